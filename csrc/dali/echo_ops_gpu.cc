// GPU backends of the echopipe DALI operators (compiled only when the build has CUDA).
//
// The source fills its whole output batch (every field of every sample, and the info rows) with
// ONE gather_scatter launch on DALI's stream (csrc/cuda/gather.cu): the kernel reads the pinned,
// GPU-mapped arena over the bus, or with memory='device' the device arena, and writes each
// sample where DALI put it. No per-sample call and no synchronisation: the leases are kept until
// an event recorded after the launch has fired. ECHOPIPE_GPU_SOURCE_COPY=each|batch selects
// per-sample cudaMemcpyAsync or cudaMemcpyBatchAsync instead, for the benchmark (a pageable arena
// always takes the per-sample path). The sink (after a "mixed" decoder, or GPU augmentation)
// copies into reserved cache slots and commits them once the stream has finished. This file is
// compiled by the host compiler against the CUDA runtime API; the kernels live in the core.
#if defined(ECHOPIPE_DALI_GPU) && ECHOPIPE_DALI_GPU

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "cuda/copy_mode.h"
#include "cuda/gather.h"
#include "dali/echo_ops.h"
#include "dali/pipeline/operator/checkpointing/stateless_operator.h"
#include "dali/source_draw.h"

namespace dali {
namespace {

void CudaCheck(cudaError_t err, const char* what) {
  DALI_ENFORCE(err == cudaSuccess,
               make_string("echopipe: ", what, " failed: ", cudaGetErrorString(err)));
}

// An owned CUDA event. Destroying it first waits for the work it marks, so the host memory that
// work reads (leased cache slots) is never released under a running copy, also on exceptions.
class CudaEvent {
 public:
  CudaEvent() {
    CudaCheck(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  }
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() { reset(); }
  cudaEvent_t get() const { return event_; }

 private:
  void reset() noexcept {
    if (event_ == nullptr) return;
    (void)cudaEventSynchronize(event_);
    (void)cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

// A device arena is read and written by kernels and copies on the pipeline's device: one made
// on another device would need peer access (or crash), so it is refused in one line. Checked on
// the first run, where DALI has made the pipeline's device current.
void CheckArenaDevice(const echopipe::EchoCache& cache, const std::string& name, bool* checked) {
  if (*checked) return;
  *checked = true;
  if (cache.memory_kind() != echopipe::MemoryKind::kDevice) return;
  cudaPointerAttributes attr{};
  CudaCheck(cudaPointerGetAttributes(&attr, cache.arena_device()), "cudaPointerGetAttributes");
  int current = -1;
  CudaCheck(cudaGetDevice(&current), "cudaGetDevice");
  DALI_ENFORCE(
      attr.device == current,
      make_string("echopipe: echo cache '", name, "' keeps its samples in the memory of GPU ",
                  attr.device, ", but the pipeline runs on GPU ", current,
                  "; create the cache with that device current (echopipe.dali does "
                  "for device_id), or use memory='pinned'"));
}

// A test hook's spin (copy_mode.h), parsed when the operator is built.
int64_t SpinFromEnv(const char* variable, const char* op) {
  try {
    return echopipe::cuda::spin_ns_from_env(variable, std::getenv(variable));
  } catch (const std::invalid_argument& e) {
    DALI_FAIL(make_string(op, ": ", e.what()));
  }
}

}  // namespace

class EchoSinkGPU : public StatelessOperator<GPUBackend> {
 public:
  explicit EchoSinkGPU(const OpSpec& spec)
      : StatelessOperator<GPUBackend>(spec),
        cache_name_(spec.GetArgument<std::string>("cache_name")),
        cache_(echopipe_dali::FindCacheOrFail(cache_name_, "echopipe echo sink (gpu)")),
        device_arena_(cache_->memory_kind() == echopipe::MemoryKind::kDevice),
        spin_ns_(SpinFromEnv(echopipe::cuda::kSinkSpinEnv, "echopipe echo sink (gpu)")) {}

 protected:
  bool SetupImpl(std::vector<OutputDesc>& out, const Workspace& ws) override {
    echopipe_dali::DescribeSinkOutput(out, ws);
    return true;
  }

  void RunImpl(Workspace& ws) override {
    CheckArenaDevice(*cache_, cache_name_, &device_checked_);
    int num_fields = ws.NumInput();
    int n = ws.GetInputBatchSize(0);
    echopipe_dali::RecordInputLayouts(*cache_, ws);
    std::vector<int32_t> stored(n, 0);
    echopipe::cuda::spin(spin_ns_, ws.stream());
    for (int i = 0; i < n; ++i) {
      if (!cache_->take_quota()) continue;
      echopipe::SampleDesc desc = echopipe_dali::DescribeInputSample(ws, i);
      echopipe::PutReservation reservation;
      // Never wait for space while holding uncommitted reservations: commit what is copied first.
      auto status = cache_->reserve(desc, reservation, 0.0);
      if (status == echopipe::PutStatus::kTimeout) {
        Flush(ws, stored);
        status = ReserveBlocking(desc, reservation);
      }
      if (status == echopipe::PutStatus::kEnded) continue;
      if (status != echopipe::PutStatus::kOk) FailClosed();
      for (int f = 0; f < num_fields; ++f) {
        size_t nbytes = desc.fields[f].nbytes();
        if (ws.InputIsType<GPUBackend>(f)) {
          // Default: the arena is pinned host memory or, with memory='device', device memory.
          CudaCheck(
              cudaMemcpyAsync(reservation.field_data(f), ws.Input<GPUBackend>(f).raw_tensor(i),
                              nbytes, cudaMemcpyDefault, ws.stream()),
              "copy into the echo cache");
        } else if (device_arena_) {
          CudaCheck(
              cudaMemcpyAsync(reservation.field_data(f), ws.Input<CPUBackend>(f).raw_tensor(i),
                              nbytes, cudaMemcpyDefault, ws.stream()),
              "host-to-device copy into the echo cache");
        } else {
          std::memcpy(reservation.field_data(f), ws.Input<CPUBackend>(f).raw_tensor(i), nbytes);
        }
      }
      pending_.emplace_back(i, std::move(reservation));
    }
    Flush(ws, stored);
    auto& out = ws.Output<GPUBackend>(0);
    CudaCheck(cudaMemcpyAsync(out.raw_mutable_tensor(0), stored.data(), n * sizeof(int32_t),
                              cudaMemcpyHostToDevice, ws.stream()),
              "writing the sink's stored flags");
    CudaCheck(cudaStreamSynchronize(ws.stream()), "cudaStreamSynchronize");  // `stored` is local
  }

 private:
  void Flush(Workspace& ws, std::vector<int32_t>& stored) {
    if (pending_.empty()) return;
    CudaCheck(cudaStreamSynchronize(ws.stream()), "cudaStreamSynchronize");
    for (auto& [index, reservation] : pending_) {
      if (cache_->commit(reservation) == echopipe::PutStatus::kOk) stored[index] = 1;
    }
    pending_.clear();
  }

  echopipe::PutStatus ReserveBlocking(const echopipe::SampleDesc& desc,
                                      echopipe::PutReservation& reservation) {
    for (;;) {
      auto status = cache_->reserve(desc, reservation, 0.1);
      if (status != echopipe::PutStatus::kTimeout) return status;
    }
  }

  [[noreturn]] void FailClosed() const {
    DALI_FAIL(make_string("echopipe echo sink: echo cache '", cache_name_,
                          "' was closed while the pipeline was storing into it"));
  }

  std::string cache_name_;
  std::shared_ptr<echopipe::EchoCache> cache_;
  bool device_arena_;
  int64_t spin_ns_;
  bool device_checked_ = false;
  std::vector<std::pair<int, echopipe::PutReservation>> pending_;
};

// Host memory the GPU can read (cudaHostAlloc mapped): the source's info rows, written on the
// host and copied by the same launch as the samples. Freed only when the operator goes (freeing
// pinned memory synchronises the device), so buffers are recycled through a pool.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    CudaCheck(cudaHostAlloc(&host_, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
              "cudaHostAlloc of the source's info buffer");
    if (cudaHostGetDevicePointer(&device_, host_, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      device_ = nullptr;  // not mapped: its copy takes the per-copy path
    }
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : host_(std::exchange(o.host_, nullptr)),
        device_(std::exchange(o.device_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&&) = delete;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (host_ != nullptr) (void)cudaFreeHost(host_);
  }
  void* host() const { return host_; }
  void* device() const { return device_; }
  size_t bytes() const { return bytes_; }

 private:
  void* host_ = nullptr;
  void* device_ = nullptr;
  size_t bytes_ = 0;
};

// Device copy of one sample, the padding template of the batches after the end of input, so
// every output sample of a padded batch is device-readable and the batch stays one launch. Its
// bytes are copied by the launch of the batch it was taken from (stream-ordered before any batch
// that reads it; a synchronous cudaMemcpy on the legacy stream would not be ordered with DALI's
// stream, and from a device arena it may return before the copy ends).
struct DevicePadding {
  echopipe_dali::SampleCopy desc_only;  // desc for DescribeOutputs; no host field bytes
  void* fields[echopipe::kMaxFields] = {};
  size_t nbytes[echopipe::kMaxFields] = {};
  bool filled = false;  // its copy is queued (in the plan of the batch it came from)
  // Its bytes on the host, for DALI's checkpoints: a restored template's, or copied back once
  // when a checkpoint first saves it.
  std::shared_ptr<const echopipe_dali::SampleCopy> host;

