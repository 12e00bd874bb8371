#include "reshard/exec/strided_copy.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

namespace reshard {
namespace {

using Byte = std::byte;

#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define RESHARD_TARGET_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RESHARD_TARGET_CLONES
#endif

// ---------------------------------------------------------------------------------------------
// Narrow float formats. Written branch-free (selects only) so the scaled loops vectorise.

inline uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float FromBits(uint32_t u) { return std::bit_cast<float>(u); }

inline float HalfToFloatInline(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  // Normal: rebias the exponent (15 -> 127) and widen the mantissa.
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  // Infinity and NaN keep their payload.
  const uint32_t special = 0x7F800000u | (mant << 13);
  // Zero and subnormals: mant * 2^-24, exact in float.
  const uint32_t subnormal = Bits(static_cast<float>(static_cast<int32_t>(mant)) * 0x1p-24f);
  const uint32_t magnitude = exp == 0 ? subnormal : (exp == 31 ? special : normal);
  return FromBits(sign | magnitude);
}

inline uint16_t FloatToHalfInline(float f) {
  const uint32_t x = Bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  // Normal results, |f| in [2^-14, 65520): rebias, then round the 13 dropped bits to nearest
  // even; a carry into the exponent is the correct result.
  const uint32_t normal = (abs - (112u << 23) + 0xFFFu + ((abs >> 13) & 1u)) >> 13;
  // |f| < 2^-14: the result is the subnormal count round(|f| * 2^24) <= 1024 (1024 encodes
  // 2^-14 itself). Adding 2^23 makes the float unit rounding do the round-to-nearest-even.
  const uint32_t subnormal = Bits(FromBits(abs) * 0x1p24f + 0x1p23f) - 0x4B000000u;
  // NaN: keep the top payload bits and set the quiet bit.
  const uint32_t nan = 0x7E00u | ((abs >> 13) & 0x3FFu);
  uint32_t magnitude = abs < 0x38800000u ? subnormal : normal;
  magnitude = abs >= 0x477FF000u ? 0x7C00u : magnitude;  // 65520 and up round to infinity
  magnitude = abs > 0x7F800000u ? nan : magnitude;
  return static_cast<uint16_t>(sign | magnitude);
}

inline float BFloat16ToFloatInline(uint16_t b) { return FromBits(static_cast<uint32_t>(b) << 16); }

inline uint16_t FloatToBFloat16Inline(float f) {
  const uint32_t x = Bits(f);
  // Round the 16 dropped bits to nearest even; overflow carries into infinity correctly.
  // The top halves are taken with an arithmetic shift, so they are in int16 range and the
  // vectoriser can narrow them with a saturating pack.
  const int32_t rounded = static_cast<int32_t>(x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  const int32_t nan = static_cast<int32_t>(x | 0x00400000u) >> 16;
  return static_cast<uint16_t>(static_cast<int32_t>(x & 0x7FFFFFFFu) > 0x7F800000 ? nan : rounded);
}

struct F64Codec {
  using Storage = double;
  using Compute = double;
  static double Widen(double v) { return v; }
  static double Narrow(double v) { return v; }
};
struct F32Codec {
  using Storage = float;
  using Compute = float;
  static float Widen(float v) { return v; }
  static float Narrow(float v) { return v; }
};
struct F16Codec {
  using Storage = uint16_t;
  using Compute = float;
  static float Widen(uint16_t v) { return HalfToFloatInline(v); }
  static uint16_t Narrow(float v) { return FloatToHalfInline(v); }
};
// Narrow is only ever applied to v * f or v / f, where v was widened from bfloat16 and f is
// finite and non-zero. Such a result is NaN only when v is, and then it is v's NaN made quiet
// (or the platform's default NaN): either way its low 16 bits are zero, so the rounding below
// leaves it a quiet NaN and the NaN test of FloatToBFloat16Inline can be skipped. That test is
// a third of the loop's instructions.
struct BF16Codec {
  using Storage = uint16_t;
  using Compute = float;
  static float Widen(uint16_t v) { return BFloat16ToFloatInline(v); }
  static uint16_t Narrow(float v) {
    const uint32_t x = Bits(v);
    return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
  }
};

// ---------------------------------------------------------------------------------------------
// Row kernels: one run of `n` elements, strides in bytes.

using RowCopyFn = void (*)(const Byte* src, Index src_stride, Byte* dst, Index dst_stride, Index n,
                           double factor);
// Returns the index of the first element in [0, n) whose op(src) differs from ref, or -1.
using RowCompareFn = Index (*)(const Byte* src, Index src_stride, const Byte* ref, Index ref_stride,
                               Index n, double factor);

// Copies like a scaled RowCopyFn and returns the index of the first element whose value does not
// survive the round trip (op, then the inverse op with `inverse`), or -1.
using RowExactFn = Index (*)(const Byte* src, Index src_stride, Byte* dst, Index dst_stride,
                             Index n, double factor, double inverse);

constexpr Index kBlock = 512;

template <size_t kSize>
void CopyRowContiguous(const Byte* src, Index, Byte* dst, Index, Index n, double) {
  std::memcpy(dst, src, static_cast<size_t>(n) * kSize);
}

template <size_t kSize>
void CopyRowStrided(const Byte* src, Index src_stride, Byte* dst, Index dst_stride, Index n,
                    double) {
  for (Index i = 0; i < n; ++i) std::memcpy(dst + i * dst_stride, src + i * src_stride, kSize);
}

template <size_t kSize>
void ZeroRowContiguous(const Byte*, Index, Byte* dst, Index, Index n, double) {
  std::memset(dst, 0, static_cast<size_t>(n) * kSize);
}

template <size_t kSize>
void ZeroRowStrided(const Byte*, Index, Byte* dst, Index dst_stride, Index n, double) {
  for (Index i = 0; i < n; ++i) std::memset(dst + i * dst_stride, 0, kSize);
}

template <typename S>
inline void LoadBlock(S* out, const Byte* src, Index stride, Index m) {
  if (stride == static_cast<Index>(sizeof(S))) {
    std::memcpy(out, src, static_cast<size_t>(m) * sizeof(S));
  } else {
    for (Index j = 0; j < m; ++j) std::memcpy(&out[j], src + j * stride, sizeof(S));
  }
}

template <typename S>
inline void StoreBlock(Byte* dst, Index stride, const S* in, Index m) {
  if (stride == static_cast<Index>(sizeof(S))) {
    std::memcpy(dst, in, static_cast<size_t>(m) * sizeof(S));
  } else {
    for (Index j = 0; j < m; ++j) std::memcpy(dst + j * stride, &in[j], sizeof(S));
  }
}

// The vectorised part: widen, multiply or divide, narrow, over a block in local memory.
template <typename Codec, bool kDivide>
inline void ScaleBlock(const typename Codec::Storage* in, typename Codec::Storage* out, Index m,
                       typename Codec::Compute f) {
  for (Index j = 0; j < m; ++j) {
    const typename Codec::Compute v = Codec::Widen(in[j]);
    out[j] = Codec::Narrow(kDivide ? v / f : v * f);
  }
}

// Contiguous on both sides: straight from source to destination, no staging. Where the
// toolchain can dispatch on the CPU at load time, an AVX2 clone is built beside the baseline
// one: the widen/op/narrow sequence is instruction-bound on SSE2.
template <typename Codec, bool kDivide>
RESHARD_TARGET_CLONES void ScaledCopyRun(const Byte* __restrict src, Byte* __restrict dst, Index n,
                                         typename Codec::Compute f) {
  using S = typename Codec::Storage;
  for (Index j = 0; j < n; ++j) {
    S x;
    std::memcpy(&x, src + j * static_cast<Index>(sizeof(S)), sizeof(S));
    const typename Codec::Compute v = Codec::Widen(x);
    const S y = Codec::Narrow(kDivide ? v / f : v * f);
    std::memcpy(dst + j * static_cast<Index>(sizeof(S)), &y, sizeof(S));
  }
}

template <typename Codec, bool kDivide>
void ScaledCopyRow(const Byte* src, Index src_stride, Byte* dst, Index dst_stride, Index n,
                   double factor) {
  using S = typename Codec::Storage;
  const auto f = static_cast<typename Codec::Compute>(factor);
  constexpr Index kSize = static_cast<Index>(sizeof(S));
  if (src_stride == kSize && dst_stride == kSize) {
    ScaledCopyRun<Codec, kDivide>(src, dst, n, f);
    return;
  }
  alignas(64) S in[kBlock];
  alignas(64) S out[kBlock];
  for (Index i = 0; i < n; i += kBlock) {
    const Index m = std::min(kBlock, n - i);
    LoadBlock(in, src + i * src_stride, src_stride, m);
    ScaleBlock<Codec, kDivide>(in, out, m, f);
    StoreBlock(dst + i * dst_stride, dst_stride, out, m);
  }
}

// Round-trip checked scaling: dst = op(src), and each result taken back through the inverse op
// must give the source again. When the inverse is a multiplication by a power of two
// (`kExactInverse`) it is exact in the compute type, so comparing widen(result) * g with the
// widened source decides it without narrowing again; otherwise the result is narrowed back and
// compared bit for bit. The loop is branch-free and vectorises; it returns false when some
// element may not have survived (NaNs, whose bits may change, are sorted out by FirstInexact).
template <typename S>
using BitsOf = std::conditional_t<sizeof(S) == 2, uint16_t,
                                  std::conditional_t<sizeof(S) == 4, uint32_t, uint64_t>>;

template <typename Codec, bool kDivide, bool kInverseDivide, bool kExactInverse>
RESHARD_TARGET_CLONES bool ScaleRunExact(const Byte* __restrict src, Byte* __restrict dst, Index m,
                                         typename Codec::Compute f, typename Codec::Compute g) {
  using S = typename Codec::Storage;
  constexpr Index kSize = static_cast<Index>(sizeof(S));
  unsigned lost = 0;
  for (Index j = 0; j < m; ++j) {
    S x;
    std::memcpy(&x, src + j * kSize, sizeof(S));
    const typename Codec::Compute v = Codec::Widen(x);
    const S y = Codec::Narrow(kDivide ? v / f : v * f);
    std::memcpy(dst + j * kSize, &y, sizeof(S));
    const typename Codec::Compute w = Codec::Widen(y);
    if constexpr (kExactInverse) {
      lost |= static_cast<unsigned>(w * g != v);
    } else {
      const S back = Codec::Narrow(kInverseDivide ? w / g : w * g);
      lost |= static_cast<unsigned>(std::bit_cast<BitsOf<S>>(back) != std::bit_cast<BitsOf<S>>(x));
    }
  }
  return lost == 0;
}

// The first element of a block whose round trip changed it (a NaN that stays a NaN counts as
// surviving), or -1.
template <typename Codec, bool kInverseDivide>
Index FirstInexact(const typename Codec::Storage* in, const typename Codec::Storage* out, Index m,
                   typename Codec::Compute g) {
  using S = typename Codec::Storage;
  for (Index j = 0; j < m; ++j) {
    const typename Codec::Compute w = Codec::Widen(out[j]);
    const S back = Codec::Narrow(kInverseDivide ? w / g : w * g);
    if (std::bit_cast<BitsOf<S>>(back) == std::bit_cast<BitsOf<S>>(in[j])) continue;
    if (std::isnan(Codec::Widen(in[j])) && std::isnan(Codec::Widen(back))) continue;
    return j;
  }
  return -1;
}

template <typename Codec, bool kDivide, bool kInverseDivide, bool kExactInverse>
Index ExactScaledCopyRow(const Byte* src, Index src_stride, Byte* dst, Index dst_stride, Index n,
                         double factor, double inverse) {
  using S = typename Codec::Storage;
  constexpr Index kSize = static_cast<Index>(sizeof(S));
  const auto f = static_cast<typename Codec::Compute>(factor);
  const auto g = static_cast<typename Codec::Compute>(inverse);
  const bool contiguous = src_stride == kSize && dst_stride == kSize;
  alignas(64) S in[kBlock];
  alignas(64) S out[kBlock];
  for (Index i = 0; i < n; i += kBlock) {
    const Index m = std::min(kBlock, n - i);
    bool exact;
    if (contiguous) {
      exact = ScaleRunExact<Codec, kDivide, kInverseDivide, kExactInverse>(
          src + i * kSize, dst + i * kSize, m, f, g);
    } else {
      LoadBlock(in, src + i * src_stride, src_stride, m);
      exact = ScaleRunExact<Codec, kDivide, kInverseDivide, kExactInverse>(
          reinterpret_cast<const Byte*>(in), reinterpret_cast<Byte*>(out), m, f, g);
      StoreBlock(dst + i * dst_stride, dst_stride, out, m);
    }
    if (exact) continue;
    LoadBlock(in, src + i * src_stride, src_stride, m);
    LoadBlock(out, dst + i * dst_stride, dst_stride, m);
    const Index j = FirstInexact<Codec, kInverseDivide>(in, out, m, g);
    if (j >= 0) return i + j;
  }
  return -1;
}

template <size_t kSize>
Index CompareRowIdentity(const Byte* src, Index src_stride, const Byte* ref, Index ref_stride,
                         Index n, double) {
  if (src_stride == static_cast<Index>(kSize) && ref_stride == static_cast<Index>(kSize) &&
      std::memcmp(src, ref, static_cast<size_t>(n) * kSize) == 0) {
    return -1;
  }
  for (Index i = 0; i < n; ++i) {
    if (std::memcmp(src + i * src_stride, ref + i * ref_stride, kSize) != 0) return i;
  }
  return -1;
}

template <typename Codec, bool kDivide>
Index ScaledCompareRow(const Byte* src, Index src_stride, const Byte* ref, Index ref_stride,
                       Index n, double factor) {
  using S = typename Codec::Storage;
  const auto f = static_cast<typename Codec::Compute>(factor);
  alignas(64) S in[kBlock];
  alignas(64) S out[kBlock];
  alignas(64) S expected[kBlock];
  for (Index i = 0; i < n; i += kBlock) {
    const Index m = std::min(kBlock, n - i);
    LoadBlock(in, src + i * src_stride, src_stride, m);
    LoadBlock(expected, ref + i * ref_stride, ref_stride, m);
    ScaleBlock<Codec, kDivide>(in, out, m, f);
    // Bit patterns, on purpose: -0.0 is not 0.0 and a NaN's payload counts.
    // NOLINTNEXTLINE(bugprone-suspicious-memory-comparison)
    if (std::memcmp(out, expected, static_cast<size_t>(m) * sizeof(S)) == 0) continue;
    for (Index j = 0; j < m; ++j) {
      // NOLINTNEXTLINE(bugprone-suspicious-memory-comparison)
      if (std::memcmp(&out[j], &expected[j], sizeof(S)) != 0) return i + j;
    }
  }
  return -1;
}

enum class Job { kCopy, kZero, kCompare };

// The row kernels for a dtype and (normalised) op; `contiguous` when both inner strides equal
// the element size.
RowCopyFn SelectCopy(DType dtype, const ScaleOp& op, bool contiguous) {
  const bool div = op.kind == ScaleOp::Kind::kDivide;
  if (op.kind != ScaleOp::Kind::kNone) {
    switch (dtype) {
      case DType::kF64:
        return div ? ScaledCopyRow<F64Codec, true> : ScaledCopyRow<F64Codec, false>;
      case DType::kF32:
        return div ? ScaledCopyRow<F32Codec, true> : ScaledCopyRow<F32Codec, false>;
      case DType::kF16:
        return div ? ScaledCopyRow<F16Codec, true> : ScaledCopyRow<F16Codec, false>;
      case DType::kBF16:
        return div ? ScaledCopyRow<BF16Codec, true> : ScaledCopyRow<BF16Codec, false>;
      default:
        return nullptr;  // refused earlier by CheckScaleOp
    }
  }
  switch (DTypeSize(dtype)) {
    case 1:
      return contiguous ? CopyRowContiguous<1> : CopyRowStrided<1>;
    case 2:
      return contiguous ? CopyRowContiguous<2> : CopyRowStrided<2>;
    case 4:
      return contiguous ? CopyRowContiguous<4> : CopyRowStrided<4>;
    case 8:
      return contiguous ? CopyRowContiguous<8> : CopyRowStrided<8>;
    default:
      return nullptr;
  }
}

RowCopyFn SelectZero(DType dtype, bool contiguous) {
  switch (DTypeSize(dtype)) {
    case 1:
      return contiguous ? ZeroRowContiguous<1> : ZeroRowStrided<1>;
    case 2:
      return contiguous ? ZeroRowContiguous<2> : ZeroRowStrided<2>;
    case 4:
      return contiguous ? ZeroRowContiguous<4> : ZeroRowStrided<4>;
    case 8:
      return contiguous ? ZeroRowContiguous<8> : ZeroRowStrided<8>;
    default:
      return nullptr;
  }
}

template <typename Codec>
RowExactFn SelectExactFor(bool divide, bool inverse_divide, bool exact_inverse) {
  if (divide) {
    return exact_inverse ? ExactScaledCopyRow<Codec, true, false, true>
                         : ExactScaledCopyRow<Codec, true, false, false>;
  }
  return inverse_divide ? ExactScaledCopyRow<Codec, false, true, false>
                        : ExactScaledCopyRow<Codec, false, false, true>;
}

// The checked kernel for a (normalised, non-identity) op and its inverse (InverseOp: a
// division undoes a multiplication unless the reciprocal is an exact power of two, and a
// multiplication undoes a division).
RowExactFn SelectExact(DType dtype, const ScaleOp& op, const ScaleOp& inverse) {
  const bool div = op.kind == ScaleOp::Kind::kDivide;
  const bool inv_div = inverse.kind == ScaleOp::Kind::kDivide;
  int exponent = 0;
  const bool exact_inverse = !inv_div && std::abs(std::frexp(inverse.factor, &exponent)) == 0.5;
  switch (dtype) {
    case DType::kF64:
      return SelectExactFor<F64Codec>(div, inv_div, exact_inverse);
    case DType::kF32:
      return SelectExactFor<F32Codec>(div, inv_div, exact_inverse);
    case DType::kF16:
      return SelectExactFor<F16Codec>(div, inv_div, exact_inverse);
    case DType::kBF16:
      return SelectExactFor<BF16Codec>(div, inv_div, exact_inverse);
    default:
      return nullptr;  // refused earlier by CheckScaleOp
  }
}

RowCompareFn SelectCompare(DType dtype, const ScaleOp& op) {
  const bool div = op.kind == ScaleOp::Kind::kDivide;
  if (op.kind != ScaleOp::Kind::kNone) {
    switch (dtype) {
      case DType::kF64:
        return div ? ScaledCompareRow<F64Codec, true> : ScaledCompareRow<F64Codec, false>;
      case DType::kF32:
        return div ? ScaledCompareRow<F32Codec, true> : ScaledCompareRow<F32Codec, false>;
      case DType::kF16:
        return div ? ScaledCompareRow<F16Codec, true> : ScaledCompareRow<F16Codec, false>;
      case DType::kBF16:
        return div ? ScaledCompareRow<BF16Codec, true> : ScaledCompareRow<BF16Codec, false>;
      default:
        return nullptr;
    }
  }
  switch (DTypeSize(dtype)) {
    case 1:
      return CompareRowIdentity<1>;
    case 2:
      return CompareRowIdentity<2>;
    case 4:
      return CompareRowIdentity<4>;
    case 8:
      return CompareRowIdentity<8>;
    default:
      return nullptr;
  }
}

// An identity op becomes kNone. Division by a power of two whose reciprocal is a normal
// number of the compute type becomes multiplication by that reciprocal: both are the correctly
// rounded value of the same real number, so the results are identical, and multiplication is
// cheaper.
ScaleOp NormaliseOp(DType dtype, ScaleOp op) {
  if (op.is_identity()) return ScaleOp::None();
  if (op.kind != ScaleOp::Kind::kDivide) return op;
  int exponent = 0;
  if (std::frexp(op.factor, &exponent) != 0.5 && std::frexp(op.factor, &exponent) != -0.5) {
    return op;
  }
  const double reciprocal = 1.0 / op.factor;
  if (dtype == DType::kF64) {
    if (std::isnormal(reciprocal)) return ScaleOp::Multiply(reciprocal);
    return op;
  }
  const float r = static_cast<float>(reciprocal);
  if (std::isnormal(r) && static_cast<double>(r) == reciprocal) return ScaleOp::Multiply(r);
  return op;
}

// The op that takes a (normalised, non-identity) op's results back: a multiplication is undone
// by dividing by the same factor (or multiplying by its reciprocal when that is exact), a
// division by multiplying.
ScaleOp InverseOp(DType dtype, const ScaleOp& op) {
  if (op.kind == ScaleOp::Kind::kDivide) return ScaleOp::Multiply(op.factor);
  return NormaliseOp(dtype, ScaleOp::Divide(op.factor));
}

// ---------------------------------------------------------------------------------------------
// Normalised moves.

struct Plan {
  // Outer dimensions, outermost first; strides in bytes.
  std::vector<Index> outer_shape;
  std::vector<Index> outer_a;  // destination (or reference) side
  std::vector<Index> outer_b;  // source side
  Index rows = 0;              // product of outer_shape; 0 for an empty move
  Index n = 0;                 // innermost extent
  Index inner_a = 0;
  Index inner_b = 0;
  const Byte* a = nullptr;
  const Byte* b = nullptr;
  ScaleOp op;
  RowCopyFn copy = nullptr;
  RowCompareFn compare = nullptr;
  RowExactFn exact = nullptr;  // set when a copy checks the round trip of a scaled op
  ScaleOp inverse;             // the op that takes `op`'s results back
  int64_t bytes = 0;           // elements * element size
};

// Builds the plan of one move. Side `a` is the one written (or the reference of a compare):
// its stride-1 dimension is preferred innermost.
Result<Plan> MakePlan(DType dtype, std::span<const Index> shape, const Byte* a,
                      std::span<const Index> a_strides, const Byte* b,
                      std::span<const Index> b_strides, const ScaleOp& op) {
  if (a_strides.size() != shape.size() || b_strides.size() != shape.size()) {
    return InvalidArgumentError(
        fmt::format("a move of shape {} has {} destination and {} source strides",
                    FormatShape(shape), a_strides.size(), b_strides.size()));
  }
  RESHARD_ASSIGN_OR_RETURN(const Index count, CheckedProduct(shape));
  Plan plan;
  plan.op = op;
  plan.a = a;
  plan.b = b;
  if (count == 0) return plan;
  if (a == nullptr || b == nullptr) {
    return InvalidArgumentError(
        fmt::format("a move of shape {} has a null address", FormatShape(shape)));
  }
  const Index es = static_cast<Index>(DTypeSize(dtype));
  struct Dim {
    Index extent, a, b;
  };
  std::vector<Dim> dims;
  for (size_t k = 0; k < shape.size(); ++k) {
    if (shape[k] == 1) continue;
    const std::optional<Index> sa = CheckedMul(a_strides[k], es);
    const std::optional<Index> sb = CheckedMul(b_strides[k], es);
    if (!sa || !sb) {
      return InvalidArgumentError(fmt::format("strides {} / {} overflow as byte offsets",
                                              FormatShape(a_strides), FormatShape(b_strides)));
    }
    dims.push_back({shape[k], *sa, *sb});
  }
  // Destination-major order; then the preferred contiguous dimension innermost.
  std::stable_sort(dims.begin(), dims.end(), [](const Dim& x, const Dim& y) {
    if (x.a != y.a) return x.a > y.a;
    return x.b > y.b;
  });
  if (!dims.empty() && dims.back().a != es) {
    auto it = std::find_if(dims.begin(), dims.end(), [&](const Dim& d) { return d.b == es; });
    if (it != dims.end()) std::rotate(it, it + 1, dims.end());
  }
  // Merge from the inside out: an outer dimension folds into the one inside it when it steps
  // exactly over it on both sides.
  std::vector<Dim> merged;  // innermost first
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
    if (!merged.empty()) {
      Dim& inner = merged.back();
      if (it->a == inner.extent * inner.a && it->b == inner.extent * inner.b) {
        inner.extent *= it->extent;
        continue;
      }
    }
    merged.push_back(*it);
  }
  if (merged.empty()) merged.push_back({1, es, es});  // a single element
  plan.n = merged.front().extent;
  plan.inner_a = merged.front().a;
  plan.inner_b = merged.front().b;
  plan.rows = 1;
  for (auto it = merged.rbegin(); it + 1 != merged.rend(); ++it) {
    plan.outer_shape.push_back(it->extent);
    plan.outer_a.push_back(it->a);
    plan.outer_b.push_back(it->b);
    plan.rows *= it->extent;
  }
  plan.bytes = count * es;
  return plan;
}

// A share of one plan: rows [row_begin, row_end), and of each row the elements
// [col_begin, col_end).
struct Task {
  size_t plan = 0;
  Index row_begin = 0, row_end = 0;
  Index col_begin = 0, col_end = 0;
};

int ResolveThreads(int num_threads) {
  if (num_threads > 0) return num_threads;
  // Asked once per process: glibc reads /sys to answer, about 20 us, which was most of the
  // time a small extract took.
  static const int hardware_threads =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return hardware_threads;
}

// Cuts plans into tasks of roughly `chunk` bytes (whole plans when they are small).
std::vector<Task> SplitTasks(const std::vector<Plan>& plans, int64_t chunk) {
  std::vector<Task> tasks;
  for (size_t p = 0; p < plans.size(); ++p) {
    const Plan& plan = plans[p];
    if (plan.rows == 0) continue;
    const int64_t row_bytes = plan.bytes / plan.rows;
    if (plan.bytes <= chunk) {
      tasks.push_back({p, 0, plan.rows, 0, plan.n});
    } else if (row_bytes >= chunk) {
      const Index parts = (row_bytes + chunk - 1) / chunk;
      const Index per = (plan.n + parts - 1) / parts;
      for (Index r = 0; r < plan.rows; ++r) {
        for (Index c = 0; c < plan.n; c += per) {
          tasks.push_back({p, r, r + 1, c, std::min(plan.n, c + per)});
        }
      }
    } else {
      const Index per = std::max<Index>(1, chunk / row_bytes);
      for (Index r = 0; r < plan.rows; r += per) {
        tasks.push_back({p, r, std::min(plan.rows, r + per), 0, plan.n});
      }
    }
  }
  return tasks;
}

// Calls row(a, b, n) for each row of the task, with the addresses of its first element;
// stops early when row returns false.
template <typename RowVisitor>
void VisitRows(const Plan& plan, const Task& task, RowVisitor&& row) {
  const size_t depth = plan.outer_shape.size();
  std::vector<Index> index(depth, 0);
  const Byte* a = plan.a + task.col_begin * plan.inner_a;
  const Byte* b = plan.b + task.col_begin * plan.inner_b;
  Index rest = task.row_begin;
  for (size_t k = depth; k-- > 0;) {
    index[k] = rest % plan.outer_shape[k];
    rest /= plan.outer_shape[k];
    a += index[k] * plan.outer_a[k];
    b += index[k] * plan.outer_b[k];
  }
  const Index n = task.col_end - task.col_begin;
  for (Index r = task.row_begin; r < task.row_end; ++r) {
    if (!row(a, b, n)) return;
    // Odometer step.
    for (size_t k = depth; k-- > 0;) {
      a += plan.outer_a[k];
      b += plan.outer_b[k];
      if (++index[k] < plan.outer_shape[k]) break;
      a -= plan.outer_shape[k] * plan.outer_a[k];
      b -= plan.outer_shape[k] * plan.outer_b[k];
      index[k] = 0;
    }
  }
}

// How work is spread: the tasks, and how many threads take them (1: the caller alone).
struct Schedule {
  std::vector<Task> tasks;
  int threads = 1;
};

// Inline (one task per plan) when the work is small or one thread is asked for; else tasks of
// a few per thread, so an uneven split still balances.
Schedule MakeSchedule(const std::vector<Plan>& plans, int num_threads) {
  int64_t total = 0;
  for (const Plan& p : plans) total += p.bytes;
  Schedule s;
  const int threads = ResolveThreads(num_threads);
  if (threads <= 1 || total <= kInlineBytes) {
    s.tasks = SplitTasks(plans, std::numeric_limits<int64_t>::max());
    return s;
  }
  const int64_t chunk = std::max<int64_t>(total / (int64_t{threads} * 8), int64_t{256} << 10);
  s.tasks = SplitTasks(plans, chunk);
  s.threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), s.tasks.size()));
  return s;
}

