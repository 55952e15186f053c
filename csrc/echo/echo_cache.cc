// The echo cache's public operations: put/reserve/commit, take, stream control, waiting for
// room, the sink's quota and layouts, and statistics (algorithm: echo_cache.h; internals:
// echo_impl.cc; leases and gathers: lease.cc; save/restore: echo_state.cc; registry: registry.cc).
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "echo/echo_cache_impl.h"

namespace echopipe {

using detail::Clock;
using detail::kNone;

namespace {
std::atomic<uint64_t> g_next_handle{1};

Clock::time_point deadline_after(Clock::time_point start, double timeout_s) {
  return start + std::chrono::duration_cast<Clock::duration>(
                     std::chrono::duration<double>(timeout_s < 0 ? 0.0 : std::min(timeout_s, 1e9)));
}
}  // namespace

std::shared_ptr<EchoCache> EchoCache::create(const EchoConfig& config, std::string name) {
  config.validate();
  auto* cache = new EchoCache(config, std::move(name));
  return std::shared_ptr<EchoCache>(cache, [](EchoCache* c) {
    if (c->forked()) return;  // never destroyed in a fork (see echo_cache.h, Processes)
    // acq_rel: orders every lease's last use before the delete, whichever side deletes.
    if (c->impl_->leases.fetch_or(Impl::kOrphaned, std::memory_order_acq_rel) == 0) delete c;
  });
}

void EchoCache::drop_leases(EchoCache* cache, uint64_t n) noexcept {
  const uint64_t before = cache->impl_->leases.fetch_sub(n, std::memory_order_acq_rel);
  // The last lease of an ownerless cache; a fork's copy (orphaned in the parent) is never freed.
  if (before == Impl::kOrphaned + n && !cache->forked()) delete cache;
}

EchoCache::EchoCache(const EchoConfig& config, std::string name)
    : config_(config), name_(std::move(name)) {
  handle_ = g_next_handle.fetch_add(1);
  fork_generation_ = fork_generation();
  creator_pid_ = static_cast<int64_t>(getpid());
  if (name_.empty()) name_ = "echo-" + std::to_string(handle_);
  impl_ = std::make_unique<Impl>(config_);
}

EchoCache::~EchoCache() { close(); }

void EchoCache::close() {
  // A fork's copy: its wait_mu may be held by a parent thread that does not exist here.
  if (forked()) return;
  if (impl_->closed.exchange(true, std::memory_order_seq_cst)) return;
  impl_->notify_all();
}

bool EchoCache::closed() const { return impl_->closed.load(std::memory_order_acquire); }

double EchoCache::echo_factor() const { return impl_->echo_factor.load(std::memory_order_relaxed); }

void EchoCache::set_echo_factor(double e) {
  check_process();
  if (!echo_factor_in_bounds(e)) {
    throw std::invalid_argument("set_echo_factor: echo_factor must be a finite number in [1, " +
                                std::to_string(kMaxEchoFactor) + "], got " + std::to_string(e));
  }
  impl_->echo_factor.store(e, std::memory_order_relaxed);
}

uint64_t EchoCache::top_up() {
  check_process();
  Impl& I = *impl_;
  // A publisher reads `top_ups`, publishes (its state store, then an RMW on `available`) and
  // reads `top_ups` again. RMWs on one atomic are totally ordered: if the publisher's comes
  // first, this one synchronises with it and the scan sees the unit; if this one comes first,
  // the count moved before it and the publisher sees that and tops its units up itself.
  I.top_ups.fetch_add(1, std::memory_order_seq_cst);
  I.available.fetch_add(0, std::memory_order_seq_cst);
  std::lock_guard<std::mutex> lk(I.alloc_mu);
  return I.top_up_locked();
}

MemoryKind EchoCache::memory_kind() const { return impl_->arena.kind; }
const void* EchoCache::arena_host() const { return impl_->arena.host; }
const void* EchoCache::arena_device() const { return impl_->arena.device; }

// ---- producers -------------------------------------------------------------------------------

PutStatus EchoCache::reserve(const SampleDesc& desc, PutReservation& out, double timeout_s) {
  out = PutReservation();
  std::shared_ptr<EchoCache> self = shared_from_this();  // before the slot: nothing throws after
  uint32_t slot = 0;
  const PutStatus st = reserve_slot(desc, timeout_s, &slot);
  if (st == PutStatus::kOk) {
    out.cache_ = std::move(self);
    out.slot_ = slot;
  }
  return st;
}

PutStatus EchoCache::reserve_slot(const SampleDesc& desc, double timeout_s, uint32_t* slot_out) {
  PutStatus st = PutStatus::kOk;
  reserve_slots(desc, timeout_s, slot_out, 1, &st);
  return st;
}

size_t EchoCache::reserve_slots(const SampleDesc& desc, double timeout_s, uint32_t* slot_out,
                                size_t max, PutStatus* status) {
  Impl& I = *impl_;
  size_t got = 0;
  check_process();
  desc.validate();
  const uint64_t need = desc.extent_bytes();
  if (need > I.usable_bytes) {
    uint64_t prev = I.refused_bytes.load(std::memory_order_relaxed);
    while (prev < need && !I.refused_bytes.compare_exchange_weak(prev, need)) {
    }
    throw SampleTooLargeError(need, config_.capacity_bytes);
  }
  // The clock is read only once the cache is found full (the fast path never needs it); the
  // timeout and the blocked time count from then.
  Clock::time_point start{}, deadline{};
  const bool forever = timeout_s < 0;
  bool waited = false, timed = false;
  PutStatus result = PutStatus::kOk;
  for (;;) {
    if (I.closed.load(std::memory_order_acquire)) {
      result = PutStatus::kClosed;
      break;
    }
    uint32_t gen = 0;
    {
      std::lock_guard<std::mutex> lk(I.alloc_mu);
      if (I.input_ended_locked) {
        result = PutStatus::kEnded;
        break;
      }
      gen = I.space_gen.load(std::memory_order_seq_cst);
      I.collect_retired_locked();
      I.lower_high_water_locked();
      while (got < max && I.alloc_slot_locked(desc, need, slot_out + got)) ++got;
      if (got > 0) {
        I.pending.fetch_add(static_cast<int64_t>(got), std::memory_order_seq_cst);
        break;
      }
    }
    // Full. In batch mode an open batch that cannot complete would hold space forever.
    if (config_.mode == EchoMode::kBatch && I.available.load() == 0) {
      std::lock_guard<std::mutex> lk(I.assembly_mu);
      if (I.open_unit != kNone) {
        I.flush_open_locked();
        continue;
      }
    }
    if (!timed) {
      timed = true;
      start = Clock::now();
      deadline = deadline_after(start, timeout_s);
    }
    if (!forever && Clock::now() >= deadline) {
      result = PutStatus::kTimeout;
      break;
    }
    if (!waited) {
      waited = true;
      I.puts_blocked.fetch_add(1, std::memory_order_relaxed);
    }
    I.wait_for_space(gen, forever, deadline);
  }
  if (waited) {
    I.put_blocked_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count(),
        std::memory_order_relaxed);
  }
  *status = result;
  return got;
}

