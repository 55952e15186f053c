// CPU backends of the echopipe DALI operators, their schemas, and the plugin's identity entry
// points (built DALI version, GPU backend).
//
// EchopipeEchoSink ends the upstream pipeline (reader + decode [+ augment]): it copies every
// sample of its 1..4 inputs (image, label, metadata...) into a named echo cache that Python
// created, blocking while the cache is full. EchopipeEchoSource starts the downstream pipeline: it
// has no inputs, so DALI gives it the pipeline's batch size, and it draws that many samples from
// the same cache, each fresh sample floor(e) or ceil(e) times. The pair lets the downstream part
// run e times as many iterations as the upstream part without breaking DALI's fixed-batch-size
// rule. The cache state is saved by echopipe in Python; to DALI's own checkpointing the sink is
// stateless and the source saves its padding template (dali/source_state.h).
#include "dali/echo_ops.h"

#include <any>
#include <cstring>
#include <functional>
#include <utility>

#include "dali/pipeline/operator/checkpointing/stateless_operator.h"
#include "dali/source_draw.h"

#ifndef ECHOPIPE_DALI_BUILT_VERSION
#error "ECHOPIPE_DALI_BUILT_VERSION must name the DALI version the plugin is compiled against"
#endif

#define ECHOPIPE_DALI_EXPORT extern "C" __attribute__((visibility("default")))

// Read from the file's bytes by Python before the library is loaded, so a plugin built for another
// DALI is rejected without running its static initialisers inside the wrong libdali.
ECHOPIPE_DALI_EXPORT __attribute__((used)) const char echopipe_dali_version_marker[] =
    "ECHOPIPE_DALI_BUILT_VERSION=" ECHOPIPE_DALI_BUILT_VERSION "\n";

