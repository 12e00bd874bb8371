#include "reshard/sched/fleet_model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <optional>
#include <utility>

#include "reshard/base/json_reader.h"

namespace reshard {

namespace {

using json::Json;

constexpr Index kMaxDim = Index{1} << 40;

// The model types whose tensors the layout below is (names and shapes): refused otherwise,
// rather than laid out as a Llama.
constexpr std::string_view kModelTypes[] = {"llama",   "mistral",   "qwen2",       "qwen3",
                                            "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"};

// A config's sizes are claims: the most one copy of the model may weigh on the wire (16 TiB,
// eight times the largest open models in BF16), checked before anything is planned by them.
constexpr Index kMaxModelBytes = Index{1} << 44;

Status CheckModelType(const std::string& model_type, bool given) {
  for (std::string_view t : kModelTypes) {
    if (model_type == t) return Status::Ok();
  }
  const std::string known = fmt::format("{}", fmt::join(kModelTypes, ", "));
  if (!given) {
    return InvalidArgumentError(
        fmt::format("config.json: \"model_type\" is missing; sync-plan lays out {}", known));
  }
  return InvalidArgumentError(
      fmt::format("config.json: \"model_type\" {} is not a model sync-plan lays out ({})",
                  json::QuoteShort(model_type), known));
}

// One copy of the model within kMaxModelBytes (and every size within int64).
Status CheckModelBytes(const std::vector<ModelTensor>& tensors) {
  Index total = 0;
  for (const ModelTensor& t : tensors) {
    Result<Index> n = CheckedProduct(t.shape);
    std::optional<Index> bytes = n.ok() ? CheckedMul(*n, t.element_bytes) : std::optional<Index>();
    std::optional<Index> sum = bytes ? CheckedAdd(total, *bytes) : std::optional<Index>();
    if (!sum || *sum > kMaxModelBytes) {
      return InvalidArgumentError(fmt::format(
          "config.json: the model weighs more than 2^44 bytes (16 TiB) on the wire (at tensor "
          "\"{}\", [{}]): its sizes are not a model's",
          t.name, fmt::join(t.shape, ", ")));
    }
    total = *sum;
  }
  return Status::Ok();
}

// A positive integer member of the config, or `fallback` when absent or null.
Result<std::optional<Index>> OptionalSize(const Json& cfg, std::string_view key) {
  const Json* v = json::Find(cfg, key);
  if (v == nullptr || v->is_null()) return std::optional<Index>();
  RESHARD_ASSIGN_OR_RETURN(Index n, json::ReadInt(*v, key, {0, kMaxDim}));
  return std::optional<Index>(n);
}

Result<Index> RequiredSize(const Json& cfg, std::string_view key) {
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> v, OptionalSize(cfg, key));
  if (!v || *v < 1) {
    return InvalidArgumentError(fmt::format("config.json: \"{}\" is missing or not positive", key));
  }
  return *v;
}

// A member that, when given, must be a positive size (0 would lay out tensors of no rows).
Result<std::optional<Index>> PositiveIfGiven(const Json& cfg, std::string_view key) {
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> v, OptionalSize(cfg, key));
  if (v && *v < 1) {
    return InvalidArgumentError(fmt::format("config.json: \"{}\" is 0; expected at least 1", key));
  }
  return v;
}

struct Builder {
  SyncFormat format;
  Index block = 128;
  std::vector<ModelTensor> out;

