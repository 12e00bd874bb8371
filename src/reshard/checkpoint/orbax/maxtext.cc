// MaxText's names and layouts (maxtext.h): the table's rules expanded for a config, the maps
// from Orbax device boxes to Hugging Face tensors, and from Hugging Face tensors to MaxText's
// stacked arrays.
#include "reshard/checkpoint/orbax/maxtext.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/megatron/regions.h"
#include "reshard/checkpoint/model_config.h"
#include "reshard/checkpoint/orbax/maxtext_names.h"
#include "reshard/exec/executor.h"

namespace reshard {

namespace {

using maxtext::LayoutRule;
using maxtext::Scope;

// ---- config.json ------------------------------------------------------------------------

bool HasRuleFor(std::string_view model_type) {
  return std::any_of(
      maxtext::LayoutRules().begin(), maxtext::LayoutRules().end(),
      [&](const LayoutRule& r) { return internal::WordListHolds(r.families, model_type); });
}

// ---- the table's factors ----------------------------------------------------------------

// The value of a factor symbol under `c`.
Index SymbolValue(const MaxTextModelConfig& c, std::string_view sym) {
  if (sym == "H") return c.hidden;
  if (sym == "N") return c.heads;
  if (sym == "K") return c.kv_heads;
  if (sym == "D") return c.head_dim;
  if (sym == "P") return c.head_dim / 2;
  if (sym == "R") return 2;
  if (sym == "F") return c.ffn;
  if (sym == "V") return c.vocab;
  return 0;
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  while (true) {
    const size_t at = s.find(sep);
    out.push_back(s.substr(0, at));
    if (at == std::string_view::npos) return out;
    s.remove_prefix(at + 1);
  }
}

// A side's dimensions: per dimension its factor symbols.
std::vector<std::vector<std::string_view>> Dims(std::string_view spec) {
  std::vector<std::vector<std::string_view>> dims;
  for (std::string_view d : Split(spec, ',')) dims.push_back(Split(d, '*'));
  return dims;
}

// Per symbol of a side: (its dimension, its step within the dimension).
std::map<std::string_view, std::pair<size_t, Index>> FactorPlaces(
    const MaxTextModelConfig& c, const std::vector<std::vector<std::string_view>>& dims,
    Shape& shape) {
  std::map<std::string_view, std::pair<size_t, Index>> places;
  shape.clear();
  for (size_t j = 0; j < dims.size(); ++j) {
    Index inner = 1;
    for (size_t k = dims[j].size(); k-- > 0;) {
      places[dims[j][k]] = {j, inner};
      inner *= SymbolValue(c, dims[j][k]);
    }
    shape.push_back(inner);
  }
  return places;
}

MaxTextTensor TensorOf(const MaxTextModelConfig& c, const LayoutRule& rule, Index layer) {
  MaxTextTensor t;
  t.hf_name = layer < 0 ? std::string(rule.hf) : fmt::format("model.layers.{}.{}", layer, rule.hf);
  t.leaf = rule.maxtext;
  t.layer = layer;
  const auto mt = Dims(rule.maxtext_dims);
  const auto hf = Dims(rule.hf_dims);
  FactorPlaces(c, mt, t.layer_shape);
  const auto hf_places = FactorPlaces(c, hf, t.hf_shape);
  const Shape hf_strides = RowMajorStrides(t.hf_shape);
  for (const auto& dim : mt) {
    std::vector<MaxTextFactor> factors;
    Index inner = 1;
    for (size_t k = dim.size(); k-- > 0;) {
      const auto& [hf_dim, hf_inner] = hf_places.at(dim[k]);
      factors.insert(factors.begin(),
                     MaxTextFactor{SymbolValue(c, dim[k]), inner, hf_inner * hf_strides[hf_dim]});
      inner *= SymbolValue(c, dim[k]);
    }
    t.factors.push_back(std::move(factors));
  }
  if (rule.scale == "1/sqrt(D)") t.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  return t;
}

// The stacked shape of a layer's array: the layers inserted at the scan axis.
Shape StackedShape(const Shape& layer_shape, Index layers) {
  Shape s = layer_shape;
  s.insert(s.begin() + static_cast<ptrdiff_t>(std::min(kMaxTextScanAxis, s.size())), layers);
  return s;
}

// The pieces of a tensor that a box of one layer's MaxText array holds: the box (offsets `lo`,
// sizes `sizes` in the layer's array) is the shard, row-major; F is the Hugging Face tensor.
std::vector<Piece> BoxPieces(const MaxTextTensor& t, const Shape& lo, const Shape& sizes) {
  const Shape box_strides = RowMajorStrides(sizes);
  // Per dimension, the boxes of its factors the range covers.
  std::vector<std::vector<std::pair<Shape, Shape>>> per_dim;
  for (size_t j = 0; j < t.factors.size(); ++j) {
    Shape sizes_of;
    for (const MaxTextFactor& f : t.factors[j]) sizes_of.push_back(f.size);
    per_dim.push_back(RangeBoxes(lo[j], lo[j] + sizes[j], sizes_of));
  }
  std::vector<Piece> pieces;
  std::vector<size_t> pick(per_dim.size(), 0);
  while (true) {
    Piece p;
    p.scale = t.scale;
    for (size_t j = 0; j < per_dim.size(); ++j) {
      const auto& [off, size] = per_dim[j][pick[j]];
      Index along = 0;  // the box's first element along dimension j
      for (size_t k = 0; k < t.factors[j].size(); ++k) {
        const MaxTextFactor& f = t.factors[j][k];
        p.shape.push_back(size[k]);
        p.source.strides.push_back(f.hf_stride);
        p.source.offset += off[k] * f.hf_stride;
        p.dest.strides.push_back(f.inner * box_strides[j]);
        along += off[k] * f.inner;
      }
      p.dest.offset += (along - lo[j]) * box_strides[j];
    }
    pieces.push_back(std::move(p));
    size_t j = per_dim.size();
    while (j-- > 0) {
      if (++pick[j] < per_dim[j].size()) break;
      pick[j] = 0;
    }
    if (j == static_cast<size_t>(-1)) break;
  }
  return pieces;
}

std::string Listed(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i ? ", \"" : "\"") + names[i] + "\"";
  if (names.size() > 5) out += fmt::format(" and {} more", names.size() - 5);
  return out;
}

std::string ConfigText(const MaxTextModelConfig& c) {
  return fmt::format(
      "model_type {}, num_hidden_layers {}, hidden_size {}, num_attention_heads {}, "
      "num_key_value_heads {}, head_dim {}, intermediate_size {}, vocab_size {}",
      c.model_type, c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab);
}

// Whether a map holds F whole, row-major, at rank 0 alone (a Hugging Face file's tensor).
bool WholeAtRankZero(const ParamMap& map) {
  if (map.world_size() != 1 || map.rank(0).pieces.size() != 1 || map.has_buffers()) return false;
  const Piece& p = map.rank(0).pieces[0];
  const Shape strides = RowMajorStrides(map.logical_shape());
  return p.shape == map.logical_shape() && p.source == StridedView{0, strides} &&
         p.dest == StridedView{0, strides} && p.scale == 1.0;
}

// ---- Orbax arrays -> Hugging Face tensors ------------------------------------------------

class MaxTextOrbaxSource : public ShardSource {
 public:
  explicit MaxTextOrbaxSource(std::shared_ptr<const OrbaxCheckpoint> ckpt)
      : ckpt_(std::move(ckpt)) {}

