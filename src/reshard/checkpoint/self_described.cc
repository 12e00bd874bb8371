#include "reshard/checkpoint/self_described.h"

#include <fmt/format.h>

namespace reshard::internal {

Status CheckSelfDescribedOptions(const std::string& path, const SourceOptions& options,
                                 SelfDescribedFormat format) {
  if (options.master_weights) {
    return InvalidArgumentError(fmt::format(
        "the fp32 master weights come from a DeepSpeed checkpoint's optimizer; \"{}\" is {}", path,
        format.a_format));
  }
  if (!options.config_path.empty()) {
    return InvalidArgumentError(
        fmt::format("\"{}\" is {}, which names and shapes its {} itself: it takes no config.json",
                    path, format.a_format, format.items));
  }
  if (!options.distributed_config.empty()) {
    return InvalidArgumentError(fmt::format(
        "a distributed config applies to a checkpoint scattered from a model's config.json; "
        "\"{}\" is {}: give the target layout as maps instead",
        path, format.a_format));
  }
  if (options.weights_only && options.use == SourceUse::kGather) {
    return InvalidArgumentError(fmt::format("a gather of {} writes the model's {} only already",
                                            format.a_format, format.items));
  }
  if (options.optimizer_state && options.use != SourceUse::kGather) {
    return InvalidArgumentError(
        "a convert carries the optimizer's state already (unless it is to leave it out)");
  }
  return Status::Ok();
}

}  // namespace reshard::internal
