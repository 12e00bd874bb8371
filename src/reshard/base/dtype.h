// The dtype table: one X-macro drives the enum, the safetensors names, the element sizes and
// kinds. Dtypes are serialised by name (as safetensors spells them), never by position.
#ifndef RESHARD_BASE_DTYPE_H_
#define RESHARD_BASE_DTYPE_H_

#include <cstddef>
#include <optional>
#include <string_view>

namespace reshard {

/// How values of a dtype behave under a scale factor.
enum class DTypeKind {
  kFloat,   // IEEE binary floats and bfloat16: a factor is applied in the dtype's arithmetic
  kFloat8,  // 8-bit floats: copied bit for bit; a factor other than 1 is refused
  kInt,     // signed and unsigned integers: factor refused
  kBool,    // factor refused
};

// X(enumerator, safetensors name, size in bytes, kind)
#define RESHARD_DTYPES(X)                      \
  X(kF64, "F64", 8, DTypeKind::kFloat)         \
  X(kF32, "F32", 4, DTypeKind::kFloat)         \
  X(kF16, "F16", 2, DTypeKind::kFloat)         \
  X(kBF16, "BF16", 2, DTypeKind::kFloat)       \
  X(kI64, "I64", 8, DTypeKind::kInt)           \
  X(kI32, "I32", 4, DTypeKind::kInt)           \
  X(kI16, "I16", 2, DTypeKind::kInt)           \
  X(kI8, "I8", 1, DTypeKind::kInt)             \
  X(kU64, "U64", 8, DTypeKind::kInt)           \
  X(kU32, "U32", 4, DTypeKind::kInt)           \
  X(kU16, "U16", 2, DTypeKind::kInt)           \
  X(kU8, "U8", 1, DTypeKind::kInt)             \
  X(kBool, "BOOL", 1, DTypeKind::kBool)        \
  X(kF8E4M3, "F8_E4M3", 1, DTypeKind::kFloat8) \
  X(kF8E5M2, "F8_E5M2", 1, DTypeKind::kFloat8)

enum class DType {
#define RESHARD_DTYPE_ENUM(e, name, size, kind) e,
  RESHARD_DTYPES(RESHARD_DTYPE_ENUM)
#undef RESHARD_DTYPE_ENUM
};

inline constexpr DType kAllDTypes[] = {
#define RESHARD_DTYPE_LIST(e, name, size, kind) DType::e,
    RESHARD_DTYPES(RESHARD_DTYPE_LIST)
#undef RESHARD_DTYPE_LIST
};

/// The safetensors name, e.g. "BF16".
std::string_view DTypeName(DType dtype);
/// Size of one element in bytes.
size_t DTypeSize(DType dtype);
DTypeKind DTypeKindOf(DType dtype);
/// The dtype with this exact (case-sensitive) safetensors name, or nullopt.
std::optional<DType> DTypeFromName(std::string_view name);

}  // namespace reshard

#endif  // RESHARD_BASE_DTYPE_H_
