// Fingerprints of shards that add up across processes (DESIGN.md 22).
//
// The fingerprint of a set of elements is a sum, modulo 2^64, of one keyed term per element:
//
//   term(key, position, bits) = Mix((key ^ position * kPositionMultiplier) + bits)
//
// where `position` names the element (Python's verify uses its flat index in the target shard
// that holds it, which the target's map ties to one element of F), `bits` are the element's
// bytes read as an unsigned integer (little-endian, DTypeSize(dtype) bytes) and Mix is a
// bijection of 64-bit words (two multiply-xorshift rounds). Because the fingerprint is a sum,
// it can be computed in parts by whoever holds the elements: the parts that the source
// processes compute over the elements each one sends to a target add up to what the target
// computes over its own shard.
//
// What it can miss: for a fixed position the term is a bijection of the bits, so a single
// element that differs always changes the sum. Several elements that differ change it unless
// their changes of terms cancel modulo 2^64; with a fresh random key per comparison, that
// happens with probability about 2^-64 for differences that do not depend on the key (this is
// not a cryptographic hash: data chosen by someone who knows the key can cancel). Bits that do
// not change, such as a NaN's payload rewritten into an equal pattern, are by definition no
// difference.
#ifndef RESHARD_EXEC_FINGERPRINT_H_
#define RESHARD_EXEC_FINGERPRINT_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/status.h"

namespace reshard {

/// Odd multiplier that spreads positions over the word before mixing.
inline constexpr uint64_t kPositionMultiplier = 0x9E3779B97F4A7C15ULL;

/// A bijection of 64-bit words (xorshift-multiply rounds; every step is invertible).
constexpr uint64_t FingerprintMix(uint64_t x) {
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ULL;
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ULL;
  x ^= x >> 32;
  return x;
}

/// The keyed term of one element: `position` its key index, `bits` its bytes as an integer.
constexpr uint64_t FingerprintTerm(uint64_t key, uint64_t position, uint64_t bits) {
  return FingerprintMix((key ^ (position * kPositionMultiplier)) + bits);
}

/// A strided view of elements and the positions that name them: for every multi-index i inside
/// `shape`, the element at `values + (i . value_strides) * DTypeSize(dtype)` has position
/// `position + i . position_strides`. Strides are in elements, non-negative.
struct FingerprintView {
  Shape shape;
  const std::byte* values = nullptr;
  Shape value_strides;
  Index position = 0;
  Shape position_strides;
};

/// Positions [lo, hi) cut into `count` buckets of equal width ceil((hi - lo) / count) (the last
/// may be narrower); elements at other positions are skipped. The default takes every position
/// into one bucket.
struct FingerprintBuckets {
  Index lo = 0;
  Index hi = kMaxIndex;
  Index count = 1;
};

/// Adds the term of every element of every view whose position lies in the buckets' range to
/// `sums[bucket]` (modulo 2^64); `sums` has `buckets.count` entries. The order of addition does
/// not matter, so the work may be spread over `num_threads` threads (<= 0: one per hardware
/// thread; small work runs inline). InvalidArgument for mismatched ranks, a negative extent or
/// stride, a null address with elements, an empty or inverted range, or the wrong number of
/// sums. The views' extents are the caller's to check against their buffers.
Status AddFingerprints(DType dtype, std::span<const FingerprintView> views, uint64_t key,
                       const FingerprintBuckets& buckets, std::span<uint64_t> sums,
                       int num_threads = 0);

}  // namespace reshard

#endif  // RESHARD_EXEC_FINGERPRINT_H_
