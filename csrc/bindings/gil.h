// Releasing the GIL around native calls that may block, safely at interpreter exit.
//
// pybind11's gil_scoped_release re-takes the GIL in a destructor. When the interpreter is
// finalizing, re-taking the GIL from a daemon thread ends that thread with pthread_exit, whose
// forced unwinding through a (noexcept) destructor calls std::terminate: the whole process aborts.
// without_gil() re-takes the GIL in ordinary code instead, and a thread that comes back from the
// native call while the interpreter is finalizing parks for good rather than touching Python
// again: it holds no lock, and the process exits around it.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

namespace echopipe::bindings {

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

[[noreturn]] inline void park_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(24));
}

inline void retake_gil(PyThreadState* state) {
  if (interpreter_finalizing()) park_forever();
  PyEval_RestoreThread(state);
}

/// Runs fn() with the GIL released and returns its result (exceptions propagate with the GIL
/// held again).
template <typename Fn>
auto without_gil(Fn&& fn) -> decltype(fn()) {
  PyThreadState* state = PyEval_SaveThread();
  if constexpr (std::is_void_v<decltype(fn())>) {
    try {
      std::forward<Fn>(fn)();
    } catch (...) {
      retake_gil(state);
      throw;
    }
    retake_gil(state);
  } else {
    std::optional<decltype(fn())> result;
    try {
      result.emplace(std::forward<Fn>(fn)());
    } catch (...) {
      retake_gil(state);
      throw;
    }
    retake_gil(state);
    return std::move(*result);
  }
}

}  // namespace echopipe::bindings
