// Each command registers itself on the app through AddCommand: its options fill an Args value,
// and its callback runs `Status RunX(const Args&)` and stores the exit status Finish gives.
#ifndef RESHARD_TOOLS_COMMANDS_H_
#define RESHARD_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "exit_status.h"
#include "reshard/base/status.h"

namespace reshard::cli {

void RegisterVerify(CLI::App& app, int& exit_status);
void RegisterShow(CLI::App& app, int& exit_status);
void RegisterDemo(CLI::App& app, int& exit_status);
void RegisterInfer(CLI::App& app, int& exit_status);
void RegisterLayout(CLI::App& app, int& exit_status);
void RegisterCompose(CLI::App& app, int& exit_status);
void RegisterCheckpointCommands(CLI::App& app, int& exit_status);
void RegisterDegree(CLI::App& app, int& exit_status);
void RegisterInspect(CLI::App& app, int& exit_status);
void RegisterExport(CLI::App& app, int& exit_status);

/// Prints `text` on stdout when `output` is empty, else writes it to `output` atomically
/// (replacing an existing file only with `force`).
Status PrintOrWrite(const std::string& output, const std::string& text, bool force);

/// Adds the subcommand `name` and returns it with the Args its options are to fill. When the
/// subcommand is chosen, `run(args)` runs and `exit_status` becomes Finish(name, its status).
template <typename Args>
std::pair<CLI::App*, std::shared_ptr<Args>> AddCommand(CLI::App& app, int& exit_status,
                                                       std::string name, std::string help,
                                                       Status (*run)(const Args&)) {
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(name, std::move(help));
  cmd->callback([args, run, name, &exit_status] { exit_status = Finish(name, run(*args)); });
  return {cmd, args};
}

/// `-o,--output` (described by `what`) and `--force` (replace an existing output).
CLI::Option* AddOutputOptions(CLI::App* cmd, std::string& output, bool& force,
                              const std::string& what);

/// `--json`, described by `what`.
void AddJsonFlag(CLI::App* cmd, bool& json, const std::string& what);

/// A CLI11 check that the text is a decimal integer in [min, max], read without clamping or
/// wrapping (99999999999999999999 is refused, not taken as INT64_MAX).
CLI::Validator IntegerIn(int64_t min, int64_t max);

/// `status` with the hint "; pass --force to replace it" when it says an output exists and
/// `force` was not given (the library names no flags).
Status WithForceHint(Status status, bool force);

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_COMMANDS_H_
