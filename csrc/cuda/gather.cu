// CUDA kernels that gather echo-cache samples from the pinned, GPU-mapped arena straight into a
// device batch (zero-copy reads over the bus), optionally fused with uint8 -> float32
// normalisation and HWC -> CHW. The pointer tables are one by-value kernel parameter
// (gather_plan.h): a call allocates nothing and makes no host->device copy, so it stays
// asynchronous, and a batch is one launch (more only past a table's size). Reads from the mapped
// arena are 16-byte vectors, issued so that neighbouring threads read neighbouring bytes: the bus
// then carries each byte once; byte copies store 16-byte vectors too, at any destination
// alignment (copy_range.h). Host wrappers are declared in gather.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/copy_range.h"
#include "cuda/gather.h"
#include "cuda/gather_plan.h"

namespace echopipe::cuda {
namespace {

constexpr int kThreads = 256;
// A byte-gather block moves about this much per sample before another block shares the sample.
constexpr int64_t kBytesPerBlock = 16 * 1024;
// Pixels per thread in the normalise kernel: 16 pixels of C channels are C whole 16-byte vectors.
constexpr int kPix = 16;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err));
  }
}

__host__ __device__ inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Grid: x = blocks sharing one sample, y = sample of the chunk.
template <int K>
__global__ void __launch_bounds__(kThreads)
    gather_bytes_kernel(const __grid_constant__ BytesTable<K> t, uint8_t* dst) {
  const int s = blockIdx.y;
  copy_range(t.src[s], dst + t.offset[s], t.offset[s + 1] - t.offset[s],
             static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x,
             static_cast<int64_t>(gridDim.x) * kThreads);
}

// Grid: x = blocks sharing one range, y = range of the chunk (each with its own destination).
template <int K>
__global__ void __launch_bounds__(kThreads)
    gather_scatter_kernel(const __grid_constant__ ScatterTable<K> t) {
  const int s = blockIdx.y;
  copy_range(t.src[s], t.dst[s], t.size[s],
             static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x,
             static_cast<int64_t>(gridDim.x) * kThreads);
}

struct Norm {
  float scale[4];  // 1 / std
  float shift[4];  // -mean / std
};

// Writes 16 normalised pixels (bytes b, HWC) starting at pixel p0 of an image at `out`.
template <int C, bool CHW>
__device__ void store_pixels(const uint8_t* b, const Norm& norm, float* out, int64_t hw,
                             int64_t p0) {
  if constexpr (CHW) {
#pragma unroll
    for (int ch = 0; ch < C; ++ch) {
      float v[kPix];
#pragma unroll
      for (int p = 0; p < kPix; ++p)
        v[p] = static_cast<float>(b[p * C + ch]) * norm.scale[ch] + norm.shift[ch];
      float* o = out + ch * hw + p0;
      if (aligned16(o)) {
#pragma unroll
        for (int q = 0; q < kPix / 4; ++q)
          reinterpret_cast<float4*>(o)[q] =
              make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
      } else {
#pragma unroll
        for (int p = 0; p < kPix; ++p) o[p] = v[p];
      }
    }
  } else {
    float* o = out + p0 * C;
    float v[kPix * C];
#pragma unroll
    for (int i = 0; i < kPix * C; ++i)
      v[i] = static_cast<float>(b[i]) * norm.scale[i % C] + norm.shift[i % C];
    if (aligned16(o)) {
#pragma unroll
      for (int q = 0; q < kPix * C / 4; ++q)
        reinterpret_cast<float4*>(o)[q] =
            make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    } else {
#pragma unroll
      for (int i = 0; i < kPix * C; ++i) o[i] = v[i];
    }
  }
}

