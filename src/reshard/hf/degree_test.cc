#include "reshard/hf/degree.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "reshard/hf/degree_blocks.h"

namespace reshard {
namespace {

constexpr const char* kSmolLM135M = R"({"model_type": "llama", "hidden_size": 576,
  "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
  "tie_word_embeddings": true, "vocab_size": 49152})";

DegreeAnswer Answer(std::string_view config_json, std::optional<int64_t> tp = std::nullopt,
                    PlanOptions options = {}) {
  const TpRegistry& reg = BuiltinTpRegistry();
  Result<ModelConfig> config = ReadModelConfigJson(reg, config_json);
  EXPECT_TRUE(config.ok()) << config.status().message();
  if (!config.ok()) return {};
  return PlanDegree(ResolvePlan(reg, *config, options), tp);
}

TEST(DegreeTest, SmolLM135MSplitsThreeWaysAndRefusesTwoNamingTheHeads) {
  DegreeAnswer a = Answer(kSmolLM135M);
  EXPECT_EQ(a.max_tp_degree, 3);
  EXPECT_EQ(a.degrees, (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(a.refusal);

  a = Answer(kSmolLM135M, 2);
  ASSERT_TRUE(a.refusal);
  EXPECT_EQ(a.refusal->reason, "degree_does_not_divide");
  EXPECT_NE(
      a.refusal->message.find(
          "layers.*.self_attn.q_proj (colwise) splits 9 attention heads; 2 does not divide 9"),
      std::string::npos)
      << a.refusal->message;
  EXPECT_EQ(a.chosen, 3);

  a = Answer(kSmolLM135M, 4);
  ASSERT_TRUE(a.refusal);
  EXPECT_FALSE(a.chosen);
  EXPECT_NE(a.refusal->message.find("pipeline or expert parallelism"), std::string::npos);
}

TEST(DegreeTest, MissingKeysTakeTheConfigClassDefaults) {
  // llama defaults: 32 heads, key/value heads = heads, intermediate 11008, vocab 32000.
  DegreeAnswer a = Answer(R"({"model_type": "llama"})");
  EXPECT_EQ(a.max_tp_degree, 32);  // gcd(32, 11008 = 2^8 * 43, 32000 = 2^8 * 125)
}

TEST(DegreeTest, TiedEmbeddingAndLmHeadOnlyFromTheirRelease) {
  // A vocabulary of 49155 (odd) only matters where the LM head counts it and its split must be
  // even: from 5.15 to 5.23 (5.24 splits it in ceil chunks).
  const char* config = R"({"model_type": "llama", "num_attention_heads": 8,
    "num_key_value_heads": 8, "intermediate_size": 64, "vocab_size": 49155,
    "tie_word_embeddings": true})";
  PlanOptions v520;
  v520.transformers_version = Version{5, 20, 0};
  EXPECT_EQ(Answer(config, std::nullopt, v520).max_tp_degree, 1);
  PlanOptions old;
  old.transformers_version = Version{5, 14, 0};
  EXPECT_EQ(Answer(config, std::nullopt, old).max_tp_degree, 8);
  EXPECT_EQ(Answer(config).max_tp_degree, 8);
}

const ResolvedEntry* FindEntry(const ModelPlan& plan, std::string_view pattern) {
  for (const ResolvedEntry& e : plan.entries) {
    if (e.pattern == pattern) return &e;
  }
  return nullptr;
}

ModelPlan PlanOf(std::string_view config_json, PlanOptions options = {}) {
  const TpRegistry& reg = BuiltinTpRegistry();
  Result<ModelConfig> config = ReadModelConfigJson(reg, config_json);
  EXPECT_TRUE(config.ok()) << config.status().message();
  return ResolvePlan(reg, *config, options);
}

