#include "reshard/checkpoint/megatron/run_config.h"

#include <gtest/gtest.h>

#include <string>

namespace reshard {
namespace {

// What PyYAML's safe_dump writes for a Megatron-Bridge ConfigContainer with LoRA (keys sorted,
// list items at their key's indent), around other sections.
constexpr char kRunConfig[] = R"(checkpoint:
  save: checkpoints
model:
  num_layers: 2
  tensor_model_parallel_size: 2
peft:
  _target_: megatron.bridge.peft.lora.LoRA
  a2a_experimental: false
  alpha: 32
  dim: 16
  dropout: 0.05
  exclude_modules: []
  lora_dtype: null
  target_modules:
  - linear_qkv
  - linear_proj
train:
  micro_batch_size: 1
)";

TEST(MegatronPeftConfigTest, ReadsTheLoraSectionPyYamlWrites) {
  Result<MegatronPeftConfig> c = ParseMegatronPeftConfig(kRunConfig, "run_config.yaml");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->target, "megatron.bridge.peft.lora.LoRA");
  EXPECT_EQ(c->dim, 16);
  EXPECT_EQ(c->alpha, 32);
  EXPECT_EQ(c->dropout, 0.05);
}

TEST(MegatronPeftConfigTest, QuotedAndFloatScalars) {
  Result<MegatronPeftConfig> c = ParseMegatronPeftConfig(
      "peft:\n    _target_: 'megatron.bridge.peft.lora.LoRA'\n    alpha: 8.5\n    dim: \"4\"\n",
      "x");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->target, "megatron.bridge.peft.lora.LoRA");
  EXPECT_EQ(c->dim, 4);
  EXPECT_EQ(c->alpha, 8.5);
}

// One bad run_config per case: each is refused, the message naming what is wrong.
TEST(MegatronPeftConfigTest, RefusesWhatItCannotRead) {
  const struct {
    const char* yaml;
    const char* says;
  } cases[] = {
      {"model:\n  dim: 4\n", "no peft: section"},
      {"peft: null\n", "trained no adapter"},
      {"peft: {dim: 4, alpha: 8}\n", "not a block"},
      {"peft:\n  alpha: 8\n", "peft.dim"},
      {"peft:\n  dim: 4\n", "peft.alpha"},
      {"peft:\n  dim: 4\n  alpha: -8\n", "peft.alpha"},
      {"peft:\n  dim: 4.5\n  alpha: 8\n", "whole number"},
      {"peft:\n  dim: four\n  alpha: 8\n", "peft.dim"},
      {"peft:\n  dim: 4\n  alpha: 8\n  nonsense\n", "not `key: value`"},
      {"peft:\n  dim: 4\nalpha: 8\n", "peft.alpha"},  // alpha outside the section
  };
  for (const auto& c : cases) {
    Result<MegatronPeftConfig> r = ParseMegatronPeftConfig(c.yaml, "run_config.yaml");
    ASSERT_FALSE(r.ok()) << c.yaml;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_NE(r.status().message().find(c.says), std::string::npos)
        << c.yaml << " -> " << r.status().message();
  }
}

}  // namespace
}  // namespace reshard
