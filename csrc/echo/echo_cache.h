// echopipe echo cache: a bounded, thread-safe buffer that re-emits every sample it receives a
// random number of times (data echoing, Choi et al. 2019), in random order. It is the native core
// shared by the pybind11 module (echopipe._C) and the DALI plugin (libechopipe_dali.so).
//
// Algorithm.
//  * Storage. One fixed byte arena (pageable, or pinned + GPU-mapped when a CUDA device exists)
//    that never grows, plus `capacity_samples` slots. A sample's fields (up to kMaxFields) are
//    stored back to back, each 64-byte aligned, in ONE extent of the arena. Extents come from
//    exact-size free lists (up to 8 size classes, O(1), no node allocation) in front of a
//    best-fit free-extent allocator that coalesces neighbours on free; when the tree cannot serve
//    a request, the parked extents are coalesced back into it and the request retried, so space
//    is found whenever the coalescing allocator alone would find it. One short lock, taken once
//    per put (never per draw or release).
//  * Units and tickets. The unit of echoing is one sample (EchoMode::kExample) or one batch of
//    `batch_size` consecutive commits (EchoMode::kBatch). A fresh unit gets floor(e) or ceil(e)
//    tickets, ceil with probability frac(e), from a counter-based RNG keyed by (seed, sample_id),
//    so tickets are deterministic given the seed, the put order and the sequence of
//    set_echo_factor() calls: e is one atomic, read once when a unit is published (committed, or
//    its batch closed), so a new factor applies to units published after the call and never
//    changes the tickets of a unit already in the index.
//  * Random draw without a lock. Every slot has a 64-bit atomic state word
//    `tickets:16 | generation:16 | readers:32`; a unit (identified by its first slot) is in the
//    index exactly while its tickets are > 0. A global atomic `available` counts tickets in the
//    index not yet claimed. A taker first claims n tickets from `available` with a CAS (all or
//    nothing), which guarantees that n draws will succeed; then, per draw, it probes uniformly
//    random slots below the high-water mark of allocated slots and claims a ticket from the
//    first unit that holds one with a CAS `state -> state - 1 ticket + k readers` (k = the
//    unit's samples). Rejection sampling makes the pick uniform among the units holding
//    tickets; after a bounded number of misses (few tickets left, or batch mode's sparse units)
//    it scans on from the last random probe. The generation changes at every publish of a slot,
//    so a stale CAS cannot hit a later unit (ABA).
//  * Exact accounting. A unit enters the index exactly once (publish: a release store of its
//    tickets, after its data and fields) with tickets >= 1, and leaves it exactly once (the CAS
//    that takes its last ticket). Each ticket is consumed by exactly one successful CAS, and
//    `available` never over-commits. A lease drops one reader with fetch_sub; the one release
//    that brings tickets and readers to 0 retires the unit, which can only happen once because
//    nothing adds readers to a unit without tickets. Retiring pushes the unit onto a lock-free
//    stack (one CAS; a whole batch of leases pushes one chain); the allocator, under its lock,
//    empties that stack with one exchange before it allocates (and stats() before it counts), so
//    a slot is reused only when its tickets are 0 and no reader holds it, and every sample is
//    emitted exactly its ticket count (the C++ stress test, under TSAN and ASAN, checks this).
//    A put takes the lowest free slot (a bitmap with find-first-set per level), so which slot it
//    gets depends only on the set of free slots, not on when retired units were collected
//    (stats() or save_state() in between does not change a deterministic stream).
//    give_back() undoes a draw: the copy's `k` reader references become one ticket again in one
//    CAS, while the caller's readers still keep the unit from retiring; a unit whose last ticket
//    had been drawn re-enters the index then (counted in live_samples first, as a publish is),
//    and only after that is the ticket added to `available`. So a handed-back ticket is claimed
//    and drawn again later, and the count per sample still holds (test_echo_give_back.cc).
//    Neither a draw nor a release takes a mutex; a put takes the allocator lock once.
//  * Waiting. Only an empty or full cache waits, each side with a waiter count. A blocked
//    producer registers (seq_cst), re-checks its condition, then sleeps on the 32-bit word
//    space_gen with a futex (what C++20 std::atomic::wait is built on, used directly because it
//    takes a timeout); the kernel sleeps only while the word still holds the value the producer
//    read. A release that retires enough space bumps the word (seq_cst), reads the waiter count
//    and, when non-zero, makes one futex wake: no mutex, so releases never block on a lock. A
//    waiting taker re-checks under wait_mu and sleeps on a condition variable; a put (or close,
//    end of input, give_back) that may satisfy it notifies under wait_mu, and only when a taker
//    waits. Either way a wakeup cannot be missed (Dekker on seq_cst), and every wait is also
//    bounded by a 100 ms poll, so close() wakes everybody within 100 ms even in the worst case.
//  * No deadlock. Consumers wait for `min_fill` resident samples with tickets (warm-up), except
//    when a producer is blocked for space or end_of_input() was called; and a take never waits for
//    more tickets than exist while a producer is blocked for space (it then returns a short batch).
//    Space held by retired tickets is freed as soon as the readers release their leases, so a
//    fragmented arena always becomes free again while consumers drain.
//
// Lifetime. EchoCache is always held by std::shared_ptr (EchoCache::create or the registry).
// Leases hold a shared_ptr to their cache, so sample memory stays valid until the last lease is
// dropped, even after close() and after every other owner is gone.
//
// Processes. A cache belongs to the process that created it. A fork() copies it into the child
// (arena and tickets included), where it would hand out the same samples as the parent and every
// sibling, fed by threads that do not exist there; so a forked child's copy refuses every use
// with CacheForkedError (EchoCache::forked(), from a generation that a pthread_atfork handler
// bumps in each child). Its close() does nothing there and it is never destroyed there: its
// mutexes and condition variable may be held or waited on by parent threads, and destroying a
// condition variable with waiters blocks. The registry's lock is taken around fork() so that the
// child's registry is usable; a forked child may create caches of its own, also under the names
// of inherited ones.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "echo/export.h"

