#include "reshard/checkpoint/megatron/megatron.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/megatron/megatron_names.h"
#include "reshard/checkpoint/model_config.h"
#include "reshard/checkpoint/parallel_runs.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/io/file.h"

namespace reshard {

using megatron::NameFamily;
using megatron::NameRule;
using megatron::Part;
using megatron::Scope;

namespace {

namespace fs = std::filesystem;

constexpr char kLatestName[] = "latest_checkpointed_iteration.txt";
constexpr uint64_t kMaxSmallFile = 1 << 20;

bool IsFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The iteration directory a training save dir's latest_checkpointed_iteration.txt names
// (nullopt: the dir has none). InvalidArgument for a file that names no iteration: Megatron
// writes the last saved iteration's number, or "release".
Result<std::optional<fs::path>> LatestIteration(const fs::path& dir) {
  const fs::path latest = dir / kLatestName;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(latest, ec))) return std::optional<fs::path>();
  if (!IsFile(latest)) {
    return InvalidArgumentError(fmt::format("\"{}\" is not a regular file", latest.string()));
  }
  if (fs::file_size(latest, ec) > 64 || ec) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is not an iteration number (over 64 bytes, or unreadable)", latest.string()));
  }
  RESHARD_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(latest.string()));
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s == "release") return std::optional<fs::path>(dir / "release");
  int64_t iteration = -1;
  const auto [end, err] = std::from_chars(s.data(), s.data() + s.size(), iteration);
  if (s.empty() || err != std::errc() || end != s.data() + s.size() || iteration < 0 ||
      !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds {}, which is not an iteration number (Megatron writes the last saved "
        "iteration, a non-negative integer below 2^63, or \"release\")",
        latest.string(), json::QuoteShort(s)));
  }
  return std::optional<fs::path>(dir / fmt::format("iter_{:07d}", iteration));
}

}  // namespace

Result<std::string> MegatronCheckpointDir(const std::string& path) {
  const fs::path dir(path);
  if (IsFile(dir / kMegatronMetadataName)) return path;
  RESHARD_ASSIGN_OR_RETURN(const std::optional<fs::path> it, LatestIteration(dir));
  if (it) {
    if (IsFile(*it / kMegatronMetadataName)) return it->string();
    return NotFoundError(fmt::format("\"{}\" names iteration directory \"{}\", which holds no {}",
                                     (dir / kLatestName).string(), it->string(),
                                     kMegatronMetadataName));
  }
  return NotFoundError(fmt::format("\"{}\" holds no {} (a Megatron-Core dist-ckpt has one)", path,
                                   kMegatronMetadataName));
}

bool IsMegatronCheckpoint(const std::string& path) {
  Result<std::string> dir = MegatronCheckpointDir(path);
  // A latest_checkpointed_iteration.txt that names no iteration is Megatron's file gone wrong:
  // the opener says what is wrong with it.
  if (dir.status().code() == StatusCode::kInvalidArgument) return true;
  if (!dir.ok()) return false;
  const std::string file = (fs::path(*dir) / kMegatronMetadataName).string();
  std::error_code ec;
  if (fs::file_size(file, ec) > kMaxSmallFile || ec) return false;
  Result<std::string> text = ReadFileToString(file);
  if (!text.ok()) return false;
  Result<json::Json> j = json::ParseJson(*text);
  return j.ok() && j->is_object() && j->contains("sharded_backend");
}

// ---------------------------------------------------------------------------------------------
// config.json

Result<MegatronModelConfig> ParseMegatronModelConfig(std::string_view text, std::string_view what) {
  Result<json::Json> parsed = json::ParseJson(text);
  if (!parsed.ok()) return parsed.status().Annotate(what);
  const json::Json& j = *parsed;
  if (!j.is_object()) return json::TypeError(what, "an object", j);
  const internal::ConfigInts ints(j, what, "the Megatron layout");
  MegatronModelConfig c;
  if (const json::Json* t = json::Find(j, "model_type"); t != nullptr) {
    RESHARD_ASSIGN_OR_RETURN(c.model_type, json::ReadString(*t, json::Member(what, "model_type")));
  }
  RESHARD_ASSIGN_OR_RETURN(c.layers, ints.Required("num_hidden_layers"));
  RESHARD_ASSIGN_OR_RETURN(c.hidden, ints.Required("hidden_size"));
  RESHARD_ASSIGN_OR_RETURN(const internal::AttentionHeads heads, ints.Heads(c.hidden));
  c.heads = heads.heads;
  c.kv_heads = heads.kv_heads;
  c.head_dim = heads.head_dim;
  RESHARD_ASSIGN_OR_RETURN(c.vocab, ints.Required("vocab_size"));
  if (c.heads % c.kv_heads != 0) {
    return InvalidArgumentError(
        fmt::format("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", what,
                    c.heads, c.kv_heads));
  }
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> ffn, ints.Optional("intermediate_size"));
  c.ffn = ffn.value_or(0);
  for (const char* key : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    RESHARD_ASSIGN_OR_RETURN(std::optional<Index> e, ints.Optional(key));
    if (e) {
      c.experts = *e;
      break;
    }
  }
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> moe_ffn, ints.Optional("moe_intermediate_size"));
  c.moe_ffn = moe_ffn.value_or(c.ffn);
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> shared,
                           ints.Optional("shared_expert_intermediate_size"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> n_shared, ints.Optional("n_shared_experts"));
  c.shared_ffn = shared ? *shared : (n_shared ? *n_shared * c.moe_ffn : 0);
  if (const json::Json* t = json::Find(j, "tie_word_embeddings"); t != nullptr && !t->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(bool tie,
                             json::ReadBool(*t, json::Member(what, "tie_word_embeddings")));
    c.tie_word_embeddings = tie;
  }
  if (const json::Json* m = json::Find(j, "mlp_only_layers"); m != nullptr && !m->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(c.mlp_only_layers,
                             json::ReadIntArray(*m, json::Member(what, "mlp_only_layers"), 0));
  }
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> step, ints.Optional("decoder_sparse_step"));
  c.sparse_step = step.value_or(1);
  RESHARD_ASSIGN_OR_RETURN(std::optional<Index> freq, ints.Optional("moe_layer_freq"));
  c.moe_freq = freq.value_or(1);
  if (const json::Json* k = json::Find(j, "first_k_dense_replace"); k != nullptr && !k->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(c.first_dense,
                             json::ReadInt(*k, json::Member(what, "first_k_dense_replace"), 0));
  }
  return c;
}

bool IsMoeLayer(const MegatronModelConfig& c, Index layer) {
  if (c.experts == 0) return false;
  if (std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), layer) !=
      c.mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % c.sparse_step == 0 && layer >= c.first_dense && layer % c.moe_freq == 0;
}

// ---------------------------------------------------------------------------------------------
// The name table applied to a key