  Status Build(const MaxTextModelConfig& config);

  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override { return ckpt_->inputs(); }

  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(i);
    if (it == cache_.end()) {
      Entry e;
      const Part& part = parts_[i];
      const size_t esize = DTypeSize(manifest_.params[i].dtype);
      for (const auto& [offsets, sizes] : part.boxes) {
        std::vector<std::byte> data;
        try {
          data.resize(static_cast<size_t>(ProductOf(sizes)) * esize);
        } catch (const std::bad_alloc&) {
          return DataLossError(
              fmt::format("{}: a box of {} bytes is more memory than this process can have",
                          manifest_.params[i].name, static_cast<size_t>(ProductOf(sizes)) * esize));
        }
        RESHARD_RETURN_IF_ERROR(ckpt_->ReadBox(part.array, offsets, sizes, data));
        e.boxes.push_back(std::move(data));
      }
      it = cache_.emplace(i, std::move(e)).first;
    }
    ++it->second.users;
    std::vector<ConstBuffer> out(static_cast<size_t>(manifest_.world_size));
    const Part& part = parts_[i];
    for (size_t r = 0; r < out.size(); ++r) {
      const int k = part.box_of_rank[r];
      if (k < 0) continue;
      const auto& data = it->second.boxes[static_cast<size_t>(k)];
      out[r] = {data.data(), ProductOf(part.boxes[static_cast<size_t>(k)].second)};
    }
    return out;
  }

