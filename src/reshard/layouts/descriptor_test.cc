#include "reshard/layouts/descriptor.h"

#include <gtest/gtest.h>

#include "reshard/ir/canonicalize.h"
#include "reshard/ir/infer.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/basic.h"

namespace reshard {
namespace {

LayoutDescriptor Parse(std::string_view json) {
  Result<LayoutDescriptor> d = ParseLayoutJson(json);
  EXPECT_TRUE(d.ok()) << d.status().message();
  return d.ok() ? *d : LayoutDescriptor{};
}

ParamMap Build(std::string_view json, const Shape& shape, int world) {
  Result<ParamMap> m = BuildMap(Parse(json), shape, world);
  EXPECT_TRUE(m.ok()) << json << " at " << world << ": " << m.status().message();
  return m.ok() ? *m : *ReplicatedMap({1}, 1);
}

std::vector<size_t> PiecesPerRank(const ParamMap& m) {
  std::vector<size_t> n;
  for (const RankShard& r : m.ranks()) n.push_back(r.pieces.size());
  return n;
}

std::vector<Index> ShardExtents(const ParamMap& m, size_t dim) {
  std::vector<Index> n;
  for (const RankShard& r : m.ranks()) n.push_back(r.shard_shape[dim]);
  return n;
}

SplitRule Rule(Remainder remainder, std::optional<Index> heads = std::nullopt,
               std::optional<Index> grain = std::nullopt, std::vector<Index> sizes = {}) {
  SplitRule rule;
  rule.remainder = remainder;
  rule.heads = heads;
  rule.grain = grain;
  rule.sizes = std::move(sizes);
  return rule;
}

constexpr Remainder kFront = Remainder::kFront;

TEST(SplitSizesTest, RemainderPolicies) {
  EXPECT_EQ(*SplitSizes(10, 4, {}), (std::vector<Index>{3, 3, 2, 2}));
  EXPECT_EQ(*SplitSizes(10, 4, Rule(Remainder::kBack)), (std::vector<Index>{2, 2, 3, 3}));
  EXPECT_EQ(*SplitSizes(10, 4, Rule(Remainder::kCeil)), (std::vector<Index>{3, 3, 3, 1}));
  EXPECT_EQ(*SplitSizes(5, 4, Rule(Remainder::kCeil)), (std::vector<Index>{2, 2, 1, 0}));
  EXPECT_EQ(*SplitSizes(12, 4, Rule(Remainder::kExact)), (std::vector<Index>{3, 3, 3, 3}));
}

TEST(SplitSizesTest, HeadAlignmentLeavesRanksEmptyWhenHeadsAreFewerThanRanks) {
  EXPECT_EQ(*SplitSizes(24, 4, Rule(kFront, 3)), (std::vector<Index>{8, 8, 8, 0}));
  EXPECT_EQ(*SplitSizes(40, 3, Rule(kFront, 5)), (std::vector<Index>{16, 16, 8}));
}

TEST(SplitSizesTest, GrainAlignmentGivesTheTailToTheLastRank) {
  EXPECT_EQ(*SplitSizes(200, 3, Rule(kFront, std::nullopt, 32)), (std::vector<Index>{64, 64, 72}));
  // Smaller than one grain: split index by index, as DeepSpeed does.
  EXPECT_EQ(*SplitSizes(5, 2, Rule(kFront, std::nullopt, 32)), (std::vector<Index>{3, 2}));
}

TEST(SplitSizesTest, RefusalsNameTheCountAndTheWorld) {
  Result<std::vector<Index>> r = SplitSizes(10, 4, Rule(Remainder::kExact));
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(),
            "10 indices cannot be split evenly over 4 ranks; use a world size that divides 10");
  r = SplitSizes(18, 4, Rule(Remainder::kExact, 6));
  EXPECT_EQ(r.status().message(),
            "6 heads cannot be split evenly over 4 ranks; use a world size that divides 6");
  r = SplitSizes(10, 2, Rule(kFront, 3));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "10 indices are not a whole number of 3 heads");
  r = SplitSizes(10, 3, Rule(kFront, std::nullopt, std::nullopt, {5, 5}));
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  r = SplitSizes(10, 2, Rule(kFront, std::nullopt, std::nullopt, {5, 4}));
  EXPECT_EQ(r.status().message(), "sizes [5, 4] sum to 9, but the dimension has 10");
}

