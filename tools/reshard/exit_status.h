// The one place where library statuses become process exit statuses (DESIGN.md 7):
//   0 success; 1 well-formed input that fails a check; 2 usage error or malformed /
//   unreadable input; 3 internal error or a failure of the environment.
//
// Each command's Run function returns a Status; `Finish` prints its message and maps its code
// to the exit status. The mapping reads the code alone:
//   FailedPrecondition                                   -> 1
//   InvalidArgument, OutOfRange, DataLoss, NotFound,
//   AlreadyExists, Unimplemented                         -> 2
//   ResourceExhausted, Internal, Unavailable             -> 3
// A library reports a broken invariant of a map as InvalidArgument (it cannot know whether the
// map was meant to be checked); a command that has read its input and then checks it wraps the
// failure with `CheckFailed`, which keeps the message and makes it exit 1.
#ifndef RESHARD_TOOLS_EXIT_STATUS_H_
#define RESHARD_TOOLS_EXIT_STATUS_H_

#include <string_view>

#include "reshard/base/status.h"

namespace reshard::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitInternal = 3;

/// The exit status for `status`, from its code alone (table above).
int ExitStatusFor(const Status& status);

/// `status` as the failure of a check on well-formed input (exit 1), message unchanged; ok
/// stays ok.
Status CheckFailed(Status status);

/// A failure the command has already reported on stdout (e.g. `degree` printing why a model
/// cannot be split): exit 1 with nothing more on stderr.
Status AlreadyReportedCheckFailure();

/// Prints "reshard <command>: <message>" to stderr unless `status` is ok or its message is
/// empty, and returns ExitStatusFor(status).
int Finish(std::string_view command, const Status& status);

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_EXIT_STATUS_H_
