// The degree planner's block rules (DESIGN 20, docs/quantization.md): a block-quantized weight
// split by the plan must keep its blocks whole where the engine needs it to.
//
// transformers splits a weight's scales by the same plan entry as the weight: a rank whose rows
// are part of a block gets no scale row for it (its TP load fails in Fp8Dequantize), so every
// split weight needs whole blocks on every rank. vLLM checks each linear layer when it creates
// its weights (validate_fp8_block_shape): a column-parallel layer's rows per rank and a
// row-parallel layer's columns per rank must be whole blocks; a merged layer (qkv_proj,
// gate_up_proj) is let through when a part is not, and its parts then share scale rows (V's
// rows read K's scale): reshard counts that a break too, for every part but the last (v, up).
// Fused MoE experts need the per-rank intermediate size to be whole blocks of both dimensions.
#include "reshard/hf/degree_blocks.h"

#include <fmt/format.h>

#include <numeric>
#include <string>
#include <vector>

#include "reshard/hf/degree.h"

namespace reshard {

namespace {

std::string_view LastPart(std::string_view pattern) {
  const size_t dot = pattern.rfind('.');
  return dot == std::string_view::npos ? pattern : pattern.substr(dot + 1);
}

}  // namespace

void AddBlockEntries(const ModelConfig& config, ModelPlan& plan) {
  if (config.fp8_block.size() != 2) return;
  const int64_t bn = config.fp8_block[0], bk = config.fp8_block[1];
  const auto value = [&](std::string_view key) { return ConfigValue(config.values, key); };
  std::optional<int64_t> head_dim = value("head_dim");
  const std::optional<int64_t> heads = value("num_attention_heads");
  if (!head_dim && heads && *heads > 0 && value("hidden_size"))
    head_dim = *value("hidden_size") / *heads;
  const bool mla = value("kv_lora_rank").has_value();
  const bool vllm = plan.engine == Engine::kVllm;
  std::vector<ResolvedEntry> added;
  for (const ResolvedEntry& e : plan.entries) {
    if (!e.count) continue;
    const bool rows = e.effect == StyleEffect::kSplitOut || e.effect == StyleEffect::kPackedOut;
    const bool cols = e.effect == StyleEffect::kSplitIn || e.effect == StyleEffect::kPackedIn;
    if (!rows && !cols) continue;
    int64_t features = 0;
    std::string what;
    if (e.meaning == "attention heads" || e.meaning == "key/value heads") {
      if (mla || !head_dim) continue;
      features = *e.count * *head_dim;
      what = fmt::format("{} x {} {}", *e.count, *head_dim, e.meaning);
    } else if (e.meaning.find("expert intermediate features") != std::string::npos) {
      // Counted in 16-byte groups for grouped_mm under transformers: the width itself here.
      std::optional<int64_t> width =
          e.meaning.starts_with("shared") ? std::nullopt : value("moe_intermediate_size");
      features = width ? *width : *e.count;
      what = fmt::format("{} {}", features,
                         e.meaning.starts_with("shared")
                             ? e.meaning
                             : std::string("expert intermediate features"));
    } else if (e.meaning.ends_with("intermediate features")) {
      features = *e.count;
      what = fmt::format("{} {}", features, e.meaning);
    } else {
      continue;
    }
    const std::string_view last = LastPart(e.pattern);
    const bool experts = e.meaning.starts_with("expert");
    int64_t block = rows ? bn : bk;
    std::string why;
    if (vllm) {
      // The last part of a merged layer may end in a partial block.
      if (rows && (last == "v_proj" || last == "up_proj") && !experts) continue;
      // Replicated key/value heads hold head_dim rows each: whole blocks when it is a multiple.
      if (e.replicate_above && *head_dim % bn == 0) continue;
      if (experts) block = std::lcm(bn, bk);
      why = experts ? "vLLM's fused experts (validate_fp8_block_shape_moe)"
            : rows  ? "vLLM's validate_fp8_block_shape, block_n"
                    : "vLLM's validate_fp8_block_shape, block_k";
    } else {
      why = "transformers gives a rank holding part of a block no scale";
    }
    ResolvedEntry b = e;
    b.count = features % block == 0 ? features / block : 1;
    b.uneven = false;
    b.replicate_above = false;
    b.meaning =
        fmt::format("FP8 blocks of {} {} ({}; {})", block, rows ? "rows" : "columns", what, why);
    added.push_back(std::move(b));
  }
  plan.entries.insert(plan.entries.end(), added.begin(), added.end());
}

}  // namespace reshard
