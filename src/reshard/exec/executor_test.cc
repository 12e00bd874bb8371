#include "reshard/exec/executor.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "reshard/exec/strided_copy.h"
#include "reshard/ir/fixtures.h"

namespace reshard {
namespace {

using fixtures::BigCodeBuilder;
using fixtures::MakePiece;
using fixtures::SplitBuilder;

ParamMap Finalized(const ParamMapBuilder& b) {
  Result<ParamMap> m = b.Finalize();
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return std::move(m).value();
}

// CodeGen fused QKV, 24x8 at TP 2: rank r holds F rows 12r + 6a + b + 2c at shard rows
// 6a + 3b + c.
ParamMapBuilder CodeGen() {
  ParamMapBuilder b;
  b.set_logical_shape({24, 8});
  for (Rank r = 0; r < 2; ++r) {
    b.set_shard_shape(r, {12, 8});
    b.add_piece(r, MakePiece({2, 2, 3, 8}, 96 * r, {48, 8, 16, 1}, 0, {48, 24, 8, 1}, {r}));
  }
  return b;
}

// A pre-divided bias: every rank holds all of F times `scale`.
ParamMapBuilder Replicated(Index n, int world, double scale) {
  ParamMapBuilder b;
  b.set_logical_shape({n});
  std::vector<Rank> all;
  for (Rank r = 0; r < world; ++r) all.push_back(r);
  for (Rank r = 0; r < world; ++r) {
    b.set_shard_shape(r, {n});
    b.add_piece(r, MakePiece({n}, 0, {1}, 0, {1}, all, scale));
  }
  return b;
}

// Typed storage with helpers to view it as executor buffers.
template <typename T>
struct Tensor {
  std::vector<T> v;
  ConstBuffer c() const {
    return {reinterpret_cast<const std::byte*>(v.data()), static_cast<Index>(v.size())};
  }
  MutableBuffer m() {
    return {reinterpret_cast<std::byte*>(v.data()), static_cast<Index>(v.size())};
  }
};

template <typename T>
Tensor<T> Iota(Index n, T start = T(0)) {
  Tensor<T> t{std::vector<T>(static_cast<size_t>(n))};
  for (Index i = 0; i < n; ++i) t.v[static_cast<size_t>(i)] = static_cast<T>(start + T(i));
  return t;
}

// Extracts every rank's shard of `full`.
template <typename T>
std::vector<Tensor<T>> ExtractAll(const ParamMap& map, DType dtype, const Tensor<T>& full,
                                  const ExecOptions& options = {}) {
  std::vector<Tensor<T>> shards;
  for (Rank r = 0; r < map.world_size(); ++r) {
    shards.push_back({std::vector<T>(static_cast<size_t>(map.shard_num_elements(r)))});
    const Status s = Extract(map, dtype, r, full.c(), shards.back().m(), options);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return shards;
}

template <typename T>
std::vector<ConstBuffer> Buffers(const std::vector<Tensor<T>>& shards) {
  std::vector<ConstBuffer> out;
  for (const Tensor<T>& s : shards) out.push_back(s.c());
  return out;
}

// Bytes of every dtype, random (including NaN and signalling-NaN patterns for the floats).
std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(n);
  for (std::byte& b : out) b = static_cast<std::byte>(rng() & 0xFF);
  return out;
}

TEST(ExecutorTest, EveryDTypeRoundTripsBitExactThroughExtractAndRebuild) {
  const std::vector<ParamMap> maps{Finalized(BigCodeBuilder(4)), Finalized(CodeGen()),
                                   Finalized(SplitBuilder({6, 10}, 1, {3, 3, 2, 2}))};
  for (DType dtype : kAllDTypes) {
    for (size_t mi = 0; mi < maps.size(); ++mi) {
      const ParamMap& map = maps[mi];
      const size_t es = DTypeSize(dtype);
      const std::vector<std::byte> full =
          RandomBytes(static_cast<size_t>(map.num_elements()) * es, static_cast<uint32_t>(mi) + 1);
      std::vector<std::vector<std::byte>> shards;
      std::vector<ConstBuffer> views;
      for (Rank r = 0; r < map.world_size(); ++r) {
        shards.emplace_back(static_cast<size_t>(map.shard_num_elements(r)) * es);
        ASSERT_TRUE(Extract(map, dtype, r, {full.data(), map.num_elements()},
                            {shards.back().data(), map.shard_num_elements(r)})
                        .ok());
      }
      for (Rank r = 0; r < map.world_size(); ++r) {
        views.push_back({shards[static_cast<size_t>(r)].data(), map.shard_num_elements(r)});
      }
      std::vector<std::byte> rebuilt(full.size(), std::byte{0xAB});
      const Status s = Rebuild(map, dtype, views, {rebuilt.data(), map.num_elements()});
      ASSERT_TRUE(s.ok()) << DTypeName(dtype) << " map " << mi << ": " << s.ToString();
      EXPECT_EQ(rebuilt, full) << DTypeName(dtype) << " map " << mi;
    }
  }
}

TEST(ExecutorTest, CodeGenFourDimensionalPiecePutsEachRowInItsInterleavedPlace) {
  const ParamMap map = Finalized(CodeGen());
  const Tensor<float> full = Iota<float>(24 * 8);
  const std::vector<Tensor<float>> shards = ExtractAll(map, DType::kF32, full);
  for (Rank r = 0; r < 2; ++r) {
    for (Index a = 0; a < 2; ++a) {
      for (Index b = 0; b < 2; ++b) {
        for (Index c = 0; c < 3; ++c) {
          for (Index col = 0; col < 8; ++col) {
            const Index f_row = 12 * r + 6 * a + b + 2 * c;
            const Index s_row = 6 * a + 3 * b + c;
            ASSERT_EQ(shards[static_cast<size_t>(r)].v[static_cast<size_t>(s_row * 8 + col)],
                      static_cast<float>(f_row * 8 + col));
          }
        }
      }
    }
  }
  // Spot checks, written out: shard 0 row 1 is F row 2; shard 1 row 3 is F row 13.
  EXPECT_EQ(shards[0].v[8], 16.0f);
  EXPECT_EQ(shards[1].v[24], 104.0f);
  Tensor<float> rebuilt{std::vector<float>(24 * 8, -1.0f)};
  ASSERT_TRUE(Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m()).ok());
  EXPECT_EQ(rebuilt.v, full.v);
}

TEST(ExecutorTest, TransposedPieceReadsAColumnMajorView) {
  // The single rank holds F (3x4) transposed: shard (4x3), source strides (1, 4).
  ParamMapBuilder b;
  b.set_logical_shape({3, 4});
  b.set_shard_shape(0, {4, 3});
  b.add_piece(0, MakePiece({4, 3}, 0, {1, 4}, 0, {3, 1}, {0}));
  const ParamMap map = Finalized(b);
  const Tensor<int32_t> full = Iota<int32_t>(12);
  const std::vector<Tensor<int32_t>> shards = ExtractAll(map, DType::kI32, full);
  EXPECT_EQ(shards[0].v, (std::vector<int32_t>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  Tensor<int32_t> rebuilt{std::vector<int32_t>(12, -1)};
  ASSERT_TRUE(Rebuild(map, DType::kI32, Buffers(shards), rebuilt.m()).ok());
  EXPECT_EQ(rebuilt.v, full.v);
}

TEST(ExecutorTest, BuffersThatStartPartWayIntoAllocationsAreUsedFromTheirFirstElement) {
  const ParamMap map = Finalized(SplitBuilder({4, 6}, 1, {2, 4}));
  // F lives at element 5 of a larger allocation; rank 1's shard at element 3 of another.
  std::vector<double> f_alloc(5 + 24 + 2, -7.0);
  for (int i = 0; i < 24; ++i) f_alloc[static_cast<size_t>(5 + i)] = i;
  std::vector<double> s1_alloc(3 + 16 + 3, -9.0);
  const ConstBuffer f{reinterpret_cast<const std::byte*>(f_alloc.data() + 5), 24};
  const MutableBuffer s1{reinterpret_cast<std::byte*>(s1_alloc.data() + 3), 16};
  ASSERT_TRUE(Extract(map, DType::kF64, 1, f, s1).ok());
  EXPECT_EQ(s1_alloc, (std::vector<double>{-9, -9, -9, 2,  3,  4,  5,  8,  9,  10, 11,
                                           14, 15, 16, 17, 20, 21, 22, 23, -9, -9, -9}));
  std::vector<double> s0(8);
  ASSERT_TRUE(Extract(map, DType::kF64, 0, f, {reinterpret_cast<std::byte*>(s0.data()), 8}).ok());
  std::vector<double> out_alloc(1 + 24 + 1, -5.0);
  const std::vector<ConstBuffer> shards{{reinterpret_cast<const std::byte*>(s0.data()), 8},
                                        {s1.data, 16}};
  ASSERT_TRUE(
      Rebuild(map, DType::kF64, shards, {reinterpret_cast<std::byte*>(out_alloc.data() + 1), 24})
          .ok());
  EXPECT_EQ(out_alloc.front(), -5.0);
  EXPECT_EQ(out_alloc.back(), -5.0);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(out_alloc[static_cast<size_t>(1 + i)], i);
}

TEST(ExecutorTest, ExtractMultipliesByScaleAndRebuildDividesF32) {
  const ParamMap map = Finalized(Replicated(4, 4, 0.25));
  const Tensor<float> full{{1.0f, -2.0f, 3.0f, 0.1f}};
  const std::vector<Tensor<float>> shards = ExtractAll(map, DType::kF32, full);
  for (const Tensor<float>& s : shards) {
    EXPECT_EQ(s.v, (std::vector<float>{0.25f, -0.5f, 0.75f, 0.1f * 0.25f}));
  }
  Tensor<float> rebuilt{std::vector<float>(4)};
  ASSERT_TRUE(Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m()).ok());
  EXPECT_EQ(rebuilt.v, full.v);
}

TEST(ExecutorTest, NonPowerOfTwoScaleUsesTheDTypesArithmeticF64AndF16) {
  // Split over 2 ranks at scale 3: F64 multiplies in double; F16 multiplies in float and
  // rounds: 0x3555 (0.333251953125) * 3 = 0.999755859375 = 1 - 2^-12 in float, a tie
  // between 0x3BFF and 0x3C00 in half, rounded to the even 0x3C00.
  const ParamMap map = Finalized(SplitBuilder({4}, 0, {2, 2}, 3.0));
  ExecOptions lossy;
  lossy.allow_lossy_scale = true;
  const Tensor<double> f64{{0.1, 1.0, -2.5, 1e300}};
  const std::vector<Tensor<double>> d = ExtractAll(map, DType::kF64, f64, lossy);
  EXPECT_EQ(d[0].v, (std::vector<double>{0.1 * 3.0, 3.0}));
  EXPECT_EQ(d[1].v, (std::vector<double>{-7.5, 1e300 * 3.0}));
  const Tensor<uint16_t> f16{{0x3555, 0x3C00, 0x7BFF, 0x0001}};
  const std::vector<Tensor<uint16_t>> h = ExtractAll(map, DType::kF16, f16, lossy);
  EXPECT_EQ(h[0].v, (std::vector<uint16_t>{0x3C00, 0x4200}));
  EXPECT_EQ(h[1].v, (std::vector<uint16_t>{0x7C00, 0x0003}));  // 65504 * 3 overflows
}

TEST(ExecutorTest, BFloat16ScaledRoundTripIsExactForAPowerOfTwo) {
  const ParamMap map = Finalized(SplitBuilder({2, 4}, 1, {2, 2}, 0.5));
  const Tensor<uint16_t> full{{0x3F81, 0x3F83, 0xC0A0, 0x7FC0, 0x0080, 0x4049, 0xFF80, 0x0000}};
  const std::vector<Tensor<uint16_t>> shards = ExtractAll(map, DType::kBF16, full);
  // Halving changes only the exponent, except the smallest normal, which becomes subnormal.
  EXPECT_EQ(shards[0].v, (std::vector<uint16_t>{0x3F01, 0x3F03, 0x0040, 0x3FC9}));
  EXPECT_EQ(shards[1].v, (std::vector<uint16_t>{0xC020, 0x7FC0, 0xFF80, 0x0000}));
  Tensor<uint16_t> rebuilt{std::vector<uint16_t>(8)};
  ASSERT_TRUE(Rebuild(map, DType::kBF16, Buffers(shards), rebuilt.m()).ok());
  EXPECT_EQ(rebuilt.v, full.v);
}

TEST(ExecutorTest, ScaledPiecesOnIntegerBoolAndFloat8AreRefused) {
  const ParamMap map = Finalized(Replicated(4, 2, 0.5));
  for (DType dtype : {DType::kI8, DType::kBool, DType::kF8E4M3}) {
    std::vector<uint8_t> full(4, 1), shard(4, 0);
    const Status s = Extract(map, dtype, 1, {reinterpret_cast<const std::byte*>(full.data()), 4},
                             {reinterpret_cast<std::byte*>(shard.data()), 4});
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << DTypeName(dtype);
    EXPECT_NE(s.message().find("ranks[\"1\"].pieces[0]"), std::string::npos) << s.message();
    EXPECT_EQ(shard, (std::vector<uint8_t>(4, 0)));
  }
}

TEST(ExecutorTest, OptimizerStateThroughAScaledPieceIsRefusedUnlessAllowed) {
  const ParamMap map = Finalized(Replicated(2, 2, 0.25));
  const Tensor<float> full{{1.0f, 3.0f}};
  Tensor<float> shard{std::vector<float>(2, 0.0f)};
  ExecOptions options;
  options.scale_power = -1;
  Status s = Extract(map, DType::kF32, 0, full.c(), shard.m(), options);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("scale power -1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("learning rate and epsilon stay in the source coordinate"),
            std::string::npos)
      << s.message();
  std::vector<Tensor<float>> shards{{{4.0f, 12.0f}}, {{4.0f, 12.0f}}};
  Tensor<float> rebuilt{std::vector<float>(2)};
  EXPECT_EQ(Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m(), options).code(),
            StatusCode::kFailedPrecondition);

  // Allowed: the shard holds F * scale^-1 = F * 4, and rebuild undoes it.
  options.allow_scaled_optimizer_state = true;
  ASSERT_TRUE(Extract(map, DType::kF32, 0, full.c(), shard.m(), options).ok());
  EXPECT_EQ(shard.v, (std::vector<float>{4.0f, 12.0f}));
  ASSERT_TRUE(Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m(), options).ok());
  EXPECT_EQ(rebuilt.v, full.v);
  // p = -2 (Adam's second moment): F * 16.
  options.scale_power = -2;
  ASSERT_TRUE(Extract(map, DType::kF32, 0, full.c(), shard.m(), options).ok());
  EXPECT_EQ(shard.v, (std::vector<float>{16.0f, 48.0f}));
  // Unscaled pieces move optimizer state without being asked.
  const ParamMap plain = Finalized(SplitBuilder({2}, 0, {1, 1}));
  ExecOptions strict;
  strict.scale_power = -2;
  Tensor<float> one{std::vector<float>(1)};
  ASSERT_TRUE(Extract(plain, DType::kF32, 1, full.c(), one.m(), strict).ok());
  EXPECT_EQ(one.v[0], 3.0f);
}

