// JSON forms of expert layouts (layouts/experts_json.h) and how `show` draws the buffers they
// make (ir/map_summary.h, SummarizeBuffers / BufferTable / BuffersSvg).
#include "reshard/layouts/experts_json.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "reshard/base/cpu_limit_testing.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_summary.h"

namespace reshard {
namespace {

using ::testing::HasSubstr;

// gate_up_proj of an MoE layer: E experts, intermediate 4, hidden 6.
std::string GateUp(std::string_view placement, int tp = 1, int dp = 1,
                   std::string_view order = "tp_fastest") {
  return fmt::format(
      R"({{"family": "stacked_experts", "buffer": "model.layers.0.mlp.experts.gate_up_proj",
          "dtype": "BF16",
          "members": [{{"name": "model.layers.0.mlp.experts.{{e}}.gate_proj.weight",
                        "shape": [4, 6], "split_dim": 0}},
                      {{"name": "model.layers.0.mlp.experts.{{e}}.up_proj.weight",
                        "shape": [4, 6], "split_dim": 0}}],
          "fused_dim": 0, "placement": {}, "tp": {}, "dp": {}, "rank_order": "{}"}})",
      placement, tp, dp, order);
}

Result<MapDocument> LayOut(const std::string& text, int world) {
  RESHARD_ASSIGN_OR_RETURN(auto ds, ParseStackedExpertsJson(text));
  return BuildStackedExpertsDocument(ds, world);
}

const ParamMap& MapOf(const MapDocument& doc, std::string_view name) {
  for (const auto& [n, m] : doc.params) {
    if (n == name) return m;
  }
  ADD_FAILURE() << "no map " << name;
  return doc.params[0].second;
}

TEST(StackedExpertsJsonTest, ContiguousAtEpFourHoldsTwoExpertsPerRank) {
  Result<MapDocument> doc = LayOut(GateUp(R"({"family": "contiguous", "num_experts": 8})"), 4);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  EXPECT_EQ(doc->params.size(), 16u);
  ASSERT_EQ(doc->buffers.buffers().size(), 1u);
  const BufferDecl& b = doc->buffers.buffers()[0];
  EXPECT_EQ(b.dtype, DType::kBF16);
  for (const BufferRank& r : b.ranks) EXPECT_EQ(r.shape, (Shape{2, 8, 6}));
  // Expert 3's up rows: rank 1, slot 1, after the gate rows.
  const ParamMap& up3 = MapOf(*doc, "model.layers.0.mlp.experts.3.up_proj.weight");
  ASSERT_EQ(up3.rank(1).pieces.size(), 1u);
  EXPECT_EQ(up3.rank(1).buffer, "model.layers.0.mlp.experts.gate_up_proj");
  EXPECT_EQ(up3.rank(1).pieces[0].dest.offset, 1 * 48 + 4 * 6);
  EXPECT_EQ(up3.rank(1).pieces[0].locations, (std::vector<Rank>{1}));
  EXPECT_TRUE(up3.rank(0).pieces.empty());
}

