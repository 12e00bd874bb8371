#include "reshard/hf/model_maps.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "reshard/layouts/descriptor.h"

namespace reshard {
namespace {

// A small llama: 4 heads of 8, 2 key/value heads, MLP 32, vocab 64, untied.
constexpr const char* kTinyLlama = R"({"model_type": "llama", "hidden_size": 32,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
  "intermediate_size": 32, "vocab_size": 64, "tie_word_embeddings": false})";

ModelPlan Plan(std::string_view config_json, PlanOptions options = {}) {
  const TpRegistry& reg = BuiltinTpRegistry();
  Result<ModelConfig> config = ReadModelConfigJson(reg, config_json);
  EXPECT_TRUE(config.ok()) << config.status().message();
  return ResolvePlan(reg, *config, options);
}

std::vector<std::pair<std::string, Shape>> TinyLlamaTensors() {
  return {{"model.embed_tokens.weight", {64, 32}},
          {"model.layers.0.self_attn.q_proj.weight", {32, 32}},
          {"model.layers.0.self_attn.k_proj.weight", {16, 32}},
          {"model.layers.0.self_attn.o_proj.weight", {32, 32}},
          {"model.layers.0.mlp.down_proj.weight", {32, 32}},
          {"model.layers.11.mlp.up_proj.weight", {32, 32}},
          {"model.layers.0.input_layernorm.weight", {32}},
          {"model.norm.weight", {32}},
          {"lm_head.weight", {64, 32}}};
}

TEST(ModelMapsTest, WildcardsOnlyWholeLayerNumbers) {
  EXPECT_EQ(WildcardLayerNumbers("model.layers.12.mlp.w1.weight"), "model.layers.*.mlp.w1.weight");
  EXPECT_EQ(WildcardLayerNumbers("h.3"), "h.*");
  EXPECT_EQ(WildcardLayerNumbers("a.1b.c"), "a.1b.c");
}

TEST(ModelMapsTest, LlamaTensorsTakeTheirPlanLayouts) {
  ModelPlan plan = Plan(kTinyLlama);
  Result<MapDocument> doc = ModelMaps(plan, 2, TinyLlamaTensors());
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  ASSERT_EQ(doc->params.size(), 9u);
  auto expect = [&](size_t i, const LayoutDescriptor& d, const Shape& shape) {
    Result<ParamMap> want = BuildMap(d, shape, 2);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(ParamMapToJson(doc->params[i].second), ParamMapToJson(*want)) << doc->params[i].first;
  };
  LayoutDescriptor rows;
  rows.family = LayoutFamily::kSplit;
  rows.rule.remainder = Remainder::kExact;
  LayoutDescriptor cols = rows;
  cols.dim = 1;
  LayoutDescriptor replicated;
  // embed_tokens: split on the vocabulary, tied or not, as transformers 5.24 does.
  expect(0, rows, {64, 32});
  expect(1, rows, {32, 32});  // q_proj colwise
  expect(2, rows, {16, 32});  // k_proj colwise
  expect(3, cols, {32, 32});  // o_proj rowwise
  expect(4, cols, {32, 32});  // down_proj rowwise
  expect(5, rows, {32, 32});  // layer 11 matched through the wildcard
  expect(6, replicated, {32});
  expect(7, replicated, {32});
  expect(8, rows, {64, 32});  // lm_head colwise_gather_output
}

TEST(ModelMapsTest, RowwiseBiasIsReplicatedColwiseBiasIsSplit) {
  ModelPlan plan = Plan(kTinyLlama);
  const ResolvedEntry* o = MatchPlanEntry(plan, "model.layers.3.self_attn.o_proj.bias");
  const ResolvedEntry* q = MatchPlanEntry(plan, "model.layers.3.self_attn.q_proj.bias");
  ASSERT_NE(o, nullptr);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(TensorLayout(o, "o.bias", {32})->family, LayoutFamily::kReplicated);
  EXPECT_EQ(TensorLayout(q, "q.bias", {32})->family, LayoutFamily::kSplit);
}

