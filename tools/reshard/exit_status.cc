#include "exit_status.h"

namespace reshard::cli {

int ExitStatusFor(const Status& status, Stage stage) {
  switch (status.code()) {
    case StatusCode::kOk:
      return kExitOk;
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kDataLoss:
      return stage == Stage::kReading ? kExitUsage : kExitCheckFailed;
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists:
    case StatusCode::kUnimplemented:
      return kExitUsage;
    case StatusCode::kFailedPrecondition:
      return kExitCheckFailed;
    case StatusCode::kResourceExhausted:
    case StatusCode::kInternal:
    case StatusCode::kUnavailable:
      return kExitInternal;
  }
  return kExitInternal;
}

}  // namespace reshard::cli
