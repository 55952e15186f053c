// Element types, sample descriptions and configuration validation for the echo cache. Every
// rejection here is a std::invalid_argument whose message names the offending value, because the
// Python bindings turn it into a ValueError shown to the user as is.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "echo/echo_cache.h"

namespace echopipe {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kUInt8, "uint8", 1},     {DType::kInt8, "int8", 1},
    {DType::kUInt16, "uint16", 2},   {DType::kInt16, "int16", 2},
    {DType::kInt32, "int32", 4},     {DType::kInt64, "int64", 8},
    {DType::kFloat16, "float16", 2}, {DType::kBFloat16, "bfloat16", 2},
    {DType::kFloat32, "float32", 4}, {DType::kFloat64, "float64", 8},
    {DType::kBool, "bool", 1},
};

const DTypeInfo& info(DType d) {
  auto i = static_cast<size_t>(d);
  if (i >= sizeof(kDTypes) / sizeof(kDTypes[0])) {
    throw std::invalid_argument("unsupported dtype code " + std::to_string(i));
  }
  return kDTypes[i];
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace

SampleTooLargeError::SampleTooLargeError(uint64_t sample_bytes, uint64_t capacity_bytes)
    : std::invalid_argument("sample of " + std::to_string(sample_bytes) +
                            " bytes (64-byte aligned fields) is larger than the cache arena of "
                            "capacity_bytes=" +
                            std::to_string(capacity_bytes)),
      sample_bytes_(sample_bytes),
      capacity_bytes_(capacity_bytes) {}

size_t dtype_size(DType dtype) { return info(dtype).size; }
const char* dtype_name(DType dtype) { return info(dtype).name; }

DType dtype_from_name(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (name == d.name) return d.dtype;
  }
  struct Alias {
    const char* alias;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"u1", DType::kUInt8},       {"i1", DType::kInt8},       {"u2", DType::kUInt16},
      {"i2", DType::kInt16},       {"i4", DType::kInt32},      {"i8", DType::kInt64},
      {"f2", DType::kFloat16},     {"f4", DType::kFloat32},    {"f8", DType::kFloat64},
      {"b1", DType::kBool},        {"half", DType::kFloat16},  {"float", DType::kFloat32},
      {"double", DType::kFloat64}, {"bf16", DType::kBFloat16},
  };
  for (const auto& a : kAliases) {
    if (name == a.alias) return a.dtype;
  }
  throw std::invalid_argument("unsupported dtype '" + std::string(name) +
                              "' (supported: uint8, int8, uint16, int16, int32, int64, float16, "
                              "bfloat16, float32, float64, bool)");
}

int64_t FieldDesc::numel() const {
  // An empty field may have huge other dimensions: their product is never formed.
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] == 0) return 0;
  }
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

size_t FieldDesc::nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }

void SampleDesc::validate() const {
  if (num_fields < 1 || num_fields > kMaxFields) {
    throw std::invalid_argument("a sample needs 1.." + std::to_string(kMaxFields) +
                                " fields, got num_fields=" + std::to_string(num_fields));
  }
  for (int f = 0; f < num_fields; ++f) {
    const FieldDesc& fd = fields[f];
    (void)dtype_size(fd.dtype);
    if (fd.ndim < 0 || fd.ndim > kMaxDims) {
      throw std::invalid_argument("field " + std::to_string(f) +
                                  ": ndim=" + std::to_string(fd.ndim) + " is outside 0.." +
                                  std::to_string(kMaxDims));
    }
    for (int d = 0; d < fd.ndim; ++d) {
      if (fd.shape[d] < 0) {
        throw std::invalid_argument("field " + std::to_string(f) + ": negative dimension " +
                                    std::to_string(fd.shape[d]));
      }
    }
    // numel() and nbytes() multiply the dimensions: a product that wrapped around (a corrupt
    // saved state, raw shapes) would describe more elements than the bytes stored, which a view
    // or a gather would then read past.
    const bool empty = std::find(fd.shape, fd.shape + fd.ndim, int64_t{0}) != fd.shape + fd.ndim;
    uint64_t bytes = dtype_size(fd.dtype);
    for (int d = 0; d < fd.ndim && !empty; ++d) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(fd.shape[d]), &bytes) ||
          bytes > kMaxFieldBytes) {
        std::string shape;
        for (int i = 0; i < fd.ndim; ++i) shape += (i ? ", " : "") + std::to_string(fd.shape[i]);
        throw std::invalid_argument("field " + std::to_string(f) + ": shape (" + shape + ") of " +
                                    dtype_name(fd.dtype) + " holds more than " +
                                    std::to_string(kMaxFieldBytes) + " bytes");
      }
    }
  }
}

