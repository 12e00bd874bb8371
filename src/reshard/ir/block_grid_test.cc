#include "reshard/ir/block_grid.h"

#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "reshard/ir/canonicalize.h"
#include "reshard/ir/fixtures.h"
#include "reshard/ir/random_map.h"

namespace reshard {
namespace {

using fixtures::SplitBuilder;

ParamMap Split(const Shape& shape, size_t dim, const std::vector<Index>& sizes) {
  Result<ParamMap> m = SplitBuilder(shape, dim, sizes).Finalize();
  EXPECT_TRUE(m.ok()) << m.status().message();
  return *m;
}

// The element-level oracle: for each rank, the global scale offset of every local block (-1:
// none), or nullopt when some local block takes elements of two blocks.
std::optional<std::vector<std::vector<Index>>> OracleScaleIndex(const ParamMap& data,
                                                                const Shape& block) {
  const Shape& shape = data.logical_shape();
  const Shape grid = *BlockGridShape(shape, block);
  const Shape gs = RowMajorStrides(grid);
  std::vector<std::vector<Index>> out;
  for (Rank r = 0; r < data.world_size(); ++r) {
    const Shape& sshape = data.rank(r).shard_shape;
    const Shape local = *BlockGridShape(sshape, block);
    const Shape ls = RowMajorStrides(local);
    std::vector<Index> index(static_cast<size_t>(ProductOf(local)), -1);
    bool clash = false;
    for (const Piece& p : data.rank(r).pieces) {
      ForEachPieceElement(p, [&](Index dst, Index src) {
        const Shape x = UnravelIndex(src, shape), y = UnravelIndex(dst, sshape);
        Index g = 0, l = 0;
        for (size_t j = 0; j < shape.size(); ++j) g += x[j] / block[j] * gs[j];
        const size_t lead = sshape.size() - shape.size();
        for (size_t j = 0; j < sshape.size(); ++j)
          l += y[j] / (j < lead ? 1 : block[j - lead]) * ls[j];
        Index& slot = index[static_cast<size_t>(l)];
        if (slot >= 0 && slot != g) clash = true;
        slot = g;
      });
    }
    if (clash) return std::nullopt;
    out.push_back(std::move(index));
  }
  return out;
}

void ExpectImageMatchesOracle(const ParamMap& data, const Shape& block) {
  const Shape grid = *BlockGridShape(data.logical_shape(), block);
  Result<ParamMap> image = BlockImage(data, block, grid);
  auto oracle = OracleScaleIndex(data, block);
  // One block for the whole tensor is a per-tensor scale: every rank holds it, even one
  // without data.
  if (ProductOf(grid) == 1) oracle = std::vector<std::vector<Index>>(data.world_size(), {0});
  if (!oracle) {
    ASSERT_FALSE(image.ok()) << "expected a refusal";
    EXPECT_EQ(image.status().code(), StatusCode::kFailedPrecondition) << image.status().message();
    return;
  }
  ASSERT_TRUE(image.ok()) << image.status().message();
  EXPECT_EQ(ExpandSourceOffsets(*image), *oracle);
  // Canonical already: canonicalising changes nothing.
  EXPECT_EQ(*Canonicalize(*image), *image);
}

TEST(BlockGridTest, GridIsCeilOfShapeOverBlock) {
  EXPECT_EQ(*BlockGridShape({576, 7168}, {128, 128}), (Shape{5, 56}));
  EXPECT_EQ(*BlockGridShape({4, 6, 3, 16}, {16}), (Shape{4, 6, 3, 1}));
  EXPECT_FALSE(BlockGridShape({4, 4}, {0, 1}).ok());
  EXPECT_FALSE(BlockGridShape({4}, {1, 1}).ok());
  EXPECT_TRUE(MatchesGrid({4, 6, 3}, {4, 6, 3, 1}));
  EXPECT_TRUE(MatchesGrid({1}, {1, 1}));
  EXPECT_FALSE(MatchesGrid({6, 4}, {4, 6}));
}

TEST(BlockGridTest, WholeBlockRowSplitGivesEachRankItsScaleRows) {
  const ParamMap data = Split({256, 384}, 0, {128, 128});
  Result<ParamMap> s = BlockImage(data, {128, 128}, {2, 3});
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->rank(0).shard_shape, (Shape{1, 3}));
  EXPECT_EQ(s->rank(1).shard_shape, (Shape{1, 3}));
  EXPECT_EQ(ExpandSourceOffsets(*s), (std::vector<std::vector<Index>>{{0, 1, 2}, {3, 4, 5}}));
  for (Rank r = 0; r < 2; ++r) EXPECT_EQ(s->rank(r).pieces[0].locations, (std::vector<Rank>{r}));
}

TEST(BlockGridTest, HalfBlockRowSplitHoldsTheScaleOnBothRanks) {
  // Two 64-row key/value heads at TP 2: each rank's rows lie in the one 128-row block.
  const ParamMap data = Split({128, 256}, 0, {64, 64});
  Result<ParamMap> s = BlockImage(data, {128, 128}, {1, 2});
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(ExpandSourceOffsets(*s), (std::vector<std::vector<Index>>{{0, 1}, {0, 1}}));
  EXPECT_EQ(s->rank(1).pieces[0].locations, (std::vector<Rank>{0, 1}));
}

TEST(BlockGridTest, SplitThroughABlockThatStraddlesIsRefusedNamingTheBlocks) {
  // 384 rows at TP 2: rank 1 starts at row 192, so its local block 0 (rows 192..319) would
  // take rows of blocks 1 and 2.
  Result<ParamMap> s = BlockImage(Split({384, 128}, 0, {192, 192}), {128, 128}, {3, 1});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("blocks 1 and 2"), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("rank 1"), std::string::npos) << s.status().message();
}

