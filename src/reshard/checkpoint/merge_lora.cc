#include "reshard/checkpoint/merge_lora.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/checkpoint/sharded_io.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/file.h"
#include "reshard/io/safetensors.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// A tensor's name, dtype and valid shape, whatever holds it.
struct NamedTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

bool Mergeable(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

// Element `i` of float32, bfloat16 or float16 data as float (exact).
float ElementAt(DType dtype, const std::byte* data, Index i) {
  const auto at = static_cast<size_t>(i);
  if (dtype == DType::kF32) {
    float f = 0;
    std::memcpy(&f, data + at * 4, 4);
    return f;
  }
  uint16_t h = 0;
  std::memcpy(&h, data + at * 2, 2);
  return dtype == DType::kBF16 ? BFloat16ToFloat(h) : HalfToFloat(h);
}

// `f` rounded to `dtype` (nearest, ties to even), as float.
float Rounded(float f, DType dtype) {
  if (dtype == DType::kBF16) return BFloat16ToFloat(FloatToBFloat16(f));
  if (dtype == DType::kF16) return HalfToFloat(FloatToHalf(f));
  return f;
}

// One targeted module: the names of its A and B, and whether B @ A is the weight's transpose.
struct LoraPair {
  std::string a;
  std::string b;
  bool embedding = false;
  bool transposed = false;
};

// W + delta rounded to W's dtype, or DataLoss where it is not finite and W was: the adapter holds
// a NaN or an infinity, or a value whose update W's dtype cannot hold (PEFT's safe merge refuses
// it alike). Element (o, i) of B @ A, for the message.
Result<float> Merged(float w, float delta, DType dtype, const LoraPair& pair, Index o, Index i) {
  const float sum = Rounded(w + delta, dtype);
  if (std::isfinite(sum) || !std::isfinite(w)) return sum;
  return DataLossError(fmt::format(
      "merging \"{}\" @ \"{}\" gives {} at element ({}, {}) of the update, where the base "
      "weight holds {}: the adapter holds a value that is not finite, or one too large for {}",
      pair.b, pair.a, sum, o, i, w, DTypeName(dtype)));
}

void Store(float f, DType dtype, std::byte* at) {
  if (dtype == DType::kF32) {
    std::memcpy(at, &f, 4);
  } else {
    const uint16_t h = dtype == DType::kBF16 ? FloatToBFloat16(f) : FloatToHalf(f);
    std::memcpy(at, &h, 2);
  }
}

// One element of scaling * B @ A as PEFT computes its merge on the CPU: summed over r in float
// (fused multiply-adds), times the scaling in float, rounded to the adapter's dtype (PEFT casts
// 16-bit A and B up, and the product back). `a_col` is A's column, `a_stride` apart.
float Delta(const float* b_row, const float* a_col, Index a_stride, Index r, float scaling,
            DType adapter_dtype) {
  float acc = 0;
  for (Index k = 0; k < r; ++k) acc = std::fma(b_row[k], a_col[k * a_stride], acc);
  return Rounded(acc * scaling, adapter_dtype);
}

// Calls f(source offset, dest offset) for every element of `piece` in row-major order of its
// shape, until f returns false.
template <typename F>
void ForEachElement(const Piece& piece, F&& f) {
  if (piece.num_elements() == 0) return;
  const size_t n = piece.shape.size();
  std::vector<Index> index(n, 0);
  Index s = piece.source.offset;
  Index d = piece.dest.offset;
  for (;;) {
    if (!f(s, d)) return;
    size_t k = n;
    for (;;) {
      if (k == 0) return;
      --k;
      if (++index[k] < piece.shape[k]) {
        s += piece.source.strides[k];
        d += piece.dest.strides[k];
        break;
      }
      s -= (piece.shape[k] - 1) * piece.source.strides[k];
      d -= (piece.shape[k] - 1) * piece.dest.strides[k];
      index[k] = 0;
    }
  }
}

// The row-major offset in the valid shape of the element at `offset` of F (logical shape);
// nullopt for padding.
std::optional<Index> ValidOffset(Index offset, const ParamMap& map) {
  if (!map.has_padding()) return offset;
  const Shape& logical = map.logical_shape();
  const Shape& valid = map.valid_shape();
  Index out = 0;
  Index stride = 1;
  for (size_t k = logical.size(); k-- > 0;) {
    const Index i = offset % logical[k];
    offset /= logical[k];
    if (i >= valid[k]) return std::nullopt;
    out += i * stride;
    stride *= valid[k];
  }
  return out;
}

// The elements of an adapter tensor that one rank holds, in its valid shape.
struct Held {
  DType dtype = DType::kF32;
  Shape shape;
  std::span<const std::byte> data;  // of a whole tensor; else `owned`
  std::vector<std::byte> owned;
  std::vector<uint8_t> held;  // per element; empty: every element

  const std::byte* bytes() const { return owned.empty() ? data.data() : owned.data(); }
  bool Has(Index i) const { return held.empty() || held[static_cast<size_t>(i)] != 0; }
  float At(Index i) const { return ElementAt(dtype, bytes(), i); }
};

// A PEFT adapter directory (whole tensors, every rank reads what it needs) or an adapter
// scattered by reshard (rank j reads rank j's shards).
class Adapter {
 public:
  static Result<Adapter> Open(const std::string& dir) {
    std::error_code ec;
    const fs::path config_path = fs::path(dir) / kAdapterConfigName;
    if (!fs::is_regular_file(config_path, ec)) {
      return InvalidArgumentError(
          fmt::format("\"{}\" is not a LoRA adapter: it has no {}", dir, kAdapterConfigName));
    }
    Adapter a;
    a.dir_ = dir;
    RESHARD_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(config_path.string()));
    Result<LoraConfig> parsed = ParseLoraConfigJson(text);
    if (!parsed.ok()) return parsed.status().Annotate(fmt::format("\"{}\"", dir));
    a.config_ = *std::move(parsed);
    if (!a.config_.has_targets) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": {} records no target_modules, so which modules PEFT adapts (its defaults for "
          "the model's type) is not known",
          dir, kAdapterConfigName));
    }
    if (fs::is_regular_file(fs::path(dir) / kManifestName, ec)) {
      RESHARD_ASSIGN_OR_RETURN(ShardedCheckpoint sharded, ShardedCheckpoint::Open(dir));
      a.sharded_ = std::make_shared<const ShardedCheckpoint>(std::move(sharded));
      const std::vector<ShardedParam>& params = a.sharded_->manifest().params;
      for (size_t i = 0; i < params.size(); ++i) {
        a.tensors_.push_back({params[i].name, params[i].dtype, params[i].map.valid_shape()});
        a.index_.emplace(params[i].name, i);
      }
    } else if (IsPeftAdapterDir(dir)) {
      RESHARD_ASSIGN_OR_RETURN(FullCheckpoint full, FullCheckpoint::Open(dir));
      a.full_ = std::make_shared<const FullCheckpoint>(std::move(full));
      const std::vector<TensorRef>& refs = a.full_->tensors();
      for (size_t i = 0; i < refs.size(); ++i) {
        a.tensors_.push_back({refs[i].info->name, refs[i].info->dtype, refs[i].info->shape});
        a.index_.emplace(refs[i].info->name, i);
      }
    } else {
      return InvalidArgumentError(fmt::format(
          "\"{}\" is not a LoRA adapter: {} is beside neither {} (a PEFT adapter) nor {} (one "
          "reshard scattered)",
          dir, kAdapterConfigName, kAdapterWeightsName, kManifestName));
    }
    std::vector<std::pair<std::string, Shape>> shapes;
    for (const NamedTensor& t : a.tensors_) shapes.emplace_back(t.name, t.shape);
    RESHARD_RETURN_IF_ERROR(
        CheckLoraTensors(a.config_, shapes).Annotate(fmt::format("\"{}\"", dir)));
    return a;
  }

  const LoraConfig& config() const { return config_; }
  const std::vector<NamedTensor>& tensors() const { return tensors_; }
  const std::string& directory() const { return dir_; }
  /// The world size it is scattered at; 0 for whole tensors.
  int world_size() const { return sharded_ ? sharded_->manifest().world_size : 0; }

  std::vector<std::string> inputs() const {
    std::vector<std::string> out = {dir_};
    for (std::string& p : sharded_ ? sharded_->file_paths() : full_->file_paths()) {
      out.push_back(std::move(p));
    }
    return out;
  }

  /// The elements of tensor `name` that rank `rank` holds.
  Result<Held> HeldOn(const std::string& name, Rank rank) const {
    const size_t i = index_.at(name);
    if (full_) {
      const TensorRef& t = full_->tensors()[i];
      return Held{t.info->dtype, t.info->shape, t.data, {}, {}};
    }
    const ShardedParam& p = sharded_->manifest().params[i];
    const size_t size = DTypeSize(p.dtype);
    const auto count = static_cast<size_t>(ProductOf(p.map.valid_shape()));
    Held h{p.dtype,
           p.map.valid_shape(),
           {},
           std::vector<std::byte>(count * size),
           std::vector<uint8_t>(count, 0)};
    const std::span<const std::byte> shard = sharded_->shard(i, rank);
    for (const Piece& piece : p.map.rank(rank).pieces) {
      if (piece.scale != 1.0 || p.scale_power != 1) {
        return FailedPreconditionError(fmt::format(
            "the adapter's \"{}\" is held at a scale on rank {}, which merging does not undo", name,
            rank));
      }
      ForEachElement(piece, [&](Index s, Index d) {
        const std::optional<Index> v = ValidOffset(s, p.map);
        if (!v) return true;
        std::memcpy(h.owned.data() + static_cast<size_t>(*v) * size,
                    shard.data() + static_cast<size_t>(d) * size, size);
        h.held[static_cast<size_t>(*v)] = 1;
        return true;
      });
    }
    return h;
  }

 private:
  std::string dir_;
  LoraConfig config_;
  std::vector<NamedTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::shared_ptr<const FullCheckpoint> full_;
  std::shared_ptr<const ShardedCheckpoint> sharded_;
};