TEST(ExecutorTest, WrongBufferSizesNameExpectedAndGivenElementsAndTheRank) {
  const ParamMap map = Finalized(BigCodeBuilder(4));  // F 48x8, shards 24x8
  Tensor<float> full{std::vector<float>(384)};
  Tensor<float> shard{std::vector<float>(100)};
  Status s = Extract(map, DType::kF32, 2, full.c(), shard.m());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "the shard buffer of rank 2 has 100 elements but the map gives rank 2 a shard of "
            "shape [24, 8] (192 elements)");
  Tensor<float> small_full{std::vector<float>(383)};
  shard.v.resize(192);
  s = Extract(map, DType::kF32, 2, small_full.c(), shard.m());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "the F buffer has 383 elements but the map's logical shape [48, 8] has 384");

  std::vector<Tensor<float>> shards(4, Tensor<float>{std::vector<float>(192)});
  shards[3].v.resize(191);
  s = Rebuild(map, DType::kF32, Buffers(shards), full.m());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("rank 3 has 191 elements"), std::string::npos) << s.message();
  shards.pop_back();
  s = Rebuild(map, DType::kF32, Buffers(shards), full.m());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "3 shard buffers given for a map of world size 4");
  EXPECT_EQ(Extract(map, DType::kF32, 4, full.c(), shard.m()).code(), StatusCode::kInvalidArgument);
}

