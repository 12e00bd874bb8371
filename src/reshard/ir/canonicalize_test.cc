#include "reshard/ir/canonicalize.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "reshard/ir/buffer_set.h"
#include "reshard/ir/fixtures.h"
#include "reshard/ir/infer.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/random_map.h"

namespace reshard {
namespace {

using fixtures::MakePiece;

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::filesystem::path DataDir() {
  const char* src = std::getenv("RESHARD_SOURCE_DIR");
  return std::filesystem::path(src ? src : ".") / "tests" / "data" / "deepspeed";
}

std::vector<Index> PiecesPerRank(const ParamMap& m) {
  std::vector<Index> out;
  for (const RankShard& r : m.ranks()) out.push_back(static_cast<Index>(r.pieces.size()));
  return out;
}

// Expanding the inferred map gives back exactly the observation.
void ExpectSameIndexMaps(const IndexMaps& want, const ParamMap& got) {
  IndexMaps back = ToIndexMaps(got);
  ASSERT_EQ(back.ranks.size(), want.ranks.size());
  for (const ObservedShard& w : want.ranks) {
    const ObservedShard& b = back.ranks[static_cast<size_t>(w.rank)];
    EXPECT_EQ(b.shard_shape, w.shard_shape) << "rank " << w.rank;
    EXPECT_EQ(b.index_map, w.index_map) << "rank " << w.rank;
  }
}

// CodeGen's fused QKV as DeepSpeed shards it (3 * hidden rows, mp_num 4): F is 4 blocks of
// 3 * hidden / 4 rows; inside a block, row c * (hidden / 4) + b for c < 3, b < hidden / 4; a
// rank takes 4 / tp consecutive blocks and stores each b-major. The last row of one block and
// the first of the next are adjacent in F, the trap for greedy run merging.
IndexMaps CodeGenObservation(Index hidden, int tp, Index cols) {
  const Index rows = 3 * hidden;
  const Index blocks = 4 / tp;
  const Index quarter = hidden / 4;
  ParamMapBuilder b;
  b.set_logical_shape({rows, cols});
  for (Rank r = 0; r < tp; ++r) {
    b.set_shard_shape(r, {rows / tp, cols});
    const Shape shape = {blocks, quarter, 3, cols};
    b.add_piece(r, MakePiece(shape, r * blocks * 3 * quarter * cols,
                             {3 * quarter * cols, cols, quarter * cols, 1}, 0,
                             RowMajorStrides(shape), {r}));
  }
  Result<ParamMap> m = b.Finalize();
  EXPECT_TRUE(m.ok()) << m.status().message();
  return ToIndexMaps(*m);
}

TEST(InferTest, DeepSpeedPartitionsFoldToTheirMinimalPieceCounts) {
  struct Case {
    const char* file;
    std::vector<Index> pieces;
  };
  const Case cases[] = {
      {"column_dim0__F16x4__tp2__even.json", {1, 1}},
      {"column_dim0__F10x4__tp4__uneven.json", {1, 1, 1, 1}},
      {"column_dim0__F12x4__tp4__kv3.json", {1, 1, 1, 0}},
      {"row_dim1__F4x16__tp2__even.json", {1, 1}},
      {"row_dim1__F4x10__tp4__uneven.json", {1, 1, 1, 1}},
      {"bigcodetype__F48x8__tp1.json", {1}},
      {"bigcodetype__F48x8__tp2.json", {2, 2}},
      {"bigcodetype__F48x8__tp4.json", {2, 2, 2, 2}},
      {"bigcodetype.bias__F48__tp4.json", {2, 2, 2, 2}},
      {"codegentype__F24x8__tp1.json", {1}},
      {"codegentype__F24x8__tp2.json", {1, 1}},
      {"codegentype__F48x8__tp2.json", {1, 1}},
      {"yuan_value_dim0__F32x8__tp1.json", {1}},
      {"yuan_value_dim0__F32x8__tp2.json", {1, 1}},
      {"yuan_value_dim0__F32x8__tp4.json", {1, 1, 1, 1}},
      {"yuan_oproj_dim1__F8x32__tp2.json", {1, 1}},
      {"yuan_oproj_dim1__F8x32__tp4.json", {1, 1, 1, 1}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file);
    Result<IndexMaps> observed = ParseIndexMapsJson(ReadFile(DataDir() / c.file));
    ASSERT_TRUE(observed.ok()) << observed.status().message();
    Result<ParamMap> m = Infer(*observed);
    ASSERT_TRUE(m.ok()) << m.status().message();
    EXPECT_EQ(PiecesPerRank(*m), c.pieces) << ParamMapToJson(*m);
    ExpectSameIndexMaps(*observed, *m);
  }
}

TEST(InferTest, CodeGenIsOneFourDimensionalPiecePerRankAtEveryHiddenSize) {
  for (Index hidden : {8, 16, 32, 64, 256}) {
    for (int tp : {1, 2, 4}) {
      SCOPED_TRACE(testing::Message() << "hidden " << hidden << " tp " << tp);
      IndexMaps observed = CodeGenObservation(hidden, tp, 8);
      Result<ParamMap> m = Infer(observed);
      ASSERT_TRUE(m.ok()) << m.status().message();
      EXPECT_EQ(PiecesPerRank(*m), std::vector<Index>(static_cast<size_t>(tp), 1))
          << ParamMapToJson(*m);
      ExpectSameIndexMaps(observed, *m);
    }
  }
}

TEST(InferTest, CodeGenDesignExampleHasShapeTwoTwoThreeEight) {
  Result<IndexMaps> observed =
      ParseIndexMapsJson(ReadFile(DataDir() / "codegentype__F24x8__tp2.json"));
  ASSERT_TRUE(observed.ok());
  Result<ParamMap> m = Infer(*observed);
  ASSERT_TRUE(m.ok()) << m.status().message();
  const Piece& p = m->rank(1).pieces.at(0);
  EXPECT_EQ(p.shape, (Shape{2, 2, 3, 8}));
  EXPECT_EQ(p.source, (StridedView{96, {48, 8, 16, 1}}));
  EXPECT_EQ(p.dest, (StridedView{0, {48, 24, 8, 1}}));
}

TEST(InferTest, ScaleConstantPerBlockBecomesAPieceScale) {
  // A pre-divided bias of 8 at TP 2, observed with one scale per rank and per element.
  IndexMaps obs;
  obs.logical_shape = {8};
  for (Rank r = 0; r < 2; ++r) {
    obs.ranks.push_back({r,
                         {8},
                         {0, 1, 2, 3, 4, 5, 6, 7},
                         r == 0 ? std::vector<double>{0.5} : std::vector<double>(8, 0.5),
                         ""});
  }
  Result<ParamMap> m = Infer(obs);
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_EQ(m->rank(1).pieces.size(), 1u);
  EXPECT_EQ(m->rank(1).pieces[0].scale, 0.5);
  EXPECT_EQ(m->rank(1).pieces[0].locations, (std::vector<Rank>{0, 1}));
  // A scale that changes inside what would be one piece splits it.
  obs.ranks[1].scale = {0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25};
  obs.ranks[0].scale = obs.ranks[1].scale;
  m = Infer(obs);
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_EQ(m->rank(1).pieces.size(), 2u);
  EXPECT_EQ(m->rank(1).pieces[1].scale, 0.25);
  EXPECT_EQ(m->rank(1).pieces[1].source.offset, 4);
}

TEST(InferTest, MultiQueryKeyValueBlockStaysSeparateWhereAdjacent) {
  // At TP 2 rank 1's last query row is adjacent in F to the shared key/value block, and in
  // its shard; different holders keep them apart.
  ParamMapBuilder b;
  b.set_logical_shape({6, 2});
  for (Rank r = 0; r < 2; ++r) {
    b.set_shard_shape(r, {4, 2});
    b.add_piece(r, MakePiece({2, 2}, 4 * r, {2, 1}, 0, {2, 1}, {r}));
    b.add_piece(r, MakePiece({2, 2}, 8, {2, 1}, 4, {2, 1}, {0, 1}));
  }
  Result<ParamMap> m = Infer(ToIndexMaps(*b.Finalize()));
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(PiecesPerRank(*m), (std::vector<Index>{2, 2}));
}

TEST(InferTest, ErrorsNameTheRankAndElement) {
  auto error = [](IndexMaps obs, InferOptions options = {}) {
    Result<ParamMap> m = Infer(obs, options);
    return m.ok() ? std::string("OK") : m.status().message();
  };
  IndexMaps base;
  base.logical_shape = {2, 3};
  base.ranks = {{0, {3}, {0, 1, 2}, {}, ""}, {1, {3}, {3, 4, 5}, {}, ""}};
  EXPECT_EQ(error(base), "OK");
  IndexMaps outside = base;
  outside.ranks[1].index_map[2] = 6;
  EXPECT_EQ(error(outside), "rank 1: index_map[2] = 6 is outside F (shape [2, 3], 6 elements)");
  IndexMaps twice = base;
  twice.ranks[1].index_map[2] = 4;
  EXPECT_EQ(error(twice),
            "rank 1: index_map[2] = 4 repeats element [1, 1] of F, which the shard already "
            "holds; a shard holds each element of F at most once");
  IndexMaps short_map = base;
  short_map.ranks[0].index_map.pop_back();
  EXPECT_EQ(error(short_map),
            "ranks[0] (rank 0): shard_shape [3] has 3 elements but index_map has 2 entries "
            "(shard elements are missing)");
  IndexMaps dup_rank = base;
  dup_rank.ranks[1].rank = 0;
  EXPECT_EQ(error(dup_rank), "ranks[1] (rank 0): rank 0 is listed twice");
  IndexMaps far_rank = base;
  far_rank.ranks[1].rank = 5;
  EXPECT_EQ(error(far_rank),
            "ranks[1] (rank 5): rank 5 is outside 0..1; ranks must be numbered 0 to N-1");
  IndexMaps zero_scale = base;
  zero_scale.ranks[0].scale = {0.0};
  EXPECT_EQ(error(zero_scale), "ranks[0] (rank 0): scale[0] = 0 is not a finite non-zero number");
  IndexMaps partial = base;
  partial.ranks[1] = {1, {2}, {3, 5}, {}, ""};
  EXPECT_EQ(error(partial),
            "element [1, 1] of F (shape [2, 3]) is held by no rank (allow_uncovered accepts a "
            "deliberately partial observation)");
  EXPECT_EQ(error(partial, {.allow_uncovered = true}), "OK");
}

// vLLM's fused qkv at TP 2: q [4, 2] (two heads of one row) split by rows, k and v [1, 2] (one
// key/value head, replicated), rank r's qkv_proj [4, 2] = q rows 2r..2r+1, then k, then v.
std::vector<std::pair<std::string, IndexMaps>> FusedQkvObservation() {
  std::vector<std::pair<std::string, IndexMaps>> out;
  IndexMaps q{{4, 2}, std::nullopt, {}};
  IndexMaps k{{1, 2}, std::nullopt, {}};
  IndexMaps v = k;
  for (Rank r = 0; r < 2; ++r) {
    const Index base = 4 * r;
    q.ranks.push_back({r, {4, 2}, {base, base + 1, base + 2, base + 3, -1, -1, -1, -1}, {}, "qkv"});
    k.ranks.push_back({r, {4, 2}, {-1, -1, -1, -1, 0, 1, -1, -1}, {}, "qkv"});
    v.ranks.push_back({r, {4, 2}, {-1, -1, -1, -1, -1, -1, 0, 1}, {}, "qkv"});
  }
  out.emplace_back("q", std::move(q));
  out.emplace_back("k", std::move(k));
  out.emplace_back("v", std::move(v));
  return out;
}

TEST(InferTest, BufferedShardsInferOneMapPerTensorThatTheBufferSetAccepts) {
  std::vector<std::pair<std::string, ParamMap>> maps;
  for (const auto& [name, observed] : FusedQkvObservation()) {
    Result<ParamMap> m = Infer(observed);
    ASSERT_TRUE(m.ok()) << name << ": " << m.status().message();
    maps.emplace_back(name, *std::move(m));
  }
  const ParamMap& q = maps[0].second;
  ASSERT_EQ(q.rank(1).buffer, "qkv");
  ASSERT_EQ(q.rank(1).pieces.size(), 1u);
  EXPECT_EQ(q.rank(1).pieces[0].shape, (Shape{2, 2}));
  EXPECT_EQ(q.rank(1).pieces[0].source, (StridedView{4, {2, 1}}));
  EXPECT_EQ(q.rank(1).pieces[0].dest, (StridedView{0, {2, 1}}));
  const ParamMap& v = maps[2].second;
  ASSERT_EQ(v.rank(0).pieces.size(), 1u);  // one piece held by both ranks
  EXPECT_EQ(v.rank(0).pieces[0].locations, (std::vector<Rank>{0, 1}));
  EXPECT_EQ(v.rank(0).pieces[0].dest.offset, 6);
  // The round trip keeps the buffer, and the three maps fill it exactly.
  Result<ParamMap> again = Infer(ToIndexMaps(q));
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(ParamMapToJson(*again), ParamMapToJson(q));
  BufferSetBuilder buffers;
  buffers.add({"qkv", DType::kF32, {{{4, 2}, {}}, {{4, 2}, {}}}});
  std::vector<NamedMapRef> refs;
  for (const auto& [name, map] : maps) refs.push_back({name, &map});
  Result<BufferSet> set = buffers.Finalize(refs);
  EXPECT_TRUE(set.ok()) << set.status().message();
  // Without v, two elements of every rank's buffer are written by no map.
  refs.pop_back();
  set = buffers.Finalize(refs);
  ASSERT_FALSE(set.ok());
  EXPECT_NE(set.status().message().find("written by no map"), std::string::npos)
      << set.status().message();
}

TEST(InferTest, MinusOneIsAllowedOnlyInABufferedShard) {
  IndexMaps k = FusedQkvObservation()[1].second;
  k.ranks[0].buffer.clear();
  Result<ParamMap> m = Infer(k);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().message(),
            "rank 0: index_map[0] = -1 is outside F (shape [1, 2], 2 elements); -1 (not this "
            "tensor's) is allowed only in a buffered shard");
  k.ranks[0].buffer = "qkv";
  k.ranks[0].index_map[0] = -2;
  m = Infer(k);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().message(),
            "rank 0: index_map[0] = -2 is outside F (shape [1, 2], 2 elements)");
}

