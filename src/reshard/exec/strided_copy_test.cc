#include "reshard/exec/strided_copy.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <vector>

namespace reshard {
namespace {

template <typename T>
const std::byte* B(const T* p) {
  return reinterpret_cast<const std::byte*>(p);
}
template <typename T>
std::byte* B(T* p) {
  return reinterpret_cast<std::byte*>(p);
}

bool IsQuietHalfNaN(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x0200u) != 0; }
bool IsQuietBFloat16NaN(uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x0040u) != 0; }

// Slow reference rounding of a finite float to bfloat16: pick the nearer of the two
// neighbouring bfloat16 values in double arithmetic, ties to the even pattern.
uint16_t ReferenceBFloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t down = static_cast<uint16_t>(x >> 16);  // truncation toward zero
  const uint16_t up = static_cast<uint16_t>(down + 1);   // next pattern away from zero
  const double vd = static_cast<double>(BFloat16ToFloat(down));
  // `up` may be infinity; its "value" for rounding is the next power of two.
  const double vu = (up & 0x7FFFu) == 0x7F80u ? std::copysign(std::ldexp(1.0, 128), f)
                                              : static_cast<double>(BFloat16ToFloat(up));
  const double dd = std::fabs(static_cast<double>(f) - vd);
  const double du = std::fabs(static_cast<double>(f) - vu);
  if (dd < du) return down;
  if (du < dd) return up;
  return (down & 1u) == 0 ? down : up;
}

TEST(HalfTest, KnownValuesConvertBothWays) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(0x1p-14f), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(HalfToFloat(0x3555), 0x1.554p-2f);
  EXPECT_EQ(HalfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x03FF), 0x3FFp-24f);
  EXPECT_EQ(HalfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
}

TEST(HalfTest, RoundsToNearestEven) {
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3C00);             // tie, down to even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * 0x1p-11f), 0x3C02);         // tie, up to even
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);  // past the tie
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie between 65504 and 2^16: to infinity
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);  // subnormal tie, down to even (zero)
  EXPECT_EQ(FloatToHalf(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(FloatToHalf(0x1p-26f), 0x0000);
  EXPECT_EQ(FloatToHalf(0x7FFp-25f), 0x0400);  // rounds up out of the subnormals
  EXPECT_EQ(FloatToHalf(1e-30f), 0x0000);
}

TEST(HalfTest, NaNStaysQuietNaN) {
  EXPECT_TRUE(IsQuietHalfNaN(FloatToHalf(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsQuietHalfNaN(FloatToHalf(std::bit_cast<float>(0x7F800001u))));  // signalling
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0xFD01)));
}

TEST(HalfTest, EveryHalfSurvivesARoundTripThroughFloat) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const uint16_t back = FloatToHalf(HalfToFloat(static_cast<uint16_t>(h)));
    if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0) {
      ASSERT_TRUE(IsQuietHalfNaN(back)) << h;
    } else {
      ASSERT_EQ(back, h);
    }
  }
}

#ifdef __FLT16_MAX__
TEST(HalfTest, AgreesWithTheCompilersFloat16OnRandomFloats) {
  std::mt19937 rng(12345);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    ASSERT_EQ(FloatToHalf(f), std::bit_cast<uint16_t>(h)) << f;
  }
}
#endif

TEST(BFloat16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f), 0x3F80);                     // tie, down to even
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * 0x1p-8f), 0x3F82);                 // tie, up to even
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x7F7FFFFFu)), 0x7F80);  // overflow: inf
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(BFloat16ToFloat(0x4049), 3.140625f);
}

TEST(BFloat16Test, NaNStaysQuietNaN) {
  EXPECT_TRUE(IsQuietBFloat16NaN(FloatToBFloat16(std::numeric_limits<float>::quiet_NaN())));
  // A signalling NaN whose payload lives only in the dropped bits must not become infinity.
  EXPECT_TRUE(IsQuietBFloat16NaN(FloatToBFloat16(std::bit_cast<float>(0x7F800001u))));
  EXPECT_TRUE(IsQuietBFloat16NaN(FloatToBFloat16(std::bit_cast<float>(0xFFFFFFFFu))));
}

TEST(BFloat16Test, AgreesWithASlowReferenceOnRandomFloats) {
  std::mt19937 rng(777);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBFloat16(f), ReferenceBFloat16(f)) << std::bit_cast<uint32_t>(f);
  }
}