TEST(ModelMapsTest, ShapeThatDisagreesWithTheConfigIsAnError) {
  ModelPlan plan = Plan(kTinyLlama);
  Result<MapDocument> doc =
      ModelMaps(plan, 2, {{"model.layers.0.self_attn.k_proj.weight", {15, 32}}});
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(doc.status().message().find("splits 2 key/value heads"), std::string::npos)
      << doc.status().message();
}

TEST(ModelMapsTest, DegreeThatBreaksAConstraintIsRefusedLikeThePlanner) {
  ModelPlan plan = Plan(kTinyLlama);
  Result<MapDocument> doc = ModelMaps(plan, 4, TinyLlamaTensors());
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(doc.status().message().find("4 does not divide 2"), std::string::npos);
}

TEST(ModelMapsTest, PackedExpertsAreFusedHalves) {
  ModelPlan plan = Plan(R"({"model_type": "mixtral", "hidden_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4,
    "intermediate_size": 6, "num_local_experts": 4, "vocab_size": 16})");
  const ResolvedEntry* e = MatchPlanEntry(plan, "model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->style, "packed_colwise");
  Result<LayoutDescriptor> d = TensorLayout(e, "gate_up", {4, 12, 8});
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->family, LayoutFamily::kFused);
  EXPECT_EQ(d->dim, 1);
  EXPECT_EQ(d->equal_parts, 2);
}

TEST(ModelMapsTest, PerExpertTensorsThatTransformersFusesAreRefusedNamingTheConversion) {
  ModelPlan plan = Plan(R"({"model_type": "mixtral", "hidden_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4,
    "intermediate_size": 6, "num_local_experts": 4, "vocab_size": 16})");
  Result<MapDocument> doc =
      ModelMaps(plan, 2, {{"model.layers.0.block_sparse_moe.experts.3.w1.weight", {6, 8}}});
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(doc.status().message().find(".experts.gate_up_proj by MergeModulelist, Concatenate"),
            std::string::npos)
      << doc.status().message();
  // The router and the attention are stored as transformers holds them.
  EXPECT_TRUE(ModelMaps(plan, 2,
                        {{"model.layers.0.block_sparse_moe.gate.weight", {4, 8}},
                         {"model.layers.0.self_attn.q_proj.weight", {8, 8}}})
                  .ok());
}

TEST(ModelMapsTest, QwenMoeExpertsAreRefusedButItsDenseMlpIsNot) {
  ModelPlan plan = Plan(R"({"model_type": "qwen3_moe", "hidden_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4,
    "intermediate_size": 6, "moe_intermediate_size": 4, "num_experts": 4, "vocab_size": 16})");
  EXPECT_EQ(ModelMaps(plan, 2, {{"model.layers.1.mlp.experts.0.down_proj.weight", {8, 4}}})
                .status()
                .code(),
            StatusCode::kFailedPrecondition);
  EXPECT_TRUE(ModelMaps(plan, 2, {{"model.layers.1.mlp.down_proj.weight", {8, 6}}}).ok());
}

TEST(ModelMapsTest, UnevenVocabularyAndMlpTakeCeilChunksAsTransformersDoes) {
  ModelPlan plan = Plan(R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 129, "vocab_size": 251})");
  Result<MapDocument> doc = ModelMaps(plan, 2,
                                      {{"model.embed_tokens.weight", {251, 64}},
                                       {"model.layers.0.mlp.up_proj.weight", {129, 64}},
                                       {"model.layers.0.mlp.down_proj.weight", {64, 129}},
                                       {"lm_head.weight", {251, 64}}});
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  auto shards = [&](size_t i) {
    return std::vector<Shape>{doc->params[i].second.rank(0).shard_shape,
                              doc->params[i].second.rank(1).shard_shape};
  };
  EXPECT_EQ(shards(0), (std::vector<Shape>{{126, 64}, {125, 64}}));
  EXPECT_EQ(shards(1), (std::vector<Shape>{{65, 64}, {64, 64}}));
  EXPECT_EQ(shards(2), (std::vector<Shape>{{64, 65}, {64, 64}}));
  EXPECT_EQ(shards(3), (std::vector<Shape>{{126, 64}, {125, 64}}));
}