  void Add(const std::string& name, const Shape& shape, int split_dim, Index units, int layer,
           bool experts = false, bool quantized = false) {
    ModelTensor t{name, shape, 2, split_dim, units, experts, layer};
    if (quantized && format == SyncFormat::kFp8) {
      t.element_bytes = 1;
      // The fp32 scales of the weight's 128x128 blocks, split along with it where the
      // degree keeps whole blocks, and replicated where it cannot.
      Shape scale = shape;
      const size_t n = scale.size();
      scale[n - 2] = (scale[n - 2] + block - 1) / block;
      scale[n - 1] = (scale[n - 1] + block - 1) / block;
      Index scale_units = 0;
      int scale_dim = -1;
      if (split_dim >= 0 && shape[static_cast<size_t>(split_dim)] % block == 0) {
        scale_dim = split_dim;
        scale_units = scale[static_cast<size_t>(split_dim)];
      }
      std::string scale_name = name.substr(0, name.size() - (name.ends_with(".weight") ? 7 : 0));
      out.push_back(t);
      out.push_back(ModelTensor{scale_name + ".weight_scale_inv", scale, 4, scale_dim, scale_units,
                                experts, layer});
      return;
    }
    out.push_back(t);
  }
};

// The attention tensors of one layer (prefix `a` ends in "self_attn.").
Status AddAttention(const Json& cfg, Builder& b, const std::string& a, int li, Index heads,
                    Index nkv, Index hd, Index hidden, std::optional<Index> kv_lora,
                    std::optional<Index> q_lora, bool attention_bias, bool qk_norm) {
  if (kv_lora) {  // multi-head latent attention
    RESHARD_ASSIGN_OR_RETURN(Index nope, RequiredSize(cfg, "qk_nope_head_dim"));
    RESHARD_ASSIGN_OR_RETURN(Index rope, RequiredSize(cfg, "qk_rope_head_dim"));
    RESHARD_ASSIGN_OR_RETURN(Index vd, RequiredSize(cfg, "v_head_dim"));
    if (q_lora && *q_lora > 0) {
      b.Add(a + "q_a_proj.weight", {*q_lora, hidden}, -1, 0, li, false, true);
      b.Add(a + "q_a_layernorm.weight", {*q_lora}, -1, 0, li);
      b.Add(a + "q_b_proj.weight", {heads * (nope + rope), *q_lora}, 0, heads, li, false, true);
    } else {
      b.Add(a + "q_proj.weight", {heads * (nope + rope), hidden}, 0, heads, li, false, true);
    }
    b.Add(a + "kv_a_proj_with_mqa.weight", {*kv_lora + rope, hidden}, -1, 0, li, false, true);
    b.Add(a + "kv_a_layernorm.weight", {*kv_lora}, -1, 0, li);
    b.Add(a + "kv_b_proj.weight", {heads * (nope + vd), *kv_lora}, 0, heads, li, false, true);
    b.Add(a + "o_proj.weight", {hidden, heads * vd}, 1, heads, li, false, true);
  } else {
    b.Add(a + "q_proj.weight", {heads * hd, hidden}, 0, heads, li, false, true);
    b.Add(a + "k_proj.weight", {nkv * hd, hidden}, 0, nkv, li, false, true);
    b.Add(a + "v_proj.weight", {nkv * hd, hidden}, 0, nkv, li, false, true);
    if (attention_bias) {
      b.Add(a + "q_proj.bias", {heads * hd}, 0, heads, li);
      b.Add(a + "k_proj.bias", {nkv * hd}, 0, nkv, li);
      b.Add(a + "v_proj.bias", {nkv * hd}, 0, nkv, li);
    }
    if (qk_norm) {
      b.Add(a + "q_norm.weight", {hd}, -1, 0, li);
      b.Add(a + "k_norm.weight", {hd}, -1, 0, li);
    }
    b.Add(a + "o_proj.weight", {hidden, heads * hd}, 1, heads, li, false, true);
  }
  return Status::Ok();
}

}  // namespace

Index ModelSpec::num_bytes() const {
  Index n = 0;
  for (const ModelTensor& t : tensors) n += t.num_elements() * t.element_bytes;
  return n;
}

Index ModelSpec::num_elements() const {
  Index n = 0;
  for (const ModelTensor& t : tensors) n += t.num_elements();
  return n;
}

