// Status and Result: error values for a library that does not throw.
//
// Codes follow abseil's meanings. The CLI maps them to exit statuses in one place
// (tools/reshard/exit_status.h), so a library function chooses a code by what went wrong,
// never by what the process should do about it.
#ifndef RESHARD_BASE_STATUS_H_
#define RESHARD_BASE_STATUS_H_

#include <string>
#include <string_view>
#include <utility>

namespace reshard {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // malformed input: a bad map, a bad config, a bad flag
  kNotFound,            // a named file, rank or parameter does not exist
  kAlreadyExists,       // an output exists and overwriting was not asked for
  kOutOfRange,          // an offset or index past an end
  kFailedPrecondition,  // well-formed input that does not fit: mismatched world sizes, a
                        // factor on an integer dtype, disagreeing replicas
  kDataLoss,            // a corrupt or truncated file
  kResourceExhausted,   // a limit was hit: memory, disk, a size cap
  kUnimplemented,       // a valid request this version does not support
  kInternal,            // a bug: an invariant the code relies on was broken
  kUnavailable,         // the environment failed: I/O error, disk full
};

std::string_view StatusCodeName(StatusCode code);

/// The outcome of an operation: ok, or a code with a message that carries the real values
/// and the path from outer to inner context (see `Annotate`).
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  /// Returns this status with `context` prepended as "context: message". Context is
  /// added by callers on the way out, so the final message reads outer to inner.
  Status Annotate(std::string_view context) const&;
  Status Annotate(std::string_view context) &&;

  /// "INVALID_ARGUMENT: message", or "OK".
  std::string ToString() const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgumentError(std::string m) {
  return Status(StatusCode::kInvalidArgument, std::move(m));
}
inline Status NotFoundError(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
inline Status AlreadyExistsError(std::string m) {
  return Status(StatusCode::kAlreadyExists, std::move(m));
}
inline Status OutOfRangeError(std::string m) {
  return Status(StatusCode::kOutOfRange, std::move(m));
}
inline Status FailedPreconditionError(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
inline Status DataLossError(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }
inline Status ResourceExhaustedError(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
inline Status UnimplementedError(std::string m) {
  return Status(StatusCode::kUnimplemented, std::move(m));
}
inline Status InternalError(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
inline Status UnavailableError(std::string m) {
  return Status(StatusCode::kUnavailable, std::move(m));
}

}  // namespace reshard

#define RESHARD_STATUS_CONCAT_INNER_(a, b) a##b
#define RESHARD_STATUS_CONCAT_(a, b) RESHARD_STATUS_CONCAT_INNER_(a, b)

/// Returns from the enclosing function if `expr` (a Status) is not ok.
#define RESHARD_RETURN_IF_ERROR(expr) \
  RESHARD_RETURN_IF_ERROR_IMPL_(RESHARD_STATUS_CONCAT_(reshard_status_, __COUNTER__), expr)
#define RESHARD_RETURN_IF_ERROR_IMPL_(name, expr) \
  do {                                            \
    ::reshard::Status name = (expr);              \
    if (!name.ok()) return name;                  \
  } while (0)

#endif  // RESHARD_BASE_STATUS_H_
