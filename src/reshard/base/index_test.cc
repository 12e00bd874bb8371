#include "reshard/base/index.h"

#include <gtest/gtest.h>

#include <limits>

namespace reshard {
namespace {

TEST(IndexTest, CheckedArithmeticRefusesPastTwoToTheSixtyTwo) {
  EXPECT_EQ(CheckedMul(Index{1} << 31, Index{1} << 31), Index{1} << 62);
  EXPECT_FALSE(CheckedMul(Index{1} << 31, (Index{1} << 31) + 1).has_value());
  EXPECT_FALSE(CheckedMul(std::numeric_limits<Index>::max(), 2).has_value());
  EXPECT_EQ(CheckedAdd(kMaxIndex - 1, 1), kMaxIndex);
  EXPECT_FALSE(CheckedAdd(kMaxIndex, 1).has_value());
  EXPECT_FALSE(CheckedAdd(std::numeric_limits<Index>::max(), 1).has_value());
}

TEST(IndexTest, CheckedProductNamesTheNegativeDimension) {
  EXPECT_EQ(*CheckedProduct(Shape{3, 4, 5}), 60);
  EXPECT_EQ(*CheckedProduct(Shape{}), 1);
  EXPECT_EQ(*CheckedProduct(Shape{0, Index{1} << 62, 7}), 0);
  Result<Index> negative = CheckedProduct(Shape{3, -1});
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("dimension 1"), std::string::npos);
  EXPECT_FALSE(CheckedProduct(Shape{Index{1} << 40, Index{1} << 40}).ok());
}

TEST(IndexTest, RowMajorStridesAndUnravel) {
  EXPECT_EQ(RowMajorStrides(Shape{2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(RowMajorStrides(Shape{}), Shape{});
  EXPECT_EQ(UnravelIndex(23, Shape{2, 3, 4}), (Shape{1, 2, 3}));
  EXPECT_EQ(UnravelIndex(5, Shape{2, 3, 4}), (Shape{0, 1, 1}));
  EXPECT_EQ(FormatShape(Shape{48, 8}), "[48, 8]");
}

TEST(IndexTest, LastOffsetOverflowIsDetected) {
  EXPECT_EQ(LastOffset(10, Shape{2, 3}, Shape{8, 1}), 10 + 8 + 2);
  EXPECT_FALSE(LastOffset(0, Shape{Index{1} << 40}, Shape{Index{1} << 40}).has_value());
}

}  // namespace
}  // namespace reshard
