// Arena memory for the echo cache (internal header, not installed). Pageable memory is a private
// anonymous mmap; pinned memory is cudaHostAlloc(portable | mapped) and is chosen only when the
// core was built with CUDA and a device is present when the cache is created, so importing the
// package never touches the CUDA runtime.
#pragma once

#include <cstddef>

#include "echo/echo_cache.h"

namespace echopipe::detail {

struct Arena {
  void* host = nullptr;
  void* device = nullptr;  // mapped device address of `host`, or nullptr
  size_t size = 0;
  MemoryKind kind = MemoryKind::kPageable;
};

// Throws std::runtime_error when the memory cannot be had (message names the size and kind).
Arena arena_allocate(size_t bytes, MemoryKind requested);
void arena_free(Arena& arena) noexcept;

}  // namespace echopipe::detail
