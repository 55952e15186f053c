// Arena memory for the echo cache (internal header, not installed). Pageable memory is a private
// anonymous mmap; pinned memory is cudaHostAlloc(portable | mapped) and is chosen only when the
// core was built with CUDA and a device is present when the cache is created, so importing the
// package never touches the CUDA runtime.
#pragma once

#include <cstddef>
#include <cstring>
#include <utility>

#include "echo/echo_cache.h"

namespace echopipe::detail {

// The arena's memory, owned: freed by the destructor (move-only).
class Arena {
 public:
  Arena() = default;
  Arena(Arena&& other) noexcept { *this = std::move(other); }
  Arena& operator=(Arena&& other) noexcept;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() { reset(); }

  void* host = nullptr;
  void* device = nullptr;  // mapped device address of `host`, or nullptr
  size_t size = 0;
  MemoryKind kind = MemoryKind::kPageable;

 private:
  void reset() noexcept;
};

// Throws std::runtime_error when the memory cannot be had (message names the size and kind).
Arena arena_allocate(size_t bytes, MemoryKind requested);

// Synchronous cudaMemcpy (cudaMemcpyDefault); std::runtime_error naming the CUDA error.
void device_copy(void* dst, const void* src, size_t n);

// Copies n bytes between host memory and an arena of `kind` (either direction): memcpy, or for
// a device arena a synchronous cudaMemcpy. Inline: the host case is the put path's hot copy.
inline void arena_copy(MemoryKind kind, void* dst, const void* src, size_t n) {
  if (n == 0) return;
  if (kind == MemoryKind::kDevice) {
    device_copy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

}  // namespace echopipe::detail