TEST(ExecutorTest, DisagreeingReplicasAreNamedWithRanksIndexOffsetAndValues) {
  const ParamMap map = Finalized(BigCodeBuilder(4));
  Tensor<float> full{std::vector<float>(384, 0.5f)};
  full.v[323] = 1.5f;  // element [40, 3], in the key/value block every rank holds
  std::vector<Tensor<float>> shards = ExtractAll(map, DType::kF32, full);
  // Rank 2 holds the block at shard rows 8..23: F row 40 is shard row 16.
  ASSERT_EQ(shards[2].v[16 * 8 + 3], 1.5f);
  shards[2].v[16 * 8 + 3] = 1.25f;
  shards[3].v[16 * 8 + 3] = 1.0f;  // rank 3 too; rank 2 is reported first
  Tensor<float> rebuilt{std::vector<float>(384)};
  const Status s = Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "ranks 0 and 2 hold different data for element [40, 3] of F (offset 323): 1.5 vs "
            "1.25");
  // The same check on the shards alone.
  EXPECT_EQ(VerifyReplicas(map, DType::kF32, Buffers(shards)), s);
  // Without verification, rank 0's data wins silently.
  ExecOptions no_verify;
  no_verify.verify_replicas = false;
  ASSERT_TRUE(Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m(), no_verify).ok());
  EXPECT_EQ(rebuilt.v, full.v);
}

