// reshard degree CONFIG.json [--tp N] [--engine transformers|vllm] [--transformers-version V]
//                [--distributed-config JSON] [--json]
//                [--emit-maps MAPS.json --weights DIR [--force]]
#include <fmt/format.h>

#include <charconv>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "exit_status.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/hf/degree.h"
#include "reshard/hf/model_maps.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"

namespace reshard::cli {

namespace {

// The largest degree accepted: a world size (as scatter and convert take it).
constexpr int64_t kMaxDegree = int64_t{1} << 20;

struct DegreeArgs {
  std::string config;
  std::optional<std::string> tp;  // parsed strictly: CLI11 would clamp an out-of-range number
  std::string engine = "transformers";
  std::string transformers_version;
  std::string distributed_config;
  bool json = false;
  std::string emit_maps;
  std::string weights;
  bool force = false;
};

// A degree given on the command line: decimal digits only, 1 to kMaxDegree.
Result<int64_t> ParseDegree(std::string_view text) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end || value < 1 || value > kMaxDegree) {
    return InvalidArgumentError(
        fmt::format("--tp {}: expected a degree from 1 to {}", text, kMaxDegree));
  }
  return value;
}

// Names and shapes of every tensor of a full checkpoint, through the library's one reader of
// full checkpoints (headers validated, the index's weight map checked against the files).
Result<std::vector<std::pair<std::string, Shape>>> CheckpointTensors(const std::string& dir) {
  RESHARD_ASSIGN_OR_RETURN(FullCheckpoint checkpoint, FullCheckpoint::Open(dir));
  std::vector<std::pair<std::string, Shape>> tensors;
  for (const TensorRef& t : checkpoint.tensors()) tensors.emplace_back(t.info->name, t.info->shape);
  return tensors;
}

nlohmann::ordered_json AnswerJson(const DegreeAnswer& a, const DegreeCombinations& c) {
  using J = nlohmann::ordered_json;
  auto opt = [](const std::optional<int64_t>& v) { return v ? J(*v) : J(nullptr); };
  J constraints = J::array();
  for (const ResolvedEntry& e : a.constraints) {
    constraints.push_back(
        {{"module", e.pattern}, {"style", e.style}, {"count", *e.count}, {"meaning", e.meaning}});
  }
  J refusal = nullptr;
  if (a.refusal) refusal = {{"reason", a.refusal->reason}, {"message", a.refusal->message}};
  J mxfp4 = nullptr;
  if (a.vllm_mxfp4) {
    const VllmMxfp4Degrees& m = *a.vllm_mxfp4;
    J requested = nullptr;
    if (m.requested) {
      const VllmMxfp4Split& s = *m.requested;
      requested = {{"degree", s.degree},
                   {"whole_groups", s.whole_groups()},
                   {"features_per_rank", s.rows_per_rank},
                   {"holding_ranks", s.holding_ranks},
                   {"last_rank_features", s.last_rows},
                   {"parameter_features",
                    {{"cpu", s.ParameterRows(32)},
                     {"align_64", s.ParameterRows(64)},
                     {"align_128", s.ParameterRows(128)},
                     {"align_256", s.ParameterRows(256)}}}};
    }
    mxfp4 = {{"module", m.module},
             {"group", 32},
             {"whole_group_degrees", m.whole_groups},
             {"padded_degrees", m.padded},
             {"requested", requested}};
  }
  return {{"max_tp_degree", opt(a.max_tp_degree)},
          {"degrees", a.degrees},
          {"requested", opt(a.requested)},
          {"chosen", opt(a.chosen)},
          {"constraints", constraints},
          {"refusal", refusal},
          {"vllm_mxfp4", mxfp4},
          {"combinations", {{"tp", c.tp}, {"tp_ep", c.tp_ep ? J(*c.tp_ep) : J(nullptr)}}}};
}

std::string FormatDegrees(const std::vector<int64_t>& degrees) {
  return degrees.empty() ? std::string("none") : fmt::format("{}", fmt::join(degrees, ", "));
}

void PrintText(const DegreeArgs& args, const ModelConfig& config, const TpRegistry& registry,
               const DegreeAnswer& a, const DegreeCombinations& c) {
  fmt::print(
      "{}: model type {}{} ({} rules, plans from transformers {})\n", args.config,
      config.model_type,
      config.text_model_type.empty() ? "" : fmt::format(" (text: {})", config.text_model_type),
      args.engine == "vllm" ? "vLLM"
                            : fmt::format("transformers {}", args.transformers_version.empty()
                                                                 ? registry.transformers_version
                                                                 : args.transformers_version),
      registry.transformers_version);
  if (a.max_tp_degree) {
    fmt::print("largest tensor-parallel degree: {}\n", *a.max_tp_degree);
    fmt::print("working degrees: {}\n", fmt::join(a.degrees, ", "));
  } else {
    fmt::print("largest tensor-parallel degree: none (the model cannot be split)\n");
  }
  if (!a.constraints.empty()) fmt::print("constraints:\n");
  for (const ResolvedEntry& e : a.constraints)
    fmt::print("  {} ({}): {} {}\n", e.pattern, e.style, *e.count, e.meaning);
  if (a.vllm_mxfp4) {
    fmt::print("MXFP4 experts ({}, vLLM): whole groups of 32 a rank at {}; padded at {}\n",
               a.vllm_mxfp4->module, FormatDegrees(a.vllm_mxfp4->whole_groups),
               FormatDegrees(a.vllm_mxfp4->padded));
  }
  if (args.engine != "vllm") {
    fmt::print("combinations (N processes):\n  tp N: {}\n", fmt::join(c.tp, ", "));
    if (c.tp_ep) {
      fmt::print("  tp N x ep N (experts by expert, the rest by tp): {}\n",
                 fmt::join(*c.tp_ep, ", "));
    } else {
      fmt::print("  tp N x ep N: none (no expert-parallel plan)\n");
    }
  }
  if (a.requested) {
    if (a.refusal) {
      fmt::print("tp {}: refused{}\n", *a.requested,
                 a.chosen ? fmt::format("; use {}", *a.chosen) : "");
    } else {
      const bool padded =
          a.vllm_mxfp4 && a.vllm_mxfp4->requested && !a.vllm_mxfp4->requested->whole_groups();
      fmt::print("tp {}: works{}\n", *a.requested,
                 padded ? ", with the MXFP4 experts padded (see the note)" : "");
    }
  }
}

