// Each command registers itself on the app; its callback stores the exit status.
#ifndef RESHARD_TOOLS_COMMANDS_H_
#define RESHARD_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <string>
#include <string_view>

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

/// Prints `text` on stdout when `output` is empty, else writes it to `output` atomically
/// (replacing an existing file only with `force`); returns the exit status.
int EmitText(std::string_view command, const std::string& output, const std::string& text,
             bool force);

/// A CLI11 check that the text is a decimal integer in [min, max], read without clamping or
/// wrapping (99999999999999999999 is refused, not taken as INT64_MAX).
CLI::Validator IntegerIn(int64_t min, int64_t max);

/// `status` with the hint "; pass --force to replace it" when it says an output exists and
/// `force` was not given (the library names no flags).
Status WithForceHint(Status status, bool force);

/// Prints "reshard <command>: <message>" to stderr and returns `exit_status`.
int Report(std::string_view command, const Status& status, int exit_status);

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_COMMANDS_H_
