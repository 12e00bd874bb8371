// Buffers (ir/buffer_set.h): maps of several tensors over one rank tensor, validated together.
#include "reshard/ir/buffer_set.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "reshard/ir/compose.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/plan_json.h"

namespace reshard {
namespace {

using ::testing::HasSubstr;

// q [8, 4], k [4, 4], v [4, 4] split by rows over 2 ranks, each rank's slices stacked in one
// buffer "qkv" [8, 4]: q rows then k rows then v rows (vLLM's qkv_proj).
ParamMap RowsInto(const std::string& buffer, Index rows, Index cols, Index dest_row, int world,
                  Index buffer_rows) {
  ParamMapBuilder b;
  b.set_logical_shape({rows, cols});
  b.set_world_size(world);
  const Index per = rows / world;
  for (Rank r = 0; r < world; ++r) {
    b.set_shard_shape(r, {buffer_rows, cols});
    b.set_buffer(r, buffer);
    b.add_piece(r,
                Piece{{per, cols}, {r * per * cols, {cols, 1}}, {dest_row * cols, {cols, 1}}, {r}});
  }
  Result<ParamMap> m = b.Finalize();
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *m;
}

struct Qkv {
  ParamMap q = RowsInto("qkv", 8, 4, 0, 2, 8);
  ParamMap k = RowsInto("qkv", 4, 4, 4, 2, 8);
  ParamMap v = RowsInto("qkv", 4, 4, 6, 2, 8);
  std::vector<NamedMapRef> refs() const { return {{"q", &q}, {"k", &k}, {"v", &v}}; }
};

BufferDecl QkvDecl(Index rows = 8) {
  return BufferDecl{"qkv", DType::kF32, {{{rows, 4}, {}}, {{rows, 4}, {}}}};
}

TEST(BufferSetTest, FusedQkvIsExact) {
  Qkv qkv;
  Result<BufferSet> set = BufferSetBuilder().add(QkvDecl()).Finalize(qkv.refs());
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->world_size(), 2);
  ASSERT_NE(set->Find("qkv"), nullptr);
  EXPECT_EQ(set->Find("other"), nullptr);
}

TEST(BufferSetTest, AMapAloneMayLeaveTheBufferToOthers) {
  // One map over a buffer validates on its own: gaps are other maps' elements.
  EXPECT_TRUE(Qkv().q.has_buffers());
  EXPECT_EQ(Qkv().q.buffer(1), "qkv");
}

TEST(BufferSetTest, AMissingMapLeavesAGapNamedByElement) {
  Qkv qkv;
  std::vector<NamedMapRef> refs = {{"q", &qkv.q}, {"k", &qkv.k}};
  Result<BufferSet> set = BufferSetBuilder().add(QkvDecl()).Finalize(refs);
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(set.status().message(),
              HasSubstr("buffers[\"qkv\"].ranks[\"0\"]: element [6, 0] (shape [8, 4]) is "
                        "written by no map and is not declared padding"));
}

TEST(BufferSetTest, TwoMapsWritingOneElementAreNamed) {
  Qkv qkv;
  ParamMap v_over_k = RowsInto("qkv", 4, 4, 5, 2, 8);  // rows 5..6 overlap k's 4..5
  std::vector<NamedMapRef> refs = {{"q", &qkv.q}, {"k", &qkv.k}, {"v", &v_over_k}};
  Result<BufferSet> set = BufferSetBuilder().add(QkvDecl()).Finalize(refs);
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(set.status().message(),
              HasSubstr("element [5, 0] is written by params[\"k\"].ranks[\"0\"].pieces[0] and by "
                        "params[\"v\"].ranks[\"0\"].pieces[0]"));
}

TEST(BufferSetTest, DeclaredPaddingFillsTheRest) {
  Qkv qkv;
  BufferDecl decl = QkvDecl(10);  // two rows of alignment after v
  for (BufferRank& r : decl.ranks) r.padding.push_back({{2, 4}, {32, {4, 1}}});
  ParamMap q = RowsInto("qkv", 8, 4, 0, 2, 10);
  ParamMap k = RowsInto("qkv", 4, 4, 4, 2, 10);
  ParamMap v = RowsInto("qkv", 4, 4, 6, 2, 10);
  std::vector<NamedMapRef> refs = {{"q", &q}, {"k", &k}, {"v", &v}};
  EXPECT_TRUE(BufferSetBuilder().add(decl).Finalize(refs).ok());
  // Padding over data is a double write.
  decl.ranks[1].padding[0].view.offset = 28;
  Result<BufferSet> set = BufferSetBuilder().add(decl).Finalize(refs);
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(set.status().message(), HasSubstr("buffers[\"qkv\"].ranks[\"1\"].padding[0]"));
  // Padding past the end.
  decl.ranks[1].padding[0].view.offset = 36;
  set = BufferSetBuilder().add(decl).Finalize(refs);
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), StatusCode::kOutOfRange);
}

