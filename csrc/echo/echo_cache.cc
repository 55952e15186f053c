// Implementation of the echo cache (algorithm and correctness argument: echo_cache.h) and the
// process-wide registry of named caches. Lock order, outermost first: assembly_mu (batch mode
// only) -> shard mutex; alloc_mu and wait_mu are leaves (never held while taking another lock).
#include "echo/echo_cache.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "echo/arena.h"

namespace echopipe {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
constexpr uint64_t kNoEmit = std::numeric_limits<uint64_t>::max();
constexpr uint64_t kTicket = uint64_t{1} << 32;
constexpr size_t kMaxHist = 64;
// Upper bound on any blocking wait, so close() is seen within this even if a notify were lost.
constexpr auto kPoll = std::chrono::milliseconds(100);

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform integer in [0, n) from 32 random bits (Lemire's multiply-shift; bias < n / 2^32).
uint32_t bounded(uint32_t r, uint32_t n) {
  return static_cast<uint32_t>((static_cast<uint64_t>(r) * n) >> 32);
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

std::atomic<uint64_t> g_next_handle{1};

}  // namespace

struct EchoCache::Impl {
  struct Slot {
    SampleDesc desc;
    uint64_t offset = 0;  // extent start in the arena
    uint64_t extent = 0;  // extent bytes
    uint64_t sample_id = 0;
    uint32_t next = kNone;  // next member of the same unit (batch mode), put order
    uint32_t unit = kNone;  // first member's slot id
    uint32_t index_in_unit = 0;
  };
  // A unit is identified by its first member's slot id; only that entry of `units` is used.
  struct Unit {
    std::atomic<uint64_t> state{0};  // tickets << 32 | readers
    uint32_t tickets_total = 0;
    uint32_t members = 0;
    uint32_t pos = 0;  // index in its shard's array (under the shard mutex)
    uint32_t shard = 0;
    uint64_t last_emit = kNoEmit;  // global emission position of the previous copy
  };
  struct alignas(64) Shard {
    std::mutex mu;
    std::vector<uint32_t> units;
    std::atomic<uint64_t> reuse_sum{0};  // written under mu, read by stats()
    std::atomic<uint64_t> reuse_pairs{0};
  };

  EchoConfig cfg;
  detail::Arena arena;
  std::vector<Slot> slots;
  std::unique_ptr<Unit[]> units;
  std::unique_ptr<Shard[]> shards;
  // Shard sizes (written under each shard's mutex), packed: a draw reads every size, and 16
  // shards fit in one cache line instead of 16.
  std::unique_ptr<std::atomic<uint32_t>[]> shard_sizes;
  uint32_t num_shards = 1;
  // Current echo factor (set_echo_factor); read once per published unit.
  std::atomic<double> echo_factor{2.0};
  uint64_t seed = 0;  // replaced by restore_state
  uint32_t unit_samples = 1;

  // Allocator (alloc_mu): slots and best-fit extents with coalescing. The counters written
  // under the lock share its cache line (40 + 3 * 8 bytes): taking the lock brings them along.
  alignas(64) mutable std::mutex alloc_mu;
  std::atomic<uint64_t> resident{0};
  std::atomic<uint64_t> bytes_used{0};
  std::atomic<uint64_t> space_gen{0};  // bumped on every free (wakes blocked puts)
  std::vector<uint32_t> free_slots;
  std::map<uint64_t, uint64_t> free_by_offset;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size;  // (size, offset)
  // Segregated exact-size free lists in front of the coalescing tree: an extent freed with one
  // of the first kSizeClasses sizes seen is parked here uncoalesced, and a request of that size
  // pops it in O(1) without touching (or allocating nodes of) the tree. Uniform samples, the
  // common case, then never reach the tree. When the tree cannot serve a request, every parked
  // extent is given back to it (coalescing) and the request retried, so the allocator still
  // finds space exactly when the coalescing allocator alone would.
  static constexpr int kSizeClasses = 8;
  struct SizeClass {
    uint64_t size = 0;
    std::vector<uint64_t> offsets;
  };
  std::array<SizeClass, kSizeClasses> size_classes;
  int num_size_classes = 0;
  uint64_t parked_extents = 0;
  std::vector<uint64_t> histogram = std::vector<uint64_t>(kMaxHist, 0);
  uint64_t retired = 0;
  bool input_ended_locked = false;  // mirror of input_ended under alloc_mu

  // Batch assembly (assembly_mu).
  std::mutex assembly_mu;
  uint32_t open_unit = kNone;
  uint32_t open_tail = kNone;
  uint32_t open_count = 0;

  // Lock-free counters, grouped by who writes them, one cache line per group, so producers and
  // consumers do not invalidate each other's lines with counters the other side never touches.
  // Shared by both sides (the ticket count both sides must agree on):
  alignas(64) std::atomic<int64_t> available{0};  // tickets in the index not yet claimed
  std::atomic<int64_t> live_samples{0};           // samples of units in the index
  // Producers (commit / publish):
  alignas(64) std::atomic<int64_t> pending{0};  // reservations not yet committed/aborted
  std::atomic<uint64_t> fresh_in{0};
  std::atomic<uint64_t> publish_counter{0};
  std::atomic<uint64_t> next_sample_id{0};
  // Consumers (take):
  alignas(64) std::atomic<uint64_t> emitted{0};
  std::atomic<uint64_t> emit_pos{0};      // global emission position (units)
  std::atomic<uint64_t> draw_counter{0};  // RNG counter for draws
  // Flags: written rarely, read on every call.
  alignas(64) std::atomic<bool> closed{false};
  std::atomic<bool> input_ended{false};
  std::atomic<bool> sealed{false};  // input ended, no pending puts, open batch flushed

  // Waiting (wait_mu is a leaf lock).
  std::mutex wait_mu;
  std::condition_variable space_cv;
  std::condition_variable data_cv;
  std::atomic<int> put_waiters{0};
  std::atomic<int> take_waiters{0};
  // Smallest ticket count a waiting taker needs; publishes below it do not wake anybody.
  std::atomic<int64_t> want_hint{std::numeric_limits<int64_t>::max()};
  // Free space a blocked producer waits for before it is woken (hysteresis: one wakeup per
  // 1/16 of the cache instead of one per retired sample).
  uint64_t wake_slots = 1;
  uint64_t wake_bytes = 0;
  uint64_t usable_bytes = 0;
  std::atomic<uint64_t> puts_blocked{0}, put_blocked_ns{0};
  std::atomic<uint64_t> takes_waited{0}, take_wait_ns{0};

  explicit Impl(const EchoConfig& c) : cfg(c) {
    arena = detail::arena_allocate(round_up(cfg.capacity_bytes, 4096), cfg.memory);
    slots.resize(cfg.capacity_samples);
    units.reset(new Unit[cfg.capacity_samples]);
    num_shards = static_cast<uint32_t>(cfg.num_shards);
    if (num_shards == 0) {
      num_shards = static_cast<uint32_t>(std::clamp<size_t>(cfg.capacity_samples / 64, 1, 16));
    }
    shards.reset(new Shard[num_shards]);
    shard_sizes.reset(new std::atomic<uint32_t>[num_shards]);
    for (uint32_t s = 0; s < num_shards; ++s) shard_sizes[s].store(0, std::memory_order_relaxed);
    for (uint32_t s = 0; s < num_shards; ++s) {
      shards[s].units.reserve(cfg.capacity_samples / num_shards + 64);
    }
    echo_factor.store(cfg.echo_factor, std::memory_order_relaxed);
    seed = cfg.seed;
    unit_samples = cfg.mode == EchoMode::kBatch ? static_cast<uint32_t>(cfg.batch_size) : 1;
    free_slots.reserve(cfg.capacity_samples);
    for (size_t i = cfg.capacity_samples; i-- > 0;) free_slots.push_back(static_cast<uint32_t>(i));
    uint64_t usable = cfg.capacity_bytes / kFieldAlignment * kFieldAlignment;
    usable_bytes = usable;
    wake_slots = std::max<uint64_t>(1, cfg.capacity_samples / 16);
    wake_bytes = usable / 16;
    free_by_offset.emplace(0, usable);
    free_by_size.emplace(usable, 0);
  }
  ~Impl() { detail::arena_free(arena); }

  uint32_t tickets_for(uint64_t sample_id) const {
    const double e = echo_factor.load(std::memory_order_relaxed);
    const auto floor_tickets = static_cast<uint32_t>(std::floor(e));
    const double frac_tickets = e - floor_tickets;
    if (frac_tickets <= 0.0) return floor_tickets;
    uint64_t r = splitmix64(seed ^ splitmix64(sample_id + 0x51ed270b27ull));
    double u = static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);
    return floor_tickets + (u < frac_tickets ? 1 : 0);
  }

  // ---- allocator (caller holds alloc_mu) ----
  SizeClass* size_class(uint64_t size, bool create) {
    if (size == 0) return nullptr;  // empty samples take the tree path, as they always did
    for (int i = 0; i < num_size_classes; ++i) {
      if (size_classes[i].size == size) return &size_classes[i];
    }
    if (!create || num_size_classes == kSizeClasses) return nullptr;
    SizeClass& c = size_classes[num_size_classes++];
    c.size = size;
    c.offsets.reserve(std::min<size_t>(cfg.capacity_samples, usable_bytes / size + 1));
    return &c;
  }
  bool alloc_extent(uint64_t size, uint64_t* offset) {
    if (SizeClass* c = size_class(size, false); c != nullptr && !c->offsets.empty()) {
      *offset = c->offsets.back();
      c->offsets.pop_back();
      --parked_extents;
      return true;
    }
    if (alloc_from_tree(size, offset)) return true;
    if (parked_extents == 0) return false;
    for (int i = 0; i < num_size_classes; ++i) {
      SizeClass& c = size_classes[i];
      for (uint64_t off : c.offsets) coalesce_into_tree(off, c.size);
      c.offsets.clear();
    }
    parked_extents = 0;
    return alloc_from_tree(size, offset);
  }
  bool alloc_from_tree(uint64_t size, uint64_t* offset) {
    auto it = free_by_size.lower_bound({size, 0});
    if (it == free_by_size.end()) return false;
    uint64_t sz = it->first, off = it->second;
    free_by_size.erase(it);
    free_by_offset.erase(off);
    if (sz > size) {
      free_by_offset.emplace(off + size, sz - size);
      free_by_size.emplace(sz - size, off + size);
    }
    *offset = off;
    return true;
  }
  void free_extent(uint64_t off, uint64_t size) {
    if (SizeClass* c = size_class(size, true); c != nullptr) {
      c->offsets.push_back(off);
      ++parked_extents;
      return;
    }
    coalesce_into_tree(off, size);
  }
  void coalesce_into_tree(uint64_t off, uint64_t size) {
    auto next = free_by_offset.find(off + size);
    if (next != free_by_offset.end()) {
      size += next->second;
      free_by_size.erase({next->second, next->first});
      free_by_offset.erase(next);
    }
    auto it = free_by_offset.lower_bound(off);
    if (it != free_by_offset.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == off) {
        off = prev->first;
        size += prev->second;
        free_by_size.erase({prev->second, prev->first});
        free_by_offset.erase(prev);
      }
    }
    free_by_offset.emplace(off, size);
    free_by_size.emplace(size, off);
  }
  // Frees one slot and its extent (caller holds alloc_mu).
  void free_slot_locked(uint32_t s) {
    Slot& sl = slots[s];
    free_extent(sl.offset, sl.extent);
    bytes_used.fetch_sub(sl.extent, std::memory_order_relaxed);
    resident.fetch_sub(1, std::memory_order_relaxed);
    sl.next = kNone;
    sl.unit = kNone;
    free_slots.push_back(s);
  }

