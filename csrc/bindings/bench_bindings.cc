// Native benchmark drivers for bench/echo_cache.py: the extension module _bench_native, built only
// with ECHOPIPE_BUILD_BENCH=ON into the build folder and never installed, so not in the wheel (it
// links the same core library). At 4 KB per sample a Python loop costs more than the cache
// itself, so the measured loops (producer and consumer threads around one cache, and the memcpy
// limit over the same bytes) run here in C++, with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings/gil.h"
#include "echo/echo_cache.h"
#include "echo/echo_cache_impl.h"  // detail::splitmix64

namespace py = pybind11;
using namespace echopipe;
using echopipe::bindings::without_gil;
using Clock = std::chrono::steady_clock;

namespace {

// One uint8 field of `sample_bytes`.
SampleDesc bytes_sample(size_t sample_bytes) {
  SampleDesc d;
  d.num_fields = 1;
  d.fields[0].dtype = DType::kUInt8;
  d.fields[0].ndim = 1;
  d.fields[0].shape[0] = static_cast<int64_t>(sample_bytes);
  return d;
}

// The 64 MB (at least one sample) the producers copy from, standing in for decoded images.
std::vector<uint8_t> source_pool(size_t sample_bytes) {
  std::vector<uint8_t> pool(std::max<size_t>(size_t{64} << 20, sample_bytes));
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<uint8_t>(i * 131u);
  return pool;
}

py::dict bench_put_take(size_t sample_bytes, size_t n_fresh, int producers, int consumers,
                        double echo_factor, size_t capacity_bytes, size_t batch, size_t min_fill,
                        uint64_t seed) {
  if (sample_bytes == 0 || n_fresh == 0 || producers < 1 || consumers < 1 || batch < 1) {
    throw std::invalid_argument("bench: sizes and thread counts must be >= 1");
  }
  const SampleDesc d = bytes_sample(sample_bytes);
  EchoConfig cfg;
  cfg.capacity_bytes = capacity_bytes;
  cfg.capacity_samples = std::max<size_t>(capacity_bytes / d.extent_bytes(), 1);
  cfg.echo_factor = echo_factor;
  cfg.min_fill = std::min(min_fill, cfg.capacity_samples);
  cfg.seed = seed;
  cfg.memory = MemoryKind::kPageable;
  auto cache = EchoCache::create(cfg, "bench");
  // Fault the arena in before timing, as a long-running job would have.
  std::memset(const_cast<void*>(cache->arena_host()), 0, capacity_bytes);
  const std::vector<uint8_t> pool = source_pool(sample_bytes);
  const size_t pool_samples = pool.size() / sample_bytes;

  std::atomic<size_t> next{0};
  std::atomic<uint64_t> copies{0}, checksum{0};
  std::vector<std::thread> threads;
  double seconds = 0;
  without_gil([&] {
    auto start = Clock::now();
    for (int p = 0; p < producers; ++p) {
      threads.emplace_back([&] {
        for (;;) {
          size_t i = next.fetch_add(1, std::memory_order_relaxed);
          if (i >= n_fresh) break;
          const void* src = pool.data() + (i % pool_samples) * sample_bytes;
          if (cache->put(d, &src, -1) != PutStatus::kOk) break;
        }
      });
    }
    for (int c = 0; c < consumers; ++c) {
      threads.emplace_back([&] {
        std::vector<uint8_t> dst(batch * sample_bytes);
        std::vector<SampleLease> out;
        uint64_t local = 0, sum = 0;
        for (;;) {
          release_leases(out);  // the previous batch: one allocator lock for all its retires
          if (cache->take(batch, out, -1) != TakeStatus::kOk) break;
          gather(out, 0, dst.data(), nullptr);
          sum += dst[0];
          local += out.size();
        }
        copies.fetch_add(local);
        checksum.fetch_add(sum);
      });
    }
    for (int p = 0; p < producers; ++p) threads[p].join();
    cache->end_of_input();
    for (size_t i = producers; i < threads.size(); ++i) threads[i].join();
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  });
  EchoStats st = cache->stats();
  py::dict r;
  r["seconds"] = seconds;
  r["fresh"] = st.fresh_in;
  r["copies"] = copies.load();
  r["bytes_out"] = copies.load() * sample_bytes;
  r["puts_blocked"] = st.puts_blocked;
  r["takes_waited"] = st.takes_waited;
  r["put_blocked_seconds"] = st.put_blocked_seconds;
  r["take_wait_seconds"] = st.take_wait_seconds;
  r["mean_reuse_distance"] = st.mean_reuse_distance;
  r["capacity_samples"] = cfg.capacity_samples;
  r["checksum"] = checksum.load();
  return r;
}

// memcpy of `n_copies` samples out of a `src_bytes` region into a per-thread batch buffer, split
// over `threads`: the same copy-out work the consumers do. The region is walked in order
// (wrapping), or with `random_order` each sample comes from a uniformly drawn position, as a
// take draws them.
py::dict bench_memcpy(size_t sample_bytes, size_t n_copies, int threads, size_t src_bytes,
                      size_t batch, bool random_order) {
  if (sample_bytes == 0 || threads < 1 || src_bytes < sample_bytes || batch < 1) {
    throw std::invalid_argument("bench_memcpy: bad sizes");
  }
  // The source is an echo cache's own (empty) arena: both sides read through the same kind of
  // pages (huge ones for a large pageable arena).
  EchoConfig cfg;
  cfg.capacity_bytes = src_bytes;
  cfg.capacity_samples = 1;
  cfg.min_fill = 0;
  cfg.memory = MemoryKind::kPageable;
  auto region = EchoCache::create(cfg, "bench-memcpy-source");
  auto* src = static_cast<uint8_t*>(const_cast<void*>(region->arena_host()));
  std::memset(src, 1, src_bytes);
  const size_t src_samples = src_bytes / sample_bytes;
  double seconds = 0;
  std::atomic<uint64_t> sink{0};
  without_gil([&] {
    std::vector<std::thread> th;
    auto start = Clock::now();
    for (int t = 0; t < threads; ++t) {
      th.emplace_back([&, t] {
        std::vector<uint8_t> dst(batch * sample_bytes);
        size_t share = n_copies / threads + (static_cast<size_t>(t) < n_copies % threads);
        size_t pos = static_cast<size_t>(t) * (src_samples / threads);
        const uint64_t key = detail::splitmix64(static_cast<uint64_t>(t) + 1);
        uint64_t s = 0;
        for (size_t i = 0; i < share; ++i) {
          const size_t at =
              random_order ? detail::splitmix64(key + i) % src_samples : pos++ % src_samples;
          std::memcpy(dst.data() + (i % batch) * sample_bytes, src + at * sample_bytes,
                      sample_bytes);
          if (i % batch == batch - 1) s += dst[0];
        }
        sink.fetch_add(s);
      });
    }
    for (auto& x : th) x.join();
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  });
  py::dict r;
  r["seconds"] = seconds;
  r["bytes"] = n_copies * sample_bytes;
  r["sink"] = sink.load();
  return r;
}

// What the copy limits share: a faulted-in arena region of `capacity_bytes` in extents of one
// sample, the source pool, and the copies out a cache run at `echo_factor` makes.
struct CopyLimit {
  CopyLimit(const char* who, size_t sample_bytes, size_t n_fresh, double echo_factor,
            size_t capacity_bytes, size_t batch)
      : sample_bytes(sample_bytes), extent(bytes_sample(sample_bytes).extent_bytes()) {
    if (sample_bytes == 0 || n_fresh == 0 || batch < 1 || !(echo_factor >= 1.0)) {
      throw std::invalid_argument(std::string(who) + ": bad sizes or echo factor");
    }
    if (capacity_bytes < extent)
      throw std::invalid_argument(std::string(who) + ": arena too small");
    EchoConfig cfg;
    cfg.capacity_bytes = capacity_bytes;
    cfg.capacity_samples = 1;
    cfg.memory = MemoryKind::kPageable;
    region = EchoCache::create(cfg, who);
    arena = static_cast<uint8_t*>(const_cast<void*>(region->arena_host()));
    std::memset(arena, 0, capacity_bytes);
    slots = capacity_bytes / extent;
    pool = source_pool(sample_bytes);
    pool_samples = pool.size() / sample_bytes;
    copies = static_cast<size_t>(std::llround(static_cast<double>(n_fresh) * echo_factor));
  }
  size_t sample_bytes;
  size_t extent;
  std::shared_ptr<EchoCache> region;
  uint8_t* arena = nullptr;
  size_t slots = 0;
  std::vector<uint8_t> pool;
  size_t pool_samples = 0;
  size_t copies = 0;

