// The one place where library statuses become process exit statuses (DESIGN.md 7):
//   0 success; 1 well-formed input that fails a check; 2 usage error or malformed /
//   unreadable input; 3 internal error or a failure of the environment.
#ifndef RESHARD_TOOLS_EXIT_STATUS_H_
#define RESHARD_TOOLS_EXIT_STATUS_H_

#include "reshard/base/status.h"

namespace reshard::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitInternal = 3;

/// Whether the failing input had already been read and found well-formed. A map that parses
/// but breaks an invariant is a failed check (1); the same code while reading is malformed
/// input (2).
enum class Stage { kReading, kChecking };

int ExitStatusFor(const Status& status, Stage stage);

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_EXIT_STATUS_H_