TEST(DescriptorTest, ColumnSplitIsOnePiecePerRank) {
  ParamMap m = Build(R"({"family": "split", "dim": 1})", {4, 10}, 4);
  const Piece& p = m.rank(2).pieces.at(0);
  EXPECT_EQ(p.shape, (Shape{4, 2}));
  EXPECT_EQ(p.source, (StridedView{6, {10, 1}}));
  EXPECT_EQ(p.dest, (StridedView{0, {2, 1}}));
  EXPECT_EQ(PiecesPerRank(m), (std::vector<size_t>{1, 1, 1, 1}));
}

TEST(DescriptorTest, PreDividedReplicaIsHeldAtOneOverWorld) {
  ParamMap m = Build(R"({"family": "replicated", "pre_divided": true})", {16}, 4);
  EXPECT_EQ(m.rank(3).pieces.at(0).scale, 0.25);
  EXPECT_EQ(m.rank(3).pieces.at(0).locations, (std::vector<Rank>{0, 1, 2, 3}));
}

TEST(DescriptorTest, FusedQkvWithNarrowKeyValueSplitsEachPart) {
  // q 32 rows, k and v 8 rows each, at TP 4: 8 + 2 + 2 rows per rank. The k and v blocks
  // fold into one piece of shape [2 (k, v), 2 rows, 6].
  ParamMap m =
      Build(R"({"family": "fused", "dim": 0, "parts": [{"size": 32}, {"size": 8}, {"size": 8}]})",
            {48, 6}, 4);
  EXPECT_EQ(ShardExtents(m, 0), (std::vector<Index>{12, 12, 12, 12}));
  const RankShard& r1 = m.rank(1);
  ASSERT_EQ(r1.pieces.size(), 2u);
  EXPECT_EQ(r1.pieces[0].source, (StridedView{8 * 6, {6, 1}}));
  EXPECT_EQ(r1.pieces[1].shape, (Shape{2, 2, 6}));
  EXPECT_EQ(r1.pieces[1].source, (StridedView{(32 + 2) * 6, {8 * 6, 6, 1}}));
  EXPECT_EQ(r1.pieces[1].dest, (StridedView{8 * 6, {2 * 6, 6, 1}}));
}

TEST(DescriptorTest, PackedGateUpIsTwoEqualParts) {
  ParamMap m = Build(R"({"family": "fused", "dim": 0, "parts": 2})", {16, 4}, 2);
  ASSERT_EQ(m.rank(1).pieces.size(), 1u);  // folds into one 3-D piece: (2 halves, 4 rows, 4)
  EXPECT_EQ(m.rank(1).shard_shape, (Shape{8, 4}));
  EXPECT_EQ(m.rank(1).pieces[0].source.offset, 4 * 4);
}

TEST(DescriptorTest, MultiQueryKeepsTheSharedBlockApart) {
  ParamMap m = Build(
      R"({"family": "segmented", "dim": 0, "parts": [{"size": 32}, {"size": 16, "replicated": true}]})",
      {48, 8}, 4);
  const RankShard& r0 = m.rank(0);
  EXPECT_EQ(r0.shard_shape, (Shape{24, 8}));
  ASSERT_EQ(r0.pieces.size(), 2u);
  EXPECT_EQ(r0.pieces[1].source, (StridedView{256, {8, 1}}));
  EXPECT_EQ(r0.pieces[1].dest, (StridedView{64, {8, 1}}));
  EXPECT_EQ(r0.pieces[1].locations, (std::vector<Rank>{0, 1, 2, 3}));
}

