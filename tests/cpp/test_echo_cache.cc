// C++ tests of the echo cache core, run by ctest (also under -fsanitize=thread and =address).
// They check exact accounting under 4 producers x 4 consumers (every sample emitted exactly its
// ticket count, nothing lost or extra, payload intact), close() waking blocked threads, drain,
// batch mode, ragged sizes, back-pressure, min_fill and save/restore (truncated blobs and a
// flipped byte at every position). test_echo_give_back.cc covers copies handed back after a
// claim and releases that wake blocked producers. Exit status 0 = all passed.
// ECHOPIPE_STRESS_SAMPLES overrides the stress size (default 200000).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "echo/echo_cache.h"
#include "echo/echo_cache_impl.h"  // detail::FreeSlotSet
#include "echo_test_support.h"

using namespace echopipe;
using namespace echopipe::testing;
using Clock = std::chrono::steady_clock;

namespace {

// About 16 s under TSAN on 2 cores; well under a second in a release build.
constexpr size_t kDefaultStress = 200000;

size_t stress_samples() {
  const char* env = std::getenv("ECHOPIPE_STRESS_SAMPLES");
  return env ? std::strtoull(env, nullptr, 10) : kDefaultStress;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void test_stress(double e, size_t n_samples) {
  const int kProducers = 4, kConsumers = 4;
  EchoConfig cfg;
  cfg.capacity_samples = 2048;
  cfg.capacity_bytes = 2048 * 256;
  cfg.echo_factor = e;
  cfg.min_fill = 256;
  cfg.seed = 42;
  auto cache = EchoCache::create(cfg);
  std::vector<std::atomic<uint32_t>> seen(n_samples);
  std::vector<std::atomic<uint32_t>> tickets(n_samples);
  std::atomic<uint64_t> bad_payload{0}, bad_emission{0}, next_key{0}, ceil_count{0};
  std::vector<std::thread> threads;
  auto start = Clock::now();
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      std::mt19937 rng(p);
      std::vector<uint64_t> buf;
      for (;;) {
        if (p == kProducers - 1) {  // one producer puts blocks of 8 rows with put_rows
          const uint64_t first = next_key.fetch_add(8);
          if (first >= n_samples) break;
          const size_t rows = std::min<uint64_t>(8, n_samples - first);
          const int64_t words = 2 + static_cast<int64_t>(rng() % 24);
          std::vector<uint64_t> block(rows * words), row(words);
          for (size_t i = 0; i < rows; ++i) {
            fill(row, first + i);
            std::copy(row.begin(), row.end(), block.begin() + i * words);
          }
          const void* ptr = block.data();
          size_t done = 0;
          CHECK(cache->put_rows(int64_desc(words), &ptr, rows, -1, &done) == PutStatus::kOk);
          CHECK(done == rows);
          continue;
        }
        uint64_t key = next_key.fetch_add(1);
        if (key >= n_samples) break;
        int64_t words = 2 + static_cast<int64_t>(rng() % 24);
        buf.resize(words);
        fill(buf, key);
        SampleDesc d = int64_desc(words);
        const void* ptr = buf.data();
        if (key % 3 == 0) {  // exercise the zero-copy path too
          PutReservation r;
          CHECK(cache->reserve(d, r, -1) == PutStatus::kOk);
          std::memcpy(r.field_data(0), buf.data(), words * 8);
          CHECK(cache->commit(r) == PutStatus::kOk);
        } else {
          CHECK(cache->put(d, &ptr, -1) == PutStatus::kOk);
        }
      }
    });
  }
  for (int c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&, c] {
      std::vector<SampleLease> out;
      size_t n = 8 + 8 * c;
      for (;;) {
        // Half the consumers release their batch with release_leases (one allocator lock).
        if (c % 2 == 0) {
          release_leases(out);
          CHECK(out.empty());
        } else {
          out.clear();
        }
        TakeStatus st = cache->take(n, out, -1);
        if (st == TakeStatus::kEnd) break;
        CHECK(st == TakeStatus::kOk);
        CHECK(!out.empty() && out.size() <= n);
        for (auto& l : out) {
          if (!payload_ok(l)) bad_payload.fetch_add(1);
          uint64_t key = static_cast<const uint64_t*>(l.data(0))[0];
          if (key >= n_samples) {
            bad_payload.fetch_add(1);
            continue;
          }
          seen[key].fetch_add(1);
          uint32_t t = l.tickets();
          uint32_t prev = tickets[key].exchange(t);
          if (prev != 0 && prev != t) bad_emission.fetch_add(1);
          if (l.emission() >= t) bad_emission.fetch_add(1);
        }
      }
    });
  }
  for (int p = 0; p < kProducers; ++p) threads[p].join();
  cache->end_of_input();
  for (size_t i = kProducers; i < threads.size(); ++i) threads[i].join();
  double secs = seconds_since(start);

  uint64_t total = 0, missing = 0, wrong = 0;
  uint32_t lo = static_cast<uint32_t>(std::floor(e)), hi = static_cast<uint32_t>(std::ceil(e));
  for (size_t k = 0; k < n_samples; ++k) {
    uint32_t s = seen[k].load(), t = tickets[k].load();
    total += s;
    if (s == 0) ++missing;
    if (s != t || (t != lo && t != hi)) ++wrong;
    if (t == hi && hi != lo) ceil_count.fetch_add(1);
  }
  EchoStats st = cache->stats();
  std::printf("stress e=%.2f: %zu samples, %llu copies in %.2fs (%.0f copies/s), reuse dist %.0f\n",
              e, n_samples, static_cast<unsigned long long>(total), secs, total / secs,
              st.mean_reuse_distance);
  CHECK(missing == 0);
  CHECK(wrong == 0);
  CHECK(bad_payload.load() == 0);
  CHECK(bad_emission.load() == 0);
  CHECK(st.fresh_in == n_samples);
  CHECK(st.emitted == total);
  CHECK(st.resident == 0);
  CHECK(st.bytes_used == 0);
  CHECK(st.retired == n_samples);
  uint64_t hist_sum = 0;
  for (size_t k = 0; k < st.emit_histogram.size(); ++k) hist_sum += st.emit_histogram[k];
  CHECK(hist_sum == n_samples);
  double frac = e - std::floor(e);
  if (frac > 0) {
    double got = static_cast<double>(ceil_count.load()) / n_samples;
    CHECK(std::abs(got - frac) < 0.02);
  }
  // Mean copies per sample close to e.
  CHECK(std::abs(static_cast<double>(total) / n_samples - e) < 0.02 * e);
  std::vector<SampleLease> out;
  CHECK(cache->take(4, out, 0.0) == TakeStatus::kEnd);
}

