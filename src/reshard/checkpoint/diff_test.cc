#include "reshard/checkpoint/diff.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "reshard/exec/executor.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/ir/fixtures.h"

namespace reshard {
namespace {

using fixtures::BigCodeBuilder;
using fixtures::SplitBuilder;

ParamMap Valid(const ParamMapBuilder& b) {
  Result<ParamMap> m = b.Finalize();
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *std::move(m);
}

// F32 elements of F as bytes: value(i) for flat index i of the padded F.
std::vector<std::byte> F32Tensor(Index n, const std::function<float(Index)>& value) {
  std::vector<std::byte> out(static_cast<size_t>(n) * 4);
  for (Index i = 0; i < n; ++i) {
    const float v = value(i);
    std::memcpy(out.data() + i * 4, &v, 4);
  }
  return out;
}

std::vector<std::byte> BF16Tensor(Index n, const std::function<float(Index)>& value) {
  std::vector<std::byte> out(static_cast<size_t>(n) * 2);
  for (Index i = 0; i < n; ++i) {
    const uint16_t v = FloatToBFloat16(value(i));
    std::memcpy(out.data() + i * 2, &v, 2);
  }
  return out;
}

// Tensors held in memory at some layout, as a shard source: each cut from its full tensor by
// its map.
class MemorySource : public ShardSource {
 public:
  void Add(std::string name, const ParamMap& map, DType dtype, const std::vector<std::byte>& full) {
    manifest_.world_size = map.world_size();
    const size_t elem = DTypeSize(dtype);
    std::vector<std::vector<std::byte>> shards;
    for (Rank r = 0; r < map.world_size(); ++r) {
      shards.emplace_back(static_cast<size_t>(map.shard_num_elements(r)) * elem);
      const Status s = Extract(map, dtype, r, {full.data(), map.num_elements()},
                               {shards.back().data(), map.shard_num_elements(r)});
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    manifest_.params.push_back({std::move(name), dtype, map, std::nullopt, 1});
    data_.push_back(std::move(shards));
  }
  const Manifest& manifest() const override { return manifest_; }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    ++acquired;
    std::vector<ConstBuffer> out;
    const size_t elem = DTypeSize(manifest_.params[i].dtype);
    for (const std::vector<std::byte>& s : data_[i]) {
      out.push_back({s.data(), static_cast<Index>(s.size() / elem)});
    }
    return out;
  }
  void ReleaseShards(size_t) override { ++released; }
  std::vector<std::string> inputs() const override { return {}; }

  int acquired = 0;
  int released = 0;

 private:
  Manifest manifest_;
  std::vector<std::vector<std::vector<std::byte>>> data_;
};

float Ramp(Index i) { return 0.5f + static_cast<float>(i); }

// F [6, 10] at world 1 (as a Hugging Face file holds it).
ParamMap Whole() { return Valid(SplitBuilder({6, 10}, 0, {6})); }
// F [6, 10] split by columns over 2 ranks (5 each).
ParamMap Columns() { return Valid(SplitBuilder({6, 10}, 1, {5, 5})); }

TEST(DiffTest, EqualTensorsInDifferentLayoutsAreEqual) {
  MemorySource a, b;
  a.Add("w", Whole(), DType::kF32, F32Tensor(60, Ramp));
  b.Add("w", Columns(), DType::kF32, F32Tensor(60, Ramp));
  // GPT-BigCode's fused QKV with replicated key/value rows, against the whole tensor.
  a.Add("qkv", Valid(SplitBuilder({48, 8}, 0, {48})), DType::kF32, F32Tensor(384, Ramp));
  b.Add("qkv", Valid(BigCodeBuilder(4)), DType::kF32, F32Tensor(384, Ramp));
  DiffOptions options;
  options.band_bytes = 40;  // bands of one row of w: many bands per tensor
  Result<DiffReport> r = DiffSources(a, b, options);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->equal()) << DiffReportText(*r);
  EXPECT_EQ(r->tensors_compared, 2);
  EXPECT_EQ(r->elements_compared, 60 + 384);
  EXPECT_EQ(a.acquired, a.released);
  EXPECT_EQ(b.acquired, b.released);
}

TEST(DiffTest, FirstDifferenceIsFirstInRowMajorOrderNotInRankOrder) {
  // Rank 0 holds F[2][3] (flat 23), rank 1 holds F[1][7] (flat 17): the first in F is 17.
  auto changed = [](Index i) { return i == 23 ? -1.0f : i == 17 ? 100.0f : Ramp(i); };
  for (uint64_t band_bytes : {uint64_t{40}, uint64_t{64} << 20}) {
    MemorySource a, b;
    a.Add("w", Whole(), DType::kF32, F32Tensor(60, Ramp));
    b.Add("w", Columns(), DType::kF32, F32Tensor(60, changed));
    DiffOptions options;
    options.band_bytes = band_bytes;
    Result<DiffReport> r = DiffSources(a, b, options);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->differences.size(), 1u) << DiffReportText(*r);
    const TensorDifference& d = r->differences[0];
    EXPECT_EQ(d.kind, DiffKind::kValue);
    EXPECT_EQ(d.name, "w");
    EXPECT_EQ(d.index, 17);
    EXPECT_EQ(d.multi_index, (Shape{1, 7}));
    EXPECT_EQ(d.value_a, "17.5");
    EXPECT_EQ(d.value_b, "100");
    EXPECT_NE(
        DiffReportText(*r).find("w: first difference at [1, 7] (flat 17): 17.5 (A) vs 100 (B)"),
        std::string::npos)
        << DiffReportText(*r);
  }
}