TEST(ExecutorTest, ReplicasAreComparedAfterUndoingTheirScale) {
  const ParamMap map = Finalized(Replicated(3, 3, 0.25));
  std::vector<Tensor<float>> shards{
      {{0.25f, 0.5f, 1.0f}}, {{0.25f, 0.5f, 1.0f}}, {{0.25f, 0.75f, 1.0f}}};
  Tensor<float> rebuilt{std::vector<float>(3)};
  const Status s = Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m());
  EXPECT_EQ(s.message(),
            "ranks 0 and 2 hold different data for element [1] of F (offset 1): 2 vs 3");
  EXPECT_EQ(VerifyReplicas(map, DType::kF32, Buffers(shards)), s);
  shards[2].v[1] = 0.5f;
  EXPECT_TRUE(VerifyReplicas(map, DType::kF32, Buffers(shards)).ok());
  ASSERT_TRUE(Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m()).ok());
  EXPECT_EQ(rebuilt.v, (std::vector<float>{1.0f, 2.0f, 4.0f}));
}

TEST(ExecutorTest, UnheldPaddingIsZeroFilledAndHeldPaddingKeepsItsData) {
  // F 16x4 with 13 valid rows: ranks 0..2 hold 4 rows each, rank 3 only row 12.
  ParamMapBuilder b;
  b.set_logical_shape({16, 4}).set_valid_shape(Shape{13, 4});
  for (Rank r = 0; r < 4; ++r) {
    const Index rows = r < 3 ? 4 : 1;
    b.set_shard_shape(r, {rows, 4});
    b.add_piece(r, MakePiece({rows, 4}, 16 * r, {4, 1}, 0, {4, 1}, {r}));
  }
  const ParamMap map = Finalized(b);
  const Tensor<int16_t> full = Iota<int16_t>(64, 1);
  const std::vector<Tensor<int16_t>> shards = ExtractAll(map, DType::kI16, full);
  Tensor<int16_t> rebuilt{std::vector<int16_t>(64, -1)};
  ASSERT_TRUE(Rebuild(map, DType::kI16, Buffers(shards), rebuilt.m()).ok());
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(rebuilt.v[static_cast<size_t>(i)], i < 52 ? i + 1 : 0) << i;
  }
  // A full split of the padded F: rank 3 holds padding rows 13..15, which keep its data.
  const ParamMap held =
      Finalized(SplitBuilder({16, 4}, 0, {4, 4, 4, 4}).set_valid_shape(Shape{13, 4}));
  const std::vector<Tensor<int16_t>> all = ExtractAll(held, DType::kI16, full);
  ASSERT_TRUE(Rebuild(held, DType::kI16, Buffers(all), rebuilt.m()).ok());
  EXPECT_EQ(rebuilt.v, full.v);
}

