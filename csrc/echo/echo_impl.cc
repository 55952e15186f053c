// Internals of the echo cache: the extent allocator, publication of units, the lock-free draw and
// retire paths, and the wait/notify protocol (algorithm: echo_cache.h).
#include <climits>
#include <cmath>
#include <thread>

#include "echo/echo_cache_impl.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace echopipe::detail {

// ---- futex on a 32-bit atomic ----------------------------------------------------------------
// C++20's std::atomic<T>::wait has no timeout, and a blocked put must honour its own and the
// 100 ms poll; so producers sleep on the word with the futex that std::atomic::wait is built on,
// which takes one. The kernel compares the word with `expected` and sleeps atomically, so a bump
// made before the sleep begins is never missed, and a waker needs no mutex.
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
              std::atomic<uint32_t>::is_always_lock_free);

namespace {

void wait_on_word(std::atomic<uint32_t>& word, uint32_t expected, Clock::time_point until) {
  const auto left = until - Clock::now();
  if (left <= Clock::duration::zero()) return;
#if defined(__linux__)
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(ns / 1000000000);
  ts.tv_nsec = static_cast<long>(ns % 1000000000);
  // Returns on a wake, a timeout, a signal, or at once when the word no longer holds `expected`:
  // the caller re-checks its condition in every case.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr,
          0);
#else
  // No futex: a short sleep, so a wakeup is late by at most 1 ms (never missed: callers loop).
  (void)word;
  (void)expected;
  std::this_thread::sleep_for(std::min<Clock::duration>(left, std::chrono::milliseconds(1)));
#endif
}

void wake_all_on_word(std::atomic<uint32_t>& word) noexcept {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}

}  // namespace

// ---- extent allocator ------------------------------------------------------------------------

ExtentAllocator::ExtentAllocator(uint64_t usable_bytes, size_t capacity_samples)
    : usable_(usable_bytes), capacity_samples_(capacity_samples) {
  by_offset_.emplace(0, usable_bytes);
  by_size_.emplace(usable_bytes, 0);
}

ExtentAllocator::SizeClass* ExtentAllocator::size_class(uint64_t size, bool create) {
  if (size == 0) return nullptr;  // empty samples take the tree path
  for (int i = 0; i < num_classes_; ++i) {
    if (classes_[i].size == size) return &classes_[i];
  }
  if (!create || num_classes_ == kSizeClasses) return nullptr;
  SizeClass& c = classes_[num_classes_++];
  c.size = size;
  c.offsets.reserve(std::min<size_t>(capacity_samples_, usable_ / size + 1));
  return &c;
}

bool ExtentAllocator::alloc(uint64_t size, uint64_t* offset) {
  if (SizeClass* c = size_class(size, false); c != nullptr && !c->offsets.empty()) {
    *offset = c->offsets.back();
    c->offsets.pop_back();
    --parked_;
    return true;
  }
  if (alloc_from_tree(size, offset)) return true;
  if (parked_ == 0) return false;
  for (int i = 0; i < num_classes_; ++i) {
    for (uint64_t off : classes_[i].offsets) coalesce_into_tree(off, classes_[i].size);
    classes_[i].offsets.clear();
  }
  parked_ = 0;
  return alloc_from_tree(size, offset);
}

bool ExtentAllocator::alloc_from_tree(uint64_t size, uint64_t* offset) {
  auto it = by_size_.lower_bound({size, 0});
  if (it == by_size_.end()) return false;
  const uint64_t sz = it->first, off = it->second;
  by_size_.erase(it);
  by_offset_.erase(off);
  if (sz > size) {
    by_offset_.emplace(off + size, sz - size);
    by_size_.emplace(sz - size, off + size);
  }
  *offset = off;
  return true;
}

void ExtentAllocator::free(uint64_t offset, uint64_t size) {
  if (SizeClass* c = size_class(size, true); c != nullptr) {
    // Capacity was reserved for every extent of this size that fits, so this never allocates.
    c->offsets.push_back(offset);
    ++parked_;
    return;
  }
  coalesce_into_tree(offset, size);
}