TEST(BufferSetTest, DeclarationsMustFitTheMaps) {
  Qkv qkv;
  // Not declared.
  Result<BufferSet> set = BufferSetBuilder().Finalize(qkv.refs());
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(set.status().message(), HasSubstr("buffer \"qkv\" is not declared"));
  // Another shape.
  set = BufferSetBuilder().add(QkvDecl(9)).Finalize(qkv.refs());
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(set.status().message(), HasSubstr("shard_shape [8, 4] but buffer \"qkv\" has shape "
                                                "[9, 4] on that rank"));
  // Another dtype.
  const std::vector<DType> dtypes = {DType::kBF16, DType::kF32, DType::kF32};
  set = BufferSetBuilder().add(QkvDecl()).Finalize(qkv.refs(), dtypes);
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(set.status().message(), HasSubstr("params[\"q\"] is BF16 but buffer \"qkv\" is F32"));
  // Declared twice; another world.
  set = BufferSetBuilder().add(QkvDecl()).add(QkvDecl()).Finalize(qkv.refs());
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(set.status().message(), HasSubstr("declared twice"));
  BufferDecl three = QkvDecl();
  three.ranks.push_back(three.ranks[0]);
  set = BufferSetBuilder().add(three).Finalize(qkv.refs());
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(set.status().message(), HasSubstr("has 2 ranks but its buffers have 3"));
}

TEST(BufferSetTest, AMapWritingItsBufferTwiceIsRefusedAlone) {
  ParamMapBuilder b;
  b.set_logical_shape({4, 4}).set_world_size(1).set_shard_shape(0, {8, 4}).set_buffer(0, "qkv");
  b.add_piece(0, Piece{{2, 4}, {0, {4, 1}}, {0, {4, 1}}, {0}});
  b.add_piece(0, Piece{{2, 4}, {8, {4, 1}}, {4, {4, 1}}, {0}});
  Result<ParamMap> m = b.Finalize();
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("is written by pieces 0 and 1"));
  // More elements than the buffer has.
  ParamMapBuilder big;
  big.set_logical_shape({4, 4}).set_world_size(1).set_shard_shape(0, {2, 4}).set_buffer(0, "b");
  big.add_piece(0, Piece{{4, 4}, {0, {4, 1}}, {0, {4, 1}}, {0}});
  m = big.Finalize();
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("dest view ends at offset 16 but the shard has 8"));
}