TEST(ExecutorTest, PaddingAlongAnInnerDimensionIsZeroFilled) {
  ParamMapBuilder b;
  b.set_logical_shape({3, 8}).set_valid_shape(Shape{3, 6});
  b.set_shard_shape(0, {3, 6});
  b.add_piece(0, MakePiece({3, 6}, 0, {8, 1}, 0, {6, 1}, {0}));
  const ParamMap map = Finalized(b);
  const std::vector<Tensor<float>> shards{{std::vector<float>(18, 2.0f)}};
  Tensor<float> rebuilt{std::vector<float>(24, 9.0f)};
  ASSERT_TRUE(Rebuild(map, DType::kF32, Buffers(shards), rebuilt.m()).ok());
  for (int i = 0; i < 24; ++i) {
    EXPECT_EQ(rebuilt.v[static_cast<size_t>(i)], i % 8 < 6 ? 2.0f : 0.0f) << i;
  }
}

TEST(ExecutorTest, DisagreementInsidePaddingIsIgnored) {
  // Two ranks both hold all of a 4x2 F whose last row is padding.
  ParamMapBuilder b;
  b.set_logical_shape({4, 2}).set_valid_shape(Shape{3, 2});
  for (Rank r = 0; r < 2; ++r) {
    b.set_shard_shape(r, {4, 2});
    b.add_piece(r, MakePiece({4, 2}, 0, {2, 1}, 0, {2, 1}, {0, 1}));
  }
  const ParamMap map = Finalized(b);
  std::vector<Tensor<int32_t>> shards{Iota<int32_t>(8), Iota<int32_t>(8)};
  shards[1].v[7] = 70;  // padding element [3, 1]
  Tensor<int32_t> rebuilt{std::vector<int32_t>(8)};
  ASSERT_TRUE(Rebuild(map, DType::kI32, Buffers(shards), rebuilt.m()).ok());
  EXPECT_TRUE(VerifyReplicas(map, DType::kI32, Buffers(shards)).ok());
  EXPECT_EQ(rebuilt.v, Iota<int32_t>(8).v);  // rank 0's padding data
  shards[1].v[5] = 50;                       // real element [2, 1]
  const Status s = Rebuild(map, DType::kI32, Buffers(shards), rebuilt.m());
  EXPECT_EQ(s.message(),
            "ranks 0 and 1 hold different data for element [2, 1] of F (offset 5): 5 vs 50");
  EXPECT_EQ(VerifyReplicas(map, DType::kI32, Buffers(shards)), s);
}