PutStatus EchoCache::commit(PutReservation& r) {
  if (!r.valid()) throw std::invalid_argument("commit() of an invalid (empty) reservation");
  if (r.cache_.get() != this) throw std::invalid_argument("reservation belongs to another cache");
  check_process();
  // The reservation's reference may be the cache's last owner: it stays until the commit is done.
  const std::shared_ptr<EchoCache> owner = std::move(r.cache_);
  return commit_slot(r.slot_);
}

PutStatus EchoCache::commit_slot(uint32_t s) {
  Impl& I = *impl_;
  if (I.closed.load(std::memory_order_acquire)) {
    {
      std::lock_guard<std::mutex> lk(I.alloc_mu);
      I.free_slot_locked(s);
    }
    if (I.pending.fetch_sub(1, std::memory_order_seq_cst) == 1) I.try_seal();
    I.notify_space();
    return PutStatus::kClosed;
  }
  Impl::Slot& sl = I.slots[s];
  if (config_.mode == EchoMode::kExample) {
    const uint64_t id = I.next_sample_id.fetch_add(1, std::memory_order_relaxed);
    sl.sample_id = id;
    sl.unit = s;
    sl.index_in_unit = 0;
    sl.next = kNone;
    I.fresh_in.fetch_add(1, std::memory_order_relaxed);
    I.publish(s, 1, id);
  } else {
    std::lock_guard<std::mutex> lk(I.assembly_mu);
    const uint64_t id = I.next_sample_id.fetch_add(1, std::memory_order_relaxed);
    sl.sample_id = id;
    sl.next = kNone;
    if (I.open_unit == kNone) {
      I.open_unit = I.open_tail = s;
      I.open_count = 0;
    } else {
      I.slots[I.open_tail].next = s;
      I.open_tail = s;
    }
    sl.unit = I.open_unit;
    sl.index_in_unit = I.open_count++;
    I.fresh_in.fetch_add(1, std::memory_order_relaxed);
    if (I.open_count == I.unit_samples) I.flush_open_locked();
  }
  if (I.pending.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
      I.input_ended.load(std::memory_order_seq_cst)) {
    I.try_seal();
  }
  return PutStatus::kOk;
}

