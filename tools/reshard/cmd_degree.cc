// reshard degree CONFIG.json [--tp N] [--engine transformers|vllm] [--transformers-version V]
//                [--distributed-config JSON] [--json]
//                [--emit-maps MAPS.json --weights DIR [--force]]
#include <fmt/format.h>

#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "commands.h"
#include "exit_status.h"
#include "reshard/hf/degree.h"
#include "reshard/hf/model_maps.h"
#include "reshard/io/file.h"
#include "reshard/io/safetensors.h"
#include "reshard/ir/map_json.h"

namespace reshard::cli {

namespace {

constexpr int64_t kUnset = std::numeric_limits<int64_t>::min();

struct DegreeArgs {
  std::string config;
  int64_t tp = kUnset;
  std::string engine = "transformers";
  std::string transformers_version;
  std::string distributed_config;
  bool json = false;
  std::string emit_maps;
  std::string weights;
  bool force = false;
};

// Names and shapes of every tensor of a full checkpoint, from the safetensors headers only:
// model.safetensors, or model.safetensors.index.json and the files its weight_map names.
Result<std::vector<std::pair<std::string, Shape>>> CheckpointTensors(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(index.string()));
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return InvalidArgumentError(
          fmt::format("\"{}\": expected {{\"weight_map\": {{name: file}}}}", index.string()));
    }
    std::set<std::string> seen;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
        return InvalidArgumentError(
            fmt::format("\"{}\": weight_map[\"{}\"]: expected a file name in the same directory",
                        index.string(), name));
      }
      if (seen.insert(file.get<std::string>()).second) files.push_back(file.get<std::string>());
    }
  } else if (fs::exists(single, ec)) {
    files.push_back("model.safetensors");
  } else {
    return NotFoundError(
        fmt::format("\"{}\" has neither model.safetensors nor model.safetensors.index.json", dir));
  }
  std::vector<std::pair<std::string, Shape>> tensors;
  for (const std::string& file : files) {
    const std::string path = (fs::path(dir) / file).string();
    RESHARD_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(path));
    for (const TensorInfo& t : header.tensors) tensors.emplace_back(t.name, t.shape);
  }
  return tensors;
}

nlohmann::ordered_json AnswerJson(const DegreeAnswer& a) {
  using J = nlohmann::ordered_json;
  auto opt = [](const std::optional<int64_t>& v) { return v ? J(*v) : J(nullptr); };
  J constraints = J::array();
  for (const ResolvedEntry& e : a.constraints) {
    constraints.push_back(
        {{"module", e.pattern}, {"style", e.style}, {"count", *e.count}, {"meaning", e.meaning}});
  }
  J refusal = nullptr;
  if (a.refusal) refusal = {{"reason", a.refusal->reason}, {"message", a.refusal->message}};
  return {{"max_tp_degree", opt(a.max_tp_degree)},
          {"degrees", a.degrees},
          {"requested", opt(a.requested)},
          {"chosen", opt(a.chosen)},
          {"constraints", constraints},
          {"refusal", refusal}};
}

void PrintText(const DegreeArgs& args, const ModelConfig& config, const TpRegistry& registry,
               const DegreeAnswer& a) {
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
  if (a.requested) {
    if (a.refusal) {
      fmt::print("tp {}: refused{}\n", *a.requested,
                 a.chosen ? fmt::format("; use {}", *a.chosen) : "");
    } else {
      fmt::print("tp {}: works\n", *a.requested);
    }
  }
}

