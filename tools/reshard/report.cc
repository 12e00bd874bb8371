#include <fmt/format.h>

#include <charconv>
#include <cstdio>

#include "commands.h"
#include "exit_status.h"
#include "reshard/io/file.h"

namespace reshard::cli {

int Report(std::string_view command, const Status& status, int exit_status) {
  fmt::print(stderr, "reshard {}: {}\n", command, status.message());
  return exit_status;
}

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

Status WithForceHint(Status status, bool force) {
  if (force || status.code() != StatusCode::kAlreadyExists) return status;
  return Status(status.code(), status.message() + "; pass --force to replace it");
}

Status PrintOrWrite(const std::string& output, const std::string& text, bool force) {
  if (output.empty()) {
    fmt::print("{}", text);
    return Status::Ok();
  }
  return WithForceHint(WriteFileAtomically(output, text, {.overwrite = force}), force);
}

int EmitText(std::string_view command, const std::string& output, const std::string& text,
             bool force) {
  if (output.empty()) {
    fmt::print("{}", text);
    return kExitOk;
  }
  Status s = WithForceHint(WriteFileAtomically(output, text, {.overwrite = force}), force);
  if (!s.ok()) return Report(command, s, ExitStatusFor(s, Stage::kReading));
  return kExitOk;
}

}  // namespace reshard::cli
