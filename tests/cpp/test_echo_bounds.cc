// What a caller hands the cache at its edges: shapes whose byte count would wrap around (from a
// put or from a saved state), a reservation that holds the cache's last owner, and a put whose
// copy into the arena fails (a device arena's cudaMemcpy).
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "echo_test_support.h"

using namespace echopipe;
using namespace echopipe::testing;

namespace {

EchoConfig small_config(MemoryKind memory = MemoryKind::kPageable) {
  EchoConfig cfg;
  cfg.capacity_bytes = size_t{1} << 20;
  cfg.capacity_samples = 16;
  cfg.echo_factor = 1.0;
  cfg.memory = memory;
  return cfg;
}

template <typename E, typename F>
bool throws(F&& call) {
  try {
    call();
  } catch (const E&) {
    return true;
  }
  return false;
}

// 8 * (2^62 + 32) bytes is 256 modulo 2^64: the bytes of an int64 field of 32 elements.
constexpr int64_t kWrappingLength = (int64_t{1} << 62) + 32;

void test_a_shape_whose_bytes_wrap_around_is_refused() {
  auto cache = EchoCache::create(small_config());
  SampleDesc huge = int64_desc(kWrappingLength);
  std::vector<uint64_t> buf(32);
  const void* data[1] = {buf.data()};
  CHECK_THROWS(cache->put(huge, data, 0.0), "holds more than");
  SampleDesc wide = int64_desc(1);  // 2^31 * 2^31 * 2^31 elements: the product wraps in int64
  wide.fields[0].ndim = 3;
  wide.fields[0].shape[0] = wide.fields[0].shape[1] = wide.fields[0].shape[2] = int64_t{1} << 31;
  CHECK_THROWS(cache->put(wide, data, 0.0), "holds more than");
  // An empty field may have huge other dimensions: it holds no bytes.
  SampleDesc empty = wide;
  empty.fields[0].shape[2] = 0;
  CHECK(empty.fields[0].numel() == 0 && empty.fields[0].nbytes() == 0);
  CHECK(cache->put(empty, data, 0.0) == PutStatus::kOk);
  CHECK(cache->stats().fresh_in == 1);
}

// A saved state whose sample's length was changed to one whose bytes wrap around to the stored
// ones: it parsed, and the restored sample claimed 2^62 elements over 256 bytes.
void test_a_saved_shape_whose_bytes_wrap_around_is_corrupt() {
  auto a = EchoCache::create(small_config());
  std::vector<uint64_t> buf(32);
  fill(buf, 5);
  const void* data[1] = {buf.data()};
  CHECK(a->put(int64_desc(32), data, 0.0) == PutStatus::kOk);
  std::vector<uint8_t> blob = a->save_state();
  // The field's record: ndim 1, then shape[0] = 32 and kMaxDims - 1 zero dimensions.
  std::vector<uint8_t> record(4 + 8 * kMaxDims, 0);
  const int32_t ndim = 1;
  const int64_t length = 32;
  std::memcpy(record.data(), &ndim, 4);
  std::memcpy(record.data() + 4, &length, 8);
  size_t at = blob.size();
  for (size_t i = 0; i + record.size() <= blob.size(); ++i) {
    if (std::memcmp(blob.data() + i, record.data(), record.size()) == 0) {
      CHECK(at == blob.size());  // one field record in the blob
      at = i;
    }
  }
  CHECK(at < blob.size());
  if (at == blob.size()) return;
  std::memcpy(blob.data() + at + 4, &kWrappingLength, 8);
  auto b = EchoCache::create(small_config());
  CHECK(throws<CacheStateError>([&] { b->restore_state(blob.data(), blob.size()); }));
  CHECK(b->stats().fresh_in == 0 && b->stats().resident == 0);  // untouched
}

// The reservation's reference is the cache's last owner: commit and abort used the cache after
// dropping it (a use after free, which ASAN reports).
void test_a_reservation_may_hold_the_last_owner() {
  std::vector<uint64_t> buf(4);
  fill(buf, 9);
  for (bool commit : {true, false}) {
    auto cache = EchoCache::create(small_config());
    PutReservation r;
    CHECK(cache->reserve(int64_desc(4), r, 0.0) == PutStatus::kOk);
    std::memcpy(r.field_data(0), buf.data(), 32);
    EchoCache* raw = cache.get();
    cache.reset();  // the reservation owns the cache now
    if (commit) {
      CHECK(raw->commit(r) == PutStatus::kOk);
    } else {
      raw->abort(r);
    }
    CHECK(!r.valid());
  }
  {  // the destructor of an uncommitted reservation aborts it
    auto cache = EchoCache::create(small_config());
    PutReservation r;
    CHECK(cache->reserve(int64_desc(4), r, 0.0) == PutStatus::kOk);
    cache.reset();
  }
}

// A put into a device arena whose cudaMemcpy fails (here: from a null pointer) kept its slot
// reserved for ever: the cache never counted the input as ended, and a take after
// end_of_input() waited for that sample until its timeout. Needs a CUDA device.
void test_a_failed_copy_gives_its_slots_back() {
  if (!cuda_available()) {
    std::printf("test_a_failed_copy_gives_its_slots_back: skipped (no CUDA device)\n");
    return;
  }
  auto cache = EchoCache::create(small_config(MemoryKind::kDevice));
  const void* data[1] = {nullptr};
  CHECK(throws<std::runtime_error>([&] { cache->put(int64_desc(4), data, 0.0); }));
  size_t done = 99;
  CHECK(throws<std::runtime_error>([&] { cache->put_rows(int64_desc(4), data, 3, 0.0, &done); }));
  CHECK(done == 0);
  CHECK(cache->stats().resident == 0);
  cache->end_of_input();
  std::vector<SampleLease> out;
  CHECK(cache->take(1, out, 5.0) == TakeStatus::kEnd);
}

}  // namespace

int main() {
  test_a_shape_whose_bytes_wrap_around_is_refused();
  test_a_saved_shape_whose_bytes_wrap_around_is_corrupt();
  test_a_reservation_may_hold_the_last_owner();
  test_a_failed_copy_gives_its_slots_back();
  if (g_failures > 0) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("test_echo_bounds: all passed\n");
  return 0;
}