TEST(DegreeTest, InputEmbeddingIsSplitOnTheVocabularyTiedOrNot) {
  // transformers 5.24 adds embed_tokens: embedding_rowwise to every base model holding an
  // embedding of that name, tied or not.
  const char* untied = R"({"model_type": "llama", "num_attention_heads": 8,
    "num_key_value_heads": 8, "intermediate_size": 64, "vocab_size": 36,
    "tie_word_embeddings": false})";
  const ModelPlan plan = PlanOf(untied);
  const ResolvedEntry* e = FindEntry(plan, "embed_tokens");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->style, "embedding_rowwise");
  EXPECT_EQ(e->count, 36);
  // Releases before it add the entry for tied embeddings only.
  PlanOptions v520;
  v520.transformers_version = Version{5, 20, 0};
  EXPECT_EQ(FindEntry(PlanOf(untied, v520), "embed_tokens"), nullptr);
  const char* tied = R"({"model_type": "llama", "num_attention_heads": 8,
    "num_key_value_heads": 8, "intermediate_size": 64, "vocab_size": 36,
    "tie_word_embeddings": true})";
  EXPECT_NE(FindEntry(PlanOf(tied, v520), "embed_tokens"), nullptr);
  // There the vocabulary binds: 36 caps the degree at 4.
  EXPECT_EQ(Answer(tied, std::nullopt, v520).max_tp_degree, 4);
}

TEST(DegreeTest, VocabularyAndMlpWidthsSplitUnevenlyOnlyHeadsBind) {
  // transformers 5.24 gives the last rank a shorter slice of the vocabulary (251 -> 126, 125)
  // and of the MLP (129 -> 65, 64), and its forward is exact; the heads must divide.
  const char* config = R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 129, "vocab_size": 251})";
  DegreeAnswer a = Answer(config, 2);
  EXPECT_FALSE(a.refusal) << a.refusal->message;
  EXPECT_EQ(a.max_tp_degree, 2);
  for (const ResolvedEntry& c : a.constraints)
    EXPECT_TRUE(c.meaning == "attention heads" || c.meaning == "key/value heads") << c.meaning;
  a = Answer(config, 4);
  ASSERT_TRUE(a.refusal);
  EXPECT_NE(a.refusal->message.find("splits 2 key/value heads; 4 does not divide 2"),
            std::string::npos);
}

TEST(DegreeTest, ModelWithoutAnEmbedTokensModuleGetsNoInputEmbeddingEntry) {
  // GPT-NeoX names its embedding embed_in: the entry would match nothing.
  const char* neox = R"({"model_type": "gpt_neox", "num_attention_heads": 8,
    "intermediate_size": 64, "vocab_size": 36, "hidden_size": 64})";
  for (const ResolvedEntry& e : Answer(neox).constraints) EXPECT_NE(e.pattern, "embed_tokens");
}

TEST(DegreeTest, NoPlanIsRefused) {
  DegreeAnswer a = Answer(R"({"model_type": "gpt2", "n_head": 12})");
  ASSERT_TRUE(a.refusal);
  EXPECT_EQ(a.refusal->reason, "no_tp_plan");
  EXPECT_NE(a.refusal->message.find("full copy of the model on every rank"), std::string::npos);
  EXPECT_FALSE(a.max_tp_degree);
}

TEST(DegreeTest, UnregisteredStyleFromAnOverrideIsRefused) {
  PlanOptions options;
  options.distributed.tp_plan = Plan{{"layers.*.mlp.up_proj", "local_colwise"}};
  DegreeAnswer a = Answer(kSmolLM135M, 3, options);
  ASSERT_TRUE(a.refusal);
  EXPECT_EQ(a.refusal->reason, "unregistered_style");
  EXPECT_NE(a.refusal->message.find("layers.*.mlp.up_proj (local_colwise)"), std::string::npos);
}

TEST(DegreeTest, VllmReplicatesKeyValueHeadsAboveTheirCountAndPadsTheVocabulary) {
  // 32 heads, 8 kv heads, vocab 32001 (padded to 32064 = 2^6 * 501).
  const char* config = R"({"model_type": "llama", "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32001})";
  PlanOptions vllm;
  vllm.engine = Engine::kVllm;
  DegreeAnswer a = Answer(config, 16, vllm);
  EXPECT_FALSE(a.refusal) << a.refusal->message;
  EXPECT_EQ(a.max_tp_degree, 32);
  EXPECT_EQ(a.degrees, (std::vector<int64_t>{1, 2, 4, 8, 16, 32}));
  EXPECT_TRUE(Answer(config, 16).refusal);  // transformers: 16 does not divide 8 kv heads
}