  void ReleaseShards(size_t i) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(i);
    if (it != cache_.end() && --it->second.users == 0) cache_.erase(it);
  }

 private:
  // One Hugging Face tensor: its array and the distinct boxes of it that the devices hold (in
  // the array's coordinates, the layer alone along the scan axis).
  struct Part {
    size_t array = 0;
    std::vector<std::pair<Shape, Shape>> boxes;
    std::vector<int> box_of_rank;  // -1: none
  };
  struct Entry {
    int users = 0;
    std::vector<std::vector<std::byte>> boxes;
  };

  std::shared_ptr<const OrbaxCheckpoint> ckpt_;
  Manifest manifest_;
  std::vector<Part> parts_;
  std::mutex mu_;
  std::map<size_t, Entry> cache_;
};

Status MaxTextOrbaxSource::Build(const MaxTextModelConfig& config) {
  const std::vector<OrbaxArray>& arrays = ckpt_->arrays();
  constexpr std::string_view kNorm = "decoder.decoder_norm.scale";
  std::optional<std::string> root;
  for (const OrbaxArray& a : arrays) {
    if (a.optimizer_state || !a.name.ends_with(kNorm)) continue;
    const size_t at = a.name.size() - kNorm.size();
    if (at == 0 || a.name[at - 1] == '.') {
      root = a.name.substr(0, at);
      break;
    }
  }
  if (!root) {
    return FailedPreconditionError(
        fmt::format("\"{}\" holds no MaxText model: no array is named <root>.{} (MaxText saves "
                    "params.params.{})",
                    ckpt_->path(), kNorm, kNorm));
  }
  std::map<std::string, size_t> model;  // the arrays of the model tree, by name
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (!arrays[i].optimizer_state && arrays[i].name.starts_with(*root)) {
      model.emplace(arrays[i].name, i);
    }
  }
  std::set<size_t> used;
  manifest_.world_size = ckpt_->world_size();
  const auto world = static_cast<size_t>(manifest_.world_size);
  for (const MaxTextTensor& t : MaxTextTensors(config)) {
    std::string name = *root + t.leaf;
    Shape want = t.layer_shape;
    Index at_layer = -1;  // the layer's index along the scan axis of a stacked array
    if (t.layer >= 0) {
      const std::string stacked = *root + "decoder.layers." + t.leaf;
      name = model.contains(stacked)
                 ? stacked
                 : fmt::format("{}decoder.layers_{}.{}", *root, t.layer, t.leaf);
      if (model.contains(stacked)) {
        want = StackedShape(t.layer_shape, config.layers);
        at_layer = t.layer;
      }
    }
    const auto it = model.find(name);
    if (it == model.end()) {
      return FailedPreconditionError(
          fmt::format("\"{}\" lacks \"{}\" (MaxText's {} of the model config.json describes: {})",
                      ckpt_->path(), name, t.hf_name, ConfigText(config)));
    }
    const OrbaxArray& a = arrays[it->second];
    if (a.zarr.shape != want) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": \"{}\" is {}, but the model config.json describes ({}) has it {} (for {})",
          ckpt_->path(), name, FormatShape(a.zarr.shape), ConfigText(config), FormatShape(want),
          t.hf_name));
    }
    used.insert(it->second);
    Part part;
    part.array = it->second;
    part.box_of_rank.assign(world, -1);
    std::map<std::pair<Shape, Shape>, std::vector<Rank>> holders;
    for (size_t r = 0; r < world; ++r) {
      auto [offsets, sizes] = ckpt_->Box(it->second, static_cast<Rank>(r));
      if (ProductOf(sizes) == 0) continue;
      if (at_layer >= 0) {
        const size_t ax = std::min(kMaxTextScanAxis, t.layer_shape.size());
        if (at_layer < offsets[ax] || at_layer >= offsets[ax] + sizes[ax]) continue;
        offsets[ax] = at_layer;
        sizes[ax] = 1;
      }
      holders[{offsets, sizes}].push_back(static_cast<Rank>(r));
    }
    ParamMapBuilder b;
    b.set_logical_shape(t.hf_shape);
    b.set_world_size(manifest_.world_size);
    for (size_t r = 0; r < world; ++r) b.set_shard_shape(static_cast<Rank>(r), {0});
    for (const auto& [box, ranks] : holders) {
      Shape lo = box.first, sizes = box.second;
      if (at_layer >= 0) {
        const size_t ax = std::min(kMaxTextScanAxis, t.layer_shape.size());
        lo.erase(lo.begin() + static_cast<ptrdiff_t>(ax));
        sizes.erase(sizes.begin() + static_cast<ptrdiff_t>(ax));
      }
      const std::vector<Piece> pieces = BoxPieces(t, lo, sizes);
      for (const Rank r : ranks) {
        part.box_of_rank[static_cast<size_t>(r)] = static_cast<int>(part.boxes.size());
        b.set_shard_shape(r, {ProductOf(sizes)});
        for (Piece p : pieces) {
          p.locations = ranks;
          b.add_piece(r, std::move(p));
        }
      }
      part.boxes.push_back(box);
    }
    Result<ParamMap> map = b.Finalize();
    if (!map.ok()) {
      return DataLossError(fmt::format("\"{}\": {} from \"{}\": {}", ckpt_->path(), t.hf_name, name,
                                       map.status().message()));
    }
    manifest_.params.push_back(
        ShardedParam{t.hf_name, a.zarr.dtype, *std::move(map), DcpDefaultLayout(t.hf_shape), 1});
    parts_.push_back(std::move(part));
  }
  std::vector<std::string> unknown;
  for (const auto& [name, i] : model) {
    if (!used.contains(i)) unknown.push_back(name);
  }
  if (!unknown.empty()) {
    return FailedPreconditionError(fmt::format(
        "\"{}\": {} {} not a parameter of MaxText's {} model as reshard's layout table has it "
        "(config.json: {}); a model with other parameters (biases, experts, Gemma's norms) is "
        "not read",
        ckpt_->path(), Listed(unknown), unknown.size() == 1 ? "is" : "are", config.model_type,
        ConfigText(config)));
  }
  return Status::Ok();
}

