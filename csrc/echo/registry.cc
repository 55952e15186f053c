// The process-wide registry of named echo caches, which the pybind11 module and the DALI plugin
// share (both link libechopipe_core.so), and what a fork() does to it and to the caches.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "echo/echo_cache.h"

namespace echopipe {

namespace {
struct Registry {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<EchoCache>> by_name;
  uint64_t next_unnamed = 1;
};
Registry& registry() {
  // Leaked on purpose: caches may be looked up from atexit handlers and plugin destructors.
  static Registry* r = new Registry();
  return *r;
}

std::atomic<uint64_t> g_fork_generation{0};

// The registry's lock is held across fork(), so that no other thread of the parent holds it in
// the child, where that thread does not exist and the lock would never be released.
void before_fork() { registry().mu.lock(); }
void after_fork_in_parent() { registry().mu.unlock(); }
void after_fork_in_child() {
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);
  registry().mu.unlock();
}
[[maybe_unused]] const int g_fork_handlers =
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);

// Whether `name` is held by a cache of this process; an inherited (forked) cache holding it is
// dropped from the registry, which gives the name up. Caller holds r.mu.
bool name_taken_locked(Registry& r, const std::string& name) {
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) return false;
  if (!it->second->forked()) return true;
  r.by_name.erase(it);  // never destroyed here: its deleter leaves a fork's copy alone
  return false;
}
}  // namespace

uint64_t fork_generation() noexcept { return g_fork_generation.load(std::memory_order_relaxed); }

CacheForkedError::CacheForkedError(const std::string& name, int64_t creator_pid, int64_t pid)
    : std::runtime_error(
          "echo cache '" + name + "' was created in process " + std::to_string(creator_pid) +
          ", and process " + std::to_string(pid) +
          " is a fork of it (a DataLoader worker, an os.fork() child): the fork's copy is private "
          "to it, so every forked process would hand out the same samples again; create the cache "
          "in the process that uses it, after the fork, or keep it (and an EchoLoader) in the "
          "main process, around the DataLoader"),
      creator_pid_(creator_pid),
      pid_(pid) {}

bool EchoCache::forked() const noexcept { return fork_generation() != fork_generation_; }

void EchoCache::check_process() const {
  if (forked()) throw CacheForkedError(name_, creator_pid_, static_cast<int64_t>(getpid()));
}

std::shared_ptr<EchoCache> create_cache(const std::string& name, const EchoConfig& config) {
  config.validate();
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  if (!name.empty() && name_taken_locked(r, name)) {
    throw std::invalid_argument("an echo cache named '" + name + "' already exists");
  }
  // An unnamed cache gets the first free "echo-<n>". A caller may have taken such a name
  // explicitly: emplace would then keep the caller's cache, leave this one unregistered, and this
  // one's close() would unregister the caller's (its DALI operators would no longer find it).
  std::string chosen = name;
  while (chosen.empty() || name_taken_locked(r, chosen)) {
    chosen = "echo-" + std::to_string(r.next_unnamed++);
  }
  auto cache = EchoCache::create(config, chosen);
  r.by_name.emplace(cache->name(), cache);
  return cache;
}

std::shared_ptr<EchoCache> find_cache(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  auto it = r.by_name.find(name);
  return it == r.by_name.end() ? nullptr : it->second;
}

std::shared_ptr<EchoCache> find_cache(uint64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (auto& [n, c] : r.by_name) {
    if (c->handle() == handle) return c;
  }
  return nullptr;
}

bool remove_cache(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  return r.by_name.erase(name) > 0;
}

bool remove_cache(const std::string& name, uint64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end() || it->second->handle() != handle) return false;
  r.by_name.erase(it);
  return true;
}

std::vector<std::string> cache_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::string> names;
  for (auto& [n, c] : r.by_name) names.push_back(n);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace echopipe