TEST(DegreeTest, VllmKeyValueRuleRefusesADegreeThatIsNeitherDivisorNorMultiple) {
  const char* config = R"({"model_type": "llama", "num_attention_heads": 24,
    "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 192})";
  PlanOptions vllm;
  vllm.engine = Engine::kVllm;
  DegreeAnswer a = Answer(config, 6, vllm);
  ASSERT_TRUE(a.refusal);
  EXPECT_NE(a.refusal->message.find("6 is neither"), std::string::npos) << a.refusal->message;
  EXPECT_EQ(a.degrees, (std::vector<int64_t>{1, 2, 4, 8, 12, 24}));
}

constexpr const char* kMixtral = R"({"model_type": "mixtral", "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
    "vocab_size": 32000})";

PlanOptions Distributed(std::string_view json) {
  PlanOptions options;
  Result<DistributedConfig> c = ParseDistributedConfigJson(BuiltinTpRegistry(), json);
  EXPECT_TRUE(c.ok()) << c.status().message();
  if (c.ok()) options.distributed = *c;
  return options;
}

TEST(DegreeTest, ExpertParallelUsesTheEpPlanCountingExperts) {
  EXPECT_EQ(Answer(kMixtral).max_tp_degree, 8);
  // EP over the TP ranks: the experts by the EP plan, attention by the TP plan.
  DegreeAnswer a = Answer(kMixtral, 8, Distributed(R"({"tp_plan": "auto", "ep_size": 8})"));
  ASSERT_FALSE(a.refusal) << a.refusal->message;
  bool saw_experts = false, saw_heads = false;
  for (const ResolvedEntry& e : a.constraints) {
    saw_experts |= e.style == "grouped_gemm" && e.meaning == "experts" && e.count == 8;
    saw_heads |= e.pattern == "layers.*.self_attn.k_proj" && e.count == 8;
    EXPECT_NE(e.style, "packed_colwise") << "EP rules replace the TP rules on the experts";
  }
  EXPECT_TRUE(saw_experts && saw_heads);
  EXPECT_EQ(a.max_tp_degree, 8);
}

TEST(DegreeTest, ExpertsMustDivideTheEpDegreeWithTransformersMessage) {
  const char* three = R"({"model_type": "qwen3_moe", "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_experts": 3, "vocab_size": 256})";
  EXPECT_FALSE(Answer(three, 2).refusal);  // TP splits every expert, whatever their count
  DegreeAnswer a = Answer(three, 2, Distributed(R"({"tp_plan": "auto", "ep_size": 2})"));
  ASSERT_TRUE(a.refusal);
  EXPECT_EQ(a.refusal->reason, "degree_does_not_divide");
  EXPECT_NE(a.refusal->message.find("Cannot evenly shard 3 experts across 2 expert-parallel "
                                    "ranks."),
            std::string::npos)
      << a.refusal->message;
}