// What the adapter does to the base, by base weight name.
struct AdapterTargets {
  std::map<std::string, LoraPair> pairs;
  std::map<std::string, std::string> copies;  // the adapter's whole copy of the weight
};

using FindBase = std::function<const NamedTensor*(const std::string&)>;

// The adapter's pairs and whole copies, checked against the base.
Result<AdapterTargets> PairAdapter(const Adapter& adapter, const FindBase& find) {
  const LoraConfig& config = adapter.config();
  AdapterTargets out;
  std::map<std::string, const NamedTensor*> by_name;
  for (const NamedTensor& t : adapter.tensors()) {
    by_name.emplace(t.name, &t);
    const LoraTensorName n = *ParseLoraTensorName(t.name);  // CheckLoraTensors saw it
    const NamedTensor* w = find(n.base);
    if (w == nullptr) {
      return FailedPreconditionError(fmt::format(
          "adapter tensor \"{}\" targets \"{}\", which the base checkpoint does not hold", t.name,
          n.base));
    }
    if (n.part == LoraPart::kBaseCopy) {
      if (t.shape != w->shape || t.dtype != w->dtype) {
        return FailedPreconditionError(fmt::format(
            "adapter tensor \"{}\" ({} [{}]) is not of the shape and dtype of the base's \"{}\" "
            "({} [{}])",
            t.name, DTypeName(t.dtype), fmt::join(t.shape, ", "), n.base, DTypeName(w->dtype),
            fmt::join(w->shape, ", ")));
      }
      out.copies[n.base] = t.name;
      continue;
    }
    LoraPair& pair = out.pairs[n.base];
    const bool is_a = n.part == LoraPart::kA || n.part == LoraPart::kEmbeddingA;
    (is_a ? pair.a : pair.b) = t.name;
    pair.embedding = n.part == LoraPart::kEmbeddingA || n.part == LoraPart::kEmbeddingB;
  }
  // A linear layer's B @ A is its weight ([out, in], a Linear) or the weight's transpose
  // ([in, out], a Conv1D). PEFT takes the module's own kind whatever fan_in_fan_out says, so
  // here the shapes tell where they can; a square weight takes the kind the others show, or
  // fan_in_fan_out where none shows one.
  std::map<std::string, std::pair<bool, bool>> fits;  // linear pairs: (as [out, in], as [in, out])
  std::set<bool> shown;
  for (const auto& [name, pair] : out.pairs) {
    if (pair.embedding) continue;
    const Shape& w = find(name)->shape;
    const Shape& a = by_name.at(pair.a)->shape;
    const Shape& b = by_name.at(pair.b)->shape;
    const bool as_weight = w == Shape{b[0], a[1]};
    const bool as_transpose = w == Shape{a[1], b[0]};
    fits[name] = {as_weight, as_transpose};
    if (as_weight != as_transpose) shown.insert(as_transpose);
  }
  for (auto& [name, pair] : out.pairs) {
    const NamedTensor& w = *find(name);
    const NamedTensor& a = *by_name.at(pair.a);
    const NamedTensor& b = *by_name.at(pair.b);
    if (pair.embedding) {
      pair.transposed = true;
    } else if (fits[name].first != fits[name].second) {
      pair.transposed = fits[name].second;
    } else if (fits[name].first && shown.size() > 1) {
      return FailedPreconditionError(fmt::format(
          "the base's \"{}\" is square, and the adapter's other weights are both of Linear "
          "layers ([out, in]) and of Conv1D ones ([in, out]): whether \"{}\" @ \"{}\" or its "
          "transpose is added to it is not known",
          name, b.name, a.name));
    } else {
      pair.transposed = shown.empty() ? config.fan_in_fan_out : *shown.begin();
    }
    const Shape want = pair.embedding || pair.transposed ? Shape{a.shape[1], b.shape[0]}
                                                         : Shape{b.shape[0], a.shape[1]};
    if (w.shape != want) {
      return FailedPreconditionError(fmt::format(
          "adapter tensors \"{}\" and \"{}\" make a [{}] update, but the base's \"{}\" is [{}]",
          a.name, b.name, fmt::join(want, ", "), name, fmt::join(w.shape, ", ")));
    }
    for (const NamedTensor* t : {&w, &a, &b}) {
      if (!Mergeable(t->dtype)) {
        return FailedPreconditionError(fmt::format(
            "\"{}\" is {}: merging takes float32, bfloat16 or float16 weights{}", t->name,
            DTypeName(t->dtype), t == &w ? " (dequantize a quantized base first)" : ""));
      }
    }
  }
  return out;
}

