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

}  // namespace
}  // namespace reshard