TEST(ExecutorTest, VerifyingReplicasReadsOnlyReplicatedPiecesAndSkipsUnreplicatedMaps) {
  // A split map has no replicas: nothing to compare, whatever the shards hold.
  const ParamMap split = Finalized(SplitBuilder({4, 2}, 0, {2, 2}));
  std::vector<Tensor<float>> two{{{1, 2, 3, 4}}, {{5, 6, 7, 8}}};
  EXPECT_TRUE(VerifyReplicas(split, DType::kF32, Buffers(two)).ok());
  // Only the key/value block of GPT-BigCode is compared: query rows may differ freely.
  const ParamMap map = Finalized(BigCodeBuilder(2));
  const Tensor<float> full = Iota<float>(384);
  std::vector<Tensor<float>> shards = ExtractAll(map, DType::kF32, full);
  shards[1].v[0] = -1.0f;  // a query element of rank 1
  EXPECT_TRUE(VerifyReplicas(map, DType::kF32, Buffers(shards)).ok());
  shards[1].v[16 * 8 + 15 * 8 + 7] = -1.0f;  // the last key/value element, F [47, 7]
  EXPECT_EQ(VerifyReplicas(map, DType::kF32, Buffers(shards)).message(),
            "ranks 0 and 1 hold different data for element [47, 7] of F (offset 383): 383 vs -1");
  shards.pop_back();
  EXPECT_EQ(VerifyReplicas(map, DType::kF32, Buffers(shards)).code(),
            StatusCode::kFailedPrecondition);
}

