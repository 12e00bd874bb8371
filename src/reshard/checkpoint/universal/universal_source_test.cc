// A universal checkpoint as a source (OpenUniversal, universal.h): what it offers, and the
// files it refuses, each named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "reshard/base/temp_dir_testing.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/io/file.h"
#include "reshard/io/torch_writer.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test_support::TempDir;
using ::testing::HasSubstr;

// Writes {key: fp32 tensor of `shape` with values start, start + 1, ...} (or the bare tensor
// when `key` is empty) to `path`.
void WriteState(const fs::path& path, const Shape& shape, float start,
                const std::string& key = "param") {
  fs::create_directories(path.parent_path());
  TorchTreeBuilder b;
  const PickleNodeId t = b.Tensor(DType::kF32, shape, [&](std::span<std::byte> out) {
    for (size_t k = 0; k < out.size() / 4; ++k) {
      const float v = start + static_cast<float>(k);
      std::memcpy(out.data() + k * 4, &v, 4);
    }
    return Status::Ok();
  });
  const PickleNodeId root = key.empty() ? t : b.Dict({{b.Str(key), t}});
  ASSERT_TRUE(b.Write(path.string(), root, {.overwrite = true, .sync = false}).ok());
}

// OUT/latest_universal -> step2_universal with one parameter "w" of shape [2, 3].
fs::path MakeUniversal(const TempDir& dir) {
  fs::path folder = dir / "step2_universal";
  WriteState(folder / "zero" / "w" / "fp32.pt", {2, 3}, 1.0f);
  WriteState(folder / "zero" / "w" / "exp_avg.pt", {2, 3}, 10.0f);
  WriteState(folder / "zero" / "w" / "exp_avg_sq.pt", {2, 3}, 100.0f);
  WriteState(folder / "zero" / "optimizer_state.pt", {1}, 0.0f, "param_groups");
  EXPECT_TRUE(WriteFileAtomically((dir / "latest_universal").string(), "step2_universal",
                                  {.overwrite = true})
                  .ok());
  return folder;
}

SourceOptions Convert() {
  SourceOptions o;
  o.use = SourceUse::kConvert;
  return o;
}

TEST(UniversalSourceTest, OffersTheMastersAndMomentsAsDeepSpeedSourcesNameThem) {
  TempDir dir;
  const fs::path folder = MakeUniversal(dir);
  EXPECT_TRUE(IsUniversalCheckpoint(dir.path().string()));
  EXPECT_TRUE(IsUniversalCheckpoint(folder.string()));
  EXPECT_FALSE(IsUniversalCheckpoint((folder / "zero").string()));
  // A DeepSpeed save dir with ds_to_universal's output beside its tags stays DeepSpeed's.
  const fs::path save = dir / "save";
  fs::create_directories(save);
  ASSERT_TRUE(WriteFileAtomically((save / "latest").string(), "global_step2").ok());
  ASSERT_TRUE(WriteFileAtomically((save / "latest_universal").string(), "x_universal").ok());
  EXPECT_FALSE(IsUniversalCheckpoint(save.string()));
  for (const std::string& path : {dir.path().string(), folder.string()}) {
    Result<OpenedCheckpoint> opened = OpenUniversal(path, Convert());
    ASSERT_TRUE(opened.ok()) << opened.status().message();
    const Manifest& m = opened->source->manifest();
    EXPECT_EQ(m.world_size, 1);
    std::vector<std::string> names;
    for (const ShardedParam& p : m.params) names.push_back(p.name);
    EXPECT_THAT(names, ::testing::ElementsAre("w", "w.fp32", "w.exp_avg", "w.exp_avg_sq"));
    EXPECT_EQ(m.params[2].scale_power, -1);
    EXPECT_EQ(m.params[3].scale_power, -2);
    EXPECT_EQ(m.params[0].dtype, DType::kF32);  // no model-states copy: the module is fp32
    Result<std::vector<ConstBuffer>> shards = opened->source->AcquireShards(3);
    ASSERT_TRUE(shards.ok());
    ASSERT_EQ(shards->size(), 1u);
    ASSERT_EQ((*shards)[0].num_elements, 6);
    float last = 0;
    std::memcpy(&last, (*shards)[0].data + size_t{5} * 4, 4);
    EXPECT_EQ(last, 105.0f);
    opened->source->ReleaseShards(3);
  }
  Result<OpenedCheckpoint> gather = OpenUniversal(dir.path().string(), SourceOptions{});
  ASSERT_TRUE(gather.ok());
  EXPECT_EQ(gather->source->manifest().params.size(), 1u);
}

TEST(UniversalSourceTest, LatestUniversalNamingNoFolderIsNotFound) {
  TempDir dir;
  MakeUniversal(dir);
  ASSERT_TRUE(WriteFileAtomically((dir / "latest_universal").string(), "step9_universal",
                                  {.overwrite = true})
                  .ok());
  Result<OpenedCheckpoint> opened = OpenUniversal(dir.path().string(), SourceOptions{});
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(opened.status().message(), HasSubstr((dir / "latest_universal").string()));
  EXPECT_THAT(opened.status().message(), HasSubstr("step9_universal"));
}

TEST(UniversalSourceTest, AParameterFolderWithoutFp32IsNotFound) {
  TempDir dir;
  const fs::path folder = MakeUniversal(dir);
  WriteState(folder / "zero" / "v" / "exp_avg.pt", {4}, 0.0f);
  Result<OpenedCheckpoint> opened = OpenUniversal(dir.path().string(), SourceOptions{});
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(opened.status().message(), HasSubstr((folder / "zero" / "v" / "fp32.pt").string()));
}

TEST(UniversalSourceTest, ATensorNotAtParamIsRefused) {
  TempDir dir;
  const fs::path folder = MakeUniversal(dir);
  const fs::path bad = folder / "zero" / "w" / "fp32.pt";
  WriteState(bad, {2, 3}, 1.0f, "weight");
  Result<OpenedCheckpoint> opened = OpenUniversal(dir.path().string(), SourceOptions{});
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(opened.status().message(), HasSubstr(bad.string()));
  EXPECT_THAT(opened.status().message(), HasSubstr("\"param\""));
  // A bare tensor is the flat form, which needs a model-states copy's param_shapes.
  WriteState(bad, {2, 3}, 1.0f, "");
  opened = OpenUniversal(dir.path().string(), SourceOptions{});
  ASSERT_FALSE(opened.ok());
  EXPECT_THAT(opened.status().message(), HasSubstr(bad.string()));
}

TEST(UniversalSourceTest, MomentsOfAnotherShapeAreRefusedWhenConverting) {
  TempDir dir;
  const fs::path folder = MakeUniversal(dir);
  const fs::path bad = folder / "zero" / "w" / "exp_avg_sq.pt";
  WriteState(bad, {3, 2}, 0.0f);
  Result<OpenedCheckpoint> opened = OpenUniversal(dir.path().string(), Convert());
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(opened.status().message(), HasSubstr(bad.string()));
  EXPECT_THAT(opened.status().message(), HasSubstr("[3, 2]"));
  EXPECT_THAT(opened.status().message(), HasSubstr("[2, 3]"));
  // A gather reads fp32.pt alone; the weights-only convert too.
  EXPECT_TRUE(OpenUniversal(dir.path().string(), SourceOptions{}).ok());
  SourceOptions weights = Convert();
  weights.weights_only = true;
  EXPECT_TRUE(OpenUniversal(dir.path().string(), weights).ok());
}

}  // namespace
}  // namespace reshard