// ---- Hugging Face tensors -> MaxText arrays ----------------------------------------------

class MaxTextView : public ShardSource {
 public:
  explicit MaxTextView(std::shared_ptr<ShardSource> hf) : hf_(std::move(hf)) {}

  Status Build(const MaxTextModelConfig& config, std::string_view root);

  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override { return hf_->inputs(); }

  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(i);
    if (it == cache_.end()) {
      RESHARD_ASSIGN_OR_RETURN(Entry e, Read(i));
      it = cache_.emplace(i, std::move(e)).first;
    }
    ++it->second.users;
    return it->second.buffers;
  }

  void ReleaseShards(size_t i) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(i);
    if (it == cache_.end() || --it->second.users > 0) return;
    for (const size_t j : it->second.held) hf_->ReleaseShards(j);
    cache_.erase(it);
  }

 private:
  struct Entry {
    int users = 0;
    std::vector<ConstBuffer> buffers;  // per rank: its layer's Hugging Face tensor
    std::vector<std::vector<std::byte>> owned;
    std::vector<size_t> held;  // tensors of hf_ whose shards the buffers are
  };

  // Each rank's Hugging Face tensor, whole: the source's shard where that is the tensor,
  // else rebuilt from its shards.
  Result<Entry> Read(size_t i) {
    Entry e;
    e.buffers.resize(static_cast<size_t>(manifest_.world_size));
    const auto fail = [&](Status s) {
      for (const size_t j : e.held) hf_->ReleaseShards(j);
      return s;
    };
    for (size_t r = 0; r < e.buffers.size(); ++r) {
      const int j = of_rank_[i][r];
      if (j < 0) continue;
      const ShardedParam& p = hf_->manifest().params[static_cast<size_t>(j)];
      Result<std::vector<ConstBuffer>> shards = hf_->AcquireShards(static_cast<size_t>(j));
      if (!shards.ok()) return fail(shards.status());
      if (WholeAtRankZero(p.map)) {
        e.held.push_back(static_cast<size_t>(j));
        e.buffers[r] = (*shards)[0];
        continue;
      }
      std::vector<std::byte> full(static_cast<size_t>(p.map.num_elements()) * DTypeSize(p.dtype));
      ExecOptions exec;
      exec.scale_power = p.scale_power;
      Status s = Rebuild(p.map, p.dtype, *shards, {full.data(), p.map.num_elements()}, exec);
      hf_->ReleaseShards(static_cast<size_t>(j));
      if (!s.ok()) return fail(s.Annotate(fmt::format("\"{}\"", p.name)));
      e.buffers[r] = {full.data(), p.map.num_elements()};
      e.owned.push_back(std::move(full));
    }
    return e;
  }

  std::shared_ptr<ShardSource> hf_;
  Manifest manifest_;
  std::vector<std::vector<int>> of_rank_;  // per array, per rank: a tensor of hf_, or -1
  std::mutex mu_;
  std::map<size_t, Entry> cache_;
};