TEST(BlockGridTest, ColumnSplitAndEdgeBlocks) {
  ExpectImageMatchesOracle(Split({576, 512}, 1, {256, 256}), {128, 128});
  ExpectImageMatchesOracle(Split({576, 512}, 0, {256, 320}), {128, 128});
  ExpectImageMatchesOracle(Split({576, 512}, 0, {576}), {128, 128});
}

TEST(BlockGridTest, UnitDimensionsOfTheStoredScalesFollowTheGrid) {
  // MXFP4: blocks [E, R, G, 16] bytes, scales [E, R, G]; experts split over two ranks.
  const ParamMap data = Split({4, 6, 3, 16}, 0, {2, 2});
  Result<ParamMap> s = BlockImage(data, {1, 1, 1, 16}, {4, 6, 3});
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->logical_shape(), (Shape{4, 6, 3}));
  EXPECT_EQ(s->rank(1).shard_shape, (Shape{2, 6, 3}));
  std::vector<Index> rank1(36);
  for (Index i = 0; i < 36; ++i) rank1[static_cast<size_t>(i)] = 36 + i;
  EXPECT_EQ(ExpandSourceOffsets(*s)[1], rank1);
}

TEST(BlockGridTest, PerTensorScaleIsHeldByEveryRank) {
  Result<ParamMap> s = BlockImage(Split({8, 4}, 0, {4, 4}), {8, 4}, {});
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->rank(1).shard_shape, Shape{});
  EXPECT_EQ(s->rank(1).pieces[0].locations, (std::vector<Rank>{0, 1}));
}

TEST(BlockGridTest, ScalesThatAreNotTheGridAreRefused) {
  const ParamMap data = Split({256, 256}, 0, {128, 128});
  Result<ParamMap> s = BlockImage(data, {128, 128}, {2, 3});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("not the block grid [2, 2]"), std::string::npos);
}

TEST(BlockGridTest, ReplicatedDataReplicatesItsScales) {
  ParamMapBuilder b;
  b.set_logical_shape({200, 300}).set_world_size(3);
  for (Rank r = 0; r < 3; ++r) {
    b.set_shard_shape(r, {200, 300});
    b.add_piece(r, fixtures::MakePiece({200, 300}, 0, {300, 1}, 0, {300, 1}, {0, 1, 2}));
  }
  ExpectImageMatchesOracle(*b.Finalize(), {128, 128});
}

