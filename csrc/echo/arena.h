// Arena memory for the echo cache (internal header, not installed). Pageable memory is a private
// anonymous mmap; pinned memory is cudaHostAlloc(portable | mapped) and is chosen only when the
// core was built with CUDA and a device is present when the cache is created, so importing the
// package never touches the CUDA runtime.
#pragma once

#include <cstddef>
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

}  // namespace echopipe::detail
