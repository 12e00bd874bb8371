#include "reshard/ir/infer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "reshard/base/json_reader.h"
#include "reshard/ir/canonicalize.h"
#include "reshard/ir/fold.h"

namespace reshard {

using internal::FoldItem;

namespace {

std::string ObservedPath(size_t i, Rank rank) {
  return fmt::format("ranks[{}] (rank {})", i, rank);
}

// Holder sets, interned: set 0 is empty; a set's members are ascending, so adding ranks in
// increasing order only ever appends.
class HolderSets {
 public:
  HolderSets() : sets_(1) {}

  // The set `id` plus `rank` (rank is above every member).
  uint32_t With(uint32_t id, Rank rank) {
    const uint64_t key = (static_cast<uint64_t>(id) << 32) | static_cast<uint32_t>(rank);
    auto [it, inserted] = next_.try_emplace(key, static_cast<uint32_t>(sets_.size()));
    if (inserted) {
      std::vector<Rank> members = sets_[id];
      members.push_back(rank);
      sets_.push_back(std::move(members));
    }
    return it->second;
  }
  const std::vector<Rank>& members(uint32_t id) const { return sets_[id]; }

 private:
  std::vector<std::vector<Rank>> sets_;
  std::unordered_map<uint64_t, uint32_t> next_;
};

// The holder set of every element of F: a dense array when F is not much larger than the
// observation, a hash table otherwise (a deliberately partial observation of a huge F must
// not cost memory in proportion to F).
class HolderTable {
 public:
  HolderTable(Index n, Index entries) : dense_(n <= 4 * entries + 4096) {
    if (dense_) values_.assign(static_cast<size_t>(n), 0);
  }
  uint32_t& operator[](Index e) { return dense_ ? values_[static_cast<size_t>(e)] : sparse_[e]; }
  uint32_t at(Index e) const {
    if (dense_) return values_[static_cast<size_t>(e)];
    auto it = sparse_.find(e);
    return it == sparse_.end() ? 0 : it->second;
  }

