#include "reshard/base/dtype.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

TEST(DTypeTest, NamesRoundTripAndSizesMatchSafetensors) {
  for (DType d : kAllDTypes) {
    auto back = DTypeFromName(DTypeName(d));
    ASSERT_TRUE(back.has_value()) << DTypeName(d);
    EXPECT_EQ(*back, d);
  }
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF64), 8u);
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(DTypeKindOf(DType::kBF16), DTypeKind::kFloat);
  EXPECT_EQ(DTypeKindOf(DType::kF8E5M2), DTypeKind::kFloat8);
  EXPECT_EQ(DTypeKindOf(DType::kBool), DTypeKind::kBool);
  EXPECT_EQ(DTypeKindOf(DType::kU16), DTypeKind::kInt);
}

TEST(DTypeTest, UnknownAndWrongCaseNamesAreRefused) {
  EXPECT_FALSE(DTypeFromName("bf16").has_value());
  EXPECT_FALSE(DTypeFromName("F8_E4M3FN").has_value());
  EXPECT_FALSE(DTypeFromName("").has_value());
}

}  // namespace
}  // namespace reshard
