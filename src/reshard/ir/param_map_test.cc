#include "reshard/ir/param_map.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "reshard/ir/fixtures.h"

namespace reshard {
namespace {

using fixtures::BigCodeBuilder;
using fixtures::MakePiece;
using fixtures::SplitBuilder;

std::string Error(const ParamMapBuilder& b, ValidateOptions options = {}) {
  Result<ParamMap> m = b.Finalize(options);
  return m.ok() ? std::string("OK") : m.status().message();
}

TEST(ParamMapTest, RowAndColumnSplitsAreValid) {
  EXPECT_EQ(Error(SplitBuilder({16, 4}, 0, {8, 8})), "OK");
  EXPECT_EQ(Error(SplitBuilder({10, 4}, 0, {3, 3, 2, 2})), "OK");
  EXPECT_EQ(Error(SplitBuilder({4, 10}, 1, {3, 3, 2, 2})), "OK");
  EXPECT_EQ(Error(SplitBuilder({12, 4}, 0, {4, 4, 4, 0})), "OK");  // an empty rank
  EXPECT_EQ(Error(SplitBuilder({2, 3, 12}, 2, {5, 7})), "OK");
}

TEST(ParamMapTest, MultiQueryKeyValueBlockOnEveryRankIsValid) {
  Result<ParamMap> m = BigCodeBuilder(4).Finalize();
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->world_size(), 4);
  EXPECT_EQ(m->num_pieces(), 8);
  EXPECT_EQ(m->shard_num_elements(2), 24 * 8);
}

TEST(ParamMapTest, PreDividedBiasIsValid) {
  ParamMapBuilder b;
  b.set_logical_shape({16});
  for (Rank r = 0; r < 4; ++r) {
    b.set_shard_shape(r, {16});
    b.add_piece(r, MakePiece({16}, 0, {1}, 0, {1}, {0, 1, 2, 3}, 0.25));
  }
  EXPECT_EQ(Error(b), "OK");
}

TEST(ParamMapTest, CodeGenInterleaveIsOneFourDimensionalPiecePerRank) {
  // 24x8 fused QKV at TP 2: rank r holds rows {6a + b + 2c + 12r}.
  ParamMapBuilder b;
  b.set_logical_shape({24, 8});
  for (Rank r = 0; r < 2; ++r) {
    b.set_shard_shape(r, {12, 8});
    b.add_piece(r, MakePiece({2, 2, 3, 8}, 96 * r, {48, 8, 16, 1}, 0, {48, 24, 8, 1}, {r}));
  }
  EXPECT_EQ(Error(b), "OK");
}

TEST(ParamMapTest, PaddedVocabularyMayLeavePaddingUnheld) {
  ParamMapBuilder b = SplitBuilder({16, 4}, 0, {4, 4, 4, 4});
  b.set_valid_shape(Shape{13, 4});
  EXPECT_EQ(Error(b), "OK");
  // Rank 3 holds only rows 12..12: rows 13..15 are padding, so nobody needs to hold them.
  ParamMapBuilder partial;
  partial.set_logical_shape({16, 4}).set_valid_shape(Shape{13, 4});
  for (Rank r = 0; r < 4; ++r) {
    const Index rows = r < 3 ? 4 : 1;
    partial.set_shard_shape(r, {rows, 4});
    partial.add_piece(r, MakePiece({rows, 4}, 16 * r, {4, 1}, 0, {4, 1}, {r}));
  }
  EXPECT_EQ(Error(partial), "OK");
  partial.set_valid_shape(Shape{14, 4});
  EXPECT_EQ(Error(partial), "element [13, 0] of F (shape [16, 4]) is held by no rank");
}

TEST(ParamMapTest, PaddingAlongAnInnerDimension) {
  ParamMapBuilder b;
  b.set_logical_shape({4, 8}).set_valid_shape(Shape{4, 6});
  b.set_shard_shape(0, {4, 6});
  b.add_piece(0, MakePiece({4, 6}, 0, {8, 1}, 0, {6, 1}, {0}));
  EXPECT_EQ(Error(b), "OK");
  b.set_valid_shape(Shape{4, 7});
  EXPECT_EQ(Error(b), "element [0, 6] of F (shape [4, 8]) is held by no rank");
}

TEST(ParamMapTest, SourceViewPastTheEndIsNamed) {
  ParamMapBuilder b = SplitBuilder({16, 4}, 0, {8, 8});
  b.add_piece(1, MakePiece({1, 4}, 62, {4, 1}, 0, {4, 1}, {1}));
  EXPECT_EQ(Error(b),
            "ranks[\"1\"].pieces[1]: source view ends at offset 66 but F has 64 elements");
  EXPECT_EQ(b.Finalize().status().code(), StatusCode::kOutOfRange);
}

TEST(ParamMapTest, DestViewPastTheEndIsNamed) {
  ParamMapBuilder b;
  b.set_logical_shape({8});
  b.set_shard_shape(0, {8});
  b.add_piece(0, MakePiece({8}, 0, {1}, 1, {1}, {0}));
  EXPECT_EQ(Error(b),
            "ranks[\"0\"].pieces[0]: dest view ends at offset 9 but the shard has 8 elements");
}

TEST(ParamMapTest, ShardGapIsNamedWithItsMultiIndex) {
  ParamMapBuilder b;
  b.set_logical_shape({4, 4});
  b.set_shard_shape(0, {4, 4});
  // Two pieces write rows 0-1 and rows 1-2 of the shard; F rows are disjoint.
  b.add_piece(0, MakePiece({2, 4}, 0, {4, 1}, 0, {4, 1}, {0}));
  b.add_piece(0, MakePiece({2, 4}, 8, {4, 1}, 4, {4, 1}, {0}));
  EXPECT_EQ(Error(b), "ranks[\"0\"]: shard element [1, 0] is written by pieces 0 and 1");
}

TEST(ParamMapTest, ElementCountMismatchIsReportedBeforeTheSweep) {
  ParamMapBuilder b = SplitBuilder({16, 4}, 0, {8, 8});
  b.set_shard_shape(1, {9, 4});
  EXPECT_EQ(Error(b),
            "ranks[\"1\"]: pieces account for 32 elements but the shard (shape [9, 4]) has 36; "
            "every shard element must be written by exactly one piece");
}

TEST(ParamMapTest, UncoveredElementIsNamedAsAMultiIndex) {
  ParamMapBuilder b = SplitBuilder({4, 10}, 1, {3, 3, 2, 1});
  EXPECT_EQ(Error(b), "element [0, 9] of F (shape [4, 10]) is held by no rank");
  EXPECT_EQ(Error(b, {.require_coverage = false}), "OK");
}

TEST(ParamMapTest, InhomogeneousPieceIsRefused) {
  // Rank 0 claims the key/value block alone while rank 1 also holds it.
  ParamMapBuilder b;
  b.set_logical_shape({48, 8});
  for (Rank r = 0; r < 2; ++r) {
    b.set_shard_shape(r, {32, 8});
    b.add_piece(r, MakePiece({16, 8}, r * 128, {8, 1}, 0, {8, 1}, {r}));
    b.add_piece(r, MakePiece({16, 8}, 256, {8, 1}, 128, {8, 1},
                             r == 0 ? std::vector<Rank>{0} : std::vector<Rank>{0, 1}));
  }
  EXPECT_EQ(Error(b),
            "ranks[\"0\"].pieces[1]: element [32, 0] of F is held by ranks [0, 1] but the "
            "piece's locations are [0]; a piece must not span elements with different holders");
}

TEST(ParamMapTest, ReplicatedPieceThatIsNotHeldByAllItsLocationsIsRefused) {
  ParamMapBuilder b = BigCodeBuilder(2);
  // Rank 1's key/value piece now covers only half of the block.
  ParamMapBuilder broken;
  broken.set_logical_shape({48, 8});
  broken.set_shard_shape(0, {32, 8});
  broken.add_piece(0, MakePiece({16, 8}, 0, {8, 1}, 0, {8, 1}, {0}));
  broken.add_piece(0, MakePiece({16, 8}, 256, {8, 1}, 128, {8, 1}, {0, 1}));
  broken.set_shard_shape(1, {24, 8});
  broken.add_piece(1, MakePiece({16, 8}, 128, {8, 1}, 0, {8, 1}, {1}));
  broken.add_piece(1, MakePiece({8, 8}, 256, {8, 1}, 128, {8, 1}, {0, 1}));
  EXPECT_EQ(Error(broken),
            "ranks[\"0\"].pieces[1]: element [40, 0] of F is held by ranks [0] but the piece's "
            "locations are [0, 1]; a piece must not span elements with different holders");
  EXPECT_EQ(Error(b), "OK");
}

TEST(ParamMapTest, RankHoldingAnElementTwiceIsRefused) {
  ParamMapBuilder b;
  b.set_logical_shape({4});
  b.set_shard_shape(0, {6});
  b.add_piece(0, MakePiece({4}, 0, {1}, 0, {1}, {0}));
  b.add_piece(0, MakePiece({2}, 1, {1}, 4, {1}, {0}));
  EXPECT_EQ(Error(b),
            "ranks[\"0\"]: holds element [1] of F twice (pieces 0 and 1); a shard holds each "
            "element of F at most once");
}

TEST(ParamMapTest, LocationsMustNameTheListingRankAndExistingRanks) {
  ParamMapBuilder b = SplitBuilder({8}, 0, {4, 4});
  ParamMapBuilder missing_self;
  missing_self.set_logical_shape({8});
  missing_self.set_shard_shape(0, {8});
  missing_self.add_piece(0, MakePiece({8}, 0, {1}, 0, {1}, {1}));
  missing_self.set_shard_shape(1, {0});
  EXPECT_EQ(Error(missing_self),
            "ranks[\"0\"].pieces[0]: locations [1] do not include rank 0, which lists the piece");
  ParamMapBuilder outside;
  outside.set_logical_shape({8});
  outside.set_shard_shape(0, {8});
  outside.add_piece(0, MakePiece({8}, 0, {1}, 0, {1}, {0, 5}));
  EXPECT_EQ(Error(outside),
            "ranks[\"0\"].pieces[0]: locations names rank 5, outside the world of 1 ranks");
  ParamMapBuilder twice;
  twice.set_logical_shape({8});
  twice.set_shard_shape(0, {8});
  twice.add_piece(0, MakePiece({8}, 0, {1}, 0, {1}, {0, 0}));
  EXPECT_EQ(Error(twice), "ranks[\"0\"].pieces[0]: locations names rank 0 twice");
  EXPECT_EQ(Error(b), "OK");
}

TEST(ParamMapTest, LocationsAreSortedOnFinalize) {
  ParamMapBuilder b = BigCodeBuilder(2);
  ParamMapBuilder unsorted;
  unsorted.set_logical_shape({8});
  for (Rank r = 0; r < 2; ++r) {
    unsorted.set_shard_shape(r, {8});
    unsorted.add_piece(r, MakePiece({8}, 0, {1}, 0, {1}, {1, 0}));
  }
  Result<ParamMap> m = unsorted.Finalize();
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->rank(0).pieces[0].locations, (std::vector<Rank>{0, 1}));
}

