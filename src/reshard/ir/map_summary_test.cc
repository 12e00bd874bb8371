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

namespace reshard {
namespace {

// vLLM-style fused q and k rows in one buffer: the columns are the tensors.
TEST(MapSummaryTest, BuffersOfUnnumberedTensorsHaveTensorColumns) {
  auto map = [](Index rows, Index offset) {
    ParamMapBuilder b;
    b.set_logical_shape({rows, 2});
    b.set_shard_shape(0, {6, 2});
    b.set_buffer(0, "qkv");
    b.add_piece(0, Piece{{rows, 2}, {0, {2, 1}}, {offset, {2, 1}}, {0}, 1.0});
    return *b.Finalize();
  };
  const ParamMap q = map(4, 0);
  const ParamMap k = map(2, 8);
  const NamedMapRef refs[] = {{"q", &q}, {"k", &k}};
  BufferSetBuilder builder;
  builder.add(BufferDecl{"qkv", DType::kF32, {BufferRank{{6, 2}, {}}}});
  Result<BufferSet> set = builder.Finalize(refs);
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  Result<std::vector<BufferSummary>> view = SummarizeBuffers(*set, refs);
  ASSERT_TRUE(view.ok());
  ASSERT_EQ(view->size(), 1u);
  const BufferSummary& s = (*view)[0];
  EXPECT_FALSE(s.expert_columns());
  ASSERT_EQ(s.columns.size(), 2u);
  EXPECT_EQ(s.columns[1].label, "k");
  EXPECT_EQ(s.cells[0][1].elements, 4);
  EXPECT_TRUE(s.cells[0][1].slots.empty());
  const std::vector<std::string> table = BufferTable(s);
  EXPECT_EQ(table[0], "buffer \"qkv\" (F32): 2 tensors on 1 ranks");
  EXPECT_EQ(table[2], "     0  [6, 2]              0 1");
  EXPECT_EQ(table[3], "  column 0: q");
  EXPECT_EQ(table.back(), "    rank 0 # #");
}

}  // namespace
}  // namespace reshard