// Applies `op` to `in` through a contiguous 1-D move.
template <typename T>
std::vector<T> Apply(DType dtype, const std::vector<T>& in, ScaleOp op) {
  std::vector<T> out(in.size());
  const Index n = static_cast<Index>(in.size());
  const StridedMove move{{n}, B(in.data()), {1}, B(out.data()), {1}, op};
  const Status s = StridedCopy(dtype, {&move, 1});
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

TEST(ScaleTest, F32MultipliesAndDividesInFloat) {
  EXPECT_EQ(Apply<float>(DType::kF32, {1.5f, -2.0f, 3.0f}, ScaleOp::Multiply(0.5)),
            (std::vector<float>{0.75f, -1.0f, 1.5f}));
  // True division: x / 3 differs from x * float(1/3) for this x.
  const float x = 0x1.000004p+0f;
  const std::vector<float> divided = Apply<float>(DType::kF32, {x}, ScaleOp::Divide(3.0));
  EXPECT_EQ(divided[0], 0x1.55555ap-2f);
  EXPECT_NE(divided[0], x * static_cast<float>(1.0 / 3.0));
}

TEST(ScaleTest, F32FactorIsRoundedToFloatFirst) {
  // 0.1 as a double times 3 differs from float(0.1) * 3 in float; the dtype's arithmetic is
  // the latter.
  const std::vector<float> out = Apply<float>(DType::kF32, {3.0f}, ScaleOp::Multiply(0.1));
  EXPECT_EQ(out[0], 3.0f * 0.1f);
}

TEST(ScaleTest, F64DividesInDouble) {
  const std::vector<double> out =
      Apply<double>(DType::kF64, {1.0, 3.0, -7.5}, ScaleOp::Divide(10.0));
  EXPECT_EQ(out, (std::vector<double>{0.1, 0.3, -0.75}));
}

TEST(ScaleTest, BFloat16ProductsRoundToNearestEven) {
  // 1.5 * (1 + 2^-7) = 1.5 + 1.5 ulp: a tie, to the even 1.5 + 2 ulp (0x3FC2).
  // 1.5 * (1 + 3 * 2^-7) = 1.5 + 4.5 ulp: a tie, to the even 1.5 + 4 ulp (0x3FC4).
  // max * 2 overflows to infinity; 1 / 4 is exact.
  const std::vector<uint16_t> out =
      Apply<uint16_t>(DType::kBF16, {0x3F81, 0x3F83, 0x7F7F, 0xBF80}, ScaleOp::Multiply(1.5));
  EXPECT_EQ(out, (std::vector<uint16_t>{0x3FC2, 0x3FC4, 0x7F80, 0xBFC0}));
  EXPECT_EQ(Apply<uint16_t>(DType::kBF16, {0x3F80, 0x4049}, ScaleOp::Divide(4.0)),
            (std::vector<uint16_t>{0x3E80, 0x3F49}));
}

TEST(ScaleTest, BFloat16NaNStaysQuietNaNAndInfinityStaysInfinity) {
  const std::vector<uint16_t> out =
      Apply<uint16_t>(DType::kBF16, {0x7FC0, 0x7F81, 0xFF80}, ScaleOp::Multiply(0.25));
  EXPECT_TRUE(IsQuietBFloat16NaN(out[0]));
  EXPECT_TRUE(IsQuietBFloat16NaN(out[1]));
  EXPECT_EQ(out[2], 0xFF80);
}

TEST(ScaleTest, HalfScalesThroughSubnormalsWithTiesToEven) {
  // 1 * 0.5 = 0x3800; 2^-14 * 0.5 = 0x0200 (subnormal); 2^-24 * 0.5 is a tie to zero;
  // 3 * 2^-24 * 0.5 is a tie to 2 * 2^-24; NaN stays a quiet NaN.
  const std::vector<uint16_t> out = Apply<uint16_t>(
      DType::kF16, {0x3C00, 0x0400, 0x0001, 0x0003, 0x7D00}, ScaleOp::Multiply(0.5));
  EXPECT_EQ(out[0], 0x3800);
  EXPECT_EQ(out[1], 0x0200);
  EXPECT_EQ(out[2], 0x0000);
  EXPECT_EQ(out[3], 0x0002);
  EXPECT_TRUE(IsQuietHalfNaN(out[4]));
  // Division by a power of two overflows exactly as multiplication would: 65504 / 0.5 = inf.
  EXPECT_EQ(Apply<uint16_t>(DType::kF16, {0x7BFF, 0x3C00}, ScaleOp::Divide(0.5)),
            (std::vector<uint16_t>{0x7C00, 0x4000}));
  // Division by 3 in float, then rounded: 1 / 3 -> 0x3555.
  EXPECT_EQ(Apply<uint16_t>(DType::kF16, {0x3C00}, ScaleOp::Divide(3.0)),
            (std::vector<uint16_t>{0x3555}));
}

TEST(ScaleTest, IntegerBoolAndFloat8RefuseAFactor) {
  for (DType dtype : {DType::kI8, DType::kBool, DType::kF8E4M3, DType::kF8E5M2, DType::kI64}) {
    std::vector<uint64_t> in{1}, out{0};
    const StridedMove move{{1}, B(in.data()), {1}, B(out.data()), {1}, ScaleOp::Multiply(2.0)};
    const Status s = StridedCopy(dtype, {&move, 1});
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << DTypeName(dtype);
    EXPECT_NE(s.message().find(DTypeName(dtype)), std::string::npos) << s.message();
    EXPECT_EQ(out[0], 0u);  // nothing written
  }
  // A factor of exactly 1 is no factor: copied bit for bit.
  std::vector<int8_t> in{-5, 7}, out{0, 0};
  const StridedMove move{{2}, B(in.data()), {1}, B(out.data()), {1}, ScaleOp::Multiply(1.0)};
  ASSERT_TRUE(StridedCopy(DType::kI8, {&move, 1}).ok());
  EXPECT_EQ(out, in);
}

TEST(ScaleTest, NonFiniteOrZeroFactorsAreRefused) {
  EXPECT_EQ(CheckScaleOp(DType::kF32, ScaleOp::Multiply(0.0)).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckScaleOp(DType::kF64, ScaleOp::Divide(std::nan(""))).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckScaleOp(DType::kBF16, ScaleOp::Multiply(1e300)).code(),
            StatusCode::kFailedPrecondition);  // infinite as a float
  EXPECT_TRUE(CheckScaleOp(DType::kF64, ScaleOp::Multiply(1e300)).ok());
}

TEST(StridedCopyTest, TransposeWritesEveryElementToItsPlace) {
  // src: 3x4 row-major; dst: its 4x3 transpose, written through dst strides (1, 3).
  std::vector<int32_t> src(12), dst(12, -1);
  for (int i = 0; i < 12; ++i) src[static_cast<size_t>(i)] = i;
  const StridedMove move{{3, 4}, B(src.data()), {4, 1}, B(dst.data()), {1, 3}, {}};
  ASSERT_TRUE(StridedCopy(DType::kI32, {&move, 1}).ok());
  EXPECT_EQ(dst, (std::vector<int32_t>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
}

TEST(StridedCopyTest, StridedOnBothSidesWithViewsPartWayIntoBuffers) {
  // Every second element of src from element 3; every third element of dst from element 2.
  std::vector<uint16_t> src(20), dst(20, 0xEEEE);
  for (int i = 0; i < 20; ++i) src[static_cast<size_t>(i)] = static_cast<uint16_t>(100 + i);
  const StridedMove move{{2, 3}, B(src.data() + 3), {6, 2}, B(dst.data() + 2), {9, 3}, {}};
  ASSERT_TRUE(StridedCopy(DType::kU16, {&move, 1}).ok());
  std::vector<uint16_t> want(20, 0xEEEE);
  want[2] = 103, want[5] = 105, want[8] = 107;
  want[11] = 109, want[14] = 111, want[17] = 113;
  EXPECT_EQ(dst, want);
}

TEST(StridedCopyTest, ExtentOneDimensionsAndScalarsAndEmptyShapes) {
  std::vector<double> src{1, 2, 3, 4}, dst(4, 0);
  // Extent-1 dimensions with nonsense strides are ignored.
  const StridedMove a{{1, 2, 1}, B(src.data()), {999, 2, 555}, B(dst.data()), {777, 1, 333}, {}};
  ASSERT_TRUE(StridedCopy(DType::kF64, {&a, 1}).ok());
  EXPECT_EQ(dst, (std::vector<double>{1, 3, 0, 0}));
  const StridedMove scalar{{}, B(src.data() + 3), {}, B(dst.data() + 3), {}, ScaleOp::Divide(2)};
  ASSERT_TRUE(StridedCopy(DType::kF64, {&scalar, 1}).ok());
  EXPECT_EQ(dst[3], 2.0);
  const StridedMove empty{{4, 0}, nullptr, {1, 1}, nullptr, {1, 1}, {}};
  EXPECT_TRUE(StridedCopy(DType::kF64, {&empty, 1}).ok());
}

TEST(StridedCopyTest, MalformedMovesAreInvalidArguments) {
  std::vector<float> v(4);
  const StridedMove ranks{{2, 2}, B(v.data()), {2}, B(v.data()), {2, 1}, {}};
  EXPECT_EQ(StridedCopy(DType::kF32, {&ranks, 1}).code(), StatusCode::kInvalidArgument);
  const StridedMove null{{2}, nullptr, {1}, B(v.data()), {1}, {}};
  EXPECT_EQ(StridedCopy(DType::kF32, {&null, 1}).code(), StatusCode::kInvalidArgument);
  const StridedMove negative{{-2}, B(v.data()), {1}, B(v.data()), {1}, {}};
  EXPECT_EQ(StridedCopy(DType::kF32, {&negative, 1}).code(), StatusCode::kInvalidArgument);
}

// Large enough to be split over threads: ~10 MiB of floats in 2 moves (> kInlineBytes), one a
// single long contiguous run, one a column block with short strided rows, both scaled.
TEST(StridedCopyTest, ThreadedSplitMatchesTheElementwiseDefinition) {
  constexpr Index kRows = 4096, kCols = 512;
  std::vector<float> src(kRows * kCols), dst_run(kRows * kCols, 0), dst_cols(kRows * 100, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i % 9973) - 17.0f;
  const std::vector<StridedMove> moves{
      {{kRows * kCols}, B(src.data()), {1}, B(dst_run.data()), {1}, ScaleOp::Multiply(0.5)},
      {{kRows, 100},
       B(src.data() + 7),
       {kCols, 1},
       B(dst_cols.data()),
       {100, 1},
       ScaleOp::Divide(3.0)}};
  ASSERT_GT(static_cast<int64_t>(src.size() * 4), kInlineBytes);
  ASSERT_TRUE(StridedCopy(DType::kF32, moves, /*num_threads=*/2).ok());
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(dst_run[i], src[i] * 0.5f) << i;
  for (Index r = 0; r < kRows; ++r) {
    for (Index c = 0; c < 100; ++c) {
      ASSERT_EQ(dst_cols[static_cast<size_t>(r * 100 + c)],
                src[static_cast<size_t>(r * kCols + c + 7)] / 3.0f);
    }
  }
}

TEST(StridedCopyTest, ThreadedSplitOfAManyRowStridedMove) {
  // A transposing move of 8 MiB: many short rows, split by rows.
  constexpr Index kN = 1024;
  std::vector<uint64_t> src(kN * kN), dst(kN * kN, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = i * 2654435761u;
  const StridedMove move{{kN, kN}, B(src.data()), {kN, 1}, B(dst.data()), {1, kN}, {}};
  ASSERT_TRUE(StridedCopy(DType::kU64, {&move, 1}, 2).ok());
  for (Index i = 0; i < kN; ++i) {
    for (Index j = 0; j < kN; ++j) {
      ASSERT_EQ(dst[static_cast<size_t>(j * kN + i)], src[static_cast<size_t>(i * kN + j)]);
    }
  }
}

TEST(StridedZeroTest, ZeroesOnlyTheView) {
  std::vector<float> v(12, 7.0f);
  const Shape shape{2, 2};
  const Shape strides{6, 2};
  ASSERT_TRUE(StridedZero(DType::kF32, shape, B(v.data() + 1), strides).ok());
  EXPECT_EQ(v, (std::vector<float>{7, 0, 7, 0, 7, 7, 7, 0, 7, 0, 7, 7}));
}

TEST(StridedCompareTest, ReportsTheFirstCountedMismatchWithOffsetsAndValues) {
  // ref holds src / 2 except at elements 2 and 5 of the view.
  std::vector<float> src{2, 4, 6, 8, 10, 12}, ref{1, 2, 9, 4, 5, 9};
  const StridedCompareMove move{{6}, B(src.data()), {1}, B(ref.data()), {1}, ScaleOp::Divide(2.0)};
  Result<std::optional<CompareMismatch>> r = StridedCompare(DType::kF32, {&move, 1});
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->src_offset, 2);
  EXPECT_EQ((*r)->ref_offset, 2);
  EXPECT_EQ(FormatElement(DType::kF32, (*r)->value), "3");
  EXPECT_EQ(FormatElement(DType::kF32, (*r)->ref_value), "9");
  // A filter that ignores offset 2 moves on to offset 5.
  r = StridedCompare(DType::kF32, {&move, 1},
                     [](const CompareMismatch& m) { return m.ref_offset != 2; });
  ASSERT_TRUE(r.ok() && r->has_value());
  EXPECT_EQ((*r)->ref_offset, 5);
  ref[2] = 3, ref[5] = 6;
  r = StridedCompare(DType::kF32, {&move, 1});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value());
}

TEST(StridedCompareTest, ComparesBitsNotValues) {
  // +0 and -0 are equal as values but not as bits; equal NaN patterns compare equal.
  std::vector<float> src{0.0f, std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> ref{-0.0f, std::numeric_limits<float>::quiet_NaN()};
  const StridedCompareMove move{{2}, B(src.data()), {1}, B(ref.data()), {1}, {}};
  Result<std::optional<CompareMismatch>> r = StridedCompare(DType::kF32, {&move, 1});
  ASSERT_TRUE(r.ok() && r->has_value());
  EXPECT_EQ((*r)->ref_offset, 0);
  ref[0] = 0.0f;
  r = StridedCompare(DType::kF32, {&move, 1});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value());
}

TEST(StridedCompareTest, ThreadedCompareFindsTheEarliestMismatch) {
  constexpr size_t kN = size_t{3} << 20;  // 6 MiB of bf16
  std::vector<uint16_t> src(kN), ref(kN);
  for (size_t i = 0; i < kN; ++i) {
    src[i] = static_cast<uint16_t>(0x3F80 + (i % 64));
    ref[i] = FloatToBFloat16(BFloat16ToFloat(src[i]) * 0.25f);
  }
  ref[kN - 10] ^= 1;
  ref[kN / 2 + 3] ^= 1;
  const StridedCompareMove move{{static_cast<Index>(kN)}, B(src.data()), {1}, B(ref.data()), {1},
                                ScaleOp::Multiply(0.25)};
  Result<std::optional<CompareMismatch>> r = StridedCompare(DType::kBF16, {&move, 1}, {}, 2);
  ASSERT_TRUE(r.ok() && r->has_value());
  EXPECT_EQ((*r)->ref_offset, static_cast<Index>(kN / 2 + 3));
}

// Runs StridedCopyExact over `in` (contiguous, or every other element of a buffer twice as
// long when `strided`) and returns the first element that does not survive.
template <typename T>
std::optional<InexactElement> FirstLost(DType dtype, const std::vector<T>& in, ScaleOp op,
                                        std::vector<T>& out, bool strided = false,
                                        int threads = 1) {
  const Index n = static_cast<Index>(in.size());
  std::vector<T> spread(in.size() * 2);
  for (size_t i = 0; i < in.size(); ++i) spread[2 * i] = in[i];
  out.assign(in.size(), T{});
  const StridedMove move{
      {n}, strided ? B(spread.data()) : B(in.data()), {strided ? 2 : 1}, B(out.data()), {1}, op};
  Result<std::optional<InexactElement>> r = StridedCopyExact(dtype, {&move, 1}, threads);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : std::nullopt;
}

TEST(StridedCopyExactTest, HalfUnderflowIsFoundWithItsValuesBeforeAfterAndBack) {
  // F16 [1e-5, 3e-5, 6e-8, 2] at a quarter: 1e-5 (168 * 2^-24) quarters exactly; 3e-5
  // (503 * 2^-24) becomes 125.75 * 2^-24, rounded to 126, which comes back as 504 * 2^-24.
  const std::vector<uint16_t> in{FloatToHalf(1e-5f), FloatToHalf(3e-5f), FloatToHalf(6e-8f),
                                 FloatToHalf(2.0f)};
  ASSERT_EQ(in[1], 503);
  std::vector<uint16_t> out;
  for (bool strided : {false, true}) {
    std::optional<InexactElement> lost =
        FirstLost(DType::kF16, in, ScaleOp::Multiply(0.25), out, strided);
    ASSERT_TRUE(lost.has_value());
    EXPECT_EQ(lost->src_offset, strided ? 2 : 1);
    EXPECT_EQ(lost->dst_offset, 1);
    EXPECT_EQ(FormatElement(DType::kF16, lost->before), FormatElement(DType::kF16, B(&in[1])));
    uint16_t after, back;
    std::memcpy(&after, lost->after, 2);
    std::memcpy(&back, lost->back, 2);
    EXPECT_EQ(after, 126);
    EXPECT_EQ(back, 504);
  }
  // The element that underflows to zero is found when it is the only one.
  ASSERT_TRUE(
      FirstLost(DType::kF16, std::vector<uint16_t>{in[0], in[2]}, ScaleOp::Multiply(0.25), out)
          .has_value());
  EXPECT_FALSE(
      FirstLost(DType::kF16, std::vector<uint16_t>{in[0], in[3]}, ScaleOp::Multiply(0.25), out)
          .has_value());
  EXPECT_EQ(out, (std::vector<uint16_t>{42, FloatToHalf(0.5f)}));
}

TEST(StridedCopyExactTest, OverflowToInfinityIsLostAndInfinityAndNaNSurvive) {
  std::vector<uint16_t> out;
  // 60000 / (1/4) = 240000 overflows F16.
  std::optional<InexactElement> lost =
      FirstLost(DType::kF16, std::vector<uint16_t>{FloatToHalf(1.0f), FloatToHalf(60000.0f)},
                ScaleOp::Divide(0.25), out);
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->dst_offset, 1);
  EXPECT_EQ(FormatElement(DType::kF16, lost->after), "inf");
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> f32_out;
  EXPECT_FALSE(FirstLost(DType::kF32, std::vector<float>{inf, -inf, nan, -0.0f, 0.0f, 1e30f},
                         ScaleOp::Multiply(4.0), f32_out)
                   .has_value());
  EXPECT_TRUE(std::isnan(f32_out[2]));
  EXPECT_TRUE(std::signbit(f32_out[3]));
  std::vector<uint16_t> bf16_out;
  EXPECT_FALSE(FirstLost(DType::kBF16, std::vector<uint16_t>{0x7FC1, 0x3F81, 0x0080},
                         ScaleOp::Multiply(0.5), bf16_out)
                   .has_value());
  EXPECT_TRUE(IsQuietBFloat16NaN(bf16_out[0]));
}

TEST(StridedCopyExactTest, PowersOfTwoAreExactOnNormalValuesAndOtherFactorsRound) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(-1000.0, 1000.0);
  std::vector<double> f64(5000);
  std::vector<float> f32(5000);
  for (size_t i = 0; i < f64.size(); ++i) f64[i] = u(rng), f32[i] = static_cast<float>(u(rng));
  std::vector<double> o64;
  std::vector<float> o32;
  for (double factor : {0.5, 0.125, 1024.0}) {
    EXPECT_FALSE(FirstLost(DType::kF64, f64, ScaleOp::Multiply(factor), o64).has_value());
    EXPECT_FALSE(FirstLost(DType::kF32, f32, ScaleOp::Divide(factor), o32, true, 2).has_value());
  }
  EXPECT_TRUE(FirstLost(DType::kF32, f32, ScaleOp::Multiply(2.0 / 3.0), o32).has_value());
  EXPECT_TRUE(FirstLost(DType::kF64, f64, ScaleOp::Divide(3.0), o64).has_value());
  // An identity op is a plain copy.
  EXPECT_FALSE(FirstLost(DType::kF32, f32, ScaleOp::None(), o32).has_value());
  EXPECT_EQ(o32, f32);
}