// A module's B ([out, r]) and A ([r, in]) in float as one rank holds them, and which rows of B
// and columns of A it holds whole.
struct ModuleOnRank {
  Index r = 0;
  Index out = 0;
  Index in = 0;
  DType adapter_dtype = DType::kF32;
  bool transposed = false;
  std::vector<float> b;
  std::vector<float> a;
  std::vector<uint8_t> row_held;
  std::vector<uint8_t> col_held;
};

Result<ModuleOnRank> LoadModule(const Adapter& adapter, const LoraPair& pair, Rank rank) {
  RESHARD_ASSIGN_OR_RETURN(const Held a, adapter.HeldOn(pair.a, rank));
  RESHARD_ASSIGN_OR_RETURN(const Held b, adapter.HeldOn(pair.b, rank));
  ModuleOnRank m;
  m.r = a.shape[0];
  m.in = a.shape[1];
  m.out = b.shape[0];
  m.adapter_dtype = b.dtype;
  m.transposed = pair.transposed;
  m.b.resize(static_cast<size_t>(m.out * m.r));
  m.a.resize(static_cast<size_t>(m.r * m.in));
  m.row_held.assign(static_cast<size_t>(m.out), 1);
  m.col_held.assign(static_cast<size_t>(m.in), 1);
  for (Index i = 0; i < m.out * m.r; ++i) {
    m.b[static_cast<size_t>(i)] = b.At(i);
    if (!b.Has(i)) m.row_held[static_cast<size_t>(i / m.r)] = 0;
  }
  for (Index i = 0; i < m.r * m.in; ++i) {
    m.a[static_cast<size_t>(i)] = a.At(i);
    if (!a.Has(i)) m.col_held[static_cast<size_t>(i % m.in)] = 0;
  }
  return m;
}