TEST(BufferSetTest, DocumentRoundTripsAtVersionTwo) {
  MapDocument doc;
  BufferDecl decl = QkvDecl(10);
  for (BufferRank& r : decl.ranks) r.padding.push_back({{2, 4}, {32, {4, 1}}});
  ParamMap q = RowsInto("qkv", 8, 4, 0, 2, 10);
  ParamMap k = RowsInto("qkv", 4, 4, 4, 2, 10);
  ParamMap v = RowsInto("qkv", 4, 4, 6, 2, 10);
  doc.params = {{"q", q}, {"k", k}, {"buffers", v}};  // a parameter may be named "buffers"
  ASSERT_TRUE(ValidateBuffers(doc, BufferSetBuilder().add(decl)).ok());
  const std::string text = MapDocumentToJson(doc);
  EXPECT_THAT(text, HasSubstr("\"version\": 2"));
  EXPECT_THAT(text, HasSubstr("\"buffer\": \"qkv\""));
  EXPECT_THAT(text, HasSubstr("\"^buffers$\""));
  Result<MapDocument> back = ReadMapDocumentJson(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->buffers, doc.buffers);
  EXPECT_EQ(MapDocumentToJson(*back), text);
  // A version-1 document does not declare buffers, so its buffered maps do not validate.
  std::string v1 = text;
  v1.replace(v1.find("\"version\": 2"), 12, "\"version\": 1");
  Result<MapDocument> refused = ReadMapDocumentJson(v1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
}

TEST(BufferSetTest, PlansNameTheirBuffers) {
  // q at TP 2 inside qkv -> q at TP 1 as its own tensor.
  Qkv qkv;
  ParamMapBuilder one;
  one.set_logical_shape({8, 4}).set_world_size(1).set_shard_shape(0, {8, 4});
  one.add_piece(0, Piece{{8, 4}, {0, {4, 1}}, {0, {4, 1}}, {0}});
  Result<ParamMap> whole = one.Finalize();
  ASSERT_TRUE(whole.ok());
  Result<ParamPlan> plan = Compose(*whole, qkv.q);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->moves.size(), 2u);
  EXPECT_EQ(plan->src_buffer(plan->moves[1]), "qkv");
  EXPECT_EQ(plan->dst_buffer(plan->moves[1]), "");
  PlanDocument doc;
  doc.params = {{"q", *plan}};
  EXPECT_THAT(PlanDocumentToJson(doc), HasSubstr("\"src_buffer\": \"qkv\""));
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {

std::vector<uint8_t> Bytes(DType dtype, double value) {
  Result<std::vector<std::byte>> b = ElementBytes(dtype, value);
  if (!b.ok()) return {};
  std::vector<uint8_t> out;
  for (std::byte x : *b) out.push_back(static_cast<uint8_t>(x));
  return out;
}

TEST(BufferFillTest, ElementBytesAreExactOrRefused) {
  EXPECT_EQ(Bytes(DType::kF32, 1.0), (std::vector<uint8_t>{0x00, 0x00, 0x80, 0x3f}));
  EXPECT_EQ(Bytes(DType::kBF16, 1.0), (std::vector<uint8_t>{0x80, 0x3f}));
  EXPECT_EQ(Bytes(DType::kBF16, -2.0), (std::vector<uint8_t>{0x00, 0xc0}));
  EXPECT_EQ(Bytes(DType::kF16, 1.0), (std::vector<uint8_t>{0x00, 0x3c}));
  EXPECT_EQ(Bytes(DType::kF16, 0.5), (std::vector<uint8_t>{0x00, 0x38}));
  EXPECT_EQ(Bytes(DType::kF16, 65504.0), (std::vector<uint8_t>{0xff, 0x7b}));
  EXPECT_EQ(Bytes(DType::kF16, std::ldexp(1.0, -24)), (std::vector<uint8_t>{0x01, 0x00}));
  EXPECT_EQ(Bytes(DType::kF64, 1.0), (std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 0xf0, 0x3f}));
  EXPECT_EQ(Bytes(DType::kI16, -2.0), (std::vector<uint8_t>{0xfe, 0xff}));
  EXPECT_EQ(Bytes(DType::kU8, 255.0), (std::vector<uint8_t>{0xff}));
  EXPECT_EQ(Bytes(DType::kBool, 1.0), (std::vector<uint8_t>{0x01}));
  for (auto [dtype, value] :
       {std::pair{DType::kBF16, 0.1}, std::pair{DType::kF32, 0.1}, std::pair{DType::kF16, 65536.0},
        std::pair{DType::kF16, 1.0 / 3}, std::pair{DType::kU8, 256.0}, std::pair{DType::kU8, -1.0},
        std::pair{DType::kI64, std::ldexp(1.0, 63)}, std::pair{DType::kI32, 1.5},
        std::pair{DType::kBool, 2.0}, std::pair{DType::kF8E4M3, 1.0}}) {
    Result<std::vector<std::byte>> b = ElementBytes(dtype, value);
    EXPECT_FALSE(b.ok()) << DTypeName(dtype) << " " << value;
  }
  EXPECT_EQ(ElementBytes(DType::kBF16, 0.1).status().message(), "0.1 is not exactly a BF16 value");
}

// vLLM's attention scale: a scalar no checkpoint has, on every rank, all padding, fill 1.
BufferDecl ScaleDecl(double fill, DType dtype = DType::kF32) {
  BufferDecl d{"attn._k_scale", dtype, {}};
  d.fill = fill;
  for (int r = 0; r < 2; ++r) d.ranks.push_back({{}, {BufferBlock{{}, {0, {}}}}});
  return d;
}

TEST(BufferFillTest, AConstantBufferIsAllPaddingAndRoundTripsWithItsFill) {
  Result<BufferSet> set = BufferSetBuilder().add(ScaleDecl(1.0)).Finalize({});
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  const std::string text = BufferSetToJson(*set);
  EXPECT_THAT(text, HasSubstr("\"fill\": 1"));
  Result<BufferSetBuilder> back = ParseBufferSetJson(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  Result<BufferSet> again = back->Finalize({});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, *set);
  EXPECT_EQ(again->Find("attn._k_scale")->fill, 1.0);
  // Fill 0 is the default and not written.
  EXPECT_THAT(BufferSetToJson(*BufferSetBuilder().add(ScaleDecl(0.0)).Finalize({})),
              ::testing::Not(HasSubstr("fill")));
}

TEST(BufferFillTest, NegativeZeroIsAFillOfItsOwnAndKeepsItsSign) {
  Result<BufferSet> set = BufferSetBuilder().add(ScaleDecl(-0.0)).Finalize({});
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  const std::string text = BufferSetToJson(*set);
  EXPECT_THAT(text, HasSubstr("\"fill\": -0.0"));
  Result<BufferSetBuilder> back = ParseBufferSetJson(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  Result<BufferSet> again = back->Finalize({});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(std::signbit(again->Find("attn._k_scale")->fill));
}

TEST(BufferFillTest, AFillTheDtypeCannotHoldIsRefused) {
  Result<BufferSet> set = BufferSetBuilder().add(ScaleDecl(0.1, DType::kBF16)).Finalize({});
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().message(),
            "buffers[\"attn._k_scale\"].fill: 0.1 is not exactly a BF16 value");
  // A fill that is no number (null included: it is not the default 0), or a literal a double
  // cannot hold (1e-400 would read as 0, 1e400 as infinity), is refused.
  for (const char* fill : {R"("one")", "null", "true", "[0]", "1e-400", "-1e-400", "1e400"}) {
    const Result<BufferSetBuilder> parsed = ParseBufferSetJson(fmt::format(
        R"({{"b": {{"dtype": "F32", "fill": {}, "ranks": {{"0": {{"shape": []}}}}}}}})", fill));
    ASSERT_FALSE(parsed.ok()) << fill;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << fill;
    // The path, or (past a double's range: the parser's own refusal) the literal.
    EXPECT_THAT(parsed.status().message(),
                HasSubstr(std::string_view(fill) == "1e400" ? "1e400" : "fill"))
        << fill;
  }
}

}  // namespace
}  // namespace reshard