namespace {

// A key split into its scope and leaf.
struct ParsedKey {
  Scope scope = Scope::kModel;
  std::string_view leaf;
  std::optional<Index> layer;   // decoder.layers.{l}.; nullopt: stacked (leading dim L)
  std::optional<Index> expert;  // ...experts.{e}.; nullopt: stacked (leading dim E)
};

// A leading "{n}." of `s`, consumed.
std::optional<Index> TakeIndex(std::string_view& s) {
  size_t k = 0;
  while (k < s.size() && k < 12 && s[k] >= '0' && s[k] <= '9') ++k;
  if (k == 0 || k >= s.size() || s[k] != '.') return std::nullopt;
  const Index n = std::stoll(std::string(s.substr(0, k)));
  s.remove_prefix(k + 1);
  return n;
}

ParsedKey ParseKey(std::string_view key) {
  ParsedKey p;
  p.leaf = key;
  constexpr std::string_view kLayers = "decoder.layers.";
  if (!key.starts_with(kLayers)) return p;
  std::string_view rest = key.substr(kLayers.size());
  p.scope = Scope::kLayer;
  p.layer = TakeIndex(rest);
  for (std::string_view experts : {"mlp.experts.experts.", "mlp.experts.local_experts."}) {
    if (rest.starts_with(experts)) {
      rest.remove_prefix(experts.size());
      p.scope = Scope::kExpert;
      p.expert = TakeIndex(rest);
      break;
    }
  }
  p.leaf = rest;
  return p;
}

std::string Substitute(std::string_view pattern, const NameFamily& f) {
  std::string out(pattern);
  const std::pair<std::string_view, std::string_view> subs[] = {
      {"{moe}", f.moe}, {"{w1}", f.w1}, {"{w3}", f.w3}, {"{w2}", f.w2}, {"{shared}", f.shared}};
  for (const auto& [from, to] : subs) {
    for (size_t at = out.find(from); at != std::string::npos; at = out.find(from)) {
      out.replace(at, from.size(), to);
    }
  }
  return out;
}

// The config's sizes by table symbol; 0 for a size the config does not give.
Index SymbolValue(const MegatronModelConfig& c, std::string_view sym) {
  if (sym == "H") return c.hidden;
  if (sym == "D") return c.head_dim;
  if (sym == "A") return c.heads * c.head_dim;
  if (sym == "QKV") return (c.heads + 2 * c.kv_heads) * c.head_dim;
  if (sym == "F") return c.ffn;
  if (sym == "I") return c.moe_ffn;
  if (sym == "S") return c.shared_ffn;
  if (sym == "E") return c.experts;
  if (sym == "V") return c.vocab;
  if (sym == "R") return c.lora_rank;
  if (sym == "1") return 1;
  return 0;
}

std::string_view SymbolSource(std::string_view sym) {
  if (sym == "H") return "hidden_size";
  if (sym == "D") return "head_dim";
  if (sym == "A") return "num_attention_heads * head_dim";
  if (sym == "QKV") return "(num_attention_heads + 2 * num_key_value_heads) * head_dim";
  if (sym == "F") return "intermediate_size";
  if (sym == "I") return "moe_intermediate_size";
  if (sym == "S") return "the shared experts' intermediate size";
  if (sym == "E") return "the number of experts";
  if (sym == "V") return "vocab_size (or more: padding)";
  if (sym == "R") return "the LoRA rank, run_config.yaml's peft.dim";
  return "";
}

std::vector<std::string_view> SplitShape(std::string_view spec) {
  std::vector<std::string_view> out;
  while (true) {
    const size_t comma = spec.find(',');
    out.push_back(spec.substr(0, comma));
    if (comma == std::string_view::npos) return out;
    spec.remove_prefix(comma + 1);
  }
}

// Whether `shape` (without stacked dims) is what the rule's shape spec gives; else the error.
Status CheckLeafShape(const MegatronModelConfig& c, std::string_view key, const NameRule& rule,
                      std::span<const Index> shape) {
  const std::vector<std::string_view> syms = SplitShape(rule.shape);
  bool ok = syms.size() == shape.size();
  std::vector<std::string> expected;
  std::vector<std::string> sources;
  for (size_t d = 0; d < syms.size(); ++d) {
    std::string_view sym = syms[d];
    Index factor = 1;
    if (sym.size() > 1 && sym[0] == '2') {
      factor = 2;
      sym.remove_prefix(1);
    }
    const Index v = SymbolValue(c, sym) * factor;
    if (sym == "V") {
      expected.push_back(fmt::format(">={}", v));
      if (ok && shape[d] < v) ok = false;
    } else {
      expected.push_back(std::to_string(v));
      if (ok && shape[d] != v) ok = false;
    }
    if (sym != "1") {
      sources.push_back(fmt::format("{}{} = {}", factor == 2 ? "2 * " : "", SymbolSource(sym), v));
    }
  }
  if (ok) return Status::Ok();
  return InvalidArgumentError(fmt::format(
      "Megatron tensor \"{}\" has shape {} (per layer and expert), but config.json gives [{}] "
      "({}): the config does not describe this checkpoint",
      key, FormatShape(shape), fmt::join(expected, ", "), fmt::join(sources, ", ")));
}

// The region of `part` in a tensor whose leaf shape (without stacked dims) is `leaf`, after
// the stacked dims already added to `r`.
void AddLeafDims(const MegatronModelConfig& c, Part part, std::span<const Index> leaf,
                 TensorRegion& r, Shape& hf_shape) {
  const Index groups = c.kv_heads;
  const Index per_group = c.heads / c.kv_heads;  // query heads per group
  const Index d = c.head_dim;
  for (size_t k = 0; k < leaf.size(); ++k) {
    if (k > 0 || part == Part::kWhole) {
      AddWholeDim(r, leaf[k]);
      hf_shape.push_back(leaf[k]);
      continue;
    }
    const Index group_rows = (per_group + 2) * d;
    switch (part) {
      case Part::kQ:
        AddSplitDim(r, {groups, group_rows}, {0, 0}, {groups, per_group * d});
        hf_shape.push_back(groups * per_group * d);
        break;
      case Part::kK:
        AddSplitDim(r, {groups, group_rows}, {0, per_group * d}, {groups, d});
        hf_shape.push_back(groups * d);
        break;
      case Part::kV:
        AddSplitDim(r, {groups, group_rows}, {0, (per_group + 1) * d}, {groups, d});
        hf_shape.push_back(groups * d);
        break;
      case Part::kGate:
      case Part::kUp:
        AddSplitDim(r, {2, leaf[0] / 2}, {part == Part::kGate ? 0 : 1, 0}, {1, leaf[0] / 2});
        hf_shape.push_back(leaf[0] / 2);
        break;
      case Part::kVocab:
        AddSplitDim(r, {leaf[0]}, {0}, {c.vocab});
        hf_shape.push_back(c.vocab);
        break;
      case Part::kWhole:
        break;
    }
  }
}

}  // namespace

bool IsMegatronAdapterKey(std::string_view key) {
  return key.find(".adapter.") != std::string_view::npos;
}

