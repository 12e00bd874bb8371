#include "reshard/base/json_reader.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "reshard/base/cpu_limit_testing.h"
#include "reshard/base/json_writer.h"

namespace reshard::json {
namespace {

std::string Error(std::string_view text) {
  Result<Json> parsed = ParseJson(text);
  EXPECT_FALSE(parsed.ok()) << text;
  if (parsed.ok()) return "";
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  return parsed.status().message();
}

TEST(JsonReaderTest, BytesAfterTheValueAreRefusedEvenAfterANul) {
  const std::string text = std::string(R"({"a": 1})") + '\0' + "garbage{{{";
  EXPECT_EQ(Error(text), "malformed JSON: 11 bytes after the JSON value, from byte 8 (a NUL)");
  EXPECT_EQ(Error(std::string("[1, ") + '\0' + "2]"), "malformed JSON: a NUL byte at byte 4");
  EXPECT_EQ(Error(R"({"a": 1} {})"),
            "malformed JSON: parse error at line 1, column 10: syntax error while parsing value - "
            "unexpected '{'; expected end of input");
  EXPECT_TRUE(ParseJson("{\"a\": 1}\n \t").ok());
}

TEST(JsonReaderTest, DuplicateKeysAreRefusedWithTheirPath) {
  EXPECT_EQ(Error(R"({"a": [{}, {"b": 1, "b": 2}]})"), R"(a[1]: duplicate key "b")");
  EXPECT_EQ(Error(R"({"*": 1, "*": 2})"), R"(duplicate key "*")");
  EXPECT_TRUE(ParseJson(R"({"a": {"b": 1}, "c": {"b": 1}})").ok());
}

TEST(JsonReaderTest, NumbersADoubleCannotHoldAreRefused) {
  EXPECT_EQ(Error(R"({"b": {"fill": 1e-400}})"),
            "b.fill: number 1e-400 is too small for a double (it would read as 0)");
  EXPECT_EQ(Error(R"([1, -2.5E-999])"),
            "[1]: number -2.5E-999 is too small for a double (it would read as 0)");
  const std::string big = Error(R"({"fill": 1e400})");
  EXPECT_NE(big.find("1e400"), std::string::npos) << big;
  // Zero written as zero, and subnormal values, are numbers a double holds.
  EXPECT_TRUE(ParseJson(R"([0.0, 0e-999, -0.0, 1e-310, 1.7976931348623157e308])").ok());
}

TEST(JsonReaderTest, DepthIsLimitedBeforeParsing) {
  EXPECT_TRUE(ParseJson(std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']')).ok());
  EXPECT_EQ(Error(std::string(kMaxJsonDepth + 1, '[')),
            "JSON nests deeper than 128 levels (at byte 128)");
}

TEST(JsonReaderTest, DuplicateKeysKeepTheFirstValueAndSyntaxErrorsComeFirst) {
  EXPECT_EQ(Error(R"([1, {"x": [2, {"y": 0, "y": {"z": 1}}]}])"), R"([1].x[1]: duplicate key "y")");
  EXPECT_EQ(Error(R"({"a": 1, "a": 2, "b": })"),
            "malformed JSON: parse error at line 1, column 23: syntax error while parsing value - "
            "unexpected '}'; expected '[', '{', or a literal");
}

TEST(JsonReaderTest, WhatItParsesEqualsThePlainParse) {
  const std::string text =
      R"({"a": [1, -2, 3.5, "s", null, true, [], {}], "b": {"c": [{"d": [[0]]}]}, "é": 1})";
  Result<Json> parsed = ParseJson("\xEF\xBB\xBF" + text);  // a BOM is skipped, as nlohmann does
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, Json::parse(text));
}

// Many objects in one container cost in proportion to their number. 400 000 objects took 44 s
// of CPU when each object's end rescanned its parent (nlohmann's callback parser); a linear parse
// takes well under a second, so a 10 s CPU limit (SIGXCPU ends the child) catches only a square.
TEST(JsonReaderDeathTest, ManyObjectsParseInLinearTime) {
  const auto parse = [] {
    std::string text = R"({"ignored": [)";
    const int n = test_support::CostInput(400000);
    for (int i = 0; i < n; ++i) text += i == 0 ? R"({"a":1})" : R"(,{"a":1})";
    text += "]}";
    Result<Json> parsed = ParseJson(text);
    return parsed.ok() && (*parsed)["ignored"].size() == static_cast<size_t>(n);
  };
  EXPECT_EXIT(test_support::RunUnderCpuLimit(10, parse), ::testing::ExitedWithCode(0), "");
}

