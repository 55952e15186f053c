// The byte copy inside the gather kernels (csrc/cuda/gather.cu): one thread's share of a
// block-strided copy of `size` bytes, with 16-byte loads and stores whatever the two addresses'
// alignment. Also compiled by the host compiler (no CUDA headers needed), so
// tests/test_gpu_plan.py runs every thread of a simulated grid on the CPU and checks the result
// byte by byte for all 16 x 16 source and destination misalignments.
//
// DALI packs a batch's ragged samples back to back, so most destinations are not 16-byte
// aligned while the sources (64-byte aligned cache slots) are. The copy therefore aligns the
// destination: a head of < 16 bytes is copied byte by byte, then every 16-byte store of the body
// is aligned, and a tail of < 16 bytes follows. When the source is then misaligned by m bytes,
// each output vector is the 16 bytes at offset m of two neighbouring aligned source vectors
// (funnel shifts). Only aligned source vectors holding at least one byte of the range are read,
// so no load leaves the 16-byte blocks the range touches. Neighbouring threads then both load
// the vector between their outputs; whether the second load crosses the bus again or hits the
// cache is measured, not assumed (bench/gpu/gather_bw.py's packed rows).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ECHOPIPE_HD __host__ __device__ __forceinline__
#else
#define ECHOPIPE_HD inline
#endif

namespace echopipe::cuda {

#if defined(__CUDACC__)
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  uint32_t x, y, z, w;
};
#endif

ECHOPIPE_HD uint32_t misalignment16(const void* p) {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) % 16);
}

// The 32 bits at byte offset B (0..3) of the little-endian pair lo:hi.
template <int B>
ECHOPIPE_HD uint32_t shift_pair(uint32_t lo, uint32_t hi) {
  if constexpr (B == 0) {
    return lo;
  } else {
    return (lo >> (8 * B)) | (hi << (32 - 8 * B));
  }
}

// The 16 bytes at offset M (1..15) of the 32 bytes a:b.
template <int M>
ECHOPIPE_HD Vec16 shift_vectors(const Vec16& a, const Vec16& b) {
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  constexpr int q = M / 4;
  constexpr int r = M % 4;
  Vec16 out;
  out.x = shift_pair<r>(w[q], w[q + 1]);
  out.y = shift_pair<r>(w[q + 1], w[q + 2]);
  out.z = shift_pair<r>(w[q + 2], w[q + 3]);
  out.w = shift_pair<r>(w[q + 3], w[q + 4]);
  return out;
}

// Body vectors first, first + stride, ...: out4[i] = the 16 bytes at offset M of in4[i]:in4[i+1]
// (in4[i] alone when M is 0). `m` selects M at run time; it is the same for every thread.
template <int M>
ECHOPIPE_HD void copy_body(uint32_t m, const Vec16* __restrict__ in4, Vec16* __restrict__ out4,
                           int64_t n16, int64_t first, int64_t stride) {
  if constexpr (M < 16) {
    if (m != M) return copy_body<M + 1>(m, in4, out4, n16, first, stride);
    for (int64_t i = first; i < n16; i += stride) {
      if constexpr (M == 0) {
        out4[i] = in4[i];
      } else {
        out4[i] = shift_vectors<M>(in4[i], in4[i + 1]);
      }
    }
  }
}

/// Thread `first` of a copy shared by threads first, first + stride, ... (each thread calls it
/// with its own `first`): together they copy `size` bytes from `in` to `out`. The ranges must not
/// overlap.
ECHOPIPE_HD void copy_range(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int64_t size,
                            int64_t first, int64_t stride) {
  int64_t head = (16 - misalignment16(out)) % 16;
  if (head > size) head = size;
  for (int64_t i = first; i < head; i += stride) out[i] = in[i];
  const int64_t n16 = (size - head) / 16;
  const uint8_t* src = in + head;
  auto* out4 = reinterpret_cast<Vec16*>(out + head);
  const uint32_t m = misalignment16(src);
  const auto* in4 = reinterpret_cast<const Vec16*>(src - m);
  copy_body<0>(m, in4, out4, n16, first, stride);
  for (int64_t i = head + 16 * n16 + first; i < size; i += stride) out[i] = in[i];
}

}  // namespace echopipe::cuda