void ExtentAllocator::coalesce_into_tree(uint64_t off, uint64_t size) {
  auto next = by_offset_.find(off + size);
  if (next != by_offset_.end()) {
    size += next->second;
    by_size_.erase({next->second, next->first});
    by_offset_.erase(next);
  }
  auto it = by_offset_.lower_bound(off);
  if (it != by_offset_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == off) {
      off = prev->first;
      size += prev->second;
      by_size_.erase({prev->second, prev->first});
      by_offset_.erase(prev);
    }
  }
  by_offset_.emplace(off, size);
  by_size_.emplace(size, off);
}

// ---- the cache internals ---------------------------------------------------------------------

namespace {
// Retired samples that wake a blocked producer: 1/16 of the cache, but in a small cache at least
// one put chunk (64 rows, at most a quarter of the cache), so that a woken producer finds room
// for a whole chunk rather than waking again after a few rows (each wake is a syscall and a
// context switch on both sides).
size_t wake_slots_for(size_t capacity) {
  return std::max<size_t>({1, capacity / 16, std::min<size_t>(64, capacity / 4)});
}

uint32_t unit_samples_of(const EchoConfig& c) {
  return c.mode == EchoMode::kBatch ? static_cast<uint32_t>(c.batch_size) : 1;
}
}  // namespace

CacheImpl::CacheImpl(const EchoConfig& c)
    : cfg(c),
      capacity(static_cast<uint32_t>(c.capacity_samples)),
      unit_samples(unit_samples_of(c)),
      usable_bytes(c.capacity_bytes / kFieldAlignment * kFieldAlignment),
      // In batch mode only first members are units (at most 1 slot in batch_size holds one), so
      // a draw probes proportionally more before it falls back to a scan.
      probe_limit(static_cast<uint32_t>(
          std::min<uint64_t>(uint64_t{32} * unit_samples_of(c), uint64_t{4} * c.capacity_samples))),
      arena(arena_allocate(round_up(c.capacity_bytes, 4096), c.memory)),
      slots(c.capacity_samples),
      state(new std::atomic<uint64_t>[c.capacity_samples]),
      info(new UnitInfo[c.capacity_samples]),
      free_slots(static_cast<uint32_t>(c.capacity_samples), true),
      extents(usable_bytes, c.capacity_samples),
      wake_slots(static_cast<int64_t>(wake_slots_for(c.capacity_samples))),
      wake_bytes(static_cast<int64_t>(static_cast<double>(usable_bytes) *
                                      static_cast<double>(wake_slots_for(c.capacity_samples)) /
                                      static_cast<double>(c.capacity_samples))) {
  for (uint32_t i = 0; i < capacity; ++i) state[i].store(0, std::memory_order_relaxed);
  echo_factor.store(cfg.echo_factor, std::memory_order_relaxed);
  seed = cfg.seed;
}

uint32_t CacheImpl::tickets_for(uint64_t sample_id) const {
  const double e = echo_factor.load(std::memory_order_relaxed);
  const auto floor_tickets = static_cast<uint32_t>(std::floor(e));
  const double frac_tickets = e - floor_tickets;
  if (frac_tickets <= 0.0) return floor_tickets;
  if (cfg.epoch_size > 0) {
    // Exactly round(frac * N) units of each block of N get the extra ticket: those whose
    // position, permuted by a key of (seed, block), falls below that count.
    const uint64_t base = epoch_base.load(std::memory_order_relaxed);
    const uint64_t unit = (sample_id - base) / unit_samples;
    const uint64_t n = cfg.epoch_size;
    const uint64_t block = unit / n;
    const auto extra =
        static_cast<uint64_t>(std::floor(frac_tickets * static_cast<double>(n) + 0.5));
    const uint64_t key = splitmix64(seed ^ splitmix64(base ^ (block * 0x9E3779B97F4A7C15ull)));
    return floor_tickets + (permute_below(unit % n, n, key) < extra ? 1 : 0);
  }
  const uint64_t r = splitmix64(seed ^ splitmix64(sample_id + 0x51ed270b27ull));
  const double u = static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);
  return floor_tickets + (u < frac_tickets ? 1 : 0);
}