TEST(JsonReaderTest, TopLevelKeysKeepFileOrder) {
  std::vector<std::string> keys;
  ASSERT_TRUE(ParseJson(R"({"z": 1, "a": {"y": 2}, "m": 3})", &keys).ok());
  EXPECT_EQ(keys, (std::vector<std::string>{"z", "a", "m"}));
}

TEST(JsonReaderTest, IntegersAreCheckedForTypeAndRange) {
  const Json j = *ParseJson(R"([4.0, -1, 9223372036854775808, 4611686018427387905, "7", 5])");
  EXPECT_EQ(ReadInt(j[0], "x").status().message(), "x: expected an integer, got 4.0");
  EXPECT_EQ(ReadInt(j[1], "x", kCount).status().message(), "x: -1 is outside 0..2^62");
  EXPECT_EQ(ReadInt(j[2], "x").status().message(),
            "x: integer 9223372036854775808 is outside the range of int64");
  EXPECT_EQ(ReadInt(j[3], "x", kPositive).status().message(),
            "x: 4611686018427387905 is outside 1..2^62");
  EXPECT_EQ(ReadInt(j[4], "x", kPositive).status().message(),
            R"(x: expected a positive integer, got "7")");
  EXPECT_EQ(*ReadInt(j[5], "x", IntRange{5, 5}), 5);
  EXPECT_EQ(ReadIntArray(j, "a", kCount).status().message(),
            "a[0]: expected a non-negative integer, got 4.0");
}

TEST(JsonReaderTest, PathsQuoteKeysThatAreNotIdentifiers) {
  EXPECT_EQ(Member("", "ranks"), "ranks");
  EXPECT_EQ(Member("ranks", "3"), R"(ranks["3"])");
  EXPECT_EQ(Member(R"(ranks["3"])", "pieces"), R"(ranks["3"].pieces)");
  EXPECT_EQ(Element("pieces", 1), "pieces[1]");
  // Cut at a UTF-8 boundary: 47 ASCII bytes, then a two-byte character across byte 48.
  EXPECT_EQ(QuoteShort(std::string(47, 'x') + "\xC3\xA9" + "tail"),
            "\"" + std::string(47, 'x') + "...\"");
}

TEST(JsonReaderTest, UnknownKeysAreNamedWithTheAllowedOnes) {
  const Json j = *ParseJson(R"({"family": "split", "dims": 0})");
  EXPECT_EQ(CheckKeys(j, "", {"family", "dim"}, "family \"split\"").message(),
            "dims: unknown key for family \"split\" (allowed: family, dim)");
}

TEST(JsonWriterTest, ShallowContainersOnOneLineDeepOnesAndTheDocumentBroken) {
  OrderedJson doc;
  doc["b"] = 1;
  doc["a"] = {{"shape", {8, 8}}, {"source", {0, {8, 1}}}, {"scale", 0.25}};
  doc["deep"] = {{"x", {{"y", {{"z", {1}}}}}}};
  doc["empty"] = OrderedJson::array();
  doc["name"] = "q\"\n";
  doc["whole"] = 2.0;
  EXPECT_EQ(WriteJson(doc),
            "{\n"
            "  \"b\": 1,\n"
            "  \"a\": {\"shape\": [8, 8], \"source\": [0, [8, 1]], \"scale\": 0.25},\n"
            "  \"deep\": {\n"
            "    \"x\": {\"y\": {\"z\": [1]}}\n"
            "  },\n"
            "  \"empty\": [],\n"
            "  \"name\": \"q\\\"\\n\",\n"
            "  \"whole\": 2.0\n"
            "}");
}

TEST(JsonWriterTest, WhatItWritesReadsBackEqual) {
  OrderedJson doc = {{"k", {1, 2.5, "s", nullptr, true}}, {"n", {{"m", {{"o", {{}}}}}}}};
  Result<Json> back = ParseJson(WriteJson(doc));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->dump(), Json::parse(doc.dump()).dump());
}

}  // namespace
}  // namespace reshard::json