// ---- A Hugging Face base -----------------------------------------------------------------

// W + scaling * B @ A into `out`: W [rows, cols]; B @ A is [rows, cols], or [cols, rows] when
// transposed.
Status MergeInto(const TensorRef& w, const ModuleOnRank& m, const LoraPair& pair, float scaling,
                 std::span<std::byte> out) {
  const DType dtype = w.info->dtype;
  const size_t size = DTypeSize(dtype);
  for (Index o = 0; o < m.out; ++o) {
    for (Index i = 0; i < m.in; ++i) {
      const float delta = Delta(&m.b[static_cast<size_t>(o * m.r)], &m.a[static_cast<size_t>(i)],
                                m.in, m.r, scaling, m.adapter_dtype);
      const Index at = m.transposed ? i * m.out + o : o * m.in + i;
      RESHARD_ASSIGN_OR_RETURN(const float merged, Merged(ElementAt(dtype, w.data.data(), at),
                                                          delta, dtype, pair, o, i));
      Store(merged, dtype, out.data() + static_cast<size_t>(at) * size);
    }
  }
  return Status::Ok();
}

Result<MergeLoraReport> MergeIntoFull(const std::string& base_dir, const Adapter& adapter,
                                      const std::string& out_dir,
                                      const CheckpointOptions& options) {
  if (adapter.world_size() != 0) {
    return FailedPreconditionError(fmt::format(
        "the adapter \"{}\" is scattered at {} ranks, and the base \"{}\" is a Hugging Face "
        "checkpoint: merge it into the base scattered as the adapter is, or gather the adapter",
        adapter.directory(), adapter.world_size(), base_dir));
  }
  RESHARD_ASSIGN_OR_RETURN(const FullCheckpoint base, FullCheckpoint::Open(base_dir));
  std::map<std::string, NamedTensor> base_tensors;
  for (const TensorRef& t : base.tensors()) {
    base_tensors.emplace(t.info->name, NamedTensor{t.info->name, t.info->dtype, t.info->shape});
  }
  RESHARD_ASSIGN_OR_RETURN(const AdapterTargets targets,
                           PairAdapter(adapter, [&](const std::string& name) {
                             auto it = base_tensors.find(name);
                             return it == base_tensors.end() ? nullptr : &it->second;
                           }));
  std::vector<std::string> inputs = adapter.inputs();
  inputs.insert(inputs.begin(), base_dir);
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out,
                           OutputDirectory::Create(out_dir, options.overwrite, inputs));
  const auto scaling = static_cast<float>(adapter.config().Scaling());
  MergeLoraReport report;
  std::vector<TensorToWrite> tensors;
  for (const TensorRef& t : base.tensors()) {
    const std::string& name = t.info->name;
    const auto pair = targets.pairs.find(name);
    const auto copy = targets.copies.find(name);
    TensorRef w = t;  // the adapter's copy, where it has one
    if (copy != targets.copies.end()) {
      ++report.replaced;
      RESHARD_ASSIGN_OR_RETURN(Held held, adapter.HeldOn(copy->second, 0));
      w.data = held.data;
    }
    std::function<Status(std::span<std::byte>)> fill;
    if (pair != targets.pairs.end()) {
      ++report.merged;
      fill = [w, &adapter, lora = pair->second, scaling](std::span<std::byte> bytes) -> Status {
        RESHARD_ASSIGN_OR_RETURN(const ModuleOnRank m, LoadModule(adapter, lora, 0));
        return MergeInto(w, m, lora, scaling, bytes);
      };
    } else {
      fill = [w](std::span<std::byte> bytes) {
        std::memcpy(bytes.data(), w.data.data(), bytes.size());
        return Status::Ok();
      };
    }
    tensors.push_back({name, t.info->dtype, t.info->shape, std::move(fill)});
  }
  RESHARD_RETURN_IF_ERROR(WriteSafetensors(out.FilePath("model.safetensors"), std::move(tensors),
                                           {{"format", "pt"}, {"producer", "reshard"}},
                                           {.sync = options.sync}));
  std::error_code ec;
  for (const char* name : ModelSideFiles()) {
    const fs::path path = fs::path(base_dir) / name;
    if (std::string_view(name) == kAdapterConfigName || !fs::is_regular_file(path, ec)) continue;
    RESHARD_ASSIGN_OR_RETURN(std::string contents, ReadFileToString(path.string()));
    RESHARD_RETURN_IF_ERROR(
        WriteFileAtomically(out.FilePath(name), contents, {.sync = options.sync}));
  }
  RESHARD_RETURN_IF_ERROR(out.Commit(options.sync));
  return report;
}

