// Allocation of the echo cache arena and the lazy CUDA device probe. The CUDA runtime is linked
// statically and loads libcuda on first use, so cuda_device_count() is the first call that can
// touch the driver; with no driver or no device it reports 0 and the arena is pageable.
#include "echo/arena.h"

#include <sys/mman.h>

#include <stdexcept>
#include <string>

#ifdef ECHOPIPE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace echopipe {

bool built_with_cuda() {
#ifdef ECHOPIPE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef ECHOPIPE_WITH_CUDA
  // Devices cannot appear during the process's life; probe once.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

bool cuda_available() { return built_with_cuda() && cuda_device_count() > 0; }

namespace detail {

namespace {

constexpr size_t kHugePageArenaBytes = size_t{64} << 20;

std::string no_device_reason() {
  return built_with_cuda() ? "the CUDA runtime found none" : "echopipe was built without CUDA";
}

Arena device_allocate(size_t bytes) {
  if (!cuda_available()) {
    throw std::runtime_error("memory='device' needs a CUDA device, but " + no_device_reason());
  }
  Arena a;
  a.size = bytes;
#ifdef ECHOPIPE_WITH_CUDA
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw ArenaAllocationError(
        "cudaMalloc of " + std::to_string(bytes) +
        " bytes for a device echo cache arena failed: " + cudaGetErrorString(err));
  }
  a.host = p;  // not host-readable: the one address every slot pointer is computed from
  a.device = p;
  a.kind = MemoryKind::kDevice;
#endif
  return a;
}

}  // namespace

void device_copy(void* dst, const void* src, size_t n) {
#ifdef ECHOPIPE_WITH_CUDA
  // Not cudaMemcpy: from pageable memory it may return once the bytes are staged, before they
  // land in the arena, and it runs on the legacy default stream, which non-blocking streams
  // (DALI's, torch's) are not ordered after. The copy runs on this thread's stream and the host
  // waits for it, so a reader queued on any stream after this returns sees the bytes.
  cudaError_t err = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, cudaStreamPerThread);
  if (err == cudaSuccess) err = cudaStreamSynchronize(cudaStreamPerThread);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("cudaMemcpy to or from the device echo cache arena "
                                         "failed: ") +
                             cudaGetErrorString(err));
  }
#else
  (void)dst, (void)src, (void)n;
  throw std::runtime_error("a device echo cache arena needs echopipe built with CUDA");
#endif
}

Arena arena_allocate(size_t bytes, MemoryKind requested) {
  if (requested == MemoryKind::kDevice) return device_allocate(bytes);
  Arena a;
  a.size = bytes;
  bool pinned =
      requested == MemoryKind::kPinned || (requested == MemoryKind::kAuto && cuda_available());
  if (pinned) {
    if (!cuda_available()) {
      throw std::runtime_error("memory='pinned' needs a CUDA device, but " + no_device_reason());
    }
#ifdef ECHOPIPE_WITH_CUDA
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw ArenaAllocationError("cudaHostAlloc of " + std::to_string(bytes) +
                                 " bytes failed: " + cudaGetErrorString(err));
    }
    void* d = nullptr;
    if (cudaHostGetDevicePointer(&d, p, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      d = nullptr;  // pinned but not mapped (no unified addressing): host copies still work
    }
    a.host = p;
    a.device = d;
    a.kind = MemoryKind::kPinned;
    return a;
#endif
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    throw ArenaAllocationError("could not map " + std::to_string(bytes) +
                               " bytes of pageable memory for the echo cache arena");
  }
#if defined(MADV_HUGEPAGE)
  // Takes read samples at random across the whole arena: in an arena far beyond the TLB's
  // reach of 4 KB pages nearly every sample costs a TLB miss and a page walk, so large arenas
  // ask for huge pages (a hint: ignored when transparent huge pages are off). Small ones do
  // not: the TLB covers them anyway, and a huge page's fault may compact memory first.
  if (bytes >= kHugePageArenaBytes) (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
  a.host = p;
  a.kind = MemoryKind::kPageable;
  return a;
}

Arena& Arena::operator=(Arena&& other) noexcept {
  if (this != &other) {
    reset();
    host = std::exchange(other.host, nullptr);
    device = std::exchange(other.device, nullptr);
    size = std::exchange(other.size, 0);
    kind = other.kind;
  }
  return *this;
}

void Arena::reset() noexcept {
  if (host == nullptr) return;
  if (kind == MemoryKind::kPinned) {
#ifdef ECHOPIPE_WITH_CUDA
    (void)cudaFreeHost(host);
#endif
  } else if (kind == MemoryKind::kDevice) {
#ifdef ECHOPIPE_WITH_CUDA
    (void)cudaFree(host);
#endif
  } else {
    munmap(host, size);
  }
  host = nullptr;
  device = nullptr;
}

}  // namespace detail
}  // namespace echopipe