TEST(ParamMapTest, BadScalesStridesAndLengthsAreRefused) {
  auto one = [](Piece p) {
    ParamMapBuilder b;
    b.set_logical_shape({8});
    b.set_shard_shape(0, {8});
    b.add_piece(0, std::move(p));
    return Error(b);
  };
  EXPECT_EQ(one(MakePiece({8}, 0, {1}, 0, {1}, {0}, 0.0)),
            "ranks[\"0\"].pieces[0]: scale 0 is not a finite non-zero number");
  EXPECT_EQ(one(MakePiece({8}, 0, {1}, 0, {1}, {0}, std::nan(""))),
            "ranks[\"0\"].pieces[0]: scale nan is not a finite non-zero number");
  EXPECT_EQ(one(MakePiece({8}, 0, {1}, 0, {1}, {0}, std::numeric_limits<double>::infinity())),
            "ranks[\"0\"].pieces[0]: scale inf is not a finite non-zero number");
  EXPECT_EQ(one(MakePiece({8}, 0, {0}, 0, {1}, {0})),
            "ranks[\"0\"].pieces[0]: stride 0 on dimension 0 of extent 8 repeats one element; "
            "replication is said with locations, not with a zero stride");
  EXPECT_EQ(one(MakePiece({8}, 0, {-1}, 0, {1}, {0})),
            "ranks[\"0\"].pieces[0]: negative stride on dimension 0 (source -1, dest 1)");
  EXPECT_EQ(
      one(MakePiece({8}, 0, {1, 1}, 0, {1}, {0})),
      "ranks[\"0\"].pieces[0]: shape has 1 dimensions but source has 2 strides and dest has 1");
  EXPECT_EQ(one(MakePiece({8}, -3, {1}, 0, {1}, {0})),
            "ranks[\"0\"].pieces[0]: negative offset (source -3, dest 0)");
  EXPECT_EQ(one(MakePiece({2, 4}, 0, {1, 2}, 0, {4, 1}, {0})), "OK");  // a transposed source
  EXPECT_EQ(one(MakePiece({2, 4}, 0, {1, 1}, 0, {4, 1}, {0}))
                .rfind("ranks[\"0\"]: holds element [1] of F twice", 0),
            0u);
}

