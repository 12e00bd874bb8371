#include "reshard/layouts/deepspeed_meta.h"

#include <gtest/gtest.h>

#include "reshard/layouts/basic.h"

namespace reshard {
namespace {

ParamMap MapOf(std::string_view meta, int world) {
  Result<ParamMap> m = DeepSpeedMetaMap(meta, world);
  EXPECT_TRUE(m.ok()) << meta << ": " << m.status().message();
  return m.ok() ? *m : *ReplicatedMap({1}, 1);
}

std::vector<Index> Rows(const ParamMap& m) {
  std::vector<Index> n;
  for (const RankShard& r : m.ranks()) n.push_back(r.shard_shape[0]);
  return n;
}

TEST(DeepSpeedMetaTest, ColumnParallelWithPartitionSizesKeepsTheRecordedSizes) {
  const char* meta = R"({"partition_type": "column", "partition_dim": 0, "logical_shape": [24, 8],
                         "partition_sizes": [8, 8, 8, 0], "universal_checkpoint_version": 0.4})";
  Result<LoweredDeepSpeedMeta> l = LowerDeepSpeedMeta(meta);
  ASSERT_TRUE(l.ok()) << l.status().message();
  EXPECT_EQ(LayoutToJson(l->descriptor), R"({"family":"split","dim":0,"sizes":[8,8,8,0]})");
  EXPECT_EQ(l->recorded_world_size, 4);
  EXPECT_EQ(Rows(MapOf(meta, 4)), (std::vector<Index>{8, 8, 8, 0}));
  Result<ParamMap> other = DeepSpeedMetaMap(meta, 2);
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition);
}

TEST(DeepSpeedMetaTest, SubParametersWithWidthsBecomeAFusedLayout) {
  const char* meta =
      R"({"partition_dim": 0, "logical_shape": [48, 8], "sub_param_shape": [[32, 8, 8], 8],
                         "sub_param_sizes": [32, 8, 8],
                         "sub_param_shard_widths": [[16, 16], [4, 4], [4, 4]], "universal_checkpoint_version": 0.4})";
  Result<LoweredDeepSpeedMeta> l = LowerDeepSpeedMeta(meta);
  ASSERT_TRUE(l.ok()) << l.status().message();
  EXPECT_EQ(
      LayoutToJson(l->descriptor),
      R"({"family":"fused","dim":0,"remainder":"front","parts":[{"size":32,"widths":[16,16]},)"
      R"({"size":8,"widths":[4,4]},{"size":8,"widths":[4,4]}]})");
  EXPECT_EQ(MapOf(meta, 2).rank(1).pieces.size(), 2u);  // q, then k and v folded
}

TEST(DeepSpeedMetaTest, LegacyCategoriesLowerToExactSplits) {
  EXPECT_EQ(
      LayoutToJson(LowerDeepSpeedMeta(R"({"cat_dim": 1, "logical_shape": [4, 8]})")->descriptor),
      R"({"family":"split","dim":1,"remainder":"exact"})");
  EXPECT_EQ(LayoutToJson(LowerDeepSpeedMeta(
                             R"({"cat_dim": 0, "param_n_sub_params": 2, "logical_shape": [8, 4]})")
                             ->descriptor),
            R"({"family":"fused","dim":0,"remainder":"exact","parts":2})");
  Result<ParamMap> m = DeepSpeedMetaMap(R"({"cat_dim": 0, "logical_shape": [10, 4]})", 4);
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
}

TEST(DeepSpeedMetaTest, VocabularyIsPaddedAndRecordsItsRealRows) {
  const char* meta =
      R"({"cat_dim": 0, "vocab_tensor": true, "original_vocab_size": 13, "logical_shape": [13, 4]})";
  ParamMap m = MapOf(meta, 4);
  EXPECT_EQ(m.logical_shape(), (Shape{16, 4}));
  EXPECT_EQ(m.valid_shape(), (Shape{13, 4}));
  // The padded shape (from the shards) with the original size gives the same layout.
  ParamMap same =
      MapOf(R"({"vocab_tensor": true, "original_vocab_size": 13, "logical_shape": [16, 4]})", 4);
  EXPECT_EQ(same, m);
  Result<ParamMap> bad = DeepSpeedMetaMap(
      R"({"vocab_tensor": true, "padded_vocab_size": 16, "logical_shape": [13, 4]})", 3);
  EXPECT_EQ(bad.status().code(), StatusCode::kFailedPrecondition);
}

