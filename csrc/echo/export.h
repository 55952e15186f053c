// Symbol visibility for libechopipe_core.so. The build hides every symbol by default so that the
// core, the pybind11 module and the DALI plugin share only what is marked ECHOPIPE_API here; that
// keeps one copy of the cache registry in the process (see docs/echo_cache.md).
#pragma once

#if defined(_WIN32)
#define ECHOPIPE_API
#else
#define ECHOPIPE_API __attribute__((visibility("default")))
#endif