// Calls run(t) for every task index t, on the caller and threads - 1 helpers taking tasks in
// order. run returns false to say that tasks after t need not run.
template <typename RunTask>
void RunTasks(const Schedule& schedule, RunTask&& run) {
  const size_t count = schedule.tasks.size();
  if (schedule.threads <= 1) {
    for (size_t t = 0; t < count; ++t) {
      if (!run(t)) return;
    }
    return;
  }
  std::atomic<size_t> next{0};
  std::atomic<size_t> stop_after{count};
  auto worker = [&] {
    for (;;) {
      const size_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= count || t > stop_after.load(std::memory_order_relaxed)) return;
      if (!run(t)) {
        size_t seen = stop_after.load();
        while (t < seen && !stop_after.compare_exchange_weak(seen, t)) {
        }
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(schedule.threads - 1));
  for (int i = 1; i < schedule.threads; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& th : pool) th.join();
}

// Calls probe(plan index, plan, a, b, n) on every row of every task (a: the plan's written or
// reference side, b: its source side) and returns the first hit in task order, stopping early.
template <typename Hit, typename RowProbe>
std::optional<Hit> FindFirst(const std::vector<Plan>& plans, const Schedule& schedule,
                             RowProbe&& probe) {
  std::vector<std::optional<Hit>> found(schedule.tasks.size());
  RunTasks(schedule, [&](size_t t) {
    const Task& task = schedule.tasks[t];
    const Plan& plan = plans[task.plan];
    VisitRows(plan, task, [&](const Byte* a, const Byte* b, Index n) {
      found[t] = probe(task.plan, plan, a, b, n);
      return !found[t].has_value();
    });
    return !found[t].has_value();
  });
  for (std::optional<Hit>& f : found) {
    if (f) return f;
  }
  return std::nullopt;
}

// The plans of copy moves, each with its row kernel (the checked one for scaled ops when
// `exact`).
Result<std::vector<Plan>> CopyPlans(DType dtype, std::span<const StridedMove> moves, bool exact) {
  std::vector<Plan> plans;
  plans.reserve(moves.size());
  const Index es = static_cast<Index>(DTypeSize(dtype));
  for (size_t i = 0; i < moves.size(); ++i) {
    const StridedMove& m = moves[i];
    RESHARD_RETURN_IF_ERROR(CheckScaleOp(dtype, m.op).Annotate(fmt::format("moves[{}]", i)));
    RESHARD_ASSIGN_OR_RETURN(Plan plan, MakePlan(dtype, m.shape, m.dst, m.dst_strides, m.src,
                                                 m.src_strides, NormaliseOp(dtype, m.op)));
    plan.copy = SelectCopy(dtype, plan.op, plan.inner_a == es && plan.inner_b == es);
    if (exact && plan.op.kind != ScaleOp::Kind::kNone) {
      plan.inverse = InverseOp(dtype, plan.op);
      plan.exact = SelectExact(dtype, plan.op, plan.inverse);
    }
    plans.push_back(std::move(plan));
  }
  return plans;
}

}  // namespace

