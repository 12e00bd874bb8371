// Megatron-Core dist-ckpt with the torch_dist backend, read as Hugging Face tensors.
//
// A torch_dist checkpoint is a DCP checkpoint (checkpoint/dcp/dcp.h: `.metadata`,
// `__{r}_{n}.distcp`) plus `metadata.json` ({"sharded_backend": "torch_dist", ...}) and the
// common state (bytes items, or a legacy `common.pt`: pickles, never loaded). Its keys are
// Megatron's module paths:
//   embedding.word_embeddings.weight  [Vp, H]    (the vocabulary padded to Vp >= V)
//   output_layer.weight               [Vp, H]    (absent when tied to the embedding)
//   decoder.final_layernorm.weight    [H]
//   decoder.layers.<leaf>             [L, ...]   every layer stacked (homogeneous layers), or
//   decoder.layers.{l}.<leaf>         [...]      one key per layer (MoE and dense layers mixed)
//   .. mlp.experts.experts.<leaf>     [.., E, ...] experts stacked, or
//   .. mlp.experts.experts.{e}.<leaf> one key per expert (singleton local shards)
// with `linear_qkv` interleaved per query group ([q1 .. qn k v] rows for each of G groups, n =
// heads / G, each head_dim rows) and a SwiGLU `linear_fc1` holding every gate row then every up
// row. Which Hugging Face tensor each key holds is a declarative name table
// (megatron_names.cc: Llama-, Qwen- and Mixtral/DeepSeek-style models); the shapes that the
// split needs (heads, query groups, head_dim, the MLP widths, experts) come from the model's
// config.json, which the checkpoint does not carry.
//
// Megatron-Bridge's PEFT save holds a run's LoRA adapters alone, under the keys of the layers
// they wrap (`<layer>.adapter.linear_in.weight`: A [r, in]; `<layer>.adapter.linear_out.weight`:
// B [out, r]), at the training TP: for a column-parallel layer (linear_qkv, linear_fc1) A is
// split along r and B along its rows, for a row-parallel one (linear_proj, linear_fc2) A along
// its columns and B along its rows; dist-ckpt records each as one global tensor. Such a
// checkpoint is read as a PEFT adapter: `base_model.model.<HF module>.lora_A.weight` and
// `.lora_B.weight`, linear_qkv's B split into q, k and v as its weight is, linear_fc1's into
// gate and up, and the fused layer's A given to each of its projections. Its rank and alpha come
// from the run_config.yaml Megatron-Bridge writes beside it (megatron/run_config.h).
//
// In IR terms (DESIGN 16) every Hugging Face tensor is a parameter whose map puts its pieces into
// the Megatron tensors' rank shards, which are buffers named by their Megatron key: the source's
// manifest lists HF tensors with buffered maps over the DCP ranks, the buffer set validated
// exact (every element of every Megatron tensor goes to exactly one HF tensor, or is vocabulary
// padding), so gather and convert work on it unchanged.
#ifndef RESHARD_CHECKPOINT_MEGATRON_MEGATRON_H_
#define RESHARD_CHECKPOINT_MEGATRON_MEGATRON_H_

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/megatron/regions.h"
#include "reshard/checkpoint/megatron/run_config.h"
#include "reshard/layouts/parallel_run.h"

