#include "reshard/base/dtype.h"

namespace reshard {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
#define RESHARD_DTYPE_NAME(e, name, size, kind) \
  case DType::e:                                \
    return name;
    RESHARD_DTYPES(RESHARD_DTYPE_NAME)
#undef RESHARD_DTYPE_NAME
  }
  return "?";
}

// The X-macro's switches repeat a value for dtypes that share it (branch-clone), and its
// arguments are tokens of the table, not expressions (macro-parentheses).
// NOLINTBEGIN(bugprone-branch-clone,bugprone-macro-parentheses)
size_t DTypeSize(DType dtype) {
  switch (dtype) {
#define RESHARD_DTYPE_SIZE(e, name, size, kind) \
  case DType::e:                                \
    return size;
    RESHARD_DTYPES(RESHARD_DTYPE_SIZE)
#undef RESHARD_DTYPE_SIZE
  }
  return 0;
}

DTypeKind DTypeKindOf(DType dtype) {
  switch (dtype) {
#define RESHARD_DTYPE_KIND(e, name, size, kind) \
  case DType::e:                                \
    return kind;
    RESHARD_DTYPES(RESHARD_DTYPE_KIND)
#undef RESHARD_DTYPE_KIND
  }
  return DTypeKind::kInt;
}

std::optional<DType> DTypeFromName(std::string_view name) {
#define RESHARD_DTYPE_FROM(e, n, size, kind) \
  if (name == n) return DType::e;
  RESHARD_DTYPES(RESHARD_DTYPE_FROM)
#undef RESHARD_DTYPE_FROM
  return std::nullopt;
}
// NOLINTEND(bugprone-branch-clone,bugprone-macro-parentheses)

}  // namespace reshard
