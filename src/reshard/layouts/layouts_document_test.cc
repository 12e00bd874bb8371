#include "reshard/layouts/layouts_document.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

TEST(LayoutsDocumentTest, WritesAndReadsBackWithTheDefaultAndEscapedNames) {
  LayoutsDocument doc;
  LayoutDescriptor split;
  split.family = LayoutFamily::kSplit;
  split.dim = 1;
  doc.layouts.emplace("*", LayoutDescriptor{});
  doc.layouts.emplace("h.0.mlp.down.weight", split);
  doc.layouts.emplace("^odd", split);
  const std::string text = LayoutsDocumentToJson(doc);
  EXPECT_EQ(text,
            "{\n"
            "  \"version\": 1,\n"
            "  \"*\": {\"family\":\"replicated\"},\n"
            "  \"^\\\\^odd$\": {\"family\":\"split\",\"dim\":1,\"remainder\":\"front\"},\n"
            "  \"h.0.mlp.down.weight\": {\"family\":\"split\",\"dim\":1,\"remainder\":\"front\"}\n"
            "}\n");
  Result<LayoutsDocument> back = ParseLayoutsDocumentJson(text);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->layouts, doc.layouts);
  EXPECT_EQ(back->Find("h.0.mlp.down.weight")->family, LayoutFamily::kSplit);
  EXPECT_EQ(back->Find("anything else")->family, LayoutFamily::kReplicated);
}

TEST(LayoutsDocumentTest, TwoLayoutsForOneParameterAreRefused) {
  for (const auto& [text, message] : std::vector<std::pair<std::string, std::string>>{
           {R"({"version": 1, "*": {"family": "replicated"}, "*": {"family": "replicated"}})",
            R"(duplicate key "*")"},
           {R"({"version": 1, "^w$": {"family": "replicated"}, "w": {"family": "replicated"}})",
            R"(keys "^w$" and "w" both name the layout of "w")"},
           {R"({"version": 2})", "version 2 is not supported; this reader knows version 1"},
           {R"({"w": {"family": "replicated"}})", R"(missing key "version")"},
           {R"({"version": 1, "w": {"family": "split", "dim": 1.5}})",
            R"(["w"]: dim: expected a non-negative integer, got 1.5)"},
       }) {
    Result<LayoutsDocument> doc = ParseLayoutsDocumentJson(text);
    ASSERT_FALSE(doc.ok()) << text;
    EXPECT_EQ(doc.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(doc.status().message(), message);
  }
}

TEST(LayoutsDocumentTest, WithoutADefaultAnUnnamedParameterHasNoLayout) {
  Result<LayoutsDocument> doc =
      ParseLayoutsDocumentJson(R"({"version": 1, "w": {"family": "replicated"}})");
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->Find("v"), nullptr);
}

}  // namespace
}  // namespace reshard
