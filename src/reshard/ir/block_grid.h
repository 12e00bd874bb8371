// Block grids: the scales of a block-quantized tensor as the block image of its data's map
// (DESIGN 20).
//
// A block-quantized weight is two checkpoint tensors: data D of logical shape L and scales S,
// one per block of a grid with block shape B (an extent per dimension of D: [128, 128] for
// DeepSeek's FP8, [1, 16] bytes for NVFP4 over its packed data, [1, K] per channel, all of L
// per tensor). S's logical shape is the grid ceil(L / B), stored with its unit dimensions
// possibly dropped or added (MXFP4's [E, R, G] scales of [E, R, G, 16] blocks).
//
// A rank's shard of D (or its buffer) has a local grid of its own, ceil(shard / B) with B
// aligned to the shard's last dimensions, and the rank holds one scale per local block: the
// scale of the block of D its elements come from. That is exact only when every local block
// lies inside one block of D; a piece boundary inside a block of D is fine (every rank that
// touches the block then holds its scale: a multi-holder piece).
#ifndef RESHARD_IR_BLOCK_GRID_H_
#define RESHARD_IR_BLOCK_GRID_H_

#include <functional>
#include <string>
#include <string_view>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// ceil(shape / block) per dimension, `block` aligned to the last dimensions of `shape` (a
/// shape with more leading dimensions than `block` has takes blocks of 1 there).
/// \error InvalidArgument  a block extent below 1, or more block dimensions than `shape`.
Result<Shape> BlockGridShape(const Shape& shape, const Shape& block);

/// Whether `stored` is `grid` up to unit dimensions (added or dropped): how scale tensors are
/// stored. A grid of one element matches any stored shape of one element.
bool MatchesGrid(const Shape& stored, const Shape& grid);

/// What a sharded checkpoint records of a scale tensor: the data tensor it scales and the
/// block, so that readers can check the tie and re-derive the scale's map at any topology.
struct BlockScales {
  std::string data;
  /// In elements of the stored data tensor, one extent per dimension of it.
  Shape block;
  /// The format's name ("fp8-block", "mxfp4", ...; hf/quantization.h).
  std::string format;
  /// Whether dequantization multiplies by it (false: a per-tensor second-level or activation
  /// scale, moved but not applied).
  bool dequantizes = true;
  friend bool operator==(const BlockScales&, const BlockScales&) = default;
};

/// Checks that the block scales `scale` of `data` are stored in a dtype `format` stores them in:
/// F32, BF16 or F16 for the FP8 formats ("fp8-block", "fp8-tensor", "fp8-channel"); U8 for
/// "mxfp4" (E8M0 exponents: a number of another dtype is no exponent, and transformers would
/// truncate it to one); F8_E4M3, F32, BF16 or F16 for "nvfp4".
/// \error FailedPrecondition  another dtype (the message names both tensors, the dtype and
///        those the format stores).
/// \error InvalidArgument  a format of another name.
Status CheckBlockScaleDType(std::string_view format, std::string_view scale, std::string_view data,
                            DType dtype);

struct BlockImageOptions {
  /// The name of the buffer that holds rank `rank`'s scales when its data pieces write into the
  /// buffer `data_buffer` (DESIGN 16). Unset: buffered ranks are refused.
  std::function<std::string(Rank rank, const std::string& data_buffer)> scale_buffer;
};

/// The map of the scales (stored shape `scale_shape`) of a tensor whose map is `data` and whose
/// block shape is `block` (one extent per dimension of data's logical shape): every rank holds
/// its local grid's scales (a buffered rank: in the scale buffer, of shape
/// BlockGridShape(buffer shape, block)). A scale of one element (per tensor) is held by every
/// rank. Costs in proportion to the scale elements the ranks hold.
/// \error InvalidArgument  `scale_shape` is not the block grid of data's logical shape; a
///        buffered rank without options.scale_buffer.
/// \error FailedPrecondition  a local block would take elements of two blocks of the data
///        (the message names the rank, the dimension, the local block and both blocks), or a
///        piece takes a blocked dimension other than in contiguous runs whole blocks apart in
///        the data and in the shard (a strided or transposed split of a blocked dimension).
/// \error Unimplemented  a piece whose dimensions do not each step along one dimension.
Result<ParamMap> BlockImage(const ParamMap& data, const Shape& block, const Shape& scale_shape,
                            const BlockImageOptions& options = {});

/// Checks that `scale` is the block image of `data` (the tie a sharded checkpoint records):
/// FailedPrecondition saying how they differ (the caller names both tensors), or what
/// BlockImage refuses. Data whose ranks hold it with its last two dimensions as one (MXFP4's
/// [..., groups, 16] in vLLM's [..., groups x 16] parameters, block [..., 1, 16]) is checked
/// as the same elements of shape [..., groups x 16] in blocks of [..., 16].
Status CheckBlockTie(const ParamMap& data, const ParamMap& scale, const Shape& block);

}  // namespace reshard

#endif  // RESHARD_IR_BLOCK_GRID_H_