namespace echopipe_dali {

echopipe::DType ToEchoDType(dali::DALIDataType type, int field) {
  using echopipe::DType;
  switch (type) {
    case DALI_UINT8:
      return DType::kUInt8;
    case DALI_INT8:
      return DType::kInt8;
    case DALI_UINT16:
      return DType::kUInt16;
    case DALI_INT16:
      return DType::kInt16;
    case DALI_INT32:
      return DType::kInt32;
    case DALI_INT64:
      return DType::kInt64;
    case DALI_FLOAT16:
      return DType::kFloat16;
    case DALI_FLOAT:
      return DType::kFloat32;
    case DALI_FLOAT64:
      return DType::kFloat64;
    case DALI_BOOL:
      return DType::kBool;
    default:
      DALI_FAIL(dali::make_string("echopipe echo sink: input ", field, " has element type ",
                                  dali::TypeTable::GetTypeInfo(type).name(),
                                  ", which the echo cache cannot store (supported: uint8, int8, "
                                  "uint16, int16, int32, int64, float16, float, float64, bool)"));
  }
}

dali::DALIDataType ToDaliDType(echopipe::DType type) {
  using echopipe::DType;
  switch (type) {
    case DType::kUInt8:
      return DALI_UINT8;
    case DType::kInt8:
      return DALI_INT8;
    case DType::kUInt16:
      return DALI_UINT16;
    case DType::kInt16:
      return DALI_INT16;
    case DType::kInt32:
      return DALI_INT32;
    case DType::kInt64:
      return DALI_INT64;
    case DType::kFloat16:
      return DALI_FLOAT16;
    case DType::kFloat32:
      return DALI_FLOAT;
    case DType::kFloat64:
      return DALI_FLOAT64;
    case DType::kBool:
      return DALI_BOOL;
    default:
      DALI_FAIL(dali::make_string("echopipe echo source: the cache holds element type ",
                                  echopipe::dtype_name(type), ", which DALI has no type for"));
  }
}

std::shared_ptr<echopipe::EchoCache> FindCacheOrFail(const std::string& name, const char* op) {
  auto cache = echopipe::find_cache(name);
  DALI_ENFORCE(cache != nullptr,
               dali::make_string(op, ": no echo cache named '", name,
                                 "' is registered in this process; create it from Python "
                                 "(echopipe.EchoCache / echopipe.dali.EchoPipeline) before "
                                 "building the pipeline"));
  return cache;
}

// The CPU operators read and write the arena on the host, which a device arena is not.
static std::shared_ptr<echopipe::EchoCache> HostCacheOrFail(const std::string& name,
                                                            const char* op) {
  auto cache = FindCacheOrFail(name, op);
  DALI_ENFORCE(cache->memory_kind() != echopipe::MemoryKind::kDevice,
               dali::make_string(op, ": echo cache '", name,
                                 "' keeps its samples in GPU memory (memory='device'); use "
                                 "device='gpu' for this operator, or memory='pinned'"));
  return cache;
}

void DescribeSinkOutput(std::vector<dali::OutputDesc>& out, const dali::Workspace& ws) {
  out.resize(1);
  out[0].shape = dali::uniform_list_shape(ws.GetInputBatchSize(0), dali::TensorShape<0>());
  out[0].type = DALI_INT32;
}

void RecordInputLayouts(echopipe::EchoCache& cache, const dali::Workspace& ws) {
  for (int f = 0; f < ws.NumInput(); ++f) cache.record_layout(f, ws.GetInputLayout(f).c_str());
}

echopipe::SampleDesc DescribeInputSample(const dali::Workspace& ws, int i) {
  echopipe::SampleDesc desc;
  desc.num_fields = ws.NumInput();
  for (int f = 0; f < desc.num_fields; ++f) {
    auto shape = ws.GetInputShape(f)[i];
    DALI_ENFORCE(
        shape.size() <= echopipe::kMaxDims,
        dali::make_string("echopipe echo sink: input ", f, " has ", shape.size(),
                          " dimensions; the echo cache stores at most ", echopipe::kMaxDims));
    desc.fields[f].dtype = ToEchoDType(ws.GetInputDataType(f), f);
    desc.fields[f].ndim = shape.size();
    for (int k = 0; k < shape.size(); ++k) desc.fields[f].shape[k] = shape[k];
  }
  return desc;
}

dali::TensorLayout RecordedLayout(const echopipe::EchoCache& cache, int field) {
  const std::vector<std::string> layouts = cache.layouts();
  if (static_cast<int>(layouts.size()) <= field) return {};
  return dali::TensorLayout(layouts[field]);
}

DrawnBatch DrawBatch(echopipe::EchoCache& cache, int batch_size, const SampleCopy* padding,
                     const std::string& cache_name, const std::function<void()>& between_attempts) {
  DrawnBatch batch;
  batch.leases.reserve(batch_size);
  const DrawEnd end = take_batch(cache, batch_size, batch.leases, between_attempts);
  if (end == DrawEnd::kClosed)
    DALI_FAIL(dali::make_string("echopipe echo source: echo cache '", cache_name,
                                "' was closed while the pipeline was drawing from it"));
  const bool ended = end == DrawEnd::kEnded;  // every ticket was emitted
  batch.valid = static_cast<int>(batch.leases.size());
  batch.ended = ended;
  batch.source_index.resize(batch_size);
  for (int i = 0; i < batch_size; ++i) {
    if (i < batch.valid) {
      batch.source_index[i] = i;
    } else if (batch.valid > 0) {
      batch.source_index[i] = i % batch.valid;
    } else {
      batch.source_index[i] = -1;
    }
  }
  if (ended && batch.valid == 0 && padding == nullptr) {
    DALI_FAIL(dali::make_string("echopipe echo source: the input of echo cache '", cache_name,
                                "' ended before any sample was stored (empty data set?)"));
  }
  return batch;
}

static const echopipe::SampleDesc& DescAt(const DrawnBatch& batch, const SampleCopy* padding,
                                          int i) {
  int src = batch.source_index[i];
  return src >= 0 ? batch.leases[src].desc() : padding->desc;
}

void DescribeOutputs(const DrawnBatch& batch, const SampleCopy* padding, int num_fields,
                     std::vector<dali::OutputDesc>& out, const std::string& cache_name) {
  int n = static_cast<int>(batch.source_index.size());
  out.resize(num_fields + 1);
  const auto& first = DescAt(batch, padding, 0);
  DALI_ENFORCE(
      first.num_fields == num_fields,
      dali::make_string("echopipe echo source: echo cache '", cache_name, "' holds samples with ",
                        first.num_fields,
                        " fields but the source was created with num_fields=", num_fields));
  for (int f = 0; f < num_fields; ++f) {
    const auto& fd = first.fields[f];
    dali::TensorListShape<> shape(n, fd.ndim);
    for (int i = 0; i < n; ++i) {
      const auto& d = DescAt(batch, padding, i).fields[f];
      DALI_ENFORCE(
          d.ndim == fd.ndim && d.dtype == fd.dtype,
          dali::make_string("echopipe echo source: field ", f, " differs between samples (ndim ",
                            fd.ndim, " vs ", d.ndim, ", dtype ", echopipe::dtype_name(fd.dtype),
                            " vs ", echopipe::dtype_name(d.dtype), ")"));
      dali::TensorShape<> ts;
      ts.resize(d.ndim);
      for (int k = 0; k < d.ndim; ++k) ts[k] = d.shape[k];
      shape.set_tensor_shape(i, ts);
    }
    out[f].shape = std::move(shape);
    out[f].type = ToDaliDType(fd.dtype);
  }
  out[num_fields].shape = dali::uniform_list_shape(n, dali::TensorShape<1>(3));
  out[num_fields].type = DALI_INT64;
}

void UpdatePadding(const DrawnBatch& batch, std::shared_ptr<const SampleCopy>& padding,
                   PaddingAge& age) {
  if (!age.take_from(batch)) return;
  auto copy = std::make_shared<SampleCopy>();
  const auto& lease = batch.leases[0];
  copy->desc = lease.desc();
  for (int f = 0; f < copy->desc.num_fields; ++f) {
    const auto* p = static_cast<const uint8_t*>(lease.data(f));
    copy->fields.emplace_back(p, p + lease.nbytes(f));
  }
  padding = std::move(copy);
}

SourceState SavedSourceState(const dali::OpCheckpoint& cpt) {
  // OpCheckpoint reads its state only through a cast that fails when none was saved (a
  // checkpoint taken before the first iteration); the pointer form of any_cast tells instead.
  const auto* state =
      std::any_cast<SourceState>(&const_cast<dali::OpCheckpoint&>(cpt).MutableCheckpointState());
  return state != nullptr ? *state : SourceState{};
}

void DeserializeSourceState(dali::OpCheckpoint& cpt, const std::string& data, int num_fields) {
  try {
    cpt.MutableCheckpointState() = DecodeSourceState(data, num_fields);
  } catch (const SourceStateError& e) {
    DALI_FAIL(dali::make_string("echopipe: ", e.what()));
  }
}

const void* FieldData(const DrawnBatch& batch, const SampleCopy* padding, int i, int f,
                      size_t* nbytes) {
  int src = batch.source_index[i];
  if (src >= 0) {
    *nbytes = batch.leases[src].nbytes(f);
    return batch.leases[src].data(f);
  }
  *nbytes = padding->fields[f].size();
  return padding->fields[f].data();
}

void WriteInfo(const DrawnBatch& batch, int64_t* dst, int batch_size) {
  for (int i = 0; i < batch_size; ++i) {
    int src = batch.source_index[i];
    bool valid = i < batch.valid;
    dst[3 * i + 0] = valid ? 1 : 0;
    dst[3 * i + 1] = src >= 0 ? static_cast<int64_t>(batch.leases[src].sample_id()) : -1;
    dst[3 * i + 2] = valid ? static_cast<int64_t>(batch.leases[src].emission()) : -1;
  }
}

}  // namespace echopipe_dali