TEST(ParamMapTest, OverflowingShapesAndOffsetsAreRefused) {
  ParamMapBuilder b;
  b.set_logical_shape({Index{1} << 40, Index{1} << 40});
  b.set_shard_shape(0, {1});
  EXPECT_EQ(Error(b),
            "logical_shape: shape [1099511627776, 1099511627776] has more than 2^62 elements");
  ParamMapBuilder far;
  far.set_logical_shape({8});
  far.set_shard_shape(0, {8});
  far.add_piece(0, MakePiece({8}, std::numeric_limits<Index>::max() - 2, {1}, 0, {1}, {0}));
  EXPECT_EQ(Error(far), "ranks[\"0\"].pieces[0]: source view overflows 2^62 elements");
}

TEST(ParamMapTest, ValidShapeMustFitInsideLogicalShape) {
  ParamMapBuilder b = SplitBuilder({16, 4}, 0, {8, 8});
  b.set_valid_shape(Shape{17, 4});
  EXPECT_EQ(Error(b), "valid_shape [17, 4] is not within logical_shape [16, 4] (dimension 0)");
  b.set_valid_shape(Shape{16});
  EXPECT_EQ(Error(b), "valid_shape [16] and logical_shape [16, 4] have different ranks");
}

TEST(ParamMapTest, EmptyWorldIsRefused) {
  ParamMapBuilder b;
  b.set_logical_shape({4});
  EXPECT_EQ(Error(b), "ranks is empty: a map needs at least one rank");
}