TEST(ExecutorTest, ReplicasSplitDifferentlyOnTheirHoldersAreComparedInF) {
  // Both ranks hold all of F [4]: rank 0 as one piece, rank 1 as two, so no piece of rank 1
  // has a twin on rank 0 to compare bytes with.
  ParamMapBuilder b;
  b.set_logical_shape({4});
  b.set_shard_shape(0, {4}).set_shard_shape(1, {4});
  b.add_piece(0, MakePiece({4}, 0, {1}, 0, {1}, {0, 1}));
  b.add_piece(1, MakePiece({2}, 2, {1}, 0, {1}, {0, 1}));  // F [2, 4) first
  b.add_piece(1, MakePiece({2}, 0, {1}, 2, {1}, {0, 1}));
  const ParamMap map = Finalized(b);
  std::vector<Tensor<float>> shards{{{1, 2, 3, 4}}, {{3, 4, 1, 2}}};
  EXPECT_TRUE(VerifyReplicas(map, DType::kF32, Buffers(shards)).ok());
  shards[1].v[1] = 5;  // F element [3]
  EXPECT_EQ(VerifyReplicas(map, DType::kF32, Buffers(shards)).message(),
            "ranks 0 and 1 hold different data for element [3] of F (offset 3): 4 vs 5");
}