  DevicePadding() = default;
  DevicePadding(const DevicePadding&) = delete;
  DevicePadding& operator=(const DevicePadding&) = delete;
  ~DevicePadding() {
    for (void* p : fields)
      if (p != nullptr) (void)cudaFree(p);
  }
};

class EchoSourceGPU : public Operator<GPUBackend> {
 public:
  explicit EchoSourceGPU(const OpSpec& spec)
      : Operator<GPUBackend>(spec),
        cache_name_(spec.GetArgument<std::string>("cache_name")),
        num_fields_(spec.GetArgument<int>("num_fields")),
        cache_(echopipe_dali::FindCacheOrFail(cache_name_, "echopipe echo source (gpu)")),
        mode_(ParseMode()),
        spin_ns_(SpinFromEnv(echopipe::cuda::kSourceSpinEnv, "echopipe echo source (gpu)")) {}

 protected:
  bool SetupImpl(std::vector<OutputDesc>& out, const Workspace& ws) override {
    // Before the (blocking) draw and between its attempts: leases whose copies have completed go
    // back to the cache, so a small cache is not kept full by slots that only wait for the next
    // RunImpl (dali/source_draw.h says why that could hang).
    RetireFinished();
    RestorePadding(ws.stream());
    int batch_size = ws.GetRequestedBatchSize(0);
    const echopipe_dali::SampleCopy* pad = padding_ ? &padding_->desc_only : nullptr;
    batch_ = echopipe_dali::DrawBatch(*cache_, batch_size, pad, cache_name_,
                                      [this] { RetireFinished(); });
    UpdatePadding();
    pad = padding_ ? &padding_->desc_only : nullptr;
    echopipe_dali::DescribeOutputs(batch_, pad, num_fields_, out, cache_name_);
    return true;
  }