// Grid: x = tiles of one image (grid-stride), y = image of the chunk. A tile is up to kThreads
// groups of 16 pixels: the block first copies it from the mapped arena into shared memory with
// coalesced 16-byte loads (thread i reads vector i), then each thread normalises its 16 pixels.
// The < 16 pixels after the last whole group (and every pixel of an image whose start is not
// 16-byte aligned) are read one byte per channel.
template <int C, bool CHW, int K>
__global__ void __launch_bounds__(kThreads)
    gather_normalize_kernel(const __grid_constant__ ImageTable<K> t, int64_t hw, Norm norm,
                            float* dst) {
  __shared__ uint4 tile[kThreads * C];
  const int s = blockIdx.y;
  const uint8_t* in = t.src[s];
  float* out = dst + (t.first + s) * hw * C;
  const int64_t groups = aligned16(in) ? hw / kPix : 0;
  const int64_t tiles = (groups + kThreads - 1) / kThreads;
  // Every thread of a block runs the same iterations (they depend on blockIdx only), so the
  // barriers inside the loop are reached by all of them.
  for (int64_t tix = blockIdx.x; tix < tiles; tix += gridDim.x) {
    const int64_t g0 = tix * kThreads;
    const int n_groups = static_cast<int>(groups - g0 < kThreads ? groups - g0 : kThreads);
    const auto* src4 = reinterpret_cast<const uint4*>(in) + g0 * C;
    for (int v = threadIdx.x; v < n_groups * C; v += kThreads) tile[v] = src4[v];
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < n_groups) {
      uint4 mine[C];
#pragma unroll
      for (int k = 0; k < C; ++k) mine[k] = tile[threadIdx.x * C + k];
      store_pixels<C, CHW>(reinterpret_cast<const uint8_t*>(mine), norm, out, hw,
                           (g0 + threadIdx.x) * kPix);
    }
    __syncthreads();  // the next iteration overwrites the tile
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = groups * kPix + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       p < hw; p += stride) {
#pragma unroll
    for (int ch = 0; ch < C; ++ch) {
      const float v = static_cast<float>(in[p * C + ch]) * norm.scale[ch] + norm.shift[ch];
      out[CHW ? ch * hw + p : p * C + ch] = v;
    }
  }
}

template <int C, bool CHW>
void launch_normalize(const void* const* src, int64_t n, int64_t hw, const Norm& norm, float* dst,
                      cudaStream_t stream) {
  const int64_t tiles = (hw + kThreads * kPix - 1) / (kThreads * kPix);
  const dim3 block(kThreads);
  for_each_image_chunk<kImageEntries>(src, n, [&](const ImageTable<kImageEntries>& t) {
    const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, 1024)),
                    static_cast<unsigned>(t.count));
    gather_normalize_kernel<C, CHW, kImageEntries><<<grid, block, 0, stream>>>(t, hw, norm, dst);
    check(cudaGetLastError(), "gather_normalize_kernel launch");
  });
}

template <int C>
void launch_normalize(const void* const* src, int64_t n, int64_t hw, const Norm& norm, bool to_chw,
                      float* dst, cudaStream_t stream) {
  if (to_chw) {
    launch_normalize<C, true>(src, n, hw, norm, dst, stream);
  } else {
    launch_normalize<C, false>(src, n, hw, norm, dst, stream);
  }
}

__device__ inline uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(int64_t ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < static_cast<uint64_t>(ns)) __nanosleep(1000);
}

}  // namespace

void spin(int64_t ns, void* stream_handle) {
  if (ns <= 0) return;
  spin_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream_handle)>>>(ns);
  check(cudaGetLastError(), "spin_kernel launch");
}

void gather_bytes(const void* const* src, const int64_t* sizes, int64_t n, void* dst,
                  void* stream_handle) {
  if (n <= 0) return;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  auto* out = static_cast<uint8_t*>(dst);
  for_each_bytes_chunk<kBytesEntries>(
      src, sizes, n, [&](const BytesTable<kBytesEntries>& t, int64_t max_size) {
        const dim3 grid(blocks_per_sample(max_size, kBytesPerBlock),
                        static_cast<unsigned>(t.count));
        gather_bytes_kernel<kBytesEntries><<<grid, kThreads, 0, stream>>>(t, out);
        check(cudaGetLastError(), "gather_bytes_kernel launch");
      });
}