// ---- A sharded base: shard by shard ------------------------------------------------------

// Rank `rank`'s pieces of the targeted weight `w` merged: W from `base` (the rank tensor its
// pieces are in) or from the adapter's whole copy `w_copy`, into `out`; with `out` empty, only
// checks that the rank holds every row of B and column of A its pieces need.
Status MergePieces(const ShardedParam& w, Rank rank, const ModuleOnRank& m, const LoraPair& pair,
                   const Held* w_copy, float scaling, std::span<const std::byte> base,
                   std::span<std::byte> out) {
  const size_t size = DTypeSize(w.dtype);
  const Index cols = w.map.valid_shape()[1];
  const bool check_only = out.empty();
  Status status;
  for (const Piece& piece : w.map.rank(rank).pieces) {
    ForEachElement(piece, [&](Index s, Index d) {
      const auto at = static_cast<size_t>(d) * size;
      const std::optional<Index> v = ValidOffset(s, w.map);
      if (!v) {  // padding: as it is
        if (!check_only) std::memcpy(out.data() + at, base.data() + at, size);
        return true;
      }
      const Index row = *v / cols;
      const Index col = *v % cols;
      const Index o = m.transposed ? col : row;
      const Index i = m.transposed ? row : col;
      if (m.row_held[static_cast<size_t>(o)] == 0 || m.col_held[static_cast<size_t>(i)] == 0) {
        const bool b = m.row_held[static_cast<size_t>(o)] == 0;
        status = FailedPreconditionError(fmt::format(
            "rank {}'s shard of \"{}\" needs {} {} of \"{}\", which the adapter's rank {} does "
            "not hold: the adapter is laid out otherwise than the base (give its PEFT "
            "directory, or scatter it as the base is)",
            rank, w.name, b ? "row" : "column", b ? o : i, b ? pair.b : pair.a, rank));
        return false;
      }
      if (w_copy != nullptr && !w_copy->Has(*v)) {
        status = FailedPreconditionError(
            fmt::format("rank {}'s shard of \"{}\" needs element {} of the adapter's copy of it, "
                        "which the adapter's rank {} does not hold",
                        rank, w.name, *v, rank));
        return false;
      }
      if (check_only) return true;
      const float delta = Delta(&m.b[static_cast<size_t>(o * m.r)], &m.a[static_cast<size_t>(i)],
                                m.in, m.r, scaling, m.adapter_dtype);
      const float wv = w_copy != nullptr ? w_copy->At(*v) : ElementAt(w.dtype, base.data(), d);
      Result<float> merged = Merged(wv, delta, w.dtype, pair, o, i);
      if (!merged.ok()) {
        status = merged.status().Annotate(fmt::format("rank {}'s shard of \"{}\"", rank, w.name));
        return false;
      }
      Store(*merged, w.dtype, out.data() + at);
      return true;
    });
    RESHARD_RETURN_IF_ERROR(status);
  }
  return Status::Ok();
}