int RunDegree(const DegreeArgs& args) {
  const TpRegistry& registry = BuiltinTpRegistry();
  PlanOptions options;
  options.engine = args.engine == "vllm" ? Engine::kVllm : Engine::kTransformers;
  if (!args.transformers_version.empty()) {
    Result<Version> v = ParseVersion(args.transformers_version);
    if (!v.ok()) return Report("degree", v.status().Annotate("--transformers-version"), kExitUsage);
    options.transformers_version = *v;
  }
  if (!args.distributed_config.empty()) {
    std::string text = args.distributed_config;
    if (text.find('{') == std::string::npos) {  // a file holding the JSON
      Result<std::string> file = ReadFileToString(text);
      if (!file.ok()) return Report("degree", file.status(), kExitUsage);
      text = *file;
    }
    Result<DistributedConfig> dist = ParseDistributedConfigJson(registry, text);
    if (!dist.ok()) return Report("degree", dist.status(), kExitUsage);
    options.distributed = *dist;
  }
  std::optional<int64_t> requested;
  if (args.tp != kUnset) {
    if (args.tp < 1) {
      return Report(
          "degree",
          InvalidArgumentError(fmt::format("--tp {}: expected a positive degree", args.tp)),
          kExitUsage);
    }
    requested = args.tp;
  }
  if (options.distributed.tp_size) {
    if (requested && *requested != *options.distributed.tp_size) {
      return Report("degree",
                    InvalidArgumentError(fmt::format(
                        "--tp {} and the distributed config's tp_size {} disagree: give one",
                        *requested, *options.distributed.tp_size)),
                    kExitUsage);
    }
    requested = options.distributed.tp_size;
  }
  if (!args.emit_maps.empty() && (args.weights.empty() || !requested)) {
    return Report("degree",
                  InvalidArgumentError("--emit-maps needs --weights DIR and a degree (--tp N)"),
                  kExitUsage);
  }

  Result<std::string> text = ReadFileToString(args.config);
  if (!text.ok())
    return Report("degree", text.status(), ExitStatusFor(text.status(), Stage::kReading));
  Result<ModelConfig> config = ReadModelConfigJson(registry, *text);
  if (!config.ok()) {
    return Report("degree",
                  config.status().Annotate(fmt::format("error reading \"{}\"", args.config)),
                  kExitUsage);
  }
  const ModelPlan plan = ResolvePlan(registry, *config, options);
  const DegreeAnswer answer = PlanDegree(plan, requested);
  if (args.json) {
    fmt::print("{}\n", AnswerJson(answer).dump());
  } else {
    PrintText(args, *config, registry, answer);
  }
  for (const std::string& note : answer.notes)
    fmt::print(stderr, "reshard degree: note: {}\n", note);
  if (answer.refusal) {
    fmt::print(stderr, "reshard degree: \"{}\": {}\n", args.config, answer.refusal->message);
    return kExitCheckFailed;
  }
  if (args.emit_maps.empty()) return kExitOk;

  Result<std::vector<std::pair<std::string, Shape>>> tensors = CheckpointTensors(args.weights);
  if (!tensors.ok())
    return Report("degree", tensors.status(), ExitStatusFor(tensors.status(), Stage::kReading));
  Result<MapDocument> maps = ModelMaps(plan, static_cast<int>(*requested), *tensors);
  if (!maps.ok()) {
    Status s = maps.status().Annotate(fmt::format("\"{}\"", args.weights));
    return Report("degree", s, ExitStatusFor(s, Stage::kChecking));
  }
  Status s = WithForceHint(
      WriteFileAtomically(args.emit_maps, MapDocumentToJson(*maps), {.overwrite = args.force}),
      args.force);
  if (!s.ok()) return Report("degree", s, ExitStatusFor(s, Stage::kReading));
  return kExitOk;
}

}  // namespace

void RegisterDegree(CLI::App& app, int& exit_status) {
  auto args = std::make_shared<DegreeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "degree",
      "The largest tensor-parallel degree a model supports, from its config.json and "
      "transformers' plans (docs/degree.md). With --tp N, confirm N (exit 0) or refuse it "
      "naming the constraint that breaks (exit 1). Exit 1 also for a model that cannot be split.");
  cmd->add_option("CONFIG", args->config, "the model's config.json")->required();
  cmd->add_option("--tp", args->tp, "the degree you want to use");
  cmd->add_option("--engine", args->engine, "whose rules: transformers (default) or vllm")
      ->check(CLI::IsMember({"transformers", "vllm"}));
  cmd->add_option("--transformers-version", args->transformers_version,
                  "apply this release's rules (the LM head and tied-embedding entries from 5.15)");
  cmd->add_option("--distributed-config", args->distributed_config,
                  "transformers' DistributedConfig as JSON (inline or a file), e.g. "
                  "'{\"tp_size\": 4, \"enable_expert_parallel\": true}'");
  cmd->add_flag("--json", args->json, "print the answer as JSON");
  cmd->add_option("--emit-maps", args->emit_maps,
                  "write the param map of every tensor of --weights at degree --tp here");
  cmd->add_option("--weights", args->weights,
                  "checkpoint directory (model.safetensors or model.safetensors.index.json); only "
                  "the headers are read");
  cmd->add_flag("--force", args->force, "replace an existing --emit-maps file");
  cmd->callback([args, &exit_status] { exit_status = RunDegree(*args); });
}

}  // namespace reshard::cli
