#include "reshard/checkpoint/checkpoint_ops.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "reshard/base/cpu_limit_testing.h"
#include "reshard/io/file.h"
#include "reshard/layouts/basic.h"

namespace reshard {
namespace {

LayoutDescriptor Layout(std::string_view json) {
  Result<LayoutDescriptor> d = ParseLayoutJson(json);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return *d;
}

const char kPreDivided[] = R"({"family": "replicated", "pre_divided": true})";
const char kReplicated[] = R"({"family": "replicated"})";

double ScaleOf(const ResolvedMap& m) { return m.provided.map.rank(0).pieces.at(0).scale; }

TEST(ResolveMapTest, OptimizerStateTakesItsParametersLayoutThroughADefault) {
  // Only a default: the moments take it as their parameter's, with their scale powers.
  const MapProvider star = MapsFromLayouts({{"*", Layout(kPreDivided)}}, 4);
  for (auto [name, power] :
       {std::pair{"b", 1}, std::pair{"b.exp_avg", -1}, std::pair{"b.exp_avg_sq", -2}}) {
    Result<ResolvedMap> m = ResolveMap(star, name, {8});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->scale_power, power) << name;
    EXPECT_EQ(ScaleOf(*m), 0.25) << name;
  }
}

TEST(ResolveMapTest, OptimizerStateTakesItsParametersLayoutBeforeTheDefault) {
  const MapProvider maps =
      MapsFromLayouts({{"b", Layout(kPreDivided)}, {"*", Layout(kReplicated)}}, 4);
  Result<ResolvedMap> m = ResolveMap(maps, "b.exp_avg", {8});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->scale_power, -1);
  EXPECT_EQ(ScaleOf(*m), 0.25);
  ASSERT_TRUE(m->provided.layout.has_value());
  EXPECT_TRUE(m->provided.layout->pre_divided);
  // Other tensors take the default at scale power 1.
  m = ResolveMap(maps, "w", {8});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->scale_power, 1);
  EXPECT_EQ(ScaleOf(*m), 1.0);
}

TEST(ResolveMapTest, OptimizerStateWithoutAParameterLayoutKeepsItsScalePower) {
  // No layout for "b" and no default: the moment's own entry, still at scale power -2.
  const MapProvider maps = MapsFromLayouts({{"b.exp_avg_sq", Layout(kPreDivided)}}, 2);
  Result<ResolvedMap> m = ResolveMap(maps, "b.exp_avg_sq", {8});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->scale_power, -2);
  EXPECT_EQ(ResolveMap(maps, "c.exp_avg", {8}).status().code(), StatusCode::kNotFound);
  // A name that is only the suffix is no optimizer state.
  EXPECT_EQ(ResolveMap(maps, ".exp_avg", {8}).status().code(), StatusCode::kNotFound);
}

namespace fs = std::filesystem;

// A sharded checkpoint of one F32 parameter "w" = [1, 2, 3, 4], replicated on 2 ranks.
class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("checkpoint_ops_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "full");
    const float w[4] = {1, 2, 3, 4};
    ASSERT_TRUE(WriteSafetensors((dir_ / "full" / "model.safetensors").string(),
                                 {{"w",
                                   DType::kF32,
                                   {4},
                                   [&](std::span<std::byte> out) {
                                     std::memcpy(out.data(), w, sizeof(w));
                                     return Status::Ok();
                                   }}},
                                 {})
                    .ok());
    ASSERT_TRUE(Scatter((dir_ / "full").string(), 2,
                        MapsFromLayouts({{"*", Layout(kReplicated)}}, 2), sharded())
                    .ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string sharded() const { return (dir_ / "tp2").string(); }
  std::string out() const { return (dir_ / "out").string(); }
  fs::path RankFile(int r) const { return dir_ / "tp2" / ShardFileName(r, 0); }

  void SetFiles(const std::vector<std::vector<std::string>>& files) {
    const std::string path = (dir_ / "tp2" / kManifestName).string();
    Result<std::string> text = ReadFileToString(path);
    ASSERT_TRUE(text.ok());
    Result<Manifest> m = ParseManifestJson(*text);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    m->files = files;
    ASSERT_TRUE(WriteFileAtomically(path, ManifestToJson(*m), {.overwrite = true}).ok());
  }

  fs::path dir_;
};

TEST_F(ShardedCheckpointTest, AFileListedForTwoRanksIsRefused) {
  SetFiles({{ShardFileName(0, 0)}, {ShardFileName(0, 0)}});
  Result<ShardedCheckpoint> opened = ShardedCheckpoint::Open(sharded());
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(opened.status().message().find(
                "files: \"model-rank-0-part-0.safetensors\" is listed for rank 0 and again for "
                "rank 1"),
            std::string::npos)
      << opened.status().message();
  EXPECT_EQ(Convert(sharded(), 1, std::nullopt, out()).code(), StatusCode::kDataLoss);
  EXPECT_FALSE(fs::exists(out()));
}

TEST_F(ShardedCheckpointTest, AFileListedTwiceForOneRankIsRefused) {
  SetFiles({{ShardFileName(0, 0), ShardFileName(0, 0)}, {ShardFileName(1, 0)}});
  Result<ShardedCheckpoint> opened = ShardedCheckpoint::Open(sharded());
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("is listed for rank 0 and again for rank 0"),
            std::string::npos)
      << opened.status().message();
}