TEST(StackedExpertsJsonTest, ExpertTpTimesEpTimesDpInMegatronOrder) {
  // 4 experts, EP 2, expert TP 2, expert DP 2: rank = tp_rank + 2 (ep_rank + 2 dp_rank).
  Result<MapDocument> doc =
      LayOut(GateUp(R"({"family": "contiguous", "num_experts": 4})", 2, 2), 8);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  const ParamMap& gate0 = MapOf(*doc, "model.layers.0.mlp.experts.0.gate_proj.weight");
  // Rows [0, 2) of expert 0 on tp rank 0 of EP rank 0 in both DP groups: ranks 0 and 4.
  ASSERT_EQ(gate0.rank(0).pieces.size(), 1u);
  EXPECT_EQ(gate0.rank(0).pieces[0].source.offset, 0);
  EXPECT_EQ(gate0.rank(0).pieces[0].locations, (std::vector<Rank>{0, 4}));
  EXPECT_EQ(gate0.rank(1).pieces[0].source.offset, 2 * 6);
  EXPECT_EQ(gate0.rank(1).pieces[0].locations, (std::vector<Rank>{1, 5}));
  EXPECT_TRUE(gate0.rank(2).pieces.empty());  // EP rank 1
  // EP fastest: rank = ep_rank + 2 tp_rank, so tp rank 1 of EP rank 0 is rank 2.
  Result<MapDocument> ep_fast =
      LayOut(GateUp(R"({"family": "contiguous", "num_experts": 4})", 2, 1, "ep_fastest"), 4);
  ASSERT_TRUE(ep_fast.ok()) << ep_fast.status().ToString();
  const ParamMap& g = MapOf(*ep_fast, "model.layers.0.mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(g.rank(2).pieces.at(0).source.offset, 2 * 6);
  EXPECT_TRUE(g.rank(1).pieces.empty());
}

TEST(StackedExpertsJsonTest, WorldsThatDoNotFitAreFailedChecks) {
  struct Case {
    std::string text;
    int world;
    const char* says;
  };
  const Case cases[] = {
      {GateUp(R"({"family": "contiguous", "num_experts": 6})"), 4,
       "6 experts do not split into 4 equal contiguous blocks"},
      {GateUp(R"({"family": "contiguous", "num_experts": 4})", 2), 3, "it must be a multiple of 2"},
      {GateUp(R"({"family": "linear", "num_experts": 4})", 8), 8,
       "expert TP 8 does not divide dimension 0"},
      {GateUp(R"({"version": 1, "num_experts": 2, "ep_size": 2,
                  "ranks": [{"rank": 0, "experts": [0]}, {"rank": 1, "experts": [1]}]})"),
       4, "lists 2 EP ranks, not 4"},
  };
  for (const Case& c : cases) {
    Result<MapDocument> doc = LayOut(c.text, c.world);
    ASSERT_FALSE(doc.ok()) << c.says;
    EXPECT_EQ(doc.status().code(), StatusCode::kFailedPrecondition) << doc.status().ToString();
    EXPECT_THAT(doc.status().message(), HasSubstr(c.says));
  }
  // Linear takes the uneven count the contiguous family refuses.
  EXPECT_TRUE(LayOut(GateUp(R"({"family": "linear", "num_experts": 6})"), 4).ok());
}

TEST(StackedExpertsJsonTest, MalformedDescriptorsNameThePath) {
  struct Case {
    std::string text;
    const char* says;
  };
  const Case cases[] = {
      {GateUp(R"({"version": 1, "num_experts": 4, "ep_size": 2,
                  "ranks": [{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2]}]})"),
       "placement: expert 3 is on no EP rank"},
      {GateUp(R"({"version": 1, "num_experts": 4, "ep_size": 2,
                  "ranks": [{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2, 3, 2]}]})"),
       "placement: ranks[1].experts[2]: rank 1 names expert 2 twice"},
      {GateUp(R"({"family": "striped", "num_experts": 4})"), "placement.family: unknown"},
      {GateUp(R"({"family": "linear", "num_experts": 4, "ranks": []})"), "not both"},
      {GateUp(R"({"family": "linear", "num_experts": 0})"), "placement.num_experts"},
      {GateUp(R"({"family": "linear", "num_experts": 4})", 0), "tp"},
      {GateUp(R"({"family": "linear", "num_experts": 4})", 1, 1, "dp_fastest"), "rank_order"},
      {R"({"family": "stacked_experts", "buffer": "b", "dtype": "BF16", "placement":
           {"family": "linear", "num_experts": 2},
           "members": [{"name": "x.gate", "shape": [4, 6]}]})",
       "members[0].name: \"x.gate\" needs \"{e}\" once"},
      {R"({"family": "stacked_experts", "buffer": "b", "dtype": "BF16", "placement":
           {"family": "linear", "num_experts": 2},
           "members": [{"name": "x.{e}.gate", "shape": [4, 6], "split_dim": 2}]})",
       "members[0].split_dim: 2 is not a dimension of [4, 6]"},
      {R"({"family": "stacked_experts", "buffer": "b", "dtype": "BF17", "placement":
           {"family": "linear", "num_experts": 2},
           "members": [{"name": "x.{e}.gate", "shape": [4, 6]}]})",
       "dtype: unknown dtype"},
      {R"({"family": "stacked_experts", "buffer": "b", "dtype": "BF16", "placement":
           {"family": "linear", "num_experts": 2}, "bias": true,
           "members": [{"name": "x.{e}.gate", "shape": [4, 6]}]})",
       "bias"},
      {R"({"family": "stacked_experts", "buffer": "b", "dtype": "BF16", "placement":
           {"family": "linear", "num_experts": 2},
           "members": [{"name": "x.{e}.gate", "shape": [4, 6], "permutation": [0, 0]}]})",
       "members[0].permutation: expected a permutation"},
  };
  for (const Case& c : cases) {
    Result<std::vector<StackedExpertsDescriptor>> d = ParseStackedExpertsJson(c.text);
    ASSERT_FALSE(d.ok()) << c.says;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(), HasSubstr(c.says));
  }
}

