// reshard verify MAP.json [--json]
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "exit_status.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"

namespace reshard::cli {

namespace {

struct VerifyArgs {
  std::string path;
  bool json = false;
};

std::string ParamLabel(const std::string& name) {
  return name.empty() ? std::string("the map") : fmt::format("parameter \"{}\"", name);
}

int RunVerify(const VerifyArgs& args) {
  Result<std::string> text = ReadFileToString(args.path);
  if (!text.ok())
    return Report("verify", text.status(), ExitStatusFor(text.status(), Stage::kReading));
  Result<MapDocumentBuilder> doc = ParseMapDocumentJson(*text);
  if (!doc.ok()) {
    Status s = doc.status().Annotate(fmt::format("error reading \"{}\"", args.path));
    return Report("verify", s, ExitStatusFor(s, Stage::kReading));
  }
  int status = kExitOk;
  size_t invalid = 0;
  nlohmann::ordered_json params = nlohmann::ordered_json::array();
  for (const NamedMapBuilder& p : doc->params) {
    Result<ParamMap> map = p.builder.Finalize();
    nlohmann::ordered_json entry = {{"name", p.name}, {"valid", map.ok()}};
    if (map.ok()) {
      entry["world_size"] = map->world_size();
      entry["pieces"] = map->num_pieces();
      if (!args.json) {
        fmt::print("ok       {}: {} ranks, {} pieces\n", ParamLabel(p.name), map->world_size(),
                   map->num_pieces());
      }
    } else {
      ++invalid;
      const int code = ExitStatusFor(map.status(), Stage::kChecking);
      status = std::max(status, code);
      entry["error"] = map.status().message();
      if (!args.json) fmt::print("INVALID  {}\n", ParamLabel(p.name));
      Report("verify",
             map.status().Annotate(fmt::format("\"{}\": {}", args.path, ParamLabel(p.name))), code);
    }
    params.push_back(std::move(entry));
  }
  if (args.json) {
    nlohmann::ordered_json out = {{"file", args.path},
                                  {"valid", invalid == 0},
                                  {"num_params", doc->params.size()},
                                  {"num_invalid", invalid},
                                  {"params", std::move(params)}};
    fmt::print("{}\n", out.dump(2));
  } else {
    fmt::print("{} of {} parameter(s) valid\n", doc->params.size() - invalid, doc->params.size());
  }
  return status;
}

}  // namespace

void RegisterVerify(CLI::App& app, int& exit_status) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify",
      "Validate a param map or map document: bounds, exact shards, coverage, homogeneity.\n"
      "Exit 0 when every parameter is valid, 1 naming the first violation per parameter, 2 "
      "when the file is unreadable or malformed.");
  cmd->add_option("MAP", args->path, "param map or map document (JSON)")->required();
  cmd->add_flag("--json", args->json, "print a machine-readable report on stdout");
  cmd->callback([args, &exit_status] { exit_status = RunVerify(*args); });
}

}  // namespace reshard::cli
