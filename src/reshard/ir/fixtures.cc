#include "reshard/ir/fixtures.h"

#include <utility>

namespace reshard::fixtures {

Piece MakePiece(Shape shape, Index src_offset, Shape src_strides, Index dst_offset,
                Shape dst_strides, std::vector<Rank> locations, double scale) {
  return Piece{std::move(shape),
               {src_offset, std::move(src_strides)},
               {dst_offset, std::move(dst_strides)},
               std::move(locations),
               scale};
}

ParamMapBuilder SplitBuilder(const Shape& shape, size_t dim, const std::vector<Index>& sizes,
                             double scale) {
  ParamMapBuilder b;
  b.set_logical_shape(shape);
  const Shape strides = RowMajorStrides(shape);
  Index start = 0;
  for (size_t r = 0; r < sizes.size(); ++r) {
    Shape shard = shape;
    shard[dim] = sizes[r];
    b.set_shard_shape(static_cast<Rank>(r), shard);
    b.add_piece(static_cast<Rank>(r),
                MakePiece(shard, start * strides[dim], strides, 0, RowMajorStrides(shard),
                          {static_cast<Rank>(r)}, scale));
    start += sizes[r];
  }
  return b;
}

ParamMapBuilder BigCodeBuilder(int world) {
  ParamMapBuilder b;
  b.set_logical_shape({48, 8});
  std::vector<Rank> all;
  for (Rank r = 0; r < world; ++r) all.push_back(r);
  const Index q = 32 / world;
  for (Rank r = 0; r < world; ++r) {
    b.set_shard_shape(r, {q + 16, 8});
    b.add_piece(r, MakePiece({q, 8}, r * q * 8, {8, 1}, 0, {8, 1}, {r}));
    b.add_piece(r, MakePiece({16, 8}, 256, {8, 1}, q * 8, {8, 1}, all));
  }
  return b;
}

}  // namespace reshard::fixtures