TEST(InferTest, IndexMapsJsonReadsABufferName) {
  Result<IndexMaps> observed = ParseIndexMapsJson(
      R"({"logical_shape": [1, 2], "ranks": [{"rank": 0, "shard_shape": [2, 2], "buffer": "kv",)"
      R"( "index_map": [-1, -1, 0, 1]}]})");
  ASSERT_TRUE(observed.ok()) << observed.status().message();
  EXPECT_EQ(observed->ranks[0].buffer, "kv");
  Result<ParamMap> m = Infer(*observed);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->rank(0).buffer, "kv");
  EXPECT_EQ(m->rank(0).pieces[0].dest.offset, 2);
  EXPECT_FALSE(ParseIndexMapsJson(R"({"logical_shape": [1], "ranks": [{"rank": 0,)"
                                  R"( "shard_shape": [1], "index_map": [0], "buffer": 3}]})")
                   .ok());
}

TEST(CanonicalizeTest, RowPerPieceMapFoldsBackAndIsIdempotent) {
  // A column split described one row per piece, as a naive converter would.
  ParamMapBuilder b;
  b.set_logical_shape({64, 16});
  for (Rank r = 0; r < 2; ++r) {
    b.set_shard_shape(r, {64, 8});
    for (Index row = 0; row < 64; ++row) {
      b.add_piece(r, MakePiece({8}, row * 16 + 8 * r, {1}, row * 8, {1}, {r}));
    }
  }
  Result<ParamMap> m = Canonicalize(*b.Finalize());
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(PiecesPerRank(*m), (std::vector<Index>{1, 1}));
  EXPECT_EQ(m->rank(1).pieces[0].shape, (Shape{64, 8}));
  EXPECT_EQ(m->rank(1).pieces[0].source, (StridedView{8, {16, 1}}));
  Result<ParamMap> again = Canonicalize(*m);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(ParamMapToJson(*again), ParamMapToJson(*m));
}