void EchoCache::commit_slots_example(const uint32_t* chunk, size_t n) {
  Impl& I = *impl_;
  const uint64_t ups = I.top_ups.load(std::memory_order_acquire);  // as in publish()
  const uint64_t first_id = I.next_sample_id.fetch_add(n, std::memory_order_relaxed);
  // As in publish(), but each counter that consumers share changes once per chunk: the samples
  // are counted before any becomes drawable, the tickets after all are.
  I.live_samples.fetch_add(static_cast<int64_t>(n), std::memory_order_seq_cst);
  int64_t tickets = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint32_t s = chunk[j];
    Impl::Slot& sl = I.slots[s];
    sl.sample_id = first_id + j;
    sl.unit = s;
    sl.index_in_unit = 0;
    sl.next = kNone;
    const uint32_t t = I.make_drawable(s, 1, sl.sample_id);
    tickets += t;
  }
  I.fresh_in.fetch_add(n, std::memory_order_relaxed);
  I.available.fetch_add(tickets, std::memory_order_seq_cst);
  I.top_up_published(ups, chunk, n);
  I.notify_data_published();
  if (I.pending.fetch_sub(static_cast<int64_t>(n), std::memory_order_seq_cst) ==
          static_cast<int64_t>(n) &&
      I.input_ended.load(std::memory_order_seq_cst)) {
    I.try_seal();
  }
}

void EchoCache::abort(PutReservation& r) {
  if (!r.valid()) return;
  if (r.cache_.get() != this) throw std::invalid_argument("reservation belongs to another cache");
  // The reservation's reference may be the cache's last owner: it stays until the abort is done.
  const std::shared_ptr<EchoCache> owner = std::move(r.cache_);
  if (forked()) return;  // (a destructor's call) the copy's alloc_mu may be held by the parent
  unreserve(&r.slot_, 1);
}

void EchoCache::unreserve(const uint32_t* slots, size_t n) {
  Impl& I = *impl_;
  {
    std::lock_guard<std::mutex> lk(I.alloc_mu);
    for (size_t j = 0; j < n; ++j) I.free_slot_locked(slots[j]);
  }
  if (I.pending.fetch_sub(static_cast<int64_t>(n), std::memory_order_seq_cst) ==
          static_cast<int64_t>(n) &&
      I.input_ended.load(std::memory_order_seq_cst)) {
    I.try_seal();
  }
  I.notify_space();
}

