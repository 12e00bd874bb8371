// Internal to the checkpoint readers' .cc files: what the formats that name and shape every
// tensor themselves (DCP, Orbax) refuse alike of a caller's options.
#ifndef RESHARD_CHECKPOINT_SELF_DESCRIBED_H_
#define RESHARD_CHECKPOINT_SELF_DESCRIBED_H_

#include <string>
#include <string_view>

#include "reshard/base/result.h"
#include "reshard/checkpoint/source.h"

namespace reshard::internal {

/// How a refusal names the format and what it stores: "a PyTorch Distributed Checkpoint" and
/// "tensors", "an Orbax checkpoint" and "arrays".
struct SelfDescribedFormat {
  std::string_view a_format;
  std::string_view items;
};

/// InvalidArgument, naming `path` and the format, for what such a source cannot give: DeepSpeed's
/// fp32 master weights, a config.json (it names and shapes its tensors itself), a distributed
/// config (the target layout comes as maps), a weights-only gather (a gather writes the model's
/// tensors only already) or optimizer state asked of a convert (a convert carries it already).
Status CheckSelfDescribedOptions(const std::string& path, const SourceOptions& options,
                                 SelfDescribedFormat format);

}  // namespace reshard::internal

#endif  // RESHARD_CHECKPOINT_SELF_DESCRIBED_H_