TEST(DescriptorTest, SharedQkWithOddHeadsPerRankSharesAHeadBetweenNeighbours) {
  // 6 heads of 2 rows at TP 2: 3 query heads per rank; rank 0 holds value heads 0, 1, 3, 4
  // and rank 1 holds 1, 2, 4, 5, so heads 1 and 4 are held by both.
  ParamMap m = Build(R"({"family": "block_gather", "dim": 0, "pairing": "shared_qk", "heads": 6})",
                     {12, 3}, 2);
  EXPECT_EQ(ShardExtents(m, 0), (std::vector<Index>{8, 8}));
  // Per holder set, the two heads fold into one piece whose rows are strided in the shard
  // too: heads 0 and 3 (rank 0 alone) at shard rows 0-1 and 4-5, heads 1 and 4 (shared).
  const RankShard& r0 = m.rank(0);
  ASSERT_EQ(r0.pieces.size(), 2u);
  EXPECT_EQ(r0.pieces[0].locations, (std::vector<Rank>{0}));
  EXPECT_EQ(r0.pieces[0].source, (StridedView{0, {18, 3, 1}}));
  EXPECT_EQ(r0.pieces[0].dest, (StridedView{0, {12, 3, 1}}));
  EXPECT_EQ(r0.pieces[1].locations, (std::vector<Rank>{0, 1}));
  EXPECT_EQ(r0.pieces[1].source.offset, 2 * 3);
  EXPECT_EQ(r0.pieces[1].dest.offset, 2 * 3);
}

TEST(DescriptorTest, SharedQkAtEvenHeadsIsOnePiecePerRank) {
  // 8 heads at TP 2: rank 0 holds 0, 1, 4, 5 - a 3-D piece (2 runs of 2 heads).
  ParamMap m = Build(R"({"family": "block_gather", "dim": 1, "pairing": "shared_qk", "heads": 8})",
                     {3, 16}, 2);
  EXPECT_EQ(PiecesPerRank(m), (std::vector<size_t>{1, 1}));
}

TEST(DescriptorTest, SharedQkRefusesAWorldItCannotPair) {
  Result<ParamMap> m = BuildMap(
      Parse(R"({"family": "block_gather", "pairing": "shared_qk", "heads": 8})"), {16, 2}, 3);
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(m.status().message().find("8 heads cannot be split over 3 ranks"), std::string::npos)
      << m.status().message();
  m = BuildMap(Parse(R"({"family": "block_gather", "pairing": "shared_qk", "heads": 8})"), {16, 2},
               8);
  EXPECT_NE(m.status().message().find("8 heads allow at most 4 ranks"), std::string::npos)
      << m.status().message();
}

TEST(DescriptorTest, CodegenIsOneFourDimensionalPiecePerRank) {
  ParamMap m = Build(R"({"family": "codegen_qkv", "dim": 0, "heads": 16})", {24, 8}, 2);
  EXPECT_EQ(PiecesPerRank(m), (std::vector<size_t>{1, 1}));
  EXPECT_EQ(m.rank(1).pieces[0].shape.size(), 4u);
}

TEST(DescriptorTest, CodegenRefusesHeadsThatDoNotDivide) {
  Result<ParamMap> m =
      BuildMap(Parse(R"({"family": "codegen_qkv", "dim": 0, "heads": 16})"), {96, 8}, 8);
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(m.status().message().find("16 heads do not split over 8 ranks"), std::string::npos)
      << m.status().message();
}

