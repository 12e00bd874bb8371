#include "reshard/ir/map_json.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "reshard/ir/fixtures.h"
#include "reshard/ir/random_map.h"

namespace reshard {
namespace {

std::string Replay(uint64_t seed) {
  return "seed " + std::to_string(seed) + " (replay with RESHARD_SEED=" + std::to_string(seed) +
         ")";
}

// GPT-BigCode's fused QKV weight at TP 4 (DESIGN 6.1), in the writer's exact form.
constexpr std::string_view kBigCodeJson = R"({
  "logical_shape": [48, 8],
  "ranks": {
    "0": {
      "shard_shape": [24, 8],
      "pieces": [
        {"shape": [8, 8], "source": [0, [8, 1]], "dest": [0, [8, 1]], "locations": [0]},
        {"shape": [16, 8], "source": [256, [8, 1]], "dest": [64, [8, 1]], "locations": [0, 1, 2, 3]}
      ]
    },
    "1": {
      "shard_shape": [24, 8],
      "pieces": [
        {"shape": [8, 8], "source": [64, [8, 1]], "dest": [0, [8, 1]], "locations": [1]},
        {"shape": [16, 8], "source": [256, [8, 1]], "dest": [64, [8, 1]], "locations": [0, 1, 2, 3]}
      ]
    },
    "2": {
      "shard_shape": [24, 8],
      "pieces": [
        {"shape": [8, 8], "source": [128, [8, 1]], "dest": [0, [8, 1]], "locations": [2]},
        {"shape": [16, 8], "source": [256, [8, 1]], "dest": [64, [8, 1]], "locations": [0, 1, 2, 3]}
      ]
    },
    "3": {
      "shard_shape": [24, 8],
      "pieces": [
        {"shape": [8, 8], "source": [192, [8, 1]], "dest": [0, [8, 1]], "locations": [3]},
        {"shape": [16, 8], "source": [256, [8, 1]], "dest": [64, [8, 1]], "locations": [0, 1, 2, 3]}
      ]
    }
  }
}
)";

ParamMap BigCode() { return *fixtures::BigCodeBuilder(4).Finalize(); }

Result<ParamMap> ReadOne(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(ParamMapBuilder b, ParseParamMapJson(text));
  return b.Finalize();
}

TEST(MapJsonTest, BigCodeGoldenReadsValidatesAndWritesExactly) {
  Result<ParamMap> read = ReadOne(kBigCodeJson);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, BigCode());
  EXPECT_EQ(read->rank(2).pieces[0].source.offset, 128);
  EXPECT_EQ(read->rank(3).pieces[1].locations, (std::vector<Rank>{0, 1, 2, 3}));
  EXPECT_EQ(ParamMapToJson(BigCode()), kBigCodeJson);
}

TEST(MapJsonTest, DesignExampleInOneLineReads) {
  // DESIGN 6.1's rank-0 piece list, completed for all ranks, with no whitespace at all.
  std::string text = R"({"logical_shape":[48,8],"ranks":{)";
  for (int r = 0; r < 4; ++r) {
    text += (r ? "," : "") + ("\"" + std::to_string(r) + "\":{\"shard_shape\":[24,8],") +
            "\"pieces\":[{\"shape\":[8,8],\"source\":[" + std::to_string(64 * r) +
            ",[8,1]],\"dest\":[0,[8,1]],\"locations\":[" + std::to_string(r) +
            "]},{\"shape\":[16,8],\"source\":[256,[8,1]],\"dest\":[64,[8,1]],"
            "\"locations\":[3,2,1,0]}]}";
  }
  text += "}}";
  Result<ParamMap> read = ReadOne(text);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, BigCode());  // locations sorted on Finalize
}

