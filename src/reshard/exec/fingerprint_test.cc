#include "reshard/exec/fingerprint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace reshard {
namespace {

std::vector<uint16_t> RandomHalves(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = static_cast<uint16_t>(gen());
  return v;
}

const std::byte* At(const std::vector<uint16_t>& v, Index offset) {
  return reinterpret_cast<const std::byte*>(v.data() + offset);
}

uint64_t Sum(DType dtype, const std::vector<FingerprintView>& views, uint64_t key,
             int threads = 1) {
  uint64_t sum = 0;
  EXPECT_TRUE(AddFingerprints(dtype, views, key, {}, std::span(&sum, 1), threads).ok());
  return sum;
}

// A rows x cols bf16 tensor, row-major, positions its own flat indices.
FingerprintView Whole(const std::vector<uint16_t>& v, Index rows, Index cols) {
  return {{rows, cols}, At(v, 0), {cols, 1}, 0, {cols, 1}};
}

TEST(FingerprintTest, EqualsTheSumOfEachElementsTerm) {
  const std::vector<uint16_t> v = RandomHalves(6 * 5, 1);
  uint64_t want = 0;
  for (size_t i = 0; i < v.size(); ++i) want += FingerprintTerm(7, i, v[i], 2);
  EXPECT_EQ(Sum(DType::kBF16, {Whole(v, 6, 5)}, 7), want);
}

TEST(FingerprintTest, RunsAcrossTheHigh32BitsOfPositionsEqualTheirTerms) {
  // Positions that cross 2^32 and 2^33 inside one run, at stride 1 and at a stride that skips
  // a boundary's neighbourhood: the vectorised run is cut where the high bits change.
  const std::vector<uint16_t> v = RandomHalves(4096, 9);
  const std::pair<uint64_t, uint64_t> runs[] = {{(uint64_t{1} << 32) - 1000, 1},
                                                {(uint64_t{1} << 32) - 5, 3},
                                                {(uint64_t{1} << 31), 3000001},
                                                {(uint64_t{1} << 33) - 2047, 1}};
  for (const auto& [first, stride] : runs) {
    uint64_t want = 0;
    for (size_t i = 0; i < v.size(); ++i) want += FingerprintTerm(21, first + i * stride, v[i], 2);
    const FingerprintView run{
        {4096}, At(v, 0), {1}, static_cast<Index>(first), {static_cast<Index>(stride)}};
    EXPECT_EQ(Sum(DType::kBF16, {run}, 21), want) << first << " " << stride;
  }
}

TEST(FingerprintTest, EveryBitOfEveryElementSizeChangesTheTerm) {
  // The term is a bijection of the bits for a fixed position, in its low half for elements of
  // up to 4 bytes (so the sign bit of an fp32 counts) and in all of it for 8 bytes.
  for (const size_t size : {size_t{1}, size_t{2}, size_t{4}, size_t{8}}) {
    for (const uint64_t bits : {uint64_t{0}, uint64_t{0x0123456789ABCDEFULL}}) {
      const uint64_t word = size == 8 ? bits : bits & ((uint64_t{1} << (8 * size)) - 1);
      const uint64_t term = FingerprintTerm(3, 77, word, size);
      for (size_t bit = 0; bit < 8 * size; ++bit) {
        EXPECT_NE(FingerprintTerm(3, 77, word ^ (uint64_t{1} << bit), size), term)
            << size << " " << bit;
      }
    }
  }
}

TEST(FingerprintTest, PartsHeldElsewhereAddUpToTheWhole) {
  // A 6 x 5 tensor as a row block, a column block and the rest, each read in another order:
  // the column block transposed (its value strides (1, 5)), positions always the flat index.
  const std::vector<uint16_t> v = RandomHalves(6 * 5, 2);
  const uint64_t whole = Sum(DType::kBF16, {Whole(v, 6, 5)}, 99);
  const std::vector<FingerprintView> parts = {
      {{2, 5}, At(v, 0), {5, 1}, 0, {5, 1}},    // rows 0-1
      {{4, 4}, At(v, 10), {1, 5}, 10, {1, 5}},  // rows 2-5, columns 0-3, transposed
      {{4}, At(v, 14), {5}, 14, {5}},           // column 4 of rows 2-5
  };
  uint64_t added = 0;
  for (const FingerprintView& p : parts) added += Sum(DType::kBF16, {p}, 99);
  EXPECT_EQ(added, whole);
  EXPECT_EQ(Sum(DType::kBF16, parts, 99), whole);
}

TEST(FingerprintTest, EverySingleChangedElementChangesTheSum) {
  std::vector<uint16_t> v = RandomHalves(64, 3);
  const uint64_t before = Sum(DType::kBF16, {Whole(v, 8, 8)}, 5);
  for (size_t i = 0; i < v.size(); ++i) {
    for (uint16_t flip : {uint16_t{1}, uint16_t{0x8000}, uint16_t{0x7FFF}}) {
      v[i] ^= flip;
      EXPECT_NE(Sum(DType::kBF16, {Whole(v, 8, 8)}, 5), before) << i << " " << flip;
      v[i] ^= flip;
    }
  }
  EXPECT_EQ(Sum(DType::kBF16, {Whole(v, 8, 8)}, 5), before);
}

TEST(FingerprintTest, TwoElementsSwappedOrAValueMovedChangeTheSum) {
  std::vector<uint16_t> v = RandomHalves(64, 4);
  v[3] = 1;
  v[40] = 2;
  const uint64_t before = Sum(DType::kBF16, {Whole(v, 8, 8)}, 11);
  std::swap(v[3], v[40]);
  EXPECT_NE(Sum(DType::kBF16, {Whole(v, 8, 8)}, 11), before);
  // The same values at shifted positions (a shard written one element off).
  const FingerprintView shifted{{63}, At(v, 1), {1}, 0, {1}};
  const FingerprintView straight{{63}, At(v, 0), {1}, 0, {1}};
  EXPECT_NE(Sum(DType::kBF16, {shifted}, 11), Sum(DType::kBF16, {straight}, 11));
}

TEST(FingerprintTest, TheKeyChangesEverySum) {
  const std::vector<uint16_t> v = RandomHalves(30, 5);
  EXPECT_NE(Sum(DType::kBF16, {Whole(v, 6, 5)}, 1), Sum(DType::kBF16, {Whole(v, 6, 5)}, 2));
}

TEST(FingerprintTest, BucketsSplitTheRangeAndSkipWhatLiesOutside) {
  std::vector<uint16_t> v = RandomHalves(100, 6);
  const FingerprintView all = Whole(v, 10, 10);
  std::vector<uint64_t> sums(4, 0);
  ASSERT_TRUE(AddFingerprints(DType::kBF16, {&all, 1}, 3, {10, 90, 4}, sums).ok());
  for (Index b = 0; b < 4; ++b) {  // bucket b: positions [10 + 20 b, 30 + 20 b)
    const FingerprintView part{{20}, At(v, 10 + 20 * b), {1}, 10 + 20 * b, {1}};
    EXPECT_EQ(sums[static_cast<size_t>(b)], Sum(DType::kBF16, {part}, 3)) << b;
  }
  // A change outside the range changes no bucket; one inside changes its own only.
  v[95] ^= 1;
  v[55] ^= 1;
  std::vector<uint64_t> after(4, 0);
  ASSERT_TRUE(AddFingerprints(DType::kBF16, {&all, 1}, 3, {10, 90, 4}, after).ok());
  EXPECT_EQ(after[0], sums[0]);
  EXPECT_EQ(after[1], sums[1]);
  EXPECT_NE(after[2], sums[2]);
  EXPECT_EQ(after[3], sums[3]);
}

TEST(FingerprintTest, EveryElementSizeReadsItsOwnBytes) {
  // The same bytes read as 1-, 2-, 4- and 8-byte elements give four different sums, each the
  // sum of its elements' terms.
  std::vector<uint64_t> words = {0x0123456789ABCDEFULL, 0xFEDCBA9876543210ULL};
  const auto* bytes = reinterpret_cast<const std::byte*>(words.data());
  const std::pair<DType, Index> kinds[] = {
      {DType::kU8, 16}, {DType::kBF16, 8}, {DType::kF32, 4}, {DType::kI64, 2}};
  for (const auto& [dtype, n] : kinds) {
    const FingerprintView view{{n}, bytes, {1}, 0, {1}};
    uint64_t want = 0;
    const size_t size = DTypeSize(dtype);
    for (Index i = 0; i < n; ++i) {
      uint64_t bits = 0;
      std::memcpy(&bits, bytes + static_cast<size_t>(i) * size, size);
      want += FingerprintTerm(8, static_cast<uint64_t>(i), bits, size);
    }
    EXPECT_EQ(Sum(dtype, {view}, 8), want) << DTypeName(dtype);
  }
}

TEST(FingerprintTest, ThreadsGiveTheSameSum) {
  const Index rows = 1024, cols = 1536;  // above the inline limit
  const std::vector<uint16_t> v = RandomHalves(static_cast<size_t>(rows * cols), 7);
  const FingerprintView transposed{{cols, rows}, At(v, 0), {1, cols}, 0, {1, cols}};
  const uint64_t one = Sum(DType::kBF16, {Whole(v, rows, cols)}, 13, 1);
  EXPECT_EQ(Sum(DType::kBF16, {Whole(v, rows, cols)}, 13, 4), one);
  EXPECT_EQ(Sum(DType::kBF16, {transposed}, 13, 3), one);
}

TEST(FingerprintTest, RefusesMalformedViewsAndBuckets) {
  const std::vector<uint16_t> v = RandomHalves(4, 8);
  uint64_t sum = 0;
  const FingerprintView ranks{{2, 2}, At(v, 0), {2}, 0, {2, 1}};
  EXPECT_FALSE(AddFingerprints(DType::kBF16, {&ranks, 1}, 0, {}, {&sum, 1}).ok());
  const FingerprintView negative{{2}, At(v, 0), {-1}, 0, {1}};
  EXPECT_FALSE(AddFingerprints(DType::kBF16, {&negative, 1}, 0, {}, {&sum, 1}).ok());
  const FingerprintView null{{2}, nullptr, {1}, 0, {1}};
  EXPECT_FALSE(AddFingerprints(DType::kBF16, {&null, 1}, 0, {}, {&sum, 1}).ok());
  const FingerprintView fine{{2}, At(v, 0), {1}, 0, {1}};
  EXPECT_FALSE(AddFingerprints(DType::kBF16, {&fine, 1}, 0, {5, 5, 1}, {&sum, 1}).ok());
  EXPECT_FALSE(AddFingerprints(DType::kBF16, {&fine, 1}, 0, {0, 4, 2}, {&sum, 1}).ok());
  EXPECT_TRUE(AddFingerprints(DType::kBF16, {&fine, 1}, 0, {0, 4, 1}, {&sum, 1}).ok());
}

}  // namespace
}  // namespace reshard
