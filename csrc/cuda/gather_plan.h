// Host-side plan of a batched gather: the pointer tables travel to the kernel as ONE by-value
// kernel parameter (__grid_constant__), not through a device allocation and a host->device copy,
// so the host call stays asynchronous and allocates nothing. A batch larger than one table is
// split into chunks, one launch each. Plain C++ (no CUDA headers) so the plan is testable on a
// machine without nvcc (tests/test_gpu_plan.py compiles it with the host compiler).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace echopipe::cuda {

// sm_70+ with CUDA >= 12.1 accepts 32764 bytes of kernel parameters; older toolkits 4096. Both
// architectures built (sm_80, sm_90) qualify, so the toolkit decides. The tables leave room for
// the kernels' other parameters.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
inline constexpr size_t kParamBytes = 32764;
#else
inline constexpr size_t kParamBytes = 4096;
#endif
inline constexpr size_t kParamReserve = 256;

/// Ragged byte ranges: sample i of the chunk is read from src[i] and written to
/// dst + offset[i] .. dst + offset[i + 1] (offsets are from the start of the whole batch).
template <int K>
struct BytesTable {
  int32_t count;
  const uint8_t* src[K];
  int64_t offset[K + 1];
};

/// Same-shape images: sample i of the chunk is read from src[i] and is image `first + i` of the
/// batch.
template <int K>
struct ImageTable {
  int32_t count;
  int64_t first;
  const uint8_t* src[K];
};

/// Independent byte ranges: entry i copies size[i] bytes from src[i] to dst[i]. Both sides are
/// device-accessible (mapped pinned host memory or device memory), so one launch fills a whole
/// DALI output batch whose samples need not be contiguous.
template <int K>
struct ScatterTable {
  int32_t count;
  const uint8_t* src[K];
  uint8_t* dst[K];
  int64_t size[K];
};

/// The largest table sizes that fit one kernel parameter next to the reserve.
inline constexpr int kBytesEntries =
    static_cast<int>((kParamBytes - kParamReserve - 16) / (sizeof(void*) + sizeof(int64_t)));
inline constexpr int kImageEntries =
    static_cast<int>((kParamBytes - kParamReserve - 16) / sizeof(void*));
inline constexpr int kScatterEntries =
    static_cast<int>((kParamBytes - kParamReserve - 16) / (2 * sizeof(void*) + sizeof(int64_t)));
static_assert(sizeof(BytesTable<kBytesEntries>) + kParamReserve <= kParamBytes);
static_assert(sizeof(ScatterTable<kScatterEntries>) + kParamReserve <= kParamBytes);
static_assert(sizeof(ImageTable<kImageEntries>) + kParamReserve <= kParamBytes);

/// Calls `launch(table, max_size)` once per chunk of at most K samples, in batch order;
/// `max_size` is the largest sample of that chunk (it sizes the grid). Returns the total bytes.
template <int K, typename Launch>
int64_t for_each_bytes_chunk(const void* const* src, const int64_t* sizes, int64_t n,
                             Launch&& launch) {
  BytesTable<K> t{};
  int64_t total = 0;
  for (int64_t first = 0; first < n; first += K) {
    const int count = static_cast<int>(std::min<int64_t>(K, n - first));
    t.count = count;
    int64_t max_size = 0;
    for (int i = 0; i < count; ++i) {
      t.src[i] = static_cast<const uint8_t*>(src[first + i]);
      t.offset[i] = total;
      total += sizes[first + i];
      max_size = std::max(max_size, sizes[first + i]);
    }
    t.offset[count] = total;
    launch(t, max_size);
  }
  return total;
}

/// Calls `launch(table, max_size)` once per chunk of at most K ranges, in order; `max_size` is
/// the largest range of that chunk (it sizes the grid). Returns the total bytes.
template <int K, typename Launch>
int64_t for_each_scatter_chunk(const void* const* src, void* const* dst, const int64_t* sizes,
                               int64_t n, Launch&& launch) {
  ScatterTable<K> t{};
  int64_t total = 0;
  for (int64_t first = 0; first < n; first += K) {
    const int count = static_cast<int>(std::min<int64_t>(K, n - first));
    t.count = count;
    int64_t max_size = 0;
    for (int i = 0; i < count; ++i) {
      t.src[i] = static_cast<const uint8_t*>(src[first + i]);
      t.dst[i] = static_cast<uint8_t*>(dst[first + i]);
      t.size[i] = sizes[first + i];
      total += sizes[first + i];
      max_size = std::max(max_size, sizes[first + i]);
    }
    launch(t, max_size);
  }
  return total;
}

/// Calls `launch(table)` once per chunk of at most K images, in batch order.
template <int K, typename Launch>
void for_each_image_chunk(const void* const* src, int64_t n, Launch&& launch) {
  ImageTable<K> t{};
  for (int64_t first = 0; first < n; first += K) {
    const int count = static_cast<int>(std::min<int64_t>(K, n - first));
    t.count = count;
    t.first = first;
    for (int i = 0; i < count; ++i) t.src[i] = static_cast<const uint8_t*>(src[first + i]);
    launch(t);
  }
}

/// Blocks per sample for a byte gather: enough that a large sample is read by many SMs at once
/// (zero-copy reads need many loads in flight), capped so tiny samples get one block.
inline unsigned blocks_per_sample(int64_t max_size, int64_t bytes_per_block) {
  const int64_t b = (max_size + bytes_per_block - 1) / bytes_per_block;
  return static_cast<unsigned>(std::clamp<int64_t>(b, 1, 64));
}

}  // namespace echopipe::cuda