  // ---- notification (Dekker: state change is seq_cst, then read the waiter count) ----
  void notify_space() {
    space_gen.fetch_add(1, std::memory_order_seq_cst);
    if (put_waiters.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(wait_mu);
      space_cv.notify_all();
    }
  }
  // Called after `available`/`live_samples` grew: wakes takers only if one could now proceed
  // (the waiter publishes want_hint before it re-checks, so this cannot miss it).
  void notify_data_published() {
    if (take_waiters.load(std::memory_order_seq_cst) == 0) return;
    // A blocked producer or ended input lets takers take short batches and skip min_fill.
    bool relaxed = put_waiters.load(std::memory_order_seq_cst) > 0 ||
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
  void notify_data() {
    if (take_waiters.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(wait_mu);
      data_cv.notify_all();
    }
  }
  void notify_all() {
    std::lock_guard<std::mutex> lk(wait_mu);
    space_cv.notify_all();
    data_cv.notify_all();
  }

  // ---- publish a unit into the index ----
  void publish(uint32_t u, uint32_t members, uint64_t first_sample_id) {
    Unit& U = units[u];
    uint32_t t = tickets_for(first_sample_id);
    U.tickets_total = t;
    U.members = members;
    U.last_emit = kNoEmit;
    U.state.store(static_cast<uint64_t>(t) << 32, std::memory_order_relaxed);
    uint32_t s =
        static_cast<uint32_t>(publish_counter.fetch_add(1, std::memory_order_relaxed) % num_shards);
    insert_into_shard(u, s);
    live_samples.fetch_add(members, std::memory_order_seq_cst);
    available.fetch_add(t, std::memory_order_seq_cst);
    notify_data_published();
  }
  void insert_into_shard(uint32_t u, uint32_t s) {
    Shard& sh = shards[s];
    std::lock_guard<std::mutex> lk(sh.mu);
    units[u].shard = s;
    units[u].pos = static_cast<uint32_t>(sh.units.size());
    sh.units.push_back(u);
    shard_sizes[s].store(static_cast<uint32_t>(sh.units.size()), std::memory_order_relaxed);
  }

  // Flushes the open batch as a (possibly short) unit. Caller holds assembly_mu.
  void flush_open_locked() {
    if (open_unit == kNone) return;
    uint32_t u = open_unit;
    uint32_t k = open_count;
    open_unit = open_tail = kNone;
    open_count = 0;
    publish(u, k, slots[u].sample_id);
  }

  void try_seal() {
    std::lock_guard<std::mutex> lk(assembly_mu);
    if (sealed.load(std::memory_order_seq_cst)) return;
    if (!input_ended.load(std::memory_order_seq_cst)) return;
    if (pending.load(std::memory_order_seq_cst) != 0) return;
    flush_open_locked();
    sealed.store(true, std::memory_order_seq_cst);
    notify_data();
  }

  // Draws one unit for a taker that already owns a ticket in `available`.
  uint32_t draw_one(uint64_t rnd, uint64_t pos, uint32_t* emission) {
    for (uint32_t attempt = 0;; ++attempt) {
      uint32_t sizes[1024];
      uint64_t total = 0;
      for (uint32_t s = 0; s < num_shards; ++s) {
        sizes[s] = shard_sizes[s].load(std::memory_order_relaxed);
        total += sizes[s];
      }
      uint32_t s = 0;
      if (total > 0) {
        uint64_t r = bounded(static_cast<uint32_t>(rnd), static_cast<uint32_t>(total));
        while (r >= sizes[s]) r -= sizes[s++];
      } else {
        s = attempt % num_shards;
      }
      Shard& sh = shards[s];
      {
        std::lock_guard<std::mutex> lk(sh.mu);
        uint32_t n = static_cast<uint32_t>(sh.units.size());
        if (n > 0) {
          uint32_t idx = bounded(static_cast<uint32_t>(rnd >> 32), n);
          uint32_t u = sh.units[idx];
          Unit& U = units[u];
          uint64_t old = U.state.fetch_add(U.members - kTicket, std::memory_order_acq_rel);
          uint32_t left = static_cast<uint32_t>(old >> 32) - 1;
          *emission = U.tickets_total - 1 - left;
          if (U.last_emit != kNoEmit && pos > U.last_emit) {
            sh.reuse_sum.store(sh.reuse_sum.load(std::memory_order_relaxed) + (pos - U.last_emit),
                               std::memory_order_relaxed);
            sh.reuse_pairs.store(sh.reuse_pairs.load(std::memory_order_relaxed) + 1,
                                 std::memory_order_relaxed);
          }
          U.last_emit = pos;
          if (left == 0) {
            uint32_t last = sh.units.back();
            sh.units[idx] = last;
            units[last].pos = idx;
            sh.units.pop_back();
            shard_sizes[s].store(static_cast<uint32_t>(sh.units.size()), std::memory_order_relaxed);
            live_samples.fetch_sub(U.members, std::memory_order_seq_cst);
          }
          return u;
        }
      }
      // Sizes were stale (another taker emptied the shard): re-draw.
      rnd = splitmix64(rnd);
      if (attempt > 64) std::this_thread::yield();
    }
  }

  void retire(uint32_t u) { retire_many(&u, 1); }
  // Retires units whose state word reached 0, freeing them under one allocator lock.
  void retire_many(const uint32_t* us, size_t n) {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lk(alloc_mu);
      for (size_t i = 0; i < n; ++i) {
        const uint32_t u = us[i];
        uint32_t t = units[u].tickets_total;
        uint32_t k = 0;
        for (uint32_t s = u; s != kNone;) {
          uint32_t next = slots[s].next;
          free_slot_locked(s);
          s = next;
          ++k;
        }
        histogram[std::min<size_t>(t, kMaxHist - 1)] += k;
        retired += k;
      }
      // Wake blocked producers once 1/16 of the cache is free, or at every retire when no
      // ticket is left (then no further retire may come from takers, only from lease releases).
      wake = (free_slots.size() >= wake_slots &&
              usable_bytes - bytes_used.load(std::memory_order_relaxed) >= wake_bytes) ||
             available.load(std::memory_order_seq_cst) <= 0;
      if (wake) space_gen.fetch_add(1, std::memory_order_seq_cst);
    }
    if (wake && put_waiters.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(wait_mu);
      space_cv.notify_all();
    }
  }
};