TEST(DegreeTest, DistributedConfigsTransformersRefusesAreRefused) {
  struct Refused {
    const char* config;
    int64_t tp;
    const char* message;
  };
  const Refused cases[] = {
      // the deprecated flag sets tp_plan = {}, and tp_size > 1 then has no plan
      {R"({"tp_size": 8, "enable_expert_parallel": true})", 8,
       "`tp_size=8` was requested, but the model has no `tp_plan`"},
      {R"({"tp_size": 2, "ep_size": 2, "tp_plan": {}})", 2,
       "`tp_size=2` was requested, but the model has no `tp_plan`"},
      // neither tp_size nor tp_plan: transformers takes tp_size = 1
      {R"({"ep_size": 2})", 2, "`ep_size` must divide `fsdp_size * tp_size`."},
      {R"({"tp_size": 4, "ep_size": 2})", 4, "`ep_size` must be a multiple of `tp_size`."},
      {R"({"tp_size": 2, "ep_size": 4})", 2, "`ep_size` must divide `fsdp_size * tp_size`."},
  };
  for (const Refused& c : cases) {
    DegreeAnswer a = Answer(kMixtral, c.tp, Distributed(c.config));
    ASSERT_TRUE(a.refusal) << c.config;
    EXPECT_EQ(a.refusal->reason, "distributed_config") << c.config;
    EXPECT_NE(a.refusal->message.find(c.message), std::string::npos) << a.refusal->message;
  }
  // The flag with tp_plan "auto" keeps the TP plan: EP over the TP ranks.
  EXPECT_FALSE(
      Answer(kMixtral, 8, Distributed(R"({"tp_plan": "auto", "enable_expert_parallel": true})"))
          .refusal);
  EXPECT_FALSE(Answer(kMixtral, 2, Distributed(R"({"tp_size": 2, "ep_size": 2})")).refusal);
}

TEST(DegreeTest, ExpertParallelKeepsATpPlanThatSplitsOnlyExperts) {
  // AFMoE's TP plan names only its experts: at EP the EP rules take them, but transformers asks
  // for a TP plan before that, so the model still has one (the embedding and the LM head).
  const char* afmoe = R"({"model_type": "afmoe", "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_experts": 4, "vocab_size": 256})";
  DegreeAnswer a = Answer(afmoe, 2, Distributed(R"({"tp_plan": "auto", "ep_size": 2})"));
  EXPECT_FALSE(a.refusal) << a.refusal->message;
}

TEST(DegreeTest, SharedExpertWidthIsReadUnderEachConfigClassKey) {
  const TpRegistry& reg = BuiltinTpRegistry();
  auto shared_count = [&](std::string_view json) -> std::optional<int64_t> {
    Result<ModelConfig> config = ReadModelConfigJson(reg, json);
    EXPECT_TRUE(config.ok()) << config.status().message();
    if (!config.ok()) return std::nullopt;
    for (const ResolvedEntry& e : ResolvePlan(reg, *config, {}).entries)
      if (e.pattern == "layers.*.mlp.shared_experts.down_proj") return e.count;
    return std::nullopt;
  };
  // ERNIE 4.5 MoE: moe_intermediate_size x moe_num_shared_experts; HY-V3: x num_shared_experts.
  EXPECT_EQ(shared_count(R"({"model_type": "ernie4_5_moe", "intermediate_size": 128,
    "moe_intermediate_size": 32, "moe_num_shared_experts": 2})"),
            64);
  EXPECT_EQ(shared_count(R"({"model_type": "hy_v3", "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_shared_experts": 1})"),
            32);
  EXPECT_EQ(shared_count(R"({"model_type": "glm4_moe", "intermediate_size": 128,
    "moe_intermediate_size": 32, "n_shared_experts": 3})"),
            96);
}

TEST(DegreeTest, ExpertTensorParallelNeedsSixteenByteRowsForGroupedMm) {
  auto qwen = [](int intermediate, const char* dtype) {
    return fmt::format(R"({{"model_type": "qwen3_moe", "num_attention_heads": 64,
      "num_key_value_heads": 64, "head_dim": 16, "hidden_size": 1024, "intermediate_size": 4096,
      "moe_intermediate_size": {}, "num_experts": 64, "vocab_size": 256, "dtype": "{}"}})",
                       intermediate, dtype);
  };
  // 36 float32 columns: 18 per rank at tp 2 (72 bytes) fail in grouped_mm; whole experts at EP.
  DegreeAnswer a = Answer(qwen(36, "float32"), 2);
  ASSERT_TRUE(a.refusal);
  EXPECT_NE(a.refusal->message.find("strides should be multiple of 16 bytes"), std::string::npos)
      << a.refusal->message;
  EXPECT_FALSE(
      Answer(qwen(36, "float32"), 2, Distributed(R"({"tp_plan": "auto", "ep_size": 2})")).refusal);
  // 32 columns: float32 rows stay aligned down to 4 per rank, bfloat16 down to 8.
  EXPECT_FALSE(Answer(qwen(32, "float32"), 8).refusal);
  EXPECT_FALSE(Answer(qwen(32, "bfloat16"), 4).refusal);
  EXPECT_TRUE(Answer(qwen(32, "bfloat16"), 8).refusal);
  // An uneven split of the packed experts is refused too (33 = 17 + 16 columns).
  EXPECT_TRUE(Answer(qwen(33, "float32"), 2).refusal);
}

