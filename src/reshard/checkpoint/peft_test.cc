#include "reshard/checkpoint/peft.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

// Rank j's rows of an [rows, 3] weight at world 2, flattened into one run, at row `at` of the
// buffer "L.qkv.weight" ([3, 3] on each rank).
ParamMap FlatRows(Index rows, Index at) {
  ParamMapBuilder b;
  b.set_logical_shape({rows, 3}).set_world_size(2);
  for (Rank j = 0; j < 2; ++j) {
    b.set_shard_shape(j, {3, 3}).set_buffer(j, "L.qkv.weight");
    b.add_piece(j, Piece{{rows / 2 * 3}, {j * rows / 2 * 3, {1}}, {at * 3, {1}}, {j}, 1.0});
  }
  return *b.Finalize();
}

MapDocument FusedBase() {
  MapDocument doc;
  doc.params.emplace_back("L.q.weight", FlatRows(4, 0));
  doc.params.emplace_back("L.k.weight", FlatRows(2, 2));
  BufferSetBuilder buffers;
  buffers.add({"L.qkv.weight", DType::kF32, {{{3, 3}, {}}, {{3, 3}, {}}}, 0.0});
  std::vector<NamedMapRef> refs;
  for (const auto& [name, map] : doc.params) refs.push_back({name, &map});
  doc.buffers = *buffers.Finalize(refs);
  return doc;
}

const ParamMap& MapOf(const MapDocument& doc, const std::string& name) {
  for (const auto& [n, map] : doc.params) {
    if (n == name) return map;
  }
  ADD_FAILURE() << "no map for " << name;
  return doc.params.front().second;
}

TEST(LoraMapsFromBaseTest, FusedRowsStackBAsTheBaseRowsAndKeepAWhole) {
  const std::vector<LoraTensorToLay> tensors = {
      {"base_model.model.L.q.lora_A.weight", DType::kF32, {2, 3}},
      {"base_model.model.L.q.lora_B.weight", DType::kF32, {4, 2}},
      {"base_model.model.L.k.lora_A.weight", DType::kF32, {2, 3}},
      {"base_model.model.L.k.lora_B.weight", DType::kF32, {2, 2}},
  };
  Result<MapDocument> doc = LoraMapsFromBase(tensors, false, FusedBase());
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  const std::string buffer = "base_model.model.L.qkv.lora_B.weight";
  const ParamMap& k_b = MapOf(*doc, "base_model.model.L.k.lora_B.weight");
  EXPECT_EQ(k_b.buffer(1), buffer);
  ASSERT_EQ(k_b.rank(1).pieces.size(), 1u);
  const Piece& p = k_b.rank(1).pieces[0];
  EXPECT_EQ(p.shape, (Shape{1, 2}));
  EXPECT_EQ(p.source, (StridedView{2, {2, 1}}));  // row 1 of k's B
  EXPECT_EQ(p.dest, (StridedView{4, {2, 1}}));    // row 2 of the buffer, after q's two
  const ParamMap& q_a = MapOf(*doc, "base_model.model.L.q.lora_A.weight");
  EXPECT_FALSE(q_a.rank(0).is_buffered());
  EXPECT_EQ(q_a.rank(0).shard_shape, (Shape{2, 3}));
  EXPECT_EQ(q_a.rank(0).pieces.at(0).locations, (std::vector<Rank>{0, 1}));
  ASSERT_NE(doc->buffers.Find(buffer), nullptr);
  EXPECT_EQ(doc->buffers.Find(buffer)->ranks[1].shape, (Shape{3, 2}));
  EXPECT_TRUE(doc->buffers.Find(buffer)->ranks[1].padding.empty());
}

TEST(LoraMapsFromBaseTest, AnUntargetedFusedWeightLeavesPaddingRows) {
  const std::vector<LoraTensorToLay> tensors = {
      {"base_model.model.L.k.lora_A.weight", DType::kF32, {2, 3}},
      {"base_model.model.L.k.lora_B.weight", DType::kF32, {2, 2}},
  };
  Result<MapDocument> doc = LoraMapsFromBase(tensors, false, FusedBase());
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  const BufferDecl* decl = doc->buffers.Find("base_model.model.L.qkv.lora_B.weight");
  ASSERT_NE(decl, nullptr);
  ASSERT_EQ(decl->ranks[0].padding.size(), 1u);
  EXPECT_EQ(decl->ranks[0].padding[0].shape, (Shape{2, 2}));  // q's two rows
  EXPECT_EQ(decl->ranks[0].padding[0].view, (StridedView{0, {2, 1}}));
}

TEST(LoraMapsFromBaseTest, APieceThatIsNoBlockOfRowsAndColumnsIsRefused) {
  // W [2, 2] whole on one rank, stored transposed.
  ParamMapBuilder b;
  b.set_logical_shape({2, 2}).set_world_size(1).set_shard_shape(0, {2, 2});
  b.add_piece(0, Piece{{2, 2}, {0, {2, 1}}, {0, {1, 2}}, {0}, 1.0});
  MapDocument base;
  base.params.emplace_back("L.o.weight", *b.Finalize());
  Result<MapDocument> doc =
      LoraMapsFromBase({{"base_model.model.L.o.lora_B.weight", DType::kF32, {2, 1}}}, false, base);
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(doc.status().message().find("piece 0 of rank 0 of its base weight \"L.o.weight\""),
            std::string::npos)
      << doc.status().ToString();
  Result<MapDocument> missing =
      LoraMapsFromBase({{"base_model.model.L.x.lora_B.weight", DType::kF32, {2, 1}}}, false, base);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("\"L.x.weight\""), std::string::npos);
}