Status MaxTextView::Build(const MaxTextModelConfig& config, std::string_view root) {
  const Manifest& hf = hf_->manifest();
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < hf.params.size(); ++i) by_name.emplace(hf.params[i].name, i);
  // The arrays in the table's order, each with its tensors.
  std::vector<std::string> names;
  std::map<std::string, std::vector<std::pair<MaxTextTensor, size_t>>> of_array;
  std::set<size_t> used;
  for (MaxTextTensor& t : MaxTextTensors(config)) {
    const auto it = by_name.find(t.hf_name);
    if (it == by_name.end()) {
      return FailedPreconditionError(
          fmt::format("the checkpoint lacks \"{}\", which the model config.json describes has ({})",
                      t.hf_name, ConfigText(config)));
    }
    const ShardedParam& p = hf.params[it->second];
    if (p.map.valid_shape() != t.hf_shape) {
      return FailedPreconditionError(fmt::format(
          "\"{}\" is {}, but the model config.json describes ({}) has it {}", t.hf_name,
          FormatShape(p.map.valid_shape()), ConfigText(config), FormatShape(t.hf_shape)));
    }
    used.insert(it->second);
    const std::string name =
        std::string(root) + (t.layer < 0 ? t.leaf : "decoder.layers." + t.leaf);
    if (!of_array.contains(name)) names.push_back(name);
    of_array[name].emplace_back(std::move(t), it->second);
  }
  std::vector<std::string> unknown;
  for (size_t i = 0; i < hf.params.size(); ++i) {
    if (!used.contains(i)) unknown.push_back(hf.params[i].name);
  }
  if (!unknown.empty()) {
    return FailedPreconditionError(
        fmt::format("{} {} not a parameter of MaxText's {} model as reshard's layout table has it "
                    "(config.json: {}); optimizer state is not written with MaxText's names "
                    "(convert the weights alone)",
                    Listed(unknown), unknown.size() == 1 ? "is" : "are", config.model_type,
                    ConfigText(config)));
  }
  manifest_.world_size = static_cast<int>(std::max<Index>(config.layers, 1));
  const auto world = static_cast<size_t>(manifest_.world_size);
  for (const std::string& name : names) {
    const auto& tensors = of_array.at(name);
    const MaxTextTensor& first = tensors.front().first;
    const bool stacked = first.layer >= 0;
    const Shape shape =
        stacked ? StackedShape(first.layer_shape, config.layers) : first.layer_shape;
    const Shape strides = RowMajorStrides(shape);
    const size_t ax = std::min(kMaxTextScanAxis, first.layer_shape.size());
    const DType dtype = hf.params[tensors.front().second].dtype;
    ParamMapBuilder b;
    b.set_logical_shape(shape);
    b.set_world_size(manifest_.world_size);
    std::vector<int> of_rank(world, -1);
    for (size_t r = 0; r < world; ++r) b.set_shard_shape(static_cast<Rank>(r), {0});
    for (const auto& [t, j] : tensors) {
      if (hf.params[j].dtype != dtype) {
        return FailedPreconditionError(fmt::format(
            "\"{}\" is {} but \"{}\" is {}: the layers of MaxText's stacked \"{}\" need one dtype",
            t.hf_name, DTypeName(hf.params[j].dtype), tensors.front().first.hf_name,
            DTypeName(dtype), name));
      }
      const Rank rank = static_cast<Rank>(std::max<Index>(t.layer, 0));
      Piece p;
      p.scale = 1.0 / t.scale;
      p.locations = {rank};
      p.source.offset = stacked ? t.layer * strides[ax] : 0;
      for (size_t d = 0; d < t.factors.size(); ++d) {
        const size_t in_array = stacked && d >= ax ? d + 1 : d;
        for (const MaxTextFactor& f : t.factors[d]) {
          p.shape.push_back(f.size);
          p.source.strides.push_back(f.inner * strides[in_array]);
          p.dest.strides.push_back(f.hf_stride);
        }
      }
      b.set_shard_shape(rank, {ProductOf(t.hf_shape)});
      b.add_piece(rank, std::move(p));
      of_rank[static_cast<size_t>(rank)] = static_cast<int>(j);
    }
    Result<ParamMap> map = b.Finalize();
    if (!map.ok()) return map.status().Annotate(fmt::format("\"{}\"", name));
    manifest_.params.push_back(ShardedParam{name, dtype, *std::move(map), std::nullopt, 1});
    of_rank_.push_back(std::move(of_rank));
  }
  return Status::Ok();
}

}  // namespace