TEST(DescriptorTest, PaddedVocabularyRecordsTheRealRows) {
  ParamMap m = Build(R"({"family": "padded_vocab", "dim": 0})", {13, 4}, 4);
  EXPECT_EQ(m.logical_shape(), (Shape{16, 4}));
  EXPECT_EQ(m.valid_shape(), (Shape{13, 4}));
  EXPECT_EQ(ShardExtents(m, 0), (std::vector<Index>{4, 4, 4, 4}));
  ParamMap fixed = Build(R"({"family": "padded_vocab", "dim": 0, "padded_size": 24})", {13, 4}, 3);
  EXPECT_EQ(fixed.logical_shape(), (Shape{24, 4}));
  Result<ParamMap> bad =
      BuildMap(Parse(R"({"family": "padded_vocab", "dim": 0, "padded_size": 24})"), {13, 4}, 5);
  EXPECT_EQ(bad.status().code(), StatusCode::kFailedPrecondition);
}

// Every family at every world size it allows: canonical, idempotent, equal to inference on
// its own index maps byte for byte, and its JSON form reads back to the same descriptor.
struct Case {
  const char* json;
  Shape shape;
  std::vector<int> worlds;
};

TEST(DescriptorTest, EveryFamilyIsCanonicalAndEqualsInferenceOnItsShards) {
  const std::vector<Case> cases = {
      {R"({"family": "replicated"})", {6, 5}, {1, 2, 3, 4, 8}},
      {R"({"family": "replicated", "pre_divided": true})", {7}, {1, 2, 3, 4, 8}},
      {R"({"family": "split", "dim": 0})", {10, 3}, {1, 2, 3, 4, 8}},
      {R"({"family": "split", "dim": 1, "remainder": "back"})", {3, 10}, {1, 2, 3, 4, 8}},
      {R"({"family": "split", "dim": 0, "remainder": "ceil"})", {10, 3}, {1, 2, 3, 4, 8}},
      {R"({"family": "split", "dim": 0, "remainder": "exact"})", {24, 2}, {1, 2, 3, 4, 8}},
      {R"({"family": "split", "dim": 0, "heads": 3})", {24, 2}, {1, 2, 3, 4, 8}},
      {R"({"family": "split", "dim": 0, "grain": 4})", {30, 2}, {1, 2, 3, 4, 8}},
      {R"({"family": "split", "dim": 2})", {2, 3, 9}, {1, 2, 3, 4, 8}},
      {R"({"family": "fused", "dim": 0, "parts": [{"size": 16}, {"size": 4}, {"size": 4}], "heads": 2})",
       {24, 3},
       {1, 2, 3, 4, 8}},
      {R"({"family": "fused", "dim": 0, "parts": 2})", {24, 3}, {1, 2, 3, 4, 8}},
      {R"({"family": "segmented", "dim": 0, "parts": [{"size": 16}, {"size": 8, "replicated": true}]})",
       {24, 3},
       {1, 2, 3, 4, 8}},
      {R"({"family": "block_gather", "dim": 0, "pairing": "shared_qk", "heads": 16})",
       {32, 3},
       {1, 2, 4, 8}},
      {R"({"family": "block_gather", "dim": 1, "pairing": "shared_qk", "heads": 12})",
       {2, 24},
       {1, 2, 3, 4}},
      {R"({"family": "codegen_qkv", "dim": 0, "heads": 96})", {288, 2}, {1, 2, 3, 4, 8}},
      {R"({"family": "padded_vocab", "dim": 0})", {13, 3}, {1, 2, 3, 4, 8}},
      {R"({"family": "padded_vocab", "dim": 0, "pad_multiple": 8})", {13, 3}, {1, 2, 3, 4, 8}},
  };
  for (const Case& c : cases) {
    const LayoutDescriptor d = Parse(c.json);
    Result<LayoutDescriptor> again = ParseLayoutJson(LayoutToJson(d));
    ASSERT_TRUE(again.ok()) << LayoutToJson(d) << ": " << again.status().message();
    EXPECT_EQ(*again, d) << c.json;
    EXPECT_EQ(LayoutToJson(*again), LayoutToJson(d));
    for (int world : c.worlds) {
      SCOPED_TRACE(::testing::Message() << c.json << " at " << world);
      Result<ParamMap> m = BuildMap(d, c.shape, world);
      ASSERT_TRUE(m.ok()) << m.status().message();
      EXPECT_EQ(m->world_size(), world);
      Result<ParamMap> canonical = Canonicalize(*m);
      ASSERT_TRUE(canonical.ok()) << canonical.status().message();
      EXPECT_EQ(*canonical, *m);
      Result<ParamMap> inferred = Infer(ToIndexMaps(*m));
      ASSERT_TRUE(inferred.ok()) << inferred.status().message();
      EXPECT_EQ(ParamMapToJson(*inferred), ParamMapToJson(*m));
    }
  }
}