PutStatus EchoCache::put(const SampleDesc& desc, const void* const* field_data, double timeout_s) {
  uint32_t s = 0;
  const PutStatus st = reserve_slot(desc, timeout_s, &s);
  if (st != PutStatus::kOk) return st;
  // The slot is ours until commit_slot (nothing else reads or frees a pending slot).
  auto* base = static_cast<uint8_t*>(impl_->arena.host) + impl_->slots[s].offset;
  try {
    for (int f = 0; f < desc.num_fields; ++f) {
      const size_t nb = desc.fields[f].nbytes();
      detail::arena_copy(impl_->arena.kind, base + desc.field_offset(f), field_data[f], nb);
    }
  } catch (...) {  // a device arena's copy failed: the slot goes back, or it stays pending
    unreserve(&s, 1);
    throw;
  }
  return commit_slot(s);
}

PutStatus EchoCache::put_rows(const SampleDesc& desc, const void* const* field_data, size_t rows,
                              double timeout_s, size_t* done) {
  constexpr size_t kChunk = 64;
  uint32_t chunk[kChunk];
  *done = 0;
  while (*done < rows) {
    PutStatus st = PutStatus::kOk;
    const size_t got = reserve_slots(desc, timeout_s, chunk, std::min(kChunk, rows - *done), &st);
    if (got == 0) return st;
    // The slots are ours until committed (nothing else reads or frees a pending slot).
    try {
      for (size_t j = 0; j < got; ++j) {
        auto* base = static_cast<uint8_t*>(impl_->arena.host) + impl_->slots[chunk[j]].offset;
        for (int f = 0; f < desc.num_fields; ++f) {
          const size_t nb = desc.fields[f].nbytes();
          const auto* src = static_cast<const uint8_t*>(field_data[f]) + (*done + j) * nb;
          detail::arena_copy(impl_->arena.kind, base + desc.field_offset(f), src, nb);
        }
      }
    } catch (...) {  // as in put(): the chunk's slots go back; *done counts the rows stored
      unreserve(chunk, got);
      throw;
    }
    if (config_.mode == EchoMode::kExample && !impl_->closed.load(std::memory_order_acquire)) {
      commit_slots_example(chunk, got);
      *done += got;
      continue;
    }
    PutStatus result = PutStatus::kOk;
    size_t stored = 0;
    for (size_t j = 0; j < got; ++j) {  // every slot is committed (or freed when closed)
      const PutStatus c = commit_slot(chunk[j]);
      if (c == PutStatus::kOk) {
        ++stored;
      } else {
        result = c;
      }
    }
    *done += stored;
    if (result != PutStatus::kOk) return result;
  }
  return PutStatus::kOk;
}

PutStatus EchoCache::wait_for_room(size_t n, double timeout_s) {
  Impl& I = *impl_;
  check_process();
  if (n > config_.capacity_samples) {
    throw std::invalid_argument(
        "wait_for_room(n=" + std::to_string(n) +
        ") can never succeed: capacity_samples=" + std::to_string(config_.capacity_samples));
  }
  const bool forever = timeout_s < 0;
  const Clock::time_point deadline = deadline_after(Clock::now(), timeout_s);
  for (;;) {
    if (I.closed.load(std::memory_order_acquire)) return PutStatus::kClosed;
    uint32_t gen = 0;
    {
      std::lock_guard<std::mutex> lk(I.alloc_mu);
      if (I.input_ended_locked) return PutStatus::kEnded;
      gen = I.space_gen.load(std::memory_order_seq_cst);
      I.collect_retired_locked();
      if (I.free_slots.size() >= n) return PutStatus::kOk;
    }
    if (config_.mode == EchoMode::kBatch && I.available.load() == 0) {
      std::lock_guard<std::mutex> lk(I.assembly_mu);
      if (I.open_unit != kNone) {
        I.flush_open_locked();
        continue;
      }
    }
    if (!forever && Clock::now() >= deadline) return PutStatus::kTimeout;
    I.wait_for_space(gen, forever, deadline);
  }
}