void gather_scatter(const void* const* src, void* const* dst, const int64_t* sizes, int64_t n,
                    void* stream_handle) {
  if (n <= 0) return;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  for_each_scatter_chunk<kScatterEntries>(
      src, dst, sizes, n, [&](const ScatterTable<kScatterEntries>& t, int64_t max_size) {
        const dim3 grid(blocks_per_sample(max_size, kBytesPerBlock),
                        static_cast<unsigned>(t.count));
        gather_scatter_kernel<kScatterEntries><<<grid, kThreads, 0, stream>>>(t);
        check(cudaGetLastError(), "gather_scatter_kernel launch");
      });
}

void copy_each(const void* const* src, void* const* dst, const int64_t* sizes, int64_t n,
               void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  for (int64_t i = 0; i < n; ++i) {
    if (sizes[i] == 0) continue;
    check(cudaMemcpyAsync(dst[i], src[i], static_cast<size_t>(sizes[i]), cudaMemcpyDefault, stream),
          "cudaMemcpyAsync (per-sample copy)");
  }
}

bool copy_batch_supported() {
  // The runtime has it from 12.8 on, and the driver must be as new (else the call would fail
  // with cudaErrorCallRequiresNewerDriver at the first batch).
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return CUDART_VERSION >= 12080 && driver >= 12080;
}

void copy_batch(const void* const* src, void* const* dst, const int64_t* sizes, int64_t n,
                void* stream_handle) {
  if (n <= 0) return;
#if CUDART_VERSION >= 12080
  auto stream = static_cast<cudaStream_t>(stream_handle);
  if (stream == nullptr) {
    // The batched call refuses the legacy default stream.
    throw std::invalid_argument("copy_batch needs an explicit stream, not the default stream");
  }
  // Empty ranges left out: a zero size is an invalid value to the batched call.
  std::vector<const void*> from;
  std::vector<void*> to;
  std::vector<size_t> bytes;
  for (int64_t i = 0; i < n; ++i) {
    if (sizes[i] == 0) continue;
    from.push_back(src[i]);
    to.push_back(dst[i]);
    bytes.push_back(static_cast<size_t>(sizes[i]));
  }
  if (bytes.empty()) return;
  cudaMemcpyAttributes attr{};
  // Stream order: the sources may have been written by earlier work on the same stream.
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  check(cudaMemcpyBatchAsync(to.data(), from.data(), bytes.data(), bytes.size(), &attr, &attr_index,
                             1, stream),
        "cudaMemcpyBatchAsync");
#else
  size_t fail_index = 0;
  check(cudaMemcpyBatchAsync(to.data(), const_cast<void**>(from.data()), bytes.data(), bytes.size(),
                             &attr, &attr_index, 1, &fail_index, stream),
        "cudaMemcpyBatchAsync");
#endif
#else
  (void)src, (void)dst, (void)sizes, (void)stream_handle;
  throw std::runtime_error("copy_batch needs CUDA 12.8 or newer (cudaMemcpyBatchAsync)");
#endif
}

void gather_normalize_u8(const void* const* src, int64_t n, int64_t height, int64_t width,
                         int64_t channels, const float* mean, const float* std, bool to_chw,
                         float* dst, void* stream_handle) {
  if (n <= 0) return;
  if (channels < 1 || channels > 4) {
    throw std::invalid_argument("gather_normalize_u8 supports 1..4 channels, got " +
                                std::to_string(channels));
  }
  Norm norm{};
  for (int64_t c = 0; c < channels; ++c) {
    if (std[c] == 0.0f)
      throw std::invalid_argument("std must be non-zero (channel " + std::to_string(c) + ")");
    norm.scale[c] = 1.0f / std[c];
    norm.shift[c] = -mean[c] / std[c];
  }
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const int64_t hw = height * width;
  switch (channels) {
    case 1:
      return launch_normalize<1>(src, n, hw, norm, to_chw, dst, stream);
    case 2:
      return launch_normalize<2>(src, n, hw, norm, to_chw, dst, stream);
    case 3:
      return launch_normalize<3>(src, n, hw, norm, to_chw, dst, stream);
    default:
      return launch_normalize<4>(src, n, hw, norm, to_chw, dst, stream);
  }
}

}  // namespace echopipe::cuda
