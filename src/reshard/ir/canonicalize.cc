#include "reshard/ir/canonicalize.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "reshard/ir/fold.h"

namespace reshard {

using internal::FoldDim;
using internal::FoldedPiece;
using internal::FoldItem;

namespace {

// A run of consecutive shard elements sharing one key (holders and scale).
struct Segment {
  std::vector<Rank> locations;
  double scale = 1.0;
  Index dest_start = 0;
  std::vector<FoldItem> items;
};

// Splits dims that cross a dimension of F, for readable pieces.
std::vector<FoldDim> SplitAtLogicalStrides(const std::vector<FoldDim>& dims,
                                           const Shape& logical_strides) {
  std::vector<FoldDim> out;
  for (FoldDim d : dims) {
    std::vector<FoldDim> parts;
    bool split = true;
    while (split) {
      split = false;
      for (Index l : logical_strides) {
        if (l > d.stride && l < d.stride * d.extent && l % d.stride == 0 &&
            d.extent % (l / d.stride) == 0) {
          const Index inner = l / d.stride;
          out.push_back({d.extent / inner, l});
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

Piece MakePiece(const FoldedPiece& folded, Index dest_offset, const Shape& logical_strides,
                const std::vector<Rank>& locations, double scale) {
  const std::vector<FoldDim> dims = SplitAtLogicalStrides(folded.dims, logical_strides);
  Piece p;
  for (const FoldDim& d : dims) {
    p.shape.push_back(d.extent);
    p.source.strides.push_back(d.stride);
  }
  if (p.shape.empty()) {  // a single element: keep the rank of F for readability
    p.shape.assign(logical_strides.size(), 1);
    p.source.strides = logical_strides;
  }
  p.source.offset = folded.source_offset;
  p.dest.offset = dest_offset;
  p.dest.strides = RowMajorStrides(p.shape);
  p.locations = locations;
  p.scale = scale;
  return p;
}

// Folds every segment of a rank and adds the pieces to the builder.
void EmitSegments(std::vector<Segment>& segments, Rank rank, const Shape& logical_strides,
                  ParamMapBuilder& builder) {
  for (Segment& seg : segments) {
    Index dest = seg.dest_start;
    for (const FoldedPiece& folded : internal::FoldSequence(seg.items)) {
      builder.add_piece(rank, MakePiece(folded, dest, logical_strides, seg.locations, seg.scale));
      dest += folded.num_elements;
    }
  }
}

void AddToSegments(std::vector<Segment>& segments, const std::vector<Rank>& locations,
                   double scale, Index dest_offset, FoldItem item) {
  if (segments.empty() || segments.back().locations != locations ||
      segments.back().scale != scale) {
    segments.push_back({locations, scale, dest_offset, {}});
  }
  internal::AppendItem(segments.back().items, std::move(item));
}

// One dest-contiguous block of a piece.
struct Chunk {
  Index dest_offset;
  FoldItem item;
  size_t piece;
};

}  // namespace

Result<ParamMap> Canonicalize(const ParamMap& map) {
  const Shape logical_strides = RowMajorStrides(map.logical_shape());
  ParamMapBuilder builder;
  builder.set_logical_shape(map.logical_shape());
  if (map.has_padding()) builder.set_valid_shape(map.valid_shape());
  builder.set_world_size(map.world_size());
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankShard& shard = map.rank(r);
    builder.set_shard_shape(r, shard.shard_shape);
    std::vector<Chunk> chunks;
    for (size_t i = 0; i < shard.pieces.size(); ++i) {
      const Piece& p = shard.pieces[i];
      if (p.num_elements() == 0) continue;
      struct Dim {
        Index extent, src, dst;
      };
      std::vector<Dim> dims;
      for (size_t k = 0; k < p.shape.size(); ++k) {
        if (p.shape[k] > 1) dims.push_back({p.shape[k], p.source.strides[k], p.dest.strides[k]});
      }
      std::sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.dst > b.dst; });
      // The innermost dims that are row-major contiguous in the shard form one chunk; the
      // others are walked.
      size_t inner = dims.size();
      Index span = 1;
      while (inner > 0 && dims[inner - 1].dst == span) {
        span *= dims[inner - 1].extent;
        --inner;
      }
      FoldItem base{0, {}};
      for (size_t k = inner; k < dims.size(); ++k) base.dims.push_back({dims[k].extent, dims[k].src});
      std::vector<Index> index(inner, 0);
      while (true) {
        Index src = p.source.offset;
        Index dst = p.dest.offset;
        for (size_t k = 0; k < inner; ++k) {
          src += index[k] * dims[k].src;
          dst += index[k] * dims[k].dst;
        }
        FoldItem item = base;
        item.offset = src;
        chunks.push_back({dst, std::move(item), i});
        size_t k = inner;
        while (k > 0) {
          if (++index[k - 1] < dims[k - 1].extent) break;
          index[k - 1] = 0;
          --k;
        }
        if (k == 0) break;
      }
    }
    std::sort(chunks.begin(), chunks.end(),
              [](const Chunk& a, const Chunk& b) { return a.dest_offset < b.dest_offset; });
    std::vector<Segment> segments;
    for (Chunk& c : chunks) {
      const Piece& p = shard.pieces[c.piece];
      AddToSegments(segments, p.locations, p.scale, c.dest_offset, std::move(c.item));
    }
    EmitSegments(segments, r, logical_strides, builder);
  }
  return builder.Finalize({.require_coverage = false});
}

}  // namespace reshard