Result<MegatronKeyParts> MegatronPartsOf(const MegatronModelConfig& config, std::string_view key,
                                         const Shape& shape) {
  const ParsedKey pk = ParseKey(key);
  std::vector<const NameRule*> rules;
  for (const NameRule& rule : megatron::NameRules()) {
    if (rule.scope == pk.scope && rule.leaf == pk.leaf) rules.push_back(&rule);
  }
  const bool adapter = IsMegatronAdapterKey(key);
  if (rules.empty() && adapter) {
    return FailedPreconditionError(fmt::format(
        "Megatron tensor \"{}\" is part of an adapter the Megatron name table cannot map onto "
        "PEFT names: reshard reads Megatron-Bridge's LoRA (adapter.linear_in / linear_out) on "
        "linear_qkv, linear_proj, linear_fc1 and linear_fc2 of dense layers, not DoRA (its "
        "weight_magnitude), CanonicalLoRA (adapter.adapter_q ...) or adapters of experts",
        key));
  }
  if (rules.empty()) {
    return InvalidArgumentError(fmt::format(
        "Megatron tensor \"{}\" is not one the Megatron name table knows (Llama-, Qwen-, Mixtral- "
        "and DeepSeek-style GPT models; see docs/formats.md)",
        key));
  }
  MegatronKeyParts out;
  if (key == "output_layer.weight" && config.tie_word_embeddings.value_or(false)) {
    out.skipped = true;  // transformers ties lm_head to the embedding
    return out;
  }
  // Stacked dims lead: the layers, then the experts.
  size_t lead = 0;
  const bool layer_stacked = pk.scope != Scope::kModel && !pk.layer;
  const bool expert_stacked = pk.scope == Scope::kExpert && !pk.expert;
  const size_t stacked = (layer_stacked ? 1 : 0) + (expert_stacked ? 1 : 0);
  if (shape.size() < stacked) {
    return InvalidArgumentError(
        fmt::format("Megatron tensor \"{}\" has shape {}: fewer dims than "
                    "its stacked layers and experts",
                    key, FormatShape(shape)));
  }
  const auto check_count = [&](Index n, Index want, std::string_view what, std::string_view field) {
    if (n == want) return Status::Ok();
    return InvalidArgumentError(fmt::format(
        "Megatron tensor \"{}\" stacks {} {}, but config.json has {} ({}): the config does not "
        "describe this checkpoint",
        key, n, what, want, field));
  };
  const auto check_index = [&](Index i, Index count, std::string_view what,
                               std::string_view field) {
    if (i < count) return Status::Ok();
    return InvalidArgumentError(fmt::format(
        "Megatron tensor \"{}\" is {} {}, but config.json has {} ({}): the config does not "
        "describe this checkpoint",
        key, what, i, count, field));
  };
  if (pk.scope != Scope::kModel) {
    if (layer_stacked) {
      RESHARD_RETURN_IF_ERROR(
          check_count(shape[lead++], config.layers, "layers", "num_hidden_layers"));
    } else {
      RESHARD_RETURN_IF_ERROR(check_index(*pk.layer, config.layers, "layer", "num_hidden_layers"));
    }
  }
  if (pk.scope == Scope::kExpert) {
    if (expert_stacked) {
      RESHARD_RETURN_IF_ERROR(
          check_count(shape[lead++], config.experts, "experts", "num_local_experts / num_experts"));
    } else {
      RESHARD_RETURN_IF_ERROR(
          check_index(*pk.expert, config.experts, "expert", "num_local_experts / num_experts"));
    }
  }
  const std::span<const Index> leaf(shape.data() + lead, shape.size() - lead);
  RESHARD_RETURN_IF_ERROR(CheckLeafShape(config, key, *rules[0], leaf));
  const NameFamily& family = megatron::FamilyOf(config.model_type);
  const Index layers = layer_stacked ? config.layers : 1;
  const Index experts = expert_stacked ? config.experts : 1;
  for (Index l = 0; l < layers; ++l) {
    for (Index e = 0; e < experts; ++e) {
      int copies = 0;  // rules of the key that hold it whole
      for (const NameRule* rule : rules) {
        MegatronPart part;
        if (rule->part == Part::kWhole) part.copy = copies++;
        if (layer_stacked) AddIndexDim(part.region, config.layers, l);
        if (expert_stacked) AddIndexDim(part.region, config.experts, e);
        AddLeafDims(config, rule->part, leaf, part.region, part.shape);
        const std::string hf = Substitute(rule->hf, family);
        const Index layer = layer_stacked ? l : pk.layer.value_or(0);
        const Index expert = expert_stacked ? e : pk.expert.value_or(0);
        switch (pk.scope) {
          case Scope::kModel:
            part.name = hf;
            break;
          case Scope::kLayer:
            // PEFT names an adapter's tensors after the module under base_model.model.
            part.name =
                fmt::format("{}model.layers.{}.{}", adapter ? "base_model.model." : "", layer, hf);
            break;
          case Scope::kExpert:
            part.name =
                fmt::format("model.layers.{}.{}.experts.{}.{}", layer, family.moe, expert, hf);
            break;
        }
        out.parts.push_back(std::move(part));
      }
    }
  }
  if (rules[0]->part == Part::kVocab && leaf[0] > config.vocab) out.padding_from = config.vocab;
  return out;
}

// ---------------------------------------------------------------------------------------------
// The source

namespace {

// HF tensors over the chunks of a DCP checkpoint's tensors: each saved chunk is a buffer, so
// a tensor's shards are the chunks it touches and nothing more (a layer of a stacked key reads
// that layer's chunks, not the whole stack). A chunk sits on its writing rank; in the rare case
// that one HF tensor touches two chunks of one rank, the second goes to a further virtual rank
// (slot s of rank r is rank s * W + r), since a map puts each rank's pieces in one buffer.
class MegatronShardSource : public ShardSource {
 public:
  MegatronShardSource(std::shared_ptr<const DcpCheckpoint> ckpt,
                      std::vector<std::string> extra_inputs)
      : ckpt_(std::move(ckpt)), extra_inputs_(std::move(extra_inputs)) {}

  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override {
    std::vector<std::string> in = {ckpt_->dir()};
    for (const std::string& p : ckpt_->file_paths()) in.push_back(p);
    in.insert(in.end(), extra_inputs_.begin(), extra_inputs_.end());
    return in;
  }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    std::vector<ConstBuffer> buffers(static_cast<size_t>(manifest_.world_size));
    const std::vector<ChunkRef>& chunks = chunks_of_[i];
    for (size_t k = 0; k < chunks.size(); ++k) {
      Result<ConstBuffer> b = AcquireChunk(chunks[k]);
      if (!b.ok()) {
        for (size_t j = 0; j < k; ++j) ReleaseChunk(chunks[j]);
        return b.status();
      }
      buffers[static_cast<size_t>(chunks[k].virtual_rank)] = *b;
    }
    return buffers;
  }
  void ReleaseShards(size_t i) override {
    for (const ChunkRef& c : chunks_of_[i]) ReleaseChunk(c);
  }

  Status Build(const MegatronModelConfig& config, const std::string& dir, bool optimizer_state,
               bool stateless);

 private:
  struct ChunkRef {
    size_t tensor = 0;  // into ckpt_->tensors()
    size_t chunk = 0;   // into its chunks
    Rank virtual_rank = 0;
  };
  struct Held {
    int users = 0;
    ConstBuffer buffer;
    std::vector<std::byte> owned;
  };

  Result<ConstBuffer> AcquireChunk(const ChunkRef& c) {
    const auto key = std::make_pair(c.tensor, c.chunk);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = held_.find(key);
      if (it != held_.end()) {
        ++it->second->users;
        return it->second->buffer;
      }
    }
    auto h = std::make_shared<Held>();
    RESHARD_ASSIGN_OR_RETURN(const auto bytes, ckpt_->ReadChunk(c.tensor, c.chunk, h->owned));
    const DcpChunk& chunk = ckpt_->tensors()[c.tensor].chunks[c.chunk];
    h->buffer = {bytes.data(), ProductOf(chunk.sizes)};
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = held_.emplace(key, h);
    ++it->second->users;
    return it->second->buffer;
  }
  void ReleaseChunk(const ChunkRef& c) {
    std::shared_ptr<Held> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = held_.find(std::make_pair(c.tensor, c.chunk));
      if (it == held_.end() || --it->second->users > 0) return;
      done = std::move(it->second);
      held_.erase(it);
    }
    ckpt_->ReleaseChunk(c.tensor, c.chunk);
  }

  std::shared_ptr<const DcpCheckpoint> ckpt_;
  std::vector<std::string> extra_inputs_;
  Manifest manifest_;
  std::vector<std::vector<ChunkRef>> chunks_of_;  // per HF tensor: the chunks it reads
  std::mutex mu_;
  std::map<std::pair<size_t, size_t>, std::shared_ptr<Held>> held_;
};

// A box of a tensor that a chunk holds, and where it lies in the chunk's buffer.
struct ChunkBox {
  Shape offsets;  // in the (model) tensor
  Shape sizes;
  StridedView view;
};