TEST(ExecutorTest, AScaleThatLosesAValueIsRefusedUnlessAllowed) {
  // F16 [1e-5, 3e-5, 6e-8, 2] pre-divided at TP 4: 3e-5 does not survive a quarter.
  const ParamMap map = Finalized(Replicated(4, 4, 0.25));
  const Tensor<uint16_t> full{
      {FloatToHalf(1e-5f), FloatToHalf(3e-5f), FloatToHalf(6e-8f), FloatToHalf(2.0f)}};
  Tensor<uint16_t> shard{std::vector<uint16_t>(4)};
  Status s = Extract(map, DType::kF16, 2, full.c(), shard.m());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "ranks[\"2\"].pieces[0]: element [1] of F (offset 1) does not survive the scale: "
            "2.9981136e-05 multiplied by 0.25 gives 7.5101852e-06 (it underflows into the "
            "subnormals of F16, which keep fewer bits), which scales back to 3.0040741e-05; "
            "refusing to change a value silently (allow lossy scale to apply the scale anyway)");
  ExecOptions lossy;
  lossy.allow_lossy_scale = true;
  const std::vector<Tensor<uint16_t>> shards = ExtractAll(map, DType::kF16, full, lossy);
  Tensor<uint16_t> rebuilt{std::vector<uint16_t>(4)};
  ASSERT_TRUE(Rebuild(map, DType::kF16, Buffers(shards), rebuilt.m()).ok());
  EXPECT_EQ(rebuilt.v, (std::vector<uint16_t>{full.v[0], 504, 0, full.v[3]}));

  // Adam's first moment (scale power -1) is held at F * 4: 60000 overflows F16.
  lossy.scale_power = -1;
  lossy.allow_scaled_optimizer_state = true;
  lossy.allow_lossy_scale = false;
  const Tensor<uint16_t> moment{{FloatToHalf(1.0f), FloatToHalf(60000.0f), 0, 0}};
  s = Extract(map, DType::kF16, 0, moment.c(), shard.m(), lossy);
  EXPECT_NE(s.message().find("element [1] of F (offset 1) does not survive the scale: 60000 "
                             "divided by 0.25 gives inf (it overflows F16 to infinity)"),
            std::string::npos)
      << s.message();

  // Rebuild checks its own scaling: a shard value that F cannot hold.
  const ParamMap up = Finalized(Replicated(2, 1, 4.0));
  const std::vector<Tensor<float>> tiny{{{1.0f, std::numeric_limits<float>::denorm_min() * 3}}};
  Tensor<float> f{std::vector<float>(2)};
  s = Rebuild(up, DType::kF32, Buffers(tiny), f.m());
  EXPECT_NE(s.message().find("ranks[\"0\"].pieces[0]: element [1] of F (offset 1)"),
            std::string::npos)
      << s.message();
}

TEST(ExecutorTest, APlanFactorThatRoundsIsRefusedNamingTheMove) {
  // Pre-divided at TP 2 -> TP 3: rank 0 moves its values at a factor of 2/3.
  const ParamMap from = Finalized(Replicated(64, 2, 0.5));
  const ParamMap to = Finalized(Replicated(64, 3, 1.0 / 3.0));
  Result<ParamPlan> plan = Compose(to, from);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const Tensor<float> held = Iota<float>(64, 0.1f);
  const std::vector<Tensor<float>> src{held, held};
  std::vector<Tensor<float>> dst(3, Tensor<float>{std::vector<float>(64)});
  std::vector<MutableBuffer> targets;
  for (Tensor<float>& t : dst) targets.push_back(t.m());
  const Status s = ExecutePlan(*plan, DType::kF32, Buffers(src), targets);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("moves[0] (source rank 0 -> target rank 0): element "),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("does not survive the scale"), std::string::npos) << s.message();
  ExecOptions lossy;
  lossy.allow_lossy_scale = true;
  EXPECT_TRUE(ExecutePlan(*plan, DType::kF32, Buffers(src), targets, lossy).ok());
}

TEST(ExecutorTest, LargeColumnSplitRoundTripsOnTwoThreads) {
  // 4096 x 2048 bf16 (16 MiB) with a scale: rank 1's 8 MiB is split over threads.
  const ParamMap map = Finalized(SplitBuilder({4096, 2048}, 1, {512, 1024, 512}, 0.5));
  Tensor<uint16_t> full{std::vector<uint16_t>(4096 * 2048)};
  for (size_t i = 0; i < full.v.size(); ++i) {
    full.v[i] = static_cast<uint16_t>(0x3F80 + (i * 7) % 0x3F00);
  }
  ExecOptions two;
  two.num_threads = 2;
  const std::vector<Tensor<uint16_t>> shards = ExtractAll(map, DType::kBF16, full, two);
  EXPECT_EQ(shards[1].v[0], FloatToBFloat16(BFloat16ToFloat(full.v[512]) * 0.5f));
  Tensor<uint16_t> rebuilt{std::vector<uint16_t>(full.v.size())};
  ASSERT_TRUE(Rebuild(map, DType::kBF16, Buffers(shards), rebuilt.m(), two).ok());
  EXPECT_EQ(rebuilt.v, full.v);
}

}  // namespace
}  // namespace reshard
