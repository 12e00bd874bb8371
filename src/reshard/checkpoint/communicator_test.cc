#include "reshard/checkpoint/communicator.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>

namespace reshard {
namespace {

TEST(BalanceByBytesTest, LargestFirstToTheLeastLoadedProcess) {
  const std::vector<uint64_t> bytes = {5, 9, 1, 7, 3};
  // 9 -> 0; 7 -> 1; 5 -> 1 (7 < 9); 3 -> 0 (9 < 12); 1 -> 0 (12 = 12: the lower process).
  EXPECT_EQ(BalanceByBytes(bytes, 2), (std::vector<int>{1, 0, 0, 1, 0}));
}

TEST(BalanceByBytesTest, NoProcessHoldsMoreThanItsShareAndOneFile) {
  std::vector<uint64_t> bytes;
  for (uint64_t i = 0; i < 37; ++i) bytes.push_back((i * 7919) % 101 + 1);
  const uint64_t total = std::accumulate(bytes.begin(), bytes.end(), uint64_t{0});
  for (int k = 1; k <= 6; ++k) {
    std::vector<uint64_t> load(static_cast<size_t>(k), 0);
    const std::vector<int> owner = BalanceByBytes(bytes, k);
    for (size_t i = 0; i < bytes.size(); ++i) load[static_cast<size_t>(owner[i])] += bytes[i];
    for (uint64_t l : load) EXPECT_LE(l, total / static_cast<uint64_t>(k) + 101) << k;
  }
}

TEST(BalanceByBytesTest, MoreProcessesThanFilesLeavesSomeIdle) {
  EXPECT_EQ(BalanceByBytes(std::vector<uint64_t>{4, 4}, 4), (std::vector<int>{0, 1}));
}

TEST(AgreeOnStatusTest, OneProcessKeepsItsOwnStatus) {
  const Status failed = DataLossError("\"a.safetensors\": file is truncated");
  EXPECT_EQ(AgreeOnStatus(SingleProcess(), failed), failed);
  EXPECT_TRUE(AgreeOnStatus(SingleProcess(), Status::Ok()).ok());
}

TEST(BroadcastTest, OneProcessGetsItsValue) {
  Result<std::string> value = Broadcast(SingleProcess(), "/tmp/.out.tmp-1", 0);
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(*value, "/tmp/.out.tmp-1");
}

// Process `rank` of a job whose processes were given `runs`: AllGather hands back every
// process's description as AgreeOnRun encodes it (learnt by a run of its own on a job of two
// alike processes).
class ScriptedJob final : public Communicator {
 public:
  ScriptedJob(int rank, std::vector<RunDescription> runs) : rank_(rank), runs_(std::move(runs)) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(runs_.size()); }
  Result<std::vector<std::string>> AllGather(const std::string& mine) override {
    if (encoding_) {
      last_ = mine;
      return std::vector<std::string>{mine, mine};
    }
    std::vector<std::string> all;
    for (size_t p = 0; p < runs_.size(); ++p) {
      if (static_cast<int>(p) == rank_) {
        all.push_back(mine);
        continue;
      }
      ScriptedJob encoder(0, {runs_[p], runs_[p]});
      encoder.encoding_ = true;
      EXPECT_TRUE(AgreeOnRun(encoder, runs_[p]).ok());
      all.push_back(encoder.last_);
    }
    return all;
  }
  void PublishProgress(uint64_t) override {}
  void SetProgressListener(std::function<void(uint64_t)>) override {}

 private:
  int rank_;
  std::vector<RunDescription> runs_;
  bool encoding_ = false;
  std::string last_;
};

TEST(AgreeOnRunTest, EveryProcessNamesTheFirstItemThatDiffers) {
  const RunDescription a = {{"the command", "convert"}, {"the input", "/ck/a"}, {"--tp", "2"}};
  RunDescription b = a;
  b[1].second = "/ck/b";
  for (int rank : {0, 1, 2}) {
    ScriptedJob job(rank, {a, a, b});
    const Status s = AgreeOnRun(job, rank == 2 ? b : a);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << rank;
    EXPECT_NE(s.message().find("the input is \"/ck/b\" on process 2 but \"/ck/a\" on process 0"),
              std::string::npos)
        << s.message();
  }
  ScriptedJob same(1, {a, a});
  EXPECT_TRUE(AgreeOnRun(same, a).ok());
  RunDescription more = a;
  more.emplace_back("the input file x.pt", "4 bytes");
  ScriptedJob extra(0, {a, more});
  const Status s = AgreeOnRun(extra, a);
  EXPECT_NE(s.message().find("process 1 has the input file x.pt \"4 bytes\" and process 0 none"),
            std::string::npos)
      << s.message();
}

TEST(DescribeInputTest, NamesEachFileWithItsSizeAndTime) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("describe_input_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "tag");
  { std::ofstream(dir / "latest") << "tag"; }
  { std::ofstream(dir / "tag" / "x.pt") << "12345"; }
  RunDescription d;
  DescribeInput("the input", dir.string(), d);
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0], (std::pair<std::string, std::string>{"the input", dir.string()}));
  EXPECT_EQ(d[1].first, "the input file latest");
  EXPECT_EQ(d[2].first, "the input file tag/x.pt");
  EXPECT_TRUE(d[2].second.starts_with("5 bytes, modified ")) << d[2].second;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace reshard
