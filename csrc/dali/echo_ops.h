// Shared pieces of the echopipe DALI plugin (libechopipe_dali.so): the mapping between DALI and
// echo-cache element types, the lookup of a cache that Python registered by name, and the sink's
// and source's use of the per-cache side state (field layouts, the sink's quota of fresh
// samples), which lives in the core EchoCache so that Python (pybind11) and the plugin (the
// core's C++ API) share one registry.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dali/pipeline/operator/checkpointing/op_checkpoint.h"
#include "dali/pipeline/operator/operator.h"
#include "dali/source_state.h"
#include "echo/echo_cache.h"

namespace echopipe_dali {

/// DALI element type -> echo cache element type; DALI error naming the type if unsupported.
echopipe::DType ToEchoDType(dali::DALIDataType type, int field);
/// Echo cache element type -> DALI element type.
dali::DALIDataType ToDaliDType(echopipe::DType type);

/// The registered cache called `name`; DALI error naming it when Python did not create it.
std::shared_ptr<echopipe::EchoCache> FindCacheOrFail(const std::string& name, const char* op);

/// Layout recorded for field `field` of `cache`, or an empty layout.
dali::TensorLayout RecordedLayout(const echopipe::EchoCache& cache, int field);

/// The sink's output: per sample one int32 (1 = stored), whichever backend its inputs are on.
void DescribeSinkOutput(std::vector<dali::OutputDesc>& out, const dali::Workspace& ws);

/// Records the layout of every sink input (one per cache field) in `cache`.
void RecordInputLayouts(echopipe::EchoCache& cache, const dali::Workspace& ws);

/// Cache descriptor (element type and shape of every field) of sample `i` of the sink's inputs,
/// on either backend; DALI error naming the input when it has too many dimensions.
echopipe::SampleDesc DescribeInputSample(const dali::Workspace& ws, int i);

/// Outcome of drawing one downstream batch: leases for the real samples, and for each output
/// position the index of the lease (or of the template when no lease exists) it copies from.
struct DrawnBatch {
  std::vector<echopipe::SampleLease> leases;
  std::vector<int> source_index;  ///< per output sample: lease index, or -1 = template
  int valid = 0;                  ///< the first `valid` output samples are real draws
  bool ended = false;             ///< the draw met the end of the pass's input
};

/// When a source replaces its padding template. The template repeats a sample of the pass it
/// pads (plain DALI's reader repeats the last sample of the epoch, a file of the shard it reads
/// then): the first sample drawn after a pass ended is taken again, since a reader that moves
/// to another shard every epoch makes an older template a file of another shard.
struct PaddingAge {
  bool stale = true;  ///< no template yet, or the last one came from an ended pass
  /// True when `batch` should replace the template; records the ends of passes.
  bool take_from(const DrawnBatch& batch) {
    const bool take = stale && batch.valid > 0;
    if (take) stale = false;
    if (batch.ended) stale = true;
    return take;
  }
};

/// Draws `batch_size` samples (blocking, polling close every 100 ms; `between_attempts`, when
/// set, runs after each poll that took nothing: see dali/source_draw.h). After the end of input
/// the batch is padded by repeating its own samples, or `padding` when it drew nothing.
DrawnBatch DrawBatch(echopipe::EchoCache& cache, int batch_size, const SampleCopy* padding,
                     const std::string& cache_name,
                     const std::function<void()>& between_attempts = {});

/// Fills `out` (num_fields + 1 descriptors) from a drawn batch; checks the fields agree.
void DescribeOutputs(const DrawnBatch& batch, const SampleCopy* padding, int num_fields,
                     std::vector<dali::OutputDesc>& out, const std::string& cache_name);

/// Keeps a host copy of the pass's first drawn sample as the padding template (see PaddingAge).
void UpdatePadding(const DrawnBatch& batch, std::shared_ptr<const SampleCopy>& padding,
                   PaddingAge& age);

/// The SourceState a source's SaveState put into `cpt` (a default one when it holds none).
SourceState SavedSourceState(const dali::OpCheckpoint& cpt);

/// Decodes a source's serialized state into `cpt`; a DALI error saying what is wrong.
void DeserializeSourceState(dali::OpCheckpoint& cpt, const std::string& data, int num_fields);

/// Host pointer and size of field `f` for output sample `i`.
const void* FieldData(const DrawnBatch& batch, const SampleCopy* padding, int i, int f,
                      size_t* nbytes);

/// Writes the info output: per sample int64 [valid, sample_id, emission].
void WriteInfo(const DrawnBatch& batch, int64_t* dst, int batch_size);

}  // namespace echopipe_dali
