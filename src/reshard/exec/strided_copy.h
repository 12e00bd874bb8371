// The strided-copy engine under extract, rebuild and transfer plans (DESIGN.md 5).
//
// A move copies every element of a `shape`-sized index space from one strided view to another,
// optionally multiplying or dividing by a factor on the way. Views are given by the address of
// the element at multi-index 0 and strides in *elements*; the element size comes from the
// dtype. Before copying, a move is normalised: extent-1 dimensions are dropped, dimensions are
// ordered so the innermost is contiguous (destination stride 1 preferred, else source stride
// 1), and neighbouring dimensions contiguous on both sides are merged. Contiguous runs are
// copied with memcpy; scaled runs go through a small block buffer in a loop the compiler
// vectorises.
//
// Factor arithmetic is the dtype's: F64 in double; F32 as float * float(factor) (or /);
// F16 and BF16 widened to float, the op in float, rounded back to nearest even (NaN stays a
// quiet NaN, overflow becomes infinity). Integer, BOOL and FP8 dtypes refuse a factor other
// than 1 (FailedPrecondition).
//
// Large work is split over threads: over moves and over the outer dimension (or, for a single
// long run, the run itself) of large moves. Work below `kInlineBytes` runs on the calling
// thread.
#ifndef RESHARD_EXEC_STRIDED_COPY_H_
#define RESHARD_EXEC_STRIDED_COPY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/base/status.h"

namespace reshard {

/// What happens to each element on the way: nothing, `dst = src * factor`, or
/// `dst = src / factor`, in the dtype's arithmetic.
struct ScaleOp {
  enum class Kind { kNone, kMultiply, kDivide };
  Kind kind = Kind::kNone;
  double factor = 1.0;

  static ScaleOp None() { return {}; }
  static ScaleOp Multiply(double f) { return {Kind::kMultiply, f}; }
  static ScaleOp Divide(double f) { return {Kind::kDivide, f}; }
  /// True when the op changes no value: kNone, or a factor of exactly 1.
  bool is_identity() const { return kind == Kind::kNone || factor == 1.0; }
};

/// One strided copy: for every multi-index i inside `shape`,
///   dst[sum_k i_k * dst_strides[k]] = op(src[sum_k i_k * src_strides[k]]).
/// `src` and `dst` are the addresses of the elements at multi-index 0 (not of a storage base).
/// Strides are in elements. The destination elements must be distinct and must not overlap
/// the source.
struct StridedMove {
  Shape shape;
  const std::byte* src = nullptr;
  Shape src_strides;
  std::byte* dst = nullptr;
  Shape dst_strides;
  ScaleOp op;
};

/// One strided comparison: for every multi-index i inside `shape`, is
/// op(src[i . src_strides]) bit-identical (in the dtype) to ref[i . ref_strides]?
struct StridedCompareMove {
  Shape shape;
  const std::byte* src = nullptr;
  Shape src_strides;
  const std::byte* ref = nullptr;
  Shape ref_strides;
  ScaleOp op;
};

/// Where a comparison found a difference. Offsets are in elements from the move's `src` and
/// `ref` addresses. `value` is op(src element) and `ref_value` the reference element, each
/// as the dtype's bytes (the first DTypeSize(dtype) bytes are meaningful).
struct CompareMismatch {
  size_t move_index = 0;
  Index src_offset = 0;
  Index ref_offset = 0;
  std::byte value[8] = {};
  std::byte ref_value[8] = {};
};

/// Work at or below this many bytes runs on the calling thread.
inline constexpr int64_t kInlineBytes = int64_t{4} << 20;

/// Ok if `dtype` can take `op`: any dtype takes an identity op; only F64/F32/F16/BF16 take a
/// factor other than 1, and the factor must be finite, non-zero, and (for the float-computed
/// dtypes) finite and non-zero as a float. FailedPrecondition otherwise.
Status CheckScaleOp(DType dtype, const ScaleOp& op);

/// Runs every move (in any order, possibly concurrently). `num_threads` <= 0 means one per
/// hardware thread. Errors: FailedPrecondition for a factor the dtype cannot take;
/// InvalidArgument for mismatched shape/stride ranks, a negative extent, a null address with a
/// non-empty shape, or byte offsets that overflow.
Status StridedCopy(DType dtype, std::span<const StridedMove> moves, int num_threads = 0);

/// An element that a scaled copy did not carry exactly. Offsets are in elements from the
/// move's `src` and `dst` addresses; values are the dtype's bytes (the first DTypeSize(dtype)
/// are meaningful): `before` the source element, `after` op(before) as written, `back` after
/// taken back through the inverse op.
struct InexactElement {
  size_t move_index = 0;
  Index src_offset = 0;
  Index dst_offset = 0;
  std::byte before[8] = {};
  std::byte after[8] = {};
  std::byte back[8] = {};
};

/// StridedCopy that also checks, in the same pass, that every element of a scaled move
/// survives the round trip: op, then the inverse op (a division for a multiplication, and the
/// other way round), gives back the source bits exactly (a NaN may stay any NaN). A power-of-two
/// factor survives unless a value overflows to infinity or underflows into the subnormals or to
/// zero; another factor usually rounds. Returns the first element that does not survive, in a
/// deterministic order (by move, then the engine's iteration order); the copy is then left
/// incomplete. Moves with an identity op are plain copies. Same errors as StridedCopy.
Result<std::optional<InexactElement>> StridedCopyExact(DType dtype,
                                                       std::span<const StridedMove> moves,
                                                       int num_threads = 0);

/// Sets every element of the strided view to all-zero bytes (0, +0.0, false).
Status StridedZero(DType dtype, std::span<const Index> shape, std::byte* dst,
                   std::span<const Index> dst_strides, int num_threads = 0);

/// Decides whether a mismatch counts; return false to ignore it and keep comparing.
using MismatchFilter = std::function<bool(const CompareMismatch&)>;

/// Compares every move. Returns the first mismatch that `counts` accepts (all count when it is
/// empty) in a deterministic order (by move, then by the engine's iteration order), or nullopt
/// when everything agrees. Same errors as StridedCopy. `counts` may be called concurrently.
Result<std::optional<CompareMismatch>> StridedCompare(DType dtype,
                                                      std::span<const StridedCompareMove> moves,
                                                      const MismatchFilter& counts = {},
                                                      int num_threads = 0);

/// A readable rendering of one element of `dtype` stored at `bytes`: "1.5", "-3", "true",
/// "nan"; FP8 values as their bit pattern ("0x3c").
std::string FormatElement(DType dtype, const std::byte* bytes);

/// Conversions between IEEE binary16 / bfloat16 bit patterns and float. To-narrow rounding is
/// to nearest, ties to even; NaN stays NaN (made quiet); values past the largest finite
/// narrow value round to infinity. Widening is exact.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace reshard

#endif  // RESHARD_EXEC_STRIDED_COPY_H_