// Rank `rank`'s pieces of `w` replaced by the adapter's whole copy `copy` (`out` empty: only
// checks that the rank holds them).
Status CopyPieces(const ShardedParam& w, Rank rank, const Held& copy,
                  std::span<const std::byte> base, std::span<std::byte> out) {
  const size_t size = DTypeSize(w.dtype);
  Status status;
  for (const Piece& piece : w.map.rank(rank).pieces) {
    ForEachElement(piece, [&](Index s, Index d) {
      const auto at = static_cast<size_t>(d) * size;
      const std::optional<Index> v = ValidOffset(s, w.map);
      if (v && !copy.Has(*v)) {
        status = FailedPreconditionError(
            fmt::format("rank {}'s shard of \"{}\" needs element {} of the adapter's copy of it, "
                        "which the adapter's rank {} does not hold",
                        rank, w.name, *v, rank));
        return false;
      }
      if (out.empty()) return true;
      std::memcpy(out.data() + at,
                  v ? copy.bytes() + static_cast<size_t>(*v) * size : base.data() + at, size);
      return true;
    });
    RESHARD_RETURN_IF_ERROR(status);
  }
  return Status::Ok();
}

// Rank `rank`'s pieces of `w` as the base holds them.
Status CopyUnchanged(const ShardedParam& w, Rank rank, std::span<const std::byte> base,
                     std::span<std::byte> out) {
  if (!w.map.rank(rank).is_buffered()) {
    std::memcpy(out.data(), base.data(), out.size());
    return Status::Ok();
  }
  const size_t size = DTypeSize(w.dtype);
  std::vector<StridedMove> moves;
  for (const Piece& piece : w.map.rank(rank).pieces) {
    const auto at = static_cast<size_t>(piece.dest.offset) * size;
    moves.push_back({piece.shape, base.data() + at, piece.dest.strides, out.data() + at,
                     piece.dest.strides, ScaleOp::None()});
  }
  return StridedCopy(w.dtype, moves, 1);
}

