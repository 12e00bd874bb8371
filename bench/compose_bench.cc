// Planning speed (DESIGN 9): composing the maps of a Llama-3-70B-shaped model (80 layers,
// hidden 8192, 64 heads, 8 key/value heads, intermediate 28672, vocabulary 128256: 723
// tensors) from TP 8 to TP 2 and back must take well under 50 ms for the whole model; the
// routed experts of a DeepSeek-V3-shaped model (61 layers, the first 3 dense, 256 experts of
// intermediate 2048, hidden 7168: 58 x 256 x 3 = 44544 per-expert tensors, each stacked into
// its layer's gate_up_proj / down_proj buffer) EP 8 -> EP 16 and TP 8 -> TP 4 in under 1 s.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "reshard/ir/compose.h"
#include "reshard/ir/plan_json.h"
#include "reshard/layouts/basic.h"
#include "reshard/layouts/experts.h"

namespace reshard {
namespace {

using Clock = std::chrono::steady_clock;

// Command line: `--only TEXT` runs only the cases whose title contains TEXT; `--json-out PREFIX`
// writes each case's plan document to PREFIX<case>.json (to compare plans across versions).
const char* g_only = nullptr;
const char* g_json_out = nullptr;

bool Selected(const std::string& title) {
  return g_only == nullptr || title.find(g_only) != std::string::npos;
}

void DumpJson(const std::string& title, const std::string& json) {
  if (g_json_out == nullptr) return;
  std::string file = g_json_out;
  for (char c : title) file += (std::isalnum(static_cast<unsigned char>(c)) != 0) ? c : '_';
  file += ".json";
  std::FILE* f = std::fopen(file.c_str(), "wb");
  if (f == nullptr || std::fwrite(json.data(), 1, json.size(), f) != json.size() ||
      std::fclose(f) != 0) {
    fmt::print(stderr, "cannot write {}\n", file);
    std::exit(1);
  }
}

struct Tensor {
  std::string name;
  Shape shape;
  int split_dim;  // -1: replicated
};

std::vector<Tensor> Llama70B() {
  const Index hidden = 8192, kv = 8 * 128, inter = 28672, vocab = 128256;
  std::vector<Tensor> t;
  t.push_back({"model.embed_tokens.weight", {vocab, hidden}, 0});
  for (int l = 0; l < 80; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    t.push_back({p + "self_attn.q_proj.weight", {hidden, hidden}, 0});
    t.push_back({p + "self_attn.k_proj.weight", {kv, hidden}, 0});
    t.push_back({p + "self_attn.v_proj.weight", {kv, hidden}, 0});
    t.push_back({p + "self_attn.o_proj.weight", {hidden, hidden}, 1});
    t.push_back({p + "mlp.gate_proj.weight", {inter, hidden}, 0});
    t.push_back({p + "mlp.up_proj.weight", {inter, hidden}, 0});
    t.push_back({p + "mlp.down_proj.weight", {hidden, inter}, 1});
    t.push_back({p + "input_layernorm.weight", {hidden}, -1});
    t.push_back({p + "post_attention_layernorm.weight", {hidden}, -1});
  }
  t.push_back({"model.norm.weight", {hidden}, -1});
  t.push_back({"lm_head.weight", {vocab, hidden}, 0});
  return t;
}

std::vector<ParamMap> Maps(const std::vector<Tensor>& model, int tp) {
  std::vector<ParamMap> maps;
  for (const Tensor& t : model) {
    maps.push_back(t.split_dim < 0
                       ? *ReplicatedMap(t.shape, tp)
                       : *SplitMap(t.shape, t.split_dim,
                                   EvenSplitSizes(t.shape[static_cast<size_t>(t.split_dim)], tp)));
  }
  return maps;
}

void Bench(const std::vector<Tensor>& model, int from, int to) {
  const std::string title = fmt::format("Llama TP {} -> {}", from, to);
  if (!Selected(title)) return;
  const std::vector<ParamMap> src = Maps(model, from);
  const std::vector<ParamMap> dst = Maps(model, to);
  double best = 1e30;
  PlanDocument doc;
  for (int rep = 0; rep < 10; ++rep) {
    PlanDocument d;
    const auto t0 = Clock::now();
    for (size_t i = 0; i < model.size(); ++i) {
      Result<ParamPlan> plan = Compose(dst[i], src[i]);
      if (!plan.ok()) {
        fmt::print(stderr, "{}: {}\n", model[i].name, plan.status().message());
        std::exit(1);
      }
      d.params.emplace_back(model[i].name, *std::move(plan));
    }
    best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    doc = std::move(d);
  }
  size_t moves = 0;
  for (const auto& [name, plan] : doc.params) moves += plan.moves.size();
  const std::string json = PlanDocumentToJson(doc);
  DumpJson(title, json);
  fmt::print(
      "compose Llama-3-70B shape, {} tensors, TP {} -> {}: {:6.2f} ms (bar 50 ms: {}), {} "
      "moves, plan JSON {} bytes\n",
      model.size(), from, to, best, best < 50 ? "PASS" : "MISS", moves, json.size());
}

// The routed experts of DeepSeek-V3's MoE layers as transformers holds them: per layer,
// gate_up_proj [E_local, 2I/t, H] (gate rows then up rows) and down_proj [E_local, H, I/t], at
// EP `ep` (contiguous experts) x expert TP `tp`.
std::vector<std::pair<std::string, ParamMap>> DeepSeekV3Experts(int ep, int tp) {
  const int experts = 256, layers = 61, dense = 3;
  const Index hidden = 7168, inter = 2048;
  std::vector<std::pair<std::string, ParamMap>> maps;
  const ExpertPlacement placement = *ContiguousExperts(experts, ep);
  for (int l = dense; l < layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.mlp.experts.", l);
    const std::vector<ExpertMember> gate_up = {
        {p + "{e}.gate_proj.weight", {inter, hidden}, 0, 0, {}},
        {p + "{e}.up_proj.weight", {inter, hidden}, 0, 0, {}}};
    const std::vector<ExpertMember> down = {
        {p + "{e}.down_proj.weight", {hidden, inter}, 1, 0, {}}};
    for (auto [name, members] :
         {std::pair{p + "gate_up_proj", gate_up}, std::pair{p + "down_proj", down}}) {
      Result<StackedExpertMaps> s =
          BuildStackedExpertMaps(name, DType::kBF16, members, placement, RankOrder{ep, tp, true});
      if (!s.ok()) {
        fmt::print(stderr, "{}: {}\n", name, s.status().message());
        std::exit(1);
      }
      for (auto& m : s->maps) maps.push_back(std::move(m));
    }
  }
  return maps;
}

void BenchExperts(const char* what, int from_ep, int from_tp, int to_ep, int to_tp) {
  const std::string title = fmt::format("DeepSeek-V3 {}", what);
  if (!Selected(title)) return;
  const auto src = DeepSeekV3Experts(from_ep, from_tp);
  const auto dst = DeepSeekV3Experts(to_ep, to_tp);
  double best = 1e30;
  size_t moves = 0;
  PlanDocument doc;
  for (int rep = 0; rep < 3; ++rep) {
    moves = 0;
    PlanDocument d;
    const auto t0 = Clock::now();
    for (size_t i = 0; i < src.size(); ++i) {
      Result<ParamPlan> plan = Compose(dst[i].second, src[i].second);
      if (!plan.ok()) {
        fmt::print(stderr, "{}: {}\n", src[i].first, plan.status().message());
        std::exit(1);
      }
      moves += plan->moves.size();
      if (g_json_out != nullptr) d.params.emplace_back(src[i].first, *std::move(plan));
    }
    best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    doc = std::move(d);
  }
  if (g_json_out != nullptr) DumpJson(title, PlanDocumentToJson(doc));
  fmt::print(
      "compose DeepSeek-V3 routed experts, {} tensors, {}: {:7.1f} ms (bar 1000 ms: {}), "
      "{} moves\n",
      src.size(), what, best, best < 1000 ? "PASS" : "MISS", moves);
}

}  // namespace
}  // namespace reshard

int main(int argc, char** argv) {
  using namespace reshard;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--only") == 0) {
      g_only = argv[i + 1];
    } else if (std::strcmp(argv[i], "--json-out") == 0) {
      g_json_out = argv[i + 1];
    } else {
      fmt::print(stderr, "usage: {} [--only TEXT] [--json-out PREFIX]\n", argv[0]);
      return 2;
    }
  }
  if (argc % 2 == 0) {
    fmt::print(stderr, "usage: {} [--only TEXT] [--json-out PREFIX]\n", argv[0]);
    return 2;
  }
  const auto model = Llama70B();
  Bench(model, 8, 2);
  Bench(model, 2, 8);
  Bench(model, 8, 3);
  BenchExperts("EP 8 -> EP 16", 8, 1, 16, 1);
  BenchExperts("TP 8 -> TP 4", 1, 8, 1, 4);
  BenchExperts("EP 8 -> EP 4 x TP 2", 8, 1, 4, 2);
  return 0;
}