size_t SampleDesc::extent_bytes() const {
  size_t total = 0;
  for (int f = 0; f < num_fields; ++f) total += round_up(fields[f].nbytes(), kFieldAlignment);
  return total == 0 ? kFieldAlignment : total;
}

size_t SampleDesc::field_offset(int i) const {
  size_t off = 0;
  for (int f = 0; f < i; ++f) off += round_up(fields[f].nbytes(), kFieldAlignment);
  return off;
}

const char* echo_mode_name(EchoMode mode) { return mode == EchoMode::kBatch ? "batch" : "example"; }

EchoMode echo_mode_from_name(std::string_view name) {
  if (name == "example") return EchoMode::kExample;
  if (name == "batch") return EchoMode::kBatch;
  throw std::invalid_argument("mode must be 'example' or 'batch', got '" + std::string(name) + "'");
}

const char* memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kAuto:
      return "auto";
    case MemoryKind::kPageable:
      return "pageable";
    case MemoryKind::kPinned:
      return "pinned";
    case MemoryKind::kDevice:
      return "device";
  }
  return "unknown";
}

MemoryKind memory_kind_from_name(std::string_view name) {
  if (name == "auto") return MemoryKind::kAuto;
  if (name == "pageable") return MemoryKind::kPageable;
  if (name == "pinned") return MemoryKind::kPinned;
  if (name == "device") return MemoryKind::kDevice;
  throw std::invalid_argument("memory must be 'auto', 'pageable', 'pinned' or 'device', got '" +
                              std::string(name) + "'");
}

const char* put_status_name(PutStatus s) {
  switch (s) {
    case PutStatus::kOk:
      return "ok";
    case PutStatus::kTimeout:
      return "timeout";
    case PutStatus::kClosed:
      return "closed";
    case PutStatus::kEnded:
      return "ended";
  }
  return "unknown";
}

const char* take_status_name(TakeStatus s) {
  switch (s) {
    case TakeStatus::kOk:
      return "ok";
    case TakeStatus::kTimeout:
      return "timeout";
    case TakeStatus::kClosed:
      return "closed";
    case TakeStatus::kEnd:
      return "end";
  }
  return "unknown";
}

void EchoConfig::validate() const {
  if (!echo_factor_in_bounds(echo_factor)) {
    throw std::invalid_argument("echo_factor must be a finite number in [1, " +
                                std::to_string(kMaxEchoFactor) + "], got " +
                                std::to_string(echo_factor));
  }
  if (capacity_bytes < kMinCapacityBytes) {
    throw std::invalid_argument("capacity_bytes must be >= " + std::to_string(kMinCapacityBytes) +
                                ", got " + std::to_string(capacity_bytes));
  }
  if (capacity_samples < 1 || capacity_samples > kMaxCapacitySamples) {
    throw std::invalid_argument("capacity_samples must be in [1, " +
                                std::to_string(kMaxCapacitySamples) + "], got " +
                                std::to_string(capacity_samples));
  }
  if (min_fill > capacity_samples) {
    throw std::invalid_argument("min_fill=" + std::to_string(min_fill) +
                                " exceeds capacity_samples=" + std::to_string(capacity_samples));
  }
  if (mode != EchoMode::kExample && mode != EchoMode::kBatch) {
    throw std::invalid_argument("unknown mode code " + std::to_string(static_cast<int>(mode)));
  }
  if (mode == EchoMode::kBatch) {
    if (batch_size < 1) {
      throw std::invalid_argument("batch mode needs batch_size >= 1, got " +
                                  std::to_string(batch_size));
    }
    if (batch_size > capacity_samples) {
      throw std::invalid_argument("batch_size=" + std::to_string(batch_size) +
                                  " exceeds capacity_samples=" + std::to_string(capacity_samples));
    }
  }
  if (memory != MemoryKind::kAuto && memory != MemoryKind::kPageable &&
      memory != MemoryKind::kPinned && memory != MemoryKind::kDevice) {
    throw std::invalid_argument("unknown memory kind code " +
                                std::to_string(static_cast<int>(memory)));
  }
  if (epoch_size > kMaxEpochSize) {
    throw std::invalid_argument("epoch_size must be <= " + std::to_string(kMaxEpochSize) +
                                ", got " + std::to_string(epoch_size));
  }
  if (num_shards > 1024) {
    throw std::invalid_argument("num_shards must be <= 1024, got " + std::to_string(num_shards));
  }
}

}  // namespace echopipe