// ---- consumers -------------------------------------------------------------------------------

TakeStatus EchoCache::take(size_t n, std::vector<SampleLease>& out, double timeout_s) {
  Impl& I = *impl_;
  check_process();
  if (n == 0) throw std::invalid_argument("take(n) needs n >= 1, got n=0");
  int64_t want = static_cast<int64_t>(n);
  if (config_.mode == EchoMode::kBatch) {
    if (n % config_.batch_size != 0) {
      throw std::invalid_argument("batch mode: take(n) needs n to be a multiple of batch_size=" +
                                  std::to_string(config_.batch_size) +
                                  ", got n=" + std::to_string(n));
    }
    want = static_cast<int64_t>(n / config_.batch_size);
  }
  // Everything that can throw comes before tickets are claimed; after the claim nothing can
  // fail, so a claimed ticket is never lost (on a throw, `out` and the cache are unchanged).
  out.reserve(out.size() + n);

  const auto start = Clock::now();
  const bool forever = timeout_s < 0;
  const auto deadline = deadline_after(start, timeout_s);
  const int64_t min_fill = static_cast<int64_t>(config_.min_fill);
  bool waited = false;
  int64_t got = 0;
  TakeStatus result = TakeStatus::kOk;

  // The number of tickets that may be claimed now (0 = wait), or -1 for "end".
  auto claimable = [&](int64_t avail, bool sealed) -> int64_t {
    if (sealed && avail == 0) return -1;
    if (avail <= 0) return 0;
    const bool full = I.put_waiters.load(std::memory_order_seq_cst) > 0;
    const bool gate = sealed || full || I.input_ended.load(std::memory_order_seq_cst) ||
                      I.live_samples.load(std::memory_order_seq_cst) >= min_fill;
    if (!gate) return 0;
    if (avail >= want) return want;
    return (sealed || full) ? avail : 0;
  };

  for (;;) {
    if (I.closed.load(std::memory_order_acquire)) {
      result = TakeStatus::kClosed;
      break;
    }
    // sealed is read before available: once sealed, available can only go down.
    const bool sealed = I.sealed.load(std::memory_order_seq_cst);
    int64_t avail = I.available.load(std::memory_order_seq_cst);
    const int64_t c = claimable(avail, sealed);
    if (c < 0) {
      result = TakeStatus::kEnd;
      break;
    }
    if (c > 0) {
      // All or nothing: the claim guarantees c draws will each find a ticket in the index.
      if (I.available.compare_exchange_weak(avail, avail - c, std::memory_order_seq_cst)) {
        got = c;
        break;
      }
      continue;
    }
    if (!forever && Clock::now() >= deadline) {
      result = TakeStatus::kTimeout;
      break;
    }
    if (!waited) {
      waited = true;
      I.takes_waited.fetch_add(1, std::memory_order_relaxed);
    }
    std::unique_lock<std::mutex> lk(I.wait_mu);
    I.take_waiters.fetch_add(1, std::memory_order_seq_cst);
    for (int64_t h = I.want_hint.load(); h > want && !I.want_hint.compare_exchange_weak(h, want);) {
    }
    for (;;) {
      if (I.closed.load(std::memory_order_seq_cst)) break;
      const bool s2 = I.sealed.load(std::memory_order_seq_cst);
      if (claimable(I.available.load(std::memory_order_seq_cst), s2) != 0) break;
      const auto now = Clock::now();
      if (!forever && now >= deadline) break;
      auto until = now + detail::kPoll;
      if (!forever && deadline < until) until = deadline;
      I.data_cv.wait_until(lk, until);
    }
    if (I.take_waiters.fetch_sub(1, std::memory_order_seq_cst) == 1) {
      I.want_hint.store(std::numeric_limits<int64_t>::max(), std::memory_order_seq_cst);
    }
  }
  if (waited) {
    I.take_wait_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count(),
        std::memory_order_relaxed);
  }
  if (got == 0) return result;

  const uint64_t rng_base = I.draw_counter.fetch_add(static_cast<uint64_t>(got));
  const uint64_t pos_base = I.emit_pos.fetch_add(static_cast<uint64_t>(got));
  uint64_t samples = 0;
  Impl::ReuseTally tally;
  // The leases' references are counted before any of them exists: at most n samples. Relaxed:
  // the caller holds an owner reference, so the cache cannot be orphaned meanwhile.
  I.leases.fetch_add(n, std::memory_order_relaxed);
  const uint64_t rng_seed = I.seed * 0x2545F4914F6CDD1Dull + rng_base;
  // Draws probe random units of a state/info/slot table larger than the caches: the next draw's
  // first probe (draw_one's first position, from the same random word) is fetched while this
  // draw runs. Only a hint: a stale high-water mark or a rejected probe costs one useless fetch.
  const uint32_t hint_limit = std::max<uint32_t>(I.high_water.load(std::memory_order_relaxed), 1);
  uint64_t next_rnd = detail::splitmix64(rng_seed);
  for (int64_t i = 0; i < got; ++i) {
    const uint64_t rnd = next_rnd;
    if (i + 1 < got) {
      next_rnd = detail::splitmix64(rng_seed + static_cast<uint64_t>(i) + 1);
      I.prefetch_unit(detail::bounded(static_cast<uint32_t>(next_rnd >> 32), hint_limit));
    }
    uint32_t emission = 0;
    const uint32_t u = I.draw_one(rnd, pos_base + static_cast<uint64_t>(i), &emission, &tally);
    for (uint32_t s = u; s != kNone; s = I.slots[s].next) {
      SampleLease lease;
      lease.cache_ = this;
      lease.slot_ = s;
      lease.unit_ = u;
      lease.emission_ = emission;
      lease.index_in_unit_ = I.slots[s].index_in_unit;
      out.push_back(std::move(lease));  // within the reserved capacity: cannot throw
      ++samples;
    }
  }
  if (tally.pairs > 0) {
    auto& stripe = I.reuse[pos_base % Impl::kStripes];
    stripe.sum.fetch_add(tally.sum, std::memory_order_relaxed);
    stripe.pairs.fetch_add(tally.pairs, std::memory_order_relaxed);
  }
  I.emitted.fetch_add(samples, std::memory_order_relaxed);
  if (samples < n) I.leases.fetch_sub(n - samples, std::memory_order_relaxed);  // short batch
  return TakeStatus::kOk;
}

