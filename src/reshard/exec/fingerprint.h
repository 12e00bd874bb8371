// Fingerprints of shards that add up across processes (DESIGN.md 22).
//
// The fingerprint of a set of elements is a sum, modulo 2^64, of one keyed term per element of
// (position, bits): `position` names the element (Python's verify uses its flat index in the
// target shard that holds it, which the target's map ties to one element of F) and `bits` are
// its bytes read as an unsigned integer (little-endian, DTypeSize(dtype) bytes). Elements of up
// to 4 bytes, with p = position, the key's halves k_lo, k_hi, and 32-bit arithmetic:
//
//   a = (k_lo ^ hi32(p) * kPositionHigh1 ^ lo32(p) * kPositionLow1) + bits
//   b = (k_hi ^ hi32(p) * kPositionHigh2 ^ lo32(p) * kPositionLow2) + rotl32(bits, 16)
//   term = MixA(a) + MixB(b) * 2^32                                         (mod 2^64)
//
// with MixA, MixB bijections of 32-bit words (two multiply-xorshift rounds each). Its
// multiplies are 32-bit, so eight lanes of AVX2 (or four of NEON) compute it at once. Elements
// of 8 bytes take term = Mix64((key ^ p * kPositionMultiplier) + bits), Mix64 a bijection of
// 64-bit words. Because the fingerprint is a sum, it can be computed in parts by whoever holds
// the elements: the parts that the source processes compute over the elements each one sends
// to a target add up to what the target computes over its own shard.
//
// What it can miss: for a fixed position the term is a bijection of the bits in its low 32
// bits (MixA of a, a bijection of the bits) or in all 64 (Mix64), so a single element that
// differs always changes the sum. Several elements that differ change it unless their changes
// of terms cancel modulo 2^64; with a fresh random key per comparison, that happens with
// probability about 2^-64 for differences that do not depend on the key (heuristically: the two
// halves are independent mixes, each cancelling with probability about 2^-32; this is not a
// cryptographic hash, and data chosen by someone who knows the key can cancel). Bits that do
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

/// Odd multipliers that spread positions over the words before mixing.
inline constexpr uint64_t kPositionMultiplier = 0x9E3779B97F4A7C15ULL;
inline constexpr uint32_t kPositionLow1 = 0x2545F491U;
inline constexpr uint32_t kPositionLow2 = 0x9E3779B1U;
inline constexpr uint32_t kPositionHigh1 = 0x7F4A7C15U;
inline constexpr uint32_t kPositionHigh2 = 0xC2B2AE3DU;

/// A bijection of 64-bit words (xorshift-multiply rounds; every step is invertible).
constexpr uint64_t FingerprintMix(uint64_t x) {
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ULL;
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ULL;
  x ^= x >> 32;
  return x;
}

/// A bijection of 32-bit words: xorshift 16, multiply by odd `m1`, xorshift `shift`, multiply
/// by odd `m2`, xorshift 16.
constexpr uint32_t XorshiftMultiply32(uint32_t x, uint32_t m1, int shift, uint32_t m2) {
  x ^= x >> 16;
  x *= m1;
  x ^= x >> shift;
  x *= m2;
  x ^= x >> 16;
  return x;
}

/// Two bijections of 32-bit words with unrelated constants.
constexpr uint32_t FingerprintMixA(uint32_t x) {
  return XorshiftMultiply32(x, 0x7FEB352DU, 15, 0x846CA68BU);
}
constexpr uint32_t FingerprintMixB(uint32_t x) {
  return XorshiftMultiply32(x, 0x85EBCA6BU, 13, 0xC2B2AE35U);
}

constexpr uint32_t RotateLeft16(uint32_t x) { return (x << 16) | (x >> 16); }

/// The keyed term of one element of `bytes` bytes (1, 2, 4 or 8): `position` its key index,
/// `bits` its bytes as an integer.
constexpr uint64_t FingerprintTerm(uint64_t key, uint64_t position, uint64_t bits, size_t bytes) {
  if (bytes == 8) return FingerprintMix((key ^ (position * kPositionMultiplier)) + bits);
  const auto low = static_cast<uint32_t>(position);
  const auto high = static_cast<uint32_t>(position >> 32);
  const auto word = static_cast<uint32_t>(bits);
  const uint32_t a =
      (static_cast<uint32_t>(key) ^ (high * kPositionHigh1) ^ (low * kPositionLow1)) + word;
  const uint32_t b =
      (static_cast<uint32_t>(key >> 32) ^ (high * kPositionHigh2) ^ (low * kPositionLow2)) +
      RotateLeft16(word);
  return FingerprintMixA(a) + (static_cast<uint64_t>(FingerprintMixB(b)) << 32);
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