TEST(MapJsonTest, ScaleIsWrittenOnlyWhenNotOneInShortestForm) {
  ParamMapBuilder b;
  b.set_logical_shape({16});
  for (Rank r = 0; r < 3; ++r) {
    b.set_shard_shape(r, {16});
    b.add_piece(r, Piece{{16}, {0, {1}}, {0, {1}}, {0, 1, 2}, 1.0 / 3.0});
  }
  Result<ParamMap> m = b.Finalize();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const std::string json = ParamMapToJson(*m);
  EXPECT_NE(json.find(R"("locations": [0, 1, 2], "scale": 0.3333333333333333})"), std::string::npos)
      << json;
  for (double scale : {0.25, 2.0, -0.125, 1e-300, 123456.789}) {
    ParamMapBuilder one;
    one.set_logical_shape({16}).set_shard_shape(0, {16});
    one.add_piece(0, Piece{{16}, {0, {1}}, {0, {1}}, {0}, scale});
    Result<ParamMap> sm = one.Finalize();
    ASSERT_TRUE(sm.ok());
    const std::string text = ParamMapToJson(*sm);
    Result<ParamMap> back = ReadOne(text);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->rank(0).pieces[0].scale, scale) << text;
  }
  ParamMapBuilder two;
  two.set_logical_shape({4}).set_shard_shape(0, {4});
  two.add_piece(0, Piece{{4}, {0, {1}}, {0, {1}}, {0}, 2.0});
  EXPECT_NE(ParamMapToJson(*two.Finalize()).find(R"("scale": 2.0})"), std::string::npos);
}

TEST(MapJsonTest, ValidShapeIsWrittenOnlyWhenPadded) {
  ParamMapBuilder b;
  b.set_logical_shape({16, 2}).set_valid_shape(Shape{13, 2});
  b.set_shard_shape(0, {13, 2});
  b.add_piece(0, Piece{{13, 2}, {0, {2, 1}}, {0, {2, 1}}, {0}, 1.0});
  Result<ParamMap> m = b.Finalize();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const std::string json = ParamMapToJson(*m);
  EXPECT_TRUE(json.starts_with(
      "{\n  \"logical_shape\": [16, 2],\n  \"valid_shape\": [13, 2],\n  \"ranks\": {\n"))
      << json;
  Result<ParamMap> back = ReadOne(json);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, *m);
  EXPECT_EQ(ParamMapToJson(BigCode()).find("valid_shape"), std::string::npos);
}

TEST(MapJsonTest, RandomMapsRoundTripExactlyAndByteForByte) {
  for (uint64_t seed : PropertyTestSeeds(1500)) {
    SCOPED_TRACE(Replay(seed));
    std::mt19937_64 rng(seed);
    const ParamMap map = RandomParamMap(rng);
    const std::string json = ParamMapToJson(map);
    Result<ParamMapBuilder> parsed = ParseParamMapJson(json);
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString() << "\n" << json;
    Result<ParamMap> back = parsed->Finalize();
    ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << json;
    ASSERT_EQ(*back, map) << json;
    ASSERT_EQ(ParamMapToJson(*back), json);
  }
}

TEST(MapJsonTest, RandomDocumentsRoundTripWithAwkwardNames) {
  const std::vector<std::string> names = {"h.0.attn.c_attn.weight",
                                          "version",
                                          "^starts.with.caret$",
                                          "with \"quotes\" and \\",
                                          "tab\tnewline\n",
                                          "unicode \xc3\xa9\xe2\x82\xac",
                                          "",
                                          "^",
                                          "a$",
                                          "[x]*(y)+{z}?|.",
                                          "model.layers.31.mlp.down_proj.weight"};
  for (uint64_t seed : PropertyTestSeeds(100)) {
    SCOPED_TRACE(Replay(seed));
    std::mt19937_64 rng(seed);
    MapDocument doc;
    for (const std::string& name : names) {
      if (rng() % 2 == 0) doc.params.emplace_back(name, RandomParamMap(rng));
    }
    const std::string json = MapDocumentToJson(doc);
    Result<MapDocument> back = ReadMapDocumentJson(json);
    ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << json;
    ASSERT_EQ(back->params.size(), doc.params.size());
    for (size_t i = 0; i < doc.params.size(); ++i) {
      EXPECT_EQ(back->params[i].first, doc.params[i].first);
      EXPECT_EQ(back->params[i].second, doc.params[i].second);
    }
    EXPECT_EQ(MapDocumentToJson(*back), json);
  }
}

