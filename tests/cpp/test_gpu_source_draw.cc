// The DALI GPU echo source's draw-and-hold cycle (csrc/dali/source_draw.h) on a cache of the
// smallest size the DALI config allows, run on the CPU: the source keeps the leases of up to two
// earlier batches until their copies have ended, and here those copies end only once the next
// draw has started to wait (a "stream" thread marks them done then), the worst order a GPU can
// give. The slots of both held batches fill the cache, so the producer can put nothing until the
// draw gives them back between its attempts; a draw that does not would wait forever. A watchdog
// closes the cache if the run stops making progress, so a regression fails instead of hanging.
// Also built by tests/test_gpu_plan.py against the installed core. Exit status 0 = passed.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "dali/source_draw.h"
#include "echo/echo_cache.h"

using namespace echopipe;
using echopipe_dali::DrawEnd;

namespace {

int g_failures = 0;

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                 \
    }                                                                               \
  } while (0)

// One batch whose copies were queued: its leases, and whether the "stream" has finished it.
struct Flight {
  std::vector<SampleLease> leases;
  std::shared_ptr<std::atomic<bool>> done;
};

// When a draw starts, marks done every flight but the newest: the copies of the batch before
// last end while the source is already drawing, after its retire before the draw found both
// pending (the newest stays pending, so two batches are held at every draw's start).
class FakeStream {
 public:
  void queued(const std::shared_ptr<std::atomic<bool>>& done) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(done);
  }
  void draw_started() {
    std::lock_guard<std::mutex> lock(mu_);
    ++draws_;
    cv_.notify_all();
  }
  void stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    int seen = 0;
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || draws_ > seen; });
      if (stop_) return;
      seen = draws_;
      if (pending_.size() < 2) continue;
      for (size_t i = 0; i + 1 < pending_.size(); ++i) pending_[i]->store(true);
      pending_.erase(pending_.begin(), pending_.end() - 1);
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<std::atomic<bool>>> pending_;
  int draws_ = 0;
  bool stop_ = false;
};

void test_minimum_cache_does_not_hang_with_two_batches_held() {
  constexpr int kBatch = 4;
  constexpr int kSamples = 64;
  EchoConfig cfg;
  // echopipe.dali's smallest cache: max(shuffle_buffer, batch_size) + upstream_batch_size.
  cfg.capacity_samples = kBatch + kBatch;
  cfg.capacity_bytes = 1 << 20;
  cfg.echo_factor = 1.0;  // every sample once: a held batch's slots have no tickets left
  cfg.min_fill = kBatch;
  cfg.memory = MemoryKind::kPageable;
  auto cache = EchoCache::create(cfg);

  SampleDesc desc;
  desc.num_fields = 1;
  desc.fields[0].dtype = DType::kInt64;
  desc.fields[0].ndim = 0;
  std::thread producer([&] {
    for (int64_t k = 0; k < kSamples; ++k) {
      const void* data = &k;
      if (cache->put(desc, &data) != PutStatus::kOk) return;
    }
    cache->end_of_input();
  });

  FakeStream stream;
  std::thread stream_thread([&] { stream.run(); });

  // The hang guard: progress is counted; no progress for 20 s closes the cache.
  std::atomic<int> progress{0};
  std::atomic<bool> finished{false}, hung{false};
  std::thread watchdog([&] {
    int last = -1;
    auto since = std::chrono::steady_clock::now();
    while (!finished.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const int now = progress.load();
      if (now != last) {
        last = now;
        since = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - since > std::chrono::seconds(20)) {
        hung = true;
        cache->close();
        return;
      }
    }
  });

  // The GPU source's cycle: retire what has finished, draw (retiring between attempts), queue.
  echopipe_dali::FlightQueue<Flight> flights;
  auto is_done = [](Flight& f) { return f.done->load(); };
  auto wait = [](Flight& f) {
    while (!f.done->load()) std::this_thread::yield();
  };
  auto retired = [](Flight&) {};
  auto retire = [&] { flights.retire(2, is_done, wait, retired); };
  std::set<int64_t> drawn;
  int draws = 0;
  bool ended = false;
  while (!ended) {
    retire();
    std::vector<SampleLease> leases;
    stream.draw_started();
    const DrawEnd end = echopipe_dali::take_batch(*cache, kBatch, leases, retire);
    if (end == DrawEnd::kClosed) break;
    ended = end == DrawEnd::kEnded;
    for (const auto& l : leases) drawn.insert(*static_cast<const int64_t*>(l.data(0)));
    ++draws;
    progress.fetch_add(1);
    Flight f{std::move(leases), std::make_shared<std::atomic<bool>>(false)};
    stream.queued(f.done);
    flights.push(std::move(f));
  }
  finished = true;
  watchdog.join();
  stream.stop();
  stream_thread.join();
  flights.retire(0, is_done, [](Flight&) {}, retired);
  cache->close();
  producer.join();

  if (hung.load()) {
    std::fprintf(stderr,
                 "the draw waited with the leases of finished batches held and the producer "
                 "blocked for space (after %d draws): it hung\n",
                 draws);
  }
  CHECK(!hung.load());
  CHECK(static_cast<int>(drawn.size()) == kSamples);
}

}  // namespace

int main() {
  test_minimum_cache_does_not_hang_with_two_batches_held();
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("gpu source draw tests passed\n");
  return 0;
}
