#include "reshard/exec/delta.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace reshard {
namespace {

struct Case {
  std::vector<uint16_t> previous, current;
};

Case Changed(Index words, double fraction, uint32_t seed) {
  std::mt19937 gen(seed);
  Case c;
  c.previous.resize(static_cast<size_t>(words));
  for (uint16_t& w : c.previous) w = static_cast<uint16_t>(gen());
  c.current = c.previous;
  std::bernoulli_distribution pick(fraction);
  for (uint16_t& w : c.current) {
    if (pick(gen)) w = static_cast<uint16_t>(w ^ 0x101);
  }
  return c;
}

TEST(DeltaTest, EveryEncodingRebuildsTheChunkExactly) {
  const std::pair<double, DeltaEncoding> cases[] = {{0.0, DeltaEncoding::kIndices},
                                                    {0.01, DeltaEncoding::kIndices},
                                                    {0.2, DeltaEncoding::kMask},
                                                    {0.9, DeltaEncoding::kMask},
                                                    {1.0, DeltaEncoding::kWhole}};
  for (const auto& [fraction, want] : cases) {
    for (Index words : {Index{1}, Index{9}, Index{1000}, Index{4099}}) {
      const Case c = Changed(words, fraction, static_cast<uint32_t>(words));
      std::vector<std::byte> payload(static_cast<size_t>(2 * words));
      Result<DeltaChunk> chunk =
          EncodeDelta(c.previous.data(), c.current.data(), words, payload.data(), 2 * words);
      ASSERT_TRUE(chunk.ok());
      EXPECT_EQ(chunk->changed, CountChangedWords(c.previous.data(), c.current.data(), words));
      if (words == 4099) {
        EXPECT_EQ(chunk->encoding, want) << fraction;
      }
      const std::byte* sent = chunk->encoding == DeltaEncoding::kWhole
                                  ? reinterpret_cast<const std::byte*>(c.current.data())
                                  : payload.data();
      const Index bytes = chunk->encoding == DeltaEncoding::kWhole ? 2 * words : chunk->bytes;
      EXPECT_LE(bytes, 2 * words);
      std::vector<uint16_t> held = c.previous;
      ASSERT_TRUE(
          ApplyDelta(held.data(), words, chunk->encoding, chunk->changed, sent, bytes).ok());
      EXPECT_EQ(held, c.current) << fraction << " " << words;
    }
  }
}

// The encoding the header comment promises: whole when it is no larger than both others, else
// the indices when no larger than the mask, else the mask.
DeltaEncoding Smallest(Index words, Index changed) {
  const Index whole = 2 * words;
  const Index indices = DeltaPayloadBytes(DeltaEncoding::kIndices, words, changed);
  const Index mask = DeltaPayloadBytes(DeltaEncoding::kMask, words, changed);
  if (whole <= indices && whole <= mask) return DeltaEncoding::kWhole;
  return indices <= mask ? DeltaEncoding::kIndices : DeltaEncoding::kMask;
}

TEST(DeltaTest, ChoosesTheSmallestEncodingAtEveryCount) {
  const Index words = 4099;  // the indices stop winning at 128 changed words
  std::vector<Index> counts;
  for (Index c = 0; c <= words; c += 37) counts.push_back(c);
  for (Index c = 120; c <= 136; ++c) counts.push_back(c);
  counts.push_back(words);
  std::vector<uint16_t> previous(static_cast<size_t>(words));
  for (Index i = 0; i < words; ++i) previous[static_cast<size_t>(i)] = static_cast<uint16_t>(i);
  for (Index c : counts) {
    std::vector<uint16_t> current = previous;
    for (Index j = 0; j < c; ++j) current[static_cast<size_t>(j * words / c)] ^= 0x4000;
    std::vector<std::byte> payload(static_cast<size_t>(2 * words));
    Result<DeltaChunk> chunk =
        EncodeDelta(previous.data(), current.data(), words, payload.data(), 2 * words);
    ASSERT_TRUE(chunk.ok());
    EXPECT_EQ(chunk->changed, c);
    EXPECT_EQ(chunk->encoding, Smallest(words, c)) << c;
    if (chunk->encoding == DeltaEncoding::kWhole) continue;
    std::vector<uint16_t> held = previous;
    ASSERT_TRUE(ApplyDelta(held.data(), words, chunk->encoding, chunk->changed, payload.data(),
                           chunk->bytes)
                    .ok());
    EXPECT_EQ(held, current) << c;
  }
}

TEST(DeltaTest, FindsAChangedWordWhereverItSits) {
  // Every word of chunks shorter, as long as and longer than the blocks compared at once, its
  // lowest or its highest bit flipped.
  for (Index words : {Index{31}, Index{32}, Index{33}, Index{70}}) {
    std::vector<uint16_t> previous(static_cast<size_t>(words), 0x3f80);
    for (Index i = 0; i < words; ++i) {
      for (uint16_t bit : {uint16_t{0x0001}, uint16_t{0x8000}}) {
        std::vector<uint16_t> current = previous;
        current[static_cast<size_t>(i)] ^= bit;
        std::vector<std::byte> payload(static_cast<size_t>(2 * words));
        Result<DeltaChunk> chunk =
            EncodeDelta(previous.data(), current.data(), words, payload.data(), 2 * words);
        ASSERT_TRUE(chunk.ok());
        ASSERT_EQ(chunk->changed, 1) << words << " " << i;
        std::vector<uint16_t> held = previous;
        const std::byte* sent = chunk->encoding == DeltaEncoding::kWhole
                                    ? reinterpret_cast<const std::byte*>(current.data())
                                    : payload.data();
        const Index bytes = chunk->encoding == DeltaEncoding::kWhole ? 2 * words : chunk->bytes;
        ASSERT_TRUE(ApplyDelta(held.data(), words, chunk->encoding, 1, sent, bytes).ok());
        EXPECT_EQ(held, current) << words << " " << i;
      }
    }
  }
}

TEST(DeltaTest, RefusesPayloadsThatDoNotMatchTheirHeader) {
  Case c = Changed(100, 0.0, 3);
  c.current[7] ^= 1;
  c.current[50] ^= 1;
  std::vector<std::byte> payload(200);
  Result<DeltaChunk> chunk =
      EncodeDelta(c.previous.data(), c.current.data(), 100, payload.data(), 200);
  ASSERT_TRUE(chunk.ok() && chunk->encoding == DeltaEncoding::kIndices && chunk->changed == 2);
  std::vector<uint16_t> held = c.previous;
  EXPECT_EQ(ApplyDelta(held.data(), 100, chunk->encoding, chunk->changed, payload.data(),
                       chunk->bytes - 1)
                .code(),
            StatusCode::kDataLoss);
  const int32_t outside = 100;
  std::memcpy(payload.data(), &outside, 4);
  EXPECT_EQ(
      ApplyDelta(held.data(), 100, chunk->encoding, chunk->changed, payload.data(), chunk->bytes)
          .code(),
      StatusCode::kDataLoss);
  EXPECT_FALSE(EncodeDelta(c.previous.data(), c.current.data(), 100, payload.data(), 199).ok());
}

}  // namespace
}  // namespace reshard
