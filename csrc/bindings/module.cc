// Entry point of the private extension module echopipe._C (the benchmark drivers are a module of
// their own, _bench_native from bench_bindings.cc, built only with ECHOPIPE_BUILD_BENCH=ON and
// never installed). Each binding file contributes one bind_* function; everything native lives in
// libechopipe_core.so, which this module links, so the DALI plugin and Python share one registry
// of echo caches.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_echo(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "echopipe native core (echo cache, CUDA gather kernels)";
  m.attr("__version__") = ECHOPIPE_VERSION;
  bind_echo(m);
}
