// The tensors of a model as a trainer and inference engines hold them, from its config.json,
// and their maps over a parallel grid (DESIGN.md 21): what `reshard sync-plan --config` plans.
//
// The layouts are Megatron-Core's and vLLM's tensor parallelism (not transformers', whose plan
// leaves DeepSeek's attention whole): q/k/v, gate/up and MLA's q_b_proj / kv_b_proj split their
// output rows by heads (rows), o_proj and down_proj their input columns, the embedding and the
// LM head their vocabulary rows; norms, routers and MLA's down-projections (q_a_proj,
// kv_a_proj_with_mqa) are replicated. When a head count is smaller than the degree, groups of
// ranks share a head (a replicated piece). Routed experts are one stacked tensor per layer and
// projection ([E, rows, cols], `mlp.experts.gate_proj` etc.): expert parallelism gives each EP
// rank a contiguous block of experts, and tensor parallelism splits each expert as the dense
// projection of the same name.
//
// The grid is Megatron's: rank = tp_rank + tp * (ep_rank + ep * pp_stage). Every tensor of a
// decoder layer lives on one pipeline stage (layer l of L on stage floor(l * pp / L)), the
// embedding on the first, the final norm and LM head on the last; tensors outside the experts
// are replicated over the EP ranks (expert parallelism runs over the data-parallel ranks).
#ifndef RESHARD_SCHED_FLEET_MODEL_H_
#define RESHARD_SCHED_FLEET_MODEL_H_

#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// One tensor of the model as it is synchronised.
struct ModelTensor {
  std::string name;
  Shape shape;
  /// Bytes of one element as the engines hold it (and as it crosses the links).
  Index element_bytes = 2;
  /// The dimension tensor parallelism splits, or -1 (replicated).
  int split_dim = -1;
  /// The units the split goes by (heads, or rows): split_dim's extent is a multiple of them.
  Index split_units = 0;
  /// Dimension 0 is the expert dimension (expert parallelism splits it).
  bool experts = false;
  /// The decoder layer, or -1 for the embedding (first stage), -2 for the final norm and LM
  /// head (last stage).
  int layer = -1;
  Index num_elements() const { return ProductOf(shape); }
};

struct ModelSpec {
  std::string model_type;
  int num_layers = 0;
  std::vector<ModelTensor> tensors;
  Index num_bytes() const;
  Index num_elements() const;
};

/// The element format of the weights synchronised into the engines.
enum class SyncFormat {
  kBf16,  // every tensor 2 bytes per element
  /// FP8 block-quantized as DeepSeek-V3 ships it: linear weights 1 byte per element, each with
  /// a `weight_scale_inv` of fp32 scales per 128x128 block (the config's weight_block_size),
  /// split with its weight; embeddings, LM head, norms and routers stay BF16.
  kFp8,
};

/// The model's tensors from its config.json: Llama-family dense models (llama, mistral,
/// qwen2, qwen3, ...), MoE models with stacked experts (mixtral, qwen3_moe, deepseek_v3 and
/// models of its shape) and DeepSeek's multi-head latent attention.
/// \error InvalidArgument  malformed config, a missing size, or a model type it cannot lay out.
Result<ModelSpec> ModelFromConfigJson(std::string_view config_json, SyncFormat format);

/// A parallel layout: tensor, pipeline and expert parallel degrees (engines: tp only).
struct GridLayout {
  int tp = 1;
  int pp = 1;
  int ep = 1;
  int world() const { return tp * pp * ep; }
};

/// Parses "tp=8,pp=8,ep=8" (any subset, any order; each degree a positive integer).
/// \error InvalidArgument  naming the part it cannot read.
Result<GridLayout> ParseGridLayout(std::string_view text);

/// The map of `tensor` over `grid` (world grid.world(), ranks in Megatron's order).
/// \error FailedPrecondition  a degree that does not divide what it splits (naming the
///        tensor, what it splits and both counts).
Result<ParamMap> GridMap(const ModelTensor& tensor, const GridLayout& grid, int num_layers);

}  // namespace reshard

#endif  // RESHARD_SCHED_FLEET_MODEL_H_
