#include "reshard/hf/registry.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

TEST(TpRegistryTest, BuiltinRegistryHasLlamaAndTheRegisteredStyles) {
  const TpRegistry& reg = BuiltinTpRegistry();
  EXPECT_FALSE(reg.transformers_version.empty());
  const ModelTypeInfo* llama = reg.Find("llama");
  ASSERT_NE(llama, nullptr);
  ASSERT_FALSE(llama->tp_plan.empty());
  EXPECT_EQ(llama->tp_plan[0], (PlanEntry{"layers.*.self_attn.q_proj", "colwise"}));
  EXPECT_TRUE(reg.IsRegistered("colwise"));
  EXPECT_TRUE(reg.IsRegistered("rowwise"));
  EXPECT_FALSE(reg.IsRegistered("local_colwise"));
  EXPECT_EQ(reg.Find("no_such_model"), nullptr);
}

TEST(TpRegistryTest, EveryStyleTheRegistryNamesHasAKnownEffect) {
  const TpRegistry& reg = BuiltinTpRegistry();
  for (const std::string& style : reg.styles) EXPECT_TRUE(ResolveStyle(reg, style).ok()) << style;
}

TEST(TpRegistryTest, UnregisteredStyleIsRefusedNamingTheRegisteredOnes) {
  Result<TpRegistry> reg = ParseTpRegistryJson(
      R"({"transformers_version": "9.9", "styles": ["rowwise", "colwise"], "model_types": {}})");
  ASSERT_TRUE(reg.ok()) << reg.status().message();
  Result<StyleEffect> e = ResolveStyle(*reg, "colwise_rep");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(e.status().message().find("\"colwise_rep\" is not registered in transformers 9.9 "
                                      "(registered: colwise, rowwise)"),
            std::string::npos)
      << e.status().message();
  EXPECT_EQ(*ResolveStyle(*reg, "colwise"), StyleEffect::kSplitOut);
}

TEST(TpRegistryTest, MalformedRegistriesAreRefusedWithThePath) {
  for (
      const char* text : {
          "[]",
          R"({"styles": []})",
          R"({"transformers_version": "1", "styles": [1], "model_types": {}})",
          R"({"transformers_version": "1", "styles": [], "model_types": {"a": {"tp_plan": {"x": 1}}}})",
          R"({"transformers_version": "1", "styles": [], "model_types": {"a": {"bogus": 1}}}})",
      }) {
    Result<TpRegistry> reg = ParseTpRegistryJson(text);
    EXPECT_FALSE(reg.ok()) << text;
  }
}

TEST(TpRegistryTest, ConversionSourcesMatchAnywhereUpToANameBoundary) {
  EXPECT_TRUE(MatchesConversionSource("mlp.experts.*.gate_proj.weight",
                                      "model.layers.0.mlp.experts.12.gate_proj.weight"));
  EXPECT_TRUE(MatchesConversionSource(".experts.*.w1.weight",
                                      "model.layers.3.block_sparse_moe.experts.0.w1.weight"));
  EXPECT_FALSE(MatchesConversionSource(
      ".experts.*.w1.weight", "model.layers.3.block_sparse_moe.experts.0.w1.weight_scale"));
  EXPECT_FALSE(MatchesConversionSource("mlp.experts.*.gate_proj.weight",
                                       "model.layers.0.mlp.gate_proj.weight"));
  EXPECT_TRUE(MatchesConversionSource(R"(mlp\.experts\.gate_up_proj)",
                                      "model.layers.0.mlp.experts.gate_up_proj"));
}

TEST(TpRegistryTest, LoadRenamesApplyInOrderToTheFirstMatch) {
  const TpRegistry& reg = BuiltinTpRegistry();
  ASSERT_NE(reg.Find("mixtral"), nullptr);
  EXPECT_EQ(ApplyLoadRenames(reg.Find("mixtral")->load_renames,
                             "model.layers.0.block_sparse_moe.gate.weight"),
            "model.layers.0.mlp.gate.weight");
  ASSERT_NE(reg.Find("exaone"), nullptr);
  EXPECT_EQ(ApplyLoadRenames(reg.Find("exaone")->load_renames,
                             "transformer.h.3.attn.attention.out_proj.weight"),
            "model.layers.3.self_attn.o_proj.weight");
  EXPECT_EQ(ApplyLoadRenames(reg.Find("exaone")->load_renames, "lm_head.weight"), "lm_head.weight");
}

TEST(TpRegistryTest, BuiltinRegistryRecordsTheInputEmbeddingRuleAndConversions) {
  const TpRegistry& reg = BuiltinTpRegistry();
  ASSERT_TRUE(reg.input_embedding);
  EXPECT_EQ(reg.input_embedding->module, "embed_tokens");
  EXPECT_EQ(reg.input_embedding->style, "embedding_rowwise");
  EXPECT_FALSE(reg.input_embedding->tied_only);
  ASSERT_NE(reg.Find("llama"), nullptr);
  EXPECT_TRUE(reg.Find("llama")->embed_tokens);
  ASSERT_NE(reg.Find("mixtral"), nullptr);
  EXPECT_FALSE(reg.Find("mixtral")->load_conversions.empty());
  EXPECT_TRUE(reg.Find("llama")->load_conversions.empty());
}

}  // namespace
}  // namespace reshard