// ---- EchoCache -------------------------------------------------------------------------------

std::shared_ptr<EchoCache> EchoCache::create(const EchoConfig& config, std::string name) {
  config.validate();
  return std::shared_ptr<EchoCache>(new EchoCache(config, std::move(name)));
}

EchoCache::EchoCache(const EchoConfig& config, std::string name)
    : config_(config), name_(std::move(name)) {
  handle_ = g_next_handle.fetch_add(1);
  if (name_.empty()) name_ = "echo-" + std::to_string(handle_);
  impl_ = std::make_unique<Impl>(config_);
}

EchoCache::~EchoCache() { close(); }

void EchoCache::close() {
  if (impl_->closed.exchange(true, std::memory_order_seq_cst)) return;
  impl_->notify_all();
}

bool EchoCache::closed() const { return impl_->closed.load(std::memory_order_acquire); }

double EchoCache::echo_factor() const { return impl_->echo_factor.load(std::memory_order_relaxed); }

void EchoCache::set_echo_factor(double e) {
  if (!(e >= 1.0) || !std::isfinite(e) || e > 65535.0) {
    throw std::invalid_argument(
        "set_echo_factor: echo_factor must be a finite number in "
        "[1, 65535], got " +
        std::to_string(e));
  }
  impl_->echo_factor.store(e, std::memory_order_relaxed);
}