void test_close_wakes() {
  EchoConfig cfg;
  cfg.capacity_samples = 2;
  cfg.capacity_bytes = 4096;
  cfg.echo_factor = 1.0;
  cfg.min_fill = 2;
  auto cache = EchoCache::create(cfg);
  uint64_t v[2] = {1, 2};
  const void* ptr = v;
  SampleDesc d = int64_desc(2);
  // One sample: min_fill (2) is not reached and no producer is blocked, so take waits.
  CHECK(cache->put(d, &ptr, 0) == PutStatus::kOk);
  std::atomic<int> take_status{-1};
  double take_wake = 0;
  std::thread taker([&] {
    std::vector<SampleLease> out;
    take_status = static_cast<int>(cache->take(1, out, -1));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  CHECK(take_status.load() == -1);
  // Second sample fills the cache: the taker runs (min_fill reached).
  CHECK(cache->put(d, &ptr, 0) == PutStatus::kOk);
  taker.join();
  CHECK(take_status.load() == static_cast<int>(TakeStatus::kOk));
  // The cache is full (one slot holds a ticket, the taken one was released): fill again.
  CHECK(cache->put(d, &ptr, 0) == PutStatus::kOk);
  CHECK(cache->put(d, &ptr, 0.05) == PutStatus::kTimeout);  // back-pressure with timeout
  std::atomic<int> put_status{-1};
  std::thread putter([&] { put_status = static_cast<int>(cache->put(d, &ptr, -1)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(put_status.load() == -1);
  // And a taker on an empty second cache.
  auto empty = EchoCache::create(cfg);
  std::atomic<int> take2{-1};
  std::thread taker2([&] {
    std::vector<SampleLease> out;
    take2 = static_cast<int>(empty->take(1, out, -1));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = Clock::now();
  cache->close();
  empty->close();
  putter.join();
  taker2.join();
  take_wake = seconds_since(t0);
  std::printf("close woke a blocked put and take in %.1f ms\n", take_wake * 1e3);
  CHECK(put_status.load() == static_cast<int>(PutStatus::kClosed));
  CHECK(take2.load() == static_cast<int>(TakeStatus::kClosed));
  CHECK(take_wake < 1.0);
  cache->close();  // idempotent
  std::vector<SampleLease> out;
  CHECK(cache->take(1, out, 0) == TakeStatus::kClosed);
  CHECK(cache->put(d, &ptr, 0) == PutStatus::kClosed);
}

void test_drain_and_reset() {
  EchoConfig cfg;
  cfg.capacity_samples = 64;
  cfg.capacity_bytes = 64 * 128;
  cfg.echo_factor = 2.5;
  cfg.min_fill = 32;  // larger than what is put: end_of_input must release the warm-up
  auto cache = EchoCache::create(cfg);
  SampleDesc d = int64_desc(1);
  for (uint64_t i = 0; i < 10; ++i) {
    const void* p = &i;
    CHECK(cache->put(d, &p, 0) == PutStatus::kOk);
  }
  std::vector<SampleLease> out;
  CHECK(cache->take(4, out, 0.05) == TakeStatus::kTimeout);
  cache->end_of_input();
  uint64_t one = 1;
  const void* p1 = &one;
  CHECK(cache->put(d, &p1, 0) == PutStatus::kEnded);
  size_t copies = 0, last_batch = 0;
  uint64_t expected = 0;
  for (;;) {
    out.clear();
    TakeStatus st = cache->take(4, out, 1.0);
    if (st == TakeStatus::kEnd) break;
    CHECK(st == TakeStatus::kOk);
    copies += out.size();
    last_batch = out.size();
  }
  for (auto& l : out) (void)l;
  EchoStats st = cache->stats();
  for (size_t k = 0; k < st.emit_histogram.size(); ++k) expected += k * st.emit_histogram[k];
  CHECK(copies == expected);
  CHECK(copies >= 20 && copies <= 30);
  CHECK(last_batch >= 1 && last_batch <= 4);
  CHECK(cache->take(4, out, 0) == TakeStatus::kEnd);
  cache->reset_input();
  CHECK(cache->put(d, &p1, 0) == PutStatus::kOk);
  cache->end_of_input();
  out.clear();
  CHECK(cache->take(4, out, 1.0) == TakeStatus::kOk);
  CHECK(out.size() == 2 || out.size() == 3);
}

void test_batch_mode() {
  EchoConfig cfg;
  cfg.capacity_samples = 64;
  cfg.capacity_bytes = 64 * 128;
  cfg.echo_factor = 2.0;
  cfg.mode = EchoMode::kBatch;
  cfg.batch_size = 4;
  auto cache = EchoCache::create(cfg);
  SampleDesc d = int64_desc(1);
  std::thread producer([&] {
    for (uint64_t i = 0; i < 42; ++i) {  // 10 full batches + a partial one of 2
      const void* p = &i;
      CHECK(cache->put(d, &p, 5.0) == PutStatus::kOk);
    }
    cache->end_of_input();
  });
  std::vector<int> copies(42, 0);
  std::vector<SampleLease> out;
  CHECK_THROWS(cache->take(3, out, 0), "n=3");
  size_t short_batches = 0;
  for (;;) {
    out.clear();
    TakeStatus st = cache->take(4, out, 5.0);
    if (st == TakeStatus::kEnd) break;
    CHECK(st == TakeStatus::kOk);
    if (out.size() != 4) ++short_batches;
    for (size_t i = 0; i < out.size(); ++i) {
      uint64_t v = *static_cast<const uint64_t*>(out[i].data(0));
      CHECK(v == out[0].sample_id() + i);  // put order inside the batch
      CHECK(out[i].sample_id() == v);
      CHECK(out[i].index_in_unit() == i);
      CHECK(out[i].emission() == out[0].emission());
      copies[v]++;
    }
  }
  producer.join();
  for (int c : copies) CHECK(c == 2);
  CHECK(short_batches == 2);  // the partial batch, echoed twice
}

void test_ragged() {
  EchoConfig cfg;
  cfg.capacity_samples = 256;
  cfg.capacity_bytes = size_t{8} << 20;
  cfg.echo_factor = 2.0;
  cfg.min_fill = 4;
  auto cache = EchoCache::create(cfg);
  const size_t n = 400;
  std::atomic<uint64_t> next{0}, copies{0}, bad{0};
  std::vector<std::thread> th;
  for (int p = 0; p < 2; ++p) {
    th.emplace_back([&, p] {
      std::mt19937 rng(100 + p);
      std::vector<uint64_t> buf;
      for (;;) {
        uint64_t key = next.fetch_add(1);
        if (key >= n) break;
        int64_t words = (40 * 1024 + static_cast<int64_t>(rng() % (560 * 1024))) / 8;
        buf.resize(words);
        fill(buf, key);
        SampleDesc d = int64_desc(words);
        const void* ptr = buf.data();
        CHECK(cache->put(d, &ptr, 30.0) == PutStatus::kOk);
      }
    });
  }
  for (int c = 0; c < 2; ++c) {
    th.emplace_back([&] {
      std::vector<SampleLease> out;
      for (;;) {
        out.clear();
        TakeStatus st = cache->take(3, out, 30.0);
        if (st == TakeStatus::kEnd) break;
        CHECK(st == TakeStatus::kOk);
        for (auto& l : out) {
          if (!payload_ok(l)) bad++;
        }
        copies += out.size();
      }
    });
  }
  th[0].join();
  th[1].join();
  cache->end_of_input();
  th[2].join();
  th[3].join();
  CHECK(copies.load() == 2 * n);
  CHECK(bad.load() == 0);
  CHECK(cache->stats().bytes_used == 0);
  // A sample larger than the arena is an error naming both sizes, not a hang.
  SampleDesc big = int64_desc((size_t{9} << 20) / 8);
  std::vector<uint64_t> buf(big.fields[0].shape[0]);
  const void* ptr = buf.data();
  CHECK_THROWS(cache->put(big, &ptr, -1), "capacity_bytes=8388608");
}

void test_restore() {
  EchoConfig cfg;
  cfg.capacity_samples = 256;
  cfg.capacity_bytes = 256 * 256;
  cfg.echo_factor = 2.5;
  cfg.seed = 7;
  auto a = EchoCache::create(cfg);
  SampleDesc d = int64_desc(3);
  auto put_range = [&](EchoCache& c, uint64_t lo, uint64_t hi) {
    for (uint64_t i = lo; i < hi; ++i) {
      uint64_t v[3] = {i, i * 2, i * 3};
      const void* p = v;
      CHECK(c.put(d, &p, 0) == PutStatus::kOk);
    }
  };
  auto take_ids = [&](EchoCache& c, int rounds) {
    std::vector<uint64_t> ids;
    std::vector<SampleLease> out;
    for (int r = 0; r < rounds; ++r) {
      out.clear();
      if (c.take(8, out, 0) != TakeStatus::kOk) break;
      for (auto& l : out) ids.push_back(*static_cast<const uint64_t*>(l.data(0)));
    }
    return ids;
  };
  put_range(*a, 0, 100);
  (void)take_ids(*a, 10);
  std::vector<uint8_t> blob = a->save_state();
  auto b = EchoCache::create(cfg);
  b->restore_state(blob.data(), blob.size());
  CHECK(b->stats().fresh_in == a->stats().fresh_in);
  CHECK(b->stats().tickets_left == a->stats().tickets_left);
  put_range(*a, 100, 150);
  put_range(*b, 100, 150);
  auto ia = take_ids(*a, 30), ib = take_ids(*b, 30);
  CHECK(!ia.empty());
  CHECK(ia == ib);
  // Errors name the reason.
  CHECK_THROWS(b->restore_state(blob.data(), blob.size()), "empty cache");
  // The echo factor is runtime state: a cache created with another e adopts the saved one.
  EchoConfig other = cfg;
  other.echo_factor = 3.0;
  auto c = EchoCache::create(other);
  a->set_echo_factor(1.5);
  std::vector<uint8_t> blob15 = a->save_state();
  c->restore_state(blob15.data(), blob15.size());
  CHECK(c->echo_factor() == 1.5);
  CHECK(c->config().echo_factor == 3.0);
  c = EchoCache::create(other);
  std::vector<uint8_t> junk(blob.begin(), blob.begin() + 20);
  junk[0] = 'X';
  CHECK_THROWS(c->restore_state(junk.data(), junk.size()), "magic");
  std::vector<uint8_t> cut(blob.begin(), blob.begin() + blob.size() / 2);
  auto d2 = EchoCache::create(cfg);
  CHECK_THROWS(d2->restore_state(cut.data(), cut.size()), "truncated");
}

// Strong guarantees: a corrupt blob or a failing take leaves the cache exactly as it was.
void test_strong_guarantees() {
  EchoConfig cfg;
  cfg.capacity_samples = 64;
  cfg.capacity_bytes = 64 * 128;
  cfg.echo_factor = 2.0;
  cfg.seed = 5;
  auto a = EchoCache::create(cfg);
  SampleDesc d = int64_desc(1);
  for (uint64_t i = 0; i < 20; ++i) {
    const void* p = &i;
    CHECK(a->put(d, &p, 0) == PutStatus::kOk);
  }
  std::vector<uint8_t> blob = a->save_state();
  // A truncated blob throws with the target untouched, and the target still loads a good one.
  for (size_t cut : {blob.size() - 1, blob.size() - 5, blob.size() / 2, size_t{60}}) {
    auto b = EchoCache::create(cfg);
    CHECK_THROWS(b->restore_state(blob.data(), cut), "corrupt");
    EchoStats st = b->stats();
    CHECK(st.resident == 0 && st.fresh_in == 0 && st.tickets_left == 0 && st.bytes_used == 0);
    b->restore_state(blob.data(), blob.size());  // still empty, so a good blob loads
    CHECK(b->stats().tickets_left == 40);
  }
  // A flipped byte, at every position of the blob: sample bytes restore as they are (the blob
  // has no checksum, and any payload is valid); anything else either restores completely, in a
  // cache whose accounting adds up, or throws CacheStateError with the cache untouched.
  size_t refused = 0, loaded = 0;
  for (size_t pos = 0; pos < blob.size(); ++pos) {
    std::vector<uint8_t> flipped = blob;
    flipped[pos] ^= 0x5A;
    auto b = EchoCache::create(cfg);
    try {
      b->restore_state(flipped.data(), flipped.size());
    } catch (const CacheStateError&) {
      ++refused;
      EchoStats st = b->stats();
      CHECK(st.resident == 0 && st.fresh_in == 0 && st.tickets_left == 0 && st.bytes_used == 0);
      b->restore_state(blob.data(), blob.size());
      CHECK(b->stats().tickets_left == 40);
      continue;
    }
    ++loaded;
    // Loaded: every ticket it holds is drawn, and the cache ends empty.
    EchoStats st = b->stats();
    b->end_of_input();
    std::vector<SampleLease> got;
    uint64_t copies = 0;
    while (b->take(4, got, 1) == TakeStatus::kOk) {
      copies += got.size();
      release_leases(got);
    }
    CHECK(copies == st.tickets_left);
    CHECK(b->stats().resident == 0 && b->stats().bytes_used == 0);
  }
  std::printf("flipped bytes: %zu of %zu refused, %zu loaded\n", refused, blob.size(), loaded);
  CHECK(refused > 0 && loaded > 0);
  std::vector<uint8_t> bad = blob;
  bad.push_back(0);  // trailing garbage
  auto b = EchoCache::create(cfg);
  CHECK_THROWS(b->restore_state(bad.data(), bad.size()), "trailing");
  CHECK(b->stats().resident == 0);
  // A take whose output cannot be allocated throws before claiming tickets.
  std::vector<SampleLease> out;
  bool threw = false;
  try {
    a->take(std::numeric_limits<size_t>::max() / 2, out, 0);
  } catch (const std::exception&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(out.empty() && a->stats().tickets_left == 40);
  a->end_of_input();
  size_t copies = 0;
  while (a->take(7, out, 1) == TakeStatus::kOk) {
    copies += out.size();
    release_leases(out);
  }
  CHECK(copies == 40);
  CHECK(a->stats().resident == 0);
}

// wait_for_room blocks like a put, counts as a blocked producer, and ends on close/end of input.
// The sink's quota and layouts live in the core cache.
void test_wait_for_room_quota_layouts() {
  EchoConfig cfg;
  cfg.capacity_samples = 8;
  cfg.capacity_bytes = 8 * 128;
  cfg.echo_factor = 1.0;
  cfg.min_fill = 8;  // takers would wait for 8 samples unless a producer is blocked
  auto c = EchoCache::create(cfg);
  SampleDesc d = int64_desc(1);
  for (uint64_t i = 0; i < 6; ++i) {
    const void* p = &i;
    CHECK(c->put(d, &p, 0) == PutStatus::kOk);
  }
  CHECK(c->wait_for_room(2, 0) == PutStatus::kOk);
  CHECK(c->wait_for_room(3, 0.05) == PutStatus::kTimeout);
  CHECK_THROWS(c->wait_for_room(9, 0), "capacity_samples=8");
  std::atomic<int> status{-1};
  std::thread waiter([&] { status = static_cast<int>(c->wait_for_room(3, 10)); });
  std::vector<SampleLease> out;
  // The waiter counts as a blocked producer: the warm-up is skipped and a take succeeds.
  CHECK(c->take(1, out, 5) == TakeStatus::kOk);
  release_leases(out);
  waiter.join();
  CHECK(status == static_cast<int>(PutStatus::kOk));
  std::thread closed_waiter([&] { status = static_cast<int>(c->wait_for_room(8, -1)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  c->close();
  closed_waiter.join();
  CHECK(status == static_cast<int>(PutStatus::kClosed));

  CHECK(c->quota() < 0 && c->take_quota());
  c->set_quota(2);
  CHECK(c->take_quota() && c->take_quota() && !c->take_quota() && c->quota() == 0);
  c->set_quota(-5);
  CHECK(c->quota() == -1 && c->take_quota());
  CHECK(c->layouts().empty());
  c->record_layout(1, "HWC");
  CHECK((c->layouts() == std::vector<std::string>{"", "HWC"}));
  c->set_layouts({"CHW"});
  CHECK((c->layouts() == std::vector<std::string>{"CHW"}));
  CHECK_THROWS(c->record_layout(4, "x"), "field 4");
  CHECK_THROWS(c->set_layouts({"a", "b", "c", "d", "e"}), "at most 4");
}

// A big cache with very few tickets left: draws fall back from random probes to a scan and still
// find every ticket (each of the few samples is emitted exactly its ticket count).
void test_sparse_draws() {
  EchoConfig cfg;
  cfg.capacity_samples = 1 << 16;
  cfg.capacity_bytes = size_t{1} << 23;
  cfg.echo_factor = 3.0;
  auto c = EchoCache::create(cfg);
  SampleDesc d = int64_desc(1);
  for (uint64_t i = 0; i < 3; ++i) {
    const void* p = &i;
    CHECK(c->put(d, &p, 0) == PutStatus::kOk);
  }
  c->end_of_input();
  std::vector<int> seen(3, 0);
  std::vector<SampleLease> out;
  while (c->take(1, out, 1) == TakeStatus::kOk) {
    ++seen[*static_cast<const uint64_t*>(out[0].data(0))];
    release_leases(out);
  }
  CHECK(seen == std::vector<int>({3, 3, 3}));
}

// Draws probe the slots below the allocator's high-water mark. Once a cache has been full and
// drained, the mark comes down with the next put (to just above the highest used slot), or every
// draw among the few new samples would probe thousands of free slots first. The free-slot set's
// query for it is checked against a brute-force count on random sets.
void test_probe_range_follows_use() {
  std::mt19937_64 rng(7);
  for (uint32_t n : {1u, 63u, 64u, 65u, 4096u, 5000u, 300000u}) {
    detail::FreeSlotSet set(n, true);
    std::vector<bool> is_free(n, true);
    for (uint32_t k = 0; k < std::min<uint32_t>(n, 2000); ++k) {
      const uint32_t s = set.pop_lowest();  // lowest-first, as a put takes slots
      is_free[s] = false;
    }
    for (uint32_t k = 0; k < std::min<uint32_t>(n, 600); ++k) {
      const auto s = static_cast<uint32_t>(rng() % n);
      if (!is_free[s]) {
        set.insert(s);
        is_free[s] = true;
      }
    }
    for (uint32_t end : {0u, 1u, n / 3, n - 1, n}) {
      uint32_t want = 0;
      for (uint32_t s = 0; s < end; ++s) {
        if (!is_free[s]) want = s + 1;
      }
      CHECK(set.used_end(end) == want);
      if (end < n) CHECK(set.contains(end) == is_free[end]);
    }
  }

  EchoConfig cfg;
  cfg.capacity_samples = 4096;
  cfg.capacity_bytes = 4096 * 64;
  cfg.echo_factor = 2.0;
  auto c = EchoCache::create(cfg);
  SampleDesc d = int64_desc(1);
  for (uint64_t i = 0; i < cfg.capacity_samples; ++i) {
    const void* p = &i;
    CHECK(c->put(d, &p, 0) == PutStatus::kOk);
  }
  CHECK(c->stats().probe_slots == cfg.capacity_samples);
  c->end_of_input();
  std::vector<SampleLease> out;
  while (c->take(64, out, 1) == TakeStatus::kOk) release_leases(out);
  c->reset_input();
  for (uint64_t i = 0; i < 3; ++i) {
    const void* p = &i;
    CHECK(c->put(d, &p, 0) == PutStatus::kOk);
  }
  CHECK(c->stats().probe_slots == 3);
  c->end_of_input();
  std::vector<int> seen(3, 0);
  while (c->take(1, out, 1) == TakeStatus::kOk) {
    ++seen[*static_cast<const uint64_t*>(out[0].data(0))];
    release_leases(out);
  }
  CHECK(seen == std::vector<int>({2, 2, 2}));
}

// Tickets follow set_echo_factor() for units published after the call; units already in the
// cache keep theirs; accounting stays exact.
void test_set_echo_factor() {
  EchoConfig cfg;
  cfg.capacity_samples = 512;
  cfg.capacity_bytes = 512 * 128;
  cfg.echo_factor = 2.0;
  cfg.seed = 3;
  auto cache = EchoCache::create(cfg);
  CHECK(cache->echo_factor() == 2.0);
  CHECK_THROWS(cache->set_echo_factor(0.5), "0.5");
  CHECK_THROWS(cache->set_echo_factor(std::nan("")), "nan");
  CHECK(cache->echo_factor() == 2.0);
  SampleDesc d = int64_desc(1);
  auto put_range = [&](uint64_t lo, uint64_t hi) {
    for (uint64_t i = lo; i < hi; ++i) {
      const void* p = &i;
      CHECK(cache->put(d, &p, 0) == PutStatus::kOk);
    }
  };
  put_range(0, 100);
  cache->set_echo_factor(3.0);
  CHECK(cache->echo_factor() == 3.0);
  CHECK(cache->config().echo_factor == 2.0);
  put_range(100, 200);
  cache->set_echo_factor(1.0);
  put_range(200, 300);
  cache->end_of_input();
  std::vector<uint32_t> seen(300, 0), tick(300, 0);
  std::vector<SampleLease> out;
  for (;;) {
    out.clear();
    TakeStatus st = cache->take(7, out, 1.0);
    if (st == TakeStatus::kEnd) break;
    CHECK(st == TakeStatus::kOk);
    for (auto& l : out) {
      uint64_t k = *static_cast<const uint64_t*>(l.data(0));
      ++seen[k];
      tick[k] = l.tickets();
    }
  }
  uint64_t wrong = 0;
  for (uint64_t k = 0; k < 300; ++k) {
    uint32_t want = k < 100 ? 2 : (k < 200 ? 3 : 1);
    if (seen[k] != want || tick[k] != want) ++wrong;
  }
  CHECK(wrong == 0);
  EchoStats st = cache->stats();
  CHECK(st.emitted == 600);
  CHECK(st.retired == 300 && st.resident == 0 && st.bytes_used == 0);

  // Concurrent changes while 2 producers and 2 consumers run: every sample is still emitted
  // exactly its ticket count, and every count is floor or ceil of some factor that was set.
  const size_t n = std::min<size_t>(stress_samples(), 40000);
  cfg.min_fill = 64;
  auto c2 = EchoCache::create(cfg);
  std::vector<std::atomic<uint32_t>> seen2(n), tick2(n);
  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> th;
  for (int p = 0; p < 2; ++p) {
    th.emplace_back([&] {
      for (uint64_t k; (k = next.fetch_add(1)) < n;) {
        const void* ptr = &k;
        CHECK(c2->put(d, &ptr, -1) == PutStatus::kOk);
      }
    });
  }
  for (int c = 0; c < 2; ++c) {
    th.emplace_back([&] {
      std::vector<SampleLease> o;
      for (;;) {
        o.clear();
        TakeStatus s = c2->take(16, o, -1);
        if (s == TakeStatus::kEnd) break;
        CHECK(s == TakeStatus::kOk);
        for (auto& l : o) {
          uint64_t k = *static_cast<const uint64_t*>(l.data(0));
          seen2[k].fetch_add(1);
          tick2[k].store(l.tickets());
        }
      }
    });
  }
  std::thread setter([&] {
    const double es[] = {1.0, 2.0, 3.5, 1.5};
    for (int i = 0; !stop.load(); ++i) {
      c2->set_echo_factor(es[i % 4]);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  th[0].join();
  th[1].join();
  stop.store(true);
  setter.join();
  c2->end_of_input();
  th[2].join();
  th[3].join();
  uint64_t bad = 0, copies = 0;
  for (size_t k = 0; k < n; ++k) {
    uint32_t s = seen2[k].load();
    copies += s;
    if (s != tick2[k].load() || s < 1 || s > 4) ++bad;
  }
  CHECK(bad == 0);
  CHECK(c2->stats().emitted == copies);
  CHECK(c2->stats().retired == n);
}

void test_validation_and_lifetime() {
  EchoConfig cfg;
  cfg.echo_factor = 0.5;
  CHECK_THROWS(cfg.validate(), "0.5");
  cfg.echo_factor = 2;
  cfg.capacity_samples = 0;
  CHECK_THROWS(EchoCache::create(cfg), "capacity_samples");
  cfg.capacity_samples = 8;
  cfg.min_fill = 9;
  CHECK_THROWS(EchoCache::create(cfg), "min_fill=9");
  CHECK_THROWS(dtype_from_name("complex64"), "complex64");
  CHECK(dtype_from_name("f4") == DType::kFloat32);
  CHECK(std::string(dtype_name(DType::kBFloat16)) == "bfloat16");
  cfg.min_fill = 0;
  cfg.capacity_bytes = 4096;
  auto reg = create_cache("test-registry", cfg);
  CHECK(find_cache("test-registry") == reg);
  CHECK(find_cache(reg->handle()) == reg);
  CHECK_THROWS(create_cache("test-registry", cfg), "test-registry");
  CHECK(remove_cache("test-registry"));
  CHECK(find_cache("test-registry") == nullptr);
  // A lease keeps the memory alive after close() and after every other owner is gone.
  SampleLease keep;
  {
    auto c = EchoCache::create(cfg);
    uint64_t v = 77;
    const void* p = &v;
    CHECK(c->put(int64_desc(1), &p, 0) == PutStatus::kOk);
    std::vector<SampleLease> out;
    CHECK(c->take(1, out, 0) == TakeStatus::kOk);
    keep = std::move(out[0]);
    c->close();
  }
  CHECK(keep.valid());
  CHECK(*static_cast<const uint64_t*>(keep.data(0)) == 77);
  keep.release();
  CHECK(!keep.valid());
  CHECK(!built_with_cuda() || cuda_device_count() >= 0);
}

}  // namespace

// gather() copies each lease's field back to back (ragged sizes: offsets), from leases of
// samples scattered over the arena, and leaves the leases valid; release_leases() then frees them.
void test_gather_ragged() {
  EchoConfig cfg;
  cfg.capacity_samples = 64;
  cfg.capacity_bytes = size_t{1} << 20;
  cfg.echo_factor = 1.0;
  cfg.min_fill = 1;
  auto cache = EchoCache::create(cfg);
  std::vector<uint64_t> buf;
  for (uint64_t key = 0; key < 40; ++key) {
    const int64_t words = 1 + static_cast<int64_t>(key % 7) * 60;  // 8 B .. 2.9 KB
    buf.resize(static_cast<size_t>(words));
    fill(buf, key);
    const void* ptr = buf.data();
    CHECK(cache->put(int64_desc(words), &ptr, 0) == PutStatus::kOk);
  }
  cache->end_of_input();
  std::vector<SampleLease> leases;
  CHECK(cache->take(40, leases, 10.0) == TakeStatus::kOk);
  CHECK(leases.size() == 40);
  std::vector<uint8_t> out(gather_bytes(leases, 0));
  std::vector<int64_t> offsets(leases.size() + 1, -1);
  gather(leases, 0, out.data(), offsets.data());
  CHECK(offsets[0] == 0 && static_cast<size_t>(offsets.back()) == out.size());
  for (size_t i = 0; i < leases.size(); ++i) {
    const auto* got = reinterpret_cast<const uint64_t*>(out.data() + offsets[i]);
    const int64_t words = (offsets[i + 1] - offsets[i]) / 8;
    CHECK(words == leases[i].desc().fields[0].shape[0]);
    CHECK(std::memcmp(got, leases[i].data(0), static_cast<size_t>(words) * 8) == 0);
    for (int64_t w = 1; w < words; ++w) CHECK(got[w] == word(got[0], w));
  }
  std::vector<SampleLease> none;
  gather(none, 0, nullptr, nullptr);  // nothing to copy, nothing touched
  release_leases(leases);
  CHECK(leases.empty());
  leases.clear();
  CHECK(cache->take(1, leases, 0) == TakeStatus::kEnd);
}

int main() {
  size_t n = stress_samples();
  test_validation_and_lifetime();
  test_close_wakes();
  test_drain_and_reset();
  test_batch_mode();
  test_restore();
  test_strong_guarantees();
  test_wait_for_room_quota_layouts();
  test_sparse_draws();
  test_probe_range_follows_use();
  test_set_echo_factor();
  test_ragged();
  test_gather_ragged();
  for (double e : {1.0, 2.0, 3.5}) test_stress(e, n);
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("all echo cache tests passed\n");
  return 0;
}
