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

}  // namespace
}  // namespace reshard
