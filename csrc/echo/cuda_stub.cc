// Stand-ins for the CUDA gather kernels (csrc/cuda/gather.cu) when the core is built without nvcc:
// the symbols exist so the bindings link the same way, and calling them explains why it failed.
#include <stdexcept>

#include "cuda/gather.h"

#ifndef ECHOPIPE_WITH_CUDA
namespace echopipe::cuda {

void gather_bytes(const void* const*, const int64_t*, int64_t, void*, void*) {
  throw std::runtime_error("echopipe was built without CUDA");
}

void gather_scatter(const void* const*, void* const*, const int64_t*, int64_t, void*) {
  throw std::runtime_error("echopipe was built without CUDA");
}

void copy_each(const void* const*, void* const*, const int64_t*, int64_t, void*) {
  throw std::runtime_error("echopipe was built without CUDA");
}

bool copy_batch_supported() { return false; }

void copy_batch(const void* const*, void* const*, const int64_t*, int64_t, void*) {
  throw std::runtime_error("echopipe was built without CUDA");
}

void gather_normalize_u8(const void* const*, int64_t, int64_t, int64_t, int64_t, const float*,
                         const float*, bool, float*, void*) {
  throw std::runtime_error("echopipe was built without CUDA");
}

}  // namespace echopipe::cuda
#endif