namespace reshard {

inline constexpr char kMegatronMetadataName[] = "metadata.json";

/// Whether `path` holds a Megatron-Core dist-ckpt: a directory with a `metadata.json` that
/// names a `sharded_backend`, or a training save dir whose `latest_checkpointed_iteration.txt`
/// names an `iter_*` directory that does.
bool IsMegatronCheckpoint(const std::string& path);

/// The checkpoint directory `path` names: `path` itself, or the iteration a training save dir's
/// `latest_checkpointed_iteration.txt` names (`iter_0000100`). NotFound when neither holds a
/// metadata.json.
Result<std::string> MegatronCheckpointDir(const std::string& path);

/// What the name table needs of a model's config.json.
struct MegatronModelConfig {
  std::string model_type;
  Index layers = 0;      // num_hidden_layers
  Index hidden = 0;      // hidden_size
  Index heads = 0;       // num_attention_heads
  Index kv_heads = 0;    // num_key_value_heads (default: heads): Megatron's query groups
  Index head_dim = 0;    // head_dim (default: hidden / heads): Megatron's kv_channels
  Index ffn = 0;         // intermediate_size
  Index vocab = 0;       // vocab_size
  Index experts = 0;     // num_local_experts / num_experts / n_routed_experts (0: dense)
  Index moe_ffn = 0;     // moe_intermediate_size (default: intermediate_size)
  Index shared_ffn = 0;  // shared_expert_intermediate_size, or moe_ffn * n_shared_experts
  std::optional<bool> tie_word_embeddings;
  // Which layers are MoE layers (IsMoeLayer): none without experts; else every layer but
  // Qwen-MoE's mlp_only_layers, those off its decoder_sparse_step, and DeepSeek's first
  // first_k_dense_replace layers and those off its moe_layer_freq.
  std::vector<Index> mlp_only_layers;
  Index sparse_step = 1;  // decoder_sparse_step
  Index first_dense = 0;  // first_k_dense_replace
  Index moe_freq = 1;     // moe_layer_freq
  /// The rank of the LoRA adapters a checkpoint holds (0: none); not from config.json.
  Index lora_rank = 0;
};

/// Whether the model config.json describes has experts in layer `layer` (as transformers builds
/// the model: fields above).
bool IsMoeLayer(const MegatronModelConfig& config, Index layer);

/// Reads the fields above from config.json text (`what` names it in errors). InvalidArgument
/// for malformed JSON, a missing or non-positive size, heads not a multiple of the key/value
/// heads.
Result<MegatronModelConfig> ParseMegatronModelConfig(std::string_view json, std::string_view what);

/// One Hugging Face tensor held by a Megatron tensor: its name and shape, and the region of the
/// Megatron tensor that it is.
struct MegatronPart {
  std::string name;
  Shape shape;
  TensorRegion region;
  /// 0, or k > 0 for the k-th further tensor that holds the same elements (the A of each
  /// projection of a fused layer's adapter): each copy reads buffers of its own.
  int copy = 0;
};

/// Whether Megatron key `key` is a LoRA adapter's tensor (Megatron-Bridge: "<layer>.adapter.").
bool IsMegatronAdapterKey(std::string_view key);

/// What a Megatron tensor holds under the name table and the config.
struct MegatronKeyParts {
  std::vector<MegatronPart> parts;
  /// Rows [padding_from, rows) of dim 0 are vocabulary padding (no HF tensor holds them);
  /// nullopt: none.
  std::optional<Index> padding_from;
  /// The tensor is left out (an output layer tied to the embedding).
  bool skipped = false;
};

/// The HF tensors of Megatron key `key` (global shape `shape`). InvalidArgument naming the key
/// for a key the name table does not know, a shape the config does not give (the message shows
/// both and the config fields it came from), a layer or expert index beyond the config's.
Result<MegatronKeyParts> MegatronPartsOf(const MegatronModelConfig& config, std::string_view key,
                                         const Shape& shape);

/// A box of a Megatron tensor that a rank of a live model holds (a ShardedTensor of its
/// `sharded_state_dict()`), and the rank tensor it lies in.
struct MegatronLiveShard {
  std::string key;  // the Megatron tensor (the ShardedTensor's key)
  Shape shape;      // its global shape, stacked dims included
  DType dtype = DType::kF32;
  Rank rank = 0;
  Shape offsets;  // the box: one entry per dim of `shape`
  Shape sizes;
  std::string buffer;         // the rank tensor holding the box, row-major
  Index buffer_elements = 0;  // that tensor's elements
  Index buffer_offset = 0;    // where the box's first element lies in it
};

/// The Hugging Face tensors of a live model over its ranks' Megatron tensors: every HF tensor a
/// parameter whose map, over `world` ranks, puts its pieces into the buffers the shards name
/// (one buffer per name, each rank's shape that rank's tensor, flat), the same name table as
/// OpenMegatronSource. A box several ranks hold (replicas) is one piece they all hold.
/// InvalidArgument naming the key for a key the table does not know, shards of one key that
/// disagree on its shape or dtype, a model the shards do not hold whole (`what` names them in
/// messages); FailedPrecondition when the maps do not fill the buffers exactly.
Result<Manifest> MegatronLiveManifest(const MegatronModelConfig& config,
                                      std::span<const MegatronLiveShard> shards, int world,
                                      std::string_view what);

struct MegatronSourceOptions {
  /// The model's config.json (its text) and its path (an input the output may not replace).
  std::string config_json;
  std::string config_path;
  /// Read the distributed optimizer's state too (fully_reshardable: each state a tensor of its
  /// parameter's shape), each Hugging Face tensor's as "<name>.fp32" (the fp32 main weight),
  /// "<name>.exp_avg" and "<name>.exp_avg_sq".
  bool optimizer_state = false;
  /// Where to put the run that wrote it (MegatronRunOf), when not null.
  ParallelRun* run = nullptr;
  /// With optimizer_state: take a parameter the optimizer holds none of the state of while it
  /// holds the others' (a frozen one) as its weight alone. Otherwise such a parameter is
  /// refused (InvalidArgument naming it): a gather or convert of the optimizer's state would
  /// write it without any.
  bool stateless_parameters = false;
  /// Where to put the PEFT config of a checkpoint of LoRA adapters (its run_config.yaml's
  /// peft: section), when not null; left unset for a checkpoint of the model's weights.
  std::optional<MegatronPeftConfig>* peft = nullptr;
};

/// The checkpoint in `path` (see MegatronCheckpointDir) as a source of Hugging Face tensors
/// (names, shapes and dtypes as transformers loads them; the optimizer state left out unless
/// `options.optimizer_state`), world size = the ranks that wrote it. InvalidArgument for a
/// backend other than torch_dist, no config, a config that disagrees with the checkpoint's
/// shapes, a model the checkpoint does not hold whole (a layer, an expert or the output layer
/// missing), or optimizer state asked for in a layout reshard does not read or not whole.
/// A checkpoint of Megatron-Bridge LoRA adapters (IsMegatronAdapterKey) is read as a PEFT
/// adapter's tensors, its rank and alpha from run_config.yaml; InvalidArgument also for one
/// without a run_config.yaml peft: section, a rank that disagrees with the tensors, and a
/// checkpoint that holds the model's weights beside the adapters; DataLoss for a module with A
/// or B alone; FailedPrecondition for an adapter kind the name table cannot map (DoRA's
/// weight_magnitude, CanonicalLoRA's per-projection adapters, experts' adapters) naming the
/// tensor, or a PEFT class other than LoRA in run_config.yaml. An adapter checkpoint's
/// optimizer state is never read (a PEFT adapter keeps none).
Result<std::unique_ptr<ShardSource>> OpenMegatronSource(const std::string& path,
                                                        const MegatronSourceOptions& options);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_MEGATRON_MEGATRON_H_
