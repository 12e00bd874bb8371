#include "reshard/ir/map_summary.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

// GPT-BigCode fused QKV at TP 2: 32 query rows split, 16 key/value rows on both ranks.
ParamMap BigCodeTp2() {
  ParamMapBuilder b;
  b.set_logical_shape({48, 8});
  for (Rank r = 0; r < 2; ++r) {
    b.set_shard_shape(r, {32, 8});
    b.add_piece(r, Piece{{16, 8}, {r * 128, {8, 1}}, {0, {8, 1}}, {r}, 1.0});
    b.add_piece(r, Piece{{16, 8}, {256, {8, 1}}, {128, {8, 1}}, {0, 1}, 0.5});
  }
  return *b.Finalize();
}

TEST(MapSummaryTest, CountsReplicatedAndScaledElements) {
  MapSummary s = Summarize(BigCodeTp2());
  ASSERT_EQ(s.ranks.size(), 2u);
  EXPECT_EQ(s.ranks[1].pieces, 2);
  EXPECT_EQ(s.ranks[1].elements, 256);
  EXPECT_EQ(s.ranks[1].replicated_elements, 128);
  EXPECT_EQ(s.ranks[1].scaled_elements, 128);
  EXPECT_EQ(s.held_elements, 512);
  EXPECT_EQ(s.full_elements, 384);
}

TEST(MapSummaryTest, PictureShowsRowsPerRankAndTheSharedBlock) {
  Result<std::vector<std::string>> pic = HolderPicture(BigCodeTp2(), 6, 4);
  ASSERT_TRUE(pic.ok()) << pic.status().message();
  EXPECT_EQ(*pic, (std::vector<std::string>{"0000", "0000", "1111", "1111", "****", "****"}));
  EXPECT_EQ(HoldersOf(BigCodeTp2(), 300), (std::vector<Rank>{0, 1}));
  EXPECT_EQ(HoldersOf(BigCodeTp2(), 130), (std::vector<Rank>{1}));
}

TEST(MapSummaryTest, PaddingIsDrawnAsDots) {
  ParamMapBuilder b;
  b.set_logical_shape({4, 2}).set_valid_shape(Shape{3, 2});
  b.set_shard_shape(0, {4, 2});
  b.add_piece(0, Piece{{4, 2}, {0, {2, 1}}, {0, {2, 1}}, {0}, 1.0});
  Result<std::vector<std::string>> pic = HolderPicture(*b.Finalize(), 8, 8);
  ASSERT_TRUE(pic.ok());
  EXPECT_EQ(*pic, (std::vector<std::string>{"00", "00", "00", ".."}));
}

}  // namespace
}  // namespace reshard
