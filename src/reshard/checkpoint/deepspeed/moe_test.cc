// DeepSpeed AutoEP affine maps (checkpoint/deepspeed_moe.h): the maps DeepSpeed's
// autoep_placement_to_affine_map records, written out here from its rule, and the placement
// read back from a map.
#include "reshard/checkpoint/deepspeed/moe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

namespace reshard {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;
using Experts = std::vector<std::vector<int>>;

ExpertPlacement Placement(int num_experts, Experts experts) {
  ExpertPlacement p;
  p.num_experts = num_experts;
  p.experts = std::move(experts);
  return p;
}

Json MapOf(const ExpertPlacement& p, const Shape& shape) {
  Result<std::string> json = AutoEpAffineMapJson(p, shape);
  EXPECT_TRUE(json.ok()) << json.status().message();
  return json.ok() ? Json::parse(*json) : Json();
}

// What DeepSpeed's lowering gives a contiguous placement: one piece per rank.
TEST(AutoEpAffineMapTest, ContiguousExpertsAreOnePiecePerRank) {
  const Json m = MapOf(Placement(4, {{0, 1}, {2, 3}}), {4, 3, 2});
  const Json want = Json::parse(R"({"logical_shape": [4, 3, 2], "ranks": {
    "0": {"shard_shape": [2, 3, 2], "pieces": [{"shape": [2, 3, 2], "source": [0, [6, 2, 1]],
          "dest": [0, [6, 2, 1]], "locations": [0]}]},
    "1": {"shard_shape": [2, 3, 2], "pieces": [{"shape": [2, 3, 2], "source": [12, [6, 2, 1]],
          "dest": [0, [6, 2, 1]], "locations": [1]}]}}})");
  EXPECT_EQ(m, want);
}

// Runs break where ids do not follow, and an expert on two ranks is a piece of its own on
// each, located on both; an empty rank has an empty shard and no piece.
TEST(AutoEpAffineMapTest, RunsReplicasAndEmptyRanks) {
  const Json m = MapOf(Placement(4, {{2, 3, 0}, {1, 2}, {}}), {4, 5});
  const Json& r0 = m["ranks"]["0"]["pieces"];
  ASSERT_EQ(r0.size(), 3u);  // 2 is on two ranks: its own piece; 3; then 0
  EXPECT_EQ(r0[0], Json::parse(R"({"shape": [1, 5], "source": [10, [5, 1]],
                                    "dest": [0, [5, 1]], "locations": [0, 1]})"));
  EXPECT_EQ(r0[1]["source"][0], 15);
  EXPECT_EQ(r0[1]["locations"], Json::parse("[0]"));
  EXPECT_EQ(r0[2]["dest"][0], 10);
  EXPECT_EQ(m["ranks"]["1"]["pieces"].size(), 2u);
  EXPECT_EQ(m["ranks"]["2"], Json::parse(R"({"shard_shape": [0, 5], "pieces": []})"));
  EXPECT_TRUE(AutoEpAffineMap(Placement(4, {{2, 3, 0}, {1, 2}, {}}), {4, 5}).ok());
}

TEST(AutoEpAffineMapTest, RefusesBadInput) {
  Result<std::string> wrong_shape = AutoEpAffineMapJson(Placement(4, {{0, 1}, {2, 3}}), {3, 2});
  ASSERT_FALSE(wrong_shape.ok());
  EXPECT_THAT(wrong_shape.status().message(), HasSubstr("start with its 4 experts"));
  EXPECT_FALSE(AutoEpAffineMapJson(Placement(4, {{0, 1}, {2}}), {4}).ok());  // 3 on no rank
  EXPECT_FALSE(AutoEpAffineMapJson(Placement(2, {{0, 0, 1}}), {2}).ok());    // 0 twice
}

// Placement -> map -> placement is the identity, over random placements.
TEST(AutoEpAffineMapTest, PlacementsRoundTripThroughTheirMaps) {
  std::mt19937 gen(20);
  for (int trial = 0; trial < 300; ++trial) {
    const int num = 1 + static_cast<int>(gen() % 9), ep = 1 + static_cast<int>(gen() % 5);
    Experts experts(static_cast<size_t>(ep));
    for (int e = 0; e < num; ++e) {
      const size_t first = gen() % static_cast<size_t>(ep);
      experts[first].push_back(e);
      const size_t second = gen() % static_cast<size_t>(ep);
      if (gen() % 4 == 0 && second != first) experts[second].push_back(e);
    }
    for (auto& held : experts) std::shuffle(held.begin(), held.end(), gen);
    const ExpertPlacement p = Placement(num, experts);
    Shape shape = {num};
    for (size_t d = gen() % 3; d > 0; --d) shape.push_back(1 + static_cast<Index>(gen() % 3));
    Result<ParamMap> map = AutoEpAffineMap(p, shape);
    ASSERT_TRUE(map.ok()) << map.status().message();
    Result<ExpertPlacement> back = AutoEpPlacementOfMap(*map);
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(*back, p);
  }
}

// A map that moves half an expert is no placement's.
TEST(AutoEpAffineMapTest, AMapCuttingAnExpertIsNoPlacement) {
  ParamMapBuilder b;
  b.set_logical_shape({2, 4}).set_world_size(2);
  b.set_shard_shape(0, {1, 4}).set_shard_shape(1, {1, 4});
  b.add_piece(0, Piece{{1, 4}, {2, {4, 1}}, {0, {4, 1}}, {0}, 1.0});  // starts mid-expert
  b.add_piece(1, Piece{{1, 2}, {0, {4, 1}}, {0, {4, 1}}, {1}, 1.0});
  b.add_piece(1, Piece{{1, 2}, {6, {4, 1}}, {2, {4, 1}}, {1}, 1.0});
  Result<ParamMap> map = b.Finalize();
  ASSERT_TRUE(map.ok()) << map.status().message();
  Result<ExpertPlacement> p = AutoEpPlacementOfMap(*map);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(p.status().message(), HasSubstr("EP rank 0, slot 0"));
}

}  // namespace
}  // namespace reshard
