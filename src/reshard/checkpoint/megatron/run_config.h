// Megatron-Bridge's run_config.yaml: the PEFT section that a LoRA adapter's dist-ckpt needs.
//
// Megatron-Bridge writes the whole ConfigContainer of a run beside every checkpoint it saves
// (`iter_{N:07d}/run_config.yaml`, PyYAML's safe_dump: block style, keys sorted, two-space
// indent, list items at their key's indent). A PEFT run's `peft:` section names the adapter's
// class and its hyperparameters:
//
//   peft:
//     _target_: megatron.bridge.peft.lora.LoRA
//     alpha: 32
//     dim: 16
//     dropout: 0.0
//     target_modules:
//     - linear_qkv
//     ...
//
// The adapter's tensors do not record alpha (the scaling is alpha / dim), so a gather needs
// this section. Only the `peft:` section is read, and of it only the scalars below: the reader
// takes the block form PyYAML writes (and flow lists), not YAML at large.
#ifndef RESHARD_CHECKPOINT_MEGATRON_RUN_CONFIG_H_
#define RESHARD_CHECKPOINT_MEGATRON_RUN_CONFIG_H_

#include <string>
#include <string_view>

#include "reshard/base/index.h"
#include "reshard/base/result.h"

namespace reshard {

inline constexpr char kMegatronBridgeRunConfigName[] = "run_config.yaml";

/// The PEFT section of a Megatron-Bridge run_config.yaml.
struct MegatronPeftConfig {
  std::string target;  // `_target_`: the PEFT class ("megatron.bridge.peft.lora.LoRA")
  Index dim = 0;       // the LoRA rank
  double alpha = 0;    // scaling = alpha / dim
  double dropout = 0;
};

/// Reads the `peft:` section of run_config.yaml text (`what` names the file in errors).
/// \error InvalidArgument  no `peft:` section, or `peft: null` (the run trained no adapter);
///        `dim` or `alpha` missing or not a positive number; a line of the section that is not
///        `key: value` in PyYAML's block form.
Result<MegatronPeftConfig> ParseMegatronPeftConfig(std::string_view yaml, std::string_view what);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_MEGATRON_RUN_CONFIG_H_