MemoryKind EchoCache::memory_kind() const { return impl_->arena.kind; }
const void* EchoCache::arena_host() const { return impl_->arena.host; }
const void* EchoCache::arena_device() const { return impl_->arena.device; }

PutStatus EchoCache::reserve(const SampleDesc& desc, PutReservation& out, double timeout_s) {
  out = PutReservation();
  uint32_t slot = 0;
  PutStatus st = reserve_slot(desc, timeout_s, &slot);
  if (st == PutStatus::kOk) {
    out.cache_ = shared_from_this();
    out.slot_ = slot;
  }
  return st;
}

PutStatus EchoCache::reserve_slot(const SampleDesc& desc, double timeout_s, uint32_t* slot_out) {
  Impl& I = *impl_;
  desc.validate();
  const uint64_t need = desc.extent_bytes();
  const uint64_t usable = config_.capacity_bytes / kFieldAlignment * kFieldAlignment;
  if (need > usable) {
    throw std::invalid_argument("sample of " + std::to_string(need) +
                                " bytes (64-byte aligned fields) is larger than the cache arena "
                                "of capacity_bytes=" +
                                std::to_string(config_.capacity_bytes));
  }
  // The clock is read only once the cache is found full (the fast path never needs it); the
  // timeout and the blocked time count from then.
  Clock::time_point start{}, deadline{};
  const bool forever = timeout_s < 0;
  bool waited = false;
  bool timed = false;
  PutStatus result = PutStatus::kOk;
  for (;;) {
    if (I.closed.load(std::memory_order_acquire)) {
      result = PutStatus::kClosed;
      break;
    }
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(I.alloc_mu);
      if (I.input_ended_locked) {
        result = PutStatus::kEnded;
        break;
      }
      gen = I.space_gen.load(std::memory_order_seq_cst);
      uint64_t off;
      if (!I.free_slots.empty() && I.alloc_extent(need, &off)) {
        uint32_t s = I.free_slots.back();
        I.free_slots.pop_back();
        Impl::Slot& sl = I.slots[s];
        sl.desc = desc;
        sl.offset = off;
        sl.extent = need;
        sl.next = kNone;
        sl.unit = kNone;
        I.pending.fetch_add(1, std::memory_order_seq_cst);
        I.resident.fetch_add(1, std::memory_order_relaxed);
        I.bytes_used.fetch_add(need, std::memory_order_relaxed);
        *slot_out = s;
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
      deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                             forever ? 0.0 : std::min(timeout_s, 1e9)));
    }
    if (!forever && Clock::now() >= deadline) {
      result = PutStatus::kTimeout;
      break;
    }
    if (!waited) {
      waited = true;
      I.puts_blocked.fetch_add(1, std::memory_order_relaxed);
    }
    std::unique_lock<std::mutex> lk(I.wait_mu);
    I.put_waiters.fetch_add(1, std::memory_order_seq_cst);
    // Consumers may now ignore min_fill; tell any that wait.
    I.data_cv.notify_all();
    while (I.space_gen.load(std::memory_order_seq_cst) == gen &&
           !I.closed.load(std::memory_order_seq_cst) &&
           !I.input_ended.load(std::memory_order_seq_cst)) {
      auto now = Clock::now();
      if (!forever && now >= deadline) break;
      auto until = now + kPoll;
      if (!forever && deadline < until) until = deadline;
      I.space_cv.wait_until(lk, until);
    }
    I.put_waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
  if (waited) {
    I.put_blocked_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count(),
        std::memory_order_relaxed);
  }
  return result;
}