  void RunImpl(Workspace& ws) override {
    CheckArenaDevice(*cache_, cache_name_, &device_checked_);
    RetireFinished();
    const int n = static_cast<int>(batch_.source_index.size());
    cudaStream_t stream = ws.stream();
    stream_ = stream;
    InFlight flight;
    flight.info = TakeInfoBuffer(static_cast<size_t>(3 * n) * sizeof(int64_t));
    echopipe_dali::WriteInfo(batch_, static_cast<int64_t*>(flight.info->host()), n);
    plan_.clear();
    for (int f = 0; f < num_fields_; ++f) {
      auto& out = ws.Output<GPUBackend>(f);
      out.SetLayout(echopipe_dali::RecordedLayout(*cache_, f));
      for (int i = 0; i < n; ++i) AddSample(i, f, out.raw_mutable_tensor(i));
    }
    AddPaddingFill();
    plan_.add(flight.info->device(), flight.info->host(),
              ws.Output<GPUBackend>(num_fields_).raw_mutable_tensor(0),
              static_cast<int64_t>(3 * n * sizeof(int64_t)));
    try {
      echopipe::cuda::spin(spin_ns_, stream);
      Copy(plan_, stream);
    } catch (...) {
      // Some copies may be queued: the event must mark them before the leases can go.
      (void)cudaEventRecord(flight.event.get(), stream);
      throw;
    }
    CudaCheck(cudaEventRecord(flight.event.get(), stream), "cudaEventRecord");
    // The leases and the info buffer live until the copies that read them have completed.
    flight.old_padding = std::move(old_padding_);
    flight.batch = std::move(batch_);
    batch_ = {};
    in_flight_.push(std::move(flight));
  }

