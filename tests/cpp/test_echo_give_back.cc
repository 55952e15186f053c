// C++ tests of the echo cache core, run by ctest (also under -fsanitize=thread and =address):
// copies handed back after a claim (EchoCache::give_back, what the Python take_batch does when it
// cannot gather a batch) are emitted later, exactly their ticket count, and releases wake
// producers blocked on a full cache (they sleep on a futex word: a release takes no mutex), with
// exact accounting under producers, consumers and releasing threads. Also the typed errors.
// Exit status 0 = all passed. ECHOPIPE_STRESS_SAMPLES scales the stress size (default 200000).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "echo/echo_cache.h"
#include "echo_test_support.h"

using namespace echopipe;
using namespace echopipe::testing;

namespace {

size_t stress_samples() {
  const char* env = std::getenv("ECHOPIPE_STRESS_SAMPLES");
  return (env ? std::strtoull(env, nullptr, 10) : size_t{200000}) / 4;
}

uint64_t key_of(const SampleLease& l) { return static_cast<const uint64_t*>(l.data(0))[0]; }

void put_keys(EchoCache& c, uint64_t lo, uint64_t hi) {
  for (uint64_t k = lo; k < hi; ++k) {
    const void* p = &k;
    CHECK(c.put(int64_desc(1), &p, 0) == PutStatus::kOk);
  }
}

// Polls a state condition the cache keeps (a counter), failing after 10 s.
template <typename F>
void until(F condition) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) {
      CHECK(!"the condition never held");
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// One consumer: copies handed back are drawn again and emitted exactly their ticket count, with
// their emission numbers, and the counters read as if they had never been taken.
void test_give_back_example_mode() {
  EchoConfig cfg;
  cfg.capacity_samples = 16;
  cfg.capacity_bytes = 16 * 128;
  cfg.echo_factor = 2.0;
  auto c = EchoCache::create(cfg);
  put_keys(*c, 0, 3);
  std::vector<SampleLease> out;
  CHECK(c->take(4, out, 0) == TakeStatus::kOk);
  CHECK(out.size() == 4 && c->stats().emitted == 4 && c->stats().tickets_left == 2);
  c->give_back(out);
  CHECK(out.empty());
  EchoStats st = c->stats();
  CHECK(st.emitted == 0 && st.tickets_left == 6 && st.resident_with_tickets == 3);
  c->end_of_input();
  std::vector<std::vector<uint32_t>> emissions(3);
  while (c->take(2, out, 0) == TakeStatus::kOk) {
    for (const auto& l : out) emissions[key_of(l)].push_back(l.emission());
    release_leases(out);
  }
  for (auto& e : emissions) {
    std::sort(e.begin(), e.end());
    CHECK((e == std::vector<uint32_t>{0, 1}));
  }
  st = c->stats();
  CHECK(st.emitted == 6 && st.retired == 3 && st.resident == 0 && st.bytes_used == 0);
}

// Batch mode: whole units go back; a unit missing members is released (those copies count as
// emitted), and leases of another cache are released too.
void test_give_back_batch_mode() {
  EchoConfig cfg;
  cfg.capacity_samples = 16;
  cfg.capacity_bytes = 16 * 128;
  cfg.echo_factor = 1.0;
  cfg.mode = EchoMode::kBatch;
  cfg.batch_size = 3;
  auto c = EchoCache::create(cfg);
  auto other = EchoCache::create(cfg);
  put_keys(*c, 0, 6);
  put_keys(*other, 100, 103);
  std::vector<SampleLease> out, foreign;
  CHECK(c->take(6, out, 0) == TakeStatus::kOk && out.size() == 6);
  CHECK(other->take(3, foreign, 0) == TakeStatus::kOk);
  const uint64_t whole = out[0].sample_id() / 3;  // the unit handed back whole
  out.pop_back();                                 // the second unit loses a member
  for (auto& l : foreign) out.push_back(std::move(l));
  c->give_back(out);
  CHECK(out.empty());
  CHECK(c->stats().emitted == 3 && c->stats().tickets_left == 1);
  CHECK(other->stats().emitted == 3 && other->stats().tickets_left == 0);
  c->end_of_input();
  CHECK(c->take(3, out, 0) == TakeStatus::kOk && out.size() == 3);
  for (uint32_t i = 0; i < 3; ++i) {
    CHECK(out[i].sample_id() == whole * 3 + i && out[i].index_in_unit() == i);
  }
  release_leases(out);
  CHECK(c->take(3, out, 0) == TakeStatus::kEnd);
  CHECK(c->stats().retired == 6 && c->stats().resident == 0);
}

// Producers and consumers at full speed; every consumer hands back about one take in three (a
// take_batch that raised after its claim). Exact accounting of what was delivered.
void test_give_back_stress(EchoMode mode) {
  const size_t n = stress_samples();
  const size_t unit = mode == EchoMode::kBatch ? 4 : 1;
  EchoConfig cfg;
  cfg.capacity_samples = 512;
  cfg.capacity_bytes = 512 * 128;
  cfg.echo_factor = 2.5;
  cfg.min_fill = 64;
  cfg.seed = 3;
  cfg.mode = mode;
  cfg.batch_size = unit;
  auto c = EchoCache::create(cfg);
  std::vector<std::atomic<uint32_t>> seen(n), tickets(n);
  std::atomic<uint64_t> next{0}, handed_back{0}, bad{0};
  std::vector<std::thread> producers, consumers;
  for (int p = 0; p < 3; ++p) {
    producers.emplace_back([&] {
      std::vector<uint64_t> buf(3);
      for (uint64_t k; (k = next.fetch_add(1)) < n;) {
        fill(buf, k);
        const void* ptr = buf.data();
        CHECK(c->put(int64_desc(3), &ptr, -1) == PutStatus::kOk);
      }
    });
  }
  for (int t = 0; t < 3; ++t) {
    consumers.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<SampleLease> out;
      for (;;) {
        const TakeStatus st = c->take(unit * (1 + t), out, -1);
        if (st == TakeStatus::kEnd) break;
        CHECK(st == TakeStatus::kOk);
        if (rng() % 3 == 0) {
          handed_back.fetch_add(out.size());
          c->give_back(out);
          CHECK(out.empty());
          continue;
        }
        for (const auto& l : out) {
          const uint64_t k = key_of(l);
          if (k >= n || !payload_ok(l) || l.emission() >= l.tickets()) {
            bad.fetch_add(1);
            continue;
          }
          seen[k].fetch_add(1);
          tickets[k].store(l.tickets());
        }
        release_leases(out);
      }
    });
  }
  for (auto& t : producers) t.join();
  c->end_of_input();
  for (auto& t : consumers) t.join();
  uint64_t total = 0, wrong = 0;
  for (size_t k = 0; k < n; ++k) {
    total += seen[k].load();
    if (seen[k].load() == 0 || seen[k].load() != tickets[k].load()) ++wrong;
  }
  const EchoStats st = c->stats();
  std::printf("give_back stress (%s): %zu samples, %llu copies delivered, %llu handed back\n",
              echo_mode_name(mode), n, static_cast<unsigned long long>(total),
              static_cast<unsigned long long>(handed_back.load()));
  CHECK(bad.load() == 0);
  CHECK(wrong == 0);
  CHECK(handed_back.load() > 0);
  CHECK(st.emitted == total);
  CHECK(st.fresh_in == n && st.retired == n && st.resident == 0 && st.bytes_used == 0);
  std::vector<SampleLease> out;
  CHECK(c->take(unit, out, 0) == TakeStatus::kEnd);
}

