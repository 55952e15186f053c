// save_state / restore_state of the echo cache. Restore parses and checks the whole blob first,
// into private structures (including the extent placement), then copies the sample bytes into the
// empty arena (the one step that can fail after parsing: a device arena's cudaMemcpy), and only
// then commits the cache's state, with operations that cannot fail: a corrupt or mismatched blob,
// or a failed copy, leaves the cache untouched.
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "echo/echo_cache_impl.h"

namespace echopipe {

using detail::kNone;

namespace {

constexpr char kMagic[8] = {'E', 'C', 'H', 'O', 'C', 'A', 'C', '1'};
// Since version 3, units are saved with the slots they occupy and the free slots (a set, written
// in ascending order; restore accepts any order), so that a restored cache (same
// capacity_samples) puts into the same slots and draws exactly the stream the saved one would have.
constexpr uint32_t kStateVersion = 4;

struct Writer {
  std::vector<uint8_t>& buf;
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf.insert(buf.end(), p, p + sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    buf.insert(buf.end(), b, b + n);
  }
};

struct Reader {
  const uint8_t* p;
  size_t left;
  template <typename T>
  T get() {
    T v;
    need(sizeof(T));
    std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    left -= sizeof(T);
    return v;
  }
  const uint8_t* bytes(size_t n) {
    need(n);
    const uint8_t* r = p;
    p += n;
    left -= n;
    return r;
  }
  void need(size_t n) const {
    if (n > left) throw CacheStateError("echo cache state is truncated or corrupt");
  }
};

void write_desc(Writer& w, const SampleDesc& d) {
  w.put<int32_t>(d.num_fields);
  for (int f = 0; f < d.num_fields; ++f) {
    w.put<uint8_t>(static_cast<uint8_t>(d.fields[f].dtype));
    w.put<int32_t>(d.fields[f].ndim);
    for (int i = 0; i < kMaxDims; ++i) w.put<int64_t>(d.fields[f].shape[i]);
  }
}

SampleDesc read_desc(Reader& r) {
  SampleDesc d;
  d.num_fields = r.get<int32_t>();
  if (d.num_fields < 1 || d.num_fields > kMaxFields) {
    throw CacheStateError(
        "echo cache state is corrupt (num_fields=" + std::to_string(d.num_fields) + ")");
  }
  for (int f = 0; f < d.num_fields; ++f) {
    d.fields[f].dtype = static_cast<DType>(r.get<uint8_t>());
    d.fields[f].ndim = r.get<int32_t>();
    for (int i = 0; i < kMaxDims; ++i) d.fields[f].shape[i] = r.get<int64_t>();
  }
  try {
    d.validate();
  } catch (const std::invalid_argument& e) {
    throw CacheStateError(std::string("echo cache state is corrupt (") + e.what() + ")");
  }
  return d;
}

CacheStateError corrupt(const std::string& what) {
  return CacheStateError("echo cache state is corrupt (" + what + ")");
}

// A parsed unit, placed: everything the commit phase writes.
struct ParsedMember {
  uint32_t slot;
  uint64_t sample_id;
  SampleDesc desc;
  uint64_t offset;  // extent placed in the private allocator during parsing
  const uint8_t* data;
};
struct ParsedUnit {
  uint32_t left = 0, total = 0;
  uint64_t last_emit = detail::kNoEmit;
  std::vector<ParsedMember> members;
};

}  // namespace

std::vector<uint8_t> EchoCache::save_state() const {
  Impl& I = *impl_;
  check_process();
  std::vector<uint8_t> buf;
  Writer w{buf};
  // No publish, reservation or slot reuse runs while these are held (retired units are given
  // back to the allocator only under alloc_mu, so the saved sample bytes cannot be overwritten).
  // Draws are lock-free and may still run: each unit's tickets are read atomically, but the
  // snapshot is one cut of the stream only when consumers are quiet.
  std::lock_guard<std::mutex> alk(I.assembly_mu);
  std::lock_guard<std::mutex> lk(I.alloc_mu);
  I.collect_retired_locked();

  w.bytes(kMagic, sizeof(kMagic));
  w.put<uint32_t>(kStateVersion);
  w.put<double>(I.echo_factor.load(std::memory_order_relaxed));
  w.put<uint8_t>(static_cast<uint8_t>(config_.mode));
  w.put<uint64_t>(I.unit_samples);
  w.put<uint32_t>(I.capacity);
  w.put<uint64_t>(I.seed);
  w.put<uint64_t>(I.next_sample_id.load());
  w.put<uint64_t>(I.epoch_base.load());
  w.put<uint64_t>(I.draw_counter.load());
  w.put<uint64_t>(I.emit_pos.load());
  w.put<uint64_t>(I.fresh_in.load());
  w.put<uint64_t>(I.emitted.load());
  w.put<uint64_t>(I.retired);
  w.put<uint32_t>(static_cast<uint32_t>(I.histogram.size()));
  for (uint64_t h : I.histogram) w.put<uint64_t>(h);

  auto write_members = [&](uint32_t u) {
    uint32_t k = 0;
    for (uint32_t s = u; s != kNone; s = I.slots[s].next) ++k;
    w.put<uint32_t>(k);
    for (uint32_t s = u; s != kNone; s = I.slots[s].next) {
      const Impl::Slot& sl = I.slots[s];
      w.put<uint32_t>(s);
      w.put<uint64_t>(sl.sample_id);
      write_desc(w, sl.desc);
      const auto* base = static_cast<const uint8_t*>(I.arena.host) + sl.offset;
      for (int f = 0; f < sl.desc.num_fields; ++f) {
        const size_t nb = sl.desc.fields[f].nbytes();
        const size_t at = w.buf.size();
        w.buf.resize(at + nb);
        detail::arena_copy(I.arena.kind, w.buf.data() + at, base + sl.desc.field_offset(f), nb);
      }
    }
  };
  std::vector<std::pair<uint32_t, uint64_t>> units;  // (unit, state word)
  for (uint32_t u = 0; u < I.capacity; ++u) {
    const uint64_t s = I.state[u].load(std::memory_order_acquire);
    if (detail::tickets_of(s) != 0) units.emplace_back(u, s);
  }
  w.put<uint32_t>(static_cast<uint32_t>(units.size()));
  for (auto [u, s] : units) {
    // Copies already drawn keep their readers; only the tickets left are saved.
    w.put<uint32_t>(detail::tickets_of(s));
    w.put<uint32_t>(I.info[u].tickets_total.load(std::memory_order_relaxed));
    w.put<uint64_t>(I.info[u].last_emit.load(std::memory_order_relaxed));
    write_members(u);
  }
  w.put<uint8_t>(I.open_unit != kNone ? 1 : 0);
  if (I.open_unit != kNone) write_members(I.open_unit);
  w.put<uint32_t>(static_cast<uint32_t>(I.free_slots.size()));
  I.free_slots.for_each([&](uint32_t s) { w.put<uint32_t>(s); });  // ascending
  w.put<uint32_t>(I.high_water.load(std::memory_order_relaxed));   // draws probe below it
  return buf;
}

void EchoCache::restore_state(const uint8_t* data, size_t size) {
  Impl& I = *impl_;
  check_process();
  Reader r{data, size};
  if (size < sizeof(kMagic) || std::memcmp(data, kMagic, sizeof(kMagic)) != 0) {
    throw CacheStateError("not an echo cache state (bad magic)");
  }
  r.bytes(sizeof(kMagic));
  const uint32_t version = r.get<uint32_t>();
  if (version != kStateVersion) {
    throw CacheStateError("echo cache state version " + std::to_string(version) +
                          " is not supported (expected " + std::to_string(kStateVersion) +
                          "; it was saved by another echopipe release)");
  }
  const double e = r.get<double>();
  const auto mode = static_cast<EchoMode>(r.get<uint8_t>());
  const uint64_t bs = r.get<uint64_t>();
  const uint32_t capacity = r.get<uint32_t>();
  if (!echo_factor_in_bounds(e)) {
    throw corrupt("echo_factor=" + std::to_string(e));
  }
  if (mode != config_.mode) {
    throw CacheStateError(std::string("saved mode '") + echo_mode_name(mode) +
                          "' differs from this cache's '" + echo_mode_name(config_.mode) + "'");
  }
  if (bs != I.unit_samples) {
    throw CacheStateError("saved batch_size=" + std::to_string(bs) + " differs from this cache's " +
                          std::to_string(I.unit_samples));
  }
  if (capacity != I.capacity) {
    throw CacheStateError("saved capacity_samples=" + std::to_string(capacity) +
                          " differs from this cache's " + std::to_string(I.capacity));
  }
  auto check_empty = [&] {
    if (I.fresh_in.load() != 0 || I.resident.load() != 0 || I.pending.load() != 0) {
      throw CacheStateError("restore_state() needs an empty cache (this one has " +
                            std::to_string(I.fresh_in.load()) + " samples put)");
    }
  };
  check_empty();
  const uint64_t seed = r.get<uint64_t>();
  const uint64_t next_id = r.get<uint64_t>();
  const uint64_t epoch_base = r.get<uint64_t>();
  if (epoch_base > next_id) throw corrupt("epoch_base=" + std::to_string(epoch_base));
  const uint64_t draws = r.get<uint64_t>();
  const uint64_t epos = r.get<uint64_t>();
  const uint64_t fresh = r.get<uint64_t>();
  const uint64_t emitted = r.get<uint64_t>();
  const uint64_t retired = r.get<uint64_t>();
  const uint32_t nh = r.get<uint32_t>();
  if (nh > 4096) throw corrupt("histogram");
  std::vector<uint64_t> hist(nh);
  for (auto& h : hist) h = r.get<uint64_t>();

  // ---- parse and place everything privately ----
  detail::ExtentAllocator extents(I.usable_bytes, config_.capacity_samples);
  std::vector<uint8_t> used(I.capacity, 0);
  // A unit holds 1..unit_samples members; the open one (a batch still being filled) fewer than
  // unit_samples, since a full batch is closed at once (one that is not would never close, and
  // every later put would join it), and example mode has none.
  auto read_members = [&](ParsedUnit& unit, uint32_t most) {
    const uint32_t k = r.get<uint32_t>();
    if (k == 0 || k > most) throw corrupt("unit of " + std::to_string(k) + " samples");
    for (uint32_t i = 0; i < k; ++i) {
      ParsedMember m{};
      m.slot = r.get<uint32_t>();
      if (m.slot >= I.capacity || used[m.slot]) throw corrupt("slot " + std::to_string(m.slot));
      used[m.slot] = 1;
      m.sample_id = r.get<uint64_t>();
      m.desc = read_desc(r);
      const uint64_t need = m.desc.extent_bytes();
      if (!extents.alloc(need, &m.offset)) {
        throw CacheStateError(
            "saved state does not fit: capacity_bytes=" + std::to_string(config_.capacity_bytes) +
            " is too small for the saved samples");
      }
      size_t nb = 0;
      for (int f = 0; f < m.desc.num_fields; ++f) nb += m.desc.fields[f].nbytes();
      m.data = r.bytes(nb);
      unit.members.push_back(m);
    }
  };
  const uint32_t nunits = r.get<uint32_t>();
  // Checked before anything is sized by it: a corrupt count must not allocate gigabytes.
  if (nunits > I.capacity) throw corrupt(std::to_string(nunits) + " units");
  std::vector<ParsedUnit> units(nunits);
  int64_t tickets = 0, live = 0;
  for (ParsedUnit& unit : units) {
    unit.left = r.get<uint32_t>();
    unit.total = r.get<uint32_t>();
    unit.last_emit = r.get<uint64_t>();
    if (unit.left == 0 || unit.left > unit.total || unit.total > detail::kMaxTickets) {
      throw corrupt("tickets " + std::to_string(unit.left) + "/" + std::to_string(unit.total));
    }
    read_members(unit, I.unit_samples);
    tickets += unit.left;
    live += static_cast<int64_t>(unit.members.size());
  }
  ParsedUnit open;
  if (r.get<uint8_t>() != 0) read_members(open, I.unit_samples - 1);
  // The free slots are a set (a put takes the lowest): any order is accepted, each slot once.
  const uint32_t nfree = r.get<uint32_t>();
  if (nfree > I.capacity) throw corrupt(std::to_string(nfree) + " free slots");
  for (uint32_t i = 0; i < nfree; ++i) {
    const uint32_t s = r.get<uint32_t>();
    if (s >= I.capacity || used[s]) throw corrupt("free slot " + std::to_string(s));
    used[s] = 2;
  }
  // Slots that were leased when the state was saved are free here too: the saved cache frees
  // them once the leases are released, so both put into the same slots when that happened before
  // the saved cache's next put.
  detail::FreeSlotSet free_slots(I.capacity, false);
  for (uint32_t s = 0; s < I.capacity; ++s) {
    if (used[s] != 1) free_slots.insert(s);
  }
  uint32_t high_water = r.get<uint32_t>();
  for (uint32_t s = 0; s < I.capacity; ++s) {
    if (used[s] == 1 && s >= high_water) throw corrupt("high-water mark " + std::to_string(s));
  }
  if (high_water > I.capacity) throw corrupt("high-water mark " + std::to_string(high_water));
  if (r.left != 0) throw corrupt(std::to_string(r.left) + " trailing bytes");

  // ---- stage the sample bytes ----
  std::lock_guard<std::mutex> alk(I.assembly_mu);
  std::lock_guard<std::mutex> lk(I.alloc_mu);
  check_empty();  // again, under the locks: no extent is in use, and none is allocated meanwhile
  // Into the empty arena, before any of the cache's state is written: a copy that fails (a
  // device arena's cudaMemcpy) leaves only bytes that no extent owns.
  auto stage = [&](const ParsedUnit& unit) {
    for (const ParsedMember& m : unit.members) {
      auto* base = static_cast<uint8_t*>(I.arena.host) + m.offset;
      const uint8_t* src = m.data;
      for (int f = 0; f < m.desc.num_fields; ++f) {
        const size_t nb = m.desc.fields[f].nbytes();
        detail::arena_copy(I.arena.kind, base + m.desc.field_offset(f), src, nb);
        src += nb;
      }
    }
  };
  for (const ParsedUnit& unit : units) stage(unit);
  stage(open);

  // ---- commit: nothing below can fail ----
  std::swap(I.extents, extents);
  I.free_slots = std::move(free_slots);
  I.high_water.store(high_water, std::memory_order_release);
  uint64_t bytes = 0;
  auto place = [&](const ParsedUnit& unit) noexcept -> uint32_t {
    const uint32_t first = unit.members.front().slot;
    uint32_t index = 0;
    for (size_t i = 0; i < unit.members.size(); ++i) {
      const ParsedMember& m = unit.members[i];
      Impl::Slot& sl = I.slots[m.slot];
      sl.desc = m.desc;
      sl.offset = m.offset;
      sl.extent = m.desc.extent_bytes();
      sl.sample_id = m.sample_id;
      sl.unit = first;
      sl.index_in_unit = index++;
      sl.next = i + 1 < unit.members.size() ? unit.members[i + 1].slot : kNone;
      bytes += sl.extent;
    }
    return first;
  };
  for (const ParsedUnit& unit : units) {
    const uint32_t u = place(unit);
    auto& U = I.info[u];
    U.tickets_total.store(unit.total, std::memory_order_relaxed);
    U.drawn.store(unit.total - unit.left, std::memory_order_relaxed);
    U.first_sample_id.store(unit.members.front().sample_id, std::memory_order_relaxed);
    U.members.store(static_cast<uint32_t>(unit.members.size()), std::memory_order_relaxed);
    U.last_emit.store(unit.last_emit, std::memory_order_relaxed);
    const uint64_t gen =
        (I.state[u].load(std::memory_order_relaxed) + detail::kGenOne) & detail::kGenMask;
    I.state[u].store((static_cast<uint64_t>(unit.left) << detail::kTicketShift) | gen,
                     std::memory_order_release);
  }
  if (!open.members.empty()) {
    I.open_unit = place(open);
    I.open_tail = open.members.back().slot;
    I.open_count = static_cast<uint32_t>(open.members.size());
  }
  const size_t resident = open.members.size() + static_cast<size_t>(live);
  I.resident.store(resident);
  I.bytes_used.store(bytes);
  I.seed = seed;
  I.echo_factor.store(e, std::memory_order_relaxed);
  I.next_sample_id.store(next_id);
  I.epoch_base.store(epoch_base);
  I.draw_counter.store(draws);
  I.emit_pos.store(epos);
  I.fresh_in.store(fresh);
  I.emitted.store(emitted);
  I.retired = retired;
  for (size_t i = 0; i < hist.size() && i < I.histogram.size(); ++i) I.histogram[i] = hist[i];
  I.live_samples.fetch_add(live);
  I.available.fetch_add(tickets);
  I.notify_data();
}

}  // namespace echopipe