// transformers renames checkpoint keys before it matches its plan; reshard matches the renamed
// key and keeps the stored name.
TEST(ModelMapsTest, CheckpointNamesAreMatchedAsTransformersRenamesThem) {
  ModelPlan exaone = Plan(R"({"model_type": "exaone", "hidden_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 8,
    "vocab_size": 32})");
  Result<TensorMap> m =
      PlanTensorMap(exaone, 2, "transformer.h.0.attn.attention.q_proj.weight", {16, 16});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->layout.family, LayoutFamily::kSplit);
  EXPECT_EQ(m->map.rank(1).shard_shape, (Shape{8, 16}));
  m = PlanTensorMap(exaone, 2, "transformer.wte.weight", {32, 16});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->map.rank(0).shard_shape, (Shape{16, 16}));  // embed_tokens: the vocabulary

  ModelPlan granite = Plan(R"({"model_type": "granitemoe", "hidden_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 6,
    "num_local_experts": 4, "vocab_size": 16})");
  m = PlanTensorMap(granite, 2, "model.layers.0.block_sparse_moe.input_linear.weight", {4, 12, 8});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->layout.family, LayoutFamily::kFused);
  EXPECT_EQ(m->layout.dim, 1);
  EXPECT_EQ(m->map.rank(0).shard_shape, (Shape{4, 6, 8}));

  ModelPlan neox = Plan(R"({"model_type": "gpt_neox", "hidden_size": 16,
    "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": 32})");
  m = PlanTensorMap(neox, 2, "embed_out.weight", {32, 16});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->map.rank(0).shard_shape, (Shape{16, 16}));  // lm_head: colwise_gather_output
}

TEST(ModelMapsTest, LmHeadPlanInheritedFromTheParentClassIsApplied) {
  // InternLM3's causal-LM class inherits Llama's {"lm_head": "colwise_gather_output"}.
  ModelPlan plan = Plan(R"({"model_type": "internlm3", "hidden_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 8,
    "vocab_size": 32})");
  Result<TensorMap> m = PlanTensorMap(plan, 2, "lm_head.weight", {32, 16});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->map.rank(1).shard_shape, (Shape{16, 16}));
}

// The planner and the map generator read one registry of styles: for every style name,
// registered or not, either both accept a plan using it or both refuse it.
TEST(ModelMapsTest, PlannerAndMapGeneratorRefuseTheSameStyles) {
  std::vector<std::string> names = BuiltinTpRegistry().styles;
  for (const char* extra : {"local_colwise", "local_rowwise", "gather", "colwise_repp", ""})
    names.push_back(extra);
  for (const std::string& style : names) {
    PlanOptions options;
    options.distributed.tp_plan = ::reshard::Plan{{"layers.*.mlp.up_proj", style}};
    ModelPlan plan = Plan(kTinyLlama, options);
    DegreeAnswer answer = PlanDegree(plan, 2);
    const bool planner_refuses_style =
        answer.refusal && answer.refusal->reason == "unregistered_style";
    Result<MapDocument> maps = ModelMaps(plan, 2, TinyLlamaTensors());
    const bool maps_refuse_style =
        !maps.ok() && maps.status().message().find("not registered") != std::string::npos;
    EXPECT_EQ(planner_refuses_style, maps_refuse_style) << style;
    EXPECT_EQ(planner_refuses_style, !BuiltinTpRegistry().IsRegistered(style)) << style;
  }
}