TEST(DescriptorJsonTest, MalformedDescriptorsNameTheJsonPath) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"({"dim": 0})", "missing key \"family\""},
      {R"({"family": "sharded"})", "family: expected one of \"replicated\""},
      {R"({"family": "split", "dim": 0, "pre_divided": true})",
       "pre_divided: unknown key for family \"split\""},
      {R"({"family": "split", "dim": -1})", "dim: -1 is outside 0..2^62"},
      {R"({"family": "split", "heads": 2, "grain": 4})", "give \"heads\" or \"grain\", not both"},
      {R"({"family": "split", "remainder": "middle"})",
       "remainder: expected one of \"front\", \"back\""},
      {R"({"family": "split", "sizes": [2, 2], "remainder": "ceil"})",
       "sizes: explicit sizes take no"},
      {R"({"family": "fused", "parts": [{"size": 4}, {"size": 4, "replicated": true}]})",
       "parts[1].replicated: unknown key for a fused part"},
      {R"({"family": "fused", "parts": [{"size": 4.5}]})",
       "parts[0].size: expected a non-negative integer, got 4.5"},
      {R"({"family": "segmented", "parts": [{"size": 4, "replicated": true, "heads": 2}]})",
       "parts[0]: a replicated part is held whole by every rank"},
      {R"({"family": "block_gather", "heads": 4})", "give either \"pairing\""},
      {R"({"family": "block_gather", "blocks": 4, "rank_blocks": [[0, "1"]]})",
       "rank_blocks[0][1]: expected a non-negative integer, got \"1\""},
      {R"({"family": "split", "dim": 0, "dim": 1})", "duplicate key \"dim\""},
      {R"({"family": "split",)", "malformed JSON"},
  };
  for (const auto& [json, message] : cases) {
    Result<LayoutDescriptor> d = ParseLayoutJson(json);
    ASSERT_FALSE(d.ok()) << json;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << json;
    EXPECT_NE(d.status().message().find(message), std::string::npos)
        << json << " -> " << d.status().message();
  }
}