TEST(CanonicalizeTest, RowSplitReadsAsRowsAndColumns) {
  ParamMapBuilder b;
  b.set_logical_shape({8, 4});
  b.set_shard_shape(0, {32});
  b.add_piece(0, MakePiece({32}, 0, {1}, 0, {1}, {0}));
  Result<ParamMap> m = Canonicalize(*b.Finalize());
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->rank(0).pieces[0].shape, (Shape{8, 4}));
  EXPECT_EQ(m->rank(0).pieces[0].source.strides, (Shape{4, 1}));
}

TEST(CanonicalizeTest, TransposedShardIsOnePiece) {
  // Rank r stores its column block transposed: shard [cols, rows].
  ParamMapBuilder b;
  b.set_logical_shape({3, 4});
  for (Rank r = 0; r < 2; ++r) {
    b.set_shard_shape(r, {2, 3});
    b.add_piece(r, MakePiece({3, 2}, 2 * r, {4, 1}, 0, {1, 3}, {r}));
  }
  Result<ParamMap> m = Canonicalize(*b.Finalize());
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(PiecesPerRank(*m), (std::vector<Index>{1, 1}));
  const Piece& p = m->rank(1).pieces[0];
  EXPECT_EQ(p.shape, (Shape{2, 3}));
  EXPECT_EQ(p.source, (StridedView{2, {1, 4}}));
  EXPECT_EQ(p.dest, (StridedView{0, {3, 1}}));
}