TEST(StridedCopyExactTest, ThreadedCopyFindsTheEarliestLoss) {
  constexpr size_t kN = size_t{3} << 20;  // 6 MiB of f16
  std::vector<uint16_t> in(kN, FloatToHalf(1.5f));
  in[kN - 10] = 3;  // subnormals whose low bit a quarter drops
  in[kN / 2 + 3] = 5;
  std::vector<uint16_t> out;
  std::optional<InexactElement> lost =
      FirstLost(DType::kF16, in, ScaleOp::Multiply(0.25), out, false, 2);
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->src_offset, static_cast<Index>(kN / 2 + 3));
}

TEST(FormatElementTest, EachKindReadsNaturally) {
  const double d = 1.5;
  const int16_t i = -3;
  const uint8_t t = 1, fp8 = 0x3C;
  const uint16_t bf = 0x3FA0, half = 0x3E00;
  EXPECT_EQ(FormatElement(DType::kF64, B(&d)), "1.5");
  EXPECT_EQ(FormatElement(DType::kI16, B(&i)), "-3");
  EXPECT_EQ(FormatElement(DType::kBool, B(&t)), "true");
  EXPECT_EQ(FormatElement(DType::kF8E4M3, B(&fp8)), "0x3c");
  EXPECT_EQ(FormatElement(DType::kBF16, B(&bf)), "1.25");
  EXPECT_EQ(FormatElement(DType::kF16, B(&half)), "1.5");
}

}  // namespace
}  // namespace reshard
