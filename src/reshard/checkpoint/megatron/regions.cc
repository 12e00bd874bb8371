#include "reshard/checkpoint/megatron/regions.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>

namespace reshard {

void AddWholeDim(TensorRegion& r, Index size) { AddSplitDim(r, {size}, {0}, {size}); }

void AddIndexDim(TensorRegion& r, Index size, Index at) { AddSplitDim(r, {size}, {at}, {1}); }

void AddSplitDim(TensorRegion& r, Shape factors, Shape offsets, Shape sizes) {
  r.factors.push_back(std::move(factors));
  r.offsets.insert(r.offsets.end(), offsets.begin(), offsets.end());
  r.sizes.insert(r.sizes.end(), sizes.begin(), sizes.end());
}

Index RegionElements(const TensorRegion& r) { return ProductOf(r.sizes); }

Status CheckRegion(const TensorRegion& r, const Shape& shape) {
  if (r.factors.size() != shape.size()) {
    return InvalidArgumentError(fmt::format("a region of {} dims for a tensor of shape {}",
                                            r.factors.size(), FormatShape(shape)));
  }
  size_t k = 0;
  for (size_t j = 0; j < shape.size(); ++j) {
    if (ProductOf(r.factors[j]) != shape[j]) {
      return InvalidArgumentError(fmt::format("dim {} of shape {} split as {}", j,
                                              FormatShape(shape), FormatShape(r.factors[j])));
    }
    for (const Index f : r.factors[j]) {
      if (k >= r.offsets.size() || k >= r.sizes.size() || r.offsets[k] < 0 || r.sizes[k] < 0 ||
          r.offsets[k] + r.sizes[k] > f) {
        return InvalidArgumentError(
            fmt::format("the region's box [{}] + [{}] lies outside the view of shape {}",
                        fmt::join(r.offsets, ", "), fmt::join(r.sizes, ", "), FormatShape(shape)));
      }
      ++k;
    }
  }
  if (k != r.offsets.size() || k != r.sizes.size()) {
    return InvalidArgumentError("the region's box has more dims than its factors");
  }
  return Status::Ok();
}

namespace {

// [begin, end) of a dim seen as factors[from..]: appends its boxes, prefixed.
void RangeBoxesInto(Index begin, Index end, const Shape& factors, size_t from, Shape off,
                    Shape size, std::vector<std::pair<Shape, Shape>>& out) {
  if (begin >= end) return;
  if (from + 1 == factors.size()) {
    off.push_back(begin);
    size.push_back(end - begin);
    out.emplace_back(std::move(off), std::move(size));
    return;
  }
  Index inner = 1;
  for (size_t k = from + 1; k < factors.size(); ++k) inner *= factors[k];
  const auto with = [&](const Shape& base, Index v) {
    Shape s = base;
    s.push_back(v);
    return s;
  };
  if (begin % inner != 0) {  // the head: part of one row of the outer factor
    const Index row = begin / inner;
    const Index stop = std::min(end, (row + 1) * inner);
    RangeBoxesInto(begin - row * inner, stop - row * inner, factors, from + 1, with(off, row),
                   with(size, 1), out);
    begin = stop;
  }
  const Index first = begin / inner;
  const Index last = end / inner;  // rows [first, last) whole
  if (begin < end && last > first) {
    Shape o = with(off, first);
    Shape s = with(size, last - first);
    for (size_t k = from + 1; k < factors.size(); ++k) {
      o.push_back(0);
      s.push_back(factors[k]);
    }
    out.emplace_back(std::move(o), std::move(s));
    begin = last * inner;
  }
  if (begin < end) {  // the tail
    RangeBoxesInto(0, end - last * inner, factors, from + 1, with(off, last), with(size, 1), out);
  }
}

}  // namespace

std::vector<std::pair<Shape, Shape>> RangeBoxes(Index begin, Index end, const Shape& factors) {
  std::vector<std::pair<Shape, Shape>> out;
  RangeBoxesInto(begin, end, factors, 0, {}, {}, out);
  return out;
}

std::vector<Piece> RegionPieces(const TensorRegion& region, const Shape& box_offsets,
                                const Shape& box_sizes, const StridedView& box_dest, Rank rank) {
  const size_t dims = region.factors.size();
  // Per dim: the boxes of the stored box's range in the refined view.
  std::vector<std::vector<std::pair<Shape, Shape>>> per_dim(dims);
  for (size_t j = 0; j < dims; ++j) {
    per_dim[j] = RangeBoxes(box_offsets[j], box_offsets[j] + box_sizes[j], region.factors[j]);
    if (per_dim[j].empty()) return {};
  }
  const Shape source_strides = RowMajorStrides(region.sizes);
  // Per refined dim: the dest stride (the box's stride of its dim times the later factors).
  Shape dest_strides;
  for (size_t j = 0; j < dims; ++j) {
    const Shape& f = region.factors[j];
    for (size_t t = 0; t < f.size(); ++t) {
      Index later = 1;
      for (size_t u = t + 1; u < f.size(); ++u) later *= f[u];
      dest_strides.push_back(box_dest.strides[j] * later);
    }
  }
  std::vector<Piece> pieces;
  std::vector<size_t> pick(dims, 0);
  while (true) {
    // One box of the product: intersect it with the region.
    Shape lo, hi;
    for (size_t j = 0; j < dims; ++j) {
      const auto& [o, s] = per_dim[j][pick[j]];
      for (size_t t = 0; t < o.size(); ++t) {
        lo.push_back(o[t]);
        hi.push_back(o[t] + s[t]);
      }
    }
    bool empty = false;
    for (size_t k = 0; k < lo.size(); ++k) {
      lo[k] = std::max(lo[k], region.offsets[k]);
      hi[k] = std::min(hi[k], region.offsets[k] + region.sizes[k]);
      if (lo[k] >= hi[k]) empty = true;
    }
    if (!empty) {
      Piece p;
      p.locations = {rank};
      Index source = 0;
      Index dest = box_dest.offset;
      for (size_t k = 0; k < lo.size(); ++k)
        source += (lo[k] - region.offsets[k]) * source_strides[k];
      // The tensor index of the piece's first element, per dim, relative to the stored box.
      size_t k = 0;
      for (size_t j = 0; j < dims; ++j) {
        Index at = 0;
        for (size_t t = 0; t < region.factors[j].size(); ++t, ++k) {
          at = at * region.factors[j][t] + lo[k];
        }
        dest += (at - box_offsets[j]) * box_dest.strides[j];
      }
      p.source.offset = source;
      p.dest.offset = dest;
      // Dims of one element fall away; neighbours contiguous in both views merge.
      for (size_t q = 0; q < lo.size(); ++q) {
        const Index n = hi[q] - lo[q];
        if (n == 1) continue;
        if (!p.shape.empty() && p.source.strides.back() == n * source_strides[q] &&
            p.dest.strides.back() == n * dest_strides[q]) {
          p.shape.back() *= n;
          p.source.strides.back() = source_strides[q];
          p.dest.strides.back() = dest_strides[q];
          continue;
        }
        p.shape.push_back(n);
        p.source.strides.push_back(source_strides[q]);
        p.dest.strides.push_back(dest_strides[q]);
      }
      if (p.shape.empty()) {
        p.shape = {1};
        p.source.strides = {1};
        p.dest.strides = {1};
      }
      pieces.push_back(std::move(p));
    }
    size_t j = dims;
    while (j > 0) {
      --j;
      if (++pick[j] < per_dim[j].size()) break;
      pick[j] = 0;
      if (j == 0) return pieces;
    }
    if (dims == 0) return pieces;
  }
}

}  // namespace reshard