TEST(MapJsonTest, DocumentWriterLayout) {
  MapDocument empty;
  EXPECT_EQ(MapDocumentToJson(empty), "{\n  \"version\": 1\n}\n");
  MapDocument doc;
  doc.params.emplace_back("w", BigCode());
  doc.params.emplace_back("version", BigCode());
  const std::string json = MapDocumentToJson(doc);
  EXPECT_TRUE(json.starts_with(
      "{\n  \"version\": 1,\n  \"w\": {\n    \"logical_shape\": [48, 8],\n    \"ranks\": {\n"))
      << json;
  EXPECT_NE(json.find("\n  },\n  \"^version$\": {\n    \"logical_shape\""), std::string::npos);
  EXPECT_TRUE(json.ends_with("]\n      }\n    }\n  }\n}\n")) << json;
}

TEST(MapJsonTest, DeepSpeedStyleDocumentReads) {
  // As DeepSpeed writes it: exact-match regex keys, every key quoted, scale on a
  // pre-divided bias, no valid_shape, an unknown key.
  const std::string text = R"({"version": 1,
    "^h\\.0\\.attn\\.c_attn\\.weight$": {"logical_shape": [48, 8], "ranks": {
      "1": {"shard_shape": [32, 8], "pieces": [
        {"shape": [16, 8], "source": [128, [8, 1]], "dest": [0, [8, 1]], "locations": [1]},
        {"shape": [16, 8], "source": [256, [8, 1]], "dest": [128, [8, 1]], "locations": [1, 0]}]},
      "0": {"shard_shape": [32, 8], "pieces": [
        {"shape": [16, 8], "source": [0, [8, 1]], "dest": [0, [8, 1]], "locations": [0]},
        {"shape": [16, 8], "source": [256, [8, 1]], "dest": [128, [8, 1]], "locations": [0, 1]}]}}},
    "^h\\.0\\.attn\\.c_proj\\.bias$": {"logical_shape": [8], "ranks": {
      "0": {"shard_shape": [8], "pieces": [
        {"shape": [8], "source": [0, [1]], "dest": [0, [1]], "locations": [0, 1], "scale": 0.5}]},
      "1": {"shard_shape": [8], "pieces": [
        {"shape": [8], "source": [0, [1]], "dest": [0, [1]], "locations": [0, 1], "scale": 0.5}]}},
      "dtype": "torch.float16"},
    "lm_head.weight": {"logical_shape": [4, 2], "ranks": {"0": {"shard_shape": [4, 2],
      "pieces": [{"shape": [4, 2], "source": [0, [2, 1]], "dest": [0, [2, 1]],
                  "locations": [0]}]}}}})";
  Result<MapDocument> doc = ReadMapDocumentJson(text);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  ASSERT_EQ(doc->params.size(), 3u);
  EXPECT_EQ(doc->params[0].first, "h.0.attn.c_attn.weight");
  EXPECT_EQ(doc->params[1].first, "h.0.attn.c_proj.bias");
  EXPECT_EQ(doc->params[2].first, "lm_head.weight");
  const ParamMap& qkv = doc->params[0].second;
  EXPECT_EQ(qkv.world_size(), 2);
  EXPECT_EQ(qkv.rank(1).pieces[0].source.offset, 128);
  EXPECT_EQ(qkv.rank(1).pieces[1].locations, (std::vector<Rank>{0, 1}));
  EXPECT_EQ(doc->params[1].second.rank(0).pieces[0].scale, 0.5);
  // Written back with plain names.
  const std::string json = MapDocumentToJson(*doc);
  EXPECT_NE(json.find("\n  \"h.0.attn.c_attn.weight\": {"), std::string::npos) << json;
}

TEST(MapJsonTest, BareParamMapIsADocumentWithOneUnnamedParameter) {
  Result<MapDocument> doc = ReadMapDocumentJson(kBigCodeJson);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  ASSERT_EQ(doc->params.size(), 1u);
  EXPECT_EQ(doc->params[0].first, "");
  EXPECT_EQ(doc->params[0].second, BigCode());
}