TEST(BlockGridTest, CostIsSetByPiecesNotElements) {
  // 2^42 data elements in blocks of [1, 32] at TP 4 (2^37 scales): an element walk would not
  // finish (and is refused past 2^26 scale elements), so the image is built from the pieces.
  const Index rows = Index{1} << 22, cols = Index{1} << 20;
  const ParamMap data = Split({rows, cols}, 0, {rows / 4, rows / 4, rows / 4, rows / 4});
  Result<ParamMap> s = BlockImage(data, {1, 32}, {rows, cols / 32});
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->rank(3).shard_shape, (Shape{rows / 4, cols / 32}));
  EXPECT_EQ(s->num_pieces(), 4);
}

// MXFP4 as vLLM holds it at TP 2 with 3 groups: data [E=2, R=4, G=3, 16] in buffers [2, 4, 32]
// (rank 0 takes groups 0 and 1 of every row, rank 1 group 2, then its buffer's padding), scales
// [2, 4, 3] in buffers [2, 4, 2]; `swapped`: rank 0 takes the scales of groups 1 and 2 and rank
// 1 those of group 0 (a map, but not the data's block image).
std::pair<ParamMap, ParamMap> Mxfp4InVllmBuffers(bool swapped) {
  ParamMapBuilder d, s;
  d.set_logical_shape({2, 4, 3, 16}).set_world_size(2);
  s.set_logical_shape({2, 4, 3}).set_world_size(2);
  for (Rank r = 0; r < 2; ++r) {
    d.set_shard_shape(r, {2, 4, 32}).set_buffer(r, "w2_weight");
    s.set_shard_shape(r, {2, 4, 2}).set_buffer(r, "w2_weight_scale");
  }
  d.add_piece(0, Piece{{2, 4, 2, 16}, {0, {192, 48, 16, 1}}, {0, {128, 32, 16, 1}}, {0}});
  d.add_piece(1, Piece{{2, 4, 16}, {32, {192, 48, 1}}, {0, {128, 32, 1}}, {1}});
  s.add_piece(0, Piece{{2, 4, 2}, {swapped ? 1 : 0, {12, 3, 1}}, {0, {8, 2, 1}}, {0}});
  s.add_piece(1, Piece{{2, 4}, {swapped ? 0 : 2, {12, 3}}, {0, {8, 2}}, {1}});
  Result<ParamMap> dm = d.Finalize(), sm = s.Finalize();
  EXPECT_TRUE(dm.ok()) << dm.status().message();
  EXPECT_TRUE(sm.ok()) << sm.status().message();
  return {*dm, *sm};
}

TEST(BlockGridTest, Mxfp4GroupsHeldFlatInVllmParametersAreCheckedAsOneDimension) {
  auto [data, scales] = Mxfp4InVllmBuffers(false);
  const Status ok = CheckBlockTie(data, scales, {1, 1, 1, 16});
  EXPECT_TRUE(ok.ok()) << ok.message();
  // Ranks holding other groups' scales are caught.
  auto [same, wrong] = Mxfp4InVllmBuffers(true);
  const Status bad = CheckBlockTie(same, wrong, {1, 1, 1, 16});
  EXPECT_EQ(bad.code(), StatusCode::kFailedPrecondition) << bad.message();
}

TEST(BlockGridTest, RandomSplitsMatchTheElementOracle) {
  for (uint64_t seed : PropertyTestSeeds(300)) {
    SCOPED_TRACE(testing::Message() << "RESHARD_SEED=" << seed);
    std::mt19937_64 rng(seed);
    auto pick = [&](Index lo, Index hi) {
      return std::uniform_int_distribution<Index>(lo, hi)(rng);
    };
    const Shape block{pick(1, 6), pick(1, 6)};
    const Shape shape{pick(1, 20), pick(1, 20)};
    const size_t dim = static_cast<size_t>(pick(0, 1));
    const int world = static_cast<int>(pick(1, 4));
    // Cut points: aligned to the block half of the time, anywhere otherwise.
    std::vector<Index> cuts{0, shape[dim]};
    for (int r = 1; r < world; ++r) {
      Index c = pick(0, shape[dim]);
      if (pick(0, 1) == 0) c = std::min(shape[dim], c / block[dim] * block[dim]);
      cuts.push_back(c);
    }
    std::sort(cuts.begin(), cuts.end());
    std::vector<Index> sizes;
    for (size_t i = 1; i < cuts.size(); ++i) sizes.push_back(cuts[i] - cuts[i - 1]);
    ExpectImageMatchesOracle(Split(shape, dim, sizes), block);
  }
}