TEST(ModelMapsTest, VllmMapsAreNotGenerated) {
  PlanOptions vllm;
  vllm.engine = Engine::kVllm;
  EXPECT_EQ(ModelMaps(Plan(kTinyLlama, vllm), 2, TinyLlamaTensors()).status().code(),
            StatusCode::kUnimplemented);
}

// One MoE layer of `experts` experts per member name ("w1", ...), each [rows, cols] of the
// member's shape, under "model.layers.0.<moe>.experts.{e}.".
std::vector<StoredTensor> PerExpertLayer(std::string_view moe,
                                         const std::vector<std::pair<std::string, Shape>>& members,
                                         int experts, std::string_view skip = "") {
  std::vector<StoredTensor> out;
  for (int e = 0; e < experts; ++e) {
    for (const auto& [member, shape] : members) {
      const std::string name = fmt::format("model.layers.0.{}.experts.{}.{}", moe, e, member);
      if (name != skip) out.push_back({name, DType::kF32, shape});
    }
  }
  return out;
}

TEST(PlanCheckpointMapsTest, TheExpertsOfTheCheckpointMustBeTheConfigs) {
  const std::string mixtral = R"({"model_type": "mixtral", "hidden_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 6,
    "vocab_size": 16, "num_local_experts": )";
  const std::string qwen = R"({"model_type": "qwen2_moe", "hidden_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 6,
    "moe_intermediate_size": 6, "vocab_size": 16, "num_experts": )";
  const std::string gpt_oss = R"({"model_type": "gpt_oss", "hidden_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 6,
    "vocab_size": 16, "num_local_experts": )";
  const std::vector<std::pair<std::string, Shape>> mixtral_members = {
      {"w1.weight", {6, 8}}, {"w3.weight", {6, 8}}, {"w2.weight", {8, 6}}};
  const std::vector<std::pair<std::string, Shape>> qwen_members = {
      {"gate_proj.weight", {6, 8}}, {"up_proj.weight", {6, 8}}, {"down_proj.weight", {8, 6}}};
  const auto gpt_oss_layer = [](Index gate_up, Index down) {
    return std::vector<StoredTensor>{
        {"model.layers.0.mlp.experts.gate_up_proj", DType::kF32, {gate_up, 8, 12}},
        {"model.layers.0.mlp.experts.down_proj", DType::kF32, {down, 6, 8}}};
  };
  const std::string ep = R"({"tp_plan": "auto", "ep_size": 2})";
  struct Case {
    std::string name;
    std::string config;
    std::string distributed;  // "" for none
    std::vector<StoredTensor> tensors;
    std::string error;  // "" when it is laid out
  };
  const Case cases[] = {
      {"mixtral as the config says", mixtral + "4}", "",
       PerExpertLayer("block_sparse_moe", mixtral_members, 4), ""},
      {"mixtral, fewer in the config", mixtral + "2}", ep,
       PerExpertLayer("block_sparse_moe", mixtral_members, 4), "holds 4 experts"},
      {"mixtral, more in the config", mixtral + "8}", ep,
       PerExpertLayer("block_sparse_moe", mixtral_members, 4), "model has 8"},
      {"qwen2-moe as the config says", qwen + "4}", "", PerExpertLayer("mlp", qwen_members, 4), ""},
      {"qwen2-moe missing an expert's down_proj", qwen + "4}", "",
       PerExpertLayer("mlp", qwen_members, 4, "model.layers.0.mlp.experts.3.down_proj.weight"),
       "holds 3 experts"},
      {"gpt-oss as the config says", gpt_oss + "4}", ep, gpt_oss_layer(4, 4), ""},
      {"gpt-oss, down_proj of other experts", gpt_oss + "4}", ep, gpt_oss_layer(4, 8),
       "\"model.layers.0.mlp.experts.down_proj\" (shape [8, 6, 8], experts along dim 0) "
       "holds 8 experts"},
      {"gpt-oss, fewer in the config", gpt_oss + "2}", ep, gpt_oss_layer(4, 4),
       "holds 4 experts, but config.json's model has 2"},
  };
  for (const Case& c : cases) {
    PlanOptions options;
    if (!c.distributed.empty()) {
      Result<DistributedConfig> d = ParseDistributedConfigJson(BuiltinTpRegistry(), c.distributed);
      ASSERT_TRUE(d.ok()) << d.status().message();
      options.distributed = *d;
    }
    Result<ConfigMaps> maps = ConfigMaps::FromPlan(Plan(c.config, options), 2);
    ASSERT_TRUE(maps.ok()) << c.name << ": " << maps.status().message();
    Result<CheckpointMaps> planned = PlanCheckpointMaps(*maps, c.tensors);
    if (c.error.empty()) {
      EXPECT_TRUE(planned.ok()) << c.name << ": " << planned.status().message();
      continue;
    }
    ASSERT_FALSE(planned.ok()) << c.name;
    EXPECT_EQ(planned.status().code(), StatusCode::kFailedPrecondition) << c.name;
    EXPECT_NE(planned.status().message().find(c.error), std::string::npos)
        << c.name << ": " << planned.status().message();
  }
}

