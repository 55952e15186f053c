// C++ test of the echo cache's determinism across read-only calls: the slot a put gets must depend
// only on which slots are free, not on when retired units were given back to the allocator. stats()
// and save_state() give retired units back early (so that their counts include released leases);
// two caches fed and drained identically, one of which calls them in between, must then hand out
// the same slots, samples and save_state() blobs. A resumed deterministic DALI pipeline relies on
// this (docs/dali.md). Exit status 0 = all passed.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "echo/echo_cache.h"
#include "echo_test_support.h"

using namespace echopipe;
using namespace echopipe::testing;

namespace {

struct Trace {
  std::vector<uint32_t> put_slots;                    // slot of every put, in order
  std::vector<std::pair<uint32_t, uint64_t>> copies;  // (slot, sample key) of every copy taken
  std::vector<uint8_t> blob;                          // save_state() at the end of the rounds
};

EchoConfig config(EchoMode mode, size_t batch) {
  EchoConfig cfg;
  cfg.capacity_samples = 48;
  cfg.capacity_bytes = 48 * 256;
  cfg.echo_factor = 2.0;
  cfg.seed = 11;
  cfg.mode = mode;
  cfg.batch_size = batch;
  return cfg;
}

// Rounds of: fill the cache, take `take_n` copies, release them in two halves, with `between`
// (nothing, stats() or save_state()) called after the first half only in round 1. The first half
// retires units that a put collects only after the second half has retired more, unless `between`
// collects them first.
Trace run(EchoMode mode, size_t batch, const std::function<void(EchoCache&)>& between) {
  auto c = EchoCache::create(config(mode, batch));
  const SampleDesc d = int64_desc(4);
  Trace t;
  uint64_t next = 0;
  auto put_all = [&] {
    for (;;) {
      std::vector<uint64_t> v(4);
      fill(v, next);
      PutReservation r;
      if (c->reserve(d, r, 0) != PutStatus::kOk) return;
      t.put_slots.push_back(r.slot());
      std::memcpy(r.field_data(0), v.data(), v.size() * sizeof(uint64_t));
      CHECK(c->commit(r) == PutStatus::kOk);
      ++next;
    }
  };
  const size_t take_n = batch == 1 ? 8 : 2 * batch;  // batch mode: 2 units
  for (int round = 0; round < 6; ++round) {
    put_all();
    std::vector<SampleLease> first, second;
    for (int k = 0; k < 3; ++k) CHECK(c->take(take_n, first, 0) == TakeStatus::kOk);
    for (int k = 0; k < 3; ++k) CHECK(c->take(take_n, second, 0) == TakeStatus::kOk);
    for (auto* leases : {&first, &second}) {
      for (const SampleLease& l : *leases) {
        CHECK(payload_ok(l));
        t.copies.emplace_back(l.slot(), *static_cast<const uint64_t*>(l.data(0)));
      }
    }
    release_leases(first);
    if (round == 1 && between) between(*c);
    release_leases(second);
  }
  t.blob = c->save_state();
  c->end_of_input();
  std::vector<SampleLease> out;
  while (c->take(batch, out, 0) == TakeStatus::kOk) {
    for (const SampleLease& l : out) {
      t.copies.emplace_back(l.slot(), *static_cast<const uint64_t*>(l.data(0)));
    }
    release_leases(out);
  }
  CHECK(c->stats().emitted == c->stats().fresh_in * 2);
  return t;
}

void check_same(const char* what, const Trace& ref, const Trace& got) {
  const bool same_puts = ref.put_slots == got.put_slots;
  const bool same_copies = ref.copies == got.copies;
  const bool same_blob = ref.blob == got.blob;
  if (!same_puts || !same_copies || !same_blob) {
    std::fprintf(stderr, "%s changed the stream: put slots %s, copies %s, saved state %s\n", what,
                 same_puts ? "same" : "differ", same_copies ? "same" : "differ",
                 same_blob ? "same" : "differs");
  }
  CHECK(!ref.copies.empty());
  CHECK(same_puts);
  CHECK(same_copies);
  CHECK(same_blob);
}

void test_read_only_calls_keep_the_stream(EchoMode mode, size_t batch) {
  const Trace ref = run(mode, batch, nullptr);
  // Some units retired by the first half must be collected by `between`, or the test shows
  // nothing: their slots are reused in the rounds after.
  CHECK(ref.put_slots.size() > 48);
  check_same("stats()", ref, run(mode, batch, [](EchoCache& c) { (void)c.stats(); }));
  check_same("save_state()", ref, run(mode, batch, [](EchoCache& c) { (void)c.save_state(); }));
  check_same("wait_for_room()", ref,
             run(mode, batch, [](EchoCache& c) { (void)c.wait_for_room(1, 0); }));
}

// A cache restored from a blob saved mid-stream continues the same slots and samples as the
// original (which was saved from, so also collected there).
void test_restored_cache_keeps_the_stream() {
  const SampleDesc d = int64_desc(4);
  auto a = EchoCache::create(config(EchoMode::kExample, 1));
  uint64_t next = 0;
  auto put_all = [&](EchoCache& c, uint64_t from, std::vector<uint32_t>* slots) {
    uint64_t k = from;
    for (;; ++k) {
      std::vector<uint64_t> v(4);
      fill(v, k);
      PutReservation r;
      if (c.reserve(d, r, 0) != PutStatus::kOk) return k;
      slots->push_back(r.slot());
      std::memcpy(r.field_data(0), v.data(), v.size() * sizeof(uint64_t));
      CHECK(c.commit(r) == PutStatus::kOk);
    }
  };
  std::vector<uint32_t> ignored;
  next = put_all(*a, 0, &ignored);
  std::vector<SampleLease> out;
  CHECK(a->take(30, out, 0) == TakeStatus::kOk);
  release_leases(out);
  const std::vector<uint8_t> blob = a->save_state();
  auto b = EchoCache::create(config(EchoMode::kExample, 1));
  b->restore_state(blob.data(), blob.size());
  const std::vector<uint8_t> b_saved = b->save_state();
  std::vector<uint32_t> sa, sb;
  CHECK(put_all(*a, next, &sa) == put_all(*b, next, &sb));
  CHECK(!sa.empty());
  CHECK(sa == sb);
  std::vector<SampleLease> la, lb;
  CHECK(a->take(24, la, 0) == TakeStatus::kOk);
  CHECK(b->take(24, lb, 0) == TakeStatus::kOk);
  CHECK(la.size() == lb.size());
  for (size_t i = 0; i < la.size() && i < lb.size(); ++i) {
    CHECK(la[i].slot() == lb[i].slot());
    CHECK(*static_cast<const uint64_t*>(la[i].data(0)) ==
          *static_cast<const uint64_t*>(lb[i].data(0)));
  }
  release_leases(la);
  release_leases(lb);

  // The saved free slots are a set, written in ascending order; a blob that lists them in
  // another order (as the free list's stack order once did) restores to the same stream, and one
  // that lists a slot twice is refused.
  auto get32 = [&](size_t at) {
    uint32_t v = 0;
    std::memcpy(&v, blob.data() + at, sizeof(v));
    return v;
  };
  // Tail of the blob: free-slot count, the free slots, the high-water mark.
  size_t nfree = 0;
  for (size_t k = 1; 8 + 4 * k <= blob.size(); ++k) {
    if (get32(blob.size() - 8 - 4 * k) != k) continue;
    bool ascending = true;
    for (size_t i = 1; i < k; ++i) {
      ascending = ascending && get32(blob.size() - 4 - 4 * k + 4 * (i - 1)) <
                                   get32(blob.size() - 4 - 4 * k + 4 * i);
    }
    if (ascending) nfree = k;
  }
  CHECK(nfree > 2);
  if (nfree <= 2) return;
  const size_t first = blob.size() - 4 - 4 * nfree;
  std::vector<uint8_t> reversed = blob;
  for (size_t i = 0; i < nfree; ++i) {
    std::memcpy(reversed.data() + first + 4 * i, blob.data() + first + 4 * (nfree - 1 - i), 4);
  }
  CHECK(reversed != blob);
  auto c = EchoCache::create(config(EchoMode::kExample, 1));
  c->restore_state(reversed.data(), reversed.size());
  CHECK(c->save_state() == b_saved);
  std::vector<uint32_t> sc;
  CHECK(put_all(*c, next, &sc) > next);
  CHECK(sc == sb);
  std::vector<uint8_t> twice = blob;
  std::memcpy(twice.data() + first + 4, blob.data() + first, 4);
  auto d2 = EchoCache::create(config(EchoMode::kExample, 1));
  CHECK_THROWS(d2->restore_state(twice.data(), twice.size()), "free slot");
}

// A put takes the lowest free slot, also in a bitmap of three levels (> 4096 slots).
void test_lowest_free_slot() {
  EchoConfig cfg;
  cfg.capacity_samples = 300000;
  cfg.capacity_bytes = size_t{300000} * 128;
  cfg.echo_factor = 1.0;
  auto c = EchoCache::create(cfg);
  const SampleDesc d = int64_desc(1);
  std::vector<uint32_t> slots;
  for (uint64_t i = 0; i < 270000; ++i) {
    PutReservation r;
    CHECK(c->reserve(d, r, 0) == PutStatus::kOk);
    slots.push_back(r.slot());
    std::memcpy(r.field_data(0), &i, sizeof(i));
    CHECK(c->commit(r) == PutStatus::kOk);
  }
  bool packed = true;
  for (size_t i = 0; i < slots.size(); ++i) packed = packed && slots[i] == i;
  CHECK(packed);
  // Draw everything (e = 1: each unit retires when its lease is released), release in an order
  // of its own, and put again: the puts fill the slots lowest first.
  std::vector<SampleLease> out;
  CHECK(c->take(slots.size(), out, 0) == TakeStatus::kOk);
  std::vector<SampleLease> keep;
  for (SampleLease& l : out) {
    // Keep every slot that is not a multiple of 4097 (crosses level-0 and level-1 words).
    if (l.slot() % 4097 != 0) keep.push_back(std::move(l));
  }
  release_leases(out);
  std::vector<uint32_t> again;
  for (uint64_t i = 0; i < 10; ++i) {
    PutReservation r;
    CHECK(c->reserve(d, r, 0) == PutStatus::kOk);
    again.push_back(r.slot());
    std::memcpy(r.field_data(0), &i, sizeof(i));
    CHECK(c->commit(r) == PutStatus::kOk);
  }
  bool lowest = true;
  for (size_t i = 0; i < again.size(); ++i) lowest = lowest && again[i] == 4097 * i;
  CHECK(lowest);
  // The other 56 freed slots, then the ones never used: 270000 onward, in order.
  for (uint64_t i = 0; i < 100; ++i) {
    PutReservation r;
    CHECK(c->reserve(d, r, 0) == PutStatus::kOk);
    lowest = lowest && r.slot() == (i < 56 ? 4097 * (10 + i) : 270000 + (i - 56));
    std::memcpy(r.field_data(0), &i, sizeof(i));
    CHECK(c->commit(r) == PutStatus::kOk);
  }
  CHECK(lowest);
  release_leases(keep);
}

}  // namespace

int main() {
  test_read_only_calls_keep_the_stream(EchoMode::kExample, 1);
  test_read_only_calls_keep_the_stream(EchoMode::kBatch, 4);
  test_restored_cache_keeps_the_stream();
  test_lowest_free_slot();
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("all echo slot-order tests passed\n");
  return 0;
}