PutStatus EchoCache::commit(PutReservation& r) {
  if (!r.valid()) throw std::invalid_argument("commit() of an invalid (empty) reservation");
  if (r.cache_.get() != this) throw std::invalid_argument("reservation belongs to another cache");
  const uint32_t s = r.slot_;
  r.cache_.reset();
  return commit_slot(s);
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
    uint64_t id = I.next_sample_id.fetch_add(1, std::memory_order_relaxed);
    sl.sample_id = id;
    sl.unit = s;
    sl.index_in_unit = 0;
    sl.next = kNone;
    I.fresh_in.fetch_add(1, std::memory_order_relaxed);
    I.publish(s, 1, id);
  } else {
    std::lock_guard<std::mutex> lk(I.assembly_mu);
    uint64_t id = I.next_sample_id.fetch_add(1, std::memory_order_relaxed);
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

void EchoCache::abort(PutReservation& r) {
  if (!r.valid()) return;
  if (r.cache_.get() != this) throw std::invalid_argument("reservation belongs to another cache");
  Impl& I = *impl_;
  const uint32_t s = r.slot_;
  r.cache_.reset();
  {
    std::lock_guard<std::mutex> lk(I.alloc_mu);
    I.free_slot_locked(s);
  }
  if (I.pending.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
      I.input_ended.load(std::memory_order_seq_cst)) {
    I.try_seal();
  }
  I.notify_space();
}

PutStatus EchoCache::put(const SampleDesc& desc, const void* const* field_data, double timeout_s) {
  uint32_t s = 0;
  PutStatus st = reserve_slot(desc, timeout_s, &s);
  if (st != PutStatus::kOk) return st;
  // The slot is ours until commit_slot (nothing else reads or frees a pending slot).
  auto* base = static_cast<uint8_t*>(impl_->arena.host) + impl_->slots[s].offset;
  for (int f = 0; f < desc.num_fields; ++f) {
    size_t nb = desc.fields[f].nbytes();
    if (nb > 0) std::memcpy(base + desc.field_offset(f), field_data[f], nb);
  }
  return commit_slot(s);
}

TakeStatus EchoCache::take(size_t n, std::vector<SampleLease>& out, double timeout_s) {
  Impl& I = *impl_;
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
  const auto start = Clock::now();
  const bool forever = timeout_s < 0;
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(forever ? 0.0 : std::min(timeout_s, 1e9)));
  const int64_t min_fill = static_cast<int64_t>(config_.min_fill);
  bool waited = false;
  int64_t got = 0;
  TakeStatus result = TakeStatus::kOk;

  // Returns the number of tickets that may be claimed now (0 = wait), or -1 for "end".
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
    bool sealed = I.sealed.load(std::memory_order_seq_cst);
    int64_t avail = I.available.load(std::memory_order_seq_cst);
    int64_t c = claimable(avail, sealed);
    if (c < 0) {
      result = TakeStatus::kEnd;
      break;
    }
    if (c > 0) {
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
      bool s2 = I.sealed.load(std::memory_order_seq_cst);
      if (claimable(I.available.load(std::memory_order_seq_cst), s2) != 0) break;
      auto now = Clock::now();
      if (!forever && now >= deadline) break;
      auto until = now + kPoll;
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

  std::shared_ptr<EchoCache> self = shared_from_this();
  const uint64_t rng_base = I.draw_counter.fetch_add(static_cast<uint64_t>(got));
  const uint64_t pos_base = I.emit_pos.fetch_add(static_cast<uint64_t>(got));
  uint64_t samples = 0;
  out.reserve(out.size() + static_cast<size_t>(got) * I.unit_samples);
  for (int64_t i = 0; i < got; ++i) {
    uint64_t rnd = splitmix64(I.seed * 0x2545F4914F6CDD1Dull + rng_base + static_cast<uint64_t>(i));
    uint32_t emission = 0;
    uint32_t u = I.draw_one(rnd, pos_base + static_cast<uint64_t>(i), &emission);
    for (uint32_t s = u; s != kNone; s = I.slots[s].next) {
      SampleLease lease;
      lease.cache_ = self;
      lease.slot_ = s;
      lease.unit_ = u;
      lease.emission_ = emission;
      lease.index_in_unit_ = I.slots[s].index_in_unit;
      out.push_back(std::move(lease));
      ++samples;
    }
  }
  I.emitted.fetch_add(samples, std::memory_order_relaxed);
  return TakeStatus::kOk;
}

void EchoCache::release_reader(uint32_t unit) {
  Impl& I = *impl_;
  if (I.units[unit].state.fetch_sub(1, std::memory_order_acq_rel) == 1) I.retire(unit);
}

void EchoCache::end_of_input() {
  Impl& I = *impl_;
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
  std::lock_guard<std::mutex> alk(I.assembly_mu);
  std::lock_guard<std::mutex> lk(I.alloc_mu);
  I.input_ended_locked = false;
  I.input_ended.store(false, std::memory_order_seq_cst);
  I.sealed.store(false, std::memory_order_seq_cst);
}

EchoStats EchoCache::stats() const {
  const Impl& I = *impl_;
  EchoStats st;
  st.fresh_in = I.fresh_in.load();
  st.emitted = I.emitted.load();
  st.resident = I.resident.load();
  st.resident_with_tickets = static_cast<uint64_t>(std::max<int64_t>(0, I.live_samples.load()));
  st.tickets_left = static_cast<uint64_t>(std::max<int64_t>(0, I.available.load()));
  st.bytes_used = I.bytes_used.load();
  st.capacity_bytes = config_.capacity_bytes;
  st.capacity_samples = config_.capacity_samples;
  {
    std::lock_guard<std::mutex> lk(I.alloc_mu);
    st.emit_histogram = I.histogram;
    st.retired = I.retired;
  }
  while (st.emit_histogram.size() > 1 && st.emit_histogram.back() == 0) {
    st.emit_histogram.pop_back();
  }
  uint64_t sum = 0, pairs = 0;
  for (uint32_t s = 0; s < I.num_shards; ++s) {
    sum += I.shards[s].reuse_sum.load(std::memory_order_relaxed);
    pairs += I.shards[s].reuse_pairs.load(std::memory_order_relaxed);
  }
  st.reuse_pairs = pairs;
  st.mean_reuse_distance =
      pairs ? static_cast<double>(sum) / static_cast<double>(pairs) * I.unit_samples : 0.0;
  st.memory_kind = I.arena.kind;
  st.puts_blocked = I.puts_blocked.load();
  st.put_blocked_seconds = static_cast<double>(I.put_blocked_ns.load()) * 1e-9;
  st.takes_waited = I.takes_waited.load();
  st.take_wait_seconds = static_cast<double>(I.take_wait_ns.load()) * 1e-9;
  st.closed = I.closed.load();
  st.input_ended = I.input_ended.load();
  return st;
}

// ---- save / restore ------------------------------------------------------------------------

namespace {

constexpr char kMagic[8] = {'E', 'C', 'H', 'O', 'C', 'A', 'C', '1'};
// Version 2: the echo factor field is the current (runtime-settable) factor and restore adopts
// it instead of requiring the target's to match. Version 1 has the same layout.
constexpr uint32_t kStateVersion = 2;

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
    if (n > left) throw std::invalid_argument("echo cache state is truncated or corrupt");
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
    throw std::invalid_argument(
        "echo cache state is corrupt (num_fields=" + std::to_string(d.num_fields) + ")");
  }
  for (int f = 0; f < d.num_fields; ++f) {
    d.fields[f].dtype = static_cast<DType>(r.get<uint8_t>());
    d.fields[f].ndim = r.get<int32_t>();
    for (int i = 0; i < kMaxDims; ++i) d.fields[f].shape[i] = r.get<int64_t>();
  }
  d.validate();
  return d;
}

}  // namespace

