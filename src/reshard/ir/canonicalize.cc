#include "reshard/ir/canonicalize.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <unordered_map>

#include "reshard/ir/fold.h"

namespace reshard {

using internal::FoldDim;
using internal::FoldedPiece;
using internal::FoldItem;
using internal::Pair;

namespace {

// Splits dims that cross a dimension of F, for readable pieces.
std::vector<FoldDim> SplitAtLogicalStrides(const std::vector<FoldDim>& dims,
                                           const Shape& logical_strides) {
  std::vector<FoldDim> out;
  for (FoldDim d : dims) {
    bool split = true;
    while (split) {
      split = false;
      for (Index l : logical_strides) {
        const Index s = d.stride.src;
        if (l > s && l < s * d.extent && l % s == 0 && d.extent % (l / s) == 0) {
          const Index inner = l / s;
          out.push_back({d.extent / inner, d.stride * inner});
          d = {inner, d.stride};
          split = true;
          break;
        }
      }
    }
    out.push_back(d);
  }
  return out;
}

Piece MakePiece(const FoldedPiece& folded, const Shape& logical_strides,
                const std::vector<Rank>& locations, double scale) {
  const std::vector<FoldDim> dims = SplitAtLogicalStrides(folded.dims, logical_strides);
  Piece p;
  for (const FoldDim& d : dims) {
    p.shape.push_back(d.extent);
    p.source.strides.push_back(d.stride.src);
    p.dest.strides.push_back(d.stride.dst);
  }
  if (p.shape.empty()) {  // a single element: keep the rank of F for readability
    p.shape.assign(logical_strides.size(), 1);
    p.source.strides = logical_strides;
    p.dest.strides.assign(logical_strides.size(), 1);
  }
  p.source.offset = folded.offset.src;
  p.dest.offset = folded.offset.dst;
  p.locations = locations;
  p.scale = scale;
  return p;
}

void AddInShardOrder(std::vector<Piece> pieces, Rank rank, ParamMapBuilder& builder) {
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.dest.offset < b.dest.offset; });
  for (Piece& p : pieces) builder.add_piece(rank, std::move(p));
}

}  // namespace

namespace internal {

void EmitFolded(const std::vector<KeyedSequence>& sequences, Rank rank,
                const Shape& logical_strides, ParamMapBuilder& builder) {
  std::vector<Piece> pieces;
  for (const KeyedSequence& seq : sequences) {
    for (const FoldedPiece& folded : FoldSequence(seq.items)) {
      pieces.push_back(MakePiece(folded, logical_strides, seq.locations, seq.scale));
    }
  }
  AddInShardOrder(std::move(pieces), rank, builder);
}

}  // namespace internal