// A fused layout over [parts * part_rows, cols]: rank r holds rows [r q, (r + 1) q) of every
// part (q = part_rows / world), as one piece [parts, q, cols] stepping whole parts.
ParamMap FusedRows(Index parts, Index part_rows, Index cols, int world) {
  const Index q = part_rows / world;
  ParamMapBuilder b;
  b.set_logical_shape({parts * part_rows, cols}).set_world_size(world);
  for (Rank r = 0; r < world; ++r) {
    b.set_shard_shape(r, {parts * q, cols});
    b.add_piece(r, Piece{{parts, q, cols},
                         {r * q * cols, {part_rows * cols, cols, 1}},
                         {0, {q * cols, cols, 1}},
                         {r},
                         1.0});
  }
  Result<ParamMap> m = b.Finalize();
  EXPECT_TRUE(m.ok()) << m.status().message();
  return *m;
}

TEST(BlockGridTest, FusedPartsWholeBlocksApartKeepTheirBlocks) {
  // 512 rows as two parts at TP 2, blocks of 128: rank r takes block rows r and 2 + r.
  const ParamMap data = FusedRows(2, 256, 256, 2);
  Result<ParamMap> image = BlockImage(data, {128, 128}, {4, 2});
  ASSERT_TRUE(image.ok()) << image.status().message();
  EXPECT_EQ(ExpandSourceOffsets(*image),
            (std::vector<std::vector<Index>>{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  // 384 rows as two parts: rank 0's local block 0 takes rows 0-95 and 192-223 (blocks 0 and
  // 1): a check the map fails (exit 1), not a malformed map.
  Result<ParamMap> cut = BlockImage(FusedRows(2, 192, 256, 2), {128, 128}, {3, 2});
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.status().code(), StatusCode::kFailedPrecondition) << cut.status().message();
}

TEST(BlockGridTest, RandomFusedPartsMatchTheElementOracleWhereTheyAreWholeBlocksApart) {
  for (uint64_t seed : PropertyTestSeeds(300)) {
    SCOPED_TRACE(testing::Message() << "RESHARD_SEED=" << seed);
    std::mt19937_64 rng(seed);
    auto pick = [&](Index lo, Index hi) {
      return std::uniform_int_distribution<Index>(lo, hi)(rng);
    };
    const Shape block{pick(1, 6), pick(1, 3)};
    const int world = static_cast<int>(pick(1, 4));
    const Index parts = pick(1, 4), cols = pick(1, 8);
    // Parts of whole local blocks half of the time, any size otherwise.
    const Index q = pick(0, 1) == 0 ? block[0] * pick(1, 3) : pick(1, 9);
    const ParamMap data = FusedRows(parts, q * world, cols, world);
    const Shape grid = *BlockGridShape(data.logical_shape(), block);
    Result<ParamMap> image = BlockImage(data, block, grid);
    auto oracle = OracleScaleIndex(data, block);
    if (ProductOf(grid) == 1) continue;  // per tensor: every rank holds it
    if (image.ok()) {
      ASSERT_TRUE(oracle.has_value());
      EXPECT_EQ(ExpandSourceOffsets(*image), *oracle);
    } else {
      EXPECT_EQ(image.status().code(), StatusCode::kFailedPrecondition) << image.status().message();
    }
    if (!oracle) {
      EXPECT_FALSE(image.ok());
    }
    if (q % block[0] == 0 && q * world % block[0] == 0) {
      EXPECT_TRUE(image.ok()) << image.status().message();
    }
  }
}

}  // namespace
}  // namespace reshard