TEST(DegreeTest, CombinationsSayWhichTpAndEpDegreesWork) {
  const TpRegistry& reg = BuiltinTpRegistry();
  Result<ModelConfig> config = ReadModelConfigJson(reg, R"({"model_type": "qwen3_moe",
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048,
    "moe_intermediate_size": 768, "num_experts": 6, "vocab_size": 151936, "dtype": "bfloat16"})");
  ASSERT_TRUE(config.ok()) << config.status().message();
  const DegreeCombinations c = Combinations(reg, *config, PlanOptions{});
  EXPECT_EQ(c.tp, (std::vector<int64_t>{1, 2, 4}));
  ASSERT_TRUE(c.tp_ep);
  EXPECT_EQ(*c.tp_ep, (std::vector<int64_t>{1, 2}));  // 6 experts: ep 4 does not divide
  config = ReadModelConfigJson(reg, kMixtral);
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE(Combinations(reg, *config, PlanOptions{}).tp_ep);
  config = ReadModelConfigJson(reg, R"({"model_type": "llama", "num_attention_heads": 8,
    "num_key_value_heads": 8, "intermediate_size": 64, "vocab_size": 256})");
  ASSERT_TRUE(config.ok());
  EXPECT_FALSE(Combinations(reg, *config, PlanOptions{}).tp_ep);  // no expert-parallel plan
}

TEST(DegreeTest, KeysTheModelClassDoesNotDeclareAreIgnored) {
  // A stray key of config.json stays an attribute of the config, but Mixtral's experts are
  // intermediate_size wide whatever moe_intermediate_size says; Qwen2-MoE's are not. vLLM splits
  // the experts, so their width counts there.
  PlanOptions vllm;
  vllm.engine = Engine::kVllm;
  const char* mixtral = R"({"model_type": "mixtral", "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "moe_intermediate_size": 3,
    "num_local_experts": 8, "vocab_size": 32000})";
  EXPECT_EQ(Answer(mixtral, std::nullopt, vllm).max_tp_degree, 32);  // KV heads replicated
  const char* qwen2_moe = R"({"model_type": "qwen2_moe", "num_attention_heads": 16,
    "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 6,
    "shared_expert_intermediate_size": 5632, "num_experts": 8, "vocab_size": 151936})";
  EXPECT_EQ(Answer(qwen2_moe, std::nullopt, vllm).max_tp_degree, 2);
}

// gpt-oss-120b's shape: 64 heads, 8 key/value heads, 2880 expert features (90 MXFP4 groups).
constexpr const char* kGptOssMxfp4 = R"({"model_type": "gpt_oss", "num_attention_heads": 64,
  "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
  "num_local_experts": 128, "vocab_size": 201088,
  "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}})";

TEST(DegreeTest, VllmSplitsGptOssAttentionAndExpertsThatTransformersLeavesWhole) {
  PlanOptions vllm;
  vllm.engine = Engine::kVllm;
  DegreeAnswer a = Answer(kGptOssMxfp4, std::nullopt, vllm);
  EXPECT_EQ(a.degrees, (std::vector<int64_t>{1, 2, 4, 8}));  // no replication of 8 kv heads
  // 2880 = 2^6 x 45: tp 3 divides the experts but not the 64 heads; 16 has no key/value head.
  a = Answer(kGptOssMxfp4, 16, vllm);
  ASSERT_TRUE(a.refusal);
  EXPECT_NE(a.refusal->message.find("0 key/value heads a rank"), std::string::npos)
      << a.refusal->message;
  // transformers' plan splits only the embedding: no MXFP4 rule there.
  EXPECT_FALSE(Answer(kGptOssMxfp4, 8).vllm_mxfp4);
}