namespace {

struct PieceDim {
  Index extent, src, dst;
};

// The piece's dims (extent > 1) in the shard's row-major order.
std::vector<PieceDim> DestOrdered(const Piece& p) {
  std::vector<PieceDim> dims;
  for (size_t k = 0; k < p.shape.size(); ++k) {
    if (p.shape[k] > 1) dims.push_back({p.shape[k], p.source.strides[k], p.dest.strides[k]});
  }
  std::sort(dims.begin(), dims.end(),
            [](const PieceDim& a, const PieceDim& b) { return a.dst > b.dst; });
  return dims;
}

// The piece as items of its key's sequence: one item (`whole`), or its blocks that are
// contiguous in the shard (to be interleaved in shard order with other pieces' blocks).
void AddPieceItems(const Piece& p, bool whole, std::vector<std::pair<Index, FoldItem>>& out) {
  const std::vector<PieceDim> dims = DestOrdered(p);
  size_t inner = 0;
  if (!whole) {
    inner = dims.size();
    Index span = 1;
    while (inner > 0 && dims[inner - 1].dst == span) {
      span *= dims[inner - 1].extent;
      --inner;
    }
  }
  FoldItem base;
  for (size_t k = inner; k < dims.size(); ++k) {
    base.dims.push_back({dims[k].extent, {dims[k].dst, dims[k].src}});
  }
  std::vector<Index> index(inner, 0);
  while (true) {
    Pair offset{p.dest.offset, p.source.offset};
    for (size_t k = 0; k < inner; ++k) offset = offset + Pair{dims[k].dst, dims[k].src} * index[k];
    FoldItem item = base;
    item.offset = offset;
    out.emplace_back(offset.dst, std::move(item));
    size_t k = inner;
    while (k > 0) {
      if (++index[k - 1] < dims[k - 1].extent) break;
      index[k - 1] = 0;
      --k;
    }
    if (k == 0) break;
  }
}

// Interleaved pieces are joined by listing their contiguous blocks; past this many blocks a
// group that is not periodic (below) keeps its pieces as they are rather than list them all.
constexpr Index kMaxJoinBlocks = Index{1} << 16;

// The number of contiguous blocks AddPieceItems lists for `p` (capped at kMaxJoinBlocks + 1).
Index CountBlocks(const Piece& p) {
  const std::vector<PieceDim> dims = DestOrdered(p);
  size_t inner = dims.size();
  Index span = 1;
  while (inner > 0 && dims[inner - 1].dst == span) {
    span *= dims[inner - 1].extent;
    --inner;
  }
  Index count = 1;
  for (size_t k = 0; k < inner; ++k) {
    count *= dims[k].extent;
    if (count > kMaxJoinBlocks) return kMaxJoinBlocks + 1;
  }
  return count;
}

// Interleaved pieces that share their outer dims (column blocks of one matrix: every piece
// has the rows, with the same strides) repeat one period per outer index. When one period's
// blocks fold to a single piece, the group is that piece repeated over the outer dims: one
// item, the same sequence the blocks would list, found without listing every row.
std::optional<FoldItem> FoldPeriodicGroup(const std::vector<const Piece*>& group) {
  std::vector<std::vector<PieceDim>> dims;
  for (const Piece* p : group) dims.push_back(DestOrdered(*p));
  size_t shared = 0;
  while (std::all_of(dims.begin(), dims.end(), [&](const std::vector<PieceDim>& d) {
    return d.size() > shared && d[shared].extent == dims[0][shared].extent &&
           d[shared].dst == dims[0][shared].dst && d[shared].src == dims[0][shared].src;
  })) {
    ++shared;
  }
  // The most outer dims that nest without overlap and leave each period's blocks inside the
  // innermost outer step.
  for (size_t common = shared; common > 0; --common) {
    bool nested = true;
    for (size_t k = 0; k + 1 < common; ++k) {
      nested = nested && dims[0][k].dst >= dims[0][k + 1].dst * dims[0][k + 1].extent;
    }
    if (!nested) continue;
    std::vector<Piece> rests;
    Index first = group[0]->dest.offset, last = first;
    for (size_t i = 0; i < group.size(); ++i) {
      Piece rest = *group[i];
      rest.shape.clear();
      rest.source.strides.clear();
      rest.dest.strides.clear();
      for (size_t k = common; k < dims[i].size(); ++k) {
        rest.shape.push_back(dims[i][k].extent);
        rest.source.strides.push_back(dims[i][k].src);
        rest.dest.strides.push_back(dims[i][k].dst);
      }
      first = std::min(first, rest.dest.offset);
      last = std::max(last, *LastOffset(rest.dest.offset, rest.shape, rest.dest.strides));
      rests.push_back(std::move(rest));
    }
    if (last - first >= dims[0][common - 1].dst) continue;
    std::vector<std::pair<Index, FoldItem>> blocks;
    Index count = 0;
    for (const Piece& rest : rests) count += CountBlocks(rest);
    if (count > kMaxJoinBlocks) return std::nullopt;
    for (const Piece& rest : rests) AddPieceItems(rest, false, blocks);
    std::stable_sort(blocks.begin(), blocks.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<FoldItem> period_items;
    for (auto& b : blocks) internal::AppendItem(period_items, std::move(b.second));
    std::vector<FoldedPiece> period = internal::FoldSequence(period_items);
    if (period.size() != 1) return std::nullopt;
    FoldItem item{period[0].offset, {}};
    for (size_t k = 0; k < common; ++k) {
      item.dims.push_back({dims[0][k].extent, {dims[0][k].dst, dims[0][k].src}});
    }
    item.dims.insert(item.dims.end(), period[0].dims.begin(), period[0].dims.end());
    return item;
  }
  return std::nullopt;
}

}  // namespace

namespace {

// One pass: each key's sequence folded, partitioned at the input's piece boundaries where it
// does not fold whole.
Result<ParamMap> CanonicalizeOnce(const ParamMap& map) {
  const Shape logical_strides = RowMajorStrides(map.logical_shape());
  ParamMapBuilder builder;
  builder.set_logical_shape(map.logical_shape());
  if (map.has_padding()) builder.set_valid_shape(map.valid_shape());
  builder.set_world_size(map.world_size());
  using Key = std::pair<std::vector<Rank>, double>;
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankShard& shard = map.rank(r);
    builder.set_shard_shape(r, shard.shard_shape);
    builder.set_buffer(r, shard.buffer);
    // Pieces by key, with their spans in the shard.
    std::map<Key, std::vector<size_t>> by_key;
    for (size_t i = 0; i < shard.pieces.size(); ++i) {
      if (shard.pieces[i].num_elements() == 0) continue;
      by_key[{shard.pieces[i].locations, shard.pieces[i].scale}].push_back(i);
    }
    std::vector<Piece> out;
    auto emit = [&](const Key& key, const std::vector<FoldedPiece>& folded) {
      for (const FoldedPiece& f : folded) {
        out.push_back(MakePiece(f, logical_strides, key.first, key.second));
      }
    };
    for (auto& [key, indices] : by_key) {
      struct Span {
        Index first, last;
        size_t piece;
      };
      std::vector<Span> spans;
      for (size_t i : indices) {
        const Piece& p = shard.pieces[i];
        spans.push_back({p.dest.offset, *LastOffset(p.dest.offset, p.shape, p.dest.strides), i});
      }
      std::sort(spans.begin(), spans.end(),
                [](const Span& a, const Span& b) { return a.first < b.first; });
      // Pieces whose spans in the shard overlap interleave: their blocks join the key's
      // sequence in shard order when that folds to no more pieces than they are (column
      // blocks of one matrix do), else each stays a piece of its own (pieces interleaved
      // element by element, which no contiguous cut of the sequence describes as well).
      // The joined groups, each with the number of input pieces it stands for.
      std::vector<std::pair<std::vector<std::pair<Index, FoldItem>>, size_t>> groups;
      size_t s = 0;
      while (s < spans.size()) {
        size_t e = s + 1;
        Index reach = spans[s].last;
        while (e < spans.size() && spans[e].first <= reach)
          reach = std::max(reach, spans[e++].last);
        std::vector<const Piece*> group;
        Index block_count = 0;
        for (size_t c = s; c < e; ++c) {
          group.push_back(&shard.pieces[spans[c].piece]);
          block_count = std::min(block_count + CountBlocks(*group.back()), kMaxJoinBlocks + 1);
        }
        std::vector<std::pair<Index, FoldItem>> blocks;
        bool join = e - s == 1;
        std::optional<FoldItem> periodic;
        if (!join) periodic = FoldPeriodicGroup(group);
        if (periodic) {
          join = true;
          blocks.emplace_back(periodic->offset.dst, std::move(*periodic));
        } else if (join || block_count <= kMaxJoinBlocks) {
          for (const Piece* p : group) AddPieceItems(*p, e - s == 1, blocks);
        }
        if (!join && !blocks.empty()) {
          std::stable_sort(blocks.begin(), blocks.end(),
                           [](const auto& a, const auto& b) { return a.first < b.first; });
          std::vector<FoldItem> trial;
          for (const auto& b : blocks) internal::AppendItem(trial, b.second);
          join = internal::FoldSequence(trial).size() <= e - s;
        }
        if (join) {
          groups.emplace_back(std::move(blocks), e - s);
        } else {
          for (size_t c = s; c < e; ++c) {
            std::vector<std::pair<Index, FoldItem>> alone;
            AddPieceItems(shard.pieces[spans[c].piece], true, alone);
            emit(key, internal::FoldSequence({std::move(alone[0].second)}));
          }
        }
        s = e;
      }
      auto in_shard_order = [](std::vector<std::pair<Index, FoldItem>> blocks) {
        std::stable_sort(blocks.begin(), blocks.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
        std::vector<FoldItem> items;
        for (auto& b : blocks) internal::AppendItem(items, std::move(b.second));
        return items;
      };
      // The key's groups fold as one sequence, unless the fold's greedy partition of the
      // whole would take more pieces than the groups folded one by one (each folds to no more
      // than the pieces it joins): a pass never adds pieces.
      std::vector<std::pair<Index, FoldItem>> joined;
      size_t joined_pieces = 0;
      for (const auto& [blocks, count] : groups) {
        joined.insert(joined.end(), blocks.begin(), blocks.end());
        joined_pieces += count;
      }
      std::vector<FoldedPiece> whole = internal::FoldSequence(in_shard_order(std::move(joined)));
      if (whole.size() <= joined_pieces) {
        emit(key, whole);
      } else {
        for (auto& [blocks, count] : groups) {
          emit(key, internal::FoldSequence(in_shard_order(std::move(blocks))));
        }
      }
    }
    AddInShardOrder(std::move(out), r, builder);
  }
  return builder.Finalize({.require_coverage = false});
}

}  // namespace

Result<ParamMap> Canonicalize(const ParamMap& map) {
  // A pass only ever merges pieces; repeat until nothing changes, so the result is a fixed
  // point (canonicalising it again is the identity) even where a partition's greedy choice
  // depended on how the input was cut.
  RESHARD_ASSIGN_OR_RETURN(ParamMap current, CanonicalizeOnce(map));
  for (int pass = 0; pass < 32; ++pass) {
    RESHARD_ASSIGN_OR_RETURN(ParamMap next, CanonicalizeOnce(current));
    if (next == current) return current;
    current = std::move(next);
  }
  return current;
}

}  // namespace reshard