// The boxes of range [lo, hi) of the row-major order of a block of sizes `block` from dim `dim`
// on, the dims before it fixed at `prefix`; `base`: the range's first element's index in the
// block order at this level. Each box's view offset is its first element's index in the block.
void FlatRangeBoxes(const Shape& block, size_t dim, Shape& prefix, Index lo, Index hi, Index base,
                    std::vector<ChunkBox>& out) {
  if (lo >= hi) return;
  Index inner = 1;
  for (size_t d = dim + 1; d < block.size(); ++d) inner *= block[d];
  const auto emit = [&](Index from, Index count) {
    ChunkBox box;
    box.offsets = prefix;
    box.sizes.assign(prefix.size(), 1);
    box.offsets.push_back(from);
    box.sizes.push_back(count);
    for (size_t d = dim + 1; d < block.size(); ++d) {
      box.offsets.push_back(0);
      box.sizes.push_back(block[d]);
    }
    box.view.offset = base + from * inner;
    out.push_back(std::move(box));
  };
  const auto into = [&](Index i, Index from, Index to) {
    prefix.push_back(i);
    FlatRangeBoxes(block, dim + 1, prefix, from, to, base + i * inner, out);
    prefix.pop_back();
  };
  Index first = lo / inner;
  const Index last = (hi - 1) / inner;
  if (first == last && (lo % inner != 0 || hi % inner != 0))
    return into(first, lo % inner, hi - first * inner);
  if (lo % inner != 0) into(first++, lo % inner, inner);
  const Index end = hi % inner == 0 ? last + 1 : last;
  if (end > first) emit(first, end - first);
  if (hi % inner != 0) into(last, 0, hi - last * inner);
}

// The boxes of the tensor a chunk holds, each with its view in the chunk's buffer: the chunk's
// own box (row-major), or with `block` (Megatron's flattened layout) the boxes of its range of
// the block it names.
std::vector<ChunkBox> ChunkBoxes(const DcpChunk& chunk, const std::optional<Shape>& block) {
  if (!block) return {{chunk.offsets, chunk.sizes, {0, RowMajorStrides(chunk.sizes)}}};
  const Index from = chunk.offsets.back();
  Shape prefix;
  std::vector<ChunkBox> boxes;
  FlatRangeBoxes(*block, 0, prefix, from, from + chunk.sizes.back(), 0, boxes);
  const Shape strides = RowMajorStrides(*block);
  for (ChunkBox& box : boxes) {
    for (size_t d = 0; d < block->size(); ++d) box.offsets[d] += chunk.offsets[d] * (*block)[d];
    box.view = {box.view.offset - from, strides};
  }
  return boxes;
}

// The pieces of `region` a chunk holds (dest in the chunk's buffer).
std::vector<Piece> ChunkPieces(const TensorRegion& region, const DcpChunk& chunk,
                               const std::optional<Shape>& block) {
  std::vector<Piece> pieces;
  for (const ChunkBox& box : ChunkBoxes(chunk, block)) {
    std::vector<Piece> more = RegionPieces(region, box.offsets, box.sizes, box.view, 0);
    pieces.insert(pieces.end(), std::make_move_iterator(more.begin()),
                  std::make_move_iterator(more.end()));
  }
  return pieces;
}

// One HF tensor while the source is built.
struct PlannedPart {
  MegatronPart part;
  size_t tensor = 0;
  // Per chunk it touches: the chunk and its pieces (dest relative to the chunk's start).
  std::vector<std::pair<size_t, std::vector<Piece>>> pieces;
};

// Slots of one tensor's chunks: chunks of one rank that one HF tensor of `planned[first...]`
// both touches (and that are not the same box saved twice) must differ.
std::vector<int> ChunkSlots(const DcpTensor& tensor, const std::vector<PlannedPart>& planned,
                            size_t first) {
  std::vector<std::set<size_t>> conflicts(tensor.chunks.size());
  for (size_t k = first; k < planned.size(); ++k) {
    const auto& touched = planned[k].pieces;
    for (size_t a = 0; a < touched.size(); ++a) {
      for (size_t b = a + 1; b < touched.size(); ++b) {
        const DcpChunk& x = tensor.chunks[touched[a].first];
        const DcpChunk& y = tensor.chunks[touched[b].first];
        if (x.rank == y.rank) {
          conflicts[touched[a].first].insert(touched[b].first);
          conflicts[touched[b].first].insert(touched[a].first);
        }
      }
    }
  }
  std::vector<int> slots(tensor.chunks.size(), 0);
  for (size_t c = 0; c < tensor.chunks.size(); ++c) {
    std::set<int> taken;
    for (size_t o : conflicts[c]) {
      if (o < c) taken.insert(slots[o]);
    }
    int s = 0;
    while (taken.count(s) != 0) ++s;
    slots[c] = s;
  }
  return slots;
}

// Each chunk's virtual rank: slot s of rank r is rank s * world + r.
struct ChunkSlotTable {
  int world = 0;
  int count = 1;                        // slots a rank has
  std::vector<std::vector<int>> ranks;  // per tensor, per chunk: its slot

  int world_size() const { return world * count; }
  Rank Of(const DcpCheckpoint& ckpt, size_t t, size_t c) const {
    return static_cast<Rank>(ranks[t][c] * world + ckpt.tensors()[t].chunks[c].rank);
  }
};

// The buffer of chunk c of tensor t that copy `copy` of its elements reads (MegatronPart::copy).
std::string ChunkBufferName(const DcpCheckpoint& ckpt, size_t t, size_t c, int copy) {
  const DcpChunk& chunk = ckpt.tensors()[t].chunks[c];
  std::string name =
      fmt::format("{}[{}]@{}", ckpt.tensors()[t].fqn, fmt::join(chunk.offsets, ","), chunk.rank);
  if (copy > 0) name += fmt::format("#copy{}", copy);
  return name;
}

// Every chunk of every tensor used is a buffer (one per copy of its elements that HF tensors
// hold: `copies[t]`, 0 for a tensor not read), so one that no HF tensor fills is found; rows
// [padding_from, rows) of a padded vocabulary are zeros no HF tensor holds.
BufferSetBuilder ChunkBuffers(const DcpCheckpoint& ckpt, const ChunkSlotTable& slots,
                              const std::vector<int>& copies,
                              const std::vector<std::optional<Index>>& padding,
                              const std::vector<std::optional<Shape>>& blocks) {
  BufferSetBuilder buffers;
  for (size_t t = 0; t < ckpt.tensors().size(); ++t) {
    const DcpTensor& tensor = ckpt.tensors()[t];
    for (int copy = 0; copy < copies[t]; ++copy) {
      for (size_t c = 0; c < tensor.chunks.size(); ++c) {
        const DcpChunk& chunk = tensor.chunks[c];
        if (ProductOf(chunk.sizes) == 0) continue;
        BufferDecl decl{ChunkBufferName(ckpt, t, c, copy), tensor.dtype, {}};
        decl.ranks.resize(static_cast<size_t>(slots.world_size()), BufferRank{{0}, {}});
        BufferRank& mine = decl.ranks[static_cast<size_t>(slots.Of(ckpt, t, c))];
        mine.shape = {ProductOf(chunk.sizes)};
        if (padding[t]) {
          for (const ChunkBox& box : ChunkBoxes(chunk, blocks[t])) {
            const Index lo = std::max(box.offsets[0], *padding[t]);
            const Index hi = box.offsets[0] + box.sizes[0];
            if (lo >= hi) continue;
            BufferBlock block;
            block.shape = box.sizes;
            block.shape[0] = hi - lo;
            block.view = {box.view.offset + (lo - box.offsets[0]) * box.view.strides[0],
                          box.view.strides};
            mine.padding.push_back(std::move(block));
          }
        }
        buffers.add(std::move(decl));
      }
    }
  }
  return buffers;
}

