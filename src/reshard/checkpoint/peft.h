// PEFT LoRA adapters on disk: a directory of adapter_config.json and adapter_model.safetensors.
//
// An adapter's tensors are named after the base model's modules:
//   base_model.model.M.lora_A.weight      [r, in]     (a Linear, or a Conv1D with
//   base_model.model.M.lora_B.weight      [out, r]     fan_in_fan_out, whose weight is [in, out])
//   base_model.model.M.lora_embedding_A   [r, vocab]  (an Embedding: weight [vocab, dim])
//   base_model.model.M.lora_embedding_B   [dim, r]
//   base_model.model.M.weight, M.base_layer.weight    a whole copy of the base's M.weight
//                                                      (modules_to_save, saved embeddings)
// and W + scaling * B @ A (transposed for an embedding and for fan_in_fan_out) is the merged
// weight, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
#ifndef RESHARD_CHECKPOINT_PEFT_H_
#define RESHARD_CHECKPOINT_PEFT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/map_json.h"

namespace reshard {

inline constexpr char kAdapterConfigName[] = "adapter_config.json";
inline constexpr char kAdapterWeightsName[] = "adapter_model.safetensors";

/// What reshard reads of adapter_config.json.
struct LoraConfig {
  int64_t r = 0;
  double alpha = 0;
  bool use_rslora = false;
  bool use_dora = false;
  bool lora_bias = false;
  bool fan_in_fan_out = false;
  /// target_modules: a list of module names, or one regular expression (then in
  /// `target_regex`).
  std::vector<std::string> target_modules;
  std::string target_regex;
  /// Whether target_modules is given at all (null or absent: which modules the adapter adapts
  /// is not recorded, and no tensor is checked against it).
  bool has_targets = false;
  /// exclude_modules: a list of module names, or one regular expression (then in
  /// `exclude_regex`).
  std::vector<std::string> exclude_modules;
  std::string exclude_regex;
  /// layers_to_transform (empty: every layer) and layers_pattern (empty: any).
  std::vector<int64_t> layers_to_transform;
  std::vector<std::string> layers_pattern;
  std::vector<std::string> modules_to_save;
  /// Whether rank_pattern or alpha_pattern give some modules another r or alpha.
  bool has_patterns = false;

  /// lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
  double Scaling() const;
  /// "alpha/r" or "alpha/sqrt(r)".
  std::string_view ScalingRule() const;
};

/// Parses adapter_config.json. \error InvalidArgument  not JSON, not a LoRA adapter
/// (peft_type), or r / lora_alpha missing or not positive numbers.
Result<LoraConfig> ParseLoraConfigJson(std::string_view text);

/// Whether `dir` holds adapter_config.json and adapter_model.safetensors.
bool IsPeftAdapterDir(const std::string& dir);

/// The part of a LoRA pair, or a whole copy of a base tensor.
enum class LoraPart { kA, kB, kEmbeddingA, kEmbeddingB, kBaseCopy };

/// An adapter tensor's module and the base weight it belongs to.
struct LoraTensorName {
  std::string module;  // "model.layers.0.self_attn.q_proj"
  std::string base;    // "model.layers.0.self_attn.q_proj.weight"
  LoraPart part = LoraPart::kA;
};

/// The module and base weight of an adapter tensor; nullopt for a name outside
/// base_model.model. or a LoRA tensor reshard does not lay out (lora_B.bias, DoRA's
/// lora_magnitude_vector).
std::optional<LoraTensorName> ParseLoraTensorName(std::string_view name);

/// The dimension of a LoRA tensor that runs along dimension `base_dim` of its 2-D base weight
/// (the other one is r), or nullopt when it runs along none (A along the weight's output, B
/// along its input). `fan_in_fan_out`: the base weight is stored [in, out].
std::optional<int> LoraDimAlong(LoraPart part, int base_dim, bool fan_in_fan_out);

/// Whether PEFT puts a LoRA layer on module `module` ("model.layers.0.self_attn.q_proj") under
/// `config`, as PEFT selects modules: not excluded (exclude_modules; modules_to_save, which
/// PEFT never adapts), and named by target_modules (a name equal to the module or ending it
/// after a dot, with layers_to_transform counting the module's layer; or a regular expression
/// matching the whole name). True when the config records no target_modules.
/// \error FailedPrecondition  a regular expression of the config that std::regex cannot read
///        (it reads ECMAScript, which PEFT's configs' expressions are written in).
Result<bool> LoraTargetsModule(const LoraConfig& config, const std::string& module);

/// Checks the tensors of an adapter (name, shape) against its config: every LoRA tensor's r
/// is the config's, A and B of a module agree, no module has one without the other or two of
/// either, every pair is of a module the config targets (PEFT would not load another), and no
/// base weight has two whole copies.
/// \error FailedPrecondition  DoRA, lora_bias, rank or alpha patterns, a tensor reshard cannot
///        lay out, a pattern that cannot be read; DataLoss  an r that disagrees, a pair that
///        does not match, a module twice, a module the config does not target (naming the
///        tensor).
Status CheckLoraTensors(const LoraConfig& config,
                        const std::vector<std::pair<std::string, Shape>>& tensors);

/// The base weight's shape a module's A and B imply ([out, in]; [in, out] with
/// fan_in_fan_out; [vocab, dim] for an embedding).
Shape LoraBaseShape(LoraPart a_part, const Shape& a_shape, const Shape& b_shape,
                    bool fan_in_fan_out);

/// One adapter tensor to lay out (LoraMapsFromBase): its name, dtype and shape.
struct LoraTensorToLay {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

/// The maps of an adapter's tensors derived, piece by piece, from the maps of their base
/// weights in `base` (a map document over the base model's tensors, such as vLLM's layout,
/// whose fused parameters are buffers), with the buffers they fill (DESIGN 23).
///
/// Every piece of a base weight W on rank j must be a box of W's rows and columns written as a
/// box into a 2-D rank tensor (W's own shard, or a buffer). A tensor T of the pair holds, for
/// each such piece, its elements along the dimension T shares with W (B's rows for W's rows,
/// A's columns for W's columns; LoraDimAlong) over the whole of r, at the same place along that
/// dimension of T's rank tensor. So a column-parallel W gives B its rows and A whole, a
/// row-parallel W gives A its columns and B whole. Where W's pieces on a rank fill only part
/// of a buffer along the shared dimension (vLLM's qkv_proj stacks q, k and v as rows), T goes
/// into the matching adapter buffer, named after W's buffer with T's suffix
/// ("base_model.model.M.qkv_proj.lora_B.weight"): the Bs of the fused weights stacked on each
/// rank as the weights' rows are; rows no adapter tensor fills (a weight the adapter does not
/// target) are its padding, zero. Otherwise T is its own shard. A whole copy of a base weight
/// takes W's map (W's buffers, renamed under "base_model.model.").
/// \error FailedPrecondition  a tensor whose base weight `base` lacks, a piece that is no box
///        of rows and columns, a rank tensor that is not 2-D (stacked experts), layouts that
///        do not make an exact map (naming the tensor and the rank).
Result<MapDocument> LoraMapsFromBase(const std::vector<LoraTensorToLay>& tensors,
                                     bool fan_in_fan_out, const MapDocument& base);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_PEFT_H_
