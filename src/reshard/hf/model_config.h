// Reading what the degree planner needs from transformers' configuration files: a model's
// config.json (the model type and the counts the plan splits, with the config class's
// defaults), the dict form of its DistributedConfig, and release numbers.
//
// Both JSON documents are untrusted: malformed JSON, duplicate keys, trailing bytes, a count of
// the wrong type, out of range, or zero / null where the model cannot have one are refused
// (InvalidArgument naming the key) rather than answered for.
#ifndef RESHARD_HF_MODEL_CONFIG_H_
#define RESHARD_HF_MODEL_CONFIG_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/hf/registry.h"

namespace reshard {

/// A release number, compared component-wise ("5.15" == "5.15.0").
struct Version {
  int major = 0, minor = 0, patch = 0;
  friend auto operator<=>(const Version&, const Version&) = default;
};
/// "5", "5.15", "5.15.1", tolerating a suffix such as ".dev0" or "rc1". InvalidArgument else.
Result<Version> ParseVersion(std::string_view text);

/// The dict form of transformers' DistributedConfig, as far as the degree depends on it.
struct DistributedConfig {
  std::optional<int64_t> tp_size;
  std::optional<int64_t> ep_size;
  std::optional<int64_t> fsdp_size;
  bool enable_expert_parallel = false;
  /// tp_plan given ("auto" or an object): transformers then takes tp_size from the number of
  /// processes when tp_size is not given; without either it takes tp_size = 1.
  bool tp_plan_given = false;
  /// Overrides merged into the model's plans; an empty tp_plan applies no TP rule.
  std::optional<Plan> tp_plan;
  std::optional<Plan> ep_plan;
  /// Keys given with a value other than their default that change how transformers lays the
  /// model out in ways the degree answer reads (fsdp_size) but maps do not express ("fsdp_size
  /// 2", "pp_size 2", "enable_sequence_parallel true", ...).
  std::vector<std::string> not_laid_out;

  bool expert_parallel() const { return enable_expert_parallel || ep_size.value_or(1) > 1; }
};

/// Parses the JSON object form. Keys outside `registry.distributed_config_keys` are refused
/// (InvalidArgument naming them and the accepted keys) rather than dropped.
Result<DistributedConfig> ParseDistributedConfigJson(const TpRegistry& registry,
                                                     std::string_view text);

/// A config.json read against the registry: the model type and the count keys, defaults
/// applied. Values are integers (booleans 0/1); nullopt where the config derives the value.
/// `dtype_bytes` holds the element size of the config's `dtype` (or `torch_dtype`) when it
/// names a floating-point type (a sub-config without its own takes the top level's).
struct ModelConfig {
  std::string model_type;
  const ModelTypeInfo* info = nullptr;  // null: transformers has no plan for this model type
  std::map<std::string, std::optional<int64_t>> values;
  /// Composite models: the text sub-config, read the same way (empty model_type if none).
  std::string text_model_type;
  const ModelTypeInfo* text_info = nullptr;
  std::map<std::string, std::optional<int64_t>> text_values;
  /// The FP8 block [rows, columns] of a block-quantized checkpoint (quantization_config
  /// weight_block_size, hf/quantization.h); empty when it is not one.
  std::vector<int64_t> fp8_block;
  /// Whether the quantization_config says MXFP4 (quant_method "mxfp4": gpt-oss's experts).
  bool mxfp4 = false;
};

/// InvalidArgument for malformed JSON, a missing model_type, or a count key of the wrong type.
Result<ModelConfig> ReadModelConfigJson(const TpRegistry& registry, std::string_view text);

/// The value of `key` in a config's values (nullopt when absent or derived).
std::optional<int64_t> ConfigValue(const std::map<std::string, std::optional<int64_t>>& values,
                                   std::string_view key);

}  // namespace reshard

#endif  // RESHARD_HF_MODEL_CONFIG_H_