TEST(CanonicalizeTest, InterleavedPiecesAfterOtherPiecesNeverAddPieces) {
  // The last two pieces interleave element by element and fold together into one 5-D piece;
  // folded as one sequence with the two pieces before them, the greedy partition took five.
  Result<ParamMapBuilder> b = ParseParamMapJson(R"({
    "logical_shape": [5, 3, 12, 5], "valid_shape": [2, 3, 12, 5],
    "ranks": {"0": {"shard_shape": [36, 1, 25], "pieces": [
      {"shape": [5, 3, 12, 2], "source": [1, [180, 60, 5, 1]], "dest": [180, [144, 48, 4, 2]],
       "locations": [0]},
      {"shape": [5, 2, 12, 1], "source": [0, [180, 60, 5, 1]], "dest": [60, [1, 5, 10, 120]],
       "locations": [0]},
      {"shape": [5, 1, 2, 6, 1], "source": [120, [180, 60, 30, 5, 1]],
       "dest": [0, [12, 12, 6, 1, 1]], "locations": [0]},
      {"shape": [5, 3, 12, 2], "source": [3, [180, 60, 5, 1]], "dest": [181, [144, 48, 4, 2]],
       "locations": [0]}]}}})");
  ASSERT_TRUE(b.ok()) << b.status().message();
  Result<ParamMap> map = b->Finalize({.require_coverage = false});
  ASSERT_TRUE(map.ok()) << map.status().message();
  Result<ParamMap> m = Canonicalize(*map);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(ExpandSourceOffsets(*m), ExpandSourceOffsets(*map));
  ASSERT_EQ(PiecesPerRank(*m), (std::vector<Index>{3}));
  EXPECT_EQ(m->rank(0).pieces[2].shape, (Shape{5, 3, 12, 2, 2}));
  EXPECT_EQ(m->rank(0).pieces[2].source, (StridedView{1, {180, 60, 5, 1, 2}}));
}