  // A limit run's figures: its seconds, the bytes the cache run would move, what the copies read.
  py::dict result(double seconds, size_t n_fresh, uint64_t sink) const {
    py::dict r;
    r["seconds"] = seconds;
    r["bytes"] = (n_fresh + copies) * sample_bytes;
    r["sink"] = sink;
    return r;
  }
};

// The copies of put_take with no cache around them: one thread copies `n_fresh` samples from the
// same 64 MB pool into consecutive extents of an arena of `capacity_bytes` (a put's copy in),
// while another copies round(n_fresh * echo_factor) samples out of uniformly drawn extents into
// its batch buffer (a take's gather), at once and with no synchronisation between them. What
// the two copies cost together on this machine's caches and memory is the most put->take can
// reach with one thread per side: the arena is larger than the LLC, so every put writes through
// to memory, which the memcpy baseline (reads only, into a batch buffer that stays cached) does
// not.
py::dict bench_bare_copies(size_t sample_bytes, size_t n_fresh, double echo_factor,
                           size_t capacity_bytes, size_t batch) {
  const CopyLimit L("bench_bare_copies", sample_bytes, n_fresh, echo_factor, capacity_bytes, batch);
  const size_t extent = L.extent, slots = L.slots, pool_samples = L.pool_samples, copies = L.copies;
  uint8_t* const arena = L.arena;
  const std::vector<uint8_t>& pool = L.pool;
  std::atomic<uint64_t> sink{0};
  double seconds = 0;
  without_gil([&] {
    auto start = Clock::now();
    std::thread in([&] {
      for (size_t i = 0; i < n_fresh; ++i) {
        std::memcpy(arena + (i % slots) * extent, pool.data() + (i % pool_samples) * sample_bytes,
                    sample_bytes);
      }
    });
    std::thread out([&] {
      std::vector<uint8_t> dst(batch * sample_bytes);
      uint64_t s = 0;
      for (size_t i = 0; i < copies; ++i) {
        const size_t at = detail::splitmix64(i + 1) % slots;
        std::memcpy(dst.data() + (i % batch) * sample_bytes, arena + at * extent, sample_bytes);
        if (i % batch == batch - 1) s += dst[0];
      }
      sink.fetch_add(s);
    });
    in.join();
    out.join();
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  });
  return L.result(seconds, n_fresh, sink.load());
}

// The same copies as bare_copies, split between the two threads as evenly as any schedule of
// them could be: one thread copies the fresh samples in, the other starts copying out (from
// random extents already written) once `fill` samples are in (the cache's warm-up), and the
// first joins the copying out when its own copies are done, both claiming chunks of 32 KB from
// one counter, so they finish together. The consumer of put_take copies e of every 1 + e bytes
// alone; this is the most one thread per side can reach on this machine when no thread ever
// idles, with no bookkeeping at all.
py::dict bench_balanced_copies(size_t sample_bytes, size_t n_fresh, double echo_factor,
                               size_t capacity_bytes, size_t batch, size_t fill) {
  const CopyLimit L("bench_balanced_copies", sample_bytes, n_fresh, echo_factor, capacity_bytes,
                    batch);
  const size_t extent = L.extent, slots = L.slots, pool_samples = L.pool_samples, copies = L.copies;
  uint8_t* const arena = L.arena;
  const std::vector<uint8_t>& pool = L.pool;
  const size_t chunk = std::max<size_t>(1, (size_t{32} << 10) / sample_bytes);
  const size_t warm = std::min(std::max<size_t>(fill, 1), n_fresh);
  std::atomic<size_t> written{0}, next_out{0};
  std::atomic<uint64_t> sink{0};
  double seconds = 0;
  // Copies chunk [j, j + chunk) out of random extents already written; false once all are out.
  auto copy_out = [&](std::vector<uint8_t>& dst, uint64_t& s) {
    const size_t j = next_out.fetch_add(chunk, std::memory_order_relaxed);
    if (j >= copies) return false;
    const size_t have = std::min(written.load(std::memory_order_acquire), slots);
    for (size_t k = j; k < std::min(copies, j + chunk); ++k) {
      const size_t at = detail::splitmix64(k + 1) % have;
      std::memcpy(dst.data() + (k % batch) * sample_bytes, arena + at * extent, sample_bytes);
      if (k % batch == batch - 1) s += dst[0];
    }
    return true;
  };
  without_gil([&] {
    auto start = Clock::now();
    std::thread in([&] {
      std::vector<uint8_t> dst(batch * sample_bytes);
      uint64_t s = 0;
      for (size_t i = 0; i < n_fresh; ++i) {
        std::memcpy(arena + (i % slots) * extent, pool.data() + (i % pool_samples) * sample_bytes,
                    sample_bytes);
        written.store(i + 1, std::memory_order_release);
      }
      while (copy_out(dst, s)) {
      }
      sink.fetch_add(s);
    });
    std::thread out([&] {
      std::vector<uint8_t> dst(batch * sample_bytes);
      uint64_t s = 0;
      while (written.load(std::memory_order_acquire) < warm) std::this_thread::yield();
      while (copy_out(dst, s)) {
      }
      sink.fetch_add(s);
    });
    in.join();
    out.join();
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  });
  return L.result(seconds, n_fresh, sink.load());
}

}  // namespace

