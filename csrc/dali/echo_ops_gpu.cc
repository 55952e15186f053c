// GPU backends of the echopipe DALI operators (compiled only when the build has CUDA).
//
// No kernel is needed: the echo cache arena is host memory (pinned and GPU-mapped when a device is
// present), so the GPU source copies each drawn sample host->device with cudaMemcpyAsync on DALI's
// stream, and the GPU sink (after a "mixed" decoder, or GPU augmentation) copies device->host into
// reserved cache slots and commits them once the stream has finished. This file is compiled by the
// host compiler against the CUDA runtime API, which keeps the DALI headers away from nvcc.
#if defined(ECHOPIPE_DALI_GPU) && ECHOPIPE_DALI_GPU

#include <cuda_runtime_api.h>

#include <cstring>
#include <deque>
#include <utility>

#include "dali/echo_ops.h"
#include "dali/pipeline/operator/checkpointing/stateless_operator.h"

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

}  // namespace

class EchoSinkGPU : public StatelessOperator<GPUBackend> {
 public:
  explicit EchoSinkGPU(const OpSpec& spec)
      : StatelessOperator<GPUBackend>(spec),
        cache_name_(spec.GetArgument<std::string>("cache_name")),
        cache_(echopipe_dali::FindCacheOrFail(cache_name_, "echopipe echo sink (gpu)")) {}

 protected:
  bool SetupImpl(std::vector<OutputDesc>& out, const Workspace& ws) override {
    echopipe_dali::DescribeSinkOutput(out, ws);
    return true;
  }

  void RunImpl(Workspace& ws) override {
    int num_fields = ws.NumInput();
    int n = ws.GetInputBatchSize(0);
    echopipe_dali::RecordInputLayouts(*cache_, ws);
    std::vector<int32_t> stored(n, 0);
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
          CudaCheck(
              cudaMemcpyAsync(reservation.field_data(f), ws.Input<GPUBackend>(f).raw_tensor(i),
                              nbytes, cudaMemcpyDeviceToHost, ws.stream()),
              "device-to-host copy into the echo cache");
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
  std::vector<std::pair<int, echopipe::PutReservation>> pending_;
};

class EchoSourceGPU : public StatelessOperator<GPUBackend> {
 public:
  explicit EchoSourceGPU(const OpSpec& spec)
      : StatelessOperator<GPUBackend>(spec),
        cache_name_(spec.GetArgument<std::string>("cache_name")),
        num_fields_(spec.GetArgument<int>("num_fields")),
        cache_(echopipe_dali::FindCacheOrFail(cache_name_, "echopipe echo source (gpu)")) {}

 protected:
  bool SetupImpl(std::vector<OutputDesc>& out, const Workspace& ws) override {
    int batch_size = ws.GetRequestedBatchSize(0);
    batch_ = echopipe_dali::DrawBatch(*cache_, batch_size, padding_.get(), cache_name_);
    echopipe_dali::UpdatePadding(batch_, padding_);
    echopipe_dali::DescribeOutputs(batch_, padding_.get(), num_fields_, out, cache_name_);
    return true;
  }

  void RunImpl(Workspace& ws) override {
    RetireFinished();
    int n = static_cast<int>(batch_.source_index.size());
    InFlight flight;  // its event waits for the copies below if anything throws
    for (int f = 0; f < num_fields_; ++f) {
      auto& out = ws.Output<GPUBackend>(f);
      out.SetLayout(echopipe_dali::RecordedLayout(*cache_, f));
      for (int i = 0; i < n; ++i) {
        size_t nbytes = 0;
        const void* src = echopipe_dali::FieldData(batch_, padding_.get(), i, f, &nbytes);
        CudaCheck(cudaMemcpyAsync(out.raw_mutable_tensor(i), src, nbytes, cudaMemcpyHostToDevice,
                                  ws.stream()),
                  "host-to-device copy from the echo cache");
      }
    }
    flight.info.resize(3 * n);
    echopipe_dali::WriteInfo(batch_, flight.info.data(), n);
    CudaCheck(cudaMemcpyAsync(ws.Output<GPUBackend>(num_fields_).raw_mutable_tensor(0),
                              flight.info.data(), flight.info.size() * sizeof(int64_t),
                              cudaMemcpyHostToDevice, ws.stream()),
              "writing the source's info output");
    CudaCheck(cudaEventRecord(flight.event.get(), ws.stream()), "cudaEventRecord");
    // The leases (and the info buffer) live until the copies that read them have completed.
    flight.batch = std::move(batch_);
    batch_ = {};
    in_flight_.push_back(std::move(flight));
  }

 private:
  // Members are destroyed in reverse order: the event (waiting for the copies) before the info
  // buffer and the leases those copies read.
  struct InFlight {
    echopipe_dali::DrawnBatch batch;
    std::vector<int64_t> info;
    CudaEvent event;
  };

  void RetireFinished() {
    while (!in_flight_.empty()) {
      auto& front = in_flight_.front();
      // Bound the lag so leased slots are returned to the cache promptly.
      if (in_flight_.size() > 2) {
        CudaCheck(cudaEventSynchronize(front.event.get()), "cudaEventSynchronize");
      } else if (cudaEventQuery(front.event.get()) != cudaSuccess) {
        break;
      }
      in_flight_.pop_front();
    }
  }

  std::string cache_name_;
  int num_fields_;
  std::shared_ptr<echopipe::EchoCache> cache_;
  echopipe_dali::DrawnBatch batch_;
  std::unique_ptr<echopipe_dali::SampleCopy> padding_;
  std::deque<InFlight> in_flight_;
};

DALI_REGISTER_OPERATOR(EchopipeEchoSink, EchoSinkGPU, GPU);
DALI_REGISTER_OPERATOR(EchopipeEchoSource, EchoSourceGPU, GPU);

}  // namespace dali

#endif  // ECHOPIPE_DALI_GPU