bool CacheImpl::alloc_slot_locked(const SampleDesc& desc, uint64_t need, uint32_t* slot) {
  uint64_t off = 0;
  if (free_slots.empty() || !extents.alloc(need, &off)) return false;
  const uint32_t s = free_slots.pop_lowest();
  // release: a drawer that acquires a unit's tickets (published after this) sees the new mark.
  if (s >= high_water.load(std::memory_order_relaxed)) {
    high_water.store(s + 1, std::memory_order_release);
  }
  Slot& sl = slots[s];
  sl.desc = desc;
  sl.offset = off;
  sl.extent = need;
  sl.next = kNone;
  sl.unit = kNone;
  sl.index_in_unit = 0;
  resident.fetch_add(1, std::memory_order_relaxed);
  bytes_used.fetch_add(need, std::memory_order_relaxed);
  *slot = s;
  return true;
}

void CacheImpl::free_slot_locked(uint32_t s) {
  Slot& sl = slots[s];
  extents.free(sl.offset, sl.extent);
  bytes_used.fetch_sub(sl.extent, std::memory_order_relaxed);
  resident.fetch_sub(1, std::memory_order_relaxed);
  sl.next = kNone;
  sl.unit = kNone;
  free_slots.insert(s);
}

void CacheImpl::collect_retired_locked() {
  if (retired_head.load(std::memory_order_relaxed) == kNone) return;
  // acquire: the stack's pushes form one release sequence, so every pushed link (retire_next)
  // and everything its pusher saw (the whole life of the unit) is visible here.
  uint32_t u = retired_head.exchange(kNone, std::memory_order_acquire);
  int64_t samples = 0, bytes = 0;
  while (u != kNone) {
    const uint32_t next_unit = info[u].retire_next;
    const uint32_t t = info[u].tickets_total.load(std::memory_order_relaxed);
    uint64_t k = 0;
    for (uint32_t s = u; s != kNone;) {
      const uint32_t next = slots[s].next;
      bytes += static_cast<int64_t>(slots[s].extent);
      free_slot_locked(s);
      s = next;
      ++k;
    }
    histogram[std::min<size_t>(t, kMaxHist - 1)] += k;
    retired += k;
    samples += static_cast<int64_t>(k);
    u = next_unit;
  }
  retired_pending.fetch_sub(samples, std::memory_order_relaxed);
  retired_pending_bytes.fetch_sub(bytes, std::memory_order_relaxed);
}

void CacheImpl::lower_high_water_locked() noexcept {
  // Draws probe below the mark. A cache that was full once and holds few units now (an epoch
  // drained, or takes that caught up with the puts) would otherwise have them probe mostly free
  // slots and fall back to scanning thousands of them per draw: 15x slower takes at 4 KB after
  // a 1.4 GB cache was filled and drained once. Only puts lower it, after collecting retired
  // units, so the mark depends on which slots are free at a put, as the slot a put takes does,
  // and not on when stats() or save_state() collected (a deterministic stream must not).
  const uint32_t hw = high_water.load(std::memory_order_relaxed);
  if (hw == 0 || !free_slots.contains(hw - 1)) return;
  // release, as when it rises: every used slot stays below the mark, so a drawer that reads it
  // still probes every unit that holds tickets.
  high_water.store(free_slots.used_end(hw), std::memory_order_release);
}