float HalfToFloat(uint16_t h) { return HalfToFloatInline(h); }
uint16_t FloatToHalf(float f) { return FloatToHalfInline(f); }
float BFloat16ToFloat(uint16_t b) { return BFloat16ToFloatInline(b); }
uint16_t FloatToBFloat16(float f) { return FloatToBFloat16Inline(f); }

Status CheckScaleOp(DType dtype, const ScaleOp& op) {
  if (op.is_identity()) return Status::Ok();
  if (DTypeKindOf(dtype) != DTypeKind::kFloat) {
    return FailedPreconditionError(fmt::format(
        "cannot apply a factor of {} to {} elements: only F64, F32, F16 and BF16 take a factor "
        "other than 1 (integer, BOOL and FP8 values are copied bit for bit)",
        op.factor, DTypeName(dtype)));
  }
  if (!std::isfinite(op.factor) || op.factor == 0.0) {
    return FailedPreconditionError(
        fmt::format("cannot apply a factor of {}: it must be finite and non-zero", op.factor));
  }
  if (dtype != DType::kF64) {
    const float f = static_cast<float>(op.factor);
    if (!std::isfinite(f) || f == 0.0f) {
      return FailedPreconditionError(
          fmt::format("cannot apply a factor of {} to {} elements: it is {} in float arithmetic",
                      op.factor, DTypeName(dtype), f));
    }
  }
  return Status::Ok();
}