TEST(DegreeTest, VllmRefusesGptOssExpertsItsMlpBlockAssertsOn) {
  PlanOptions vllm;
  vllm.engine = Engine::kVllm;
  const char* odd = R"({"model_type": "gpt_oss", "num_attention_heads": 64,
    "num_key_value_heads": 64, "head_dim": 64, "hidden_size": 512, "intermediate_size": 96,
    "num_local_experts": 4, "vocab_size": 256, "quantization_config": {"quant_method": "mxfp4"}})";
  const DegreeAnswer a = Answer(odd, 64, vllm);  // 96 = 3 groups of 32; 64 divides the heads
  ASSERT_TRUE(a.refusal);
  EXPECT_NE(a.refusal->message.find("assert config.intermediate_size % self.world_size == 0"),
            std::string::npos)
      << a.refusal->message;
  EXPECT_EQ(a.chosen, std::nullopt);
}

TEST(DegreeTest, VllmMxfp4ExpertsPadWhereARankWouldHoldPartOfAGroup) {
  PlanOptions vllm;
  vllm.engine = Engine::kVllm;
  DegreeAnswer a = Answer(kGptOssMxfp4, 8, vllm);
  ASSERT_FALSE(a.refusal) << a.refusal->message;
  ASSERT_TRUE(a.vllm_mxfp4);
  EXPECT_EQ(a.vllm_mxfp4->whole_groups, (std::vector<int64_t>{1, 2}));  // divisors of 90
  EXPECT_EQ(a.vllm_mxfp4->padded, (std::vector<int64_t>{4, 8}));
  ASSERT_TRUE(a.vllm_mxfp4->requested);
  const VllmMxfp4Split& s = *a.vllm_mxfp4->requested;
  EXPECT_FALSE(s.whole_groups());
  EXPECT_EQ(s.rows_per_rank, 384);  // ceil(90 / 8) = 12 groups, not 360 = 11.25
  EXPECT_EQ(s.holding_ranks, 8);
  EXPECT_EQ(s.last_rows, 192);  // 2880 - 7 x 384
  EXPECT_EQ(s.ParameterRows(32), 384);
  EXPECT_EQ(s.ParameterRows(256), 512);
  ASSERT_EQ(a.notes.size(), 1u);
  EXPECT_NE(a.notes[0].find("ranks 0 to 6 take 384, rank 7 takes 192"), std::string::npos)
      << a.notes[0];
  // At tp 2 every rank holds 45 whole groups; only kernels aligned to 64 and more pad.
  a = Answer(kGptOssMxfp4, 2, vllm);
  ASSERT_TRUE(a.vllm_mxfp4 && a.vllm_mxfp4->requested);
  EXPECT_TRUE(a.vllm_mxfp4->requested->whole_groups());
  EXPECT_EQ(a.vllm_mxfp4->requested->ParameterRows(32), 1440);
  EXPECT_EQ(a.vllm_mxfp4->requested->ParameterRows(128), 1536);
  // Without MXFP4 there is nothing to pad.
  std::string bf16 = kGptOssMxfp4;
  bf16 = bf16.substr(0, bf16.find(",\n  \"quantization_config\"")) + "}";
  a = Answer(bf16, 8, vllm);
  EXPECT_FALSE(a.refusal);
  EXPECT_FALSE(a.vllm_mxfp4);
}

TEST(DegreeTest, VllmMxfp4SplitLeavesTrailingRanksEmpty) {
  // 2880 at tp 64: 45 features a rank nominally; vLLM's loader gives ranks 0 to 44 two groups
  // each and ranks 45 to 63 nothing.
  const VllmMxfp4Split s = VllmMxfp4SplitAt(2880, 64);
  EXPECT_EQ(s.rows_per_rank, 64);
  EXPECT_EQ(s.holding_ranks, 45);
  EXPECT_EQ(s.last_rows, 64);
  EXPECT_EQ(s.ParameterRows(32), 64);
  const std::optional<std::string> note = VllmMxfp4Note("experts", s);
  ASSERT_TRUE(note);
  EXPECT_NE(note->find("ranks 45 to 63 none"), std::string::npos) << *note;
  // Whole groups and 256-aligned ranks: no backend pads.
  EXPECT_FALSE(VllmMxfp4Note("experts", VllmMxfp4SplitAt(1024, 4)));
}