std::vector<uint8_t> EchoCache::save_state() const {
  Impl& I = *impl_;
  std::vector<uint8_t> buf;
  Writer w{buf};
  // Stop the world: no publish, draw, free or reservation can run while these are held.
  std::lock_guard<std::mutex> alk(I.assembly_mu);
  std::vector<std::unique_lock<std::mutex>> shard_locks;
  for (uint32_t s = 0; s < I.num_shards; ++s) shard_locks.emplace_back(I.shards[s].mu);
  std::lock_guard<std::mutex> lk(I.alloc_mu);

  w.bytes(kMagic, sizeof(kMagic));
  w.put<uint32_t>(kStateVersion);
  w.put<double>(I.echo_factor.load(std::memory_order_relaxed));
  w.put<uint8_t>(static_cast<uint8_t>(config_.mode));
  w.put<uint64_t>(config_.mode == EchoMode::kBatch ? config_.batch_size : 1);
  w.put<uint32_t>(I.num_shards);
  w.put<uint64_t>(I.seed);
  w.put<uint64_t>(I.next_sample_id.load());
  w.put<uint64_t>(I.draw_counter.load());
  w.put<uint64_t>(I.emit_pos.load());
  w.put<uint64_t>(I.publish_counter.load());
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
      w.put<uint64_t>(sl.sample_id);
      write_desc(w, sl.desc);
      const auto* base = static_cast<const uint8_t*>(I.arena.host) + sl.offset;
      for (int f = 0; f < sl.desc.num_fields; ++f) {
        w.bytes(base + sl.desc.field_offset(f), sl.desc.fields[f].nbytes());
      }
    }
  };
  for (uint32_t s = 0; s < I.num_shards; ++s) {
    const auto& sh = I.shards[s];
    w.put<uint32_t>(static_cast<uint32_t>(sh.units.size()));
    for (uint32_t u : sh.units) {
      const Impl::Unit& U = I.units[u];
      // Copies already drawn keep their readers; only the tickets left are saved.
      w.put<uint32_t>(static_cast<uint32_t>(U.state.load() >> 32));
      w.put<uint32_t>(U.tickets_total);
      w.put<uint64_t>(U.last_emit);
      write_members(u);
    }
  }
  if (I.open_unit != kNone) {
    w.put<uint8_t>(1);
    write_members(I.open_unit);
  } else {
    w.put<uint8_t>(0);
  }
  return buf;
}