// The model config.json describes, whole, in `names` (the HF tensors the checkpoint holds):
// the output layer as tied or not, every layer's attention and its MLP (dense, or the router and
// every expert) as the config makes that layer.
Status CheckWholeModel(const MegatronModelConfig& config, const std::set<std::string>& names,
                       bool have_output_layer, const std::string& dir) {
  if (have_output_layer && config.tie_word_embeddings.value_or(false)) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds its own output_layer.weight (an untied output layer), but config.json says "
        "tie_word_embeddings: true; transformers would drop it and tie lm_head to the embedding: "
        "the config does not describe this checkpoint",
        dir));
  }
  if (!have_output_layer && !config.tie_word_embeddings.value_or(false)) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" has no output_layer.weight (Megatron shares the embedding with the output layer), "
        "but config.json does not say tie_word_embeddings: true; transformers would start lm_head "
        "from random values",
        dir));
  }
  // The model whole: every layer's attention and MLP, every expert of an MoE layer.
  const NameFamily& family = megatron::FamilyOf(config.model_type);
  const auto require = [&](const std::string& name, std::string_view what) -> Status {
    if (names.count(name) != 0) return Status::Ok();
    return InvalidArgumentError(fmt::format(
        "\"{}\" does not hold {} (\"{}\"), which config.json's model has: the config does not "
        "describe this checkpoint, or the checkpoint is incomplete",
        dir, what, name));
  };
  RESHARD_RETURN_IF_ERROR(require("model.embed_tokens.weight", "the embedding"));
  RESHARD_RETURN_IF_ERROR(require("model.norm.weight", "the final norm"));
  for (Index l = 0; l < config.layers; ++l) {
    const std::string layer = fmt::format("model.layers.{}.", l);
    RESHARD_RETURN_IF_ERROR(
        require(layer + "self_attn.q_proj.weight", fmt::format("layer {}'s attention", l)));
    const std::string router = layer + Substitute("{moe}.gate.weight", family);
    const std::string dense = layer + "mlp.down_proj.weight";
    const bool moe = IsMoeLayer(config, l);
    const std::string experts = layer + Substitute("{moe}.experts.", family);
    const auto expert = names.lower_bound(experts);
    if (!moe && expert != names.end() && expert->starts_with(experts)) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": layer {} holds experts in the checkpoint (\"{}\"), but config.json's model "
          "has a dense MLP there: the config does not describe this checkpoint",
          dir, l, *expert));
    }
    if (names.contains(moe ? dense : router)) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": layer {} is {} in the checkpoint (\"{}\"), but config.json's model has {} "
          "there{}: the config does not describe this checkpoint",
          dir, l, moe ? "a dense MLP" : "an MoE layer", moe ? dense : router,
          moe ? "experts" : "a dense MLP",
          moe ? ""
              : " (num_experts, mlp_only_layers, decoder_sparse_step, first_k_dense_replace, "
                "moe_layer_freq)"));
    }
    if (moe) {
      RESHARD_RETURN_IF_ERROR(require(router, fmt::format("layer {}'s router", l)));
      for (Index e = 0; e < config.experts; ++e) {
        for (std::string_view w : {family.w1, family.w3, family.w2}) {
          RESHARD_RETURN_IF_ERROR(
              require(fmt::format("{}{}.experts.{}.{}.weight", layer, family.moe, e, w),
                      fmt::format("layer {}'s expert {}", l, e)));
        }
      }
    } else {
      RESHARD_RETURN_IF_ERROR(require(dense, fmt::format("layer {}'s MLP", l)));
    }
  }
  return Status::Ok();
}

// An adapter checkpoint's HF tensors (PEFT names) as PEFT loads an adapter: every module's A
// and B both there, of rank `rank` (CheckLoraTensors).
Status CheckAdapterPairs(const Manifest& m, Index rank, const std::string& dir) {
  LoraConfig lora;
  lora.r = rank;
  lora.alpha = 1;
  std::vector<std::pair<std::string, Shape>> tensors;
  for (const ShardedParam& p : m.params) {
    if (p.name.ends_with(".weight")) tensors.emplace_back(p.name, p.map.valid_shape());
  }
  return CheckLoraTensors(lora, tensors)
      .Annotate(fmt::format("\"{}\": its LoRA adapters under PEFT's names", dir));
}

// What a checkpoint tensor is to the source: a model tensor (its own key, no suffix), a state of
// the distributed optimizer (the model key it belongs to and reshard's name for the state), or
// left out.
struct StateKey {
  std::string model_key;
  std::string suffix;  // "", ".fp32", ".exp_avg", ".exp_avg_sq"
  bool skip = false;
  Shape model_shape;  // the model tensor's global shape
  // Flattened ranges (fully_sharded_model_space): the blocks the model tensor is cut into, and
  // the state is [model_shape / block ..., ProductOf(block)], a chunk [i..., a] + [1..., b]
  // elements [a, a + b) of block i in row-major order. nullopt: the state has the model
  // tensor's shape (fully_reshardable), or it is a model tensor.
  std::optional<Shape> block;
};

// The block a state of shape `state` cuts a model tensor of shape `model` into when it is
// Megatron's flattened layout ([model / block ..., ProductOf(block)]); nullopt otherwise.
std::optional<Shape> FlattenedBlock(const Shape& model, const Shape& state) {
  if (state.size() != model.size() + 1) return std::nullopt;
  Shape block(model.size());
  for (size_t d = 0; d < model.size(); ++d) {
    if (state[d] <= 0 || model[d] % state[d] != 0) return std::nullopt;
    block[d] = model[d] / state[d];
  }
  if (ProductOf(block) != state.back()) return std::nullopt;
  return block;
}

// Megatron's names of the distributed optimizer's per-parameter state (fully_reshardable:
// "param"; fully_sharded_model_space: "fp32_param") and reshard's.
constexpr std::pair<std::string_view, std::string_view> kOptimizerStates[] = {
    {"fp32_param", ".fp32"},
    {"param", ".fp32"},
    {"exp_avg_sq", ".exp_avg_sq"},
    {"exp_avg", ".exp_avg"}};

// The key of a tensor of the optimizer from "optimizer." on: the key itself, or with
// ChainedOptimizer's "chained_{i}." before it (a chain of optimizers: MoE models keep the
// experts' apart); nullopt for a model tensor.
std::optional<std::string_view> OptimizerKey(std::string_view key) {
  constexpr std::string_view kChained = "chained_";
  if (key.starts_with(kChained)) {
    std::string_view rest = key.substr(kChained.size());
    if (TakeIndex(rest) && rest.starts_with("optimizer.")) return rest;
  }
  if (key.starts_with("optimizer.")) return key;
  return std::nullopt;
}