TEST(DeepSpeedMetaTest, AveragedParameterBecomesACheckedReplicaWithANote) {
  std::vector<std::string> notes;
  Result<ParamMap> m = DeepSpeedMetaMap(R"({"average": true, "logical_shape": [6]})", 2, &notes);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->rank(1).pieces.at(0).locations, (std::vector<Rank>{0, 1}));
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("instead of averaging"), std::string::npos);
}

TEST(DeepSpeedMetaTest, InconsistentMetadataIsRefusedWithThePath) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"({"partition_dim": 0, "logical_shape": [24, 8], "partition_sizes": [8, 8, 7]})",
       "partition_sizes: [8, 8, 7] sum to 23, but dimension 0 of [24, 8] has 24"},
      {R"({"partition_dim": 0, "logical_shape": [48, 8], "sub_param_sizes": [32, 8, 8],
           "sub_param_shard_widths": [[16, 16], [4, 4], [4, 3]]})",
       "sub_param_shard_widths[2]: widths [4, 3] sum to 7, but sub-parameter 2 has 8"},
      {R"({"partition_dim": 0, "logical_shape": [48, 8], "sub_param_shard_widths": [[16, 16], [4, 4, 0]]})",
       "sub_param_shard_widths[1]: has widths for 3 ranks"},
      {R"({"replicated": true, "partition_dim": 0, "logical_shape": [4]})",
       "replicated: a replicated parameter"},
      {R"({"partition_dim": 2, "logical_shape": [4, 4]})",
       "partition_dim: dimension 2 is outside the shape [4, 4]"},
      {R"({"logical_shape": [4, 4]})", "does not say how the parameter is laid out"},
      {R"({"cat_dim": 0})", "missing key \"logical_shape\""},
      {R"({"cat_dim": 0, "logical_shape": [4], "padding": 3})",
       "padding: unknown key for DeepSpeed parameter metadata"},
      {R"({"vocab_tensor": true, "original_vocab_size": 20, "logical_shape": [16, 4]})",
       "original_vocab_size: 20 is more than the 16 rows"},
  };
  for (const auto& [meta, message] : cases) {
    Result<LoweredDeepSpeedMeta> l = LowerDeepSpeedMeta(meta);
    ASSERT_FALSE(l.ok()) << meta;
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << meta;
    EXPECT_NE(l.status().message().find(message), std::string::npos)
        << meta << " -> " << l.status().message();
  }
}

TEST(DeepSpeedMetaTest, UnsupportedLayoutsAreRefusedWithDeepSpeedsReason) {
  Result<ParamMap> m = DeepSpeedMetaMap(
      R"({"partition_dim": 1, "logical_shape": [4, 8], "conversion": {"unsupported_reason": "pre-divided bias"}})",
      2);
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(m.status().message().find("pre-divided bias"), std::string::npos);
}

TEST(DeepSpeedMetaTest, ARecordedAffineMapIsTheAnswerWhenItIsAllThereIs) {
  // Yuan-style: the layer publishes partition_dim and a block-gather map, no sizes.
  const char* meta = R"({"partition_dim": 0, "logical_shape": [4, 2], "conversion": {"affine_map":
      {"logical_shape": [4, 2], "ranks": {
        "0": {"shard_shape": [2, 2], "pieces": [{"shape": [1, 2], "source": [0, [2, 1]], "dest": [0, [2, 1]], "locations": [0]},
                                                {"shape": [1, 2], "source": [4, [2, 1]], "dest": [2, [2, 1]], "locations": [0]}]},
        "1": {"shard_shape": [2, 2], "pieces": [{"shape": [1, 2], "source": [2, [2, 1]], "dest": [0, [2, 1]], "locations": [1]},
                                                {"shape": [1, 2], "source": [6, [2, 1]], "dest": [2, [2, 1]], "locations": [1]}]}}}}})";
  ParamMap m = MapOf(meta, 2);
  EXPECT_EQ(m.rank(0).pieces.size(), 1u);  // canonical: one strided piece
  Result<ParamMap> other = DeepSpeedMetaMap(meta, 4);
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other.status().message().find("only by an affine map for 2 ranks"), std::string::npos);
}

}  // namespace
}  // namespace reshard
