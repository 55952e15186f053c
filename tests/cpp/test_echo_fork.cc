// A cache in a process forked from the one that created it: every use there throws
// CacheForkedError, close() and the last owner's release neither lock nor destroy the copy (a
// parent thread may hold its locks or wait on its condition variable), a child may create caches
// of its own under inherited names, and the registry's lock is never inherited held.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "echo_test_support.h"

using namespace echopipe;
using namespace echopipe::testing;

namespace {

EchoConfig small_config() {
  EchoConfig cfg;
  cfg.capacity_bytes = size_t{1} << 20;
  cfg.capacity_samples = 16;
  cfg.echo_factor = 1.0;
  cfg.memory = MemoryKind::kPageable;
  return cfg;
}

void put_key(EchoCache& c, uint64_t key) {
  std::vector<uint64_t> buf(4);
  fill(buf, key);
  const void* data[1] = {buf.data()};
  CHECK(c.put(int64_desc(4), data, 0.0) == PutStatus::kOk);
}

// Runs `child` in a forked process and returns its exit status (its failure count), or -1 when it
// did not end within `limit_s` (it is killed then).
template <typename F>
int in_fork(F&& child, double limit_s = 30.0) {
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    g_failures = 0;
    child();
    std::fflush(stderr);
    _exit(g_failures > 0 ? 1 : 0);  // no atexit handlers or destructors of the parent's objects
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Whether thread `tid` of this process sleeps in the kernel now (state S in /proc).
bool sleeping(pid_t tid) {
  if (tid == 0) return false;
  const std::string path = "/proc/self/task/" + std::to_string(tid) + "/stat";
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return false;
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const std::string stat(buf, n);
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'S';
}

template <typename F>
bool throws_forked(F&& use, int64_t creator, bool* named_ok) {
  try {
    use();
  } catch (const CacheForkedError& e) {
    *named_ok = e.creator_pid() == creator && e.pid() == static_cast<int64_t>(getpid()) &&
                std::string(e.what()).find("is a fork of it") != std::string::npos;
    return true;
  }
  return false;
}

void test_every_use_in_a_forked_child_throws() {
  const auto parent = static_cast<int64_t>(getpid());
  auto cache = create_cache("fork-test", small_config());
  put_key(*cache, 1);
  const uint64_t inherited = cache->handle();
  const int status = in_fork([&] {
    CHECK(cache->forked());
    CHECK(fork_generation() >= 1);
    bool named = false;
    std::vector<SampleLease> out;
    CHECK(throws_forked([&] { cache->take(1, out, 0.0); }, parent, &named) && named);
    CHECK(out.empty());
    CHECK(throws_forked([&] { put_key(*cache, 2); }, parent, &named) && named);
    CHECK(throws_forked([&] { (void)cache->stats(); }, parent, &named));
    CHECK(throws_forked([&] { (void)cache->save_state(); }, parent, &named));
    CHECK(throws_forked([&] { cache->end_of_input(); }, parent, &named));
    CHECK(throws_forked([&] { cache->wait_for_room(1, 0.0); }, parent, &named));
    CHECK(throws_forked([&] { cache->set_echo_factor(2.0); }, parent, &named));
    CHECK(throws_forked([&] { (void)cache->take_quota(); }, parent, &named));
    CHECK(throws_forked([&] { (void)cache->layouts(); }, parent, &named));
    cache->close();  // does nothing here
    CHECK(!cache->closed());
    // The inherited cache is still found (using it says why it cannot be used)...
    CHECK(find_cache("fork-test") == cache);
    // ...and gives its name up to a cache of this process.
    auto own = create_cache("fork-test", small_config());
    CHECK(!own->forked() && own->handle() != inherited);
    put_key(*own, 7);
    std::vector<SampleLease> got;
    CHECK(own->take(1, got, 0.0) == TakeStatus::kOk && got.size() == 1);
    CHECK(got.size() == 1 && *static_cast<const uint64_t*>(got[0].data(0)) == 7);
    got.clear();
    CHECK(!remove_cache("fork-test", inherited));  // the inherited one's close leaves it alone
    CHECK(find_cache("fork-test") == own);
    CHECK(remove_cache("fork-test", own->handle()));
    cache.reset();  // the last owner of the copy: left alone, not destroyed
  });
  CHECK(status == 0);
  // The parent's cache is its own still, untouched by the child.
  CHECK(!cache->forked());
  std::vector<SampleLease> out;
  CHECK(cache->take(1, out, 0.0) == TakeStatus::kOk && out.size() == 1);
  CHECK(out.size() == 1 && *static_cast<const uint64_t*>(out[0].data(0)) == 1);
  out.clear();
  CHECK(find_cache("fork-test") == cache);
  CHECK(remove_cache("fork-test", cache->handle()));
}

// A consumer of the parent waits in take() on the cache's condition variable when the process
// forks: in the child, destroying (or notifying) the copy would wait for that waiter for ever.
void test_a_child_lets_go_of_a_cache_a_parent_thread_waits_in() {
  auto cache = create_cache("", small_config());
  std::atomic<bool> taken{false};
  std::atomic<pid_t> tid{0};
  std::thread consumer([&] {
    tid = gettid();
    std::vector<SampleLease> out;
    taken = cache->take(1, out, 30.0) == TakeStatus::kOk;
  });
  // Waiting counted, then asleep in the kernel: inside the condition variable's wait.
  while (cache->stats().takes_waited == 0 || !sleeping(tid.load())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const std::string name = cache->name();
  const int status = in_fork([&] {
    CHECK(remove_cache(name));
    cache->close();
    cache.reset();  // the last owner
  });
  CHECK(status == 0);
  put_key(*cache, 3);
  consumer.join();
  CHECK(taken.load());
  remove_cache(name);
}

// fork() while another thread creates and removes caches: the registry's lock is taken around
// fork(), so a child never inherits it held by a thread that does not exist there.
void test_the_registry_is_usable_in_a_child_forked_while_it_is_busy() {
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    for (uint64_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      const std::string name = "busy-" + std::to_string(i % 4);
      auto c = create_cache(name, small_config());
      remove_cache(name);
    }
  });
  int hung = 0, failed = 0;
  for (int i = 0; i < 40; ++i) {
    const int status = in_fork(
        [] {
          auto own = create_cache("in-child", small_config());
          CHECK(find_cache("in-child") == own);
          CHECK(remove_cache("in-child"));
        },
        10.0);
    hung += status == -1;
    failed += status > 0;
  }
  stop = true;
  busy.join();
  if (hung > 0) std::fprintf(stderr, "%d children hung on the registry's lock\n", hung);
  CHECK(hung == 0);
  CHECK(failed == 0);
}

}  // namespace

int main() {
  test_every_use_in_a_forked_child_throws();
  test_a_child_lets_go_of_a_cache_a_parent_thread_waits_in();
  test_the_registry_is_usable_in_a_child_forked_while_it_is_busy();
  if (g_failures > 0) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("test_echo_fork: all passed\n");
  return 0;
}