TEST(MapJsonTest, DecodeParamKey) {
  EXPECT_EQ(*DecodeParamKey("h.0.attn.c_attn.weight"), "h.0.attn.c_attn.weight");
  EXPECT_EQ(*DecodeParamKey(R"(^h\.0\.attn\.c_attn\.weight$)"), "h.0.attn.c_attn.weight");
  // Python 3.7+ re.escape leaves '_' alone; older versions escaped every non-alphanumeric.
  EXPECT_EQ(*DecodeParamKey(R"(^a\_b\-c\ d\#e\~f\&g$)"), "a_b-c d#e~f&g");
  EXPECT_EQ(*DecodeParamKey(R"(^\^\$\\\[\]\(\)\{\}\*\+\?\|$)"), R"(^$\[](){}*+?|)");
  EXPECT_EQ(*DecodeParamKey("^a-b c$"), "a-b c");  // unescaped but not special
  EXPECT_EQ(*DecodeParamKey("^$"), "");
  EXPECT_EQ(*DecodeParamKey("plain$"), "plain$");
}

// --- Negative tests: each case edits one valid input and names the exact error.

enum class Reader { kParamMap, kDocument, kReadDocument };

struct BadCase {
  const char* what;
  Reader reader;
  std::string text;
  std::string error;
};