TEST(DiffTest, LastElementOfTheLastBand) {
  MemorySource a, b;
  a.Add("w", Columns(), DType::kF32, F32Tensor(60, Ramp));
  b.Add("w", Whole(), DType::kF32, F32Tensor(60, [](Index i) { return i == 59 ? 0.f : Ramp(i); }));
  DiffOptions options;
  options.band_bytes = 80;
  Result<DiffReport> r = DiffSources(a, b, options);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->differences.size(), 1u);
  EXPECT_EQ(r->differences[0].index, 59);
  EXPECT_EQ(r->differences[0].multi_index, (Shape{5, 9}));
}

TEST(DiffTest, MissingExtraDTypeAndShapeAreEachReported) {
  MemorySource a, b;
  a.Add("only_a", Whole(), DType::kF32, F32Tensor(60, Ramp));
  a.Add("dtype", Whole(), DType::kF32, F32Tensor(60, Ramp));
  b.Add("dtype", Whole(), DType::kBF16, BF16Tensor(60, Ramp));
  a.Add("shape", Whole(), DType::kF32, F32Tensor(60, Ramp));
  b.Add("shape", Valid(SplitBuilder({10, 6}, 0, {10})), DType::kF32, F32Tensor(60, Ramp));
  b.Add("only_b", Whole(), DType::kF32, F32Tensor(60, Ramp));
  Result<DiffReport> r = DiffSources(a, b);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->differences.size(), 4u) << DiffReportText(*r);
  EXPECT_EQ(r->differences[0].kind, DiffKind::kMissing);
  EXPECT_EQ(r->differences[0].name, "only_a");
  EXPECT_EQ(r->differences[1].kind, DiffKind::kDType);
  EXPECT_EQ(r->differences[1].dtype_b, DType::kBF16);
  EXPECT_EQ(r->differences[2].kind, DiffKind::kShape);
  EXPECT_EQ(r->differences[2].shape_b, (Shape{10, 6}));
  EXPECT_EQ(r->differences[3].kind, DiffKind::kExtra);
  EXPECT_EQ(r->differences[3].name, "only_b");
  EXPECT_EQ(r->tensors_compared, 2);
}

TEST(DiffTest, ToleranceComparesValuesAcrossDTypes) {
  // 1/3 + i rounds in bf16 by up to 2^-8 relative.
  auto third = [](Index i) { return static_cast<float>(i) + 1.0f / 3; };
  MemorySource a, b;
  a.Add("w", Columns(), DType::kF32, F32Tensor(60, third));
  b.Add("w", Whole(), DType::kBF16, BF16Tensor(60, third));
  DiffOptions options;
  options.rtol = 1.0 / 128;
  Result<DiffReport> r = DiffSources(a, b, options);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->equal()) << DiffReportText(*r);

  options.rtol = 0;
  options.atol = 1e-6;
  r = DiffSources(a, b, options);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->differences.size(), 1u);
  EXPECT_EQ(r->differences[0].kind, DiffKind::kValue);
  EXPECT_EQ(r->differences[0].index, 0);  // 1/3 is not a bf16

  options.atol = -1;
  EXPECT_EQ(DiffSources(a, b, options).status().code(), StatusCode::kInvalidArgument);
}

TEST(DiffTest, PaddingIsNotComparedAndScalarsAndEmptyTensorsAre) {
  // A vocabulary of 6 rows padded to 8 over 2 ranks, against the 6 rows whole; the padding
  // holds different garbage on each side.
  ParamMapBuilder padded = SplitBuilder({8, 4}, 0, {4, 4});
  padded.set_valid_shape(Shape{6, 4});
  MemorySource a, b;
  a.Add("emb", Valid(padded), DType::kF32,
        F32Tensor(32, [](Index i) { return i >= 24 ? 7.0f : Ramp(i); }));
  b.Add("emb", Valid(SplitBuilder({6, 4}, 0, {6})), DType::kF32, F32Tensor(24, Ramp));
  ParamMapBuilder scalar;
  scalar.set_logical_shape({}).set_world_size(1).set_shard_shape(0, {});
  scalar.add_piece(0, fixtures::MakePiece({}, 0, {}, 0, {}, {0}));
  a.Add("step", Valid(scalar), DType::kF32, F32Tensor(1, Ramp));
  b.Add("step", Valid(scalar), DType::kF32, F32Tensor(1, [](Index) { return 2.f; }));
  a.Add("empty", Valid(SplitBuilder({0, 4}, 0, {0})), DType::kF32, {});
  b.Add("empty", Valid(SplitBuilder({0, 4}, 0, {0})), DType::kF32, {});
  Result<DiffReport> r = DiffSources(a, b);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->differences.size(), 1u) << DiffReportText(*r);
  EXPECT_EQ(r->differences[0].name, "step");
  EXPECT_EQ(r->differences[0].index, 0);
  EXPECT_TRUE(r->differences[0].multi_index.empty());
  EXPECT_EQ(r->differences[0].value_b, "2");
}

}  // namespace
}  // namespace reshard