Status StridedCopy(DType dtype, std::span<const StridedMove> moves, int num_threads) {
  RESHARD_ASSIGN_OR_RETURN(const std::vector<Plan> plans, CopyPlans(dtype, moves, false));
  const Schedule schedule = MakeSchedule(plans, num_threads);
  RunTasks(schedule, [&](size_t t) {
    const Task& task = schedule.tasks[t];
    const Plan& plan = plans[task.plan];
    VisitRows(plan, task, [&](const Byte* a, const Byte* b, Index n) {
      plan.copy(b, plan.inner_b, const_cast<Byte*>(a), plan.inner_a, n, plan.op.factor);
      return true;
    });
    return true;
  });
  return Status::Ok();
}

Result<std::optional<InexactElement>> StridedCopyExact(DType dtype,
                                                       std::span<const StridedMove> moves,
                                                       int num_threads) {
  RESHARD_ASSIGN_OR_RETURN(const std::vector<Plan> plans, CopyPlans(dtype, moves, true));
  const Index es = static_cast<Index>(DTypeSize(dtype));
  return FindFirst<InexactElement>(
      plans, MakeSchedule(plans, num_threads),
      [&](size_t index, const Plan& plan, const Byte* dst, const Byte* src,
          Index n) -> std::optional<InexactElement> {
        Byte* out = const_cast<Byte*>(dst);
        if (!plan.exact) {
          plan.copy(src, plan.inner_b, out, plan.inner_a, n, plan.op.factor);
          return std::nullopt;
        }
        const Index j = plan.exact(src, plan.inner_b, out, plan.inner_a, n, plan.op.factor,
                                   plan.inverse.factor);
        if (j < 0) return std::nullopt;
        InexactElement e;
        e.move_index = index;
        e.src_offset = (src + j * plan.inner_b - plan.b) / es;
        e.dst_offset = (dst + j * plan.inner_a - plan.a) / es;
        std::memcpy(e.before, src + j * plan.inner_b, static_cast<size_t>(es));
        std::memcpy(e.after, dst + j * plan.inner_a, static_cast<size_t>(es));
        SelectCopy(dtype, plan.inverse, false)(e.after, es, e.back, es, 1, plan.inverse.factor);
        return e;
      });
}

