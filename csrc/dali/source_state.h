// The echo source's state in DALI's checkpoints: its padding template (the sample that fills the
// batches a pass owes after its last copy) and whether the next pass takes a new one. Without it a
// restored source padded with the first sample it drew after the restore, so a resumed
// deterministic run's padding-only batches differed from the uninterrupted run's.
//
// Plain C++ (no DALI or CUDA headers), so the codec is tested on its own
// (tests/cpp/test_source_state.cc) and the plugin's C entry point checks a saved state for Python
// before DALI restores it. The bytes come back from files, so decoding trusts nothing: every
// length is bounded by the bytes that remain, and anything malformed throws SourceStateError
// naming what is wrong.
//
// Layout (integers little-endian): kSourceStateMagic, u32 version, u8 stale (0 or 1), u8 number
// of template fields (0 = no template); per field u8 dtype, u8 ndim and ndim i64 extents; then
// each field's bytes (extents x element size), and nothing after them.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "echo/echo_cache.h"

namespace echopipe_dali {

/// Copy of one sample, kept by a source to pad the batches it emits after the end of input.
struct SampleCopy {
  echopipe::SampleDesc desc;
  std::vector<std::vector<uint8_t>> fields;
};

/// What an echo source saves in a DALI checkpoint. The template is shared, not copied: DALI
/// keeps a checkpoint per prefetched iteration, and the template changes once per pass.
struct SourceState {
  std::shared_ptr<const SampleCopy> padding;  ///< null: no template yet
  bool stale = true;                          ///< PaddingAge::stale (dali/echo_ops.h)
};

/// A saved source state that cannot be restored (says why).
class SourceStateError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

inline constexpr std::string_view kSourceStateMagic = "ECHOPIPE-SOURCE-STATE\n";
/// 1: the first format.
inline constexpr uint32_t kSourceStateVersion = 1;

namespace source_state_detail {

inline void put(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

/// Reads integers and byte runs from the front of `data`, refusing to read past its end.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}

  uint64_t get(int bytes, const char* what) {
    need(static_cast<size_t>(bytes), what);
    uint64_t value = 0;
    for (int i = 0; i < bytes; ++i)
      value |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    pos_ += bytes;
    return value;
  }

  std::string_view take(size_t bytes, const char* what) {
    need(bytes, what);
    std::string_view run = data_.substr(pos_, bytes);
    pos_ += bytes;
    return run;
  }

  size_t left() const { return data_.size() - pos_; }

 private:
  void need(size_t bytes, const char* what) const {
    if (bytes > left()) {
      throw SourceStateError("the echo source's saved state is truncated: it ends inside " +
                             std::string(what) + " (" + std::to_string(data_.size()) + " bytes)");
    }
  }

  std::string_view data_;
  size_t pos_ = 0;
};

/// Bytes of `field`, or a SourceStateError when they exceed `limit` (the bytes left to hold
/// them), so crafted extents can neither overflow nor ask for more memory than the state has.
inline size_t field_bytes(const echopipe::FieldDesc& field, int f, size_t limit) {
  size_t bytes = echopipe::dtype_size(field.dtype);
  for (int d = 0; d < field.ndim; ++d)
    if (field.shape[d] == 0) return 0;
  for (int d = 0; d < field.ndim; ++d) {
    const auto extent = static_cast<uint64_t>(field.shape[d]);
    if (extent > limit / bytes) {
      throw SourceStateError("the echo source's saved state is truncated or damaged: field " +
                             std::to_string(f) + " of its template has more bytes than remain");
    }
    bytes *= extent;
  }
  return bytes;
}

}  // namespace source_state_detail

/// `state` as bytes (the layout above).
inline std::string EncodeSourceState(const SourceState& state) {
  using source_state_detail::put;
  std::string out(kSourceStateMagic);
  put(out, kSourceStateVersion, 4);
  put(out, state.stale ? 1 : 0, 1);
  const SampleCopy* pad = state.padding.get();
  const int num_fields = pad != nullptr ? pad->desc.num_fields : 0;
  put(out, static_cast<uint64_t>(num_fields), 1);
  for (int f = 0; f < num_fields; ++f) {
    const auto& field = pad->desc.fields[f];
    put(out, static_cast<uint64_t>(field.dtype), 1);
    put(out, static_cast<uint64_t>(field.ndim), 1);
    for (int d = 0; d < field.ndim; ++d) put(out, static_cast<uint64_t>(field.shape[d]), 8);
  }
  for (int f = 0; f < num_fields; ++f)
    out.append(reinterpret_cast<const char*>(pad->fields[f].data()), pad->fields[f].size());
  return out;
}

/// True when `data` begins as a saved source state (its magic); says nothing of the rest.
inline bool IsSourceState(std::string_view data) {
  return data.substr(0, kSourceStateMagic.size()) == kSourceStateMagic;
}

/// The state in `data`, for a source of `num_fields` fields (0: any). Empty `data` is the state of
/// a checkpoint written before sources saved one (they were stateless to DALI): no template, so the
/// restored source takes the first sample it draws, as those restores did.
inline SourceState DecodeSourceState(std::string_view data, int num_fields) {
  SourceState state;
  if (data.empty()) return state;
  if (!IsSourceState(data)) {
    throw SourceStateError(
        "the echo source's saved state is not one (it lacks the ECHOPIPE-SOURCE-STATE header); "
        "the checkpoint may come from another pipeline");
  }
  source_state_detail::Reader in(data.substr(kSourceStateMagic.size()));
  const uint64_t version = in.get(4, "its version");
  if (version != kSourceStateVersion) {
    throw SourceStateError("the echo source's saved state has format version " +
                           std::to_string(version) + "; this echopipe reads version " +
                           std::to_string(kSourceStateVersion));
  }
  const uint64_t stale = in.get(1, "its flags");
  if (stale > 1) {
    throw SourceStateError("the echo source's saved state is malformed: its stale flag is " +
                           std::to_string(stale) + ", not 0 or 1");
  }
  state.stale = stale == 1;
  const auto fields = static_cast<int>(in.get(1, "its field count"));
  if (fields < 0 || fields > echopipe::kMaxFields ||
      (num_fields > 0 && fields != 0 && fields != num_fields)) {
    throw SourceStateError("the echo source's saved state holds a padding template of " +
                           std::to_string(fields) +
                           " fields, but this source has num_fields=" + std::to_string(num_fields) +
                           "; the checkpoint may come from another pipeline");
  }
  if (fields == 0 && !state.stale) {
    // (a source marks its template current only when it takes one)
    throw SourceStateError(
        "the echo source's saved state is malformed: it marks a padding template as current "
        "but holds none");
  }
  auto copy = std::make_shared<SampleCopy>();
  copy->desc.num_fields = fields;
  for (int f = 0; f < fields; ++f) {
    auto& field = copy->desc.fields[f];
    field.dtype = static_cast<echopipe::DType>(in.get(1, "a template field's element type"));
    field.ndim = static_cast<int>(in.get(1, "a template field's dimensions"));
    if (field.ndim > echopipe::kMaxDims) {
      throw SourceStateError("the echo source's saved state is malformed: template field " +
                             std::to_string(f) + " has " + std::to_string(field.ndim) +
                             " dimensions; a field has at most " +
                             std::to_string(echopipe::kMaxDims));
    }
    for (int d = 0; d < field.ndim; ++d)
      field.shape[d] = static_cast<int64_t>(in.get(8, "a template field's extents"));
  }
  if (fields > 0) {
    try {
      copy->desc.validate();  // element types and extents: the cache's own rules
    } catch (const std::invalid_argument& e) {
      throw SourceStateError(std::string("the echo source's saved padding template is invalid: ") +
                             e.what());
    }
  }
  for (int f = 0; f < fields; ++f) {
    const size_t bytes = source_state_detail::field_bytes(copy->desc.fields[f], f, in.left());
    const std::string_view run = in.take(bytes, "the template's bytes");
    copy->fields.emplace_back(run.begin(), run.end());
  }
  if (in.left() != 0) {
    throw SourceStateError("the echo source's saved state is malformed: " +
                           std::to_string(in.left()) + " more bytes follow its end");
  }
  if (fields > 0) state.padding = std::move(copy);
  return state;
}

}  // namespace echopipe_dali
