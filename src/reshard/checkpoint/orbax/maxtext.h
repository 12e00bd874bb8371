// MaxText's model names and layouts: a MaxText checkpoint's Orbax arrays read as the Hugging
// Face tensors they hold, and Hugging Face tensors written as MaxText's arrays.
//
// MaxText (linen, scan_layers) saves its TrainState's params as the tree
//   params.params.token_embedder.embedding            [V, H]
//   params.params.decoder.decoder_norm.scale          [H]
//   params.params.decoder.logits_dense.kernel         [H, V]     (absent when tied)
//   params.params.decoder.layers.<leaf>               a layer's array with every layer stacked
//                                                     on axis 1 (param_scan_axis): [H, L],
//                                                     query [H, L, N, D], out [N, L, D, H]...
// or, without scan_layers, `params.params.decoder.layers_{l}.<leaf>` per layer. Kernels are
// [in, out] (the transpose of torch's Linear), attention's per head ([embed, heads, head_dim],
// out [heads, head_dim, embed]). The leaves and their layouts are a table of rules
// (maxtext_names.cc, from MaxText's own checkpoint conversion): each rule names the factors of
// both sides' dimensions, so that a MaxText array's box is one strided piece per run of factors
// of the Hugging Face tensor - a transpose, a reshape, the rotary pairs of Llama's query and key
// (MaxText's interleaved order is Hugging Face's half-split one: a stride permutation) are
// geometry. Llama's query kernel also carries attention's 1/sqrt(head_dim), which the pieces
// hold as their scale (the IR's shard = F * scale): exact where sqrt(head_dim) is a power of two,
// otherwise rounded, which the executor refuses unless a lossy scale is allowed. A value
// transform that is not a factor (Gemma's norm offset of 1, an embedding normalizer) is in no
// rule: those models are refused.
#ifndef RESHARD_CHECKPOINT_ORBAX_MAXTEXT_H_
#define RESHARD_CHECKPOINT_ORBAX_MAXTEXT_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/orbax/orbax.h"

namespace reshard {

/// The axis MaxText stacks a layer's arrays on (its param_scan_axis default).
inline constexpr size_t kMaxTextScanAxis = 1;

/// Where MaxText's model tree lies in the arrays reshard writes (a TrainState's params, which
/// MaxText's load_parameters_path restores).
inline constexpr char kMaxTextRoot[] = "params.params.";

/// What the layout table needs of a model's config.json.
struct MaxTextModelConfig {
  std::string model_type;
  Index layers = 0;    // num_hidden_layers
  Index hidden = 0;    // hidden_size
  Index heads = 0;     // num_attention_heads
  Index kv_heads = 0;  // num_key_value_heads (default: heads)
  Index head_dim = 0;  // head_dim (default: hidden_size / heads)
  Index ffn = 0;       // intermediate_size
  Index vocab = 0;     // vocab_size
  bool tie_word_embeddings = false;
};

/// Reads the fields above from config.json text (`what` names it in errors). InvalidArgument for
/// malformed JSON, a missing or non-positive size, an odd head_dim; FailedPrecondition for a
/// model_type no rule is for (the message lists those that are) or mixture-of-experts fields.
Result<MaxTextModelConfig> ParseMaxTextModelConfig(std::string_view json, std::string_view what);

/// One factor of a MaxText dimension: its size, how far one step of it moves along that
/// dimension (the product of the factors after it), and its stride (elements) in the row-major
/// Hugging Face tensor.
struct MaxTextFactor {
  Index size = 0;
  Index inner = 1;
  Index hf_stride = 0;
};

/// One Hugging Face tensor of the model and where MaxText holds it.
struct MaxTextTensor {
  std::string hf_name;
  Shape hf_shape;
  std::string leaf;   // MaxText's path after the model root or the layer's prefix
  Index layer = -1;   // the decoder layer, or -1 for a model-scope tensor
  Shape layer_shape;  // the MaxText array of one layer
  /// Per dimension of layer_shape, its factors (row-major within the dimension).
  std::vector<std::vector<MaxTextFactor>> factors;
  double scale = 1.0;  // MaxText holds the Hugging Face value times this
};

/// Every Hugging Face tensor of the model `config` describes, in the table's order, layer by
/// layer.
std::vector<MaxTextTensor> MaxTextTensors(const MaxTextModelConfig& config);

/// The Hugging Face tensors of the MaxText model in `ckpt` as a source over its devices (world
/// size = the checkpoint's): each tensor's map puts, for every device, the part of its array's
/// box in the tensor's layer into that device's shard, as the table lays it out; layout
/// DcpDefaultLayout. The model tree is found under any root (`params.params.` as MaxText saves
/// it); arrays outside it (`step`, the optimizer's state) are left out. FailedPrecondition naming
/// them for arrays in the tree that no rule names (or that the config does not have: a
/// logits_dense of a tied model), a tensor whose array is missing, an array whose shape is not
/// the config's (both shown, with the config fields they come from), or a dtype that differs
/// between a stacked array's layers.
Result<std::unique_ptr<ShardSource>> MaxTextSourceOf(std::shared_ptr<const OrbaxCheckpoint> ckpt,
                                                     const MaxTextModelConfig& config);

/// The Hugging Face tensors of `hf` as MaxText's arrays, named `root` + MaxText's path, every
/// layer stacked on kMaxTextScanAxis: each array a parameter whose map puts layer l's Hugging
/// Face tensor (rebuilt from `hf`'s shards) into rank l's shard, at world size = the layers.
/// FailedPrecondition naming them for a tensor of `hf` that the table does not name, a tensor of
/// the model that `hf` lacks, a shape that is not the config's, or layers of different dtypes.
Result<std::unique_ptr<ShardSource>> MaxTextViewOf(std::shared_ptr<ShardSource> hf,
                                                   const MaxTextModelConfig& config,
                                                   std::string_view root = kMaxTextRoot);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_ORBAX_MAXTEXT_H_