TEST(ParamMapTest, BillionElementColumnSplitValidatesByBlocksNotElements) {
  // 32768 x 32768 = 2^30 elements over 64 ranks. An element-wise check would take seconds
  // and gigabytes; the box sweep touches 64 boxes.
  std::vector<Index> sizes(64, 512);
  ParamMapBuilder b = SplitBuilder({32768, 32768}, 1, sizes);
  EXPECT_EQ(Error(b), "OK");
  // And a single missing column is still found, at its exact multi-index.
  sizes.back() = 511;
  EXPECT_EQ(Error(SplitBuilder({32768, 32768}, 1, sizes)),
            "element [0, 32767] of F (shape [32768, 32768]) is held by no rank");
}

TEST(ParamMapTest, NonBoxViewsAreCheckedRunByRun) {
  // Stride 3 is not in any radix of 12 elements together with 4: rank 0 holds offsets
  // 0,3,6,9, rank 1 the rest, written as runs of single elements.
  ParamMapBuilder b;
  b.set_logical_shape({12});
  b.set_shard_shape(0, {4});
  b.add_piece(0, MakePiece({4}, 0, {3}, 0, {1}, {0}));
  b.set_shard_shape(1, {8});
  b.add_piece(1, MakePiece({4, 2}, 1, {3, 1}, 0, {2, 1}, {1}));
  EXPECT_EQ(Error(b), "OK");
  ParamMapBuilder c;
  c.set_logical_shape({12});
  c.set_shard_shape(0, {3});
  c.add_piece(0, MakePiece({3}, 0, {3}, 0, {1}, {0}));
  c.set_shard_shape(1, {8});
  c.add_piece(1, MakePiece({4, 2}, 1, {3, 1}, 0, {2, 1}, {1}));
  EXPECT_EQ(Error(c), "element [9] of F (shape [12]) is held by no rank");
}

}  // namespace
}  // namespace reshard
