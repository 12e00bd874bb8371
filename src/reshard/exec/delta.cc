#include "reshard/exec/delta.h"

#include <bit>
#include <cstring>
#include <limits>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace reshard {

Index DeltaPayloadBytes(DeltaEncoding encoding, Index words, Index changed) {
  switch (encoding) {
    case DeltaEncoding::kIndices:
      return 6 * changed;
    case DeltaEncoding::kMask:
      return DeltaMaskBytes(words) + 2 * changed;
    case DeltaEncoding::kWhole:
      break;
  }
  return 2 * words;
}

Index CountChangedWords(const uint16_t* previous, const uint16_t* current, Index words) {
  Index changed = 0;
  for (Index i = 0; i < words; ++i) changed += previous[i] != current[i] ? 1 : 0;
  return changed;
}

namespace {

// Calls emit(i) for every word i < words where previous and current differ, in ascending
// order, until emit returns false (then returns false). Blocks of 32 words are compared at
// once into a mask of the bytes that differ (SSE2, which every x86-64 has; else 64-bit XORs),
// so a block that did not change costs a few instructions and each changed word is found from
// the mask's bits, without a branch per word.
template <typename Emit>
bool ForEachChangedWord(const uint16_t* previous, const uint16_t* current, Index words,
                        Emit&& emit) {
  constexpr Index kBlock = 32;
  Index i = 0;
  for (; i + kBlock <= words; i += kBlock) {
    uint64_t differ = 0;  // bit 2w or 2w + 1 set: a byte of word w differs
#if defined(__SSE2__)
    for (Index j = 0; j < 4; ++j) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(previous + i + 8 * j));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(current + i + 8 * j));
      const auto same = static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(a, b)));
      differ |= static_cast<uint64_t>(~same & 0xFFFFu) << (16 * j);
    }
#else
    for (Index j = 0; j < 8; ++j) {
      uint64_t a = 0;
      uint64_t b = 0;
      std::memcpy(&a, previous + i + 4 * j, 8);
      std::memcpy(&b, current + i + 4 * j, 8);
      for (uint64_t d = a ^ b; d != 0; d &= d - 1) {
        differ |= uint64_t{1} << (8 * j + std::countr_zero(d) / 8);  // little-endian bytes
      }
    }
#endif
    if (differ == 0) continue;
    uint64_t changed = (differ | (differ >> 1)) & 0x5555555555555555u;  // bit 2w: word w
    for (; changed != 0; changed &= changed - 1) {
      if (!emit(i + std::countr_zero(changed) / 2)) return false;
    }
  }
  for (; i < words; ++i) {
    if (previous[i] != current[i] && !emit(i)) return false;
  }
  return true;
}

}  // namespace

Result<DeltaChunk> EncodeDelta(const uint16_t* previous, const uint16_t* current, Index words,
                               std::byte* payload, Index capacity) {
  if (capacity < 2 * words) {
    return InvalidArgumentError("a delta payload of " + std::to_string(capacity) +
                                " bytes for a chunk of " + std::to_string(2 * words));
  }
  if (words > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError("a chunk of more than 2^31 words");
  }
  DeltaChunk out;
  // One pass while few words changed: the indices go to the front of the payload, the values
  // to its second half, moved up behind the indices at the end. Past `most` changed words
  // (4 * changed > the mask's bytes) the indices lose to the mask: the rest is only counted.
  const Index head = DeltaMaskBytes(words);
  const Index most = head / 4;
  auto* at = payload;
  std::byte* const values = payload + words;  // 6 * most <= words: the halves do not meet
  Index found = 0;
  const bool few = ForEachChangedWord(previous, current, words, [&](Index i) {
    if (found == most) return false;
    const auto index = static_cast<int32_t>(i);
    std::memcpy(at, &index, 4);
    std::memcpy(values + 2 * found, &current[i], 2);
    at += 4;
    ++found;
    return true;
  });
  if (few) {
    out.changed = found;
    const Index indices = DeltaPayloadBytes(DeltaEncoding::kIndices, words, found);
    if (2 * words <= indices) return out;  // whole: an empty or tiny chunk
    out.encoding = DeltaEncoding::kIndices;
    std::memmove(at, values, static_cast<size_t>(2 * found));
    out.bytes = indices;
    return out;
  }
  out.changed = CountChangedWords(previous, current, words);
  const Index mask = DeltaPayloadBytes(DeltaEncoding::kMask, words, out.changed);
  if (2 * words <= mask) return out;  // whole
  out.encoding = DeltaEncoding::kMask;
  std::memset(payload, 0, static_cast<size_t>(head));
  auto* bits = reinterpret_cast<uint8_t*>(payload);
  std::byte* next = payload + head;
  ForEachChangedWord(previous, current, words, [&](Index i) {
    bits[i / 8] = static_cast<uint8_t>(bits[i / 8] | (1u << (i % 8)));
    std::memcpy(next, &current[i], 2);
    next += 2;
    return true;
  });
  out.bytes = mask;
  return out;
}

Status ApplyDelta(uint16_t* previous, Index words, DeltaEncoding encoding, Index changed,
                  const std::byte* payload, Index bytes) {
  if (changed < 0 || changed > words || bytes != DeltaPayloadBytes(encoding, words, changed)) {
    return DataLossError("a delta payload of " + std::to_string(bytes) + " bytes does not hold " +
                         std::to_string(changed) + " changed words of a chunk of " +
                         std::to_string(words));
  }
  if (encoding == DeltaEncoding::kWhole) {
    std::memcpy(previous, payload, static_cast<size_t>(2 * words));
    return Status::Ok();
  }
  if (encoding == DeltaEncoding::kIndices) {
    const std::byte* values = payload + 4 * changed;
    for (Index k = 0; k < changed; ++k) {
      int32_t index = 0;
      std::memcpy(&index, payload + 4 * k, 4);
      if (index < 0 || index >= words) {
        return DataLossError("a delta names word " + std::to_string(index) + " of a chunk of " +
                             std::to_string(words));
      }
      std::memcpy(&previous[index], values + 2 * k, 2);
    }
    return Status::Ok();
  }
  const auto* bits = reinterpret_cast<const uint8_t*>(payload);
  const std::byte* values = payload + DeltaMaskBytes(words);
  Index taken = 0;
  for (Index i = 0; i < words; ++i) {
    if (((bits[i / 8] >> (i % 8)) & 1u) == 0) continue;
    if (taken == changed) return DataLossError("a delta's mask sets more words than it carries");
    std::memcpy(&previous[i], values + 2 * taken, 2);
    ++taken;
  }
  if (taken != changed) return DataLossError("a delta's mask sets fewer words than it carries");
  return Status::Ok();
}

}  // namespace reshard
