#include "reshard/layouts/basic.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

TEST(BasicLayoutsTest, SplitIsOnePiecePerRankWithRowMajorStrides) {
  Result<ParamMap> m = SplitMap({4, 10}, 1, {3, 3, 2, 2});
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_EQ(m->world_size(), 4);
  const Piece& p = m->rank(2).pieces.at(0);
  EXPECT_EQ(p.shape, (Shape{4, 2}));
  EXPECT_EQ(p.source, (StridedView{6, {10, 1}}));
  EXPECT_EQ(p.dest, (StridedView{0, {2, 1}}));
  EXPECT_EQ(m->rank(2).shard_shape, (Shape{4, 2}));
}

TEST(BasicLayoutsTest, EmptyRankHasNoPieces) {
  Result<ParamMap> m = SplitMap({12, 4}, 0, {4, 4, 4, 0});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_TRUE(m->rank(3).pieces.empty());
  EXPECT_EQ(m->rank(3).shard_shape, (Shape{0, 4}));
}

TEST(BasicLayoutsTest, MultiQueryQkvMatchesTheDesignExample) {
  Result<ParamMap> m = SegmentedMap({48, 8}, 0, {{32, false, {8, 8, 8, 8}}, {16, true, {}}}, 4);
  ASSERT_TRUE(m.ok()) << m.status().message();
  const RankShard& r0 = m->rank(0);
  EXPECT_EQ(r0.shard_shape, (Shape{24, 8}));
  ASSERT_EQ(r0.pieces.size(), 2u);
  EXPECT_EQ(r0.pieces[1].source, (StridedView{256, {8, 1}}));
  EXPECT_EQ(r0.pieces[1].dest, (StridedView{64, {8, 1}}));
  EXPECT_EQ(r0.pieces[1].locations, (std::vector<Rank>{0, 1, 2, 3}));
}

TEST(BasicLayoutsTest, BadSegmentsAreRefused) {
  EXPECT_EQ(
      SegmentedMap({48, 8}, 0, {{32, false, {8, 8, 8}}, {16, true, {}}}, 4).status().message(),
      "segment 0 of 32 indices is split as 8+8+8 across 4 ranks");
  EXPECT_EQ(
      SegmentedMap({48, 8}, 0, {{30, false, {8, 8, 7, 7}}, {16, true, {}}}, 4).status().message(),
      "segments cover 46 indices of dimension 0 but it has 48");
  EXPECT_EQ(SplitMap({4}, 1, {4}).status().message(), "dimension 1 is outside shape [4]");
}

TEST(BasicLayoutsTest, ManySegmentsAreBuiltInOnePassPerRankOrRefusedBeforeAllocating) {
  // 1024 two-row segments at 64 ranks (2^16 pieces): each rank's
  // rows of segment s start at 2s + (the widths of the ranks before it).
  const int world = 64;
  std::vector<Segment> segments(1024, Segment{128, false, std::vector<Index>(world, 2)});
  Result<ParamMap> m = SegmentedMap({1024 * 128, 2}, 0, segments, world);
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_EQ(m->rank(5).pieces.size(), 1024u);
  EXPECT_EQ(m->rank(5).pieces[3].source.offset, (3 * 128 + 5 * 2) * 2);
  EXPECT_EQ(m->rank(5).pieces[3].dest.offset, 3 * 2 * 2);
  EXPECT_EQ(m->rank(63).pieces[1023].source.offset, (1023 * 128 + 63 * 2) * 2);

  segments.assign(Index{1} << 17, Segment{});
  EXPECT_EQ(SegmentedMap({0, 2}, 0, segments, world).status().message(),
            "131072 segments at 64 ranks make a map of more than 4194304 pieces or 16777216 "
            "holder entries");
  EXPECT_FALSE(CheckSegmentCount(5, 5, 2048).ok());
  EXPECT_TRUE(CheckSegmentCount(5, 4, 2048).ok());
  EXPECT_TRUE(CheckSegmentCount(5, 0, 65536).ok());
  EXPECT_FALSE(CheckSegmentCount(65, 0, 65536).ok());
}

TEST(BasicLayoutsTest, PreDividedBiasIsReplicatedAtAQuarter) {
  Result<ParamMap> m = ReplicatedMap({16}, 4, 0.25);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->rank(3).pieces.at(0).scale, 0.25);
  EXPECT_EQ(m->rank(3).pieces.at(0).locations.size(), 4u);
  EXPECT_EQ(EvenSplitSizes(10, 4), (std::vector<Index>{3, 3, 2, 2}));
}

}  // namespace
}  // namespace reshard
