// Leases (read access to one emitted copy), reservations (zero-copy put), gathers and the
// batched release of leases (algorithm: echo_cache.h).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "echo/echo_cache_impl.h"

namespace echopipe {

using detail::kNone;

// ---- leases ----------------------------------------------------------------------------------

SampleLease::SampleLease(SampleLease&& o) noexcept
    : cache_(std::exchange(o.cache_, nullptr)),
      slot_(o.slot_),
      unit_(o.unit_),
      emission_(o.emission_),
      index_in_unit_(o.index_in_unit_) {}

SampleLease& SampleLease::operator=(SampleLease&& o) noexcept {
  if (this != &o) {
    release();
    cache_ = std::exchange(o.cache_, nullptr);
    slot_ = o.slot_;
    unit_ = o.unit_;
    emission_ = o.emission_;
    index_in_unit_ = o.index_in_unit_;
  }
  return *this;
}

SampleLease::~SampleLease() { release(); }

void SampleLease::release() {
  if (!cache_) return;
  EchoCache* c = std::exchange(cache_, nullptr);
  c->release_reader(unit_);
  EchoCache::drop_leases(c, 1);  // last: may delete the cache
}

const SampleDesc& SampleLease::desc() const { return cache_->impl_->slots[slot_].desc; }

void SampleLease::prefetch_record() const noexcept {
  const auto* rec = reinterpret_cast<const char*>(&cache_->impl_->slots[slot_]);
  __builtin_prefetch(rec, 0, 1);
  __builtin_prefetch(rec + 64, 0, 1);
}

namespace {
// The first lines of a sample about to be copied, into every cache level (prefetcht0). Up to
// 4 KB, so a small sample arrives whole. On an Intel Xeon host, put->take at 4 KB from a full
// 512 MB cache went from 0.37-0.38x to 0.46-0.47x memcpy with this instead of the first 1 KB
// asked for non-temporally (prefetchnta), which was slower there than no prefetch at all
// (docs/echo_cache.md). Beyond 4 KB the hardware prefetcher follows the stream.
void prefetch_lines(const void* p, size_t nbytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  const size_t n = std::min<size_t>(nbytes, 4096);
  for (size_t i = 0; i < n; i += 64) __builtin_prefetch(b + i, 0, 3);
}

void check_field(const SampleDesc& d, int field) {
  if (field < 0 || field >= d.num_fields) {
    throw std::invalid_argument("field index " + std::to_string(field) + " out of range for a " +
                                std::to_string(d.num_fields) + "-field sample");
  }
}
}  // namespace

const void* SampleLease::data(int field) const {
  const auto& I = *cache_->impl_;
  const auto& sl = I.slots[slot_];
  check_field(sl.desc, field);
  return static_cast<const uint8_t*>(I.arena.host) + sl.offset + sl.desc.field_offset(field);
}

const void* SampleLease::device_data(int field) const {
  const auto& I = *cache_->impl_;
  if (I.arena.device == nullptr) return nullptr;
  const auto& sl = I.slots[slot_];
  check_field(sl.desc, field);
  return static_cast<const uint8_t*>(I.arena.device) + sl.offset + sl.desc.field_offset(field);
}

size_t SampleLease::nbytes(int field) const {
  check_field(desc(), field);
  return desc().fields[field].nbytes();
}
uint64_t SampleLease::sample_id() const { return cache_->impl_->slots[slot_].sample_id; }
uint32_t SampleLease::tickets() const {
  return cache_->impl_->info[unit_].tickets_total.load(std::memory_order_relaxed);
}

// ---- reservations ----------------------------------------------------------------------------

PutReservation::PutReservation(PutReservation&& o) noexcept
    : cache_(std::move(o.cache_)), slot_(o.slot_) {}

PutReservation& PutReservation::operator=(PutReservation&& o) noexcept {
  if (this != &o) {
    if (cache_) cache_->abort(*this);
    cache_ = std::move(o.cache_);
    slot_ = o.slot_;
  }
  return *this;
}

PutReservation::~PutReservation() {
  if (cache_) cache_->abort(*this);
}

void* PutReservation::field_data(int field) const {
  auto& I = *cache_->impl_;
  const auto& sl = I.slots[slot_];
  check_field(sl.desc, field);
  return static_cast<uint8_t*>(I.arena.host) + sl.offset + sl.desc.field_offset(field);
}

const SampleDesc& PutReservation::desc() const { return cache_->impl_->slots[slot_].desc; }

// ---- gather and batch release ----------------------------------------------------------------

size_t gather_bytes(const std::vector<SampleLease>& leases, int field) {
  size_t total = 0;
  for (const auto& l : leases) {
    if (field < 0 || field >= l.desc().num_fields) {
      throw std::invalid_argument("gather: field index " + std::to_string(field) +
                                  " out of range for a " + std::to_string(l.desc().num_fields) +
                                  "-field sample");
    }
    total += l.nbytes(field);
  }
  return total;
}

void gather(const std::vector<SampleLease>& leases, int field, void* dst, int64_t* offsets) {
  auto* out = static_cast<uint8_t*>(dst);
  int64_t off = 0;
  if (leases.empty()) {
    if (offsets) offsets[0] = 0;
    return;
  }
  const bool host = leases[0].cache()->memory_kind() != MemoryKind::kDevice;
  // Chunks of samples, each in two passes. The slots' records lie scattered like the samples
  // themselves: asking for every record of the chunk first lets their misses overlap, where
  // resolving one sample per copy would wait for each miss in turn. The copy pass then starts
  // a sample's first lines on their way a few samples ahead (the hardware prefetcher only
  // follows within a stream).
  constexpr size_t kChunk = 32;
  constexpr size_t kAhead = 2;
  const void* src[kChunk];
  size_t nbytes[kChunk];
  MemoryKind kinds[kChunk];
  for (size_t begin = 0; begin < leases.size(); begin += kChunk) {
    const size_t n = std::min(kChunk, leases.size() - begin);
    for (size_t j = 0; j < n; ++j) leases[begin + j].prefetch_record();
    for (size_t j = 0; j < n; ++j) {
      const SampleLease& l = leases[begin + j];
      src[j] = l.data(field);  // checks the field index
      nbytes[j] = l.nbytes(field);
      kinds[j] = l.cache()->memory_kind();
    }
    if (host) {
      for (size_t j = 0; j < std::min(kAhead, n); ++j) prefetch_lines(src[j], nbytes[j]);
    }
    for (size_t j = 0; j < n; ++j) {
      if (host && j + kAhead < n) prefetch_lines(src[j + kAhead], nbytes[j + kAhead]);
      if (offsets) offsets[begin + j] = off;
      detail::arena_copy(kinds[j], out + off, src[j], nbytes[j]);
      off += static_cast<int64_t>(nbytes[j]);
    }
  }
  if (offsets) offsets[leases.size()] = off;
}

void release_leases(std::vector<SampleLease>& leases) {
  // Units whose last reader this call drops are chained and pushed onto the cache's retired
  // stack with one CAS per cache (almost always one cache), and the lease references are dropped
  // with one atomic per cache.
  EchoCache* owner = nullptr;
  uint32_t first = kNone, last = kNone;
  int64_t samples = 0, bytes = 0;
  uint64_t count = 0;
  auto flush = [&] {
    if (owner == nullptr) return;
    if (first != kNone) owner->impl_->push_retired(first, last, samples, bytes);
    EchoCache::drop_leases(owner, count);  // last: may delete the cache
    owner = nullptr;
    first = last = kNone;
    samples = bytes = 0;
    count = 0;
  };
  for (SampleLease& l : leases) {
    if (!l.cache_) continue;
    if (l.cache_ != owner) {
      flush();
      owner = l.cache_;
    }
    const uint32_t u = l.unit_;
    l.cache_ = nullptr;  // released here, so the lease's destructor does nothing
    ++count;
    auto& I = *owner->impl_;
    if (I.drop_reader(u)) {
      int64_t k = 0, b = 0;
      I.unit_size(u, &k, &b);
      I.info[u].retire_next = first;
      if (last == kNone) last = u;
      first = u;
      samples += k;
      bytes += b;
    }
  }
  flush();
  leases.clear();
}

void EchoCache::give_back(std::vector<SampleLease>& leases) noexcept {
  Impl& I = *impl_;
  if (forked()) {  // a fork's copy: no waking (wait_mu may be held by a parent thread)
    release_leases(leases);
    return;
  }
  uint64_t samples = 0;
  int64_t tickets = 0;
  for (size_t i = 0; i < leases.size();) {
    if (leases[i].cache_ != this) {
      ++i;
      continue;
    }
    // One copy of a unit is its `members` leases, consecutive (take() appends them so).
    const uint32_t u = leases[i].unit_;
    const uint32_t members = I.info[u].members.load(std::memory_order_relaxed);
    size_t j = i;
    while (j < leases.size() && j - i < members && leases[j].cache_ == this &&
           leases[j].unit_ == u) {
      ++j;
    }
    if (j - i == members) {
      I.return_ticket(u, members);
      for (size_t k = i; k < j; ++k) leases[k].cache_ = nullptr;  // its readers became the ticket
      samples += members;
      ++tickets;
    }
    i = j;
  }
  if (tickets > 0) {
    I.emitted.fetch_sub(samples, std::memory_order_relaxed);
    // Only after the tickets are back in their units: a claimed ticket always finds a unit.
    I.available.fetch_add(tickets, std::memory_order_seq_cst);
    I.notify_data_published();
  }
  release_leases(leases);                       // what was not a whole unit of this cache
  if (samples > 0) drop_leases(this, samples);  // last: may delete the cache
}

}  // namespace echopipe