// kBigCodeJson with the last (or first) occurrence of `from` replaced by `to`.
std::string Edit(std::string_view from, std::string_view to, bool last = true,
                 std::string_view base = kBigCodeJson) {
  std::string text(base);
  const size_t at = last ? text.rfind(from) : text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

std::string Doc(std::string_view key, std::string_view value = kBigCodeJson) {
  return "{\"version\": 1, \"" + std::string(key) + "\": " + std::string(value) + "}";
}

std::vector<BadCase> DocumentBadCases();

std::vector<BadCase> BadCases() {
  std::vector<BadCase> cases = {
      {"float stride", Reader::kParamMap,
       Edit(R"("source": [256, [8, 1]])", R"("source": [256, [2.5, 1]])"),
       R"(ranks["3"].pieces[1].source[1][0]: expected an integer, got 2.5)"},
      {"string shape", Reader::kParamMap, Edit("[48, 8]", "\"48\""),
       R"(logical_shape: expected an array of integers, got "48")"},
      {"integral float", Reader::kParamMap, Edit("[48, 8]", "[48, 8.0]"),
       "logical_shape[1]: expected an integer, got 8.0"},
      {"bool", Reader::kParamMap, Edit("[48, 8]", "[true, 8]"),
       "logical_shape[0]: expected an integer, got true"},
      {"null", Reader::kParamMap, Edit("[48, 8]", "null"),
       "logical_shape: expected an array of integers, got null"},
      {"past int64", Reader::kParamMap, Edit("[48, 8]", "[48, 9223372036854775808]"),
       "logical_shape[1]: integer 9223372036854775808 is outside the range of int64"},
      {"below int64", Reader::kParamMap, Edit("[48, 8]", "[48, -9223372036854775809]"),
       "logical_shape[1]: expected an integer, got -9.223372036854776e+18"},
      {"missing shard_shape", Reader::kParamMap, Edit("\"shard_shape\": [24, 8],", "", false),
       R"(ranks["0"]: missing key "shard_shape")"},
      {"missing pieces", Reader::kParamMap,
       R"({"logical_shape": [1], "ranks": {"0": {"shard_shape": [1]}}})",
       R"(ranks["0"]: missing key "pieces")"},
      {"missing ranks", Reader::kParamMap, R"({"logical_shape": [1]})", R"(missing key "ranks")"},
      {"missing logical_shape", Reader::kParamMap, R"({"ranks": {}})",
       R"(missing key "logical_shape")"},
      {"missing locations", Reader::kParamMap, Edit(R"(, "locations": [3])", ""),
       R"(ranks["3"].pieces[0]: missing key "locations")"},
      {"missing dest", Reader::kParamMap, Edit(R"(, "dest": [0, [8, 1]])", "", false),
       R"(ranks["0"].pieces[0]: missing key "dest")"},
      {"rank key with a leading zero", Reader::kParamMap, Edit("\"1\": {", "\"01\": {"),
       R"(ranks: key "01" is not a rank; rank keys are decimal integers "0".."N-1" without signs or leading zeros)"},
      {"negative rank key", Reader::kParamMap, Edit("\"1\": {", "\"-1\": {"),
       R"(ranks: key "-1" is not a rank; rank keys are decimal integers "0".."N-1" without signs or leading zeros)"},
      {"rank key with a sign", Reader::kParamMap, Edit("\"1\": {", "\"+1\": {"),
       R"(ranks: key "+1" is not a rank; rank keys are decimal integers "0".."N-1" without signs or leading zeros)"},
      {"missing rank", Reader::kParamMap, Edit("\"2\": {", "\"7\": {"),
       R"(ranks: missing key "2"; 4 ranks need keys "0".."3" but "7" is among them)"},
      {"huge rank key", Reader::kParamMap, Edit("\"2\": {", "\"99999999999\": {"),
       R"(ranks: key "99999999999" is not a rank; rank keys are decimal integers "0".."N-1" without signs or leading zeros)"},
      {"duplicate rank", Reader::kParamMap, Edit("\"3\": {", "\"2\": {"),
       R"(ranks: duplicate key "2")"},
      {"duplicate piece key", Reader::kParamMap,
       Edit(R"("locations": [3])", R"("locations": [3], "shape": [8, 8])"),
       R"(ranks["3"].pieces[0]: duplicate key "shape")"},
      {"ranks not an object", Reader::kParamMap,
       R"({"logical_shape": [1], "ranks": [{"shard_shape": [1], "pieces": []}]})",
       R"(ranks: expected an object keyed by rank ("0", ...), got an array of 1 element)"},
      {"piece not an object", Reader::kParamMap,
       R"({"logical_shape": [1], "ranks": {"0": {"shard_shape": [1], "pieces": [7]}}})",
       R"(ranks["0"].pieces[0]: expected a piece (an object), got 7)"},
      {"pieces not an array", Reader::kParamMap,
       R"({"logical_shape": [1], "ranks": {"0": {"shard_shape": [1], "pieces": {}}}})",
       R"(ranks["0"].pieces: expected an array of pieces, got an object)"},
      {"source of three", Reader::kParamMap,
       Edit(R"("source": [0, [8, 1]])", R"("source": [0, 8, 1])", false),
       R"(ranks["0"].pieces[0].source: expected [offset, [strides...]], got an array of 3 elements)"},
      {"dest offset string", Reader::kParamMap,
       Edit(R"("dest": [64, [8, 1]])", R"("dest": ["64", [8, 1]])"),
       R"(ranks["3"].pieces[1].dest[0]: expected an integer, got "64")"},
      {"location past int32", Reader::kParamMap,
       Edit(R"("locations": [0])", R"("locations": [4294967296])"),
       R"(ranks["0"].pieces[0].locations[0]: rank 4294967296 is outside the range of int32)"},
      {"location float", Reader::kParamMap,
       Edit(R"("locations": [0, 1, 2, 3])", R"("locations": [0, 1, 2, 3.5])"),
       R"(ranks["3"].pieces[1].locations[3]: expected an integer, got 3.5)"},
      {"scale string", Reader::kParamMap,
       Edit(R"("locations": [0])", R"("locations": [0], "scale": "0.5")"),
       R"(ranks["0"].pieces[0].scale: expected a number, got "0.5")"},
      {"long string is cut", Reader::kParamMap,
       Edit("[48, 8]", "\"" + std::string(100, 'x') + "\""),
       "logical_shape: expected an array of integers, got \"" + std::string(48, 'x') + "...\""},
      {"not an object", Reader::kParamMap, "[1]",
       "expected a param map (an object), got an array of 1 element"},
      {"truncated", Reader::kParamMap, R"({"logical_shape": [1, 2)",
       "malformed JSON: parse error at line 1, column 24: syntax error while parsing array - "
       "unexpected end of input; expected ']'"},
      {"empty", Reader::kDocument, "",
       "malformed JSON: parse error at line 1, column 1: syntax error while parsing value - "
       "unexpected end of input; expected '[', '{', or a literal"},
      {"trailing garbage", Reader::kParamMap, R"({"logical_shape": [1]} x)",
       "malformed JSON: parse error at line 1, column 24: syntax error while parsing value - "
       "invalid literal; last read: '1]} x'; expected end of input"},
      {"too deep", Reader::kDocument, std::string(200, '[') + std::string(200, ']'),
       "JSON nests deeper than 128 levels (at byte 128)"},
      {"brackets in strings do not nest", Reader::kDocument,
       "{\"version\": 1, \"x" + std::string(200, '[') + "\": 5}",
       "parameter \"x" + std::string(47, '[') + "...\": expected a param map (an object), got 5"},
      {"bytes after a NUL", Reader::kParamMap,
       std::string(R"({"logical_shape": [1]})") + '\0' + "x",
       "malformed JSON: 2 bytes after the JSON value, from byte 22 (a NUL)"},
  };
  for (BadCase& c : DocumentBadCases()) cases.push_back(std::move(c));
  return cases;
}

std::vector<BadCase> DocumentBadCases() {
  const std::string only = "only exact-match patterns ^<re.escape(name)>$ are supported";
  return {
      {"version 3", Reader::kDocument, R"({"version": 3})",
       "version 3 is not supported; this reader knows versions 1 and 2 (with buffers)"},
      {"version 2 without buffers", Reader::kDocument, R"({"version": 2})",
       "missing key \"buffers\""},
      {"buffers not an object", Reader::kDocument, R"({"version": 2, "buffers": []})",
       "buffers: expected an object of buffers by name, got an empty array"},
      {"buffer without dtype", Reader::kDocument,
       R"({"version": 2, "buffers": {"b": {"ranks": {}}}})",
       "buffers[\"b\"]: missing key \"dtype\""},
      {"buffer of unknown dtype", Reader::kDocument,
       R"({"version": 2, "buffers": {"b": {"dtype": "F12", "ranks": {}}}})",
       "buffers[\"b\"].dtype: unknown dtype \"F12\""},
      {"buffer rank key", Reader::kDocument,
       R"({"version": 2, "buffers": {"b": {"dtype": "F32", "ranks": {"1": {"shape": [2]}}}}})",
       "buffers[\"b\"].ranks: key \"1\" is not a rank \"0\"..\"0\""},
      {"buffer padding", Reader::kDocument,
       R"({"version": 2, "buffers": {"b": {"dtype": "F32", "ranks": {"0": {"shape": [2],
           "padding": [{"shape": [1]}]}}}}})",
       "buffers[\"b\"].ranks[\"0\"].padding[0]: missing key \"view\""},
      {"buffer name not a string", Reader::kParamMap,
       R"({"logical_shape": [2], "ranks": {"0": {"buffer": 3, "shard_shape": [2], "pieces": []}}})",
       "ranks[\"0\"].buffer: expected a buffer name (a non-empty string), got 3"},
      {"version string", Reader::kDocument, R"({"version": "1"})",
       R"(version: expected an integer, got "1")"},
      {"version float", Reader::kDocument, R"({"version": 1.0})",
       "version: expected an integer, got 1.0"},
      {"no version", Reader::kDocument, R"({"w": {}})",
       R"(missing key "version"; a map document is {"version": 1, "<name>": <param map>, ...} and a bare param map has "logical_shape" and "ranks")"},
      {"document root an array", Reader::kDocument, "[]",
       "expected a map document or a param map (an object), got an empty array"},
      {"unescaped dot", Reader::kDocument, Doc("^h.0$"),
       R"(key "^h.0$": unescaped "." at position 2 is a regex metacharacter; )" + only},
      {"regex class", Reader::kDocument, Doc(R"(^h\\d$)"),
       R"(key "^h\\d$": "\d" at position 2 is a regex escape, not a literal; )" + only},
      {"alternation", Reader::kDocument, Doc("^a|b$"),
       R"(key "^a|b$": unescaped "|" at position 2 is a regex metacharacter; )" + only},
      {"unanchored end", Reader::kDocument, Doc(R"(^h\\.0)"),
       R"(key "^h\\.0": starts with "^" but does not end with "$"; )" + only},
      {"escaped anchor", Reader::kDocument, Doc(R"(^h\\$)"),
       R"(key "^h\\$": the final "$" is escaped, so it does not anchor; )" + only},
      {"same name twice", Reader::kDocument, R"({"version": 1, "h.0": {}, "^h\\.0$": {}})",
       R"(keys "h.0" and "^h\\.0$" both name parameter "h.0")"},
      {"param error names the parameter", Reader::kDocument,
       Doc("^w\\\\.b$", Edit("[48, 8]", "[48, 8.5]")),
       R"(parameter "w.b": logical_shape[1]: expected an integer, got 8.5)"},
      {"param not an object", Reader::kDocument, Doc("w", "[]"),
       R"(parameter "w": expected a param map (an object), got an empty array)"},
      {"validation error names the parameter", Reader::kReadDocument,
       Doc("w", Edit(R"("source": [192, [8, 1]])", R"("source": [340, [8, 1]])")),
       R"(parameter "w": ranks["3"].pieces[0]: source view ends at offset 404 but F has 384 elements)"},
      {"validation error of a bare map", Reader::kReadDocument,
       Edit(R"("locations": [0, 1, 2, 3])", R"("locations": [0, 1, 2])"),
       R"(ranks["3"].pieces[1]: locations [0, 1, 2] do not include rank 3, which lists the piece)"},
  };
}