TEST(StackedExpertsJsonTest, PlacementSpecsReadBothFormsAndRoundTrip) {
  Result<ExpertPlacementSpec> family =
      ParseExpertPlacementSpecJson(R"({"family": "round_robin", "num_experts": 5})");
  ASSERT_TRUE(family.ok()) << family.status().ToString();
  EXPECT_EQ(family->At(2)->experts, (std::vector<std::vector<int>>{{0, 2, 4}, {1, 3}}));
  EXPECT_EQ(*ParseExpertPlacementSpecJson(ExpertPlacementSpecToJson(*family)), *family);
  const ExpertPlacement redundant{3, {{0, 1}, {2, 0}}};
  Result<ExpertPlacementSpec> autoep =
      ParseExpertPlacementSpecJson(ExpertPlacementToJson(redundant));
  ASSERT_TRUE(autoep.ok()) << autoep.status().ToString();
  EXPECT_EQ(*autoep->At(2), redundant);
  EXPECT_EQ(autoep->At(3).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(IsStackedExpertsJson(R"({"family": "split"})"));
  EXPECT_TRUE(
      IsStackedExpertsJson("[" + GateUp(R"({"family": "linear", "num_experts": 2})") + "]"));
}

TEST(StackedExpertsJsonTest, DescriptorsOfSeveralBuffersMakeOneDocument) {
  const std::string down = R"({"family": "stacked_experts",
      "buffer": "model.layers.0.mlp.experts.down_proj", "dtype": "BF16",
      "members": [{"name": "model.layers.0.mlp.experts.{e}.down_proj.weight", "shape": [6, 4],
                   "split_dim": 1}],
      "placement": {"family": "linear", "num_experts": 4}, "tp": 2})";
  Result<MapDocument> doc =
      LayOut("[" + GateUp(R"({"family": "linear", "num_experts": 4})", 2) + ", " + down + "]", 4);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  EXPECT_EQ(doc->buffers.buffers().size(), 2u);
  EXPECT_EQ(doc->params.size(), 12u);
  Result<MapDocument> twice = LayOut("[" + down + ", " + down + "]", 4);
  ASSERT_FALSE(twice.ok());
  EXPECT_THAT(twice.status().message(), HasSubstr("described twice"));
}

