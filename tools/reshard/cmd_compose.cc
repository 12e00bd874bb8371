// reshard compose --from SRC_MAPS.json --to TGT_MAPS.json [-o PLAN.json] [--force] [--json]
#include <fmt/format.h>

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "exit_status.h"
#include "reshard/io/file.h"
#include "reshard/ir/compose.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/plan_json.h"

namespace reshard::cli {

namespace {

struct ComposeArgs {
  std::string from;
  std::string to;
  std::string output;
  bool force = false;
  bool json = false;
};

// Reads and validates a map document; on failure reports and returns the exit status.
int LoadDocument(const std::string& path, MapDocument& doc) {
  Result<std::string> text = ReadFileToString(path);
  if (!text.ok())
    return Report("compose", text.status(), ExitStatusFor(text.status(), Stage::kReading));
  Result<MapDocumentBuilder> parsed = ParseMapDocumentJson(*text);
  if (!parsed.ok()) {
    Status s = parsed.status().Annotate(fmt::format("error reading \"{}\"", path));
    return Report("compose", s, ExitStatusFor(s, Stage::kReading));
  }
  for (NamedMapBuilder& p : parsed->params) {
    Result<ParamMap> map = p.builder.Finalize();
    if (!map.ok()) {
      Status s = map.status().Annotate(fmt::format("\"{}\": parameter \"{}\"", path, p.name));
      return Report("compose", s, ExitStatusFor(s, Stage::kChecking));
    }
    doc.params.emplace_back(std::move(p.name), *std::move(map));
  }
  return kExitOk;
}

int RunCompose(const ComposeArgs& args) {
  MapDocument source, target;
  if (int s = LoadDocument(args.from, source); s != kExitOk) return s;
  if (int s = LoadDocument(args.to, target); s != kExitOk) return s;
  std::map<std::string, const ParamMap*> by_name;
  for (const auto& [name, map] : source.params) by_name[name] = &map;
  for (const auto& [name, map] : target.params) {
    if (!by_name.count(name)) {
      return Report("compose",
                    FailedPreconditionError(
                        fmt::format("parameter \"{}\" is in \"{}\" but not in \"{}\"; both map "
                                    "documents must describe the same parameters",
                                    name, args.to, args.from)),
                    kExitCheckFailed);
    }
  }
  if (source.params.size() != target.params.size()) {
    for (const auto& [name, map] : source.params) {
      bool found = false;
      for (const auto& t : target.params) found |= t.first == name;
      if (!found) {
        return Report(
            "compose",
            FailedPreconditionError(fmt::format("parameter \"{}\" is in \"{}\" but not in \"{}\"",
                                                name, args.from, args.to)),
            kExitCheckFailed);
      }
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  PlanDocument plans;
  for (const auto& [name, map] : target.params) {
    Result<ParamPlan> plan = Compose(map, *by_name[name]);
    if (!plan.ok()) {
      Status s = plan.status().Annotate(fmt::format("parameter \"{}\"", name));
      return Report("compose", s, ExitStatusFor(s, Stage::kChecking));
    }
    plans.params.emplace_back(name, *std::move(plan));
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const std::string json = PlanDocumentToJson(plans);
  if (!args.output.empty()) {
    Status s = WithForceHint(WriteFileAtomically(args.output, json, {.overwrite = args.force}),
                             args.force);
    if (!s.ok()) return Report("compose", s, ExitStatusFor(s, Stage::kReading));
  }
  size_t total_moves = 0;
  for (const auto& [name, plan] : plans.params) total_moves += plan.moves.size();
  if (args.json) {
    nlohmann::ordered_json params = nlohmann::ordered_json::array();
    for (const auto& [name, plan] : plans.params) {
      Index unwritten = 0;
      for (const UnwrittenBlock& u : plan.unwritten) unwritten += ProductOf(u.shape);
      params.push_back({{"name", name},
                        {"source_world", plan.source_world},
                        {"target_world", plan.target_world},
                        {"moves", plan.moves.size()},
                        {"moved_elements", plan.num_moved_elements()},
                        {"unwritten_elements", unwritten}});
    }
    nlohmann::ordered_json out = {{"num_params", plans.params.size()},
                                  {"total_moves", total_moves},
                                  {"plan_bytes", json.size()},
                                  {"planning_ms", ms},
                                  {"params", std::move(params)}};
    if (!args.output.empty()) out["plan"] = args.output;
    fmt::print("{}\n", out.dump(2));
  } else if (args.output.empty()) {
    fmt::print("{}", json);
  } else {
    fmt::print("{} parameters, {} moves, planned in {:.1f} ms; wrote {} ({} bytes)\n",
               plans.params.size(), total_moves, ms, args.output, json.size());
  }
  return kExitOk;
}

}  // namespace

void RegisterCompose(CLI::App& app, int& exit_status) {
  auto args = std::make_shared<ComposeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "compose",
      "Compose two map documents of the same parameters into a transfer plan: the moves that "
      "take shards laid out by --from to shards laid out by --to, without the full tensor. "
      "Prints the plan, or writes it with -o; --json prints a summary with move counts.");
  cmd->add_option("--from", args->from, "map document of the source topology")->required();
  cmd->add_option("--to", args->to, "map document of the target topology")->required();
  cmd->add_option("-o,--output", args->output, "write the plan here (atomically)");
  cmd->add_flag("--force", args->force, "replace an existing output");
  cmd->add_flag("--json", args->json, "print a machine-readable summary instead of the plan");
  cmd->callback([args, &exit_status] { exit_status = RunCompose(*args); });
}

}  // namespace reshard::cli