PYBIND11_MODULE(_bench_native, m) {
  m.doc() = "echopipe benchmark drivers (bench/echo_cache.py)";
  m.def("put_take", &bench_put_take, py::arg("sample_bytes"), py::arg("n_fresh"),
        py::arg("producers"), py::arg("consumers"), py::arg("echo_factor"),
        py::arg("capacity_bytes"), py::arg("batch"), py::arg("min_fill"), py::arg("seed") = 0,
        "Native put->take(+gather) throughput of one cache; returns timings and counts.");
  m.def("memcpy", &bench_memcpy, py::arg("sample_bytes"), py::arg("n_copies"), py::arg("threads"),
        py::arg("src_bytes"), py::arg("batch"), py::arg("random_order") = false,
        "memcpy of the same copy-out bytes (the physical limit for the consumers).");
  m.def("bare_copies", &bench_bare_copies, py::arg("sample_bytes"), py::arg("n_fresh"),
        py::arg("echo_factor"), py::arg("capacity_bytes"), py::arg("batch"),
        "put_take's copies in and out on one thread each, with no cache (its physical limit).");
  m.def("balanced_copies", &bench_balanced_copies, py::arg("sample_bytes"), py::arg("n_fresh"),
        py::arg("echo_factor"), py::arg("capacity_bytes"), py::arg("batch"), py::arg("fill"),
        "bare_copies with the copies out shared by both threads after the warm-up fill.");
}
