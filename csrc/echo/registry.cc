// The process-wide registry of named echo caches, which the pybind11 module and the DALI plugin
// share (both link libechopipe_core.so).
#include <algorithm>
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
}  // namespace

std::shared_ptr<EchoCache> create_cache(const std::string& name, const EchoConfig& config) {
  config.validate();
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  if (!name.empty() && r.by_name.count(name)) {
    throw std::invalid_argument("an echo cache named '" + name + "' already exists");
  }
  // An unnamed cache gets the first free "echo-<n>". A caller may have taken such a name
  // explicitly: emplace would then keep the caller's cache, leave this one unregistered, and this
  // one's close() would unregister the caller's (its DALI operators would no longer find it).
  std::string chosen = name;
  while (chosen.empty() || r.by_name.count(chosen)) {
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

std::vector<std::string> cache_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::string> names;
  for (auto& [n, c] : r.by_name) names.push_back(n);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace echopipe
