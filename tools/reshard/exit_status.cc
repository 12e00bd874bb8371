#include "exit_status.h"

#include <fmt/format.h>

#include <cstdio>
#include <utility>

#include "processes.h"

namespace reshard::cli {

int ExitStatusFor(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk:
      return kExitOk;
    case StatusCode::kFailedPrecondition:
      return kExitCheckFailed;
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kDataLoss:
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists:
    case StatusCode::kUnimplemented:
      return kExitUsage;
    case StatusCode::kResourceExhausted:
    case StatusCode::kInternal:
    case StatusCode::kUnavailable:
      return kExitInternal;
  }
  return kExitInternal;
}

Status CheckFailed(Status status) {
  if (status.ok()) return status;
  return Status(StatusCode::kFailedPrecondition, status.message());
}

Status AlreadyReportedCheckFailure() { return Status(StatusCode::kFailedPrecondition, ""); }

int Finish(std::string_view command, const Status& result) {
  const Status status = AsReportedHere(result);
  if (!status.ok() && !status.message().empty()) {
    fmt::print(stderr, "reshard {}: {}\n", command, status.message());
  }
  return ExitStatusFor(status);
}

}  // namespace reshard::cli