// Column blocks of a tall matrix interleave row by row. They fold as one period (a row)
// repeated over the rows: 2^26 rows, whose row-by-row listing would take tens of GB.
TEST(CanonicalizeTest, ColumnBlocksOfATallMatrixFoldWithoutListingRows) {
  constexpr Index kRows = Index{1} << 26;
  ParamMapBuilder b;
  b.set_logical_shape({kRows, 16});
  b.set_shard_shape(0, {kRows, 16});
  for (Index part = 0; part < 4; ++part) {
    b.add_piece(0, MakePiece({kRows, 4}, 4 * part, {16, 1}, 4 * part, {16, 1}, {0}));
  }
  Result<ParamMap> m = Canonicalize(*b.Finalize());
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_EQ(PiecesPerRank(*m), (std::vector<Index>{1}));
  EXPECT_EQ(m->rank(0).pieces[0].shape, (Shape{kRows, 16}));
  EXPECT_EQ(m->rank(0).pieces[0].source, (StridedView{0, {16, 1}}));
}

// The same with one element per period: a [2, N] tensor stored transposed as two pieces.
TEST(CanonicalizeTest, TransposedRowsStoredAsTwoPiecesFoldToOne) {
  constexpr Index kCols = Index{1} << 20;
  ParamMapBuilder b;
  b.set_logical_shape({2, kCols});
  b.set_shard_shape(0, {kCols, 2});
  for (Index row = 0; row < 2; ++row) {
    b.add_piece(0, MakePiece({kCols}, row * kCols, {1}, row, {2}, {0}));
  }
  Result<ParamMap> m = Canonicalize(*b.Finalize());
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_EQ(PiecesPerRank(*m), (std::vector<Index>{1}));
  EXPECT_EQ(m->rank(0).pieces[0].shape, (Shape{kCols, 2}));
  EXPECT_EQ(m->rank(0).pieces[0].source, (StridedView{0, {1, kCols}}));
}

