#include <fmt/format.h>

#include <cstdio>

#include "commands.h"

namespace reshard::cli {

int Report(std::string_view command, const Status& status, int exit_status) {
  fmt::print(stderr, "reshard {}: {}\n", command, status.message());
  return exit_status;
}

}  // namespace reshard::cli