// Random expert counts, EP sizes, expert TP and placements (families and explicit ones with
// empty ranks and redundant experts): the document is valid, its JSON reads back equal, and
// the descriptor's JSON reads back equal.
TEST(StackedExpertsJsonTest, RandomDescriptorsAreValidAndRoundTrip) {
  std::mt19937 rng(20);
  const char* families[] = {"contiguous", "linear", "round_robin"};
  for (int trial = 0; trial < 60; ++trial) {
    const int experts = 1 + static_cast<int>(rng() % 9);
    const int ep = 1 + static_cast<int>(rng() % 4);
    const int tp = 1 + static_cast<int>(rng() % 2);
    StackedExpertsDescriptor d;
    d.buffer = "layers.1.mlp.experts.gate_up_proj";
    d.tp = tp;
    d.dp = 1 + static_cast<int>(rng() % 2);
    d.tp_fastest = rng() % 2 == 0;
    d.members = {
        ExpertMember{"layers.1.mlp.experts.{e}.gate_proj.weight", {4, 3}, 0, 0, {}},
        ExpertMember{
            "layers.1.mlp.experts.{e}.up_proj.weight", {4, 3}, rng() % 3 == 0 ? -1 : 0, 0, {}}};
    if (rng() % 2 == 0) {
      d.placement.family = families[rng() % 3];
      d.placement.num_experts = experts * (d.placement.family == "contiguous" ? ep : 1);
    } else {
      ExpertPlacement p{experts, std::vector<std::vector<int>>(static_cast<size_t>(ep))};
      for (int e = 0; e < experts; ++e) {
        const size_t k = rng() % static_cast<size_t>(ep);
        p.experts[k].push_back(e);
        const size_t k2 = rng() % static_cast<size_t>(ep);  // a redundant copy, sometimes
        if (rng() % 3 == 0 && k2 != k) p.experts[k2].push_back(e);
      }
      d.placement.num_experts = experts;
      d.placement.explicit_placement = p;
    }
    const std::string text = StackedExpertsToJson(d);
    Result<std::vector<StackedExpertsDescriptor>> back = ParseStackedExpertsJson(text);
    ASSERT_TRUE(back.ok()) << text << back.status().ToString();
    ASSERT_EQ(back->size(), 1u);
    EXPECT_EQ((*back)[0], d) << text;
    const int world = ep * tp * d.dp;
    Result<MapDocument> doc = BuildStackedExpertsDocument(*back, world);
    ASSERT_TRUE(doc.ok()) << text << doc.status().ToString();
    const std::string json = MapDocumentToJson(*doc);
    Result<MapDocument> reread = ReadMapDocumentJson(json);
    ASSERT_TRUE(reread.ok()) << reread.status().ToString();
    EXPECT_EQ(reread->params, doc->params);
    EXPECT_EQ(reread->buffers, doc->buffers);
    // Every expert is drawn where the placement puts it.
    std::vector<NamedMapRef> refs;
    for (const auto& [n, m] : doc->params) refs.push_back({n, &m});
    Result<std::vector<BufferSummary>> view = SummarizeBuffers(doc->buffers, refs);
    ASSERT_TRUE(view.ok());
    ASSERT_EQ(view->size(), 1u);
    const BufferSummary& s = (*view)[0];
    ASSERT_TRUE(s.expert_columns());
    ASSERT_EQ(static_cast<int>(s.columns.size()), d.placement.num_experts);
    const ExpertPlacement placed = *d.placement.At(ep);
    for (int e = 0; e < d.placement.num_experts; ++e) {
      const std::vector<int> holders = placed.HoldersOf(e);
      EXPECT_EQ(s.columns[static_cast<size_t>(e)].holders.size(),
                holders.size() * static_cast<size_t>(tp * d.dp))
          << text;
    }
  }
}

MapDocument Redundant() {
  // 4 experts on 3 EP ranks, expert 0 on ranks 0 and 2 (a redundant copy), at expert TP 1.
  return *LayOut(GateUp(R"({"version": 1, "num_experts": 4, "ep_size": 3, "ranks": [
      {"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2]},
      {"rank": 2, "experts": [3, 0]}]})"),
                 3);
}

