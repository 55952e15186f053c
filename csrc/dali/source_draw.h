// The echo sources' blocking draw and the GPU source's queue of batches whose copies may still
// run. Plain C++ (no DALI or CUDA headers): tests/cpp/test_gpu_source_draw.cc runs the GPU
// source's draw-and-hold cycle with them against a real cache on a machine without a GPU.
//
// Why the draw calls back while it waits: the GPU source keeps the leases of earlier batches
// until their copies on DALI's stream have ended (up to two batches besides the one it draws).
// The cache's size rule (max(shuffle_buffer, batch_size) + upstream batch) counts one batch held
// by the consumer, so at that size the slots of finished batches may be all that stands between
// the sink and a free slot; a draw that blocks without returning them can wait forever.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <utility>
#include <vector>

#include "echo/echo_cache.h"

namespace echopipe_dali {

/// How a draw ended: the batch is full, the input ended first, or the cache was closed.
enum class DrawEnd { kFull, kEnded, kClosed };

/// Takes from `cache` into `leases` until it holds `batch_size` samples. Each wait is bounded
/// (100 ms), so close() from Python ends the loop; after every wait that took nothing,
/// `between_attempts` runs (when set) to give back what the caller no longer needs. Batch mode
/// hands out whole units, `batch_size / unit` of them per batch, and only the input's last unit
/// may be short: a batch that drew it ends short (kFull, padded by the caller) rather than
/// taking another unit into the room it left, so the batches of a pass do not depend on which
/// draws meet the short unit (ceil(unit copies / units per batch), the same on every rank).
inline DrawEnd take_batch(echopipe::EchoCache& cache, int batch_size,
                          std::vector<echopipe::SampleLease>& leases,
                          const std::function<void()>& between_attempts) {
  const auto& config = cache.config();
  const bool units_of_batches = config.mode == echopipe::EchoMode::kBatch;
  const size_t unit = units_of_batches ? config.batch_size : 1;
  const size_t per_batch = static_cast<size_t>(batch_size) / unit;
  size_t units = 0;
  for (const auto& lease : leases) units += !units_of_batches || lease.index_in_unit() == 0;
  while (units < per_batch) {
    const size_t before = leases.size();
    auto status = cache.take((per_batch - units) * unit, leases, 0.1);
    if (status == echopipe::TakeStatus::kOk) {
      // A take may end with fewer units than asked (a full cache's producer waits): counted
      // by their first samples, so the rest of the batch is whole units again.
      for (size_t i = before; i < leases.size(); ++i) {
        units += !units_of_batches || leases[i].index_in_unit() == 0;
      }
      continue;
    }
    if (status == echopipe::TakeStatus::kTimeout) {
      if (between_attempts) between_attempts();
      continue;
    }
    return status == echopipe::TakeStatus::kClosed ? DrawEnd::kClosed : DrawEnd::kEnded;
  }
  return DrawEnd::kFull;
}

/// Batches whose device copies were queued and may still run, oldest first. A flight holds the
/// leases (and buffers) its copies read; it is dropped only once `done(flight)` says the copies
/// have ended, or after `wait(flight)` has waited for them.
template <typename Flight>
class FlightQueue {
 public:
  void push(Flight flight) { flights_.push_back(std::move(flight)); }
  size_t size() const { return flights_.size(); }

  /// Drops the finished flights from the front (calling `retired(flight)` first), and waits for
  /// the oldest ones while more than `max_pending` would remain.
  template <typename Done, typename Wait, typename Retired>
  void retire(size_t max_pending, Done&& done, Wait&& wait, Retired&& retired) {
    while (!flights_.empty()) {
      Flight& front = flights_.front();
      if (flights_.size() > max_pending) {
        wait(front);
      } else if (!done(front)) {
        break;
      }
      retired(front);
      flights_.pop_front();
    }
  }

 private:
  std::deque<Flight> flights_;
};

}  // namespace echopipe_dali
