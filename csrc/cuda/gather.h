// Device-side gather of echo-cache samples into one device batch. The cache arena is pinned and
// mapped (cudaHostAllocMapped), so a kernel can read sample slots straight from host memory over
// PCIe/NVLink without a staging copy; these kernels write the batch contiguously on the device,
// optionally fused with uint8 -> float normalisation and HWC -> CHW. Compiled by nvcc only; without
// CUDA the same functions exist (csrc/echo/cuda_stub.cc) and throw std::runtime_error.
// Pointers and the stream are passed as raw integers/void* so the Python bindings can forward
// torch data_ptr() values and torch.cuda.current_stream().cuda_stream unchanged.
#pragma once

#include <cstddef>
#include <cstdint>

#include "echo/export.h"

namespace echopipe::cuda {

/// Copies `n` byte ranges (`src[i]`, `sizes[i]` bytes; device-accessible, e.g. mapped pinned
/// pointers from SampleLease::device_data) back to back into device memory `dst`, on `stream`
/// (a cudaStream_t; nullptr = legacy default stream). `src`/`sizes` are host arrays. Asynchronous
/// with respect to the host; the source slots must stay leased until the stream reaches this work.
ECHOPIPE_API void gather_bytes(const void* const* src, const int64_t* sizes, int64_t n, void* dst,
                               void* stream);

/// Copies `n` independent byte ranges, `sizes[i]` bytes from `src[i]` to `dst[i]` (each side
/// device-accessible: mapped pinned host memory or device memory), in one launch per
/// kScatterEntries ranges (gather_plan.h) on `stream`. `src`/`dst`/`sizes` are host arrays, read
/// before the call returns; the call allocates nothing and does not synchronise. The memory the
/// ranges name must stay valid until the stream reaches this work.
ECHOPIPE_API void gather_scatter(const void* const* src, void* const* dst, const int64_t* sizes,
                                 int64_t n, void* stream);

/// The per-sample fallback of gather_scatter (same arguments): one cudaMemcpyAsync
/// (cudaMemcpyDefault) per non-empty range on `stream`. Kept so the benchmark can measure it.
ECHOPIPE_API void copy_each(const void* const* src, void* const* dst, const int64_t* sizes,
                            int64_t n, void* stream);

/// Whether copy_batch is available (built with CUDA >= 12.8).
ECHOPIPE_API bool copy_batch_supported();

/// gather_scatter through the runtime's batched copy (cudaMemcpyBatchAsync, CUDA >= 12.8), in
/// stream order. `stream` must not be the legacy default stream (std::invalid_argument);
/// std::runtime_error when built with an older toolkit.
ECHOPIPE_API void copy_batch(const void* const* src, void* const* dst, const int64_t* sizes,
                             int64_t n, void* stream);

/// Gathers `n` uint8 images of identical shape H x W x C (HWC, dense) from device-accessible
/// `src[i]` into float32 `dst` (device), computing (x - mean[c]) / std[c] per channel (`mean`,
/// `std` are host arrays of C floats, 1 <= C <= 4). Output layout is N x C x H x W when `to_chw`,
/// else N x H x W x C. Asynchronous on `stream`.
ECHOPIPE_API void gather_normalize_u8(const void* const* src, int64_t n, int64_t height,
                                      int64_t width, int64_t channels, const float* mean,
                                      const float* std, bool to_chw, float* dst, void* stream);

/// Queues a kernel on `stream` that does nothing for `ns` nanoseconds: tests put it before a
/// copy to widen a race window (ECHOPIPE_GPU_TEST_SINK_SPIN_US / _SOURCE_SPIN_US, copy_mode.h).
/// Defined in CUDA builds only; its one caller, the DALI GPU plugin, exists only there too.
ECHOPIPE_API void spin(int64_t ns, void* stream);

}  // namespace echopipe::cuda