TEST(DescriptorTest, ShapeMismatchesAreFailedPreconditionsLikeWorldSizeMismatches) {
  Result<ParamMap> m = BuildMap(Parse(R"({"family": "split", "dim": 2})"), {4, 4}, 2);
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.status().message(),
            "split layout of [4, 4] at 2 ranks: dimension 2 is outside shape [4, 4]");
  m = BuildMap(Parse(R"({"family": "fused", "parts": [{"size": 4}, {"size": 2}]})"), {8, 2}, 2);
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      m.status().message(),
      "fused layout of [8, 2] at 2 ranks: the parts (4 + 2) cover 6 indices but dimension 0 has 8");
  m = BuildMap(Parse(R"({"family": "split", "remainder": "exact"})"), {5, 4}, 2);
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {

// Counts near 2^62 must be refused with the product that breaks, never wrap around (a
// division by a wrapped zero killed the process; a wrapped negative gave wrong messages).
TEST(DescriptorTest, OverflowingCountsAreRefusedNamingTheProduct) {
  struct OverflowCase {
    const char* json;
    Shape shape;
    int world;
    StatusCode code;
    const char* message;
  };
  const std::vector<OverflowCase> cases = {
      {R"({"family": "padded_vocab", "dim": 0, "pad_multiple": 4611686018427387904})",
       {13, 4},
       4,
       StatusCode::kFailedPrecondition,
       "padded_vocab layout of [13, 4] at 4 ranks: pad_multiple x world size: "
       "4611686018427387904 x 4 is more than 2^62"},
      {R"({"family": "padded_vocab", "dim": 0, "pad_multiple": 2305843009213693952})",
       {13, 4},
       4,
       StatusCode::kFailedPrecondition,
       "padded_vocab layout of [13, 4] at 4 ranks: pad_multiple x world size: "
       "2305843009213693952 x 4 is more than 2^62"},
      {R"({"family": "padded_vocab", "dim": 0, "pad_multiple": 1152921504606846976})",
       {13, 4},
       4,
       StatusCode::kFailedPrecondition,
       "has more than 2^62 elements"},
      {R"({"family": "split", "dim": 0, "sizes": [4611686018427387904, 4611686018427387904]})",
       {4},
       2,
       StatusCode::kFailedPrecondition,
       "sizes [4611686018427387904, 4611686018427387904] sum to more than 2^62"},
      {R"({"family": "fused", "dim": 0, "parts": [{"size": 4611686018427387904},
           {"size": 4611686018427387904}]})",
       {4},
       1,
       StatusCode::kFailedPrecondition,
       "the part sizes [4611686018427387904, "},
      {R"({"family": "block_gather", "dim": 0, "pairing": "shared_qk",
           "heads": 4611686018427387904})",
       {0},
       2,
       StatusCode::kFailedPrecondition,
       "heads are more than the 1048576 blocks"},
      {R"({"family": "fused", "dim": 0, "parts": 230552})",
       {0},
       75,
       StatusCode::kFailedPrecondition,
       "230552 segments at 75 ranks make a map of more than 4194304 pieces"},
      {R"({"family": "segmented", "dim": 0, "parts": [{"size": 0, "replicated": true}]})",
       {0},
       8192,
       StatusCode::kFailedPrecondition,
       "1 segments at 8192 ranks make a map of more than 4194304 pieces or 16777216 holder"},
      {R"({"family": "codegen_qkv", "dim": 0, "mp_num": 1048576})",
       {0, 4},
       2,
       StatusCode::kFailedPrecondition,
       "3 x 1048576 x 2 = 6291456 blocks, more than 1048576"},
  };
  for (const OverflowCase& c : cases) {
    Result<ParamMap> m = BuildMap(Parse(c.json), c.shape, c.world);
    ASSERT_FALSE(m.ok()) << c.json;
    EXPECT_EQ(m.status().code(), c.code) << c.json << " -> " << m.status().message();
    EXPECT_NE(m.status().message().find(c.message), std::string::npos)
        << c.json << " -> " << m.status().message();
  }
}

TEST(DescriptorJsonTest, CountsThatAllocateAreRangeChecked) {
  for (const auto& [json, message] : std::vector<std::pair<const char*, const char*>>{
           {R"({"family": "codegen_qkv", "dim": 0, "mp_num": 4611686018427387904})",
            "mp_num: 4611686018427387904 is outside 1..1048576"},
           {R"({"family": "fused", "dim": 0, "parts": 4611686018427387904})",
            "parts: 4611686018427387904 is outside 1..1048576"},
           {R"({"family": "block_gather", "dim": 0, "blocks": 1048577, "rank_blocks": [[0]]})",
            "blocks: 1048577 is outside 1..1048576"},
       }) {
    Result<LayoutDescriptor> d = ParseLayoutJson(json);
    ASSERT_FALSE(d.ok()) << json;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(d.status().message(), message);
  }
}

}  // namespace
}  // namespace reshard
