// Expert placements and stacked expert buffers (layouts/experts.h).
#include "reshard/layouts/experts.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "reshard/ir/map_json.h"
#include "reshard/ir/random_map.h"

namespace reshard {
namespace {

using ::testing::HasSubstr;
using Experts = std::vector<std::vector<int>>;

TEST(ExpertPlacementTest, Families) {
  EXPECT_EQ(ContiguousExperts(8, 4)->experts, (Experts{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(LinearExperts(7, 3)->experts, (Experts{{0, 1, 2}, {3, 4}, {5, 6}}));
  EXPECT_EQ(RoundRobinExperts(7, 3)->experts, (Experts{{0, 3, 6}, {1, 4}, {2, 5}}));
  EXPECT_EQ(ExpertsByFamily("round_robin", 4, 2)->experts, (Experts{{0, 2}, {1, 3}}));
  Result<ExpertPlacement> uneven = ContiguousExperts(6, 4);
  ASSERT_FALSE(uneven.ok());
  EXPECT_THAT(uneven.status().message(), HasSubstr("6 experts do not split into 4 equal"));
  EXPECT_FALSE(ExpertsByFamily("striped", 4, 2).ok());
  EXPECT_FALSE(LinearExperts(4, 0).ok());
}

TEST(ExpertPlacementTest, DeepSpeedDescriptorsRoundTrip) {
  // Uneven, non-contiguous, an empty rank and a redundant (replicated) expert.
  const ExpertPlacement p{5, {{0, 4}, {}, {1, 2, 3, 0}}};
  ASSERT_TRUE(p.Validate().ok());
  const std::string text = ExpertPlacementToJson(p);
  Result<ExpertPlacement> back = ParseExpertPlacementJson(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, p);
  EXPECT_EQ(back->HoldersOf(0), (std::vector<int>{0, 2}));
}

TEST(ExpertPlacementTest, BadDescriptorsSayWhat) {
  struct Case {
    const char* json;
    const char* says;
  };
  const Case cases[] = {
      {R"({"version": 1, "num_experts": 4, "ep_size": 2,
           "ranks": [{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2]}]})",
       "expert 3 is on no EP rank"},
      {R"({"version": 1, "num_experts": 4, "ep_size": 2,
           "ranks": [{"rank": 0, "experts": [0, 1, 1]}, {"rank": 1, "experts": [2, 3]}]})",
       "ranks[0].experts[2]: rank 0 names expert 1 twice"},
      {R"({"version": 1, "num_experts": 4, "ep_size": 2,
           "ranks": [{"rank": 0, "experts": [0, 1, 2, 3]}]})",
       "rank 1 is missing"},
      {R"({"version": 1, "num_experts": 4, "ep_size": 2,
           "ranks": [{"rank": 0, "experts": [0, 1]}, {"rank": 0, "experts": [2, 3]}]})",
       "rank 0 is listed twice"},
      {R"({"version": 1, "num_experts": 4, "ep_size": 2,
           "ranks": [{"rank": 0, "experts": [0, 1]}, {"rank": 2, "experts": [2, 3]}]})",
       "2 is outside the EP ranks 0..1"},
      {R"({"version": 1, "num_experts": 4, "ep_size": 2,
           "ranks": [{"rank": 0, "experts": [0, 9]}, {"rank": 1, "experts": [2, 3]}]})",
       "expert 9 is outside 0..3"},
      {R"({"version": 2, "num_experts": 4, "ep_size": 2, "ranks": []})", "version: 2"},
      {R"({"version": 1, "ep_size": 2, "ranks": []})", "num_experts"},
  };
  for (const Case& c : cases) {
    Result<ExpertPlacement> p = ParseExpertPlacementJson(c.json);
    ASSERT_FALSE(p.ok()) << c.json;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(p.status().message(), HasSubstr(c.says)) << c.json;
  }
}

// Mixtral-style: gate [I, H] then up [I, H] of each expert stacked in gate_up_proj.
std::vector<ExpertMember> GateUp(Index inter, Index hidden) {
  return {{"experts.{e}.gate_proj.weight", {inter, hidden}, 0, 0, {}},
          {"experts.{e}.up_proj.weight", {inter, hidden}, 0, 0, {}}};
}

Status CheckExact(const StackedExpertMaps& s) {
  std::vector<NamedMapRef> refs;
  for (const auto& [name, map] : s.maps) refs.push_back({name, &map});
  return BufferSetBuilder().add(s.buffer).Finalize(refs).status();
}

TEST(StackedExpertsTest, EpTwoHoldsContiguousExpertsGateThenUp) {
  Result<StackedExpertMaps> s = BuildStackedExpertMaps(
      "gate_up_proj", DType::kBF16, GateUp(6, 4), *ContiguousExperts(4, 2), RankOrder{2, 1, true});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->buffer.ranks[1].shape, (Shape{2, 12, 4}));
  ASSERT_EQ(s->maps.size(), 8u);
  EXPECT_EQ(s->maps[3].first, "experts.3.gate_proj.weight");
  // Expert 3's up rows: rank 1, slot 1, rows 6..11.
  const ParamMap& up3 = s->maps[7].second;
  EXPECT_TRUE(up3.rank(0).pieces.empty());
  ASSERT_EQ(up3.rank(1).pieces.size(), 1u);
  EXPECT_EQ(up3.rank(1).pieces[0].dest.offset, 1 * 48 + 6 * 4);
  EXPECT_TRUE(CheckExact(*s).ok()) << CheckExact(*s).ToString();
}