 private:
  bool dense_;
  std::vector<uint32_t> values_;
  std::unordered_map<Index, uint32_t> sparse_;
};

Status CheckValidShape(const IndexMaps& observed) {
  if (!observed.valid_shape) return Status::Ok();
  const Shape& v = *observed.valid_shape;
  bool fits = v.size() == observed.logical_shape.size();
  for (size_t k = 0; fits && k < v.size(); ++k)
    fits = v[k] >= 0 && v[k] <= observed.logical_shape[k];
  if (!fits) {
    return InvalidArgumentError(fmt::format("valid_shape {} does not fit inside logical_shape {}",
                                            FormatShape(v), FormatShape(observed.logical_shape)));
  }
  return Status::Ok();
}

// One observed shard's own consistency: shape against index map, scales.
Status CheckShard(const ObservedShard& s, size_t i) {
  auto shard_elems = CheckedProduct(s.shard_shape);
  if (!shard_elems.ok())
    return shard_elems.status().Annotate(ObservedPath(i, s.rank) + ".shard_shape");
  const auto entries = static_cast<Index>(s.index_map.size());
  if (*shard_elems != entries) {
    return InvalidArgumentError(fmt::format(
        "{}: shard_shape {} has {} elements but index_map has {} entries ({})",
        ObservedPath(i, s.rank), FormatShape(s.shard_shape), *shard_elems, entries,
        entries < *shard_elems ? "shard elements are missing" : "extra shard elements are listed"));
  }
  if (s.scale.size() > 1 && s.scale.size() != s.index_map.size()) {
    return InvalidArgumentError(
        fmt::format("{}: scale has {} values; give one number or one per index_map entry ({})",
                    ObservedPath(i, s.rank), s.scale.size(), entries));
  }
  for (size_t k = 0; k < s.scale.size(); ++k) {
    if (!std::isfinite(s.scale[k]) || s.scale[k] == 0.0) {
      return InvalidArgumentError(fmt::format("{}: scale[{}] = {} is not a finite non-zero number",
                                              ObservedPath(i, s.rank), k, s.scale[k]));
    }
  }
  return Status::Ok();
}

// The observed shards by rank, each checked; every rank 0..N-1 exactly once.
Result<std::vector<const ObservedShard*>> ShardsByRank(const IndexMaps& observed) {
  const int world = static_cast<int>(observed.ranks.size());
  std::vector<const ObservedShard*> by_rank(static_cast<size_t>(world), nullptr);
  for (size_t i = 0; i < observed.ranks.size(); ++i) {
    const ObservedShard& s = observed.ranks[i];
    if (s.rank < 0 || s.rank >= world) {
      return InvalidArgumentError(
          fmt::format("{}: rank {} is outside 0..{}; ranks must be numbered 0 to N-1",
                      ObservedPath(i, s.rank), s.rank, world - 1));
    }
    if (by_rank[static_cast<size_t>(s.rank)] != nullptr) {
      return InvalidArgumentError(
          fmt::format("{}: rank {} is listed twice", ObservedPath(i, s.rank), s.rank));
    }
    by_rank[static_cast<size_t>(s.rank)] = &s;
    RESHARD_RETURN_IF_ERROR(CheckShard(s, i));
  }
  return by_rank;
}

// Pass 1: the holder set of every element of F.
Status CollectHolders(const IndexMaps& observed, const std::vector<const ObservedShard*>& by_rank,
                      Index n, HolderSets& sets, HolderTable& holders) {
  for (Rank r = 0; r < static_cast<Rank>(by_rank.size()); ++r) {
    const ObservedShard& s = *by_rank[static_cast<size_t>(r)];
    uint32_t cached_from = UINT32_MAX;
    uint32_t cached_to = 0;
    const bool buffered = !s.buffer.empty();
    for (size_t k = 0; k < s.index_map.size(); ++k) {
      const Index e = s.index_map[k];
      if (e == -1 && buffered) continue;  // an element of the buffer that is not F's
      if (e < 0 || e >= n) {
        return InvalidArgumentError(fmt::format(
            "rank {}: index_map[{}] = {} is outside F (shape {}, {} elements){}", r, k, e,
            FormatShape(observed.logical_shape), n,
            e == -1 ? "; -1 (not this tensor's) is allowed only in a buffered shard" : ""));
      }
      uint32_t& h = holders[e];
      if (h != cached_from) {
        const std::vector<Rank>& m = sets.members(h);
        if (!m.empty() && m.back() == r) {
          return InvalidArgumentError(fmt::format(
              "rank {}: index_map[{}] = {} repeats element {} of F, which the shard already "
              "holds; a shard holds each element of F at most once",
              r, k, e, FormatShape(UnravelIndex(e, observed.logical_shape))));
        }
        cached_from = h;
        cached_to = sets.With(h, r);
      }
      h = cached_to;
    }
  }
  return Status::Ok();
}

// Walks the non-padding elements in order; the first one without a holder is named. At most
// one more step than there are entries, whatever the size of F.
Status CheckCovered(const IndexMaps& observed, Index n, const HolderTable& holders) {
  const Shape& shape = observed.logical_shape;
  const Shape valid = observed.valid_shape.value_or(shape);
  const Shape strides = RowMajorStrides(shape);
  bool any = true;
  for (size_t k = 0; k < valid.size(); ++k) any &= k < shape.size() && valid[k] > 0;
  std::vector<Index> index(shape.size(), 0);
  while (any && n > 0) {
    Index e = 0;
    for (size_t k = 0; k < index.size(); ++k) e += index[k] * strides[k];
    if (holders.at(e) == 0) {
      return InvalidArgumentError(fmt::format(
          "element {} of F (shape {}) is held by no rank (allow_uncovered accepts a deliberately "
          "partial observation)",
          FormatShape(index), FormatShape(shape)));
    }
    size_t k = index.size();
    while (k > 0) {
      if (++index[k - 1] < std::min(valid[k - 1], shape[k - 1])) break;
      index[k - 1] = 0;
      --k;
    }
    if (k == 0) break;
  }
  return Status::Ok();
}

// Pass 2 for one rank: the sequence of each key (holders and scale) as arithmetic runs, folded
// into pieces.
void AddRankPieces(const ObservedShard& s, Rank r, const HolderSets& sets,
                   const HolderTable& holders, const Shape& logical_strides,
                   ParamMapBuilder& builder) {
  builder.set_shard_shape(r, s.shard_shape);
  if (!s.buffer.empty()) builder.set_buffer(r, s.buffer);
  auto scale_at = [&](size_t k) {
    return s.scale.empty() ? 1.0 : s.scale.size() == 1 ? s.scale[0] : s.scale[k];
  };
  std::map<std::pair<uint32_t, double>, std::vector<FoldItem>> by_key;
  const size_t count = s.index_map.size();
  size_t k = 0;
  while (k < count) {
    const Index e = s.index_map[k];
    if (e < 0) {  // a buffer's element that holds nothing of F (checked in CollectHolders)
      ++k;
      continue;
    }
    const uint32_t holder = holders.at(e);
    const double scale = scale_at(k);
    size_t j = k + 1;
    Index step = 0;
    if (j < count) {
      step = s.index_map[j] - e;
      while (j < count && step > 0 && s.index_map[j] - s.index_map[j - 1] == step &&
             holders.at(s.index_map[j]) == holder && scale_at(j) == scale) {
        ++j;
      }
    }
    FoldItem item{{static_cast<Index>(k), e}, {}};
    if (j - k > 1) item.dims.push_back({static_cast<Index>(j - k), {1, step}});
    internal::AppendItem(by_key[{holder, scale}], std::move(item));
    k = std::max(j, k + 1);
  }
  std::vector<internal::KeyedSequence> sequences;
  for (auto& [key, items] : by_key) {
    sequences.push_back({sets.members(key.first), key.second, std::move(items)});
  }
  internal::EmitFolded(sequences, r, logical_strides, builder);
}

}  // namespace

Result<ParamMap> Infer(const IndexMaps& observed, const InferOptions& options) {
  auto numel = CheckedProduct(observed.logical_shape);
  if (!numel.ok()) return numel.status().Annotate("logical_shape");
  const Index n = *numel;
  if (observed.ranks.empty())
    return InvalidArgumentError("ranks is empty: observe at least one rank");
  RESHARD_RETURN_IF_ERROR(CheckValidShape(observed));
  RESHARD_ASSIGN_OR_RETURN(const std::vector<const ObservedShard*> by_rank, ShardsByRank(observed));
  Index entries = 0;
  for (const ObservedShard& s : observed.ranks) {
    for (const Index e : s.index_map) entries += e >= 0 ? 1 : 0;
  }
  HolderSets sets;
  HolderTable holders(n, entries);
  RESHARD_RETURN_IF_ERROR(CollectHolders(observed, by_rank, n, sets, holders));
  if (!options.allow_uncovered) RESHARD_RETURN_IF_ERROR(CheckCovered(observed, n, holders));
  const int world = static_cast<int>(by_rank.size());
  ParamMapBuilder builder;
  builder.set_logical_shape(observed.logical_shape);
  builder.set_valid_shape(observed.valid_shape);
  builder.set_world_size(world);
  const Shape logical_strides = RowMajorStrides(observed.logical_shape);
  for (Rank r = 0; r < world; ++r) {
    AddRankPieces(*by_rank[static_cast<size_t>(r)], r, sets, holders, logical_strides, builder);
  }
  RESHARD_ASSIGN_OR_RETURN(ParamMap folded,
                           builder.Finalize({.require_coverage = !options.allow_uncovered}));
  return Canonicalize(folded);
}

IndexMaps ToIndexMaps(const ParamMap& map) {
  IndexMaps out;
  out.logical_shape = map.logical_shape();
  if (map.has_padding()) out.valid_shape = map.valid_shape();
  bool scaled = false;
  for (const RankShard& shard : map.ranks()) {
    for (const Piece& p : shard.pieces) scaled |= p.scale != 1.0;
  }
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankShard& shard = map.rank(r);
    ObservedShard s;
    s.rank = r;
    s.shard_shape = shard.shard_shape;
    s.buffer = shard.buffer;
    s.index_map.assign(static_cast<size_t>(ProductOf(shard.shard_shape)), -1);
    if (scaled) s.scale.assign(s.index_map.size(), 1.0);
    for (const Piece& p : shard.pieces) {
      if (p.num_elements() == 0) continue;
      std::vector<Index> index(p.shape.size(), 0);
      while (true) {
        Index src = p.source.offset;
        Index dst = p.dest.offset;
        for (size_t k = 0; k < index.size(); ++k) {
          src += index[k] * p.source.strides[k];
          dst += index[k] * p.dest.strides[k];
        }
        s.index_map[static_cast<size_t>(dst)] = src;
        if (scaled) s.scale[static_cast<size_t>(dst)] = p.scale;
        size_t k = index.size();
        while (k > 0) {
          if (++index[k - 1] < p.shape[k - 1]) break;
          index[k - 1] = 0;
          --k;
        }
        if (k == 0) break;
      }
    }
    out.ranks.push_back(std::move(s));
  }
  return out;
}

