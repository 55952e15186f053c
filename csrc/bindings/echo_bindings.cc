// pybind11 bindings of the echo cache (the private side of python/echopipe/echo/). They stay
// thin: raw field pointers in, zero-copy numpy views out, GIL released around every call that can
// block or copy. The core's typed errors become the exception classes of echopipe.echo.values
// (SampleTooLargeError, CacheStateError: both ValueErrors), any other std::invalid_argument a
// ValueError (pybind11's default), so messages that name the bad value reach the user unchanged
// and callers tell the cases apart by type.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/gil.h"
#include "cuda/gather.h"
#include "echo/echo_cache.h"
#include "echo/echo_cache_impl.h"

namespace py = pybind11;
using namespace echopipe;
using echopipe::bindings::without_gil;

namespace {

// Numpy has no bfloat16: such fields are exposed as uint16 and re-typed on the Python side.
const char* numpy_name(DType d) { return d == DType::kBFloat16 ? "uint16" : dtype_name(d); }

// One emitted sample copy, owned by Python. Numpy views of its fields use this object as their
// base, so the slot stays leased while any view is alive.
struct PyLease {
  SampleLease lease;
};

py::array field_view(py::object owner, int field) {
  const PyLease& pl = owner.cast<const PyLease&>();
  const SampleLease& l = pl.lease;
  if (!l.valid()) throw std::invalid_argument("the sample lease was already released");
  if (field < 0 || field >= l.desc().num_fields) {
    throw std::invalid_argument("field index " + std::to_string(field) + " out of range for a " +
                                std::to_string(l.desc().num_fields) + "-field sample");
  }
  if (l.cache()->memory_kind() == MemoryKind::kDevice) {
    // A view would read GPU memory on the host; take_batch copies out instead.
    throw std::invalid_argument("echo cache '" + l.cache()->name() +
                                "' keeps its samples in GPU memory (memory='device'): no host "
                                "view; use take_batch (copies to the host) or the DALI GPU source");
  }
  const FieldDesc& fd = l.desc().fields[field];
  std::vector<py::ssize_t> shape(fd.shape, fd.shape + fd.ndim);
  std::vector<py::ssize_t> strides(fd.ndim);
  py::ssize_t stride = static_cast<py::ssize_t>(dtype_size(fd.dtype));
  for (int i = fd.ndim - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= fd.shape[i];
  }
  py::array arr(py::dtype(numpy_name(fd.dtype)), std::move(shape), std::move(strides),
                l.data(field), owner);
  // Copies of a sample share its memory: a write through one view would corrupt the others.
  py::detail::array_proxy(arr.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return arr;
}

SampleDesc make_desc(const std::vector<std::string>& dtypes,
                     const std::vector<std::vector<int64_t>>& shapes) {
  if (dtypes.size() != shapes.size()) {
    throw std::invalid_argument("got " + std::to_string(dtypes.size()) + " dtypes but " +
                                std::to_string(shapes.size()) + " shapes");
  }
  if (dtypes.empty() || dtypes.size() > static_cast<size_t>(kMaxFields)) {
    throw std::invalid_argument("a sample needs 1.." + std::to_string(kMaxFields) +
                                " fields, got " + std::to_string(dtypes.size()));
  }
  SampleDesc d;
  d.num_fields = static_cast<int>(dtypes.size());
  for (size_t f = 0; f < dtypes.size(); ++f) {
    d.fields[f].dtype = dtype_from_name(dtypes[f]);
    if (shapes[f].size() > static_cast<size_t>(kMaxDims)) {
      throw std::invalid_argument("field " + std::to_string(f) + " has " +
                                  std::to_string(shapes[f].size()) + " dimensions; at most " +
                                  std::to_string(kMaxDims) + " are supported");
    }
    d.fields[f].ndim = static_cast<int>(shapes[f].size());
    for (size_t i = 0; i < shapes[f].size(); ++i) d.fields[f].shape[i] = shapes[f][i];
  }
  d.validate();
  return d;
}

py::dict stats_dict(const EchoStats& s) {
  py::dict d;
  d["fresh_in"] = s.fresh_in;
  d["emitted"] = s.emitted;
  d["resident"] = s.resident;
  d["resident_with_tickets"] = s.resident_with_tickets;
  d["tickets_left"] = s.tickets_left;
  d["retired"] = s.retired;
  d["bytes_used"] = s.bytes_used;
  d["capacity_bytes"] = s.capacity_bytes;
  d["capacity_samples"] = s.capacity_samples;
  d["probe_slots"] = s.probe_slots;
  d["emit_histogram"] = s.emit_histogram;
  d["mean_reuse_distance"] = s.mean_reuse_distance;
  d["reuse_pairs"] = s.reuse_pairs;
  d["memory_kind"] = memory_kind_name(s.memory_kind);
  d["puts_blocked"] = s.puts_blocked;
  d["producers_waiting"] = s.producers_waiting;
  d["put_blocked_seconds"] = s.put_blocked_seconds;
  d["takes_waited"] = s.takes_waited;
  d["take_wait_seconds"] = s.take_wait_seconds;
  d["closed"] = s.closed;
  d["input_ended"] = s.input_ended;
  return d;
}

std::vector<SampleLease> take_leases(EchoCache& c, int64_t n, double timeout, TakeStatus* st) {
  if (n < 1) throw std::invalid_argument("take(n) needs n >= 1, got n=" + std::to_string(n));
  std::vector<SampleLease> out;
  *st = without_gil([&] { return c.take(static_cast<size_t>(n), out, timeout); });
  return out;
}

// One field of a gathered batch: (N, *shape) when all shapes agree, else a flat array plus
// int64 element offsets (N + 1).
struct GatheredField {
  py::array data;
  py::object offsets = py::none();
  int64_t* offsets_ptr = nullptr;
  bool uniform = true;
};

GatheredField plan_field(const std::vector<SampleLease>& leases, int f) {
  const FieldDesc& f0 = leases[0].desc().fields[f];
  GatheredField g;
  size_t total = 0;
  for (const auto& l : leases) {
    const FieldDesc& fd = l.desc().fields[f];
    if (fd.dtype != f0.dtype) {
      throw std::invalid_argument(std::string("take_batch: field ") + std::to_string(f) +
                                  " mixes dtypes " + dtype_name(f0.dtype) + " and " +
                                  dtype_name(fd.dtype));
    }
    if (fd.ndim != f0.ndim || !std::equal(fd.shape, fd.shape + fd.ndim, f0.shape)) {
      g.uniform = false;
    }
    total += fd.nbytes();
  }
  const py::dtype dt(numpy_name(f0.dtype));
  if (g.uniform) {
    std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(leases.size())};
    shape.insert(shape.end(), f0.shape, f0.shape + f0.ndim);
    g.data = py::array(dt, shape);
  } else {
    const size_t esize = dtype_size(f0.dtype);
    g.data = py::array(dt, std::vector<py::ssize_t>{static_cast<py::ssize_t>(total / esize)});
    py::array_t<int64_t> offsets(static_cast<py::ssize_t>(leases.size() + 1));
    g.offsets_ptr = offsets.mutable_data();
    g.offsets = std::move(offsets);
  }
  return g;
}

py::tuple shape_tuple(const FieldDesc& fd) {
  py::tuple t(fd.ndim);
  for (int i = 0; i < fd.ndim; ++i) t[i] = py::int_(fd.shape[i]);
  return t;
}

// The per-sample shapes list: one shared tuple repeated when every field is uniform (no Python
// object per sample), else one tuple per sample.
py::list batch_shapes(const std::vector<SampleLease>& leases, int nf, bool uniform) {
  if (uniform) {
    py::tuple per(nf);
    for (int f = 0; f < nf; ++f) per[f] = shape_tuple(leases[0].desc().fields[f]);
    py::list one;
    one.append(per);
    return py::reinterpret_steal<py::list>(
        PySequence_Repeat(one.ptr(), static_cast<Py_ssize_t>(leases.size())));
  }
  py::list shapes;
  for (const auto& l : leases) {
    py::tuple per(nf);
    for (int f = 0; f < nf; ++f) per[f] = shape_tuple(l.desc().fields[f]);
    shapes.append(per);
  }
  return shapes;
}

py::tuple gather_batch(std::vector<SampleLease>& leases, TakeStatus st);

// Strong guarantee: whatever fails after the draw (a batch mixing dtypes or field counts, no
// memory for the arrays) hands the copies back to the cache before the exception leaves, so
// they are drawn again later instead of being lost.
py::tuple take_batch(EchoCache& c, int64_t n, double timeout) {
  TakeStatus st;
  std::vector<SampleLease> leases = take_leases(c, n, timeout, &st);
  try {
    py::tuple result = gather_batch(leases, st);
    release_leases(leases);
    return result;
  } catch (...) {
    c.give_back(leases);
    throw;
  }
}

// Takes up to n copies straight into the caller's buffers: field f of the i-th copy lands at
// dst[f] + i * row_bytes[f] (one copy out of the arena, no array made here). Everything that can
// be checked before the draw is (field count, n against the rows free); a copy whose fields do
// not have exactly row_bytes[f] bytes is only seen after it, so the copies drawn are then handed
// back (the same strong guarantee as take_batch). Returns (status, copies written).
py::tuple take_batch_into(EchoCache& c, const std::vector<uintptr_t>& dst,
                          const std::vector<int64_t>& row_bytes, int64_t rows_free, int64_t n,
                          double timeout) {
  if (dst.empty() || dst.size() > static_cast<size_t>(kMaxFields) ||
      dst.size() != row_bytes.size()) {
    throw std::invalid_argument("take_batch_into: needs 1.." + std::to_string(kMaxFields) +
                                " output buffers, one row size each; got " +
                                std::to_string(dst.size()) + " buffers and " +
                                std::to_string(row_bytes.size()) + " row sizes");
  }
  if (n < 1 || n > rows_free) {
    throw std::invalid_argument(
        "take_batch_into: n=" + std::to_string(n) +
        " must be in [1, rows free in the buffers=" + std::to_string(rows_free) + "]");
  }
  const int nf = static_cast<int>(dst.size());
  // One GIL-free section from the draw to the release (each release of the GIL is a hand-over
  // when the reader thread waits for it). The release wakes a producer blocked on space. A
  // copy that does not fit its row throws after the draw: the handler hands the drawn copies
  // back (a gather that throws leaves them to it too), and the exception leaves with the GIL.
  std::vector<SampleLease> leases;
  size_t count = 0;
  const TakeStatus st = without_gil([&] {
    const TakeStatus got = c.take(static_cast<size_t>(n), leases, timeout);
    try {
      for (const auto& l : leases) {
        const SampleDesc& d = l.desc();
        if (d.num_fields != nf) {
          throw std::invalid_argument("take_batch_into: a sample has " +
                                      std::to_string(d.num_fields) + " fields, the output " +
                                      std::to_string(nf) + " buffers");
        }
        for (int f = 0; f < nf; ++f) {
          if (static_cast<int64_t>(d.fields[f].nbytes()) != row_bytes[f]) {
            throw std::invalid_argument("take_batch_into: field " + std::to_string(f) +
                                        " of a sample has " + std::to_string(d.fields[f].nbytes()) +
                                        " bytes, a row of output buffer " + std::to_string(f) +
                                        " " + std::to_string(row_bytes[f]));
          }
        }
      }
      for (int f = 0; f < nf; ++f) gather(leases, f, reinterpret_cast<void*>(dst[f]), nullptr);
    } catch (...) {
      c.give_back(leases);
      throw;
    }
    count = leases.size();
    release_leases(leases);
    return got;
  });
  return py::make_tuple(std::string(take_status_name(st)), count);
}

// Gathers the batch into new arrays; the leases stay valid (the caller releases or gives back).
py::tuple gather_batch(std::vector<SampleLease>& leases, TakeStatus st) {
  const auto count = static_cast<py::ssize_t>(leases.size());
  py::array_t<uint64_t> ids(count);
  py::array_t<uint32_t> emissions(count);
  py::list fields, dtypes, shapes;
  if (leases.empty()) {
    return py::make_tuple(std::string(take_status_name(st)), fields, dtypes, shapes, ids,
                          emissions);
  }
  const int nf = leases[0].desc().num_fields;
  for (const auto& l : leases) {
    if (l.desc().num_fields != nf) {
      throw std::invalid_argument("take_batch: the batch mixes samples with " + std::to_string(nf) +
                                  " and " + std::to_string(l.desc().num_fields) +
                                  " fields (use take() for such caches)");
    }
  }
  std::vector<GatheredField> planned;
  bool all_uniform = true;
  for (int f = 0; f < nf; ++f) {
    planned.push_back(plan_field(leases, f));
    all_uniform = all_uniform && planned.back().uniform;
    dtypes.append(dtype_name(leases[0].desc().fields[f].dtype));
  }
  shapes = batch_shapes(leases, nf, all_uniform);
  std::vector<void*> dst;
  for (auto& g : planned) dst.push_back(g.data.mutable_data());
  uint64_t* id_ptr = ids.mutable_data();
  uint32_t* em_ptr = emissions.mutable_data();
  without_gil([&] {
    for (int f = 0; f < nf; ++f) gather(leases, f, dst[f], planned[f].offsets_ptr);
    for (size_t i = 0; i < leases.size(); ++i) {
      id_ptr[i] = leases[i].sample_id();
      em_ptr[i] = leases[i].emission();
    }
  });
  for (int f = 0; f < nf; ++f) {
    GatheredField& g = planned[f];
    if (g.offsets_ptr != nullptr) {  // byte offsets -> element offsets
      const auto esize = static_cast<int64_t>(g.data.itemsize());
      for (py::ssize_t i = 0; i <= count; ++i) g.offsets_ptr[i] /= esize;
    }
    fields.append(py::make_tuple(g.data, g.offsets));
  }
  return py::make_tuple(std::string(take_status_name(st)), fields, dtypes, shapes, ids, emissions);
}

}  // namespace

