// What a gather writes (gather.cc), which a dequantized view (dequantized_view.cc) reads
// too: every parameter as it is, or a block-quantized tensor dequantized to numbers.
// Internal to the checkpoint library.
#ifndef RESHARD_CHECKPOINT_GATHER_H_
#define RESHARD_CHECKPOINT_GATHER_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/sharded_io.h"
#include "reshard/exec/dequantize.h"

namespace reshard::internal {

// A tensor a gather writes: one parameter rebuilt as it is, or a dequantized one (its data
// and scales rebuilt, then dequantized).
struct GatherOutput {
  std::string name;
  DType dtype;
  Shape shape;
  size_t param = 0;
  // Dequantized outputs only:
  std::optional<size_t> scales;
  std::optional<size_t> global;  // a per-tensor second-level scale (NVFP4's weight_scale_2)
  DequantizeSpec spec;
  bool mxfp4 = false;  // written [E, G * 32, R] as transformers holds gpt-oss's experts
};

// A rebuilt parameter in memory of its own (uninitialised).
struct Rebuilt {
  std::unique_ptr<std::byte[]> bytes;
  size_t size = 0;
  std::span<std::byte> span() { return {bytes.get(), size}; }
};

// What a gather writes: every parameter as it is, or, dequantizing, each quantized tensor as
// numbers and no scales.
Result<std::vector<GatherOutput>> GatherOutputs(const Manifest& m,
                                                const CheckpointOptions& options);

// Writes a dequantized output into `buffer`.
Status FillDequantized(ShardSource& source, const GatherOutput& o, const CheckpointOptions& options,
                       std::span<std::byte> buffer, Counters& counters);

}  // namespace reshard::internal

#endif  // RESHARD_CHECKPOINT_GATHER_H_