void EchoCache::restore_state(const uint8_t* data, size_t size) {
  Impl& I = *impl_;
  Reader r{data, size};
  if (size < sizeof(kMagic) || std::memcmp(data, kMagic, sizeof(kMagic)) != 0) {
    throw std::invalid_argument("not an echo cache state (bad magic)");
  }
  r.bytes(sizeof(kMagic));
  uint32_t version = r.get<uint32_t>();
  if (version != 1 && version != kStateVersion) {
    throw std::invalid_argument("echo cache state version " + std::to_string(version) +
                                " is not supported (expected " + std::to_string(kStateVersion) +
                                ")");
  }
  double e = r.get<double>();
  auto mode = static_cast<EchoMode>(r.get<uint8_t>());
  uint64_t bs = r.get<uint64_t>();
  uint32_t nshards = r.get<uint32_t>();
  if (!(e >= 1.0) || !std::isfinite(e) || e > 65535.0) {
    throw std::invalid_argument("echo cache state is corrupt (echo_factor=" + std::to_string(e) +
                                ")");
  }
  if (mode != config_.mode) {
    throw std::invalid_argument(std::string("saved mode '") + echo_mode_name(mode) +
                                "' differs from this cache's '" + echo_mode_name(config_.mode) +
                                "'");
  }
  uint64_t my_bs = config_.mode == EchoMode::kBatch ? config_.batch_size : 1;
  if (bs != my_bs) {
    throw std::invalid_argument("saved batch_size=" + std::to_string(bs) +
                                " differs from this cache's " + std::to_string(my_bs));
  }
  if (nshards != I.num_shards) {
    throw std::invalid_argument("saved num_shards=" + std::to_string(nshards) +
                                " differs from this cache's " + std::to_string(I.num_shards) +
                                " (use the same capacity_samples/num_shards)");
  }
  std::lock_guard<std::mutex> alk(I.assembly_mu);
  if (I.fresh_in.load() != 0 || I.resident.load() != 0 || I.pending.load() != 0) {
    throw std::invalid_argument("restore_state() needs an empty cache (this one has " +
                                std::to_string(I.fresh_in.load()) + " samples put)");
  }
  uint64_t seed = r.get<uint64_t>();
  uint64_t next_id = r.get<uint64_t>();
  uint64_t draws = r.get<uint64_t>();
  uint64_t epos = r.get<uint64_t>();
  uint64_t pubs = r.get<uint64_t>();
  uint64_t fresh = r.get<uint64_t>();
  uint64_t emitted = r.get<uint64_t>();
  uint64_t retired = r.get<uint64_t>();
  uint32_t nh = r.get<uint32_t>();
  if (nh > 4096) throw std::invalid_argument("echo cache state is corrupt (histogram)");
  std::vector<uint64_t> hist(nh);
  for (auto& h : hist) h = r.get<uint64_t>();

  // Loads one unit's members into fresh slots; returns the first slot id.
  auto read_members = [&]() -> std::pair<uint32_t, uint32_t> {
    uint32_t k = r.get<uint32_t>();
    if (k == 0 || k > I.unit_samples) {
      throw std::invalid_argument("echo cache state is corrupt (unit of " + std::to_string(k) +
                                  " samples)");
    }
    uint32_t first = kNone, prev = kNone;
    for (uint32_t i = 0; i < k; ++i) {
      uint64_t sid = r.get<uint64_t>();
      SampleDesc d = read_desc(r);
      uint64_t need = d.extent_bytes();
      uint32_t s;
      uint64_t off;
      {
        std::lock_guard<std::mutex> lk(I.alloc_mu);
        if (I.free_slots.empty() || !I.alloc_extent(need, &off)) {
          throw std::invalid_argument("saved state does not fit: capacity_samples=" +
                                      std::to_string(config_.capacity_samples) +
                                      ", capacity_bytes=" + std::to_string(config_.capacity_bytes) +
                                      " are too small for the saved samples");
        }
        s = I.free_slots.back();
        I.free_slots.pop_back();
        I.resident.fetch_add(1);
        I.bytes_used.fetch_add(need);
      }
      Impl::Slot& sl = I.slots[s];
      sl.desc = d;
      sl.offset = off;
      sl.extent = need;
      sl.sample_id = sid;
      sl.next = kNone;
      sl.index_in_unit = i;
      auto* base = static_cast<uint8_t*>(I.arena.host) + off;
      for (int f = 0; f < d.num_fields; ++f) {
        size_t nb = d.fields[f].nbytes();
        std::memcpy(base + d.field_offset(f), r.bytes(nb), nb);
      }
      if (first == kNone) {
        first = s;
      } else {
        I.slots[prev].next = s;
      }
      prev = s;
    }
    for (uint32_t s = first; s != kNone; s = I.slots[s].next) I.slots[s].unit = first;
    return {first, k};
  };

  int64_t tickets = 0, live = 0;
  for (uint32_t sh = 0; sh < nshards; ++sh) {
    uint32_t n = r.get<uint32_t>();
    for (uint32_t j = 0; j < n; ++j) {
      uint32_t left = r.get<uint32_t>();
      uint32_t total = r.get<uint32_t>();
      uint64_t last = r.get<uint64_t>();
      if (left == 0 || left > total) {
        throw std::invalid_argument("echo cache state is corrupt (tickets " + std::to_string(left) +
                                    "/" + std::to_string(total) + ")");
      }
      auto [u, k] = read_members();
      Impl::Unit& U = I.units[u];
      U.tickets_total = total;
      U.members = k;
      U.last_emit = last;
      U.state.store(static_cast<uint64_t>(left) << 32);
      I.insert_into_shard(u, sh);
      tickets += left;
      live += k;
    }
  }
  if (r.get<uint8_t>() != 0) {
    auto [u, k] = read_members();
    I.open_unit = u;
    uint32_t tail = u;
    while (I.slots[tail].next != kNone) tail = I.slots[tail].next;
    I.open_tail = tail;
    I.open_count = k;
  }
  I.seed = seed;
  I.echo_factor.store(e, std::memory_order_relaxed);
  I.next_sample_id.store(next_id);
  I.draw_counter.store(draws);
  I.emit_pos.store(epos);
  I.publish_counter.store(pubs);
  I.fresh_in.store(fresh);
  I.emitted.store(emitted);
  {
    std::lock_guard<std::mutex> lk(I.alloc_mu);
    I.retired = retired;
    for (size_t i = 0; i < hist.size() && i < I.histogram.size(); ++i) I.histogram[i] = hist[i];
  }
  I.live_samples.fetch_add(live);
  I.available.fetch_add(tickets);
  I.notify_data();
}

