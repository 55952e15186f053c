// How the DALI GPU echo source fills its output batch, and the batch's copy plan. Plain C++ (no
// CUDA or DALI headers), so tests/test_gpu_plan.py checks it with the host compiler.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace echopipe::cuda {

/// The source's copy path. kGather is the default: one launch of gather_scatter per batch.
/// kBatch (cudaMemcpyBatchAsync) and kEach (one cudaMemcpyAsync per field of each sample) exist
/// so the benchmark can measure them against it; kEach is also the fallback when a source is not
/// device-accessible (a pageable arena).
enum class CopyMode { kGather, kBatch, kEach };

/// The environment variable that selects the mode for every GPU echo source of the process.
inline constexpr const char* kCopyModeEnv = "ECHOPIPE_GPU_SOURCE_COPY";

/// Parses "gather" | "batch" | "each" (nullptr or "" = "gather"); std::invalid_argument naming
/// the value and the variable otherwise.
inline CopyMode copy_mode_from_name(const char* name) {
  const std::string_view v = name == nullptr ? std::string_view() : std::string_view(name);
  if (v.empty() || v == "gather") return CopyMode::kGather;
  if (v == "batch") return CopyMode::kBatch;
  if (v == "each") return CopyMode::kEach;
  throw std::invalid_argument(std::string(kCopyModeEnv) +
                              " must be 'gather', 'batch' or 'each', got '" + std::string(v) + "'");
}

inline const char* copy_mode_name(CopyMode mode) {
  switch (mode) {
    case CopyMode::kGather:
      return "gather";
    case CopyMode::kBatch:
      return "batch";
    case CopyMode::kEach:
      return "each";
  }
  return "unknown";
}

/// Test hooks: microseconds of a spin kernel queued on DALI's stream before the GPU sink's
/// copies into the cache, or before the GPU source's copies out of it, so that a missing wait
/// or hold shows as wrong bytes (tests/test_gpu_races.py). Unset or 0: no spin.
inline constexpr const char* kSinkSpinEnv = "ECHOPIPE_GPU_TEST_SINK_SPIN_US";
inline constexpr const char* kSourceSpinEnv = "ECHOPIPE_GPU_TEST_SOURCE_SPIN_US";

/// Nanoseconds from the value of `variable` (microseconds, an integer in [0, 10^7]; nullptr or
/// "" = 0); std::invalid_argument naming the variable and the value otherwise.
inline int64_t spin_ns_from_env(const char* variable, const char* value) {
  const std::string_view v = value == nullptr ? std::string_view() : std::string_view(value);
  if (v.empty()) return 0;
  int64_t us = 0;
  for (char c : v) {
    if (c < '0' || c > '9' || us > 10'000'000) {
      us = -1;
      break;
    }
    us = us * 10 + (c - '0');
  }
  if (us < 0 || us > 10'000'000) {
    throw std::invalid_argument(std::string(variable) +
                                " must be whole microseconds in [0, 10000000], got '" +
                                std::string(v) + "'");
  }
  return us * 1000;
}

/// The copies of one output batch: entry i moves size[i] bytes from src[i] to dst[i]. Sources a
/// kernel cannot read (host pageable memory) make the whole batch take the per-copy path.
struct CopyPlan {
  std::vector<const void*> src;
  std::vector<void*> dst;
  std::vector<int64_t> size;
  bool device_readable = true;

  void clear() {
    src.clear();
    dst.clear();
    size.clear();
    device_readable = true;
  }
  /// `device_src` is the device-readable address of the data, or nullptr when only the host
  /// address `host_src` can be read (then the copy runs through cudaMemcpyAsync).
  void add(const void* device_src, const void* host_src, void* to, int64_t bytes) {
    if (bytes == 0) return;
    if (device_src == nullptr) device_readable = false;
    src.push_back(device_src != nullptr ? device_src : host_src);
    dst.push_back(to);
    size.push_back(bytes);
  }
  int64_t count() const { return static_cast<int64_t>(src.size()); }
  /// The mode this batch runs with: the requested one, or kEach when a source is host-only.
  CopyMode effective(CopyMode requested) const {
    return device_readable ? requested : CopyMode::kEach;
  }
};

}  // namespace echopipe::cuda