// ---- C entry points (ctypes) -----------------------------------------------------------------

ECHOPIPE_DALI_EXPORT const char* echopipe_dali_built_version() {
  return ECHOPIPE_DALI_BUILT_VERSION;
}

// Checks a serialized echo source state (an operator's entry in a DALI checkpoint) for Python
// before DALI restores it, where a refusal is an untyped RuntimeError at the build. Returns 1 for a
// valid state, 0 for data that is not a source state, -1 for a malformed one, whose reason is
// written to `reason` (NUL-terminated, cut to `reason_size`).
ECHOPIPE_DALI_EXPORT int echopipe_dali_check_source_state(const char* data, size_t size,
                                                          int num_fields, char* reason,
                                                          size_t reason_size) {
  const std::string_view bytes(data, size);
  if (!echopipe_dali::IsSourceState(bytes)) return 0;
  try {
    (void)echopipe_dali::DecodeSourceState(bytes, num_fields);
    return 1;
  } catch (const std::exception& e) {
    if (reason_size > 0) {
      std::strncpy(reason, e.what(), reason_size - 1);
      reason[reason_size - 1] = '\0';
    }
    return -1;
  }
}

ECHOPIPE_DALI_EXPORT int echopipe_dali_gpu_backend() {
#if defined(ECHOPIPE_DALI_GPU) && ECHOPIPE_DALI_GPU
  return 1;
#else
  return 0;
#endif
}

