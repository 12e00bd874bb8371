// Result<T>: a value or the Status that explains why there is none.
#ifndef RESHARD_BASE_RESULT_H_
#define RESHARD_BASE_RESULT_H_

#include <cassert>
#include <optional>
#include <type_traits>
#include <utility>

#include "reshard/base/status.h"

namespace reshard {

template <typename T>
class [[nodiscard]] Result {
 public:
  // Implicit from a value and from a non-ok Status, so `return value;` and
  // `return InvalidArgumentError(...)` both read naturally.
  Result(T value) : value_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (status_.ok()) status_ = InternalError("Result constructed from an ok Status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T& value() & {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace reshard

/// `RESHARD_ASSIGN_OR_RETURN(auto x, Foo());` declares (or assigns) x from a Result,
/// returning the Status from the enclosing function when it is not ok.
#define RESHARD_ASSIGN_OR_RETURN(lhs, expr) \
  RESHARD_ASSIGN_OR_RETURN_IMPL_(RESHARD_STATUS_CONCAT_(reshard_result_, __LINE__), lhs, expr)
// `lhs` is a declaration and `tmp` a name: neither can be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define RESHARD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return std::move(tmp).status();       \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)

#endif  // RESHARD_BASE_RESULT_H_
