// Index arithmetic: int64 element counts, offsets and strides, checked for overflow.
//
// Every quantity here is in *elements*, never bytes. Shapes, offsets and strides read from
// files are hostile, so every product and sum is checked: a value is accepted only when it
// and every intermediate stay within [-kMaxIndex, kMaxIndex] (2^62), which leaves headroom
// for the sums of a few such values without overflowing int64.
#ifndef RESHARD_BASE_INDEX_H_
#define RESHARD_BASE_INDEX_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

/// An element count, offset or stride (in elements).
using Index = int64_t;
/// A tensor shape or a list of strides, outermost dimension first.
using Shape = std::vector<Index>;

inline constexpr Index kMaxIndex = Index{1} << 62;

/// a + b, or nullopt when the sum leaves [-kMaxIndex, kMaxIndex].
std::optional<Index> CheckedAdd(Index a, Index b);
/// a * b, or nullopt when the product leaves [-kMaxIndex, kMaxIndex].
std::optional<Index> CheckedMul(Index a, Index b);

/// Product of `shape`'s extents; InvalidArgument for a negative extent or an overflow.
Result<Index> CheckedProduct(std::span<const Index> shape);

/// Product of extents known to be valid (already checked); no checks.
Index ProductOf(std::span<const Index> shape);

/// Row-major (C order) strides of a dense tensor of `shape`, in elements.
Shape RowMajorStrides(std::span<const Index> shape);

/// The multi-index of flat row-major `offset` in `shape`.
Shape UnravelIndex(Index offset, std::span<const Index> shape);

/// "[3, 5, 0]"
std::string FormatShape(std::span<const Index> shape);

/// The greatest offset a strided view reaches: offset + sum((shape_k - 1) * stride_k), or
/// nullopt when it overflows. Undefined for empty views (check the element count first).
std::optional<Index> LastOffset(Index offset, std::span<const Index> shape,
                                std::span<const Index> strides);

}  // namespace reshard

#endif  // RESHARD_BASE_INDEX_H_