  // The padding template, so a restored source pads the rest of its pass as the saved one would.
  // DALI calls this after each iteration's RunImpl, on its stream.
  void SaveState(OpCheckpoint& cpt, AccessOrder) override {
    echopipe_dali::SourceState state;
    if (padding_ && padding_->filled) {
      state = {HostPadding(), padding_age_.stale};
    } else if (restored_) {
      state = {restored_, restored_stale_};
    }
    cpt.MutableCheckpointState() = state;
  }

  void RestoreState(const OpCheckpoint& cpt) override {
    const auto state = echopipe_dali::SavedSourceState(cpt);
    restored_ = state.padding;
    restored_stale_ = state.stale;
    padding_age_.stale = state.stale;
  }

  std::string SerializeCheckpoint(const OpCheckpoint& cpt) const override {
    return echopipe_dali::EncodeSourceState(echopipe_dali::SavedSourceState(cpt));
  }

  void DeserializeCheckpoint(OpCheckpoint& cpt, const std::string& data) const override {
    echopipe_dali::DeserializeSourceState(cpt, data, num_fields_);
  }

 private:
  // Members are destroyed in reverse order: the event (waiting for the copies) before the info
  // buffer and the leases those copies read.
  struct InFlight {
    // A padding template this batch replaced: earlier batches' copies may still read it, and
    // they run on the stream before this batch's event.
    std::unique_ptr<DevicePadding> old_padding;
    echopipe_dali::DrawnBatch batch;
    std::unique_ptr<PinnedBuffer> info;
    CudaEvent event;
  };

  static echopipe::cuda::CopyMode ParseMode() {
    try {
      return echopipe::cuda::copy_mode_from_name(std::getenv(echopipe::cuda::kCopyModeEnv));
    } catch (const std::invalid_argument& e) {
      DALI_FAIL(make_string("echopipe echo source: ", e.what()));
    }
  }

  void AddSample(int i, int f, void* dst) {
    const int src = batch_.source_index[i];
    if (src >= 0) {
      const auto& lease = batch_.leases[src];
      plan_.add(lease.device_data(f), lease.data(f), dst, static_cast<int64_t>(lease.nbytes(f)));
    } else {
      plan_.add(padding_->fields[f], padding_->fields[f], dst,
                static_cast<int64_t>(padding_->nbytes[f]));
    }
  }

  void Copy(const echopipe::cuda::CopyPlan& plan, cudaStream_t stream) {
    using echopipe::cuda::CopyMode;
    switch (plan.effective(mode_)) {
      case CopyMode::kGather:
        return echopipe::cuda::gather_scatter(plan.src.data(), plan.dst.data(), plan.size.data(),
                                              plan.count(), stream);
      case CopyMode::kBatch:
        return echopipe::cuda::copy_batch(plan.src.data(), plan.dst.data(), plan.size.data(),
                                          plan.count(), stream);
      case CopyMode::kEach:
        return echopipe::cuda::copy_each(plan.src.data(), plan.dst.data(), plan.size.data(),
                                         plan.count(), stream);
    }
  }

  // Room for a device copy of the pass's first drawn sample: the template of padded batches
  // (PaddingAge says why each pass takes its own). Padding is only read by batches that drew
  // nothing, never by the batch it comes from, so its copy can join that batch's launch
  // (AddPaddingFill); the template it replaces lives on in this batch's flight.
  void UpdatePadding() {
    if (!padding_age_.take_from(batch_)) return;
    old_padding_ = std::move(padding_);
    const auto& lease = batch_.leases[0];
    auto pad = std::make_unique<DevicePadding>();
    pad->desc_only.desc = lease.desc();
    for (int f = 0; f < lease.desc().num_fields; ++f) {
      const size_t nbytes = lease.nbytes(f);
      pad->nbytes[f] = nbytes;
      CudaCheck(cudaMalloc(&pad->fields[f], nbytes > 0 ? nbytes : 1), "cudaMalloc (padding)");
    }
    padding_ = std::move(pad);
  }

  // Queues the padding's copy from lease 0 of this batch; the flight keeps that lease until the
  // copy has ended, like the samples' own.
  void AddPaddingFill() {
    if (!padding_ || padding_->filled || batch_.valid == 0) return;
    const auto& lease = batch_.leases[0];
    // The template's sizes came from this lease unless the run that drew it failed.
    for (int f = 0; f < lease.desc().num_fields; ++f)
      if (lease.nbytes(f) != padding_->nbytes[f]) return;
    for (int f = 0; f < lease.desc().num_fields; ++f) {
      plan_.add(lease.device_data(f), lease.data(f), padding_->fields[f],
                static_cast<int64_t>(padding_->nbytes[f]));
    }
    padding_->filled = true;
  }

