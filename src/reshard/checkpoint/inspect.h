// What a tensor file or checkpoint directory holds, before anything is loaded (`reshard
// inspect`, `reshard.checkpoint.inspect`).
//
// A file is a torch.save file (.pt/.pth/.bin: its tensors, storages and object tree, read
// without running its pickle) or a safetensors file (its header). A directory is listed file by
// file (every .pt/.pth/.bin/.safetensors in it, in name order, not recursive), with a model
// view where it is one checkpoint: a reshard sharded checkpoint (reshard.json, every file
// checked as the checkpoint commands check it) or a Hugging Face one (config.json beside
// model.safetensors or its index); a DeepSpeed save dir is read through the tag its `latest`
// names, with a summary of the training checkpoint.
#ifndef RESHARD_CHECKPOINT_INSPECT_H_
#define RESHARD_CHECKPOINT_INSPECT_H_

#include <functional>
#include <map>
#include <string>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint.h"

namespace reshard {

enum class InspectFormat {
  kText,  // for a person: one line per tensor
  kJson,  // one JSON object, 2-space indented (docs/formats.md, "reshard inspect --json")
};

/// The block-quantized pairs of a Hugging Face directory (its config.json's quantization_config):
/// the ties by scale tensor name. The caller gives it (hf/checkpoint_maps.h: BlockScalesOfDir,
/// which sits above this library); an error is reported in the output, not raised.
using QuantizedPairs =
    std::function<Result<std::map<std::string, BlockScales>>(const std::string& dir)>;

/// The report on the file or directory at `path`, as `reshard inspect` prints it (ending in a
/// newline); a Hugging Face directory's scale tensors are marked with their data tensors and
/// blocks when `pairs` is given. \error NotFound for a missing path; DataLoss or
/// InvalidArgument naming the file for one that is corrupt or of no known format.
Result<std::string> Inspect(const std::string& path, InspectFormat format,
                            const QuantizedPairs& pairs = {});

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_INSPECT_H_
