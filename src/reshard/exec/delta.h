// The encodings of a delta push's chunks (DESIGN.md 22): a chunk compared with the copy of it
// that sender and receiver both hold, as 16-bit words, and sent as the changed words' indices
// and values, as a bit per word and the changed values, or whole (the smallest).
//
// Layouts (little-endian):
//   kIndices: count int32 word indices, ascending, then count uint16 words;
//   kMask:    MaskBytes(words) bytes, bit i % 8 of byte i / 8 set when word i changed, then
//             the changed words in order;
//   kWhole:   the chunk itself.
#ifndef RESHARD_EXEC_DELTA_H_
#define RESHARD_EXEC_DELTA_H_

#include <cstddef>
#include <cstdint>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/base/status.h"

namespace reshard {

enum class DeltaEncoding : int { kWhole = 0, kMask = 1, kIndices = 2 };

/// The bytes of a mask's bits for `words` words, rounded up to even (the words follow).
constexpr Index DeltaMaskBytes(Index words) { return ((words + 7) / 8 + 1) / 2 * 2; }

/// The bytes a chunk of `words` words with `changed` changed words travels as.
Index DeltaPayloadBytes(DeltaEncoding encoding, Index words, Index changed);

/// How many of `words` 16-bit words differ between `previous` and `current`.
Index CountChangedWords(const uint16_t* previous, const uint16_t* current, Index words);

struct DeltaChunk {
  DeltaEncoding encoding = DeltaEncoding::kWhole;
  Index changed = 0;  // words that differ
  Index bytes = 0;    // bytes written into the payload
};

/// Encodes `current` against `previous` (`words` each) into `payload` (room for `capacity`
/// bytes, at least 2 * words), choosing the smallest encoding. kWhole writes nothing: the
/// caller sends `current` itself. InvalidArgument for too small a payload or more words than
/// int32 indices reach.
Result<DeltaChunk> EncodeDelta(const uint16_t* previous, const uint16_t* current, Index words,
                               std::byte* payload, Index capacity);

/// Applies an encoded chunk to `previous` (`words` words), in place. DataLoss for a payload whose
/// size does not match its encoding and count, or an index outside the chunk.
Status ApplyDelta(uint16_t* previous, Index words, DeltaEncoding encoding, Index changed,
                  const std::byte* payload, Index bytes);

}  // namespace reshard

#endif  // RESHARD_EXEC_DELTA_H_