// ---- operators ---------------------------------------------------------------------------------

namespace dali {

class EchoSinkCPU : public StatelessOperator<CPUBackend> {
 public:
  explicit EchoSinkCPU(const OpSpec& spec)
      : StatelessOperator<CPUBackend>(spec),
        cache_name_(spec.GetArgument<std::string>("cache_name")),
        cache_(echopipe_dali::HostCacheOrFail(cache_name_, "echopipe echo sink")) {}

 protected:
  bool SetupImpl(std::vector<OutputDesc>& out, const Workspace& ws) override {
    echopipe_dali::DescribeSinkOutput(out, ws);
    return true;
  }

  void RunImpl(Workspace& ws) override {
    int num_fields = ws.NumInput();
    int n = ws.GetInputBatchSize(0);
    echopipe_dali::RecordInputLayouts(*cache_, ws);
    auto& stored = ws.Output<CPUBackend>(0);
    for (int i = 0; i < n; ++i) {
      *stored.mutable_tensor<int32_t>(i) = 0;
      if (!cache_->take_quota()) continue;
      echopipe::SampleDesc desc = echopipe_dali::DescribeInputSample(ws, i);
      echopipe::PutReservation reservation;
      if (!Reserve(desc, reservation)) continue;
      for (int f = 0; f < num_fields; ++f) {
        const auto& in = ws.Input<CPUBackend>(f);
        std::memcpy(reservation.field_data(f), in.raw_tensor(i), desc.fields[f].nbytes());
      }
      if (cache_->commit(reservation) == echopipe::PutStatus::kOk)
        *stored.mutable_tensor<int32_t>(i) = 1;
    }
  }

 private:
  /// Waits for space (back-pressure), polling close every 100 ms; false when input has ended.
  bool Reserve(const echopipe::SampleDesc& desc, echopipe::PutReservation& reservation) {
    for (;;) {
      auto status = cache_->reserve(desc, reservation, 0.1);
      if (status == echopipe::PutStatus::kOk) return true;
      if (status == echopipe::PutStatus::kTimeout) continue;
      if (status == echopipe::PutStatus::kEnded) return false;
      DALI_FAIL(make_string("echopipe echo sink: echo cache '", cache_name_,
                            "' was closed while the pipeline was storing into it"));
    }
  }

  std::string cache_name_;
  std::shared_ptr<echopipe::EchoCache> cache_;
};

class EchoSourceCPU : public Operator<CPUBackend> {
 public:
  explicit EchoSourceCPU(const OpSpec& spec)
      : Operator<CPUBackend>(spec),
        cache_name_(spec.GetArgument<std::string>("cache_name")),
        num_fields_(spec.GetArgument<int>("num_fields")),
        cache_(echopipe_dali::HostCacheOrFail(cache_name_, "echopipe echo source")) {}

 protected:
  bool HasContiguousOutputs() const override { return true; }

  bool SetupImpl(std::vector<OutputDesc>& out, const Workspace& ws) override {
    int batch_size = ws.GetRequestedBatchSize(0);
    batch_ = echopipe_dali::DrawBatch(*cache_, batch_size, padding_.get(), cache_name_);
    echopipe_dali::UpdatePadding(batch_, padding_, padding_age_);
    echopipe_dali::DescribeOutputs(batch_, padding_.get(), num_fields_, out, cache_name_);
    return true;
  }

