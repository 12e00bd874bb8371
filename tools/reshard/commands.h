// The commands of the CLI: each is a name and help text in the table of commands.cc and a
// CommandBody from its cmd_*.cc, whose options fill an Args value and whose callback runs
// `Status RunX(const Args&)` and stores the exit status Finish gives.
#ifndef RESHARD_TOOLS_COMMANDS_H_
#define RESHARD_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "exit_status.h"
#include "reshard/base/result.h"
#include "reshard/base/status.h"

namespace reshard::cli {

/// The part of a command that its cmd_*.cc defines: the function that declares the options
/// filling its Args, and `Status run(const Args&)`. The name and help text of every command are
/// in one table (commands.cc), which also fixes the order `reshard --help` lists them in.
class CommandBody {
 public:
  template <typename Args>
  CommandBody(void (*add_options)(CLI::App* cmd, Args* args), Status (*run)(const Args&))
      : install_([add_options, run](CLI::App* cmd, int& exit_status) {
          auto args = std::make_shared<Args>();
          add_options(cmd, args.get());
          cmd->callback([cmd, args, run, &exit_status] {
            exit_status = Finish(cmd->get_name(), run(*args));
          });
        }) {}

  /// Declares the options on `cmd`; when `cmd` is chosen, `run` runs on the parsed Args and
  /// `exit_status` becomes Finish(cmd's name, its status).
  void Install(CLI::App* cmd, int& exit_status) const { install_(cmd, exit_status); }

 private:
  std::function<void(CLI::App*, int&)> install_;
};

CommandBody VerifyCommand();
CommandBody ShowCommand();
CommandBody InferCommand();
CommandBody LayoutCommand();
CommandBody ComposeCommand();
CommandBody SyncPlanCommand();
CommandBody ScatterCommand();
CommandBody GatherCommand();
CommandBody ConvertCommand();
CommandBody DiffCommand();
CommandBody MergeLoraCommand();
CommandBody DegreeCommand();
CommandBody InspectCommand();
CommandBody ExportCommand();
CommandBody DemoCommand();

/// Adds every command to `app` as a subcommand, with its name and help from the table.
void AddCommands(CLI::App& app, int& exit_status);

/// Prints `text` on stdout when `output` is empty, else writes it to `output` as
/// WriteOutputFile does.
Status PrintOrWrite(const std::string& output, const std::string& text, bool force,
                    std::span<const std::string> inputs);

/// Writes `text` to `output` atomically, where CheckOutputFile allows (with `force`, replacing
/// only a regular file that is none of `inputs`).
Status WriteOutputFile(const std::string& output, const std::string& text, bool force,
                       std::span<const std::string> inputs);

/// `-o,--output` (described by `what`) and `--force` (replace an existing output).
CLI::Option* AddOutputOptions(CLI::App* cmd, std::string& output, bool& force,
                              const std::string& what);

/// `--json`, described by `what`.
void AddJsonFlag(CLI::App* cmd, bool& json, const std::string& what);

/// A CLI11 check that the text is a decimal integer in [min, max], read without clamping or
/// wrapping (99999999999999999999 is refused, not taken as INT64_MAX).
CLI::Validator IntegerIn(int64_t min, int64_t max);

/// The JSON text an option takes inline or from a file (`option` names it in errors): `value`
/// itself when it reads as JSON text (its first non-blank character is "{", "[" or a quote),
/// else the contents of the file it names. An empty value is refused (InvalidArgument), never
/// taken as no option.
Result<std::string> JsonTextOrFile(const std::string& option, const std::string& value);
/// A CLI11 check for such an option: an empty (or blank) value is refused.
CLI::Validator NotEmptyJson();

/// `status` with the hint "; pass --force to replace it" when it says an output exists and
/// `force` was not given (the library names no flags).
Status WithForceHint(Status status, bool force);

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_COMMANDS_H_