TEST(ConfigMapsTest, DegreeOneLaysOutAModelWithoutAPlanWhole) {
  // GPT-2 has no tensor-parallel plan: at 2 processes that is refused, at 1 nothing is split.
  ModelPlan plan = Plan(R"({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1,
    "vocab_size": 16})");
  ASSERT_TRUE(plan.refusal.has_value());
  EXPECT_EQ(ConfigMaps::FromPlan(plan, 2).status().code(), StatusCode::kFailedPrecondition);
  Result<ConfigMaps> one = ConfigMaps::FromPlan(plan, 1);
  ASSERT_TRUE(one.ok()) << one.status().message();
  Result<TensorMap> m = one->Map("h.0.attn.c_attn.weight", {8, 24});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->layout.family, LayoutFamily::kReplicated);
  EXPECT_EQ(m->map.world_size(), 1);
}

TEST(ConfigMapsTest, ADistributedConfigTheMapsCannotFollowIsRefused) {
  struct Case {
    std::string distributed;
    int world;
    std::string error;  // "" when accepted
  };
  const Case cases[] = {
      {R"({"tp_size": 2})", 2, ""},
      {R"({"tp_size": 4})", 2, "tp_size 4 and the 2 processes"},
      {R"({"tp_size": 2, "pp_size": 1, "fsdp_size": null})", 2, ""},
      {R"({"tp_plan": "auto", "fsdp_size": 2})", 2, "fsdp_size 2"},
      {R"({"tp_plan": "auto", "pp_size": 2})", 2, "pp_size 2"},
      {R"({"tp_plan": "auto", "dp_replicate_size": 2})", 2, "dp_replicate_size 2"},
      {R"({"tp_plan": "auto", "enable_sequence_parallel": true})", 2,
       "enable_sequence_parallel true"},
      {R"({"tp_plan": "auto", "fsdp_plan": {"layers": "x"}})", 2, "fsdp_plan"},
  };
  for (const Case& c : cases) {
    Result<DistributedConfig> d = ParseDistributedConfigJson(BuiltinTpRegistry(), c.distributed);
    ASSERT_TRUE(d.ok()) << c.distributed << ": " << d.status().message();
    PlanOptions options;
    options.distributed = *d;
    Result<ConfigMaps> maps = ConfigMaps::FromPlan(Plan(kTinyLlama, options), c.world);
    if (c.error.empty()) {
      EXPECT_TRUE(maps.ok()) << c.distributed << ": " << maps.status().message();
      continue;
    }
    ASSERT_FALSE(maps.ok()) << c.distributed;
    EXPECT_EQ(maps.status().code(), StatusCode::kInvalidArgument) << c.distributed;
    EXPECT_NE(maps.status().message().find(c.error), std::string::npos)
        << c.distributed << ": " << maps.status().message();
  }
}

}  // namespace
}  // namespace reshard