// Each tensor's StateKey. With `optimizer_state`, "optimizer.state.<state>.<model key>" is read
// when its shape is its model tensor's (fully_reshardable: each state a tensor of the
// parameter's shape, sharded as the parameter is); InvalidArgument naming the checkpoint for
// the other layouts Megatron saves (per-bucket flat buffers, "optimizer.distributed.*";
// flattened ranges of the parameters' shards, a state whose shape is not its parameter's), a
// state of a key that is not a model tensor, or a parameter missing some of its states (all of
// them, while others have theirs, unless `stateless`).
Result<std::vector<StateKey>> OptimizerStateKeys(const DcpCheckpoint& ckpt, bool optimizer_state,
                                                 bool stateless, const std::string& dir) {
  constexpr std::string_view kState = "optimizer.state.";
  std::map<std::string, const DcpTensor*> model;
  for (const DcpTensor& t : ckpt.tensors()) {
    if (!OptimizerKey(t.fqn)) model.emplace(t.fqn, &t);
  }
  std::vector<StateKey> out(ckpt.tensors().size());
  std::map<std::string, std::set<std::string>> found;  // model key -> its states' suffixes
  for (size_t i = 0; i < ckpt.tensors().size(); ++i) {
    const DcpTensor& t = ckpt.tensors()[i];
    const std::optional<std::string_view> optimizer_key = OptimizerKey(t.fqn);
    std::string_view key = optimizer_key.value_or(std::string_view(t.fqn));
    if (!optimizer_key && !t.optimizer_state) {
      out[i].model_key = t.fqn;
      out[i].model_shape = t.shape;
      continue;
    }
    out[i].skip = true;
    if (!optimizer_state) continue;
    if (!key.starts_with(kState)) {
      return InvalidArgumentError(fmt::format(
          "\"{}\" holds the distributed optimizer's state as \"{}\", a layout of Megatron's own "
          "buffers (its dp_reshardable sharding type: flat per-bucket buffers that do not name "
          "their parameters); reshard reads the fully_reshardable sharding type (each state a "
          "tensor of its parameter's shape): save with that, or leave the optimizer state out",
          dir, t.fqn));
    }
    key.remove_prefix(kState.size());
    const auto* state =
        std::find_if(std::begin(kOptimizerStates), std::end(kOptimizerStates), [&](const auto& s) {
          return key.size() > s.first.size() + 1 && key.starts_with(s.first) &&
                 key[s.first.size()] == '.';
        });
    if (state == std::end(kOptimizerStates)) {
      return InvalidArgumentError(fmt::format(
          "\"{}\": optimizer tensor \"{}\" is not one of the distributed optimizer's states "
          "reshard reads (optimizer.state.{{param,fp32_param,exp_avg,exp_avg_sq}}.<key>)",
          dir, t.fqn));
    }
    const std::string model_key(key.substr(state->first.size() + 1));
    const auto m = model.find(model_key);
    if (m == model.end()) {
      return InvalidArgumentError(
          fmt::format("\"{}\": optimizer tensor \"{}\" is the state of \"{}\", which the "
                      "checkpoint does not hold",
                      dir, t.fqn, model_key));
    }
    std::optional<Shape> block;
    if (m->second->shape != t.shape) {
      block = FlattenedBlock(m->second->shape, t.shape);
      if (!block) {
        return InvalidArgumentError(fmt::format(
            "\"{}\": optimizer tensor \"{}\" has shape {}, which is neither its parameter "
            "\"{}\"'s {} nor flattened ranges of blocks of it ([blocks per dim..., elements per "
            "block])",
            dir, t.fqn, FormatShape(t.shape), model_key, FormatShape(m->second->shape)));
      }
      for (const DcpChunk& c : t.chunks) {
        if (std::any_of(c.sizes.begin(), c.sizes.end() - 1, [](Index n) { return n != 1; })) {
          return InvalidArgumentError(fmt::format(
              "\"{}\": optimizer tensor \"{}\" {} holds flattened ranges, but its chunk at {} "
              "of sizes {} spans several blocks",
              dir, t.fqn, FormatShape(t.shape), FormatShape(c.offsets), FormatShape(c.sizes)));
        }
      }
    }
    if (!found[model_key].insert(std::string(state->second)).second) {
      return InvalidArgumentError(
          fmt::format("\"{}\": optimizer tensor \"{}\" is a second {} of \"{}\"", dir, t.fqn,
                      state->second.substr(1), model_key));
    }
    out[i] = {model_key, std::string(state->second), false, m->second->shape, std::move(block)};
  }
  for (const auto& [key, suffixes] : found) {
    if (suffixes.size() != 3) {
      return InvalidArgumentError(
          fmt::format("\"{}\": the optimizer state of \"{}\" is only {} of its .fp32, .exp_avg and "
                      ".exp_avg_sq: the checkpoint does not hold it whole",
                      dir, key, fmt::join(suffixes, ", ")));
    }
  }
  for (const auto& [key, t] : model) {
    if (!optimizer_state || stateless || found.empty() || found.contains(key)) continue;
    return InvalidArgumentError(fmt::format(
        "\"{}\": \"{}\" has none of the distributed optimizer's state (.fp32, .exp_avg, "
        ".exp_avg_sq) while the other parameters have theirs (a frozen parameter): the "
        "checkpoint does not hold its state; leave the optimizer state out, or convert to a "
        "universal checkpoint, which keeps it as a parameter without state",
        dir, key));
  }
  return out;
}

Status MegatronShardSource::Build(const MegatronModelConfig& config, const std::string& dir,
                                  bool optimizer_state, bool stateless) {
  const int world = ckpt_->world_size();
  std::set<std::string> names;
  bool have_output_layer = false;
  std::vector<PlannedPart> planned;
  // Per tensor: each chunk's slot, and the vocabulary padding.
  ChunkSlotTable slots{world, 1, std::vector<std::vector<int>>(ckpt_->tensors().size())};
  std::vector<std::optional<Index>> padding(ckpt_->tensors().size());
  std::vector<int> copies(ckpt_->tensors().size(), 0);
  std::vector<std::optional<Shape>> blocks(ckpt_->tensors().size());
  RESHARD_ASSIGN_OR_RETURN(const std::vector<StateKey> states,
                           OptimizerStateKeys(*ckpt_, optimizer_state, stateless, dir));
  for (size_t t = 0; t < states.size(); ++t) blocks[t] = states[t].block;
  for (size_t t = 0; t < ckpt_->tensors().size(); ++t) {
    const DcpTensor& tensor = ckpt_->tensors()[t];
    const StateKey& state = states[t];
    // The optimizer's state (Megatron's "optimizer." keys) unless asked for.
    if (state.skip) continue;
    if (config.lora_rank > 0 && !IsMegatronAdapterKey(state.model_key)) {
      return InvalidArgumentError(fmt::format(
          "\"{}\" holds LoRA adapters and the model's own tensor \"{}\" beside them: reshard "
          "reads an adapter checkpoint (Megatron-Bridge's PEFT save, the adapters alone) as a PEFT "
          "adapter, or a model's weights, not both at once",
          dir, state.model_key));
    }
    RESHARD_ASSIGN_OR_RETURN(MegatronKeyParts parts,
                             MegatronPartsOf(config, state.model_key, state.model_shape));
    if (tensor.fqn == "output_layer.weight") have_output_layer = true;
    if (parts.skipped) continue;
    for (MegatronPart& part : parts.parts) part.name += state.suffix;
    copies[t] = 1;
    padding[t] = parts.padding_from;
    const size_t first = planned.size();
    for (MegatronPart& part : parts.parts) {
      RESHARD_RETURN_IF_ERROR(CheckRegion(part.region, state.model_shape)
                                  .Annotate(fmt::format("Megatron tensor \"{}\"", tensor.fqn)));
      if (!names.insert(part.name).second) {
        return InvalidArgumentError(fmt::format(
            "Megatron tensor \"{}\" holds \"{}\", which another key holds too (the checkpoint "
            "has a layer both stacked and on its own?)",
            tensor.fqn, part.name));
      }
      copies[t] = std::max(copies[t], part.copy + 1);
      PlannedPart p{std::move(part), t, {}};
      for (size_t c = 0; c < tensor.chunks.size(); ++c) {
        const DcpChunk& chunk = tensor.chunks[c];
        if (ProductOf(chunk.sizes) == 0) continue;
        std::vector<Piece> pieces = ChunkPieces(p.part.region, chunk, state.block);
        if (!pieces.empty()) p.pieces.emplace_back(c, std::move(pieces));
      }
      planned.push_back(std::move(p));
    }
    slots.ranks[t] = ChunkSlots(tensor, planned, first);
    for (int s : slots.ranks[t]) slots.count = std::max(slots.count, s + 1);
  }
  const int vworld = slots.world_size();
  manifest_.world_size = vworld;
  const auto vrank = [&](size_t t, size_t c) { return slots.Of(*ckpt_, t, c); };
  const auto buffer_name = [&](size_t t, size_t c, int copy) {
    return ChunkBufferName(*ckpt_, t, c, copy);
  };
  for (PlannedPart& p : planned) {
    const DcpTensor& tensor = ckpt_->tensors()[p.tensor];
    // The same box saved by several ranks is one piece they hold together.
    std::map<std::pair<Shape, Shape>, std::vector<Rank>> holders;
    for (const auto& [c, pieces] : p.pieces) {
      const DcpChunk& chunk = tensor.chunks[c];
      holders[{chunk.offsets, chunk.sizes}].push_back(vrank(p.tensor, c));
    }
    for (auto& [box, ranks] : holders) std::sort(ranks.begin(), ranks.end());
    ParamMapBuilder b;
    b.set_logical_shape(p.part.shape);
    b.set_world_size(vworld);
    for (Rank r = 0; r < vworld; ++r) b.set_shard_shape(r, {0});
    std::vector<ChunkRef> refs;
    for (auto& [c, pieces] : p.pieces) {
      const DcpChunk& chunk = tensor.chunks[c];
      const Rank r = vrank(p.tensor, c);
      for (Piece& piece : pieces) {
        piece.locations = holders[{chunk.offsets, chunk.sizes}];
        b.add_piece(r, std::move(piece));
      }
      b.set_buffer(r, buffer_name(p.tensor, c, p.part.copy));
      b.set_shard_shape(r, {ProductOf(chunk.sizes)});
      refs.push_back({p.tensor, c, r});
    }
    Result<ParamMap> map = b.Finalize();
    if (!map.ok()) {
      return map.status().Annotate(
          fmt::format("\"{}\" from Megatron tensor \"{}\"", p.part.name, tensor.fqn));
    }
    manifest_.params.push_back(ShardedParam{p.part.name, tensor.dtype, *std::move(map), {}, 1});
    chunks_of_.push_back(std::move(refs));
  }
  if (config.lora_rank > 0) {
    RESHARD_RETURN_IF_ERROR(CheckAdapterPairs(manifest_, config.lora_rank, dir));
  } else {
    RESHARD_RETURN_IF_ERROR(CheckWholeModel(config, names, have_output_layer, dir));
  }
  return ValidateManifestBuffers(manifest_, ChunkBuffers(*ckpt_, slots, copies, padding, blocks))
      .Annotate(fmt::format("\"{}\": the Hugging Face tensors over its Megatron tensors", dir));
}

}  // namespace