namespace {

// Raises echopipe.echo.values.<name>(message, *extra). The classes are Python's (one hierarchy
// with the errors raised from statuses, documented there); they are looked up when raised, by
// which time echopipe.echo is imported. Without it (a bare `import echopipe._C`) the base
// class's builtin stands in.
void raise_echo_error(const char* name, PyObject* fallback, const char* message,
                      py::tuple extra = py::tuple()) {
  try {
    py::object cls = py::module_::import("echopipe.echo.values").attr(name);
    py::object exc = cls(message, *extra);
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (py::error_already_set&) {
    PyErr_SetString(fallback, message);
  }
}

void register_errors() {
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const SampleTooLargeError& e) {
      raise_echo_error("SampleTooLargeError", PyExc_ValueError, e.what(),
                       py::make_tuple(e.sample_bytes(), e.capacity_bytes()));
    } catch (const CacheStateError& e) {
      raise_echo_error("CacheStateError", PyExc_ValueError, e.what());
    } catch (const CacheForkedError& e) {
      raise_echo_error("CacheForkedError", PyExc_RuntimeError, e.what(),
                       py::make_tuple(e.creator_pid(), e.pid()));
    } catch (const ArenaAllocationError& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    }
  });
}

}  // namespace

void bind_echo(py::module_& m) {
  register_errors();
  // The core's limits, read by echopipe.echo.config so that Python checks each bound once,
  // before any cache is made, with the value the core itself enforces.
  m.attr("MAX_ECHO_FACTOR") = static_cast<double>(kMaxEchoFactor);
  m.attr("MIN_CAPACITY_BYTES") = kMinCapacityBytes;
  m.attr("MAX_CAPACITY_SAMPLES") = kMaxCapacitySamples;
  m.attr("MAX_EPOCH_SIZE") = kMaxEpochSize;
  m.attr("MAX_FIELDS") = kMaxFields;
  m.def("built_with_cuda", &built_with_cuda, "True when the CUDA kernels were compiled in.");
  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible now (0 without CUDA/driver); first call touches the runtime.");
  m.def("cuda_available", &cuda_available);
  m.def("cache_names", &cache_names, "Names of registered echo caches.");
  m.def("remove_cache", py::overload_cast<const std::string&>(&remove_cache), py::arg("name"));
  m.def("remove_cache", py::overload_cast<const std::string&, uint64_t>(&remove_cache),
        py::arg("name"), py::arg("handle"),
        "Unregisters `name` only if it is the cache with `handle`.");
  m.def("fork_generation", &fork_generation,
        "Forks this process descends from since the core was loaded (0 in the first process).");
  m.def(
      "find_cache",
      [](const std::string& name) -> py::object {
        auto c = find_cache(name);
        if (!c) return py::none();
        return py::cast(c);
      },
      py::arg("name"), "The registered native cache called `name`, or None.");
  m.def("find_cache_handle", [](const std::string& name) -> py::object {
    auto c = find_cache(name);
    if (!c) return py::none();
    return py::int_(c->handle());
  });
  m.def("dtype_names", [] {
    std::vector<std::string> v;
    for (int i = 0; i <= static_cast<int>(DType::kBool); ++i) {
      v.emplace_back(dtype_name(static_cast<DType>(i)));
    }
    return v;
  });
  m.def("normalize_dtype", [](const std::string& n) { return dtype_name(dtype_from_name(n)); });

  py::class_<PyLease, std::shared_ptr<PyLease>>(m, "Lease")
      .def_property_readonly("sample_id", [](const PyLease& p) { return p.lease.sample_id(); })
      .def_property_readonly("emission", [](const PyLease& p) { return p.lease.emission(); })
      .def_property_readonly("tickets", [](const PyLease& p) { return p.lease.tickets(); })
      .def_property_readonly("index_in_unit",
                             [](const PyLease& p) { return p.lease.index_in_unit(); })
      .def_property_readonly("num_fields",
                             [](const PyLease& p) { return p.lease.desc().num_fields; })
      .def("dtype",
           [](const PyLease& p, int f) {
             if (f < 0 || f >= p.lease.desc().num_fields) {
               throw std::invalid_argument("field index " + std::to_string(f) + " out of range");
             }
             return std::string(dtype_name(p.lease.desc().fields[f].dtype));
           })
      .def("shape",
           [](const PyLease& p, int f) {
             if (f < 0 || f >= p.lease.desc().num_fields) {
               throw std::invalid_argument("field index " + std::to_string(f) + " out of range");
             }
             const FieldDesc& fd = p.lease.desc().fields[f];
             return std::vector<int64_t>(fd.shape, fd.shape + fd.ndim);
           })
      .def("array", &field_view, py::arg("field"),
           "Read-only zero-copy numpy view of a field; keeps this lease alive.")
      .def("data_ptr",
           [](const PyLease& p, int f) { return reinterpret_cast<uintptr_t>(p.lease.data(f)); })
      .def("device_ptr", [](const PyLease& p, int f) {
        return reinterpret_cast<uintptr_t>(p.lease.device_data(f));
      });

  py::class_<EchoCache, std::shared_ptr<EchoCache>>(m, "EchoCache")
      .def(py::init([](size_t capacity_bytes, size_t capacity_samples, double echo_factor,
                       size_t min_fill, uint64_t seed, const std::string& mode, size_t batch_size,
                       const std::string& memory, const std::string& name, size_t num_shards,
                       size_t epoch_size) {
             EchoConfig cfg;
             cfg.capacity_bytes = capacity_bytes;
             cfg.capacity_samples = capacity_samples;
             cfg.echo_factor = echo_factor;
             cfg.min_fill = min_fill;
             cfg.seed = seed;
             cfg.mode = echo_mode_from_name(mode);
             cfg.batch_size = batch_size;
             cfg.memory = memory_kind_from_name(memory);
             cfg.num_shards = num_shards;
             cfg.epoch_size = epoch_size;
             return create_cache(name, cfg);  // registered, so the DALI plugin can find it
           }),
           py::arg("capacity_bytes"), py::arg("capacity_samples"), py::arg("echo_factor"),
           py::arg("min_fill"), py::arg("seed"), py::arg("mode"), py::arg("batch_size"),
           py::arg("memory"), py::arg("name"), py::arg("num_shards") = 0, py::arg("epoch_size") = 0)
      .def_property_readonly("name", &EchoCache::name)
      .def_property_readonly("handle", &EchoCache::handle)
      .def_property_readonly("memory_kind",
                             [](const EchoCache& c) { return memory_kind_name(c.memory_kind()); })
      .def_property_readonly(
          "arena_device_ptr",
          [](const EchoCache& c) { return reinterpret_cast<uintptr_t>(c.arena_device()); })
      .def_property_readonly("closed", &EchoCache::closed)
      .def_property_readonly("forked", &EchoCache::forked,
                             "True in a process forked from the one that created the cache.")
      .def("check_process", &EchoCache::check_process,
           "Raises CacheForkedError in a process forked from the one that created the cache.")
      .def_property_readonly(
          "refused_sample",
          [](const EchoCache& c) -> py::object {
            const uint64_t need = c.refused_sample_bytes();
            if (need == 0) return py::none();
            const SampleTooLargeError e(need, c.config().capacity_bytes);
            return py::module_::import("echopipe.echo.values")
                .attr("SampleTooLargeError")(e.what(), e.sample_bytes(), e.capacity_bytes());
          },
          "The typed error (SampleTooLargeError) of the largest sample refused as larger than "
          "the arena, or None.")
      .def_property("echo_factor", &EchoCache::echo_factor, &EchoCache::set_echo_factor,
                    "Current echo factor; setting it applies to units published afterwards.")
      .def(
          "top_up", [](EchoCache& c) { return without_gil([&] { return c.top_up(); }); },
          "Raises the tickets of the units in the cache to what the current factor gives; "
          "returns the tickets added.")
      .def(
          "put_raw",
          [](EchoCache& c, const std::vector<uintptr_t>& ptrs,
             const std::vector<std::string>& dtypes,
             const std::vector<std::vector<int64_t>>& shapes, double timeout) {
            SampleDesc d = make_desc(dtypes, shapes);
            if (ptrs.size() != dtypes.size()) {
              throw std::invalid_argument("got " + std::to_string(ptrs.size()) + " pointers for " +
                                          std::to_string(dtypes.size()) + " fields");
            }
            const void* data[kMaxFields];
            for (size_t i = 0; i < ptrs.size(); ++i)
              data[i] = reinterpret_cast<const void*>(ptrs[i]);
            PutStatus st = without_gil([&] { return c.put(d, data, timeout); });
            return std::string(put_status_name(st));
          },
          py::arg("ptrs"), py::arg("dtypes"), py::arg("shapes"), py::arg("timeout"),
          "Copies one sample in from raw host pointers (the caller keeps them alive). Returns "
          "'ok', 'timeout', 'closed' or 'ended'.")
      .def(
          "put_rows_raw",
          [](EchoCache& c, const std::vector<uintptr_t>& ptrs,
             const std::vector<std::string>& dtypes,
             const std::vector<std::vector<int64_t>>& row_shapes, int64_t rows, double timeout) {
            SampleDesc d = make_desc(dtypes, row_shapes);
            if (ptrs.size() != dtypes.size()) {
              throw std::invalid_argument("got " + std::to_string(ptrs.size()) + " pointers for " +
                                          std::to_string(dtypes.size()) + " fields");
            }
            if (rows < 0)
              throw std::invalid_argument("rows must be >= 0, got " + std::to_string(rows));
            size_t done = 0;
            const void* data[kMaxFields];
            for (int f = 0; f < d.num_fields; ++f) data[f] = reinterpret_cast<const void*>(ptrs[f]);
            PutStatus st = without_gil(
                [&] { return c.put_rows(d, data, static_cast<size_t>(rows), timeout, &done); });
            return py::make_tuple(std::string(put_status_name(st)), done);
          },
          py::arg("ptrs"), py::arg("dtypes"), py::arg("row_shapes"), py::arg("rows"),
          py::arg("timeout"),
          "Puts `rows` samples whose fields are consecutive rows of the given arrays (one native "
          "loop, GIL released). Returns (status, rows put); the timeout applies to each row.")
      .def(
          "take",
          [](EchoCache& c, int64_t n, double timeout) {
            TakeStatus st;
            std::vector<SampleLease> leases = take_leases(c, n, timeout, &st);
            // Every Python object first; the leases move in only once nothing can fail, and
            // until then a failure hands them back (strong guarantee, as in take_batch).
            std::vector<std::shared_ptr<PyLease>> held;
            py::list out;
            try {
              held.reserve(leases.size());
              for (size_t i = 0; i < leases.size(); ++i) {
                held.push_back(std::make_shared<PyLease>());
                out.append(py::cast(held.back()));
              }
              py::tuple result = py::make_tuple(std::string(take_status_name(st)), out);
              for (size_t i = 0; i < leases.size(); ++i) held[i]->lease = std::move(leases[i]);
              return result;
            } catch (...) {
              c.give_back(leases);
              throw;
            }
          },
          py::arg("n"), py::arg("timeout"),
          "Returns (status, [Lease]); status is 'ok', 'timeout', 'closed' or 'end'.")
      .def("take_batch", &take_batch, py::arg("n"), py::arg("timeout"),
           "Takes n copies and gathers each field into one new contiguous array (GIL released "
           "for the copies). Returns (status, [(array, offsets|None)], dtypes, per-sample "
           "shapes, sample_ids, emissions).")
      .def("take_batch_into", &take_batch_into, py::arg("dst"), py::arg("row_bytes"),
           py::arg("rows_free"), py::arg("n"), py::arg("timeout"),
           "Takes up to n copies into caller buffers (raw host pointers, row_bytes[f] bytes per "
           "copy and field; GIL released for the copies). Returns (status, copies written).")
      .def(
          "wait_for_room",
          [](EchoCache& c, int64_t n, double timeout) {
            if (n < 0) {
              throw std::invalid_argument("wait_for_room(n) needs n >= 0, got n=" +
                                          std::to_string(n));
            }
            PutStatus st =
                without_gil([&] { return c.wait_for_room(static_cast<size_t>(n), timeout); });
            return std::string(put_status_name(st));
          },
          py::arg("n"), py::arg("timeout"),
          "Blocks until n slots are free; returns 'ok', 'timeout', 'closed' or 'ended'.")
      .def_property("quota", &EchoCache::quota, &EchoCache::set_quota,
                    "Fresh samples a DALI sink may still store (-1: unlimited).")
      .def_property("layouts", &EchoCache::layouts, &EchoCache::set_layouts,
                    "Tensor layout of each field as a DALI sink saw it ('' where none).")
      .def("end_of_input", &EchoCache::end_of_input)
      .def("reset_input", &EchoCache::reset_input)
      .def("close", [](EchoCache& c) { without_gil([&] { c.close(); }); })
      .def("stats", [](const EchoCache& c) { return stats_dict(c.stats()); })
      .def("save_state",
           [](const EchoCache& c) {
             std::vector<uint8_t> blob = without_gil([&] { return c.save_state(); });
             return py::bytes(reinterpret_cast<const char*>(blob.data()), blob.size());
           })
      .def("restore_state", [](EchoCache& c, py::bytes blob) {
        std::string_view v = blob;
        without_gil([&] { c.restore_state(reinterpret_cast<const uint8_t*>(v.data()), v.size()); });
      });

  // CUDA: n byte ranges src[i] -> dst[i] (raw device-accessible addresses) in one call, by the
  // scatter kernel ("gather"), cudaMemcpyBatchAsync ("batch") or one cudaMemcpyAsync each
  // ("each"): the DALI GPU source's three copy paths, exposed for bench/gpu/gather_bw.py.
  m.def(
      "copy_ranges",
      [](const std::string& mode, const std::vector<uintptr_t>& src,
         const std::vector<uintptr_t>& dst, const std::vector<int64_t>& sizes, uintptr_t stream) {
        if (src.size() != dst.size() || src.size() != sizes.size()) {
          throw std::invalid_argument("copy_ranges: src, dst and sizes differ in length");
        }
        std::vector<const void*> s(src.size());
        std::vector<void*> d(dst.size());
        for (size_t i = 0; i < src.size(); ++i) {
          s[i] = reinterpret_cast<const void*>(src[i]);
          d[i] = reinterpret_cast<void*>(dst[i]);
        }
        void (*run)(const void* const*, void* const*, const int64_t*, int64_t, void*) = nullptr;
        if (mode == "gather") {
          run = &echopipe::cuda::gather_scatter;
        } else if (mode == "batch") {
          run = &echopipe::cuda::copy_batch;
        } else if (mode == "each") {
          run = &echopipe::cuda::copy_each;
        } else {
          throw std::invalid_argument(
              "copy_ranges: mode must be 'gather', 'batch' or 'each', got '" + mode + "'");
        }
        without_gil([&] {
          run(s.data(), d.data(), sizes.data(), static_cast<int64_t>(s.size()),
              reinterpret_cast<void*>(stream));
        });
      },
      py::arg("mode"), py::arg("src"), py::arg("dst"), py::arg("sizes"), py::arg("stream"));
  m.def("copy_batch_supported", &echopipe::cuda::copy_batch_supported,
        "True when cudaMemcpyBatchAsync was compiled in (CUDA >= 12.8).");

  // CUDA: gather leased samples from the mapped pinned arena (or a device arena) straight into a
  // device batch.
  m.def(
      "gather_to_device",
      [](const std::vector<std::shared_ptr<PyLease>>& leases, int field, uintptr_t dst,
         uintptr_t stream) {
        std::vector<const void*> src;
        std::vector<int64_t> sizes;
        for (const auto& p : leases) {
          const void* d = p->lease.device_data(field);
          if (d == nullptr) {
            throw std::runtime_error(
                "gather_to_device needs a pinned, GPU-mapped or a device cache (memory_kind is "
                "'pageable')");
          }
          src.push_back(d);
          sizes.push_back(static_cast<int64_t>(p->lease.nbytes(field)));
        }
        without_gil([&] {
          echopipe::cuda::gather_bytes(src.data(), sizes.data(), static_cast<int64_t>(src.size()),
                                       reinterpret_cast<void*>(dst),
                                       reinterpret_cast<void*>(stream));
        });
      },
      py::arg("leases"), py::arg("field"), py::arg("dst_ptr"), py::arg("stream") = 0);
  m.def(
      "gather_normalize_to_device",
      [](const std::vector<std::shared_ptr<PyLease>>& leases, int field,
         const std::vector<float>& mean, const std::vector<float>& std, bool to_chw, uintptr_t dst,
         uintptr_t stream) {
        if (leases.empty()) return;
        for (const auto& p : leases) {
          if (field < 0 || field >= p->lease.desc().num_fields) {
            throw std::invalid_argument("field " + std::to_string(field) +
                                        " is out of range for a sample with " +
                                        std::to_string(p->lease.desc().num_fields) + " fields");
          }
        }
        const FieldDesc& f0 = leases[0]->lease.desc().fields[field];
        if (f0.dtype != DType::kUInt8 || f0.ndim != 3) {
          throw std::invalid_argument("gather_normalize_to_device needs uint8 HWC images, got " +
                                      std::string(dtype_name(f0.dtype)) +
                                      " with ndim=" + std::to_string(f0.ndim));
        }
        if (mean.size() != static_cast<size_t>(f0.shape[2]) || std.size() != mean.size()) {
          throw std::invalid_argument(
              "mean/std need " + std::to_string(f0.shape[2]) + " values (one per channel), got " +
              std::to_string(mean.size()) + "/" + std::to_string(std.size()));
        }
        std::vector<const void*> src;
        for (const auto& p : leases) {
          const FieldDesc& fd = p->lease.desc().fields[field];
          if (fd.dtype != f0.dtype || fd.ndim != 3 ||
              !std::equal(fd.shape, fd.shape + 3, f0.shape)) {
            throw std::invalid_argument("gather_normalize_to_device needs equal image shapes");
          }
          const void* d = p->lease.device_data(field);
          if (d == nullptr) {
            throw std::runtime_error(
                "gather_normalize_to_device needs a pinned, GPU-mapped cache (memory_kind is not "
                "'pinned')");
          }
          src.push_back(d);
        }
        without_gil([&] {
          echopipe::cuda::gather_normalize_u8(src.data(), static_cast<int64_t>(src.size()),
                                              f0.shape[0], f0.shape[1], f0.shape[2], mean.data(),
                                              std.data(), to_chw, reinterpret_cast<float*>(dst),
                                              reinterpret_cast<void*>(stream));
        });
      },
      py::arg("leases"), py::arg("field"), py::arg("mean"), py::arg("std"), py::arg("to_chw"),
      py::arg("dst_ptr"), py::arg("stream") = 0);
}
