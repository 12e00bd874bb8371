#include "reshard/checkpoint/communicator.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace reshard
