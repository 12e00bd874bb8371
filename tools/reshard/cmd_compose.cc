// reshard compose --from SRC_MAPS.json --to TGT_MAPS.json [-o PLAN.json] [--force] [--json]
#include <fmt/format.h>

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "commands.h"
#include "documents.h"
#include "exit_status.h"
#include "reshard/io/file.h"
#include "reshard/ir/compose.h"
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

// FailedPrecondition naming the first parameter of `a` that `b` lacks.
Status CheckSameParameters(const MapDocument& a, const std::string& a_path, const MapDocument& b,
                           const std::string& b_path, std::string_view why) {
  std::set<std::string_view> in_b;
  for (const auto& [name, map] : b.params) in_b.insert(name);
  for (const auto& [name, map] : a.params) {
    if (!in_b.count(name)) {
      return FailedPreconditionError(fmt::format(
          "parameter \"{}\" is in \"{}\" but not in \"{}\"{}", name, a_path, b_path, why));
    }
  }
  return Status::Ok();
}

Status RunCompose(const ComposeArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(MapDocument source, ReadMapDocument(args.from));
  RESHARD_ASSIGN_OR_RETURN(MapDocument target, ReadMapDocument(args.to));
  RESHARD_RETURN_IF_ERROR(
      CheckSameParameters(target, args.to, source, args.from,
                          "; both map documents must describe the same parameters"));
  RESHARD_RETURN_IF_ERROR(CheckSameParameters(source, args.from, target, args.to, ""));
  std::map<std::string, const ParamMap*> by_name;
  for (const auto& [name, map] : source.params) by_name[name] = &map;
  const auto t0 = std::chrono::steady_clock::now();
  PlanDocument plans;
  for (const auto& [name, map] : target.params) {
    Result<ParamPlan> plan = Compose(map, *by_name[name]);
    if (!plan.ok()) {
      return CheckFailed(plan.status().Annotate(fmt::format("parameter \"{}\"", name)));
    }
    plans.params.emplace_back(name, *std::move(plan));
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const std::string json = PlanDocumentToJson(plans);
  if (!args.output.empty()) {
    const std::string inputs[] = {args.from, args.to};
    RESHARD_RETURN_IF_ERROR(WriteOutputFile(args.output, json, args.force, inputs));
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
  return Status::Ok();
}

void AddComposeOptions(CLI::App* cmd, ComposeArgs* args) {
  cmd->add_option("--from", args->from, "map document of the source topology")->required();
  cmd->add_option("--to", args->to, "map document of the target topology")->required();
  AddOutputOptions(cmd, args->output, args->force, "write the plan here (atomically)");
  AddJsonFlag(cmd, args->json, "print a machine-readable summary instead of the plan");
}

}  // namespace

CommandBody ComposeCommand() { return {AddComposeOptions, RunCompose}; }

}  // namespace reshard::cli
