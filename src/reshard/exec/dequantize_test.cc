#include "reshard/exec/dequantize.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "reshard/exec/executor.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/ir/block_grid.h"
#include "reshard/ir/fixtures.h"
#include "reshard/ir/random_map.h"

namespace reshard {
namespace {

std::vector<std::byte> Bytes(const std::vector<uint8_t>& v) {
  std::vector<std::byte> out(v.size());
  std::memcpy(out.data(), v.data(), v.size());
  return out;
}

template <typename T>
std::vector<std::byte> BytesOf(const std::vector<T>& v) {
  std::vector<std::byte> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<float> AsFloats(const std::vector<std::byte>& b) {
  std::vector<float> out(b.size() / 4);
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

TEST(DequantizeTest, Float8ValuesAreExact) {
  EXPECT_EQ(Float8ToFloat(DType::kF8E4M3, 0x7E), 448.0f);                // largest finite E4M3
  EXPECT_EQ(Float8ToFloat(DType::kF8E4M3, 0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(Float8ToFloat(DType::kF8E4M3, 0x38), 1.0f);
  EXPECT_EQ(Float8ToFloat(DType::kF8E4M3, 0xC0), -2.0f);
  EXPECT_TRUE(std::isnan(Float8ToFloat(DType::kF8E4M3, 0x7F)));
  EXPECT_EQ(Float8ToFloat(DType::kF8E4M3, 0x78), 256.0f);  // no infinity in E4M3
  EXPECT_EQ(Float8ToFloat(DType::kF8E5M2, 0x7B), 57344.0f);
  EXPECT_TRUE(std::isinf(Float8ToFloat(DType::kF8E5M2, 0x7C)));
}

TEST(DequantizeTest, EachElementTakesItsBlocksScaleEdgeBlocksIncluded) {
  // [3, 5] in blocks of [2, 2]: a 2 x 3 grid whose last row and column are edge blocks.
  std::vector<uint8_t> x(15, 0x38);  // all 1.0
  std::vector<float> s = {1, 2, 4, 8, 16, 32};
  DequantizeSpec spec{DType::kF8E4M3, {3, 5}, DType::kF32, {2, 2}, 1.0f};
  std::vector<std::byte> out(15 * 4);
  ASSERT_TRUE(Dequantize(spec, Bytes(x), BytesOf(s), DType::kF32, out).ok());
  EXPECT_EQ(AsFloats(out), (std::vector<float>{1, 1, 2, 2, 4, 1, 1, 2, 2, 4, 8, 8, 16, 16, 32}));
}

TEST(DequantizeTest, ProductIsRoundedOnceIntoBFloat16) {
  // 1.125 * 1.0078125 = 1.1337890625 (exact in float); bfloat16 rounds it to 1.1328125.
  std::vector<uint8_t> x = {0x39};  // 1.125
  std::vector<float> s = {1.0078125f};
  DequantizeSpec spec{DType::kF8E4M3, {1, 1}, DType::kF32, {128, 128}, 1.0f};
  std::vector<std::byte> out(2);
  ASSERT_TRUE(Dequantize(spec, Bytes(x), BytesOf(s), DType::kBF16, out).ok());
  uint16_t b;
  std::memcpy(&b, out.data(), 2);
  EXPECT_EQ(b, FloatToBFloat16(1.125f * 1.0078125f));
  EXPECT_EQ(BFloat16ToFloat(b), 1.1328125f);
}

TEST(DequantizeTest, Mxfp4NibblesLowFirstTimesPowersOfTwo) {
  // One group of 32 values (16 bytes): byte 0 = 0x21 -> values 0.5 (low) then 1.0 (high).
  std::vector<uint8_t> x(16, 0x00);
  x[0] = 0x21;
  x[15] = 0xF7;                    // 6.0 then -6.0
  std::vector<uint8_t> e = {128};  // 2^1
  DequantizeSpec spec{DType::kU8, {1, 16}, DType::kU8, {1, 16}, 1.0f};
  ASSERT_EQ(DequantizedElements(spec), 32);
  std::vector<std::byte> out(32 * 4);
  ASSERT_TRUE(Dequantize(spec, Bytes(x), Bytes(e), DType::kF32, out).ok());
  const std::vector<float> v = AsFloats(out);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], 2.0f);
  EXPECT_EQ(v[30], 12.0f);
  EXPECT_EQ(v[31], -12.0f);
  EXPECT_EQ(v[2], 0.0f);
}

// compressed-tensors' NVFP4: x * (scale / global) with the quotient in float (a [1] global
// scale), or rounded to bfloat16 first (a 0-d one). 1.5 / 3 = 0.5 exactly; 1 / 3 is not, and
// its bfloat16 rounding (0x3EAB = 0.333984375) differs from the float one.
TEST(DequantizeTest, Nvfp4GlobalScaleDividesTheBlockScale) {
  std::vector<uint8_t> x(8, 0x00);
  x[0] = 0x73;                              // 1.5 then 6.0
  const std::vector<uint8_t> s = {0x3C};    // F8_E4M3 1.5
  const std::vector<uint8_t> one = {0x38};  // F8_E4M3 1.0
  DequantizeSpec spec{DType::kU8, {1, 8}, DType::kF8E4M3, {1, 8}, 3.0f};
  spec.global_divides = true;
  std::vector<std::byte> out(16 * 4);
  ASSERT_TRUE(Dequantize(spec, Bytes(x), Bytes(s), DType::kF32, out).ok());
  std::vector<float> v = AsFloats(out);
  EXPECT_EQ(v[0], 0.75f);
  EXPECT_EQ(v[1], 3.0f);
  ASSERT_TRUE(Dequantize(spec, Bytes(x), Bytes(one), DType::kF32, out).ok());
  v = AsFloats(out);
  EXPECT_EQ(v[1], 6.0f * (1.0f / 3.0f));
  spec.factor_to_bf16 = true;
  ASSERT_TRUE(Dequantize(spec, Bytes(x), Bytes(one), DType::kF32, out).ok());
  v = AsFloats(out);
  EXPECT_EQ(v[1], 6.0f * 0.333984375f);
  // Multiplying instead (ModelOpt's weight_scale_2) gives another number.
  spec.global_divides = spec.factor_to_bf16 = false;
  ASSERT_TRUE(Dequantize(spec, Bytes(x), Bytes(one), DType::kF32, out).ok());
  EXPECT_EQ(AsFloats(out)[1], 18.0f);
}

TEST(DequantizeTest, BadScalesAreRefusedNamingTheBlock) {
  struct Case {
    const char* what;
    DType dtype;
    std::vector<std::byte> scales;
  };
  const std::vector<Case> cases = {
      {"nan", DType::kF32, BytesOf(std::vector<float>{1, NAN})},
      {"inf", DType::kF32, BytesOf(std::vector<float>{INFINITY, 1})},
      {"negative", DType::kF32, BytesOf(std::vector<float>{1, -0.5f})},
      {"e8m0 255", DType::kU8, Bytes({127, 255})},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const bool fp4 = c.dtype == DType::kU8;
    DequantizeSpec spec{
        fp4 ? DType::kU8 : DType::kF8E4M3, {2, fp4 ? 16 : 4}, c.dtype, {1, fp4 ? 16 : 4}, 1.0f};
    std::vector<std::byte> data(static_cast<size_t>(ProductOf(spec.data_shape)));
    std::vector<std::byte> out(static_cast<size_t>(DequantizedElements(spec)) * 4);
    Status st = Dequantize(spec, data, c.scales, DType::kF32, out);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(st.message().find("the scale of block ["), std::string::npos) << st.message();
  }
}

TEST(DequantizeTest, BFloat16RoundingIsTheExecutorsForEveryFloat8AndScale) {
  // Every E4M3 value times a set of scales: the loop's own rounding equals FloatToBFloat16 (the
  // executor's, torch's) bit for bit; NaN data gives torch's NaN.
  std::vector<uint8_t> x(256);
  for (int i = 0; i < 256; ++i) x[static_cast<size_t>(i)] = static_cast<uint8_t>(i);
  for (float sc : {1.0f, 0.0078125f, 1.0078125f, 3.3e-5f, 1e30f, 0.0f}) {
    std::vector<float> s = {sc};
    DequantizeSpec spec{DType::kF8E4M3, {1, 256}, DType::kF32, {1, 256}, 1.0f};
    std::vector<std::byte> out(512);
    ASSERT_TRUE(Dequantize(spec, Bytes(x), BytesOf(s), DType::kBF16, out).ok());
    for (int i = 0; i < 256; ++i) {
      uint16_t got;
      std::memcpy(&got, out.data() + 2 * i, 2);
      const float v = Float8ToFloat(DType::kF8E4M3, static_cast<uint8_t>(i)) * sc;
      if (std::isnan(v)) {
        EXPECT_EQ(got, 0x7FC0) << i;
      } else {
        EXPECT_EQ(got, FloatToBFloat16(v)) << i << " x " << sc;
      }
    }
  }
}

TEST(DequantizeTest, SizesThatDoNotFitAreRefused) {
  DequantizeSpec spec{DType::kF8E4M3, {2, 2}, DType::kF32, {2, 2}, 1.0f};
  std::vector<std::byte> data(4), scales(4), out(7);
  EXPECT_EQ(Dequantize(spec, data, scales, DType::kBF16, out).code(), StatusCode::kInvalidArgument);
  std::vector<std::byte> ok(8);
  EXPECT_EQ(Dequantize(spec, data, scales, DType::kI32, ok).code(), StatusCode::kInvalidArgument);
}

// dequantize(scatter(D, S)) == scatter(dequantize(D, S)): each rank's data shard dequantized
// with its own scale shard (the block image of the data's map) is its shard of the dequantized
// tensor, for random shapes, blocks and splits, half blocks included.
TEST(DequantizeTest, DequantizingEachShardEqualsTheShardOfTheDequantizedTensor) {
  int exact = 0;
  for (uint64_t seed : PropertyTestSeeds(200)) {
    SCOPED_TRACE(testing::Message() << "RESHARD_SEED=" << seed);
    std::mt19937_64 rng(seed);
    auto pick = [&](Index lo, Index hi) {
      return std::uniform_int_distribution<Index>(lo, hi)(rng);
    };
    const Shape block{pick(1, 5), pick(1, 5)};
    const Shape shape{pick(1, 16), pick(1, 16)};
    const size_t dim = static_cast<size_t>(pick(0, 1));
    const int world = static_cast<int>(pick(1, 4));
    std::vector<Index> cuts{0, shape[dim]};
    for (int r = 1; r < world; ++r) cuts.push_back(pick(0, shape[dim]));
    std::sort(cuts.begin(), cuts.end());
    std::vector<Index> sizes;
    for (size_t i = 1; i < cuts.size(); ++i) sizes.push_back(cuts[i] - cuts[i - 1]);
    Result<ParamMap> data_map = fixtures::SplitBuilder(shape, dim, sizes).Finalize();
    ASSERT_TRUE(data_map.ok());
    const Shape grid = *BlockGridShape(shape, block);
    Result<ParamMap> scale_map = BlockImage(*data_map, block, grid);
    if (!scale_map.ok()) continue;  // a local block across two blocks: refused (block_grid_test)
    ++exact;
    const Index n = ProductOf(shape), g = ProductOf(grid);
    std::vector<std::byte> data(static_cast<size_t>(n));
    for (auto& b : data) b = static_cast<std::byte>(pick(0, 0x7E));  // finite E4M3
    std::vector<float> scales(static_cast<size_t>(g));
    for (auto& v : scales) v = static_cast<float>(pick(1, 64)) / 8.0f;
    const DequantizeSpec full_spec{DType::kF8E4M3, shape, DType::kF32, block, 1.0f};
    std::vector<std::byte> full_out(static_cast<size_t>(n) * 4);
    ASSERT_TRUE(Dequantize(full_spec, data, BytesOf(scales), DType::kF32, full_out).ok());
    for (Rank r = 0; r < world; ++r) {
      const Shape& ds = data_map->rank(r).shard_shape;
      const Shape& ss = scale_map->rank(r).shard_shape;
      std::vector<std::byte> d(static_cast<size_t>(ProductOf(ds)));
      std::vector<std::byte> s(static_cast<size_t>(ProductOf(ss)) * 4);
      std::vector<std::byte> want(d.size() * 4), got(d.size() * 4);
      ASSERT_TRUE(
          Extract(*data_map, DType::kU8, r, {data.data(), n}, {d.data(), ProductOf(ds)}).ok());
      ASSERT_TRUE(Extract(*scale_map, DType::kF32, r, {BytesOf(scales).data(), g},
                          {s.data(), ProductOf(ss)})
                      .ok());
      ASSERT_TRUE(
          Extract(*data_map, DType::kF32, r, {full_out.data(), n}, {want.data(), ProductOf(ds)})
              .ok());
      if (d.empty()) continue;
      const DequantizeSpec spec{DType::kF8E4M3, ds, DType::kF32, block, 1.0f};
      ASSERT_TRUE(Dequantize(spec, d, s, DType::kF32, got).ok());
      EXPECT_EQ(got, want) << "rank " << r;
    }
  }
  EXPECT_GT(exact, 100);
}

}  // namespace
}  // namespace reshard
