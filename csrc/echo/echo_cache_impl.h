// Internals of the echo cache shared by its translation units (echo_cache.cc: put/take/leases,
// echo_state.cc: save/restore); not installed. The algorithm and its correctness argument are in
// echo_cache.h. Lock order, outermost first: assembly_mu (batch assembly) -> alloc_mu; wait_mu
// and side_mu are leaves. The draw path (take), the release path (leases) and give_back take no
// mutex: a release that must wake a blocked producer makes one futex wake on space_gen, and
// producers wait on that word (wait_on_word), not on wait_mu. wait_mu guards only the takers'
// condition variable; it is taken by a taker that waits and by a put, close or end of input
// that wakes waiting takers.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "echo/arena.h"
#include "echo/echo_cache.h"

namespace echopipe::detail {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
constexpr uint64_t kNoEmit = std::numeric_limits<uint64_t>::max();
constexpr size_t kMaxHist = 64;
// Upper bound on any blocking wait, so close() is seen within this even if a notify were lost.
constexpr auto kPoll = std::chrono::milliseconds(100);

// The state word of a unit: tickets (16 bits: e <= kMaxEchoFactor) | generation (16) |
// readers (32).
// The generation changes at every publish of the slot, so a draw's CAS cannot succeed against a
// later publication of the same slot that happens to have equal tickets and readers (ABA).
constexpr int kTicketShift = 48;
constexpr uint64_t kTicket = uint64_t{1} << kTicketShift;
constexpr uint64_t kGenOne = uint64_t{1} << 32;
constexpr uint64_t kGenMask = uint64_t{0xFFFF} << 32;
constexpr uint64_t kLiveMask = ~kGenMask;  // tickets and readers: 0 means the unit can retire
constexpr uint32_t kMaxTickets = kMaxEchoFactor;
static_assert(kMaxTickets <= (uint64_t{1} << (64 - kTicketShift)) - 1,
              "a unit's tickets must fit the bits above kTicketShift");

inline uint32_t tickets_of(uint64_t state) { return static_cast<uint32_t>(state >> kTicketShift); }

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform integer in [0, n) from 32 random bits (Lemire's multiply-shift; bias < n / 2^32).
inline uint32_t bounded(uint32_t r, uint32_t n) {
  return static_cast<uint32_t>((static_cast<uint64_t>(r) * n) >> 32);
}

// A pseudo-random permutation of [0, n) keyed by `key`, evaluated at x < n without a table: a
// four-round Feistel network on the smallest even number of bits covering n, walked until the
// image falls below n (a bijection of the larger domain maps each x < n to a unique x' < n).
inline uint64_t permute_below(uint64_t x, uint64_t n, uint64_t key) {
  unsigned bits = 2;
  while ((uint64_t{1} << bits) < n) bits += 2;
  const unsigned half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = splitmix64(key ^ (right + (round << 58))) & mask;
      const uint64_t next_left = right;
      right = left ^ f;
      left = next_left;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Best-fit extent allocator with coalescing, fronted by exact-size free lists (caller holds the
// cache's alloc_mu for every call).
class ExtentAllocator {
 public:
  ExtentAllocator(uint64_t usable_bytes, size_t capacity_samples);
  bool alloc(uint64_t size, uint64_t* offset);
  void free(uint64_t offset, uint64_t size);

 private:
  // An extent freed with one of the first kSizeClasses sizes seen is parked uncoalesced, and a
  // request of that size pops it in O(1) without touching (or allocating nodes of) the tree.
  // When the tree cannot serve a request, every parked extent is coalesced back and the request
  // retried, so space is found exactly when the coalescing allocator alone would find it.
  static constexpr int kSizeClasses = 8;
  struct SizeClass {
    uint64_t size = 0;
    std::vector<uint64_t> offsets;
  };
  SizeClass* size_class(uint64_t size, bool create);
  bool alloc_from_tree(uint64_t size, uint64_t* offset);
  void coalesce_into_tree(uint64_t offset, uint64_t size);

  uint64_t usable_;
  size_t capacity_samples_;
  std::map<uint64_t, uint64_t> by_offset_;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (size, offset)
  std::array<SizeClass, kSizeClasses> classes_;
  int num_classes_ = 0;
  uint64_t parked_ = 0;
};

// The free slots, as a set: a put takes the lowest free slot. So the slot a put gets depends only
// on which slots are free, not on the order in which retired units were given back: stats(),
// save_state() and wait_for_room() collect retired units at times of their own, and a
// deterministic stream (and a restored cache) must not depend on them. Lowest-first also keeps
// live units packed below the high-water mark. A bitmap with summary levels (bit w of a level is
// set when word w of the level below has any bit set), so the lowest slot is found with one
// find-first-set per level: 2 levels up to 4096 slots, 3 up to 262144, 6 at most.
class FreeSlotSet {
 public:
  // Every slot of [0, n) is free when `all_free`, none otherwise.
  FreeSlotSet(uint32_t n, bool all_free) {
    words0_ = std::max<size_t>(1, (static_cast<size_t>(n) + 63) / 64);
    size_t total = 0;
    for (size_t words = words0_;; words = (words + 63) / 64) {
      offset_[levels_++] = total;  // levels until one word summarises the level below
      total += words;
      if (words == 1) break;
    }
    bits_.assign(total, 0);
    if (!all_free) return;
    for (size_t i = 0; i < n / 64; ++i) bits_[i] = ~uint64_t{0};
    if (n % 64 != 0) bits_[n / 64] = (uint64_t{1} << (n % 64)) - 1;
    for (int l = 1; l < levels_; ++l) {
      for (size_t i = offset_[l - 1]; i < offset_[l]; ++i) {
        const size_t w = i - offset_[l - 1];
        if (bits_[i] != 0) bits_[offset_[l] + w / 64] |= uint64_t{1} << (w % 64);
      }
    }
    count_ = n;
  }
  size_t size() const noexcept { return count_; }
  bool empty() const noexcept { return count_ == 0; }
  // The lowest free slot, which is then no longer free. Requires !empty().
  uint32_t pop_lowest() noexcept {
    uint64_t w = 0;
    for (int l = levels_ - 1; l >= 0; --l) {
      w = (w << 6) | static_cast<uint64_t>(__builtin_ctzll(bits_[offset_[l] + w]));
    }
    const auto s = static_cast<uint32_t>(w);
    for (int l = 0; l < levels_; ++l, w >>= 6) {
      uint64_t& word = bits_[offset_[l] + (w >> 6)];
      word &= ~(uint64_t{1} << (w & 63));
      if (word != 0) break;  // the levels above still see a free slot below this word
    }
    --count_;
    return s;
  }
  // Frees slot s, which must not be free.
  void insert(uint32_t s) noexcept {
    uint64_t w = s;
    for (int l = 0; l < levels_; ++l, w >>= 6) {
      uint64_t& word = bits_[offset_[l] + (w >> 6)];
      const bool was_empty = word == 0;
      word |= uint64_t{1} << (w & 63);
      if (!was_empty) break;  // the levels above already see this word
    }
    ++count_;
  }
  bool contains(uint32_t s) const noexcept { return (bits_[s >> 6] >> (s & 63)) & 1; }
  // 1 + the highest slot below `end` (<= the set's size) that is not free, or 0 when all are.
  uint32_t used_end(uint32_t end) const noexcept {
    size_t w = end / 64;
    uint64_t used = w < words0_ ? ~bits_[w] & ((uint64_t{1} << (end % 64)) - 1) : 0;
    for (;;) {
      if (used != 0) return static_cast<uint32_t>(w * 64 + 64 - __builtin_clzll(used));
      if (w == 0) return 0;
      used = ~bits_[--w];
    }
  }
  // Calls f(slot) for every free slot, in ascending order.
  template <typename F>
  void for_each(F&& f) const {
    for (size_t i = 0; i < words0_; ++i) {
      for (uint64_t word = bits_[i]; word != 0; word &= word - 1) {
        f(static_cast<uint32_t>(i * 64 + static_cast<size_t>(__builtin_ctzll(word))));
      }
    }
  }

 private:
  static constexpr int kMaxLevels = 6;  // 64^6 > kMaxCapacitySamples
  std::vector<uint64_t> bits_;          // every level, level 0 (one bit per slot) first
  std::array<size_t, kMaxLevels> offset_{};
  int levels_ = 0;
  size_t words0_ = 0;
  size_t count_ = 0;
};

struct CacheImpl {
  // Slots are read at random (one per emitted copy), so what a take and a gather read sits in
  // the first two lines: the extent, then the descriptor's count and first field's shape.
  struct alignas(64) Slot {
    uint64_t offset = 0;  // extent start in the arena
    uint64_t extent = 0;  // extent bytes
    uint64_t sample_id = 0;
    uint32_t next = kNone;  // next member of the same unit (batch mode), put order
    uint32_t unit = kNone;  // first member's slot id
    uint32_t index_in_unit = 0;
    SampleDesc desc;
  };
  // A unit is identified by its first member's slot id. Its fields are written by the publisher
  // before the release store of its state word and read by drawers after an acquire load of it;
  // they are atomics (relaxed) only so that a drawer that lost a race reads them without a data
  // race while the slot is being republished.
  struct UnitInfo {
    std::atomic<uint32_t> members{0};
    // Tickets the unit was given: at its publication, raised by top_up_locked() (under
    // alloc_mu, so never while the slot is republished).
    std::atomic<uint32_t> tickets_total{0};
    // Copies drawn and not handed back: the next draw's emission index. Counted apart from
    // tickets_total, which a top-up may raise between a draw's claim and its read.
    std::atomic<uint32_t> drawn{0};
    std::atomic<uint64_t> first_sample_id{0};  // what tickets_for() is keyed by
    std::atomic<uint64_t> last_emit{kNoEmit};  // emission position of the previous copy
    uint32_t retire_next = kNone;              // link in the retired stack
  };
  // Striped reuse-distance counters: each take adds its tally to one stripe.
  struct alignas(64) ReuseStripe {
    std::atomic<uint64_t> sum{0};
    std::atomic<uint64_t> pairs{0};
  };
  static constexpr uint32_t kStripes = 16;

  // A hint for a draw about to probe unit `u`: its state word, info and first slot record.
  void prefetch_unit(uint32_t u) const noexcept {
    __builtin_prefetch(&state[u], 0, 1);
    __builtin_prefetch(&info[u], 0, 1);
    __builtin_prefetch(&slots[u], 0, 1);
  }

  explicit CacheImpl(const EchoConfig& c);

  const EchoConfig cfg;
  const uint32_t capacity;      // slots = units
  const uint32_t unit_samples;  // 1, or batch_size in batch mode
  const uint64_t usable_bytes;
  const uint32_t probe_limit;  // random probes of a draw before it scans
  Arena arena;
  std::vector<Slot> slots;
  // Dense, so that a random probe touches one 8-byte word; drawers probe it without locks.
  std::unique_ptr<std::atomic<uint64_t>[]> state;
  std::unique_ptr<UnitInfo[]> info;
  // Above every used slot: 1 + the highest slot allocated, brought down again by puts once the
  // slots at the top are free (lower_high_water_locked). A put takes the lowest free slot
  // (FreeSlotSet), so live units stay packed below this mark: draws probe [0, high_water)
  // instead of the whole capacity, which keeps the hit rate up when a large cache holds few
  // samples. Written under alloc_mu, raised before the slot's unit is published.
  std::atomic<uint32_t> high_water{0};
  std::array<ReuseStripe, kStripes> reuse;
  std::atomic<double> echo_factor{2.0};  // read once per published unit
  uint64_t seed = 0;                     // replaced by restore_state

  // Allocator (alloc_mu). The counters share the lock's cache line: taking it brings them along.
  // Top-ups begun (EchoCache::top_up). A publisher compares it before and after it publishes:
  // with the top-up's RMW on `available`, either the scan sees its units or it sees the count
  // move (see EchoCache::top_up).
  alignas(64) std::atomic<uint64_t> top_ups{0};
  alignas(64) mutable std::mutex alloc_mu;
  std::atomic<uint64_t> resident{0};
  std::atomic<uint64_t> bytes_used{0};
  // Bumped when blocked producers should re-check; they sleep on it (a futex word: 32 bits).
  std::atomic<uint32_t> space_gen{0};
  FreeSlotSet free_slots;  // the next put takes the lowest (see FreeSlotSet)
  ExtentAllocator extents;
  std::vector<uint64_t> histogram = std::vector<uint64_t>(kMaxHist, 0);
  uint64_t retired = 0;
  bool input_ended_locked = false;  // mirror of input_ended under alloc_mu

  // Retired units not yet given back to the allocator: a lock-free stack (Treiber) that any
  // releasing thread pushes onto and that the allocator, under alloc_mu, empties in one exchange
  // (so no ABA: nodes are only ever popped all at once).
  alignas(64) std::atomic<uint32_t> retired_head{kNone};
  std::atomic<int64_t> retired_pending{0};        // samples on the stack (approximate)
  std::atomic<int64_t> retired_pending_bytes{0};  // their extent bytes (approximate)

  // Batch assembly (assembly_mu).
  std::mutex assembly_mu;
  uint32_t open_unit = kNone;
  uint32_t open_tail = kNone;
  uint32_t open_count = 0;

  // Lock-free counters, grouped by who writes them, one cache line per group.
  alignas(64) std::atomic<int64_t> available{0};  // tickets in the index not yet claimed
  std::atomic<int64_t> live_samples{0};           // samples of units holding tickets
  alignas(64) std::atomic<int64_t> pending{0};    // reservations not yet committed/aborted
  std::atomic<uint64_t> fresh_in{0};
  std::atomic<uint64_t> next_sample_id{0};
  std::atomic<uint64_t> epoch_base{0};  // next_sample_id at the last reset_input(): epoch blocks
  alignas(64) std::atomic<uint64_t> emitted{0};
  std::atomic<uint64_t> emit_pos{0};      // emission position (units)
  std::atomic<uint64_t> draw_counter{0};  // RNG counter for draws
  alignas(64) std::atomic<bool> closed{false};
  std::atomic<bool> input_ended{false};
  std::atomic<bool> sealed{false};  // input ended, no pending puts, open batch flushed
  std::atomic<int64_t> quota{-1};   // fresh samples a sink may still store; < 0 = unlimited

  // Leases outstanding, plus kOrphaned once the last shared_ptr owner is gone: whichever of the
  // shared_ptr deleter and the last lease release sees the other's mark deletes the cache.
  static constexpr uint64_t kOrphaned = uint64_t{1} << 63;
  alignas(64) std::atomic<uint64_t> leases{0};

  // Waiting takers (wait_mu is a leaf lock). Producers wait on space_gen instead.
  std::mutex wait_mu;
  std::condition_variable data_cv;
  std::atomic<int> put_waiters{0};  // producers (and wait_for_room) blocked for space
  std::atomic<int> take_waiters{0};
  // Smallest ticket count a waiting taker needs; publishes below it do not wake anybody.
  std::atomic<int64_t> want_hint{std::numeric_limits<int64_t>::max()};
  // Retired samples (or bytes) that wake blocked producers: one wakeup per 1/16 of the cache
  // (in a small cache per put chunk of 64 rows, at most a quarter of it) instead of one per
  // retired sample.
  const int64_t wake_slots;
  const int64_t wake_bytes;
  std::atomic<uint64_t> puts_blocked{0}, put_blocked_ns{0};
  std::atomic<uint64_t> takes_waited{0}, take_wait_ns{0};
  std::atomic<uint64_t> refused_bytes{0};  // largest sample refused as larger than the arena

  // Field layouts ("HWC"...) recorded by a DALI sink, restored by the source (side_mu).
  mutable std::mutex side_mu;
  std::vector<std::string> layouts;

  uint32_t tickets_for(uint64_t sample_id) const;

  // -- allocator (caller holds alloc_mu) --
  bool alloc_slot_locked(const SampleDesc& desc, uint64_t need, uint32_t* slot);
  void free_slot_locked(uint32_t s);
  // Gives every retired unit on the stack back to the allocator.
  void collect_retired_locked();
  // Brings the high-water mark down to just above the highest used slot, when the slot below it
  // is free. Only the put path calls it (see the definition).
  void lower_high_water_locked() noexcept;

  // -- publication and draws --
  void publish(uint32_t u, uint32_t members, uint64_t first_sample_id);
  // Sets a reserved unit's tickets (release store): from then on draws may find it. Returns the
  // tickets; the caller then adds them to `available` (and counted live_samples before).
  uint32_t make_drawable(uint32_t u, uint32_t members, uint64_t first_sample_id);
  void flush_open_locked();  // caller holds assembly_mu
  // Raises every live unit's tickets to what the current factor gives it (tickets_for()), where
  // that is more than it was given; returns the tickets added. Caller holds alloc_mu: a unit
  // that retires meanwhile cannot be collected and republished before its total is raised.
  uint64_t top_up_locked();
  // The same for unit u alone (0 unless it is live and was given fewer).
  uint32_t top_up_unit_locked(uint32_t u);
  // Adds `change` (tickets in, readers out) to unit u's word while the unit is live; false
  // when it was not (retired or free). return_ticket() and the top-ups share it.
  bool add_to_live_unit(uint32_t u, uint64_t change, uint32_t members) noexcept;
  // A publisher's part of a top-up that ran while it published (`ups`: top_ups read before
  // its units' tickets): the scan may have passed them, so it raises them itself.
  void top_up_published(uint64_t ups, const uint32_t* units, size_t n);
  void try_seal();
  // Draws one unit for a taker that already owns a ticket in `available`. Lock-free.
  // Reuse distances of one take, added to a stripe once per take instead of once per draw.
  struct ReuseTally {
    uint64_t sum = 0, pairs = 0;
  };
  uint32_t draw_one(uint64_t rnd, uint64_t pos, uint32_t* emission,
                    ReuseTally* reuse_tally) noexcept;
  // Pushes a chain of retired units (linked by retire_next, `first`..`last`) in one CAS.
  void push_retired(uint32_t first, uint32_t last, int64_t samples, int64_t bytes) noexcept;
  // Drops one reader of unit u; returns true when that retired it (the caller pushes it).
  bool drop_reader(uint32_t u) noexcept;
  // Turns `members` reader references of unit u (one copy the caller took and holds) back into
  // one ticket; the caller then adds it to `available`.
  void return_ticket(uint32_t u, uint32_t members) noexcept;
  // Samples and bytes a retiring unit gives back.
  void unit_size(uint32_t u, int64_t* samples, int64_t* bytes) const noexcept;

  // -- notification (Dekker: state change is seq_cst, then read the waiter count). A producer
  // is woken by a futex wake on space_gen (no mutex); a taker by data_cv under wait_mu. --
  void notify_space() noexcept;
  void notify_data_published() noexcept;
  void notify_data() noexcept;
  void notify_all() noexcept;
  // Blocks a producer-side caller until space may have appeared (space_gen moved from `gen`, a
  // retired unit waits for collection, close, end of input) or `deadline` (unless forever).
  void wait_for_space(uint32_t gen, bool forever, Clock::time_point deadline);
};

}  // namespace echopipe::detail

namespace echopipe {
struct EchoCache::Impl : detail::CacheImpl {
  using detail::CacheImpl::CacheImpl;
};
}  // namespace echopipe