// A producer blocked without a timeout on a full cache is woken by a lease released on another
// thread (the release wakes it; it takes no mutex to do so).
void test_release_wakes_blocked_producer() {
  EchoConfig cfg;
  cfg.capacity_samples = 1;
  cfg.capacity_bytes = 4096;
  cfg.echo_factor = 1.0;
  auto c = EchoCache::create(cfg);
  put_keys(*c, 0, 1);
  std::vector<SampleLease> held;
  CHECK(c->take(1, held, 0) == TakeStatus::kOk);  // the slot stays leased
  std::atomic<int> status{-1};
  std::thread producer([&] {
    uint64_t k = 1;
    const void* p = &k;
    status = static_cast<int>(c->put(int64_desc(1), &p, -1));
  });
  until([&] { return c->stats().puts_blocked == 1; });
  CHECK(status.load() == -1);
  std::thread releaser([&] { release_leases(held); });
  releaser.join();
  producer.join();
  CHECK(status.load() == static_cast<int>(PutStatus::kOk));
  CHECK(c->stats().fresh_in == 2);
}

// Releases on their own threads while producers block on a tiny cache, some without a timeout
// and some with a short one (retried): nothing lost, nothing extra, no race (TSAN).
void test_releases_with_waiting_producers() {
  const size_t n = stress_samples() / 5;
  EchoConfig cfg;
  cfg.capacity_samples = 16;
  cfg.capacity_bytes = 16 * 128;
  cfg.echo_factor = 1.5;
  cfg.seed = 11;
  auto c = EchoCache::create(cfg);
  std::vector<std::atomic<uint32_t>> seen(n), tickets(n);
  std::atomic<uint64_t> next{0}, bad{0};
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::vector<SampleLease>> to_release;
  bool consumers_done = false;
  std::vector<std::thread> threads;
  for (int p = 0; p < 4; ++p) {
    threads.emplace_back([&, p] {
      for (uint64_t k; (k = next.fetch_add(1)) < n;) {
        const void* ptr = &k;
        PutStatus st;
        while ((st = c->put(int64_desc(1), &ptr, p % 2 ? 0.002 : -1.0)) == PutStatus::kTimeout) {
        }
        CHECK(st == PutStatus::kOk);
      }
    });
  }
  std::vector<std::thread> consumers, releasers;
  for (int t = 0; t < 2; ++t) {
    consumers.emplace_back([&] {
      for (;;) {
        std::vector<SampleLease> out;
        const TakeStatus st = c->take(4, out, -1);
        if (st == TakeStatus::kEnd) break;
        CHECK(st == TakeStatus::kOk);
        for (const auto& l : out) {
          const uint64_t k = key_of(l);
          if (k >= n) {
            bad.fetch_add(1);
            continue;
          }
          seen[k].fetch_add(1);
          tickets[k].store(l.tickets());
        }
        std::lock_guard<std::mutex> lk(mu);
        to_release.push_back(std::move(out));
        cv.notify_one();
      }
    });
    releasers.emplace_back([&, t] {
      for (;;) {
        std::vector<SampleLease> batch;
        {
          std::unique_lock<std::mutex> lk(mu);
          cv.wait(lk, [&] { return !to_release.empty() || consumers_done; });
          if (to_release.empty()) return;
          batch = std::move(to_release.front());
          to_release.pop_front();
        }
        if (t == 0) {
          release_leases(batch);
        } else {
          for (auto& l : batch) l.release();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  c->end_of_input();
  for (auto& t : consumers) t.join();
  {
    std::lock_guard<std::mutex> lk(mu);
    consumers_done = true;
  }
  cv.notify_all();
  for (auto& t : releasers) t.join();
  uint64_t total = 0, wrong = 0;
  for (size_t k = 0; k < n; ++k) {
    total += seen[k].load();
    if (seen[k].load() == 0 || seen[k].load() != tickets[k].load()) ++wrong;
  }
  const EchoStats st = c->stats();
  std::printf("releases with waiting producers: %zu samples, %llu copies, %llu puts blocked\n", n,
              static_cast<unsigned long long>(total),
              static_cast<unsigned long long>(st.puts_blocked));
  CHECK(bad.load() == 0 && wrong == 0);
  CHECK(st.puts_blocked > 0);
  CHECK(st.emitted == total && st.retired == n && st.resident == 0 && st.bytes_used == 0);
}

// The typed errors: a sample larger than the arena, a state this cache cannot load.
void test_typed_errors() {
  EchoConfig cfg;
  cfg.capacity_samples = 4;
  cfg.capacity_bytes = 4096;
  auto c = EchoCache::create(cfg);
  CHECK(c->refused_sample_bytes() == 0);
  std::vector<uint64_t> big(1000);
  const void* p = big.data();
  bool typed = false;
  try {
    c->put(int64_desc(1000), &p, 0);
  } catch (const SampleTooLargeError& e) {
    typed = e.sample_bytes() == 8000 && e.capacity_bytes() == 4096;
  }
  CHECK(typed);
  CHECK(c->refused_sample_bytes() == 8000);
  put_keys(*c, 0, 1);
  const std::vector<uint8_t> blob = c->save_state();
  typed = false;
  try {
    c->restore_state(blob.data(), blob.size());  // not empty
  } catch (const CacheStateError&) {
    typed = true;
  }
  CHECK(typed);
}

}  // namespace

int main() {
  test_typed_errors();
  test_give_back_example_mode();
  test_give_back_batch_mode();
  test_release_wakes_blocked_producer();
  test_give_back_stress(EchoMode::kExample);
  test_give_back_stress(EchoMode::kBatch);
  test_releases_with_waiting_producers();
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("all give-back and wake tests passed\n");
  return 0;
}