// ---- leases ----------------------------------------------------------------------------------

SampleLease::SampleLease(SampleLease&& o) noexcept
    : cache_(std::move(o.cache_)),
      slot_(o.slot_),
      unit_(o.unit_),
      emission_(o.emission_),
      index_in_unit_(o.index_in_unit_) {}

SampleLease& SampleLease::operator=(SampleLease&& o) noexcept {
  if (this != &o) {
    release();
    cache_ = std::move(o.cache_);
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
  std::shared_ptr<EchoCache> c = std::move(cache_);
  c->release_reader(unit_);
}

const SampleDesc& SampleLease::desc() const { return cache_->impl_->slots[slot_].desc; }

const void* SampleLease::data(int field) const {
  const auto& I = *cache_->impl_;
  const auto& sl = I.slots[slot_];
  if (field < 0 || field >= sl.desc.num_fields) {
    throw std::invalid_argument("field index " + std::to_string(field) + " out of range for a " +
                                std::to_string(sl.desc.num_fields) + "-field sample");
  }
  return static_cast<const uint8_t*>(I.arena.host) + sl.offset + sl.desc.field_offset(field);
}

const void* SampleLease::device_data(int field) const {
  const auto& I = *cache_->impl_;
  if (I.arena.device == nullptr) return nullptr;
  const auto& sl = I.slots[slot_];
  if (field < 0 || field >= sl.desc.num_fields) {
    throw std::invalid_argument("field index " + std::to_string(field) + " out of range for a " +
                                std::to_string(sl.desc.num_fields) + "-field sample");
  }
  return static_cast<const uint8_t*>(I.arena.device) + sl.offset + sl.desc.field_offset(field);
}

size_t SampleLease::nbytes(int field) const { return desc().fields[field].nbytes(); }
uint64_t SampleLease::sample_id() const { return cache_->impl_->slots[slot_].sample_id; }
uint32_t SampleLease::tickets() const { return cache_->impl_->units[unit_].tickets_total; }

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
  if (field < 0 || field >= sl.desc.num_fields) {
    throw std::invalid_argument("field index " + std::to_string(field) + " out of range for a " +
                                std::to_string(sl.desc.num_fields) + "-field sample");
  }
  return static_cast<uint8_t*>(I.arena.host) + sl.offset + sl.desc.field_offset(field);
}

const SampleDesc& PutReservation::desc() const { return cache_->impl_->slots[slot_].desc; }

// ---- gather ----------------------------------------------------------------------------------

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
  for (size_t i = 0; i < leases.size(); ++i) {
    const void* src = leases[i].data(field);  // checks the field index
    size_t nb = leases[i].nbytes(field);
    if (offsets) offsets[i] = off;
    std::memcpy(out + off, src, nb);
    off += static_cast<int64_t>(nb);
  }
  if (offsets) offsets[leases.size()] = off;
}

void release_leases(std::vector<SampleLease>& leases) {
  // Units whose last reader this call drops, per cache (almost always one cache).
  constexpr size_t kChunk = 256;
  uint32_t retiring[kChunk];
  size_t n = 0;
  std::shared_ptr<EchoCache> owner;  // keeps the cache alive until its units are retired
  auto flush = [&] {
    if (n > 0) owner->impl_->retire_many(retiring, n);
    n = 0;
  };
  for (SampleLease& l : leases) {
    if (!l.cache_) continue;
    if (l.cache_ != owner) {
      flush();
      owner = l.cache_;
    }
    const uint32_t u = l.unit_;
    l.cache_.reset();  // released here, so the lease's destructor does nothing
    if (owner->impl_->units[u].state.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      retiring[n++] = u;
      if (n == kChunk) flush();
    }
  }
  flush();
  leases.clear();
}

// ---- registry --------------------------------------------------------------------------------

namespace {
struct Registry {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<EchoCache>> by_name;
};
Registry& registry() {
  // Leaked on purpose: caches may be looked up from atexit handlers and plugin destructors.
  static Registry* r = new Registry();
  return *r;
}
}  // namespace

std::shared_ptr<EchoCache> create_cache(const std::string& name, const EchoConfig& config) {
  config.validate();
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  if (!name.empty() && r.by_name.count(name)) {
    throw std::invalid_argument("an echo cache named '" + name + "' already exists");
  }
  auto cache = EchoCache::create(config, name);
  r.by_name.emplace(cache->name(), cache);
  return cache;
}

std::shared_ptr<EchoCache> find_cache(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  auto it = r.by_name.find(name);
  return it == r.by_name.end() ? nullptr : it->second;
}

std::shared_ptr<EchoCache> find_cache(uint64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (auto& [n, c] : r.by_name) {
    if (c->handle() == handle) return c;
  }
  return nullptr;
}

bool remove_cache(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  return r.by_name.erase(name) > 0;
}

std::vector<std::string> cache_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::string> names;
  for (auto& [n, c] : r.by_name) names.push_back(n);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace echopipe