namespace {

// The PEFT config of an adapter checkpoint in `dir`: its run_config.yaml's peft: section, of a
// LoRA kind the name table maps.
Result<MegatronPeftConfig> ReadAdapterConfig(const std::string& dir) {
  const std::string path = (fs::path(dir) / kMegatronBridgeRunConfigName).string();
  std::error_code ec;
  if (!IsFile(path)) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" holds LoRA adapters, whose alpha only the {} Megatron-Bridge writes beside them "
        "records, and there is none (\"{}\")",
        dir, kMegatronBridgeRunConfigName, path));
  }
  constexpr uint64_t kMaxRunConfig = 16 << 20;
  if (fs::file_size(path, ec) > kMaxRunConfig || ec) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is over {} bytes, or unreadable: not a run config", path, kMaxRunConfig));
  }
  RESHARD_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path));
  RESHARD_ASSIGN_OR_RETURN(MegatronPeftConfig peft,
                           ParseMegatronPeftConfig(text, fmt::format("\"{}\"", path)));
  const std::string_view target = peft.target;
  const auto kind_is = [&](std::string_view cls) {
    return target == cls || target.ends_with(fmt::format(".{}", cls));
  };
  if (!target.empty() && !kind_is("LoRA") && !kind_is("VLMLoRA")) {
    return FailedPreconditionError(fmt::format(
        "\"{}\": the adapters are {} (peft._target_), which PEFT's LoRA does not hold as they "
        "are{}: reshard reads Megatron-Bridge's LoRA",
        path, json::QuoteShort(target),
        kind_is("DoRA") ? " (DoRA scales each output by a learned magnitude)" : ""));
  }
  return peft;
}

}  // namespace

Result<std::unique_ptr<ShardSource>> OpenMegatronSource(const std::string& path,
                                                        const MegatronSourceOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(const std::string dir, MegatronCheckpointDir(path));
  const std::string meta_path = (fs::path(dir) / kMegatronMetadataName).string();
  RESHARD_ASSIGN_OR_RETURN(const std::string meta_text, ReadFileToString(meta_path));
  Result<json::Json> parsed_meta = json::ParseJson(meta_text);
  if (!parsed_meta.ok()) return parsed_meta.status().Annotate(meta_path);
  const json::Json& meta = *parsed_meta;
  if (!meta.is_object()) return json::TypeError(meta_path, "an object", meta);
  RESHARD_ASSIGN_OR_RETURN(const json::Json* backend,
                           json::Require(meta, meta_path, "sharded_backend"));
  RESHARD_ASSIGN_OR_RETURN(const std::string backend_name,
                           json::ReadString(*backend, json::Member(meta_path, "sharded_backend")));
  if (backend_name != "torch_dist") {
    return InvalidArgumentError(fmt::format(
        "\"{}\" was saved with Megatron's \"{}\" backend; reshard reads \"torch_dist\" (load it "
        "in Megatron and save it again with --ckpt-format torch_dist)",
        dir, backend_name));
  }
  if (const json::Json* v = json::Find(meta, "sharded_backend_version"); v != nullptr) {
    const std::string field = json::Member(meta_path, "sharded_backend_version");
    RESHARD_ASSIGN_OR_RETURN(const Index version, json::ReadInt(*v, field));
    if (version != 1) {
      return InvalidArgumentError(fmt::format(
          "{} is {}: Megatron-Core's torch_dist backend writes version 1, and reshard reads no "
          "other",
          field, version));
    }
  }
  if (options.config_json.empty()) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is a Megatron-Core checkpoint, which does not record its model's shapes (heads, "
        "query groups, MLP widths): give the Hugging Face config.json of the model",
        dir));
  }
  const std::string what =
      options.config_path.empty() ? std::string("config.json") : options.config_path;
  RESHARD_ASSIGN_OR_RETURN(MegatronModelConfig config,
                           ParseMegatronModelConfig(options.config_json, what));
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const DcpCheckpoint> ckpt, DcpCheckpoint::Open(dir));
  if (options.run != nullptr) *options.run = MegatronRunOf(*ckpt);
  std::vector<std::string> extra = {meta_path};
  if (!options.config_path.empty()) extra.push_back(options.config_path);
  bool optimizer_state = options.optimizer_state;
  if (std::any_of(ckpt->tensors().begin(), ckpt->tensors().end(), [](const DcpTensor& t) {
        return !OptimizerKey(t.fqn) && IsMegatronAdapterKey(t.fqn);
      })) {
    RESHARD_ASSIGN_OR_RETURN(const MegatronPeftConfig peft, ReadAdapterConfig(dir));
    config.lora_rank = peft.dim;
    optimizer_state = false;  // a PEFT adapter keeps none
    if (options.peft != nullptr) *options.peft = peft;
    extra.push_back((fs::path(dir) / kMegatronBridgeRunConfigName).string());
  }
  auto source = std::make_unique<MegatronShardSource>(std::move(ckpt), std::move(extra));
  RESHARD_RETURN_IF_ERROR(
      source->Build(config, dir, optimizer_state, options.stateless_parameters));
  return std::unique_ptr<ShardSource>(std::move(source));
}

// ---------------------------------------------------------------------------------------------
// A live model's shards

