// Checks and sample helpers shared by the C++ tests of the echo cache (tests/cpp/test_*.cc).
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "echo/echo_cache.h"

namespace echopipe::testing {

inline int g_failures = 0;

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++::echopipe::testing::g_failures;                                            \
    }                                                                               \
  } while (0)

#define CHECK_THROWS(expr, needle)                                                               \
  do {                                                                                           \
    bool threw_ = false;                                                                         \
    try {                                                                                        \
      expr;                                                                                      \
    } catch (const std::invalid_argument& e_) {                                                  \
      threw_ = std::string(e_.what()).find(needle) != std::string::npos;                         \
      if (!threw_) std::fprintf(stderr, "message without '%s': %s\n", needle, e_.what());        \
    }                                                                                            \
    if (!threw_) {                                                                               \
      std::fprintf(stderr, "%s:%d: expected invalid_argument: %s\n", __FILE__, __LINE__, #expr); \
      ++::echopipe::testing::g_failures;                                                         \
    }                                                                                            \
  } while (0)

// A sample whose single int64 field holds `key` followed by key-derived words.
inline SampleDesc int64_desc(int64_t words) {
  SampleDesc d;
  d.num_fields = 1;
  d.fields[0].dtype = DType::kInt64;
  d.fields[0].ndim = 1;
  d.fields[0].shape[0] = words;
  return d;
}

inline uint64_t word(uint64_t key, int64_t i) {
  return key * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i);
}

inline void fill(std::vector<uint64_t>& buf, uint64_t key) {
  buf[0] = key;
  for (size_t i = 1; i < buf.size(); ++i) buf[i] = word(key, static_cast<int64_t>(i));
}

inline bool payload_ok(const SampleLease& l) {
  const auto* p = static_cast<const uint64_t*>(l.data(0));
  int64_t n = l.desc().fields[0].shape[0];
  for (int64_t i = 1; i < n; ++i) {
    if (p[i] != word(p[0], i)) return false;
  }
  return true;
}

}  // namespace echopipe::testing