Result<ModelSpec> ModelFromConfigJson(std::string_view config_json, SyncFormat format) {
  RESHARD_ASSIGN_OR_RETURN(Json cfg, json::ParseJson(config_json));
  if (!cfg.is_object()) return json::TypeError("config.json", "an object", cfg);
  ModelSpec spec;
  const Json* mt = json::Find(cfg, "model_type");
  if (mt != nullptr) {
    RESHARD_ASSIGN_OR_RETURN(spec.model_type, json::ReadString(*mt, "model_type"));
  }
  RESHARD_RETURN_IF_ERROR(CheckModelType(spec.model_type, mt != nullptr));
  RESHARD_ASSIGN_OR_RETURN(Index hidden, RequiredSize(cfg, "hidden_size"));
  RESHARD_ASSIGN_OR_RETURN(Index layers, RequiredSize(cfg, "num_hidden_layers"));
  RESHARD_ASSIGN_OR_RETURN(Index vocab, RequiredSize(cfg, "vocab_size"));
  RESHARD_ASSIGN_OR_RETURN(Index heads, RequiredSize(cfg, "num_attention_heads"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> kv_heads,
                           PositiveIfGiven(cfg, "num_key_value_heads"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> head_dim, PositiveIfGiven(cfg, "head_dim"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> inter, PositiveIfGiven(cfg, "intermediate_size"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> moe_inter,
                           OptionalSize(cfg, "moe_intermediate_size"));
  std::optional<Index> experts;
  for (const char* key : {"n_routed_experts", "num_local_experts", "num_experts"}) {
    RESHARD_ASSIGN_OR_RETURN(std::optional<Index> e, OptionalSize(cfg, key));
    if (e && *e > 0) {
      experts = e;
      break;
    }
  }
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> first_dense,
                           OptionalSize(cfg, "first_k_dense_replace"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> sparse_step,
                           OptionalSize(cfg, "decoder_sparse_step"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> shared, OptionalSize(cfg, "n_shared_experts"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> kv_lora, OptionalSize(cfg, "kv_lora_rank"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> q_lora, OptionalSize(cfg, "q_lora_rank"));
  bool tie = false;
  if (const Json* v = json::Find(cfg, "tie_word_embeddings"); v && !v->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(tie, json::ReadBool(*v, "tie_word_embeddings"));
  }
  bool attention_bias = spec.model_type == "qwen2" || spec.model_type == "qwen2_moe";
  if (const Json* v = json::Find(cfg, "attention_bias"); v && !v->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(attention_bias, json::ReadBool(*v, "attention_bias"));
  }
  Builder b{format, 128, {}};
  if (const Json* q = json::Find(cfg, "quantization_config"); q && q->is_object()) {
    if (const Json* wb = json::Find(*q, "weight_block_size"); wb && wb->is_array()) {
      RESHARD_ASSIGN_OR_RETURN(
          auto sizes,
          json::ReadIntArray(*wb, "quantization_config.weight_block_size", {1, 1 << 20}));
      if (sizes.size() != 2 || sizes[0] != sizes[1]) {
        return InvalidArgumentError(
            "config.json: quantization_config.weight_block_size must be "
            "two equal sizes");
      }
      b.block = sizes[0];
    }
  }
  const bool mixtral = spec.model_type == "mixtral";
  const bool qk_norm = spec.model_type == "qwen3" || spec.model_type == "qwen3_moe";
  if (mixtral && !inter)
    return InvalidArgumentError("config.json: \"intermediate_size\" is missing");
  const Index nkv = kv_heads.value_or(heads);
  const Index hd = head_dim.value_or(hidden / heads);
  if (hd < 1) {
    return InvalidArgumentError(fmt::format(
        "config.json: no \"head_dim\", and \"hidden_size\" {} is below \"num_attention_heads\" {}",
        hidden, heads));
  }
  const Index expert_inter = mixtral ? inter.value_or(0) : moe_inter.value_or(inter.value_or(0));
  std::vector<Index> mlp_only;
  if (const Json* v = json::Find(cfg, "mlp_only_layers"); v && v->is_array()) {
    RESHARD_ASSIGN_OR_RETURN(mlp_only, json::ReadIntArray(*v, "mlp_only_layers", {0, kMaxDim}));
  }
  b.Add("model.embed_tokens.weight", {vocab, hidden}, 0, vocab, -1);
  for (Index l = 0; l < layers; ++l) {
    const int li = static_cast<int>(l);
    const std::string p = fmt::format("model.layers.{}.", l);
    b.Add(p + "input_layernorm.weight", {hidden}, -1, 0, li);
    b.Add(p + "post_attention_layernorm.weight", {hidden}, -1, 0, li);
    RESHARD_RETURN_IF_ERROR(AddAttention(cfg, b, p + "self_attn.", li, heads, nkv, hd, hidden,
                                         kv_lora, q_lora, attention_bias, qk_norm));
    bool moe = experts.has_value();
    if (moe && first_dense && l < *first_dense) moe = false;
    if (moe && sparse_step && *sparse_step > 1 && (l + 1) % *sparse_step != 0) moe = false;
    for (Index m : mlp_only) moe = moe && m != l;
    if (!moe) {
      if (!inter) return InvalidArgumentError("config.json: \"intermediate_size\" is missing");
      const std::string m = p + "mlp.";
      b.Add(m + "gate_proj.weight", {*inter, hidden}, 0, *inter, li, false, true);
      b.Add(m + "up_proj.weight", {*inter, hidden}, 0, *inter, li, false, true);
      b.Add(m + "down_proj.weight", {hidden, *inter}, 1, *inter, li, false, true);
      continue;
    }
    if (expert_inter < 1) {
      return InvalidArgumentError("config.json: \"moe_intermediate_size\" is missing");
    }
    const Index e = *experts;
    const std::string m = p + (mixtral ? "block_sparse_moe." : "mlp.");
    b.Add(m + "gate.weight", {e, hidden}, -1, 0, li);
    if (spec.model_type == "deepseek_v3") b.Add(m + "gate.e_score_correction_bias", {e}, -1, 0, li);
    const std::string x = m + "experts.";
    b.Add(x + (mixtral ? "w1" : "gate_proj"), {e, expert_inter, hidden}, 1, expert_inter, li, true,
          true);
    b.Add(x + (mixtral ? "w3" : "up_proj"), {e, expert_inter, hidden}, 1, expert_inter, li, true,
          true);
    b.Add(x + (mixtral ? "w2" : "down_proj"), {e, hidden, expert_inter}, 2, expert_inter, li, true,
          true);
    if (shared && *shared > 0) {
      const Index si = expert_inter * *shared;
      const std::string s = m + "shared_experts.";
      b.Add(s + "gate_proj.weight", {si, hidden}, 0, si, li, false, true);
      b.Add(s + "up_proj.weight", {si, hidden}, 0, si, li, false, true);
      b.Add(s + "down_proj.weight", {hidden, si}, 1, si, li, false, true);
    }
  }
  b.Add("model.norm.weight", {hidden}, -1, 0, -2);
  if (!tie) b.Add("lm_head.weight", {vocab, hidden}, 0, vocab, -2);
  RESHARD_RETURN_IF_ERROR(CheckModelBytes(b.out));
  spec.num_layers = static_cast<int>(layers);
  spec.tensors = std::move(b.out);
  return spec;
}

Result<GridLayout> ParseGridLayout(std::string_view text) {
  GridLayout g;
  std::vector<std::string_view> seen;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view part = text.substr(pos, comma - pos);
    const size_t eq = part.find('=');
    int value = 0;
    const std::string_view key = part.substr(0, eq);
    bool ok = eq != std::string_view::npos && eq + 1 < part.size() && part.size() - eq - 1 <= 6;
    if (ok) {
      for (char c : part.substr(eq + 1)) {
        ok = ok && c >= '0' && c <= '9';
        value = value * 10 + (c - '0');
      }
    }
    int* slot = key == "tp" ? &g.tp : key == "pp" ? &g.pp : key == "ep" ? &g.ep : nullptr;
    if (!ok || slot == nullptr || value < 1) {
      return InvalidArgumentError(fmt::format(
          "parallel layout \"{}\": expected tp=N, pp=N or ep=N parts separated by commas, got "
          "\"{}\"",
          text, part));
    }
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      return InvalidArgumentError(
          fmt::format("parallel layout \"{}\": {} is given twice", text, key));
    }
    seen.push_back(key);
    *slot = value;
    pos = comma + 1;
  }
  return g;
}

Result<ParamMap> GridMap(const ModelTensor& tensor, const GridLayout& grid, int num_layers) {
  const int stage = tensor.layer >= 0
                        ? static_cast<int>(Index{tensor.layer} * grid.pp / std::max(num_layers, 1))
                        : (tensor.layer == -1 ? 0 : grid.pp - 1);
  const size_t nd = tensor.shape.size();
  // How the split dim's units go over the TP ranks: parts, and the part of each rank.
  int parts = 1;
  int share = 1;  // ranks per part
  if (tensor.split_dim >= 0 && grid.tp > 1) {
    const Index u = tensor.split_units;
    if (u % grid.tp == 0) {
      parts = grid.tp;
    } else if (grid.tp % u == 0) {
      parts = static_cast<int>(u);
      share = grid.tp / parts;
    } else {
      return FailedPreconditionError(fmt::format(
          "tensor \"{}\": tensor parallelism {} cannot split its {} units (dim {}) evenly",
          tensor.name, grid.tp, u, tensor.split_dim));
    }
  }
  int eblocks = 1;
  if (tensor.experts && grid.ep > 1) {
    if (tensor.shape[0] % grid.ep != 0) {
      return FailedPreconditionError(
          fmt::format("tensor \"{}\": expert parallelism {} does not "
                      "divide its {} experts",
                      tensor.name, grid.ep, tensor.shape[0]));
    }
    eblocks = grid.ep;
  }
  Shape strides(nd, 1);
  for (size_t k = nd; k-- > 1;) strides[k - 1] = strides[k] * tensor.shape[k];
  Shape box = tensor.shape;
  if (tensor.split_dim >= 0) box[static_cast<size_t>(tensor.split_dim)] /= parts;
  if (eblocks > 1) box[0] /= eblocks;
  Shape dense(nd, 1);
  for (size_t k = nd; k-- > 1;) dense[k - 1] = dense[k] * box[k];
  ParamMapBuilder b;
  b.set_logical_shape(tensor.shape);
  b.set_world_size(grid.world());
  for (Rank r = 0; r < grid.world(); ++r) b.set_shard_shape(r, Shape(nd, 0));
  auto rank_of = [&](int tp_rank, int ep_rank) {
    return tp_rank + grid.tp * (ep_rank + grid.ep * stage);
  };
  for (int eb = 0; eb < (eblocks > 1 ? eblocks : 1); ++eb) {
    for (int part = 0; part < parts; ++part) {
      std::vector<Rank> holders;
      for (int ep_rank = 0; ep_rank < grid.ep; ++ep_rank) {
        if (eblocks > 1 && ep_rank != eb) continue;
        for (int s = 0; s < share; ++s) holders.push_back(rank_of(part * share + s, ep_rank));
      }
      std::sort(holders.begin(), holders.end());
      Index offset = 0;
      if (tensor.split_dim >= 0) {
        const auto d = static_cast<size_t>(tensor.split_dim);
        offset += part * box[d] * strides[d];
      }
      if (eblocks > 1) offset += eb * box[0] * strides[0];
      for (Rank r : holders) {
        b.set_shard_shape(r, box);
        b.add_piece(r,
                    Piece{box, StridedView{offset, strides}, StridedView{0, dense}, holders, 1.0});
      }
    }
  }
  return b.Finalize();
}

}  // namespace reshard