LoraConfig ConfigOf(const std::string& json) {
  Result<LoraConfig> c = ParseLoraConfigJson(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : LoraConfig{};
}

bool Targets(const LoraConfig& c, const std::string& module) {
  Result<bool> t = LoraTargetsModule(c, module);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() && *t;
}

// As PEFT's check_target_module_exists selects modules.
TEST(LoraTargetsModuleTest, SelectsModulesAsPeftDoes) {
  const std::string head = R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, )";
  const LoraConfig list = ConfigOf(head + R"("target_modules": ["q_proj", "model.lm_head"]})");
  EXPECT_TRUE(Targets(list, "model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(Targets(list, "q_proj"));
  EXPECT_TRUE(Targets(list, "model.lm_head"));
  EXPECT_FALSE(Targets(list, "model.layers.0.self_attn.xq_proj"));
  EXPECT_FALSE(Targets(list, "model.layers.0.self_attn.v_proj"));
  const LoraConfig regex = ConfigOf(head + R"("target_modules": ".*\\.(q|v)_proj"})");
  EXPECT_TRUE(Targets(regex, "model.layers.3.self_attn.v_proj"));
  EXPECT_FALSE(Targets(regex, "model.layers.3.self_attn.v_proj.x"));  // the whole name
  const LoraConfig layers = ConfigOf(
      head +
      R"("target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "layers"})");
  EXPECT_TRUE(Targets(layers, "model.layers.1.self_attn.q_proj"));
  EXPECT_FALSE(Targets(layers, "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(Targets(layers, "model.layers.11.self_attn.q_proj"));
  // No pattern: the first number after a name that another name follows.
  const LoraConfig any =
      ConfigOf(head + R"("target_modules": ["q_proj"], "layers_to_transform": 0})");
  EXPECT_TRUE(Targets(any, "model.layers.0.experts.3.q_proj"));
  EXPECT_FALSE(Targets(any, "model.layers.2.experts.0.q_proj"));
  const LoraConfig excluded = ConfigOf(
      head + R"("target_modules": ".*_proj", "exclude_modules": ["layers.0.self_attn.q_proj"]})");
  EXPECT_FALSE(Targets(excluded, "model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(Targets(excluded, "model.layers.1.self_attn.q_proj"));
  const LoraConfig saved = ConfigOf(
      head + R"("target_modules": ["lm_head", "q_proj"], "modules_to_save": ["lm_head"]})");
  EXPECT_FALSE(Targets(saved, "lm_head"));
  EXPECT_TRUE(Targets(saved, "model.q_proj"));
  EXPECT_TRUE(Targets(ConfigOf(head + R"("target_modules": null})"), "anything"));
  Result<bool> unreadable =
      LoraTargetsModule(ConfigOf(head + R"j("target_modules": "(?P<x>q)"})j"), "q");
  ASSERT_FALSE(unreadable.ok());
  EXPECT_EQ(unreadable.status().code(), StatusCode::kFailedPrecondition);
}

// Before: a second A (or B) of a module replaced the first, an embedding's B paired with a
// linear layer's A, and of two whole copies of a weight the later one was merged.
TEST(CheckLoraTensorsTest, RefusesAModuleTwiceAndTensorsPeftWouldNotLoad) {
  const LoraConfig c =
      ConfigOf(R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q", "e"]})");
  const std::string q = "base_model.model.m.q";
  auto code = [&](std::vector<std::pair<std::string, Shape>> tensors) {
    return CheckLoraTensors(c, tensors).code();
  };
  EXPECT_EQ(code({{q + ".lora_A.weight", {2, 4}}, {q + ".lora_B.weight", {4, 2}}}),
            StatusCode::kOk);
  EXPECT_EQ(code({{q + ".lora_A.weight", {2, 4}},
                  {q + ".lora_embedding_A", {2, 4}},
                  {q + ".lora_B.weight", {4, 2}}}),
            StatusCode::kDataLoss);
  EXPECT_EQ(code({{q + ".lora_A.weight", {2, 4}}, {q + ".lora_embedding_B", {4, 2}}}),
            StatusCode::kDataLoss);
  EXPECT_EQ(code({{"base_model.model.m.e.base_layer.weight", {8, 4}},
                  {"base_model.model.m.e.weight", {8, 4}}}),
            StatusCode::kDataLoss);
  EXPECT_EQ(code({{"base_model.model.m.v.lora_A.weight", {2, 4}},
                  {"base_model.model.m.v.lora_B.weight", {4, 2}}}),
            StatusCode::kDataLoss);
  EXPECT_EQ(code({{q + ".lora_A.weight", {2, 4}},
                  {q + ".lora_B.weight", {4, 2}},
                  {q + ".weight", {4, 4}}}),
            StatusCode::kDataLoss);
}

}  // namespace
}  // namespace reshard