TEST(StackedExpertsTest, ExpertTpSplitsIntermediateAndReplicasAreMultiHolder) {
  // EP 2 x TP 2, tp fastest; expert 0 also on EP rank 1 (a redundant copy).
  const ExpertPlacement p{3, {{0, 1}, {2, 0}}};
  Result<StackedExpertMaps> s =
      BuildStackedExpertMaps("w13", DType::kF32, GateUp(4, 2), p, RankOrder{2, 2, true});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->buffer.ranks[3].shape, (Shape{2, 4, 2}));
  const ParamMap& gate0 = s->maps[0].second;
  // TP rank 1 of EP ranks 0 and 1 (global 1 and 3) hold gate rows 2..3 of expert 0.
  ASSERT_EQ(gate0.rank(3).pieces.size(), 1u);
  EXPECT_EQ(gate0.rank(3).pieces[0].locations, (std::vector<Rank>{1, 3}));
  EXPECT_EQ(gate0.rank(3).pieces[0].source.offset, 4);
  EXPECT_TRUE(CheckExact(*s).ok());
  // Expert TP must divide the intermediate size.
  EXPECT_FALSE(
      BuildStackedExpertMaps("w13", DType::kF32, GateUp(3, 2), p, RankOrder{2, 2, true}).ok());
}

TEST(StackedExpertsTest, ExpertDataParallelReplicasFollowMegatronRankOrder) {
  // EP 2 x TP 2 x DP 2, Megatron's order (tp fastest, then ep, then dp): rank 6 is dp 1, ep 1,
  // tp 0, and holds the same slice as rank 2 (dp 0, ep 1, tp 0).
  Result<StackedExpertMaps> s = BuildStackedExpertMaps(
      "w13", DType::kF32, GateUp(4, 2), *ContiguousExperts(4, 2), RankOrder{2, 2, true, 2});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->buffer.ranks.size(), 8u);
  const ParamMap& gate2 = s->maps[2].second;  // expert 2: EP rank 1
  ASSERT_EQ(gate2.rank(6).pieces.size(), 1u);
  EXPECT_EQ(gate2.rank(6).pieces[0].locations, (std::vector<Rank>{2, 6}));
  EXPECT_EQ(gate2.rank(7).pieces[0].locations, (std::vector<Rank>{3, 7}));
  EXPECT_TRUE(gate2.rank(0).pieces.empty());
  EXPECT_TRUE(CheckExact(*s).ok()) << CheckExact(*s).ToString();
}

TEST(StackedExpertsTest, RandomPlacementsAreExactAndRoundTrip) {
  for (uint64_t seed : PropertyTestSeeds(40)) {
    SCOPED_TRACE(testing::Message()
                 << "seed " << seed << " (replay with RESHARD_SEED=" << seed << ")");
    std::mt19937_64 rng(seed);
    const int experts = 1 + static_cast<int>(rng() % 9);
    const int ep = 1 + static_cast<int>(rng() % 4);
    const int tp = 1 + static_cast<int>(rng() % 2);
    ExpertPlacement p{experts, Experts(static_cast<size_t>(ep))};
    for (int e = 0; e < experts; ++e) {
      // One holder, sometimes two.
      const int k = static_cast<int>(rng() % static_cast<unsigned>(ep));
      p.experts[static_cast<size_t>(k)].push_back(e);
      const int k2 = static_cast<int>(rng() % static_cast<unsigned>(ep));
      if (k2 != k && rng() % 4 == 0) p.experts[static_cast<size_t>(k2)].push_back(e);
    }
    for (auto& list : p.experts) std::shuffle(list.begin(), list.end(), rng);
    const int dp = 1 + static_cast<int>(rng() % 2);
    Result<StackedExpertMaps> s = BuildStackedExpertMaps("b", DType::kF32, GateUp(2 * tp, 3), p,
                                                         RankOrder{ep, tp, rng() % 2 == 0, dp});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE(CheckExact(*s).ok()) << CheckExact(*s).ToString();
    MapDocument doc;
    doc.params = s->maps;
    ASSERT_TRUE(ValidateBuffers(doc, BufferSetBuilder().add(s->buffer)).ok());
    const std::string text = MapDocumentToJson(doc);
    Result<MapDocument> back = ReadMapDocumentJson(text);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->params, doc.params);
    EXPECT_EQ(back->buffers, doc.buffers);
    // Dropping any one map leaves a gap (when the buffer has elements).
    if (!doc.params.empty()) {
      const size_t drop = rng() % doc.params.size();
      std::vector<NamedMapRef> refs;
      for (size_t i = 0; i < doc.params.size(); ++i) {
        if (i != drop) refs.push_back({doc.params[i].first, &doc.params[i].second});
      }
      EXPECT_FALSE(BufferSetBuilder().add(s->buffer).Finalize(refs).ok());
    }
  }
}

}  // namespace
}  // namespace reshard