uint32_t CacheImpl::make_drawable(uint32_t u, uint32_t members, uint64_t first_sample_id) {
  UnitInfo& U = info[u];
  const uint32_t t = tickets_for(first_sample_id);
  U.tickets_total.store(t, std::memory_order_relaxed);
  U.drawn.store(0, std::memory_order_relaxed);
  U.first_sample_id.store(first_sample_id, std::memory_order_relaxed);
  U.members.store(members, std::memory_order_relaxed);
  U.last_emit.store(kNoEmit, std::memory_order_relaxed);
  // The slot is ours (reserved): nobody else writes its state word until it is published.
  const uint64_t gen = (state[u].load(std::memory_order_relaxed) + kGenOne) & kGenMask;
  // release: a drawer that sees the tickets (acquire) sees the unit's fields and sample data.
  state[u].store((static_cast<uint64_t>(t) << kTicketShift) | gen, std::memory_order_release);
  return t;
}

void CacheImpl::publish(uint32_t u, uint32_t members, uint64_t first_sample_id) {
  // acquire: a top-up counted here set its factor before (make_drawable reads it).
  const uint64_t ups = top_ups.load(std::memory_order_acquire);
  // Counted before the unit becomes drawable, so a draw of its last ticket never sees it negative.
  live_samples.fetch_add(members, std::memory_order_seq_cst);
  const uint32_t t = make_drawable(u, members, first_sample_id);
  // Only now may takers claim the tickets: a claimed ticket always has a unit to draw it from.
  available.fetch_add(t, std::memory_order_seq_cst);
  top_up_published(ups, &u, 1);
  notify_data_published();
}

void CacheImpl::top_up_published(uint64_t ups, const uint32_t* units, size_t n) {
  // After this publisher's RMW on `available`: a top-up whose own RMW came later sees the units
  // in its scan; one whose RMW came earlier has its count visible here.
  if (top_ups.load(std::memory_order_relaxed) == ups) return;
  uint64_t added = 0;
  {
    std::lock_guard<std::mutex> lk(alloc_mu);
    for (size_t i = 0; i < n; ++i) added += top_up_unit_locked(units[i]);
  }
  if (added > 0) notify_data_published();
}

void CacheImpl::flush_open_locked() {
  if (open_unit == kNone) return;
  const uint32_t u = open_unit;
  const uint32_t k = open_count;
  open_unit = open_tail = kNone;
  open_count = 0;
  publish(u, k, slots[u].sample_id);
}

uint64_t CacheImpl::top_up_locked() {
  uint64_t added = 0;
  const uint32_t limit = high_water.load(std::memory_order_relaxed);
  for (uint32_t u = 0; u < limit; ++u) added += top_up_unit_locked(u);
  if (added > 0) notify_data_published();
  return added;
}

uint32_t CacheImpl::top_up_unit_locked(uint32_t u) {
  // acquire: pairs with the publication's release store, as a draw's load does.
  uint64_t s = state[u].load(std::memory_order_acquire);
  if ((s & kLiveMask) == 0) return 0;  // free, reserved, retired, or a batch unit's member
  UnitInfo& U = info[u];
  const uint32_t given = U.tickets_total.load(std::memory_order_relaxed);
  const uint32_t want =
      std::min(tickets_for(U.first_sample_id.load(std::memory_order_relaxed)), kMaxTickets);
  if (want <= given) return 0;
  const uint32_t delta = want - given;
  // The total rises before the tickets do: a draw of an added ticket (its CAS acquires ours)
  // then reads the raised total, so a copy's index stays below its lease's tickets(). Raised
  // after, a copy drawn in between read the old total with an index equal to it. A unit the
  // CAS finds retired (its last reader left meanwhile) takes the raise back; alloc_mu keeps it
  // from being published again until then.
  U.tickets_total.fetch_add(delta, std::memory_order_relaxed);
  if (!add_to_live_unit(u, delta * kTicket, U.members.load(std::memory_order_relaxed))) {
    U.tickets_total.fetch_sub(delta, std::memory_order_relaxed);
    return 0;
  }
  // Only now may takers claim them, as at a publication.
  available.fetch_add(delta, std::memory_order_seq_cst);
  return delta;
}

