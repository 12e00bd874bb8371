#include "reshard/base/status.h"

namespace reshard {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
#define RESHARD_STATUS_NAME(e, name, constructor) \
  case StatusCode::e:                             \
    return name;
      RESHARD_STATUS_CODES(RESHARD_STATUS_NAME)
#undef RESHARD_STATUS_NAME
  }
  return "UNKNOWN";
}

Status Status::Annotate(std::string_view context) const& {
  Status copy = *this;
  return std::move(copy).Annotate(context);
}

Status Status::Annotate(std::string_view context) && {
  if (ok() || context.empty()) return std::move(*this);
  std::string joined(context);
  joined += ": ";
  joined += message_;
  message_ = std::move(joined);
  return std::move(*this);
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

}  // namespace reshard
