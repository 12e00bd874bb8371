#include "reshard/checkpoint/formats/formats.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace reshard {
namespace {

namespace fs = std::filesystem;

// The flat outputs (a reshard sharded checkpoint, a DCP) take a target run of one axis and
// refuse a grid before anything is opened or written.
TEST(FormatsTest, ConvertTakesTheTargetRun) {
  const fs::path out = fs::path(::testing::TempDir()) / "formats_test_out";
  fs::remove_all(out);
  EXPECT_EQ(ShardedTargetRun(3).grid.axes, (std::vector<ParallelAxis>{{ParallelDim::kTp, 3}}));
  EXPECT_EQ(DcpTargetRun(2).world(), 2);

  Result<ParallelRun> grid = MegatronRun(8, /*tp=*/2, /*pp=*/2);
  ASSERT_TRUE(grid.ok());
  Status s = ConvertCheckpoint("/nonexistent", {}, *grid, std::nullopt, out.string());
  ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("a reshard sharded checkpoint holds a flat world of ranks; the "
                             "target run pp 2 × dp 2 × cp 1 × tp 2"),
            std::string::npos)
      << s.message();
  s = WriteDcpCheckpoint("/nonexistent", {}, *grid, out.string());
  ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("a PyTorch Distributed Checkpoint holds a flat world"),
            std::string::npos)
      << s.message();
  s = ConvertCheckpoint("/nonexistent", {}, ShardedTargetRun(0), std::nullopt, out.string());
  EXPECT_EQ(s.message(), "0 is not a world size");
  // One axis of several ranks passes the check (and the missing input is then reported).
  s = ConvertCheckpoint("/nonexistent", {}, ShardedTargetRun(2), std::nullopt, out.string());
  EXPECT_NE(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message().find("flat world"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(out));
}

// DCP and Orbax name and shape every tensor themselves: they refuse alike what such a source
// cannot give, each naming itself and what it stores.
TEST(FormatsTest, SelfDescribedFormatsRefuseTheSameOptionsNamingThemselves) {
  const CheckpointFormat* dcp = nullptr;
  const CheckpointFormat* orbax = nullptr;
  for (const CheckpointFormat& f : CheckpointFormats()) {
    if (f.name == "dcp") dcp = &f;
    if (f.name == "orbax") orbax = &f;
  }
  ASSERT_NE(dcp, nullptr);
  ASSERT_NE(orbax, nullptr);
  SourceOptions config;
  config.config_path = "config.json";
  EXPECT_EQ(dcp->check("ck", config).message(),
            "\"ck\" is a PyTorch Distributed Checkpoint, which names and shapes its tensors "
            "itself: it takes no config.json");
  EXPECT_EQ(orbax->check("ck", config).message(),
            "\"ck\" is an Orbax checkpoint, which names and shapes its arrays itself: it takes "
            "no config.json (unless it is read with MaxText's names)");
  SourceOptions weights_only;
  weights_only.weights_only = true;
  EXPECT_EQ(orbax->check("ck", weights_only).message(),
            "a gather of an Orbax checkpoint writes the model's arrays only already");
  weights_only.use = SourceUse::kConvert;
  EXPECT_TRUE(orbax->check("ck", weights_only).ok());
  SourceOptions state;
  state.optimizer_state = true;
  EXPECT_TRUE(dcp->check("ck", state).ok());
  state.use = SourceUse::kConvert;
  EXPECT_EQ(dcp->check("ck", state).code(), StatusCode::kInvalidArgument);
  SourceOptions master;
  master.master_weights = true;
  EXPECT_NE(dcp->check("ck", master).message().find("\"ck\" is a PyTorch Distributed Checkpoint"),
            std::string::npos);
  SourceOptions distributed;
  distributed.distributed_config = "{}";
  EXPECT_NE(orbax->check("ck", distributed).message().find("give the target layout as maps"),
            std::string::npos);
}

}  // namespace
}  // namespace reshard