Status StridedZero(DType dtype, std::span<const Index> shape, std::byte* dst,
                   std::span<const Index> dst_strides, int num_threads) {
  RESHARD_ASSIGN_OR_RETURN(
      Plan plan, MakePlan(dtype, shape, dst, dst_strides, dst, dst_strides, ScaleOp::None()));
  plan.copy = SelectZero(dtype, plan.inner_a == static_cast<Index>(DTypeSize(dtype)));
  std::vector<Plan> plans;
  plans.push_back(std::move(plan));
  const Schedule schedule = MakeSchedule(plans, num_threads);
  RunTasks(schedule, [&](size_t t) {
    const Task& task = schedule.tasks[t];
    const Plan& p = plans[task.plan];
    VisitRows(p, task, [&](const Byte* a, const Byte*, Index n) {
      p.copy(nullptr, 0, const_cast<Byte*>(a), p.inner_a, n, 0.0);
      return true;
    });
    return true;
  });
  return Status::Ok();
}

Result<std::optional<CompareMismatch>> StridedCompare(DType dtype,
                                                      std::span<const StridedCompareMove> moves,
                                                      const MismatchFilter& counts,
                                                      int num_threads) {
  std::vector<Plan> plans;
  plans.reserve(moves.size());
  for (size_t i = 0; i < moves.size(); ++i) {
    const StridedCompareMove& m = moves[i];
    RESHARD_RETURN_IF_ERROR(CheckScaleOp(dtype, m.op).Annotate(fmt::format("moves[{}]", i)));
    RESHARD_ASSIGN_OR_RETURN(Plan plan, MakePlan(dtype, m.shape, m.ref, m.ref_strides, m.src,
                                                 m.src_strides, NormaliseOp(dtype, m.op)));
    plan.compare = SelectCompare(dtype, plan.op);
    plan.copy = SelectCopy(dtype, plan.op, false);
    plans.push_back(std::move(plan));
  }
  const Index es = static_cast<Index>(DTypeSize(dtype));
  return FindFirst<CompareMismatch>(
      plans, MakeSchedule(plans, num_threads),
      [&](size_t index, const Plan& plan, const Byte* ref, const Byte* src,
          Index n) -> std::optional<CompareMismatch> {
        Index start = 0;
        while (start < n) {
          const Index j =
              plan.compare(src + start * plan.inner_b, plan.inner_b, ref + start * plan.inner_a,
                           plan.inner_a, n - start, plan.op.factor);
          if (j < 0) return std::nullopt;
          const Byte* s = src + (start + j) * plan.inner_b;
          const Byte* r = ref + (start + j) * plan.inner_a;
          CompareMismatch mm;
          mm.move_index = index;
          mm.src_offset = (s - plan.b) / es;
          mm.ref_offset = (r - plan.a) / es;
          plan.copy(s, es, mm.value, es, 1, plan.op.factor);
          std::memcpy(mm.ref_value, r, static_cast<size_t>(es));
          if (!counts || counts(mm)) return mm;
          start += j + 1;
        }
        return std::nullopt;
      });
}