  void RunImpl(Workspace& ws) override {
    int n = static_cast<int>(batch_.source_index.size());
    auto& pool = ws.GetThreadPool();
    for (int f = 0; f < num_fields_; ++f) {
      auto& out = ws.Output<CPUBackend>(f);
      out.SetLayout(echopipe_dali::RecordedLayout(*cache_, f));
      for (int i = 0; i < n; ++i) {
        pool.AddWork([this, &out, i, f](int) {
          size_t nbytes = 0;
          const void* src = echopipe_dali::FieldData(batch_, padding_.get(), i, f, &nbytes);
          std::memcpy(out.raw_mutable_tensor(i), src, nbytes);
        });
      }
    }
    pool.RunAll();
    auto& info = ws.Output<CPUBackend>(num_fields_);
    echopipe_dali::WriteInfo(batch_, info.mutable_tensor<int64_t>(0), n);
    batch_ = {};  // drops the leases: the slots may be reused once every copy is out
  }

  // The padding template, so a restored source pads the rest of its pass as the saved one would.
  void SaveState(OpCheckpoint& cpt, AccessOrder) override {
    cpt.MutableCheckpointState() = echopipe_dali::SourceState{padding_, padding_age_.stale};
  }

  void RestoreState(const OpCheckpoint& cpt) override {
    const auto state = echopipe_dali::SavedSourceState(cpt);
    padding_ = state.padding;
    padding_age_.stale = state.stale;
  }

  std::string SerializeCheckpoint(const OpCheckpoint& cpt) const override {
    return echopipe_dali::EncodeSourceState(echopipe_dali::SavedSourceState(cpt));
  }

  void DeserializeCheckpoint(OpCheckpoint& cpt, const std::string& data) const override {
    echopipe_dali::DeserializeSourceState(cpt, data, num_fields_);
  }

 private:
  std::string cache_name_;
  int num_fields_;
  std::shared_ptr<echopipe::EchoCache> cache_;
  echopipe_dali::DrawnBatch batch_;
  std::shared_ptr<const echopipe_dali::SampleCopy> padding_;
  echopipe_dali::PaddingAge padding_age_;
};

DALI_SCHEMA(EchopipeEchoSink)
    .DocStr(R"(Stores every input sample (all inputs together form one sample) into the echopipe
echo cache named `cache_name`, blocking while the cache is full. Ends the upstream part of an
echoing pipeline; `EchopipeEchoSource` draws the samples back. Output: per sample int32, 1 if the
sample was stored, 0 if it was dropped because the run's quota of fresh samples was reached.)")
    .NumInput(1, echopipe::kMaxFields)
    .InputDevice(0, echopipe::kMaxFields, InputDevice::MatchBackendOrCPU)
    .NumOutput(1)
    .AddArg("cache_name", "Name of an echo cache created from Python.", DALI_STRING)
    .MakeStateful()
    .NoPrune();

DALI_SCHEMA(EchopipeEchoSource)
    .DocStr(R"(Draws a batch of the pipeline's batch size from the echopipe echo cache named
`cache_name`; every fresh sample is emitted floor(e) or ceil(e) times. Outputs: the `num_fields`
fields the sink stored, then per sample int64 [valid, sample_id, emission]. After the end of input
the last batches are padded (valid = 0) instead of blocking.)")
    .NumInput(0)
    .OutputFn([](const OpSpec& spec) { return spec.GetArgument<int>("num_fields") + 1; })
    .AddArg("cache_name", "Name of an echo cache created from Python.", DALI_STRING)
    .AddArg("num_fields", "How many inputs the matching sink has (1..4).", DALI_INT32)
    .MakeStateful()
    .NoPrune();

DALI_REGISTER_OPERATOR(EchopipeEchoSink, EchoSinkCPU, CPU);
DALI_REGISTER_OPERATOR(EchopipeEchoSource, EchoSourceCPU, CPU);

}  // namespace dali