TEST(DegreeTest, CompositeModelUsesItsTextSubConfig) {
  const char* llama4 = R"({"model_type": "llama4", "text_config": {"model_type": "llama4_text",
    "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "vocab_size": 202048}})";
  DegreeAnswer a = Answer(llama4);
  EXPECT_EQ(a.max_tp_degree, 8);
  bool saw_heads = false;
  for (const ResolvedEntry& e : a.constraints)
    saw_heads |= e.pattern == "layers.*.self_attn.q_proj" && e.count == 40;
  EXPECT_TRUE(saw_heads);
}

TEST(DistributedConfigTest, UnknownKeysAreRefusedNotDropped) {
  const TpRegistry& reg = BuiltinTpRegistry();
  Result<DistributedConfig> c = ParseDistributedConfigJson(reg, R"({"tp_sise": 4})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("unknown key(s) \"tp_sise\""), std::string::npos);
  c = ParseDistributedConfigJson(reg, R"({"tp_size": 4, "enable_expert_parallel": true})");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->tp_size, 4);
  EXPECT_TRUE(c->expert_parallel());
  EXPECT_FALSE(ParseDistributedConfigJson(reg, R"({"tp_size": 0})").ok());
  EXPECT_FALSE(ParseDistributedConfigJson(reg, R"({"tp_plan": {"a": 3}})").ok());
}

TEST(VersionTest, ParsesReleasesAndDevSuffixes) {
  EXPECT_EQ(*ParseVersion("5.15"), (Version{5, 15, 0}));
  EXPECT_EQ(*ParseVersion("4.51.0.dev0"), (Version{4, 51, 0}));
  EXPECT_LT(*ParseVersion("5.14.9"), kHeadPlanVersion);
  EXPECT_FALSE(ParseVersion("five").ok());
}

TEST(DegreeTest, CountsWhoseWidthsLeaveInt64AreRefusedNamingTheFields) {
  // head_dim 2^61 x (4 + 2 x 4) heads, 2^62 key/value heads x 2, an MLP of 2^62 x 2 (gate and
  // up): each a width the planner forms, more than 2^62 elements.
  const std::string fp8 =
      R"("quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]})";
  for (const auto& [fields, named] : std::vector<std::pair<std::string, std::string>>{
           {R"("head_dim": 2305843009213693952, "num_key_value_heads": 4)", "head_dim"},
           {R"("head_dim": 64, "num_key_value_heads": 4611686018427387904)", "num_key_value_heads"},
           {R"("head_dim": 64, "num_key_value_heads": 4, "intermediate_size": 4611686018427387904)",
            "intermediate_size"}}) {
    const std::string json = fmt::format(
        R"({{"model_type": "qwen3", "hidden_size": 256, "num_attention_heads": 4,
            "intermediate_size": 512, "vocab_size": 512, {}, {}}})",
        fields, fp8);
    Result<ModelConfig> config = ReadModelConfigJson(BuiltinTpRegistry(), json);
    ASSERT_FALSE(config.ok()) << fields;
    EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(config.status().message().find(named), std::string::npos)
        << config.status().message();
  }
  // 2^60 x 4 heads fits: planned as before.
  Result<ModelConfig> fits = ReadModelConfigJson(
      BuiltinTpRegistry(), fmt::format(R"({{"model_type": "qwen3", "hidden_size": 256,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 1152921504606846976,
          "intermediate_size": 512, "vocab_size": 512, {}}})",
                                       fp8));
  ASSERT_TRUE(fits.ok()) << fits.status().message();
  EXPECT_FALSE(PlanDegree(ResolvePlan(BuiltinTpRegistry(), *fits, {}), 2).degrees.empty());
}

}  // namespace
}  // namespace reshard