// Whether rank tensors of the base are merged (a parameter in them is targeted).
struct ShardedTargets {
  AdapterTargets targets;
  std::vector<char> touched;  // per parameter of the manifest
};

Result<ShardedTargets> TargetsOfSharded(const Manifest& m, const Adapter& adapter) {
  if (adapter.world_size() != 0 && adapter.world_size() != m.world_size) {
    return FailedPreconditionError(fmt::format(
        "the adapter \"{}\" is scattered at {} ranks, the base at {}: shard by shard, rank j "
        "merges rank j's adapter (convert the adapter to {} ranks, or give its PEFT directory)",
        adapter.directory(), adapter.world_size(), m.world_size, m.world_size));
  }
  std::map<std::string, NamedTensor> base;
  for (const ShardedParam& p : m.params) {
    base.emplace(p.name, NamedTensor{p.name, p.dtype, p.map.valid_shape()});
  }
  ShardedTargets out;
  RESHARD_ASSIGN_OR_RETURN(out.targets, PairAdapter(adapter, [&](const std::string& name) {
                             auto it = base.find(name);
                             return it == base.end() ? nullptr : &it->second;
                           }));
  out.touched.assign(m.params.size(), 0);
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ShardedParam& p = m.params[i];
    if (!out.targets.pairs.contains(p.name) && !out.targets.copies.contains(p.name)) continue;
    out.touched[i] = 1;
    bool scaled = p.scale_power != 1;
    for (const RankShard& shard : p.map.ranks()) {
      for (const Piece& piece : shard.pieces) scaled = scaled || piece.scale != 1.0;
    }
    if (scaled) {
      return FailedPreconditionError(fmt::format(
          "the base's \"{}\" is held at a scale, which merging shard by shard does not apply",
          p.name));
    }
  }
  return out;
}

// Rank `rank`'s shard of base parameter `i`, merged into `out` (empty: checked only).
Status MergeShard(const Manifest& m, size_t i, Rank rank, const ShardedTargets& t,
                  const Adapter& adapter, float scaling, std::span<const std::byte> base,
                  std::span<std::byte> out) {
  const ShardedParam& w = m.params[i];
  if (t.touched[i] == 0) {
    return out.empty() ? Status::Ok() : CopyUnchanged(w, rank, base, out);
  }
  std::optional<Held> copy;
  if (auto c = t.targets.copies.find(w.name); c != t.targets.copies.end()) {
    RESHARD_ASSIGN_OR_RETURN(copy, adapter.HeldOn(c->second, rank));
  }
  const auto pair = t.targets.pairs.find(w.name);
  if (pair == t.targets.pairs.end()) return CopyPieces(w, rank, *copy, base, out);
  RESHARD_ASSIGN_OR_RETURN(const ModuleOnRank module, LoadModule(adapter, pair->second, rank));
  return MergePieces(w, rank, module, pair->second, copy ? &*copy : nullptr, scaling, base, out);
}