namespace {

// The buffers the shards of the keys in `padding` name, each rank's shape its tensor; rows of a
// padded vocabulary from `padding[key]` on are padding (keys absent: no HF tensor reads them).
Result<BufferSetBuilder> LiveBuffers(std::span<const MegatronLiveShard> shards, int world,
                                     const std::map<std::string, std::optional<Index>>& padding) {
  std::map<std::string, BufferDecl> decls;
  std::vector<std::string> order;
  for (const MegatronLiveShard& s : shards) {
    const auto pad = padding.find(s.key);
    if (pad == padding.end()) continue;
    auto [it, inserted] = decls.try_emplace(s.buffer);
    BufferDecl& decl = it->second;
    if (inserted) {
      order.push_back(s.buffer);
      decl = {s.buffer, s.dtype, std::vector<BufferRank>(static_cast<size_t>(world), {{0}, {}})};
    } else if (decl.dtype != s.dtype) {
      return InvalidArgumentError(fmt::format(
          "rank tensor \"{}\" holds {} elements of Megatron tensor \"{}\" and {} of another",
          s.buffer, DTypeName(s.dtype), s.key, DTypeName(decl.dtype)));
    }
    BufferRank& mine = decl.ranks[static_cast<size_t>(s.rank)];
    mine.shape = {s.buffer_elements};
    if (!pad->second || s.sizes.empty()) continue;
    const Index lo = std::max(s.offsets[0], *pad->second);
    const Index hi = s.offsets[0] + s.sizes[0];
    if (lo >= hi) continue;
    BufferBlock block;
    block.shape = s.sizes;
    block.shape[0] = hi - lo;
    const Shape strides = RowMajorStrides(s.sizes);
    block.view = {s.buffer_offset + (lo - s.offsets[0]) * strides[0], strides};
    mine.padding.push_back(std::move(block));
  }
  BufferSetBuilder buffers;
  for (const std::string& name : order) buffers.add(std::move(decls[name]));
  return buffers;
}

// The map of `part` over the shards of its key (`of`: indices into `shards`).
Result<ParamMap> LivePartMap(const MegatronPart& part, std::span<const MegatronLiveShard> shards,
                             const std::vector<size_t>& of, int world) {
  std::map<std::pair<Shape, Shape>, std::vector<Rank>> holders;
  for (size_t i : of) holders[{shards[i].offsets, shards[i].sizes}].push_back(shards[i].rank);
  for (auto& [box, ranks] : holders) {
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  }
  ParamMapBuilder b;
  b.set_logical_shape(part.shape);
  b.set_world_size(world);
  for (Rank r = 0; r < world; ++r) b.set_shard_shape(r, {0});
  std::map<Rank, std::string> buffer_of;
  for (size_t i : of) {
    const MegatronLiveShard& s = shards[i];
    std::vector<Piece> pieces = RegionPieces(part.region, s.offsets, s.sizes,
                                             {s.buffer_offset, RowMajorStrides(s.sizes)}, s.rank);
    if (pieces.empty()) continue;
    const auto [at, inserted] = buffer_of.emplace(s.rank, s.buffer);
    if (!inserted && at->second != s.buffer) {
      return InvalidArgumentError(fmt::format(
          "rank {} holds parts of it in two rank tensors, \"{}\" and \"{}\" (a map puts a "
          "rank's pieces in one)",
          s.rank, at->second, s.buffer));
    }
    for (Piece& piece : pieces) {
      piece.locations = holders[{s.offsets, s.sizes}];
      b.add_piece(s.rank, std::move(piece));
    }
    b.set_buffer(s.rank, s.buffer);
    b.set_shard_shape(s.rank, {s.buffer_elements});
  }
  return b.Finalize();
}

// The shards of each key, keys in order of first appearance; InvalidArgument for shards of one
// key that disagree on its shape or dtype, or a box outside the shape or its rank tensor.
Result<std::vector<std::pair<std::string, std::vector<size_t>>>> LiveKeys(
    std::span<const MegatronLiveShard> shards, int world) {
  std::vector<std::pair<std::string, std::vector<size_t>>> keys;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < shards.size(); ++i) {
    const MegatronLiveShard& s = shards[i];
    const auto [it, inserted] = index.emplace(s.key, keys.size());
    if (inserted) keys.push_back({s.key, {}});
    const MegatronLiveShard& first =
        shards[keys[it->second].second.empty() ? i : keys[it->second].second.front()];
    if (first.shape != s.shape || first.dtype != s.dtype) {
      return InvalidArgumentError(
          fmt::format("Megatron tensor \"{}\" is {} {} on rank {} but {} {} on rank {}", s.key,
                      DTypeName(first.dtype), FormatShape(first.shape), first.rank,
                      DTypeName(s.dtype), FormatShape(s.shape), s.rank));
    }
    bool inside = s.rank >= 0 && s.rank < world && s.offsets.size() == s.shape.size() &&
                  s.sizes.size() == s.shape.size() && s.buffer_offset >= 0 &&
                  s.buffer_offset + ProductOf(s.sizes) <= s.buffer_elements;
    for (size_t d = 0; inside && d < s.shape.size(); ++d) {
      inside = s.offsets[d] >= 0 && s.sizes[d] >= 0 && s.offsets[d] + s.sizes[d] <= s.shape[d];
    }
    if (!inside) {
      return InvalidArgumentError(fmt::format(
          "Megatron tensor \"{}\" {}: rank {} of {} holds the box at {} of sizes {}, at element "
          "{} of its {}-element tensor \"{}\", which does not fit",
          s.key, FormatShape(s.shape), s.rank, world, FormatShape(s.offsets), FormatShape(s.sizes),
          s.buffer_offset, s.buffer_elements, s.buffer));
    }
    keys[it->second].second.push_back(i);
  }
  return keys;
}

}  // namespace

Result<Manifest> MegatronLiveManifest(const MegatronModelConfig& config,
                                      std::span<const MegatronLiveShard> shards, int world,
                                      std::string_view what) {
  RESHARD_ASSIGN_OR_RETURN(const auto keys, LiveKeys(shards, world));
  Manifest manifest;
  manifest.world_size = world;
  std::set<std::string> names;
  bool have_output_layer = false;
  std::map<std::string, std::optional<Index>> padding;  // per key read: its padding rows
  for (const auto& [key, of] : keys) {
    const Shape& shape = shards[of.front()].shape;
    if (IsMegatronAdapterKey(key)) {
      return InvalidArgumentError(fmt::format(
          "{}: Megatron tensor \"{}\" is a LoRA adapter's: a live model's adapters are not read "
          "(save them with Megatron-Bridge and gather the checkpoint into a PEFT adapter)",
          what, key));
    }
    RESHARD_ASSIGN_OR_RETURN(MegatronKeyParts parts, MegatronPartsOf(config, key, shape));
    if (key == "output_layer.weight") have_output_layer = true;
    if (parts.skipped) continue;
    padding[key] = parts.padding_from;
    for (const MegatronPart& part : parts.parts) {
      RESHARD_RETURN_IF_ERROR(
          CheckRegion(part.region, shape).Annotate(fmt::format("Megatron tensor \"{}\"", key)));
      if (!names.insert(part.name).second) {
        return InvalidArgumentError(fmt::format(
            "Megatron tensor \"{}\" holds \"{}\", which another key holds too", key, part.name));
      }
      Result<ParamMap> map = LivePartMap(part, shards, of, world);
      if (!map.ok()) {
        return map.status().Annotate(
            fmt::format("\"{}\" from Megatron tensor \"{}\"", part.name, key));
      }
      manifest.params.push_back(
          ShardedParam{part.name, shards[of.front()].dtype, *std::move(map), {}, 1});
    }
  }
  RESHARD_RETURN_IF_ERROR(CheckWholeModel(config, names, have_output_layer, std::string(what)));
  RESHARD_ASSIGN_OR_RETURN(const BufferSetBuilder buffers, LiveBuffers(shards, world, padding));
  RESHARD_RETURN_IF_ERROR(ValidateManifestBuffers(manifest, buffers)
                              .Annotate(fmt::format("{}: the Hugging Face tensors over its "
                                                    "Megatron tensors",
                                                    what)));
  return manifest;
}

}  // namespace reshard