std::vector<BufferSummary> ViewOf(const MapDocument& doc) {
  std::vector<NamedMapRef> refs;
  for (const auto& [n, m] : doc.params) refs.push_back({n, &m});
  return *SummarizeBuffers(doc.buffers, refs);
}

TEST(BufferViewTest, RedundantExpertsAreMarkedInTheTable) {
  const std::vector<BufferSummary> view = ViewOf(Redundant());
  ASSERT_EQ(view.size(), 1u);
  const BufferSummary& s = view[0];
  EXPECT_EQ(s.members, (std::vector<std::string>{"model.layers.0.mlp.experts.{e}.gate_proj.weight",
                                                 "model.layers.0.mlp.experts.{e}.up_proj.weight"}));
  EXPECT_EQ(s.columns[0].holders, (std::vector<Rank>{0, 2}));
  EXPECT_EQ(s.cells[2][0].slots, (std::vector<Index>{1}));
  EXPECT_TRUE(s.cells[2][0].replicated);
  EXPECT_FALSE(s.cells[2][3].replicated);
  const std::vector<std::string> table = BufferTable(s, 64);
  const std::vector<std::string> expected = {
      "buffer \"model.layers.0.mlp.experts.gate_up_proj\" (BF16): 4 experts on 3 ranks; tensors "
      "model.layers.0.mlp.experts.{e}.gate_proj.weight, "
      "model.layers.0.mlp.experts.{e}.up_proj.weight",
      "  rank  buffer shape        experts in slot order",
      "     0  [2, 8, 6]           0 1",
      "     1  [1, 8, 6]           2",
      "     2  [2, 8, 6]           3 0",
      "  expert 0 is replicated: held 2x, on ranks 0, 2",
      "  holders (row = rank, column = expert; the slot it is in, ~ part of it, + also on "
      "another rank, . none):",
      "    expert  0  1  2  3",
      "    rank 0 0+  1  .  .",
      "    rank 1  .  .  0  .",
      "    rank 2 1+  .  .  0",
  };
  EXPECT_EQ(table, expected);
}

TEST(BufferViewTest, TpSlicesArePartialCellsAndTheTableWraps) {
  Result<MapDocument> doc = LayOut(GateUp(R"({"family": "round_robin", "num_experts": 12})", 2), 4);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  const BufferSummary s = ViewOf(*doc)[0];
  // Rank 1 is tp rank 1 of EP rank 0: the second half of rows of experts 0, 2, 4, ...
  const BufferCell& c = s.cells[1][2];
  EXPECT_EQ(c.slots, (std::vector<Index>{1}));
  EXPECT_TRUE(c.partial(s.columns[2]));
  ASSERT_EQ(s.columns[2].sample_rows, 4);
  ASSERT_EQ(s.columns[2].sample_cols, 6);
  for (int a = 0; a < 4; ++a) EXPECT_EQ(c.samples[static_cast<size_t>(a * 6)], a >= 2) << a;
  const std::vector<std::string> table = BufferTable(s, 40);
  EXPECT_THAT(table[2], HasSubstr("0 2 4 6 8 10  (part of each: a TP slice)"));
  // 12 cells of 2 characters and a space, in 40 characters less the rank labels: two blocks.
  int headers = 0;
  for (const std::string& line : table) headers += line.starts_with("    expert");
  EXPECT_EQ(headers, 2);
}

