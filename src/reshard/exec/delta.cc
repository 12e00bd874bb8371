#include "reshard/exec/delta.h"

#include <cstring>
#include <limits>
#include <string>

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
  out.changed = CountChangedWords(previous, current, words);
  const Index indices = DeltaPayloadBytes(DeltaEncoding::kIndices, words, out.changed);
  const Index mask = DeltaPayloadBytes(DeltaEncoding::kMask, words, out.changed);
  if (2 * words <= indices && 2 * words <= mask) return out;  // whole
  if (indices <= mask) {
    out.encoding = DeltaEncoding::kIndices;
    auto* at = payload;
    auto* values = payload + 4 * out.changed;
    for (Index i = 0; i < words; ++i) {
      if (previous[i] == current[i]) continue;
      const auto index = static_cast<int32_t>(i);
      std::memcpy(at, &index, 4);
      std::memcpy(values, &current[i], 2);
      at += 4;
      values += 2;
    }
    out.bytes = indices;
    return out;
  }
  out.encoding = DeltaEncoding::kMask;
  const Index head = DeltaMaskBytes(words);
  std::memset(payload, 0, static_cast<size_t>(head));
  auto* bits = reinterpret_cast<uint8_t*>(payload);
  auto* values = payload + head;
  for (Index i = 0; i < words; ++i) {
    if (previous[i] == current[i]) continue;
    bits[i / 8] = static_cast<uint8_t>(bits[i / 8] | (1u << (i % 8)));
    std::memcpy(values, &current[i], 2);
    values += 2;
  }
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
