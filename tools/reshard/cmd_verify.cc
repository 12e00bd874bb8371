// reshard verify MAP.json [--json]
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "documents.h"
#include "exit_status.h"

namespace reshard::cli {

namespace {

struct VerifyArgs {
  std::string path;
  bool json = false;
};

std::string ParamLabel(const std::string& name) {
  return name.empty() ? std::string("the map") : fmt::format("parameter \"{}\"", name);
}

Status RunVerify(const VerifyArgs& args) {
  RESHARD_ASSIGN_OR_RETURN(ValidatedMapDocument doc, ReadValidatedMapDocument(args.path));
  // Every invalid parameter is reported; the exit status is the worst of them.
  Status worst;
  nlohmann::ordered_json params = nlohmann::ordered_json::array();
  for (const ValidatedParam& p : doc.params) {
    nlohmann::ordered_json entry = {{"name", p.name}, {"valid", p.map.ok()}};
    if (p.map.ok()) {
      entry["world_size"] = p.map->world_size();
      entry["pieces"] = p.map->num_pieces();
      if (!args.json) {
        fmt::print("ok       {}: {} ranks, {} pieces\n", ParamLabel(p.name), p.map->world_size(),
                   p.map->num_pieces());
      }
    } else {
      entry["error"] = p.map.status().message();
      if (!args.json) fmt::print("INVALID  {}\n", ParamLabel(p.name));
      const Status failed = p.status().Annotate(fmt::format("\"{}\"", args.path));
      fmt::print(stderr, "reshard verify: {}\n", failed.message());
      if (ExitStatusFor(failed) > ExitStatusFor(worst)) worst = failed;
    }
    params.push_back(std::move(entry));
  }
  const size_t invalid = doc.num_invalid();
  // Buffers (a version-2 document) are checked with every map over them, once all are valid.
  nlohmann::ordered_json buffers = nlohmann::ordered_json::object();
  if (invalid == 0 && doc.buffers.ok()) {
    for (const BufferDecl& b : doc.buffers->buffers()) buffers[b.name] = {{"valid", true}};
    if (!args.json && !doc.buffers->empty()) {
      fmt::print("ok       {} buffer(s): every element written by exactly one piece or padding\n",
                 doc.buffers->buffers().size());
    }
  } else if (invalid == 0) {
    const Status failed = doc.status().Annotate(fmt::format("\"{}\"", args.path));
    if (!args.json) fmt::print("INVALID  buffers\n");
    fmt::print(stderr, "reshard verify: {}\n", failed.message());
    if (ExitStatusFor(failed) > ExitStatusFor(worst)) worst = failed;
  }
  const bool buffers_valid = invalid > 0 || doc.buffers.ok();
  if (args.json) {
    nlohmann::ordered_json out = {{"file", args.path},
                                  {"valid", invalid == 0 && buffers_valid},
                                  {"num_params", doc.params.size()},
                                  {"num_invalid", invalid},
                                  {"params", std::move(params)}};
    if (!buffers_valid) out["buffers_error"] = doc.buffers.status().message();
    if (!buffers.empty()) out["buffers"] = std::move(buffers);
    fmt::print("{}\n", out.dump(2));
  } else {
    fmt::print("{} of {} parameter(s) valid\n", doc.params.size() - invalid, doc.params.size());
  }
  // Already reported above: the code alone.
  return worst.ok() ? worst : Status(worst.code(), "");
}

void AddVerifyOptions(CLI::App* cmd, VerifyArgs* args) {
  cmd->add_option("MAP", args->path, "param map or map document (JSON)")->required();
  AddJsonFlag(cmd, args->json, "print a machine-readable report on stdout");
}

}  // namespace

CommandBody VerifyCommand() { return {AddVerifyOptions, RunVerify}; }

}  // namespace reshard::cli