// Interleaved pieces without a common period whose listing would pass the limit stay as they
// are: still every element where it was, and a fixed point.
TEST(CanonicalizeTest, InterleavedPiecesPastTheListingLimitStayApart) {
  constexpr Index kRows = Index{1} << 17;
  ParamMapBuilder b;
  b.set_logical_shape({2 * kRows});
  b.set_shard_shape(0, {2 * kRows});
  // Even shard slots hold F[0, N) in order; odd ones F[N, 2N) with its halves interleaved.
  b.add_piece(0, MakePiece({kRows}, 0, {1}, 0, {2}, {0}));
  b.add_piece(0, MakePiece({kRows / 2, 2}, kRows, {1, kRows / 2}, 1, {4, 2}, {0}));
  Result<ParamMap> map = b.Finalize();
  ASSERT_TRUE(map.ok()) << map.status().message();
  Result<ParamMap> m = Canonicalize(*map);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(PiecesPerRank(*m), (std::vector<Index>{2}));
  EXPECT_EQ(ExpandSourceOffsets(*m), ExpandSourceOffsets(*map));
  Result<ParamMap> again = Canonicalize(*m);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(ParamMapToJson(*again), ParamMapToJson(*m));
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {

// Canonicalising random valid maps: every element stays where it was, the result is a fixed
// point (byte-identical JSON) and never has more pieces than the input; inference from the
// expanded index maps gives a canonical map of the same elements.
TEST(CanonicalizePropertyTest, PreservesElementsIsIdempotentAndAgreesWithInfer) {
  for (uint64_t seed : PropertyTestSeeds(1500)) {
    std::mt19937_64 rng(seed);
    const ParamMap map = RandomParamMap(rng);
    SCOPED_TRACE(testing::Message() << "replay with RESHARD_SEED=" << seed << "\n"
                                    << ParamMapToJson(map));
    Result<ParamMap> canonical = Canonicalize(map);
    ASSERT_TRUE(canonical.ok()) << canonical.status().ToString();
    ASSERT_EQ(ExpandSourceOffsets(*canonical), ExpandSourceOffsets(map));
    ASSERT_EQ(ExpandScales(*canonical), ExpandScales(map));
    for (Rank r = 0; r < map.world_size(); ++r) {
      ASSERT_LE(canonical->rank(r).pieces.size(), std::max<size_t>(map.rank(r).pieces.size(), 1))
          << "rank " << r;
    }
    const std::string json = ParamMapToJson(*canonical);
    Result<ParamMap> again = Canonicalize(*canonical);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(ParamMapToJson(*again), json);
    // Inference from the expanded observation: the same elements, and itself canonical.
    Result<ParamMap> inferred = Infer(ToIndexMaps(map), {.allow_uncovered = true});
    ASSERT_TRUE(inferred.ok()) << inferred.status().ToString();
    ASSERT_EQ(ExpandSourceOffsets(*inferred), ExpandSourceOffsets(map));
    ASSERT_EQ(ExpandScales(*inferred), ExpandScales(map));
    Result<ParamMap> reinferred = Canonicalize(*inferred);
    ASSERT_TRUE(reinferred.ok());
    ASSERT_EQ(ParamMapToJson(*reinferred), ParamMapToJson(*inferred));
  }
}

}  // namespace
}  // namespace reshard
