// Regions: which elements of a Megatron-Core tensor are one Hugging Face tensor, and the
// pieces that follow from them.
//
// Megatron fuses and stacks: `linear_qkv` holds, for each query group, its n query heads then
// its key head then its value head (rows [q1 ... qn k v] per group); `linear_fc1` of a SwiGLU
// MLP holds all gate rows then all up rows; dist-ckpt stacks layers ([L, ...]) and experts
// ([E, ...]). Every Hugging Face tensor is then a box of a *refined view* of the Megatron
// tensor: each dim split into factors (rows [G * (n + 2) * d] seen as [G, (n + 2) * d]), the
// box's elements, row-major, being the HF tensor's. q_proj of layer l of a stacked [L, G(n+2)d, H]
// is the box offsets [l, 0, 0, 0], sizes [1, G, n*d, H] of the view [L][G, (n+2)d][H].
//
// A stored chunk of the Megatron tensor (a DCP box, its elements row-major at some offset of a
// rank's buffer) holds a part of the region: RegionPieces turns it into the pieces of the HF
// tensor's map, their dest indexing the buffer (strided: a chunk of `linear_qkv` gives the
// HF q_proj one piece per query group it holds, or one strided piece spanning them).
#ifndef RESHARD_CHECKPOINT_MEGATRON_REGIONS_H_
#define RESHARD_CHECKPOINT_MEGATRON_REGIONS_H_

#include <utility>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// A box of a refined view of a tensor: `factors[j]` splits dim j row-major (their product is
/// the dim's size); `offsets` and `sizes` have one entry per factor, dims in order.
struct TensorRegion {
  std::vector<Shape> factors;
  Shape offsets;
  Shape sizes;
};

/// Dim j taken whole (one factor).
void AddWholeDim(TensorRegion& r, Index size);
/// Dim j of `size`, index `at` alone (a layer of a stacked tensor, an expert).
void AddIndexDim(TensorRegion& r, Index size, Index at);
/// Dim j split into the given factors and the box [offsets, offsets + sizes) of them.
void AddSplitDim(TensorRegion& r, Shape factors, Shape offsets, Shape sizes);

/// Elements of the region.
Index RegionElements(const TensorRegion& r);

/// Checks the region against the tensor's shape (factors multiply to each dim, the box lies in
/// the view). InvalidArgument otherwise.
Status CheckRegion(const TensorRegion& r, const Shape& shape);

/// The pieces of the region's tensor (F: the region's elements, row-major) that a stored box
/// of the tensor holds: the box `box_offsets` + `box_sizes` of the tensor, its element at box-local
/// index i at `box_dest.offset + sum_j i_j * box_dest.strides[j]` of the holder's buffer. Each
/// piece is held by `rank` alone. Empty when the box misses the region.
std::vector<Piece> RegionPieces(const TensorRegion& region, const Shape& box_offsets,
                                const Shape& box_sizes, const StridedView& box_dest, Rank rank);

/// The boxes that the range [begin, end) of a dim covers in the dim's refined view (split into
/// `factors`): (offsets, sizes) in the factors' coordinates, at most 2 * factors - 1 of them.
std::vector<std::pair<Shape, Shape>> RangeBoxes(Index begin, Index end, const Shape& factors);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_MEGATRON_REGIONS_H_
