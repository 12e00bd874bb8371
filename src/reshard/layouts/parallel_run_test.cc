#include "reshard/layouts/parallel_run.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <vector>

namespace reshard {
namespace {

// Megatron's parallel_state for world 8, tp 2, pp 2 (dp 2): tensor groups [0,1] [2,3] ...,
// data groups [0,2] [1,3] [4,6] [5,7], pipeline groups [0,4] [1,5] [2,6] [3,7].
TEST(ParallelRunTest, MegatronOrderMatchesItsGroups) {
  Result<ParallelRun> run = MegatronRun(8, /*tp=*/2, /*pp=*/2);
  ASSERT_TRUE(run.ok()) << run.status().message();
  EXPECT_EQ(run->grid.size(ParallelDim::kDp), 2);
  EXPECT_FALSE(run->experts.has_value());
  const auto coord = [&](int rank, ParallelDim d) { return *run->grid.CoordinateOf(rank, d); };
  EXPECT_EQ(coord(1, ParallelDim::kTp), 1);
  EXPECT_EQ(coord(2, ParallelDim::kDp), 1);
  EXPECT_EQ(coord(2, ParallelDim::kTp), 0);
  EXPECT_EQ(coord(4, ParallelDim::kPp), 1);
  EXPECT_EQ(coord(7, ParallelDim::kPp), 1);
  EXPECT_EQ(coord(7, ParallelDim::kDp), 1);
  EXPECT_EQ(coord(7, ParallelDim::kTp), 1);
  EXPECT_EQ(ParallelRunText(*run),
            "pp 2 × dp 2 × cp 1 × tp 2 (Megatron tp-cp-ep-dp-pp), optimizer sharding unknown");
}

// Megatron's expert grid (order tp-cp-ep-dp-pp with etp, ep, edp): world 8, tp 1, ep 2: expert
// groups [0,1] [2,3] ..., expert-data groups [0,2,4,6] [1,3,5,7].
TEST(ParallelRunTest, MegatronExpertGrid) {
  Result<ParallelRun> run = MegatronRun(8, /*tp=*/1, /*pp=*/1, /*cp=*/1, /*ep=*/2);
  ASSERT_TRUE(run.ok()) << run.status().message();
  ASSERT_TRUE(run->experts.has_value());
  EXPECT_EQ(run->experts->size(ParallelDim::kEdp), 4);
  EXPECT_EQ(*run->experts->CoordinateOf(3, ParallelDim::kEp), 1);
  EXPECT_EQ(*run->experts->CoordinateOf(3, ParallelDim::kEdp), 1);
  EXPECT_EQ(*run->experts->CoordinateOf(6, ParallelDim::kEdp), 3);
}

TEST(ParallelRunTest, MegatronRefusesSizesThatDoNotDivideTheWorld) {
  Result<ParallelRun> run = MegatronRun(6, /*tp=*/4, /*pp=*/1);
  ASSERT_FALSE(run.ok());
  EXPECT_EQ(run.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(run.status().message().find("tp × cp × pp (4) does not divide the world's 6 ranks"),
            std::string::npos)
      << run.status().message();
  EXPECT_FALSE(MegatronRun(8, 2, 2, 1, /*ep=*/3).ok());
  EXPECT_FALSE(MegatronRun(0, 1, 1).ok());
}

// DeepSpeed's PipeModelDataParallelTopology: axes pipe, data, model, the last fastest; a
// pipeline checkpoint's slice s = stage * tp + t is the rank of DP rank 0.
TEST(ParallelRunTest, DeepSpeedPipeGrid) {
  Result<ParallelRun> run = DeepSpeedRun(/*pp=*/2, /*tp=*/2, /*dp=*/2, OptimizerSharding::kZero1);
  ASSERT_TRUE(run.ok()) << run.status().message();
  EXPECT_EQ(ParallelRunText(*run), "pp 2 × dp 2 × tp 2 (DeepSpeed pipe/data/model grid), ZeRO 1");
  const std::vector<int> stage1_tp1_dp0 = {1, 0, 1};
  EXPECT_EQ(*run->grid.RankOf(stage1_tp1_dp0), 5);
}

// AutoEP: DP rank d is EP rank d mod ep (expert-DP d div ep), or with
// use_data_before_expert_parallelism d div edp (d mod edp).
TEST(ParallelRunTest, DeepSpeedExpertsInsideDp) {
  Result<ParallelRun> run = DeepSpeedRun(1, 1, 4, OptimizerSharding::kZero2, /*ep=*/2);
  ASSERT_TRUE(run.ok()) << run.status().message();
  EXPECT_EQ(*run->experts->CoordinateOf(3, ParallelDim::kEp), 1);
  EXPECT_EQ(*run->experts->CoordinateOf(3, ParallelDim::kEdp), 1);
  Result<ParallelRun> before = DeepSpeedRun(1, 1, 4, OptimizerSharding::kZero2, 2, true);
  ASSERT_TRUE(before.ok()) << before.status().message();
  EXPECT_EQ(*before->experts->CoordinateOf(1, ParallelDim::kEp), 0);
  EXPECT_EQ(*before->experts->CoordinateOf(2, ParallelDim::kEp), 1);
  Result<ParallelRun> bad = DeepSpeedRun(1, 1, 3, OptimizerSharding::kZero2, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("the expert-parallel size (2) does not divide"),
            std::string::npos)
      << bad.status().message();
}

TEST(ParallelRunTest, ValidationErrors) {
  ParallelRun run = FlatRun(4, ParallelDim::kRank, "DCP flat world");
  EXPECT_TRUE(run.ValidateWorld(4).ok());
  Status s = run.ValidateWorld(6);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "the axes rank 4 make 4 ranks, but there are 6");
  run.grid.axes.push_back({ParallelDim::kRank, 2});
  EXPECT_NE(run.Validate().message().find("axis rank is named twice"), std::string::npos);
  run.grid.axes = {{ParallelDim::kTp, 0}};
  EXPECT_NE(run.Validate().message().find("axis tp has size 0"), std::string::npos);
  run.grid.axes = {{ParallelDim::kTp, 1 << 16}, {ParallelDim::kDp, 1 << 16}};
  EXPECT_NE(run.Validate().message().find("more than 2^31 - 1 ranks"), std::string::npos);
  run.grid.axes = {{ParallelDim::kTp, 2}, {ParallelDim::kPp, 2}};
  run.experts = RankGrid{{{ParallelDim::kEp, 2}, {ParallelDim::kPp, 1}}};
  EXPECT_NE(run.Validate().message().find("makes 2 ranks"), std::string::npos);
  run.experts = RankGrid{{{ParallelDim::kEp, 4}}};
  EXPECT_NE(run.Validate().message().find("1 pipeline stages"), std::string::npos);
  run.experts.reset();
  run.vpp = 0;
  EXPECT_FALSE(run.Validate().ok());
  EXPECT_FALSE(run.grid.CoordinatesOf(4).ok());
  EXPECT_FALSE(run.grid.CoordinatesOf(-1).ok());
  const std::vector<int> two = {2, 0};
  EXPECT_FALSE(run.grid.RankOf(two).ok());
  const std::vector<int> one = {0};
  EXPECT_FALSE(run.grid.RankOf(one).ok());
}

TEST(ParallelRunTest, Names) {
  for (ParallelDim d :
       {ParallelDim::kTp, ParallelDim::kCp, ParallelDim::kEp, ParallelDim::kEtp, ParallelDim::kDp,
        ParallelDim::kEdp, ParallelDim::kPp, ParallelDim::kRank}) {
    EXPECT_EQ(*ParallelDimOf(ParallelDimName(d)), d);
  }
  EXPECT_FALSE(ParallelDimOf("sp").ok());
}

TEST(ParallelRunTest, JsonSaysWhatIsUnknown) {
  ParallelRun run = FlatRun(3, ParallelDim::kRank, "Megatron torch_dist");
  run.unknown = {"tp", "pp"};
  run.vpp.reset();
  const auto doc = nlohmann::json::parse(ParallelRunJson(run));
  EXPECT_EQ(doc["world"], 3);
  EXPECT_EQ(doc["axes"][0]["name"], "rank");
  EXPECT_TRUE(doc["vpp"].is_null());
  EXPECT_TRUE(doc["experts"].is_null());
  EXPECT_EQ(doc["optimizer"], "unknown");
  EXPECT_EQ(doc["unknown"], nlohmann::json::array({"tp", "pp"}));
  EXPECT_NE(ParallelRunText(run).find("not recorded: tp, pp"), std::string::npos);
}

// Property: over random grids, rank -> coordinates -> rank is the identity, every rank has
// distinct coordinates, and each coordinate is in its axis.
TEST(ParallelRunTest, CoordinatesRoundTripOnRandomGrids) {
  std::mt19937 rng(31);
  const std::vector<ParallelDim> dims = {ParallelDim::kTp, ParallelDim::kCp, ParallelDim::kEp,
                                         ParallelDim::kDp, ParallelDim::kPp};
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<ParallelDim> order = dims;
    std::shuffle(order.begin(), order.end(), rng);
    RankGrid grid;
    const int n = std::uniform_int_distribution<int>(0, 5)(rng);
    for (int i = 0; i < n; ++i)
      grid.axes.push_back({order[i], std::uniform_int_distribution<int>(1, 5)(rng)});
    ASSERT_TRUE(grid.Validate().ok());
    std::set<std::vector<int>> seen;
    for (int64_t r = 0; r < grid.world(); ++r) {
      Result<std::vector<int>> c = grid.CoordinatesOf(r);
      ASSERT_TRUE(c.ok());
      for (size_t i = 0; i < c->size(); ++i) {
        ASSERT_GE((*c)[i], 0);
        ASSERT_LT((*c)[i], grid.axes[i].size);
      }
      EXPECT_TRUE(seen.insert(*c).second);
      Result<int64_t> back = grid.RankOf(*c);
      ASSERT_TRUE(back.ok());
      EXPECT_EQ(*back, r);
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), grid.world());
    // Megatron's grid at random sizes: the dense and expert grids agree on the pipeline stage.
    const int tp = std::uniform_int_distribution<int>(1, 4)(rng);
    const int pp = std::uniform_int_distribution<int>(1, 3)(rng);
    const int ep = std::uniform_int_distribution<int>(1, 4)(rng);
    const int64_t world = int64_t{tp} * pp * ep * std::uniform_int_distribution<int>(1, 3)(rng);
    Result<ParallelRun> run = MegatronRun(world, tp, pp, 1, ep);
    ASSERT_TRUE(run.ok()) << run.status().message();
    ASSERT_TRUE(run->ValidateWorld(world).ok());
    for (int64_t r = 0; r < world; ++r) {
      const RankGrid& experts = run->experts ? *run->experts : run->grid;
      EXPECT_EQ(*run->grid.CoordinateOf(r, ParallelDim::kPp),
                *experts.CoordinateOf(r, ParallelDim::kPp));
    }
  }
}

}  // namespace
}  // namespace reshard