std::string FormatElement(DType dtype, const std::byte* bytes) {
  auto load = [&](auto v) {
    std::memcpy(&v, bytes, sizeof(v));
    return v;
  };
  switch (dtype) {
    case DType::kF64:
      return fmt::format("{}", load(double{}));
    case DType::kF32:
      return fmt::format("{}", load(float{}));
    case DType::kF16:
      return fmt::format("{}", HalfToFloat(load(uint16_t{})));
    case DType::kBF16:
      return fmt::format("{}", BFloat16ToFloat(load(uint16_t{})));
    case DType::kI64:
      return fmt::format("{}", load(int64_t{}));
    case DType::kI32:
      return fmt::format("{}", load(int32_t{}));
    case DType::kI16:
      return fmt::format("{}", load(int16_t{}));
    case DType::kI8:
      return fmt::format("{}", load(int8_t{}));
    case DType::kU64:
      return fmt::format("{}", load(uint64_t{}));
    case DType::kU32:
      return fmt::format("{}", load(uint32_t{}));
    case DType::kU16:
      return fmt::format("{}", load(uint16_t{}));
    case DType::kU8:
      return fmt::format("{}", load(uint8_t{}));
    case DType::kBool:
      return load(uint8_t{}) != 0 ? "true" : "false";
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return fmt::format("0x{:02x}", load(uint8_t{}));
  }
  return "?";
}

}  // namespace reshard
