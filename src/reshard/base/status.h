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

// The status codes: one X-macro drives the enum, the names and the constructors below.
// X(enumerator, name as ToString prints it, constructor), with abseil's meanings:
//   kInvalidArgument     malformed input: a bad map, a bad config, a bad flag
//   kNotFound            a named file, rank or parameter does not exist
//   kAlreadyExists       an output exists and overwriting was not asked for
//   kOutOfRange          an offset or index past an end
//   kFailedPrecondition  well-formed input that does not fit: mismatched world sizes, a factor
//                        on an integer dtype, disagreeing replicas
//   kDataLoss            a corrupt or truncated file
//   kResourceExhausted   a limit was hit: memory, disk, a size cap
//   kUnimplemented       a valid request this version does not support
//   kInternal            a bug: an invariant the code relies on was broken
//   kUnavailable         the environment failed: I/O error, disk full
#define RESHARD_STATUS_CODES(X)                                          \
  X(kInvalidArgument, "INVALID_ARGUMENT", InvalidArgumentError)          \
  X(kNotFound, "NOT_FOUND", NotFoundError)                               \
  X(kAlreadyExists, "ALREADY_EXISTS", AlreadyExistsError)                \
  X(kOutOfRange, "OUT_OF_RANGE", OutOfRangeError)                        \
  X(kFailedPrecondition, "FAILED_PRECONDITION", FailedPreconditionError) \
  X(kDataLoss, "DATA_LOSS", DataLossError)                               \
  X(kResourceExhausted, "RESOURCE_EXHAUSTED", ResourceExhaustedError)    \
  X(kUnimplemented, "UNIMPLEMENTED", UnimplementedError)                 \
  X(kInternal, "INTERNAL", InternalError)                                \
  X(kUnavailable, "UNAVAILABLE", UnavailableError)

enum class StatusCode {
  kOk = 0,
#define RESHARD_STATUS_ENUM(e, name, constructor) e,
  RESHARD_STATUS_CODES(RESHARD_STATUS_ENUM)
#undef RESHARD_STATUS_ENUM
};

/// "OK", "INVALID_ARGUMENT", ... (the table above).
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

/// InvalidArgumentError(message), NotFoundError(message), ...: a Status with the code of that
/// row of the table.
#define RESHARD_STATUS_CONSTRUCTOR(e, name, constructor) \
  inline Status constructor(std::string message) {       \
    return Status(StatusCode::e, std::move(message));    \
  }
RESHARD_STATUS_CODES(RESHARD_STATUS_CONSTRUCTOR)
#undef RESHARD_STATUS_CONSTRUCTOR

}  // namespace reshard

#define RESHARD_STATUS_CONCAT_INNER_(a, b) a##b
#define RESHARD_STATUS_CONCAT_(a, b) RESHARD_STATUS_CONCAT_INNER_(a, b)

/// Returns from the enclosing function if `expr` (a Status) is not ok.
#define RESHARD_RETURN_IF_ERROR(expr) \
  RESHARD_RETURN_IF_ERROR_IMPL_(RESHARD_STATUS_CONCAT_(reshard_status_, __COUNTER__), expr)
// `name` is a variable's name: it cannot be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define RESHARD_RETURN_IF_ERROR_IMPL_(name, expr) \
  do {                                            \
    ::reshard::Status name = (expr);              \
    if (!name.ok()) return name;                  \
  } while (0)
// NOLINTEND(bugprone-macro-parentheses)

#endif  // RESHARD_BASE_STATUS_H_