namespace echopipe {

// ---- errors ------------------------------------------------------------------------------
// Distinct types, so that callers (the Python module registers each as its own exception class)
// tell the cases apart without reading a message. The first two are std::invalid_argument: a bad
// value.

/// A sample whose extent (fields 64-byte aligned) exceeds the arena: it can never be stored.
class ECHOPIPE_API SampleTooLargeError : public std::invalid_argument {
 public:
  SampleTooLargeError(uint64_t sample_bytes, uint64_t capacity_bytes);
  uint64_t sample_bytes() const { return sample_bytes_; }
  uint64_t capacity_bytes() const { return capacity_bytes_; }

 private:
  uint64_t sample_bytes_;
  uint64_t capacity_bytes_;
};

/// A save_state() blob this cache cannot load: corrupt or truncated, another format version, a
/// mode, batch_size or capacity_samples other than the cache's, too large for its arena, or the
/// cache is not empty.
class ECHOPIPE_API CacheStateError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A cache used in a process forked from the one that created it (a DataLoader worker, an
/// os.fork() child). The fork's copy of the cache (arena, slots, tickets) is private to it, so
/// every forked process would hand out the same samples again, and the threads that fed the cache
/// do not exist there: refused, as CUDA refuses a forked child. Python sees
/// echopipe.echo.CacheForkedError (a RuntimeError).
class ECHOPIPE_API CacheForkedError : public std::runtime_error {
 public:
  CacheForkedError(const std::string& name, int64_t creator_pid, int64_t pid);
  int64_t creator_pid() const { return creator_pid_; }
  int64_t pid() const { return pid_; }

 private:
  int64_t creator_pid_;
  int64_t pid_;
};

/// An arena this machine cannot provide (mmap, cudaHostAlloc or cudaMalloc failed): memory, not
/// a bad value; Python sees a MemoryError.
class ECHOPIPE_API ArenaAllocationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---- element types -------------------------------------------------------------------------

/// Element type of a field. Values are stable (they are written into saved state).
enum class DType : uint8_t {
  kUInt8 = 0,
  kInt8 = 1,
  kUInt16 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat16 = 6,
  kBFloat16 = 7,
  kFloat32 = 8,
  kFloat64 = 9,
  kBool = 10,
};

/// Size in bytes of one element; throws std::invalid_argument for a value outside DType.
ECHOPIPE_API size_t dtype_size(DType dtype);
/// Canonical lower-case name: "uint8", "int8", "uint16", "int16", "int32", "int64", "float16",
/// "bfloat16", "float32", "float64", "bool".
ECHOPIPE_API const char* dtype_name(DType dtype);
/// Parses a canonical name (also accepts numpy-style aliases "u1", "f4", "half", "float",
/// "double"). Throws std::invalid_argument("unsupported dtype '<name>' ...") for anything else.
ECHOPIPE_API DType dtype_from_name(std::string_view name);

// ---- sample description --------------------------------------------------------------------

constexpr int kMaxFields = 4;           ///< fields per sample (e.g. image, label, metadata)
constexpr int kMaxDims = 8;             ///< dimensions per field
constexpr size_t kFieldAlignment = 64;  ///< every field starts at a multiple of this in the arena
/// Most bytes of one field: kMaxFields aligned fields then still add up without overflow (larger
/// ones cannot fit an arena anyway).
constexpr uint64_t kMaxFieldBytes = uint64_t{1} << 61;

/// One field of a sample: a dense C-contiguous array.
struct FieldDesc {
  DType dtype = DType::kUInt8;
  int ndim = 0;                  ///< 0 = scalar (one element)
  int64_t shape[kMaxDims] = {};  ///< first `ndim` entries are used; each >= 0

  /// Number of elements (product of the shape; 1 for a scalar).
  ECHOPIPE_API int64_t numel() const;
  /// numel() * dtype_size(dtype).
  ECHOPIPE_API size_t nbytes() const;
};

/// A sample: 1..kMaxFields fields.
struct SampleDesc {
  int num_fields = 0;
  FieldDesc fields[kMaxFields];

  /// Throws std::invalid_argument naming the bad value (num_fields, ndim, negative dim, dtype,
  /// or a shape of more than kMaxFieldBytes, whose byte count would wrap around).
  ECHOPIPE_API void validate() const;
  /// Bytes one sample occupies in the arena: sum of field sizes, each rounded up to 64 B.
  ECHOPIPE_API size_t extent_bytes() const;
  /// Offset of field `i` inside the sample's extent.
  ECHOPIPE_API size_t field_offset(int i) const;
};

// ---- configuration -------------------------------------------------------------------------

/// Unit of echoing.
enum class EchoMode : uint8_t {
  kExample = 0,  ///< each sample is drawn and echoed on its own
  kBatch = 1,    ///< `batch_size` consecutive commits form one unit sharing its tickets
};

/// Where the arena lives.
enum class MemoryKind : uint8_t {
  kAuto = 0,  ///< pinned when built with CUDA and a device is present at run time, else pageable
  kPageable = 1,  ///< ordinary (page-aligned mmap) host memory
  kPinned = 2,    ///< cudaHostAlloc(portable | mapped); an error when no device is available
  /// cudaMalloc on the current device: samples decoded on the GPU are echoed device to device.
  /// Host-side copies in and out (put, gather, save_state) are synchronous cudaMemcpy; leases'
  /// data() and device_data() are both device pointers, never to be read on the host.
  kDevice = 3,
};

ECHOPIPE_API const char* echo_mode_name(EchoMode mode);
/// "example" | "batch"; throws std::invalid_argument naming the value otherwise.
ECHOPIPE_API EchoMode echo_mode_from_name(std::string_view name);
ECHOPIPE_API const char* memory_kind_name(MemoryKind kind);
/// "auto" | "pageable" | "pinned" | "device"; throws std::invalid_argument naming the value
/// otherwise.
ECHOPIPE_API MemoryKind memory_kind_from_name(std::string_view name);

// ---- bounds of a configuration: written here only; validate() and the state checks use them,
// and the Python module exports them (MAX_ECHO_FACTOR, MIN_CAPACITY_BYTES, ...) ---------------

/// Largest echo factor: a unit's tickets are 16 bits of its state word.
constexpr uint32_t kMaxEchoFactor = 65535;
/// Smallest arena: one aligned field.
constexpr size_t kMinCapacityBytes = kFieldAlignment;
/// Most slots: a slot index is 31 bits.
constexpr size_t kMaxCapacitySamples = (size_t{1} << 31) - 1;
/// Largest epoch_size (units per block of exact copy totals).
constexpr size_t kMaxEpochSize = size_t{1} << 40;

/// Whether `e` is an echo factor a cache takes: finite, in [1, kMaxEchoFactor].
inline bool echo_factor_in_bounds(double e) { return e >= 1.0 && e <= kMaxEchoFactor; }

struct EchoConfig {
  size_t capacity_bytes = size_t{256} << 20;  ///< arena size (>= kMinCapacityBytes); fixed
  size_t capacity_samples = 4096;  ///< slots (1..kMaxCapacitySamples); batch mode: >= batch_size
  double echo_factor = 2.0;        ///< e in [1, kMaxEchoFactor]; e = 1 makes a plain shuffle buffer
  size_t min_fill = 0;  ///< warm-up: samples with tickets before takes start (<= capacity_samples)
  uint64_t seed = 0;    ///< tickets and draws are reproducible from it
  EchoMode mode = EchoMode::kExample;
  size_t batch_size = 1;  ///< batch mode: samples per unit (>= 1); ignored in example mode
  MemoryKind memory = MemoryKind::kAuto;
  /// 0: each unit gets ceil(e) tickets with probability frac(e), independently. N > 0: exact
  /// totals per epoch. The units put since the last reset_input() (or since the start) form
  /// blocks of N, and in every block exactly round(frac(e) * N) units get ceil(e) tickets, the
  /// others floor(e); which ones is a seeded pseudo-random choice, stateless per unit (so it
  /// survives save/restore). Exact while e stays the same over the block. At most kMaxEpochSize.
  size_t epoch_size = 0;
  size_t num_shards = 0;  ///< unused since draws probe slots without locks (kept for callers)

  /// Throws std::invalid_argument whose message names the field and the bad value.
  ECHOPIPE_API void validate() const;
};

// ---- statuses ------------------------------------------------------------------------------

enum class PutStatus : uint8_t {
  kOk = 0,
  kTimeout = 1,  ///< no space freed up before the timeout; nothing was stored
  kClosed = 2,   ///< close() was called; nothing was stored
  kEnded = 3,    ///< end_of_input() was called and reset_input() not yet; nothing was stored
};
enum class TakeStatus : uint8_t {
  kOk = 0,       ///< `out` got 1..n samples (fewer than n only for the last batch or a full cache)
  kTimeout = 1,  ///< nothing was taken
  kClosed = 2,   ///< close() was called; nothing was taken
  kEnd = 3,      ///< end_of_input() was called and every ticket has been emitted
};
ECHOPIPE_API const char* put_status_name(PutStatus s);
ECHOPIPE_API const char* take_status_name(TakeStatus s);

class EchoCache;

// ---- leases and reservations ---------------------------------------------------------------

/// Read access to one emitted copy of a sample. Move-only RAII: the slot is not reused while a
/// lease on it exists. The memory is shared by all copies of the sample: never write through it.
class ECHOPIPE_API SampleLease {
 public:
  SampleLease() = default;
  SampleLease(SampleLease&& other) noexcept;
  SampleLease& operator=(SampleLease&& other) noexcept;
  SampleLease(const SampleLease&) = delete;
  SampleLease& operator=(const SampleLease&) = delete;
  ~SampleLease();

  /// False for a default-constructed or moved-from lease.
  bool valid() const { return cache_ != nullptr; }
  /// Drops the reader reference now (the destructor does it otherwise). Idempotent.
  void release();

  const SampleDesc& desc() const;
  /// A hint that desc(), data() and nbytes() are about to be read: starts the lease's slot
  /// record on its way to the cache.
  void prefetch_record() const noexcept;
  /// Host pointer to field `i` (0 <= i < desc().num_fields); 64-byte aligned.
  const void* data(int field) const;
  /// Device pointer to field `i` when the arena is pinned and mapped, or a device arena (then
  /// data() is the same device pointer); else nullptr.
  const void* device_data(int field) const;
  size_t nbytes(int field) const;
  /// Monotonic id the cache gave this sample when it was committed (0, 1, 2, ...).
  uint64_t sample_id() const;
  /// Which copy this is: 0 .. tickets()-1 (in the order the copies were drawn).
  uint32_t emission() const { return emission_; }
  /// Total tickets (copies) of this sample's unit.
  uint32_t tickets() const;
  /// Index of the sample inside its unit (always 0 in example mode; put order in batch mode).
  uint32_t index_in_unit() const { return index_in_unit_; }
  /// Slot index in the cache (stable while the lease lives; for diagnostics).
  uint32_t slot() const { return slot_; }
  /// The cache this lease reads from (kept alive by the lease, see EchoCache::create).
  EchoCache* cache() const { return cache_; }

 private:
  friend class EchoCache;
  friend void release_leases(std::vector<SampleLease>& leases);
  // A plain pointer: the cache counts its leases (one atomic add per take, not one shared_ptr
  // copy per sample) and is deleted by whichever comes last, its owners or its leases.
  EchoCache* cache_ = nullptr;
  uint32_t slot_ = 0;
  uint32_t unit_ = 0;
  uint32_t emission_ = 0;
  uint32_t index_in_unit_ = 0;
};

/// A slot reserved for zero-copy put: write each field into `field_data(i)`, then
/// EchoCache::commit(). Move-only; destroying an uncommitted reservation aborts it.
class ECHOPIPE_API PutReservation {
 public:
  PutReservation() = default;
  PutReservation(PutReservation&& other) noexcept;
  PutReservation& operator=(PutReservation&& other) noexcept;
  PutReservation(const PutReservation&) = delete;
  PutReservation& operator=(const PutReservation&) = delete;
  ~PutReservation();

  bool valid() const { return cache_ != nullptr; }
  /// Writable host pointer to field `i` of the reserved extent.
  void* field_data(int field) const;
  const SampleDesc& desc() const;
  uint32_t slot() const { return slot_; }

 private:
  friend class EchoCache;
  std::shared_ptr<EchoCache> cache_;
  uint32_t slot_ = 0;
};

// ---- statistics ----------------------------------------------------------------------------

struct EchoStats {
  uint64_t fresh_in = 0;  ///< samples committed
  uint64_t emitted = 0;   ///< sample copies handed out by take
  uint64_t resident = 0;  ///< samples occupying a slot (with tickets, leased, or reserved)
  uint64_t resident_with_tickets = 0;  ///< samples still drawable
  uint64_t tickets_left = 0;           ///< tickets in the index (units; = samples in example mode)
  uint64_t retired = 0;                ///< samples whose slot was freed
  uint64_t bytes_used = 0;             ///< arena bytes in live extents
  uint64_t capacity_bytes = 0;
  uint64_t capacity_samples = 0;
  /// Slots a draw probes: above every used one (the allocator's high-water mark, which puts
  /// bring down again once the top slots are free).
  uint64_t probe_slots = 0;
  /// emit_histogram[k] = retired samples that were emitted exactly k times (index 0..kMaxHist-1).
  std::vector<uint64_t> emit_histogram;
  /// Mean number of emissions (cache-wide) between two consecutive copies of the same unit.
  double mean_reuse_distance = 0.0;
  uint64_t reuse_pairs = 0;  ///< how many copy pairs the mean is over
  MemoryKind memory_kind = MemoryKind::kPageable;
  uint64_t puts_blocked = 0;       ///< puts that had to wait for space
  uint64_t producers_waiting = 0;  ///< puts (and wait_for_room calls) blocked for space now
  double put_blocked_seconds = 0.0;
  uint64_t takes_waited = 0;  ///< takes that had to wait for samples
  double take_wait_seconds = 0.0;
  bool closed = false;
  bool input_ended = false;  ///< end_of_input() called (and not reset)
};

// ---- the cache -----------------------------------------------------------------------------

class ECHOPIPE_API EchoCache : public std::enable_shared_from_this<EchoCache> {
 public:
  /// Validates `config` (std::invalid_argument naming the bad value) and allocates the arena
  /// (std::runtime_error if the memory cannot be allocated, or pinned is requested without a
  /// CUDA device). The name is informational; use create_cache() to register one.
  /// Leases keep the cache alive without holding a shared_ptr: the shared_ptr's deleter only
  /// marks the cache orphaned while leases exist, and the last lease release deletes it.
  static std::shared_ptr<EchoCache> create(const EchoConfig& config, std::string name = "");
  ~EchoCache();  ///< closes the cache and frees the arena (no lease can exist any more by then)
  EchoCache(const EchoCache&) = delete;
  EchoCache& operator=(const EchoCache&) = delete;

  // -- producers (any number of threads) --

  /// Copies one sample in. `field_data[i]` points at desc.fields[i].nbytes() dense bytes.
  /// Blocks while the cache is full; timeout_s < 0 waits forever (still woken by close()),
  /// 0 never waits. Throws std::invalid_argument for a bad desc, SampleTooLargeError for a sample
  /// larger than the arena (its message names both sizes; refused_sample_bytes() keeps it).
  PutStatus put(const SampleDesc& desc, const void* const* field_data, double timeout_s = -1.0);
  /// Copies `rows` samples in, each described by `desc`: field f of row i is the
  /// desc.fields[f].nbytes() dense bytes at field_data[f] + i * nbytes. Slots are reserved in
  /// chunks under one allocator lock each; the timeout applies to each wait for space. Returns
  /// kOk with *done == rows, or the status that stopped it with *done rows stored before.
  PutStatus put_rows(const SampleDesc& desc, const void* const* field_data, size_t rows,
                     double timeout_s, size_t* done);
  /// Zero-copy put, phase 1: reserves a slot and an extent (same blocking rules as put). On kOk,
  /// `out` is valid; fill the fields then commit(out). On any other status `out` is invalid.
  PutStatus reserve(const SampleDesc& desc, PutReservation& out, double timeout_s = -1.0);
  /// Phase 2: publishes the reserved sample (assigns its sample_id). Returns kOk, or kClosed if
  /// the cache was closed meanwhile (the sample is dropped). `r` is invalid afterwards.
  PutStatus commit(PutReservation& r);
  /// Gives a reservation back without publishing it. Idempotent on an invalid reservation.
  void abort(PutReservation& r);

  /// Blocks until at least n slots are free (n <= capacity_samples), as a put would for one
  /// sample: kOk, kTimeout, kClosed, or kEnded after end_of_input(). The caller counts as a
  /// blocked producer meanwhile (takers may then take short batches and skip min_fill). Throws
  /// std::invalid_argument for n > capacity_samples (it could never succeed).
  PutStatus wait_for_room(size_t n, double timeout_s = -1.0);

  // -- consumers (any number of threads) --

  /// Appends up to n sample copies to `out`, drawn uniformly at random among resident units with
  /// tickets. Strong guarantee: it throws (bad n, no memory for `out`) before any ticket is
  /// claimed, so on an exception `out` and the cache are unchanged. Example mode: n samples. Batch
  /// mode: n must be a multiple of batch_size and the result is n / batch_size whole batches, each
  /// in put order. All or nothing: on kTimeout / kClosed / kEnd nothing is appended. Fewer than n
  /// only for the partial last batch after end_of_input(), or when producers are blocked on a full
  /// cache holding fewer than n tickets. Throws std::invalid_argument for n == 0 or (batch mode) n
  /// not a multiple of batch_size.
  TakeStatus take(size_t n, std::vector<SampleLease>& out, double timeout_s = -1.0);
  /// Hands copies taken but not delivered back to the cache: each unit's ticket returns to the
  /// index (it is drawn again later, by any taker) and `emitted` drops by the copies handed back,
  /// as if they had never been taken. For a caller whose own work after take() failed (the
  /// Python take_batch when it cannot gather the batch), so that nothing is lost. `leases` must
  /// come from take() on this cache, unreleased, each unit's members together (as take() returns
  /// them); whole units are handed back and any other lease is released. Clears `leases`.
  /// Takes no mutex, like a release, except to wake waiting takers (as a put does). A copy handed
  /// back after another taker already got kEnd is drawn by the next take(). Emission numbers stay
  /// unique per unit only with one consumer: with several, a copy handed back may reuse the number
  /// of a copy drawn meanwhile.
  void give_back(std::vector<SampleLease>& leases) noexcept;

  // -- stream control (any thread) --

  /// No more input: consumers drain the remaining tickets and then get kEnd; new puts get kEnded.
  /// Reservations made before still commit. In batch mode a partial open batch is published.
  void end_of_input();
  /// Starts a new input stream: puts are accepted again after end_of_input(), resident samples
  /// that still hold tickets stay drawable, and the units put from now on start a new block of
  /// epoch_size (also without a prior end_of_input(): EchoLoader starts its epochs so).
  void reset_input();
  /// Wakes every blocked put/take (they return kClosed within 100 ms) and rejects new ones.
  /// Idempotent, callable from any thread, including destructors and interpreter exit.
  void close();
  bool closed() const;

  // -- introspection --

  /// The configuration the cache was created with (config().echo_factor is the initial factor;
  /// echo_factor() is the current one).
  const EchoConfig& config() const { return config_; }
  /// Current echo factor: the initial one, or the last set_echo_factor() / restored one.
  double echo_factor() const;
  /// Changes e at run time (any thread, lock-free): units published after the call get
  /// floor(e)/ceil(e) tickets; units already in the cache keep theirs, so every sample is still
  /// emitted exactly its ticket count. Throws std::invalid_argument naming the value unless
  /// 1 <= e <= kMaxEchoFactor and finite.
  void set_echo_factor(double e);
  /// Gives every unit still in the cache (holding tickets or readers) the tickets the current
  /// factor gives a unit published now, where that is more than it was given, and returns the
  /// tickets added. After set_echo_factor() raised e, the samples published at the lower factor
  /// are then echoed as often as the ones that follow them; units already retired are not
  /// brought back. Takes the allocator's lock for one pass over the cache's slots (producers
  /// wait meanwhile); draws go on. The factors an "auto" controller chooses use it, so that the
  /// samples published before its first decision are not used once each.
  uint64_t top_up();
  const std::string& name() const { return name_; }
  /// True in a process forked from the one that created this cache (fork_generation() moved on
  /// since). There every operation that reads or changes the cache throws CacheForkedError,
  /// close() does nothing (its locks may be held by threads that exist only in the parent), and
  /// the copy is never destroyed (the process's exit frees it).
  bool forked() const noexcept;
  /// Throws CacheForkedError (naming the cache and both processes) when forked().
  void check_process() const;
  /// Process-unique handle (also the registry key for find_cache(uint64_t)).
  uint64_t handle() const { return handle_; }
  /// kPinned, kPageable or kDevice: what the arena actually is (never kAuto).
  MemoryKind memory_kind() const;
  /// Host base address of the arena.
  const void* arena_host() const;
  /// Device address of the arena: the mapped pinned arena (cudaHostGetDevicePointer) or the
  /// device arena; nullptr if pageable.
  const void* arena_device() const;
  EchoStats stats() const;
  /// Extent bytes of the largest sample put() (or reserve()) refused with SampleTooLargeError, 0
  /// when none was. A DALI sink's refusal reaches Python only as the operator's message text;
  /// this lets the caller name the typed error instead.
  uint64_t refused_sample_bytes() const;

  // -- checkpointing --

  /// Serialises resident samples that still hold tickets (with data, slots and tickets left),
  /// the open batch, the set of free slots, the RNG/draw counters and the statistics, holding the
  /// batch-assembly and allocator locks (no put, publish or slot reuse meanwhile). Draws are
  /// lock-free, so quiesce consumers (and producers) for a snapshot aligned with the stream.
  /// Samples in uncommitted reservations or in leases are not included (their copies are out).
  /// Format: magic "ECHOCAC1", version 4.
  std::vector<uint8_t> save_state() const;
  /// Loads a save_state() blob into this cache, which must be empty (nothing committed yet) and
  /// have the same mode, batch_size and capacity_samples, and room for the saved bytes. The
  /// echo factor is runtime state: the cache adopts the saved current factor. Strong guarantee:
  /// the blob is parsed and placed completely before anything is committed, so on
  /// CacheStateError (bad magic/version, mismatch, size, corruption, a cache not empty) the cache
  /// is unchanged. The sample bytes are copied into the (empty) arena before any of the cache's
  /// state is written, so a failing copy (a device arena's cudaMemcpy: std::runtime_error) leaves
  /// it unchanged too.
  void restore_state(const uint8_t* data, size_t size);

  // -- the DALI sink's side state (so that Python and the plugin share one registry) --

  /// The sink stores at most `remaining` more fresh samples (< 0: unlimited, the default).
  void set_quota(int64_t remaining);
  int64_t quota() const;
  /// Takes one unit of the quota (lock-free): true if one more sample may be stored.
  bool take_quota();
  /// Tensor layouts ("HWC", "" when none) of each field, as the sink saw them.
  void set_layouts(std::vector<std::string> layouts);
  std::vector<std::string> layouts() const;
  /// Records the layout of field `field` (cheap when unchanged). Throws std::invalid_argument
  /// for a field outside [0, kMaxFields).
  void record_layout(int field, std::string_view layout);

  // internal: used by leases and reservations
  struct Impl;

 private:
  EchoCache(const EchoConfig& config, std::string name);
  friend class SampleLease;
  friend class PutReservation;
  friend void release_leases(std::vector<SampleLease>& leases);
  void release_reader(uint32_t unit);
  // Drops n lease references; deletes the cache when they were the last and no owner is left.
  static void drop_leases(EchoCache* cache, uint64_t n) noexcept;
  // reserve()/commit() without a PutReservation: put() uses these so that a copying put does not
  // touch the shared_ptr control block (an atomic shared with every consumer's leases).
  PutStatus reserve_slot(const SampleDesc& desc, double timeout_s, uint32_t* slot);
  // Reserves 1..max slots of `desc` under one allocator lock (blocking only for the first);
  // returns how many, 0 with *status set otherwise.
  size_t reserve_slots(const SampleDesc& desc, double timeout_s, uint32_t* slots, size_t max,
                       PutStatus* status);
  PutStatus commit_slot(uint32_t slot);
  // Gives n reserved, uncommitted slots back (abort, or a put whose copy in failed): freed, no
  // longer pending (which may seal an ended input), and a blocked producer woken.
  void unreserve(const uint32_t* slots, size_t n);
  // Example mode: publishes n reserved slots with one update of each shared counter.
  void commit_slots_example(const uint32_t* slots, size_t n);

  EchoConfig config_;
  std::string name_;
  uint64_t handle_ = 0;
  uint64_t fork_generation_ = 0;  // fork_generation() when created: another one means forked()
  int64_t creator_pid_ = 0;
  std::unique_ptr<Impl> impl_;
};

// ---- reading helpers -----------------------------------------------------------------------

/// Releases every lease (like destroying them) and clears `leases`, but retires the samples
/// whose last reader this drops with one push per cache instead of one per sample.
ECHOPIPE_API void release_leases(std::vector<SampleLease>& leases);

/// Bytes gather() writes for `field` over `leases` (sum of the field sizes).
ECHOPIPE_API size_t gather_bytes(const std::vector<SampleLease>& leases, int field);
/// Copies field `field` of every lease, in order, back to back into `dst` (memcpy; ready for one
/// H2D copy). When `offsets` is non-null it receives leases.size() + 1 byte offsets (ragged
/// samples). Throws std::invalid_argument for a bad field index.
ECHOPIPE_API void gather(const std::vector<SampleLease>& leases, int field, void* dst,
                         int64_t* offsets);

// ---- registry (one per process, lives in libechopipe_core.so) ------------------------------

/// Creates and registers a cache. An empty name gets the first free "echo-<n>".
/// Throws std::invalid_argument if the name is taken by a cache of this process (or the config
/// is bad); a forked() cache inherited from the parent process gives its name up.
ECHOPIPE_API std::shared_ptr<EchoCache> create_cache(const std::string& name,
                                                     const EchoConfig& config);
/// Registered cache by name or handle, or nullptr (in a forked process also an inherited, forked()
/// one: using it throws CacheForkedError, which says more than "no such cache").
ECHOPIPE_API std::shared_ptr<EchoCache> find_cache(const std::string& name);
ECHOPIPE_API std::shared_ptr<EchoCache> find_cache(uint64_t handle);
/// Unregisters (does not close) a cache; returns false if the name was unknown.
ECHOPIPE_API bool remove_cache(const std::string& name);
/// Unregisters the cache `name` only if it is the one with `handle` (a cache inherited from the
/// parent of a forked process may have been replaced there by a new one of the same name).
ECHOPIPE_API bool remove_cache(const std::string& name, uint64_t handle);
/// Forks this process descends from since libechopipe_core.so was loaded: 0 in the process that
/// loaded it, one more in each forked child (a pthread_atfork handler, which also keeps the
/// registry's lock consistent across fork()). A cache made at another generation is forked().
ECHOPIPE_API uint64_t fork_generation() noexcept;
/// Names of registered caches.
ECHOPIPE_API std::vector<std::string> cache_names();

// ---- CUDA availability (lazy: the runtime is first touched by these calls) ----------------

/// True when built with CUDA kernels (ECHOPIPE_WITH_CUDA).
ECHOPIPE_API bool built_with_cuda();
/// Number of CUDA devices the runtime sees now; 0 without CUDA, driver or device.
ECHOPIPE_API int cuda_device_count();
/// built_with_cuda() && cuda_device_count() > 0.
ECHOPIPE_API bool cuda_available();

}  // namespace echopipe
