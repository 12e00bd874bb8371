#include <fmt/format.h>

#include <charconv>
#include <cstdio>

#include "commands.h"
#include "exit_status.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/io/file.h"

namespace reshard::cli {

CLI::Validator IntegerIn(int64_t min, int64_t max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        int64_t value = 0;
        const char* end = text.data() + text.size();
        auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (ec != std::errc() || ptr != end || value < min || value > max) {
          return fmt::format("{} is not an integer from {} to {}", text, min, max);
        }
        return "";
      },
      fmt::format("INT in [{} - {}]", min, max));
}

CLI::Validator NotEmptyJson() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text.find_first_not_of(" \t\r\n") != std::string::npos) return "";
        return "is empty: give JSON text (an object) or a file holding it, or leave the option "
               "out";
      },
      "JSON");
}

Result<std::string> JsonTextOrFile(const std::string& option, const std::string& value) {
  const size_t first = value.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) {
    return InvalidArgumentError(fmt::format(
        "{} is empty: give JSON text (an object) or a file holding it, or leave the option out",
        option));
  }
  if (const char c = value[first]; c == '{' || c == '[' || c == '"') return value;
  Result<std::string> text = ReadFileToString(value);
  if (!text.ok()) return text.status().Annotate(option);
  return text;
}

Status WithForceHint(Status status, bool force) {
  if (force || status.code() != StatusCode::kAlreadyExists) return status;
  return Status(status.code(), status.message() + "; pass --force to replace it");
}

Status PrintOrWrite(const std::string& output, const std::string& text, bool force,
                    std::span<const std::string> inputs) {
  if (output.empty()) {
    fmt::print("{}", text);
    return Status::Ok();
  }
  return WriteOutputFile(output, text, force, inputs);
}

Status WriteOutputFile(const std::string& output, const std::string& text, bool force,
                       std::span<const std::string> inputs) {
  RESHARD_RETURN_IF_ERROR(WithForceHint(CheckOutputFile(output, force, inputs), force));
  return WithForceHint(WriteFileAtomically(output, text, {.overwrite = force}), force);
}

CLI::Option* AddOutputOptions(CLI::App* cmd, std::string& output, bool& force,
                              const std::string& what) {
  CLI::Option* o = cmd->add_option("-o,--output", output, what);
  cmd->add_flag("--force", force, "replace an existing output");
  return o;
}

void AddJsonFlag(CLI::App* cmd, bool& json, const std::string& what) {
  cmd->add_flag("--json", json, what);
}

}  // namespace reshard::cli