namespace {

using json::ErrorAt;
using json::Json;
using json::Member;
using json::TypeError;

Result<std::vector<double>> ReadScale(const Json& j, std::string_view path) {
  std::vector<double> scale;
  if (j.is_number()) {
    RESHARD_ASSIGN_OR_RETURN(double v, json::ReadNumber(j, path));
    scale.push_back(v);
  } else if (j.is_array()) {
    for (size_t k = 0; k < j.size(); ++k) {
      RESHARD_ASSIGN_OR_RETURN(double v, json::ReadNumber(j[k], json::Element(path, k)));
      scale.push_back(v);
    }
  } else {
    return TypeError(path, "a number or an array of numbers", j);
  }
  return scale;
}

Result<ObservedShard> ReadObservedShard(const Json& r, std::string_view path) {
  if (!r.is_object()) return TypeError(path, "an object", r);
  ObservedShard s;
  RESHARD_ASSIGN_OR_RETURN(const Json* rank, json::Require(r, path, "rank"));
  RESHARD_ASSIGN_OR_RETURN(const Json* shard_shape, json::Require(r, path, "shard_shape"));
  RESHARD_ASSIGN_OR_RETURN(const Json* index_map, json::Require(r, path, "index_map"));
  RESHARD_ASSIGN_OR_RETURN(
      Index id, json::ReadInt(*rank, Member(path, "rank"), {0, std::numeric_limits<Rank>::max()}));
  s.rank = static_cast<Rank>(id);
  RESHARD_ASSIGN_OR_RETURN(s.shard_shape,
                           json::ReadIntArray(*shard_shape, Member(path, "shard_shape")));
  RESHARD_ASSIGN_OR_RETURN(s.index_map, json::ReadIntArray(*index_map, Member(path, "index_map")));
  if (const Json* buffer = json::Find(r, "buffer"); buffer != nullptr && !buffer->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(s.buffer, json::ReadString(*buffer, Member(path, "buffer")));
  }
  if (const Json* scale = json::Find(r, "scale"); scale != nullptr && !scale->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(s.scale, ReadScale(*scale, Member(path, "scale")));
  }
  return s;
}

}  // namespace

Result<IndexMaps> ParseIndexMapsJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(Json doc, json::ParseJson(text));
  if (!doc.is_object()) return TypeError("", "an object", doc);
  IndexMaps out;
  RESHARD_ASSIGN_OR_RETURN(const Json* shape, json::Require(doc, "", "logical_shape"));
  RESHARD_ASSIGN_OR_RETURN(out.logical_shape, json::ReadIntArray(*shape, "logical_shape"));
  if (const Json* valid = json::Find(doc, "valid_shape"); valid != nullptr && !valid->is_null()) {
    RESHARD_ASSIGN_OR_RETURN(Shape v, json::ReadIntArray(*valid, "valid_shape"));
    out.valid_shape = std::move(v);
  }
  RESHARD_ASSIGN_OR_RETURN(const Json* ranks, json::Require(doc, "", "ranks"));
  if (!ranks->is_array()) return TypeError("ranks", "an array", *ranks);
  for (size_t i = 0; i < ranks->size(); ++i) {
    RESHARD_ASSIGN_OR_RETURN(ObservedShard s,
                             ReadObservedShard((*ranks)[i], json::Element("ranks", i)));
    out.ranks.push_back(std::move(s));
  }
  return out;
}

}  // namespace reshard