  // A restored template goes to the device before the first draw that may pad with it, on the
  // stream of the copies that will read it.
  void RestorePadding(cudaStream_t stream) {
    if (!restored_) return;
    auto pad = std::make_unique<DevicePadding>();
    pad->desc_only.desc = restored_->desc;
    for (int f = 0; f < restored_->desc.num_fields; ++f) {
      const size_t nbytes = restored_->fields[f].size();
      pad->nbytes[f] = nbytes;
      CudaCheck(cudaMalloc(&pad->fields[f], nbytes > 0 ? nbytes : 1), "cudaMalloc (padding)");
      if (nbytes > 0) {
        CudaCheck(cudaMemcpyAsync(pad->fields[f], restored_->fields[f].data(), nbytes,
                                  cudaMemcpyHostToDevice, stream),
                  "cudaMemcpyAsync (restored padding)");
      }
    }
    pad->filled = true;
    pad->host = std::move(restored_);
    restored_ = nullptr;
    padding_ = std::move(pad);
  }

  // The template's bytes on the host. Copied back once per template (a pass), after the copies
  // that filled it on this stream; the wait is a checkpointing pipeline's only one per pass.
  std::shared_ptr<const echopipe_dali::SampleCopy> HostPadding() {
    if (!padding_->host) {
      auto copy = std::make_shared<echopipe_dali::SampleCopy>();
      copy->desc = padding_->desc_only.desc;
      for (int f = 0; f < copy->desc.num_fields; ++f) {
        copy->fields.emplace_back(padding_->nbytes[f]);
        if (padding_->nbytes[f] == 0) continue;
        CudaCheck(cudaMemcpyAsync(copy->fields[f].data(), padding_->fields[f], padding_->nbytes[f],
                                  cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync (padding for a checkpoint)");
      }
      CudaCheck(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (padding for a checkpoint)");
      padding_->host = std::move(copy);
    }
    return padding_->host;
  }

  std::unique_ptr<PinnedBuffer> TakeInfoBuffer(size_t bytes) {
    for (auto it = free_info_.begin(); it != free_info_.end(); ++it) {
      if ((*it)->bytes() >= bytes) {
        auto buf = std::move(*it);
        free_info_.erase(it);
        return buf;
      }
    }
    return std::make_unique<PinnedBuffer>(std::max<size_t>(bytes, 64));
  }

  // Gives back the leases and info buffers of batches whose copies have ended; at most two
  // batches stay pending (bounding the slots held), older ones are waited for.
  void RetireFinished() {
    in_flight_.retire(
        2, [](InFlight& f) { return cudaEventQuery(f.event.get()) == cudaSuccess; },
        [](InFlight& f) { CudaCheck(cudaEventSynchronize(f.event.get()), "cudaEventSynchronize"); },
        [this](InFlight& f) { free_info_.push_back(std::move(f.info)); });
  }

  std::string cache_name_;
  int num_fields_;
  std::shared_ptr<echopipe::EchoCache> cache_;
  echopipe::cuda::CopyMode mode_;
  int64_t spin_ns_;
  bool device_checked_ = false;
  echopipe_dali::DrawnBatch batch_;
  std::unique_ptr<DevicePadding> padding_;
  std::unique_ptr<DevicePadding> old_padding_;  // replaced by this batch; joins its flight
  echopipe_dali::PaddingAge padding_age_;
  // A template restored from a checkpoint, on the host until the first draw (RestorePadding).
  std::shared_ptr<const echopipe_dali::SampleCopy> restored_;
  bool restored_stale_ = true;
  cudaStream_t stream_ = nullptr;  // of the last RunImpl: the copies a checkpoint waits for
  echopipe::cuda::CopyPlan plan_;
  std::vector<std::unique_ptr<PinnedBuffer>> free_info_;
  // Last, so it is destroyed first: each flight's event waits for the copies that read the
  // leases, the info buffers and the padding.
  echopipe_dali::FlightQueue<InFlight> in_flight_;
};

DALI_REGISTER_OPERATOR(EchopipeEchoSink, EchoSinkGPU, GPU);
DALI_REGISTER_OPERATOR(EchopipeEchoSource, EchoSourceGPU, GPU);

}  // namespace dali

#endif  // ECHOPIPE_DALI_GPU