Result<MergeLoraReport> MergeIntoSharded(const std::string& base_dir, const Adapter& adapter,
                                         const std::string& out_dir,
                                         const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  RESHARD_ASSIGN_OR_RETURN(ShardedCheckpoint opened, ShardedCheckpoint::Open(base_dir));
  const auto base = std::make_shared<const ShardedCheckpoint>(std::move(opened));
  const Manifest& m = base->manifest();
  RESHARD_ASSIGN_OR_RETURN(const ShardedTargets targets, TargetsOfSharded(m, adapter));
  const auto scaling = static_cast<float>(adapter.config().Scaling());
  // Every rank holds what its shards need, before anything is written.
  for (size_t i = 0; i < m.params.size(); ++i) {
    if (targets.touched[i] == 0) continue;
    for (Rank r = 0; r < m.world_size; ++r) {
      RESHARD_RETURN_IF_ERROR(
          MergeShard(m, i, r, targets, adapter, scaling, base->shard(i, r), {}));
    }
  }
  // The base's files, each written again with its own tensors; those no merge touches are
  // copied as they are (by the file system where it can).
  std::vector<internal::OutputFile> files;
  std::map<std::pair<Rank, size_t>, std::optional<std::vector<internal::PlacedRange>>> ranges;
  for (Rank r = 0; r < m.world_size; ++r) {
    std::map<std::string, RankTensor> by_name;
    for (RankTensor& t : RankTensorsOf(m, r)) by_name.emplace(t.name, std::move(t));
    for (const std::string& name : m.files[static_cast<size_t>(r)]) {
      const std::string path = (fs::path(base_dir) / name).string();
      RESHARD_ASSIGN_OR_RETURN(const SafetensorsHeader header, ReadSafetensorsHeader(path));
      internal::OutputFile f{name, r, {}, 0, {}};
      for (const TensorInfo& info : header.tensors) {
        auto it = by_name.find(info.name);
        if (it == by_name.end()) {
          return DataLossError(fmt::format("\"{}\" holds \"{}\", which is no tensor of rank {}",
                                           path, info.name, r));
        }
        const RankTensor& t = it->second;
        const bool touched = std::any_of(t.params.begin(), t.params.end(),
                                         [&](size_t i) { return targets.touched[i] != 0; });
        for (size_t k = 0; k < t.params.size(); ++k) {
          std::optional<std::vector<internal::PlacedRange>> placed;
          if (!touched) {
            placed.emplace();
            if (k == 0) {
              placed->push_back(
                  {0, FileRange{path, header.data_offset + info.data_begin, info.num_bytes()}});
            }
          }
          ranges[{r, t.params[k]}] = std::move(placed);
        }
        f.bytes += info.num_bytes();
        f.tensors.push_back(t);
      }
      files.push_back(std::move(f));
    }
  }
  std::vector<std::string> inputs = {base_dir, (fs::path(base_dir) / kManifestName).string()};
  for (std::string& p : base->file_paths()) inputs.push_back(std::move(p));
  for (std::string& p : adapter.inputs()) inputs.push_back(std::move(p));
  Manifest manifest = m;
  internal::Counters counters;
  RESHARD_RETURN_IF_ERROR(internal::WriteSharded(
      out_dir, inputs, manifest, options, files, internal::OwnersOf(files, comm.size()), counters,
      [&](size_t i, Rank r, std::span<std::byte> buffer) {
        counters.read +=
            internal::ElementBytes(m.params[i].map.shard_num_elements(r), m.params[i].dtype);
        return MergeShard(m, i, r, targets, adapter, scaling, base->shard(i, r), buffer);
      },
      [&](size_t i, Rank r) {
        return ranges.at({r, i});
      }));
  MergeLoraReport report;
  report.merged = static_cast<int>(targets.targets.pairs.size());
  report.replaced = static_cast<int>(targets.targets.copies.size());
  report.world_size = m.world_size;
  return report;
}

}  // namespace

Result<MergeLoraReport> MergeLora(const std::string& base_dir, const std::string& adapter_dir,
                                  const std::string& out_dir, const CheckpointOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(const Adapter adapter, Adapter::Open(adapter_dir));
  std::error_code ec;
  if (fs::is_regular_file(fs::path(base_dir) / kManifestName, ec)) {
    return MergeIntoSharded(base_dir, adapter, out_dir, options);
  }
  return MergeIntoFull(base_dir, adapter, out_dir, options);
}

}  // namespace reshard