TEST(BufferViewTest, SvgIsDeterministicAndMarksReplicas) {
  const std::vector<BufferSummary> view = ViewOf(Redundant());
  const std::string svg = BuffersSvg(view);
  EXPECT_EQ(svg, BuffersSvg(ViewOf(Redundant())));
  EXPECT_TRUE(svg.starts_with("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg "));
  EXPECT_TRUE(svg.ends_with("</svg>\n"));
  // Expert 0 is hatched on ranks 0 and 2 only: one hatch overlay per replica.
  size_t hatches = 0;
  for (size_t at = svg.find("url(#replica)\"/>"); at != std::string::npos;
       at = svg.find("url(#replica)\"/>", at + 1)) {
    ++hatches;
  }
  EXPECT_EQ(hatches, 2u);
  EXPECT_THAT(svg, HasSubstr("<title>rank 2, expert 0, slot 1, 48 of 48 elements, replicated "
                             "on ranks 0, 2</title>"));
  EXPECT_THAT(svg, HasSubstr("<title>rank 1, expert 0: not held</title>"));
}

TEST(BufferViewTest, LayersLaidOutAlikeAreDrawnOnce) {
  // Layers 0 and 1 round robin, layer 2 contiguous: two layouts.
  auto layer = [](int l, std::string_view family) {
    std::string d = GateUp(fmt::format(R"({{"family": "{}", "num_experts": 4}})", family));
    const std::string to = fmt::format("layers.{}.", l);
    for (size_t at = d.find("layers.0."); at != std::string::npos;
         at = d.find("layers.0.", at + to.size())) {
      d.replace(at, 9, to);
    }
    return d;
  };
  Result<MapDocument> doc = LayOut("[" + layer(0, "round_robin") + ", " + layer(1, "round_robin") +
                                       ", " + layer(2, "contiguous") + "]",
                                   2);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  const std::vector<BufferSummary> all = ViewOf(*doc);
  ASSERT_EQ(all.size(), 3u);
  const std::vector<BufferSummary> drawn = MergeSameLayouts(all);
  ASSERT_EQ(drawn.size(), 2u);
  EXPECT_EQ(drawn[0].name, "model.layers.0.mlp.experts.gate_up_proj");
  EXPECT_EQ(drawn[0].same_layout,
            (std::vector<std::string>{"model.layers.1.mlp.experts.gate_up_proj"}));
  EXPECT_TRUE(drawn[1].same_layout.empty());
  EXPECT_EQ(BufferTable(drawn[0])[1],
            "  and 1 more buffer(s) laid out the same: model.layers.1.mlp.experts.gate_up_proj");
}

TEST(BufferViewTest, SvgEscapesNames) {
  std::vector<BufferSummary> view = ViewOf(Redundant());
  view[0].name = "a<b>&\"c\"";
  const std::string svg = BuffersSvg(view);
  EXPECT_THAT(svg, HasSubstr("a&lt;b&gt;&amp;&quot;c&quot;"));
  EXPECT_EQ(svg.find("a<b>"), std::string::npos);
}

// Laying out many experts, or a few over a large world, costs in proportion to the maps it
// writes. Each expert's holders were found by scanning the placement and each rank's (and
// each tensor's) key appended by searching the keys before it: 4 experts at world 65 536 took
// 16 s of CPU, 10^5 experts at world 2 minutes. The first takes about a second now.
TEST(StackedExpertsDeathTest, LayingOutIsLinearInExpertsAndInTheWorld) {
  const auto lay_out = [](int experts, std::string_view family, int world) {
    const std::string text = fmt::format(
        R"({{"family": "stacked_experts", "buffer": "b", "dtype": "F32",
            "members": [{{"name": "x.{{e}}.w", "shape": [2, 2]}}],
            "placement": {{"family": "{}", "num_experts": {}}}}})",
        family, experts);
    Result<MapDocument> doc = LayOut(text, world);
    return doc.ok() && doc->params.size() == static_cast<size_t>(experts) &&
           !MapDocumentToJson(*doc).empty();
  };
  EXPECT_EXIT(test_support::RunUnderCpuLimit(
                  10,
                  [&] {
                    return lay_out(4, "linear", test_support::CostInput(65536)) &&
                           lay_out(test_support::CostInput(10240), "contiguous", 2);
                  }),
              ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace reshard