Result<MaxTextModelConfig> ParseMaxTextModelConfig(std::string_view text, std::string_view what) {
  Result<json::Json> parsed = json::ParseJson(text);
  if (!parsed.ok()) return parsed.status().Annotate(what);
  const json::Json& j = *parsed;
  if (!j.is_object()) return json::TypeError(what, "an object", j);
  const internal::ConfigInts ints(j, what, "MaxText's layout");
  MaxTextModelConfig c;
  if (const json::Json* t = json::Find(j, "model_type"); t != nullptr) {
    RESHARD_ASSIGN_OR_RETURN(c.model_type, json::ReadString(*t, json::Member(what, "model_type")));
  }
  if (!HasRuleFor(c.model_type)) {
    return FailedPreconditionError(fmt::format(
        "{}: model_type \"{}\" has no MaxText layout in reshard's table (it has {}); Gemma's "
        "norm offset and embedding normalizer are value transforms, not geometry",
        what, c.model_type, maxtext::KnownFamilies()));
  }
  RESHARD_ASSIGN_OR_RETURN(c.layers, ints.Required("num_hidden_layers"));
  RESHARD_ASSIGN_OR_RETURN(c.hidden, ints.Required("hidden_size"));
  RESHARD_ASSIGN_OR_RETURN(const internal::AttentionHeads heads, ints.Heads(c.hidden));
  c.heads = heads.heads;
  c.kv_heads = heads.kv_heads;
  c.head_dim = heads.head_dim;
  RESHARD_ASSIGN_OR_RETURN(c.vocab, ints.Required("vocab_size"));
  RESHARD_ASSIGN_OR_RETURN(c.ffn, ints.Required("intermediate_size"));
  if (c.head_dim % 2 != 0) {
    return InvalidArgumentError(
        fmt::format("{}: head_dim {} is odd: rotary pairs need an even one", what, c.head_dim));
  }
  for (const char* key : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    RESHARD_ASSIGN_OR_RETURN(std::optional<Index> e, ints.Optional(key));
    if (e && *e > 1) {
      return FailedPreconditionError(
          fmt::format("{}: {} {}: MaxText's mixture-of-experts layouts are not in reshard's table",
                      what, key, *e));
    }
  }
  if (const json::Json* t = json::Find(j, "tie_word_embeddings"); t != nullptr && !t->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(c.tie_word_embeddings,
                             json::ReadBool(*t, json::Member(what, "tie_word_embeddings")));
  }
  const Index big = Index{1} << 24;
  for (const Index n : {c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab}) {
    if (n > big) {
      return InvalidArgumentError(
          fmt::format("{}: a size of {} is past what a model has ({})", what, n, big));
    }
  }
  return c;
}

std::vector<MaxTextTensor> MaxTextTensors(const MaxTextModelConfig& config) {
  std::vector<MaxTextTensor> out;
  const auto applies = [&](const LayoutRule& rule) {
    return internal::WordListHolds(rule.families, config.model_type) &&
           (rule.when != maxtext::When::kUntied || !config.tie_word_embeddings);
  };
  for (const LayoutRule& rule : maxtext::LayoutRules()) {
    if (rule.scope == Scope::kModel && applies(rule)) out.push_back(TensorOf(config, rule, -1));
  }
  for (Index l = 0; l < config.layers; ++l) {
    for (const LayoutRule& rule : maxtext::LayoutRules()) {
      if (rule.scope == Scope::kLayer && applies(rule)) out.push_back(TensorOf(config, rule, l));
    }
  }
  return out;
}

Result<std::unique_ptr<ShardSource>> MaxTextSourceOf(std::shared_ptr<const OrbaxCheckpoint> ckpt,
                                                     const MaxTextModelConfig& config) {
  auto source = std::make_unique<MaxTextOrbaxSource>(std::move(ckpt));
  RESHARD_RETURN_IF_ERROR(source->Build(config));
  return std::unique_ptr<ShardSource>(std::move(source));
}

Result<std::unique_ptr<ShardSource>> MaxTextViewOf(std::shared_ptr<ShardSource> hf,
                                                   const MaxTextModelConfig& config,
                                                   std::string_view root) {
  auto view = std::make_unique<MaxTextView>(std::move(hf));
  RESHARD_RETURN_IF_ERROR(view->Build(config, root));
  return std::unique_ptr<ShardSource>(std::move(view));
}

}  // namespace reshard
