// Transfer plans: composition (ir/compose.h) executed by the executor. The property that
// defines a plan: executing it on the source shards gives, on every non-padding element, what
// extracting the target map from F gives - and F is never built.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "reshard/base/cpu_limit_testing.h"
#include "reshard/exec/executor.h"
#include "reshard/ir/compose.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/plan_json.h"
#include "reshard/ir/random_map.h"
#include "reshard/layouts/basic.h"

namespace reshard {
namespace {

using Shards = std::vector<std::vector<float>>;

Shards ExtractAll(const ParamMap& map, const std::vector<float>& full) {
  Shards out(static_cast<size_t>(map.world_size()));
  for (Rank r = 0; r < map.world_size(); ++r) {
    auto& s = out[static_cast<size_t>(r)];
    s.assign(static_cast<size_t>(map.shard_num_elements(r)), 0.0f);
    Status st = Extract(map, DType::kF32, r,
                        {reinterpret_cast<const std::byte*>(full.data()), map.num_elements()},
                        {reinterpret_cast<std::byte*>(s.data()), map.shard_num_elements(r)});
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  return out;
}

Shards Execute(const ParamPlan& plan, const ParamMap& target, const Shards& sources, float fill) {
  Shards out(static_cast<size_t>(target.world_size()));
  std::vector<ConstBuffer> src;
  std::vector<MutableBuffer> dst;
  for (const auto& s : sources) {
    src.push_back({reinterpret_cast<const std::byte*>(s.data()), static_cast<Index>(s.size())});
  }
  for (Rank r = 0; r < target.world_size(); ++r) {
    auto& s = out[static_cast<size_t>(r)];
    s.assign(static_cast<size_t>(target.shard_num_elements(r)), fill);
    dst.push_back({reinterpret_cast<std::byte*>(s.data()), static_cast<Index>(s.size())});
  }
  Status st = ExecutePlan(plan, DType::kF32, src, dst);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Every non-padding element of every target shard equals the direct extraction, bit for bit.
void ExpectPlanMatchesExtraction(const ParamMap& target, const ParamMap& source,
                                 const std::vector<float>& full_target_f,
                                 const std::vector<float>& full_source_f, const std::string& what) {
  Result<ParamPlan> plan = Compose(target, source);
  ASSERT_TRUE(plan.ok()) << what << ": " << plan.status().ToString();
  const Shards sources = ExtractAll(source, full_source_f);
  const Shards want = ExtractAll(target, full_target_f);
  const Shards got = Execute(*plan, target, sources, std::numeric_limits<float>::quiet_NaN());
  const auto offsets = ExpandSourceOffsets(target);
  for (Rank r = 0; r < target.world_size(); ++r) {
    for (size_t k = 0; k < got[static_cast<size_t>(r)].size(); ++k) {
      const Index e = offsets[static_cast<size_t>(r)][k];
      const float g = got[static_cast<size_t>(r)][k];
      if (target.IsPadding(e)) {
        EXPECT_EQ(Bits(g), 0u) << what << ": target padding rank " << r << " element " << k;
        continue;
      }
      ASSERT_EQ(Bits(g), Bits(want[static_cast<size_t>(r)][k]))
          << what << ": rank " << r << " shard element " << k << " (F offset " << e << ")\n"
          << PlanDocumentToJson({{{"p", *plan}}});
    }
  }
}

std::vector<float> RandomF(Index n, std::mt19937_64& rng) {
  std::vector<float> f(static_cast<size_t>(n));
  std::normal_distribution<float> normal;
  for (float& x : f) x = normal(rng);
  return f;
}

TEST(PlanTest, RandomPairsOfMapsOfOneTensorMatchExtraction) {
  for (uint64_t seed : PropertyTestSeeds(400)) {
    std::mt19937_64 rng(seed);
    RandomMapOptions options;
    options.scales = false;  // exactness of scaled plans is tested with powers of two below
    const ParamMap source = RandomParamMap(rng, options);
    options.logical_shape = source.logical_shape();
    options.valid_shape = source.valid_shape();
    const ParamMap target = RandomParamMap(rng, options);
    const std::vector<float> f = RandomF(source.num_elements(), rng);
    ExpectPlanMatchesExtraction(target, source, f, f, "seed " + std::to_string(seed));
    if (HasFailure()) {
      ADD_FAILURE() << "replay with RESHARD_SEED=" << seed << "\nsource " << ParamMapToJson(source)
                    << "target " << ParamMapToJson(target);
      return;
    }
  }
}

TEST(PlanTest, ScaledPiecesMoveWithTheRatioOfScales) {
  std::mt19937_64 rng(5);
  const std::vector<float> f = RandomF(16, rng);
  for (int from : {1, 2, 4, 8}) {
    for (int to : {1, 2, 4, 8}) {
      const ParamMap source = *ReplicatedMap({16}, from, 1.0 / from);
      const ParamMap target = *ReplicatedMap({16}, to, 1.0 / to);
      ExpectPlanMatchesExtraction(target, source, f, f, fmt::format("bias {} -> {}", from, to));
      Result<ParamPlan> plan = Compose(target, source);
      ASSERT_TRUE(plan.ok());
      EXPECT_EQ(plan->moves.size(), static_cast<size_t>(to));
      EXPECT_EQ(plan->moves[0].factor, static_cast<double>(from) / to);
    }
  }
}

TEST(PlanTest, ReplicaPolicyPrefersTheSameRankThenAMoveItContinuesThenBalances) {
  // A key/value block held by all 4 source ranks, read by 2 target ranks: each reads its own.
  const ParamMap source = *SegmentedMap({48, 8}, 0, {{32, false, {8, 8, 8, 8}}, {16, true, {}}}, 4);
  const ParamMap target = *SegmentedMap({48, 8}, 0, {{32, false, {16, 16}}, {16, true, {}}}, 2);
  Result<ParamPlan> down = Compose(target, source);
  ASSERT_TRUE(down.ok());
  for (const Move& m : down->moves) {
    if (m.dst.offset == 16 * 8) {
      EXPECT_EQ(m.src_rank, m.dst_rank);  // the key/value block
    }
  }
  // 4 target ranks reading from 2 holders. Balancing alone spreads the reads 2 and 2.
  const ComposeOptions balance_only{.policy = [](const ReplicaChoice& choice) {
    ReplicaChoice without = choice;
    without.continuing = {};
    return PreferSameRankThenBalance(without);
  }};
  Result<ParamPlan> balanced = Compose(source, target, balance_only);
  ASSERT_TRUE(balanced.ok());
  std::vector<int> reads(2, 0);
  for (const Move& m : balanced->moves) {
    if (m.dst.offset == 8 * 8) ++reads[static_cast<size_t>(m.src_rank)];
  }
  EXPECT_EQ(reads, (std::vector<int>{2, 2}));
  // By default target rank 3 reads the block from source rank 1, right after its query rows
  // there: one move instead of two.
  Result<ParamPlan> up = Compose(source, target);
  ASSERT_TRUE(up.ok());
  EXPECT_EQ(up->moves.size() + 1, balanced->moves.size());
  std::vector<Move> to_3;
  for (const Move& m : up->moves) {
    if (m.dst_rank == 3) to_3.push_back(m);
  }
  ASSERT_EQ(to_3.size(), 1u);
  EXPECT_EQ(to_3[0].src_rank, 1);
  EXPECT_EQ(to_3[0].shape, (Shape{24 * 8}));
}

// GPT-BigCode's fused QKV (4 heads of 16, one key/value head held by every rank) from TP 2 to
// TP 4: DeepSpeed's design discussion measured 7 moves. Target ranks 0-2 need two moves each
// (their query rows, then the key/value block; rank 1 reads the block from itself); rank 3
// reads it from source rank 1 right after its query rows, one move.
TEST(PlanTest, BigCodeTpTwoToFourIsSevenMoves) {
  auto bigcode = [](int tp) {
    const Index q = 64 / tp;
    return *SegmentedMap(
        {96, 64}, 0, {{64, false, std::vector<Index>(static_cast<size_t>(tp), q)}, {32, true, {}}},
        tp);
  };
  Result<ParamPlan> plan = Compose(bigcode(4), bigcode(2));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->moves.size(), 7u);
}

TEST(PlanTest, ColumnSplitTpEightToTwoIsEightMoves) {
  const ParamMap source = *SplitMap({1024, 64}, 0, EvenSplitSizes(1024, 8));
  const ParamMap target = *SplitMap({1024, 64}, 0, EvenSplitSizes(1024, 2));
  Result<ParamPlan> plan = Compose(target, source);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->moves.size(), 8u);
  EXPECT_EQ(plan->moves[1].src_rank, 1);
  EXPECT_EQ(plan->moves[1].dst_rank, 0);
  EXPECT_EQ(plan->moves[1].shape, (Shape{128 * 64}));
  EXPECT_EQ(plan->moves[1].dst.offset, 128 * 64);
}

// CodeGen's fused-QKV interleave at `tp` (see ir/canonicalize_test.cc).
ParamMap CodeGen(Index hidden, Index cols, int tp) {
  const Index quarter = hidden / 4;
  const Index blocks = 4 / tp;
  ParamMapBuilder b;
  b.set_logical_shape({3 * hidden, cols});
  for (Rank r = 0; r < tp; ++r) {
    const Shape shape = {blocks, quarter, 3, cols};
    b.set_shard_shape(r, {3 * hidden / tp, cols});
    b.add_piece(
        r, Piece{shape,
                 {r * blocks * 3 * quarter * cols, {3 * quarter * cols, cols, quarter * cols, 1}},
                 {0, RowMajorStrides(shape)},
                 {r},
                 1.0});
  }
  return *b.Finalize();
}

// Yuan's shared-QK o_proj: F (rows, heads * head_dim) split along dim 1; rank r of `tp` holds
// heads {r * h/2 .. r * h/2 + h/2 - 1} and the same plus heads / 2, where h = heads / tp.
ParamMap YuanOProj(Index rows, Index heads, Index head_dim, int tp) {
  const Index per = heads / tp / 2;
  const Index cols = heads * head_dim;
  ParamMapBuilder b;
  b.set_logical_shape({rows, cols});
  for (Rank r = 0; r < tp; ++r) {
    const Shape shape = {rows, 2, per * head_dim};
    b.set_shard_shape(r, {rows, 2 * per * head_dim});
    b.add_piece(r, Piece{shape,
                         {r * per * head_dim, {cols, heads / 2 * head_dim, 1}},
                         {0, RowMajorStrides(shape)},
                         {r},
                         1.0});
  }
  return *b.Finalize();
}

size_t Moves(const ParamMap& target, const ParamMap& source) {
  Result<ParamPlan> plan = Compose(target, source);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  return plan.ok() ? plan->moves.size() : 0;
}

TEST(PlanTest, MoveCountsDoNotGrowWithTheHiddenSize) {
  for (auto [from, to] : {std::pair{4, 2}, std::pair{2, 4}, std::pair{4, 1}, std::pair{1, 4}}) {
    SCOPED_TRACE(fmt::format("TP {} -> {}", from, to));
    EXPECT_EQ(Moves(CodeGen(64, 64, to), CodeGen(64, 64, from)),
              Moves(CodeGen(512, 512, to), CodeGen(512, 512, from)));
    EXPECT_EQ(Moves(YuanOProj(64, 8, 16, to), YuanOProj(64, 8, 16, from)),
              Moves(YuanOProj(512, 8, 128, to), YuanOProj(512, 8, 128, from)));
    auto bigcode = [](Index h, int tp) {
      return *SegmentedMap({h + h / 4, h}, 0,
                           {{h, false, EvenSplitSizes(h, tp)}, {h / 4, true, {}}}, tp);
    };
    EXPECT_EQ(Moves(bigcode(64, to), bigcode(64, from)),
              Moves(bigcode(512, to), bigcode(512, from)));
    for (int dim : {0, 1}) {
      EXPECT_EQ(Moves(*SplitMap({64, 64}, dim, EvenSplitSizes(64, to)),
                      *SplitMap({64, 64}, dim, EvenSplitSizes(64, from))),
                Moves(*SplitMap({512, 512}, dim, EvenSplitSizes(512, to)),
                      *SplitMap({512, 512}, dim, EvenSplitSizes(512, from))));
    }
  }
}

TEST(PlanTest, YuanOProjFromTpFourToTwoTakesFourMoves) {
  const ParamMap source = YuanOProj(4096, 8, 128, 4);
  const ParamMap target = YuanOProj(4096, 8, 128, 2);
  EXPECT_LE(Moves(target, source), 4u);
  std::mt19937_64 rng(1);
  const std::vector<float> f = RandomF(target.num_elements(), rng);
  ExpectPlanMatchesExtraction(target, source, f, f, "yuan");
  ExpectPlanMatchesExtraction(source, target, f, f, "yuan back");
  const std::vector<float> g = RandomF(192 * 16, rng);
  ExpectPlanMatchesExtraction(CodeGen(64, 16, 2), CodeGen(64, 16, 4), g, g, "codegen");
  ExpectPlanMatchesExtraction(CodeGen(64, 16, 1), CodeGen(64, 16, 4), g, g, "codegen 4 -> 1");
}

ParamMap PaddedVocab(Index vocab, Index hidden, int tp) {
  const Index padded = (vocab + tp - 1) / tp * tp;
  ParamMapBuilder b(*SplitMap({padded, hidden}, 0, EvenSplitSizes(padded, tp)));
  b.set_valid_shape(Shape{vocab, hidden});
  return *b.Finalize();
}

TEST(PlanTest, PaddedVocabularyMovesOnlyRealRowsAndNeverReadsPadding) {
  const Index hidden = 16;
  const ParamMap source = PaddedVocab(50257, hidden, 4);  // F 50260 rows
  const ParamMap target = PaddedVocab(50257, hidden, 8);  // F 50264 rows
  Result<ParamPlan> plan = Compose(target, source);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_LE(plan->moves.size(), 4u + 8u);
  EXPECT_EQ(plan->num_moved_elements(), 50257 * hidden);
  Index unwritten = 0;
  for (const UnwrittenBlock& u : plan->unwritten) {
    EXPECT_EQ(u.dst_rank, 7);
    unwritten += ProductOf(u.shape);
  }
  EXPECT_EQ(unwritten, (50264 - 50257) * hidden);
  // Source padding holds NaN: it must never reach a target.
  std::mt19937_64 rng(3);
  std::vector<float> fs = RandomF(source.num_elements(), rng);
  for (Index i = 50257 * hidden; i < source.num_elements(); ++i) fs[static_cast<size_t>(i)] = NAN;
  std::vector<float> ft(fs.begin(), fs.begin() + 50257 * hidden);
  ft.resize(static_cast<size_t>(target.num_elements()), 0.0f);
  ExpectPlanMatchesExtraction(target, source, ft, fs, "vocab 4 -> 8");
  ExpectPlanMatchesExtraction(source, target, fs, ft, "vocab 8 -> 4");
}

TEST(PlanTest, DifferentTensorsAndUncoveredTargetsAreRefused) {
  EXPECT_EQ(Compose(*SplitMap({8, 4}, 0, {4, 4}), *SplitMap({8, 5}, 0, {4, 4})).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(Compose(*SplitMap({8, 4}, 0, {4, 4}), *SplitMap({4, 8}, 0, {2, 2})).status().message(),
            "the maps describe different tensors: source F [4, 8] (valid [4, 8]), target F [8, 4] "
            "(valid [8, 4]); they must have the same valid shape and may differ only in the "
            "padding of the first dimension");
  ParamMapBuilder partial;
  partial.set_logical_shape({8, 4});
  partial.set_shard_shape(0, {4, 4});
  partial.add_piece(0, Piece{{4, 4}, {0, {4, 1}}, {0, {4, 1}}, {0}, 1.0});
  Result<ParamMap> observed = partial.Finalize({.require_coverage = false});
  ASSERT_TRUE(observed.ok());
  EXPECT_EQ(Compose(*SplitMap({8, 4}, 0, {4, 4}), *observed).status().message(),
            "element [4, 0] of F is held by target rank 1 but by no source rank");
}

TEST(PlanTest, ExecutionRefusesBuffersThatDoNotFitThePlan) {
  const ParamMap source = *SplitMap({8, 4}, 0, {4, 4});
  const ParamMap target = *SplitMap({8, 4}, 0, {8});
  Result<ParamPlan> plan = Compose(target, source);
  ASSERT_TRUE(plan.ok());
  std::vector<float> a(16), b(15), out(32);
  std::vector<ConstBuffer> src = {{reinterpret_cast<const std::byte*>(a.data()), 16},
                                  {reinterpret_cast<const std::byte*>(b.data()), 15}};
  std::vector<MutableBuffer> dst = {{reinterpret_cast<std::byte*>(out.data()), 32}};
  Status s = ExecutePlan(*plan, DType::kF32, src, dst);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s.message(), "moves[1].src reaches past the end of a shard of 15 elements");
}

// Composing maps of many pieces costs in proportion to the pieces that meet, not to the
// product of the two maps' pieces: each target piece found its sources by trying every source
// piece (40 000 one-element pieces per rank: some 10^10 tries). The source pieces are indexed
// now; this takes well under a second.
TEST(PlanDeathTest, ComposingManyPiecesIsLinearInThePieces) {
  const auto compose = [] {
    const Index n = test_support::CostInput(40000);
    ParamMapBuilder b;
    b.set_logical_shape({2 * n});
    b.set_world_size(2);
    for (Rank r = 0; r < 2; ++r) {
      b.set_shard_shape(r, {n});
      for (Index i = 0; i < n; ++i) {
        b.add_piece(r, Piece{{1}, {r * n + (n - 1 - i), {1}}, {i, {1}}, {r}, 1.0});
      }
    }
    Result<ParamMap> map = b.Finalize();
    if (!map.ok()) return false;
    Result<ParamPlan> plan = Compose(*map, *map);
    return plan.ok() && plan->num_moved_elements() == 2 * n;
  };
  EXPECT_EXIT(test_support::RunUnderCpuLimit(10, compose), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace reshard