void EchoCache::release_reader(uint32_t unit) {
  Impl& I = *impl_;
  if (I.drop_reader(unit)) {
    int64_t k = 0, bytes = 0;
    I.unit_size(unit, &k, &bytes);
    I.info[unit].retire_next = kNone;
    I.push_retired(unit, unit, k, bytes);
  }
}

uint64_t EchoCache::refused_sample_bytes() const {
  return impl_->refused_bytes.load(std::memory_order_relaxed);
}

// ---- stream control --------------------------------------------------------------------------

void EchoCache::end_of_input() {
  Impl& I = *impl_;
  check_process();
  {
    std::lock_guard<std::mutex> lk(I.alloc_mu);
    I.input_ended_locked = true;
    I.input_ended.store(true, std::memory_order_seq_cst);
  }
  if (I.pending.load(std::memory_order_seq_cst) == 0) I.try_seal();
  I.notify_all();
}

void EchoCache::reset_input() {
  Impl& I = *impl_;
  check_process();
  std::lock_guard<std::mutex> alk(I.assembly_mu);
  std::lock_guard<std::mutex> lk(I.alloc_mu);
  I.input_ended_locked = false;
  I.input_ended.store(false, std::memory_order_seq_cst);
  I.sealed.store(false, std::memory_order_seq_cst);
  // A new stream is a new epoch: its units start a new block of epoch_size.
  I.epoch_base.store(I.next_sample_id.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

// ---- the sink's side state -------------------------------------------------------------------

void EchoCache::set_quota(int64_t remaining) {
  check_process();
  impl_->quota.store(remaining < 0 ? -1 : remaining, std::memory_order_relaxed);
}

int64_t EchoCache::quota() const { return impl_->quota.load(std::memory_order_relaxed); }

bool EchoCache::take_quota() {
  check_process();
  int64_t q = impl_->quota.load(std::memory_order_relaxed);
  for (;;) {
    if (q < 0) return true;
    if (q == 0) return false;
    if (impl_->quota.compare_exchange_weak(q, q - 1, std::memory_order_relaxed)) return true;
  }
}

void EchoCache::set_layouts(std::vector<std::string> layouts) {
  if (layouts.size() > static_cast<size_t>(kMaxFields)) {
    throw std::invalid_argument("set_layouts: a sample has at most " + std::to_string(kMaxFields) +
                                " fields, got " + std::to_string(layouts.size()) + " layouts");
  }
  check_process();
  std::lock_guard<std::mutex> lk(impl_->side_mu);
  impl_->layouts = std::move(layouts);
}

void EchoCache::record_layout(int field, std::string_view layout) {
  if (field < 0 || field >= kMaxFields) {
    throw std::invalid_argument("record_layout: field " + std::to_string(field) +
                                " is out of range [0, " + std::to_string(kMaxFields) + ")");
  }
  check_process();
  std::lock_guard<std::mutex> lk(impl_->side_mu);
  auto& l = impl_->layouts;
  if (static_cast<int>(l.size()) <= field) l.resize(field + 1);
  if (l[field] != layout) l[field].assign(layout);
}

std::vector<std::string> EchoCache::layouts() const {
  check_process();
  std::lock_guard<std::mutex> lk(impl_->side_mu);
  return impl_->layouts;
}

// ---- statistics ------------------------------------------------------------------------------

EchoStats EchoCache::stats() const {
  Impl& I = *impl_;
  check_process();
  EchoStats st;
  {
    std::lock_guard<std::mutex> lk(I.alloc_mu);
    I.collect_retired_locked();  // so that resident/bytes_used/retired count released leases
    st.emit_histogram = I.histogram;
    st.retired = I.retired;
    st.resident = I.resident.load();
    st.probe_slots = I.high_water.load();
    st.bytes_used = I.bytes_used.load();
  }
  st.fresh_in = I.fresh_in.load();
  st.emitted = I.emitted.load();
  st.resident_with_tickets = static_cast<uint64_t>(std::max<int64_t>(0, I.live_samples.load()));
  st.tickets_left = static_cast<uint64_t>(std::max<int64_t>(0, I.available.load()));
  st.capacity_bytes = config_.capacity_bytes;
  st.capacity_samples = config_.capacity_samples;
  while (st.emit_histogram.size() > 1 && st.emit_histogram.back() == 0) {
    st.emit_histogram.pop_back();
  }
  uint64_t sum = 0, pairs = 0;
  for (const auto& r : I.reuse) {
    sum += r.sum.load(std::memory_order_relaxed);
    pairs += r.pairs.load(std::memory_order_relaxed);
  }
  st.reuse_pairs = pairs;
  st.mean_reuse_distance =
      pairs ? static_cast<double>(sum) / static_cast<double>(pairs) * I.unit_samples : 0.0;
  st.memory_kind = I.arena.kind;
  st.puts_blocked = I.puts_blocked.load();
  st.producers_waiting = static_cast<uint64_t>(std::max(0, I.put_waiters.load()));
  st.put_blocked_seconds = static_cast<double>(I.put_blocked_ns.load()) * 1e-9;
  st.takes_waited = I.takes_waited.load();
  st.take_wait_seconds = static_cast<double>(I.take_wait_ns.load()) * 1e-9;
  st.closed = I.closed.load();
  st.input_ended = I.input_ended.load();
  return st;
}

}  // namespace echopipe
