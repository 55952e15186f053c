// CUDA kernels that gather echo-cache samples from the pinned, GPU-mapped arena straight into a
// device batch (zero-copy reads over the bus, one launch per batch), optionally fused with
// uint8 -> float32 normalisation and HWC -> CHW. The pointer table is staged through stream-ordered
// device memory so the host call stays asynchronous. Host wrappers are declared in gather.h.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/gather.h"

namespace echopipe::cuda {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err));
  }
}

// One block per sample (grid-stride over samples too); 16-byte vector copies when both ends
// allow it, bytes otherwise.
__global__ void gather_bytes_kernel(const uint8_t* const* src, const int64_t* sizes,
                                    const int64_t* offsets, int64_t n, uint8_t* dst) {
  for (int64_t s = blockIdx.x; s < n; s += gridDim.x) {
    const uint8_t* in = src[s];
    uint8_t* out = dst + offsets[s];
    const int64_t size = sizes[s];
    const bool vec =
        (reinterpret_cast<uintptr_t>(in) % 16 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
    int64_t done = 0;
    if (vec) {
      const int64_t n16 = size / 16;
      const auto* in4 = reinterpret_cast<const uint4*>(in);
      auto* out4 = reinterpret_cast<uint4*>(out);
      for (int64_t i = threadIdx.x; i < n16; i += blockDim.x) out4[i] = in4[i];
      done = n16 * 16;
    }
    for (int64_t i = done + threadIdx.x; i < size; i += blockDim.x) out[i] = in[i];
  }
}

struct Norm {
  float scale[4];  // 1 / std
  float shift[4];  // -mean / std
};

// Grid: x over pixels of one image, y over samples. Each thread reads one HWC pixel (C bytes) and
// writes C floats, either interleaved (HWC) or to C planes (CHW).
__global__ void gather_normalize_kernel(const uint8_t* const* src, int64_t n, int64_t hw, int c,
                                        Norm norm, bool to_chw, float* dst) {
  for (int64_t s = blockIdx.y; s < n; s += gridDim.y) {
    const uint8_t* in = src[s];
    float* out = dst + s * hw * c;
    for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < hw;
         p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      for (int ch = 0; ch < c; ++ch) {
        float v = static_cast<float>(in[p * c + ch]) * norm.scale[ch] + norm.shift[ch];
        if (to_chw) {
          out[ch * hw + p] = v;
        } else {
          out[p * c + ch] = v;
        }
      }
    }
  }
}

// Copies a host table into stream-ordered device scratch; freed on the same stream.
template <typename T>
T* stage(const std::vector<T>& host, cudaStream_t stream) {
  void* dev = nullptr;
  check(cudaMallocAsync(&dev, host.size() * sizeof(T), stream), "cudaMallocAsync");
  check(cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync");
  return static_cast<T*>(dev);
}

}  // namespace

void gather_bytes(const void* const* src, const int64_t* sizes, int64_t n, void* dst,
                  void* stream_handle) {
  if (n <= 0) return;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  std::vector<const uint8_t*> ptrs(n);
  std::vector<int64_t> sz(sizes, sizes + n), off(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    ptrs[i] = static_cast<const uint8_t*>(src[i]);
    off[i] = total;
    total += sz[i];
  }
  auto* d_ptrs = stage(ptrs, stream);
  auto* d_sizes = stage(sz, stream);
  auto* d_off = stage(off, stream);
  int blocks = static_cast<int>(std::min<int64_t>(n, 65535));
  gather_bytes_kernel<<<blocks, 256, 0, stream>>>(d_ptrs, d_sizes, d_off, n,
                                                  static_cast<uint8_t*>(dst));
  check(cudaGetLastError(), "gather_bytes_kernel launch");
  check(cudaFreeAsync(d_ptrs, stream), "cudaFreeAsync");
  check(cudaFreeAsync(d_sizes, stream), "cudaFreeAsync");
  check(cudaFreeAsync(d_off, stream), "cudaFreeAsync");
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
  std::vector<const uint8_t*> ptrs(n);
  for (int64_t i = 0; i < n; ++i) ptrs[i] = static_cast<const uint8_t*>(src[i]);
  auto* d_ptrs = stage(ptrs, stream);
  const int64_t hw = height * width;
  dim3 block(256);
  dim3 grid(static_cast<unsigned>(std::min<int64_t>((hw + 255) / 256, 1024)),
            static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  gather_normalize_kernel<<<grid, block, 0, stream>>>(d_ptrs, n, hw, static_cast<int>(channels),
                                                      norm, to_chw, dst);
  check(cudaGetLastError(), "gather_normalize_kernel launch");
  check(cudaFreeAsync(d_ptrs, stream), "cudaFreeAsync");
}

}  // namespace echopipe::cuda