Result<PlanOptions> ReadPlanOptions(const DegreeArgs& args, const TpRegistry& registry) {
  PlanOptions options;
  options.engine = args.engine == "vllm" ? Engine::kVllm : Engine::kTransformers;
  if (!args.transformers_version.empty()) {
    Result<Version> v = ParseVersion(args.transformers_version);
    if (!v.ok()) return v.status().Annotate("--transformers-version");
    options.transformers_version = *v;
  }
  if (!args.distributed_config.empty()) {
    RESHARD_ASSIGN_OR_RETURN(const std::string text,
                             JsonTextOrFile("--distributed-config", args.distributed_config));
    RESHARD_ASSIGN_OR_RETURN(options.distributed, ParseDistributedConfigJson(registry, text));
  }
  return options;
}

// The degree asked for: --tp, or the distributed config's tp_size (they must agree).
Result<std::optional<int64_t>> DegreeAsked(const DegreeArgs& args, const PlanOptions& options) {
  std::optional<int64_t> tp;
  if (args.tp) {
    RESHARD_ASSIGN_OR_RETURN(tp, ParseDegree(*args.tp));
  }
  RESHARD_ASSIGN_OR_RETURN(const std::optional<int64_t> requested,
                           RequestedDegree(tp, options.distributed));
  if (!args.emit_maps.empty() && (args.weights.empty() || !requested))
    return InvalidArgumentError("--emit-maps needs --weights DIR and a degree (--tp N)");
  return requested;
}

Status EmitMaps(const DegreeArgs& args, const ModelPlan& plan, int64_t degree) {
  RESHARD_ASSIGN_OR_RETURN(auto tensors, CheckpointTensors(args.weights));
  Result<MapDocument> maps = ModelMaps(plan, static_cast<int>(degree), tensors);
  if (!maps.ok()) return maps.status().Annotate(fmt::format("\"{}\"", args.weights));
  const std::string inputs[] = {args.config, args.weights};
  return WriteOutputFile(args.emit_maps, MapDocumentToJson(*maps), args.force, inputs);
}

Status RunDegree(const DegreeArgs& args) {
  const TpRegistry& registry = BuiltinTpRegistry();
  RESHARD_ASSIGN_OR_RETURN(const PlanOptions options, ReadPlanOptions(args, registry));
  RESHARD_ASSIGN_OR_RETURN(const std::optional<int64_t> requested, DegreeAsked(args, options));
  RESHARD_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(args.config));
  Result<ModelConfig> config = ReadModelConfigJson(registry, text);
  if (!config.ok())
    return config.status().Annotate(fmt::format("error reading \"{}\"", args.config));
  const ModelPlan plan = ResolvePlan(registry, *config, options);
  const DegreeAnswer answer = PlanDegree(plan, requested);
  const DegreeCombinations combinations = Combinations(registry, *config, options);
  if (args.json) {
    fmt::print("{}\n", AnswerJson(answer, combinations).dump());
  } else {
    PrintText(args, *config, registry, answer, combinations);
  }
  for (const std::string& note : answer.notes)
    fmt::print(stderr, "reshard degree: note: {}\n", note);
  if (answer.refusal) {
    return CheckFailed(
        FailedPreconditionError(fmt::format("\"{}\": {}", args.config, answer.refusal->message)));
  }
  if (args.emit_maps.empty()) return Status::Ok();
  return EmitMaps(args, plan, *requested);
}

void AddDegreeOptions(CLI::App* cmd, DegreeArgs* args) {
  cmd->add_option("CONFIG", args->config, "the model's config.json")->required();
  cmd->add_option("--tp", args->tp, "the degree you want to use (1 to 1048576)");
  cmd->add_option("--engine", args->engine, "whose rules: transformers (default) or vllm")
      ->check(CLI::IsMember({"transformers", "vllm"}));
  cmd->add_option("--transformers-version", args->transformers_version,
                  "apply this release's rules (the LM head and tied-embedding entries from 5.15)");
  cmd->add_option("--distributed-config", args->distributed_config,
                  "transformers' DistributedConfig as JSON (inline or a file), e.g. "
                  "'{\"tp_plan\": \"auto\", \"ep_size\": 4}'")
      ->check(NotEmptyJson());
  AddJsonFlag(cmd, args->json, "print the answer as JSON");
  cmd->add_option("--emit-maps", args->emit_maps,
                  "write the param map of every tensor of --weights at degree --tp here");
  cmd->add_option("--weights", args->weights,
                  "checkpoint directory (model.safetensors or model.safetensors.index.json); only "
                  "the headers are read");
  cmd->add_flag("--force", args->force, "replace an existing --emit-maps file");
}

}  // namespace

CommandBody DegreeCommand() { return {AddDegreeOptions, RunDegree}; }

}  // namespace reshard::cli