TEST_F(ShardedCheckpointTest, ALinkToAnotherRanksFileIsRefused) {
  fs::remove(RankFile(1));
  fs::create_symlink(ShardFileName(0, 0), RankFile(1));
  Result<ShardedCheckpoint> opened = ShardedCheckpoint::Open(sharded());
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(opened.status().message().find("(listed for rank 1) is the same file as"),
            std::string::npos)
      << opened.status().message();
}

TEST_F(ShardedCheckpointTest, ConvertRefusesDisagreeingReplicasUnlessTold) {
  // The file ends with rank 1's shard of w: flip a bit of its last element.
  {
    std::fstream f(RankFile(1), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(c ^ 0x01));
  }
  const Status s = Convert(sharded(), 1, std::nullopt, out());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("ranks 0 and 1 hold different data for element [3] of F"),
            std::string::npos)
      << s.message();
  EXPECT_FALSE(fs::exists(out()));
  CheckpointOptions no_verify;
  no_verify.verify_replicas = false;
  EXPECT_TRUE(Convert(sharded(), 1, std::nullopt, out(), no_verify).ok());
}

// Every file of `dir` (name -> bytes).
std::map<std::string, std::string> FilesOf(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    out[e.path().filename().string()] = *ReadFileToString(e.path().string());
  }
  return out;
}

// Scatter with the file system's range copies and without: the same files byte for byte, and
// the copies used exactly where a shard is an unscaled dense block of a tensor.
TEST(ScatterCopyTest, RangeCopiesWriteTheSameBytesAsCopiesThroughMemory) {
  const fs::path dir =
      fs::temp_directory_path() / ("scatter_copy_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "full");
  struct Tensor {
    const char* name;
    Shape shape;
    const char* layout;
    Index copied;  // elements the file system copies, both ranks together
  } table[] = {
      {"rows", {64, 1024}, R"({"family": "split", "dim": 0})", 64 * 1024},
      {"whole", {3000}, kReplicated, 2 * 3000},
      {"cols", {64, 1024}, R"({"family": "split", "dim": 1})", 0},  // strided
      {"halved", {256}, kPreDivided, 0},                            // scaled
      {"vocab", {33, 512}, R"({"family": "padded_vocab", "dim": 0, "pad_multiple": 8})", 0},
  };
  std::vector<TensorToWrite> tensors;
  std::map<std::string, LayoutDescriptor> layouts;
  uint64_t expected_copied = 0;
  for (const Tensor& t : table) {
    tensors.push_back({t.name, DType::kF32, t.shape, [](std::span<std::byte> out) {
                         for (size_t i = 0; i < out.size(); ++i) {
                           out[i] = static_cast<std::byte>(i * 29 + 3);
                         }
                         return Status::Ok();
                       }});
    layouts[t.name] = Layout(t.layout);
    expected_copied += static_cast<uint64_t>(t.copied) * 4;
  }
  ASSERT_TRUE(
      WriteSafetensors((dir / "full" / "model.safetensors").string(), std::move(tensors)).ok());
  std::map<std::string, std::string> outputs[2];
  for (const bool copy : {true, false}) {
    CheckpointOptions options;
    options.copy_file_ranges = copy;
    CheckpointStats stats;
    options.stats = &stats;
    const fs::path out = dir / (copy ? "copied" : "through_memory");
    const Status s =
        Scatter((dir / "full").string(), 2, MapsFromLayouts(layouts, 2), out.string(), options);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(stats.processes.size(), 1u);
    EXPECT_EQ(stats.processes[0].bytes_copied, copy ? expected_copied : 0) << copy;
    outputs[copy ? 0 : 1] = FilesOf(out);
  }
  EXPECT_EQ(outputs[0].size(), 3u);  // two rank files and the manifest
  EXPECT_TRUE(outputs[0] == outputs[1]);
  fs::remove_all(dir);
}

// A checkpoint of very many tensors: its manifest is written in time linear in them. Each
// parameter's key was appended by searching the keys before it: for 10^5 keys 14 s of CPU for
// the keys alone (`convert --tp 2` of a DCP checkpoint of 10^5 keys did not finish in 300 s).
// Now the whole write takes 1-3 s.
TEST(ManifestDeathTest, ManyTensorsAreWrittenInLinearTime) {
  const auto write = [] {
    Manifest m;
    m.world_size = 2;
    m.files = {{"model-rank-0-part-0.safetensors"}, {"model-rank-1-part-0.safetensors"}};
    Result<ParamMap> map = ReplicatedMap({2}, 2);
    if (!map.ok()) return false;
    const int n = test_support::CostInput(100000);
    for (int i = 0; i < n; ++i) {
      m.params.push_back(
          ShardedParam{fmt::format("model.t{}.weight", i), DType::kF32, *map, std::nullopt, 1});
    }
    const std::string json = ManifestToJson(m);
    return json.find(fmt::format("\"model.t{}.weight\"", n - 1)) != std::string::npos;
  };
  EXPECT_EXIT(test_support::RunUnderCpuLimit(10, write), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace reshard