TEST(MapJsonTest, MalformedInputsNameTheJsonPath) {
  for (const BadCase& c : BadCases()) {
    SCOPED_TRACE(c.what);
    Status status;
    switch (c.reader) {
      case Reader::kParamMap:
        status = ParseParamMapJson(c.text).status();
        break;
      case Reader::kDocument:
        status = ParseMapDocumentJson(c.text).status();
        break;
      case Reader::kReadDocument:
        status = ReadMapDocumentJson(c.text).status();
        EXPECT_TRUE(ParseMapDocumentJson(c.text).ok()) << "should fail only in validation";
        break;
    }
    if (c.reader != Reader::kReadDocument) {
      EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    }
    EXPECT_EQ(status.message(), c.error);
  }
}

TEST(MapJsonTest, UnknownKeysAndNullValidShapeAreIgnored) {
  std::string text = Edit(R"("logical_shape": [48, 8],)",
                          R"("logical_shape": [48, 8], "valid_shape": null, "note": {"a": [1]},)");
  text = Edit(R"("locations": [3])", R"("locations": [3], "comment": "query rows")", true, text);
  Result<ParamMap> read = ReadOne(text);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, BigCode());
}

TEST(MapJsonTest, ScaleMayBeAnyJsonNumber) {
  for (const auto& [spelled, value] : std::vector<std::pair<std::string, double>>{
           {"1", 1.0}, {"-2", -2.0}, {"0.25", 0.25}, {"2.5e-1", 0.25}, {"4E0", 4.0}}) {
    Result<ParamMapBuilder> b =
        ParseParamMapJson(Edit(R"("locations": [0])", R"("locations": [0], "scale": )" + spelled));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_EQ(b->ranks()[0].pieces[0].scale, value) << spelled;
  }
}

TEST(MapJsonTest, TinyHostileMapTooFragmentedToCheckIsRefusedCheaply) {
  // 276 bytes: a 40-digit radix (forty dimensions of 2) and a piece of 2^24 elements at a
  // stride that is no digit, so every element is its own box. Validation must refuse it
  // within its budget, not allocate boxes x digits.
  std::string shape = "[2";
  for (int i = 1; i < 40; ++i) shape += ", 2";
  shape += "]";
  const std::string text = R"({"logical_shape": )" + shape +
                           R"(, "ranks": {"0": {"shard_shape": [16777216], "pieces": [)"
                           R"({"shape": [16777216], "source": [0, [3]], "dest": [0, [1]],)"
                           R"( "locations": [0]}]}}})";
  Result<MapDocument> doc = ReadMapDocumentJson(text);
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), StatusCode::kResourceExhausted) << doc.status().ToString();
}

}  // namespace
}  // namespace reshard
