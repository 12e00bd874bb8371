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

#include "reshard/base/index.h"
#include "reshard/hf/degree.h"

namespace reshard {

namespace {

constexpr int64_t kMxfp4Group = 32;  // values a group of MXFP4 shares one E8M0 scale

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
      // model_config.cc refuses counts whose widths leave int64 (CheckDerivedWidths).
      const std::optional<Index> product = CheckedMul(*e.count, *head_dim);
      if (!product) continue;
      features = *product;
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
      // lcm(bn, bk), or a block no width here is a multiple of.
      if (experts) block = CheckedMul(bn / std::gcd(bn, bk), bk).value_or(kMaxIndex);
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

// vLLM 0.32's gpt-oss (models/gpt_oss.py): OAIAttention builds its Attention with
// num_key_value_heads // tp_size heads and splits qkv by num_key_value_heads * head_dim //
// tp_size, so a degree above the key/value heads leaves a rank none; MLPBlock starts with
// `assert config.intermediate_size % self.world_size == 0`.
void ApplyVllmGptOssRules(const ModelConfig& config, ModelPlan& plan) {
  for (ResolvedEntry& e : plan.entries) {
    if (!e.count) continue;
    const std::string_view last = LastPart(e.pattern);
    if (e.meaning == "key/value heads") {
      e.replicate_above = false;
      e.meaning =
          "key/value heads (vLLM's gpt-oss attention takes num_key_value_heads // tp a "
          "rank: no replication)";
    } else if (e.meaning == "expert intermediate features" &&
               (last == "gate_up_proj" || last == "down_proj")) {
      e.meaning =
          "expert intermediate features (vLLM's gpt-oss MLPBlock: assert "
          "config.intermediate_size % self.world_size == 0)";
      if (config.mxfp4) plan.vllm_mxfp4_intermediate = e.count;
    }
  }
}

int64_t VllmMxfp4Split::ParameterRows(int64_t alignment) const {
  const int64_t per_rank = intermediate / degree;
  return (per_rank + alignment - 1) / alignment * alignment;
}

VllmMxfp4Split VllmMxfp4SplitAt(int64_t intermediate, int64_t degree) {
  VllmMxfp4Split s;
  s.degree = degree;
  s.intermediate = intermediate;
  s.groups = intermediate / kMxfp4Group;
  s.rows_per_rank = (s.groups + degree - 1) / degree * kMxfp4Group;
  s.holding_ranks =
      s.rows_per_rank == 0 ? 0 : (intermediate + s.rows_per_rank - 1) / s.rows_per_rank;
  s.last_rows = intermediate - (s.holding_ranks - 1) * s.rows_per_rank;
  return s;
}

namespace {

// "ranks 0 to 6" / "rank 7".
std::string Ranks(int64_t first, int64_t last) {
  return first == last ? fmt::format("rank {}", first) : fmt::format("ranks {} to {}", first, last);
}

// A rank's parameter size under the alignments of vLLM 0.32's MXFP4 MoE backends
// (mxfp4_round_up_hidden_size_and_intermediate_size).
std::string BackendSizes(const VllmMxfp4Split& s) {
  return fmt::format(
      "{} features on vLLM's CPU backend (a multiple of 32), {} with Triton or on XPU (64), {} "
      "with Marlin, FlashInfer, CUTLASS or DeepGEMM (128), {} on ROCm's 256-aligned kernels",
      s.ParameterRows(32), s.ParameterRows(64), s.ParameterRows(128), s.ParameterRows(256));
}

}  // namespace

std::optional<std::string> VllmMxfp4Note(const std::string& module, const VllmMxfp4Split& s) {
  const int64_t per_rank = s.intermediate / s.degree;
  if (s.whole_groups()) {
    if (per_rank % 256 == 0) return std::nullopt;
    return fmt::format(
        "at tp {} each rank holds {} whole MXFP4 groups of 32 ({} of {} intermediate features "
        "of {}); vLLM sizes a rank's experts {}, zeros past {}",
        s.degree, s.groups / s.degree, per_rank, s.intermediate, module, BackendSizes(s), per_rank);
  }
  std::string held = fmt::format("{} {} {}", Ranks(0, s.holding_ranks - 2),
                                 s.holding_ranks == 2 ? "takes" : "take", s.rows_per_rank);
  if (s.holding_ranks == 1) held.clear();
  const std::string last =
      fmt::format("{} takes {}", Ranks(s.holding_ranks - 1, s.holding_ranks - 1), s.last_rows);
  const std::string none = s.holding_ranks < s.degree
                               ? fmt::format(" and {} none", Ranks(s.holding_ranks, s.degree - 1))
                               : std::string();
  return fmt::format(
      "at tp {} vLLM pads the MXFP4 experts of {}: {} intermediate features are {} groups of 32, "
      "{:.4g} a rank; vLLM's loader gives every rank ceil({} / {}) = {} groups ({} features) "
      "from the start, so {}{}{}{}, zeros after (a rank's gate_up_proj takes {} rows, gate and "
      "up interleaved, its down_proj {} columns, with their scales). A rank's experts hold {} / "
      "{} = {} features rounded up: {}",
      s.degree, module, s.intermediate, s.groups,
      static_cast<double>(s.groups) / static_cast<double>(s.degree), s.groups, s.degree,
      s.rows_per_rank / kMxfp4Group, s.rows_per_rank, held, held.empty() ? "" : ", ", last, none,
      fmt::format("2 x {}", s.rows_per_rank), s.rows_per_rank, s.intermediate, s.degree, per_rank,
      BackendSizes(s));
}

}  // namespace reshard
