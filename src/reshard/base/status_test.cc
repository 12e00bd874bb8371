#include "reshard/base/status.h"

#include <gtest/gtest.h>

#include "reshard/base/result.h"

namespace reshard {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  RESHARD_ASSIGN_OR_RETURN(int half, Half(x));
  RESHARD_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

Status CheckEven(int x) {
  RESHARD_RETURN_IF_ERROR(Half(x).status());
  return Status::Ok();
}

TEST(StatusTest, CodesAreNamedAsAbseilNamesThem) {
  EXPECT_EQ(Status::Ok().ToString(), "OK");
  EXPECT_EQ(InvalidArgumentError("m").ToString(), "INVALID_ARGUMENT: m");
  EXPECT_EQ(NotFoundError("m").ToString(), "NOT_FOUND: m");
  EXPECT_EQ(AlreadyExistsError("m").ToString(), "ALREADY_EXISTS: m");
  EXPECT_EQ(OutOfRangeError("m").ToString(), "OUT_OF_RANGE: m");
  EXPECT_EQ(FailedPreconditionError("m").ToString(), "FAILED_PRECONDITION: m");
  EXPECT_EQ(DataLossError("m").ToString(), "DATA_LOSS: m");
  EXPECT_EQ(ResourceExhaustedError("m").ToString(), "RESOURCE_EXHAUSTED: m");
  EXPECT_EQ(UnimplementedError("m").ToString(), "UNIMPLEMENTED: m");
  EXPECT_EQ(InternalError("m").ToString(), "INTERNAL: m");
  EXPECT_EQ(UnavailableError("m").ToString(), "UNAVAILABLE: m");
  EXPECT_EQ(UnavailableError("m").code(), StatusCode::kUnavailable);
}

TEST(StatusTest, AnnotatePrependsContextOuterToInner) {
  Status s = InvalidArgumentError("bad stride").Annotate("pieces[1]").Annotate("ranks[\"3\"]");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "ranks[\"3\"]: pieces[1]: bad stride");
  EXPECT_EQ(s.ToString(), "INVALID_ARGUMENT: ranks[\"3\"]: pieces[1]: bad stride");
}

TEST(StatusTest, AnnotateKeepsOkStatusOk) { EXPECT_TRUE(Status::Ok().Annotate("context").ok()); }

TEST(ResultTest, AssignOrReturnPropagatesTheFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "odd");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_EQ(CheckEven(3).code(), StatusCode::kInvalidArgument);
}

TEST(ResultTest, OkStatusBecomesInternalError) {
  Result<int> r{Status::Ok()};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace reshard