bool CacheImpl::add_to_live_unit(uint32_t u, uint64_t change, uint32_t members) noexcept {
  // A unit whose last ticket was drawn (its readers still hold it) re-enters the index: counted
  // in live_samples before it becomes drawable, as publish() does, and uncounted again if the
  // word changed meanwhile.
  uint64_t s = state[u].load(std::memory_order_acquire);
  while ((s & kLiveMask) != 0) {
    const bool reenters = tickets_of(s) == 0;
    if (reenters) live_samples.fetch_add(members, std::memory_order_seq_cst);
    // release: a drawer of an added ticket sees everything the unit's publisher wrote (already
    // visible here through the acquire load or the caller's draw).
    if (state[u].compare_exchange_weak(s, s + change, std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
      return true;
    }
    if (reenters) live_samples.fetch_sub(members, std::memory_order_seq_cst);
  }
  return false;
}

void CacheImpl::try_seal() {
  std::lock_guard<std::mutex> lk(assembly_mu);
  if (sealed.load(std::memory_order_seq_cst)) return;
  if (!input_ended.load(std::memory_order_seq_cst)) return;
  if (pending.load(std::memory_order_seq_cst) != 0) return;
  flush_open_locked();
  sealed.store(true, std::memory_order_seq_cst);
  notify_data();
}

uint32_t CacheImpl::draw_one(uint64_t rnd, uint64_t pos, uint32_t* emission,
                             ReuseTally* reuse_tally) noexcept {
  // acquire: the mark covers every unit whose tickets this taker's claim counted (the claim
  // synchronised with their publication, which came after their slot's allocation).
  uint32_t limit = std::max<uint32_t>(high_water.load(std::memory_order_acquire), 1);
  uint32_t p = 0;
  for (uint64_t attempt = 0;; ++attempt) {
    if (attempt < probe_limit) {
      // Rejection sampling: a uniform position, accepted if its unit holds a ticket, makes the
      // accepted unit uniform among the units holding tickets.
      p = bounded(static_cast<uint32_t>(rnd >> 32), limit);
      rnd = splitmix64(rnd);
    } else if (++p >= limit) {
      // Few positions hold tickets (draining, or batch mode's sparse units): scan on from the
      // last probe, which is random, to the next unit with a ticket, wrapping around.
      p = 0;
      limit = std::max<uint32_t>(high_water.load(std::memory_order_acquire), 1);
      std::this_thread::yield();
    }
    // acquire: pairs with publish()'s release store (the unit's fields and data are visible).
    uint64_t s = state[p].load(std::memory_order_acquire);
    while (tickets_of(s) != 0) {
      const uint32_t members = info[p].members.load(std::memory_order_relaxed);
      // One ticket becomes `members` reader references. acq_rel: acquire as above; release so
      // that the last reader's acquire in drop_reader orders the retire after this draw.
      if (state[p].compare_exchange_weak(s, s - kTicket + members, std::memory_order_acq_rel,
                                         std::memory_order_acquire)) {
        const uint32_t left = tickets_of(s) - 1;
        *emission = info[p].drawn.fetch_add(1, std::memory_order_relaxed);
        if (left == 0) live_samples.fetch_sub(members, std::memory_order_seq_cst);
        const uint64_t prev = info[p].last_emit.exchange(pos, std::memory_order_relaxed);
        if (prev != kNoEmit && pos > prev) {
          reuse_tally->sum += pos - prev;
          ++reuse_tally->pairs;
        }
        return p;
      }
    }
  }
}

bool CacheImpl::drop_reader(uint32_t u) noexcept {
  // acq_rel: release orders this reader's reads of the sample before the slot's reuse; the
  // release sequence on the word makes the final decrement (acquire) see every earlier one.
  const uint64_t old = state[u].fetch_sub(1, std::memory_order_acq_rel);
  return ((old - 1) & kLiveMask) == 0;  // no ticket and no reader left: retire (exactly once)
}

void CacheImpl::return_ticket(uint32_t u, uint32_t members) noexcept {
  // The caller's `members` readers keep the unit live (so the change always applies), and only
  // draws (which take tickets) race with this, so the word's readers never drop below what is
  // subtracted. Its copy index goes to the next draw. Given back before the ticket: a draw of
  // the returned ticket then counts from below it, and drawn stays below the unit's tickets.
  info[u].drawn.fetch_sub(1, std::memory_order_relaxed);
  add_to_live_unit(u, kTicket - members, members);
}

void CacheImpl::unit_size(uint32_t u, int64_t* samples, int64_t* bytes) const noexcept {
  int64_t k = 0, b = 0;
  for (uint32_t s = u; s != kNone; s = slots[s].next) {
    ++k;
    b += static_cast<int64_t>(slots[s].extent);
  }
  *samples = k;
  *bytes = b;
}

void CacheImpl::push_retired(uint32_t first, uint32_t last, int64_t samples,
                             int64_t bytes) noexcept {
  uint32_t head = retired_head.load(std::memory_order_relaxed);
  do {
    info[last].retire_next = head;
    // seq_cst: the push and the read of put_waiters below form the Dekker pair with a producer
    // that registers as a waiter and then checks for retired units.
  } while (!retired_head.compare_exchange_weak(head, first, std::memory_order_seq_cst,
                                               std::memory_order_relaxed));
  const int64_t pend = retired_pending.fetch_add(samples, std::memory_order_relaxed) + samples;
  const int64_t pend_bytes =
      retired_pending_bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (put_waiters.load(std::memory_order_seq_cst) == 0) return;
  // Wake blocked producers once 1/16 of the cache waits for collection, or at every retire when
  // no ticket is left (then no further retire may come from takers, only from lease releases).
  if (pend >= wake_slots || pend_bytes >= wake_bytes ||
      available.load(std::memory_order_seq_cst) <= 0) {
    notify_space();
  }
}

void CacheImpl::notify_space() noexcept {
  space_gen.fetch_add(1, std::memory_order_seq_cst);
  // A producer that registered after this read sees the bumped word (seq_cst) and does not sleep;
  // one that registered before is asleep on it or about to compare it in the kernel.
  if (put_waiters.load(std::memory_order_seq_cst) > 0) wake_all_on_word(space_gen);
}

void CacheImpl::notify_data_published() noexcept {
  if (take_waiters.load(std::memory_order_seq_cst) == 0) return;
  // A blocked producer or ended input lets takers take short batches and skip min_fill.
  const bool relaxed = put_waiters.load(std::memory_order_seq_cst) > 0 ||
                       input_ended.load(std::memory_order_seq_cst);
  if (!relaxed) {
    if (available.load(std::memory_order_seq_cst) < want_hint.load(std::memory_order_seq_cst)) {
      return;
    }
    if (live_samples.load(std::memory_order_seq_cst) < static_cast<int64_t>(cfg.min_fill)) {
      return;
    }
  }
  std::lock_guard<std::mutex> lk(wait_mu);
  data_cv.notify_all();
}

void CacheImpl::notify_data() noexcept {
  if (take_waiters.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lk(wait_mu);
    data_cv.notify_all();
  }
}

void CacheImpl::notify_all() noexcept {
  space_gen.fetch_add(1, std::memory_order_seq_cst);
  wake_all_on_word(space_gen);
  std::lock_guard<std::mutex> lk(wait_mu);
  data_cv.notify_all();
}

void CacheImpl::wait_for_space(uint32_t gen, bool forever, Clock::time_point deadline) {
  put_waiters.fetch_add(1, std::memory_order_seq_cst);
  notify_data();  // consumers may now ignore min_fill and take short batches
  while (space_gen.load(std::memory_order_seq_cst) == gen &&
         retired_head.load(std::memory_order_seq_cst) == kNone &&
         !closed.load(std::memory_order_seq_cst) && !input_ended.load(std::memory_order_seq_cst)) {
    const auto now = Clock::now();
    if (!forever && now >= deadline) break;
    auto until = now + kPoll;
    if (!forever && deadline < until) until = deadline;
    wait_on_word(space_gen, gen, until);
  }
  put_waiters.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace echopipe::detail
