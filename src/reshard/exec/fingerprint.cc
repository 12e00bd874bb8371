#include "reshard/exec/fingerprint.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "fmt/format.h"

namespace reshard {
namespace {

// A view with extent-1 dimensions dropped and its dimensions ordered by value stride
// (innermost smallest), cut into rows along every dimension but the innermost.
struct Normal {
  Shape shape, value_strides, position_strides;
  const std::byte* values = nullptr;
  Index position = 0;
  Index rows = 0;  // the product of every extent but the innermost
};

Normal Normalize(const FingerprintView& v) {
  std::vector<size_t> dims;
  for (size_t k = 0; k < v.shape.size(); ++k) {
    if (v.shape[k] != 1) dims.push_back(k);
  }
  std::stable_sort(dims.begin(), dims.end(),
                   [&](size_t a, size_t b) { return v.value_strides[a] > v.value_strides[b]; });
  Normal n;
  n.values = v.values;
  n.position = v.position;
  for (size_t k : dims) {
    n.shape.push_back(v.shape[k]);
    n.value_strides.push_back(v.value_strides[k]);
    n.position_strides.push_back(v.position_strides[k]);
  }
  if (n.shape.empty()) {  // one element
    n.shape = {1};
    n.value_strides = n.position_strides = {0};
  }
  n.rows = 1;
  for (size_t k = 0; k + 1 < n.shape.size(); ++k) n.rows *= n.shape[k];
  return n;
}

#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
// The terms vectorise: eight 32-bit lanes with AVX2, sixteen (and 64-bit multiplies, vpmullq,
// for 8-byte elements) with AVX-512.
#define RESHARD_FINGERPRINT_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define RESHARD_FINGERPRINT_CLONES
#endif

// The sum of the terms of one run of `count` elements (all positions taken) whose positions
// share their high 32 bits (elements of up to 4 bytes), or of any run (8-byte elements).
template <typename Bits>
[[gnu::always_inline]] inline uint64_t SumRunOf(const std::byte* values, Index value_stride,
                                                uint64_t position, uint64_t position_stride,
                                                Index count, uint64_t key) {
  const Index advance = value_stride * static_cast<Index>(sizeof(Bits));
  if constexpr (sizeof(Bits) == 8) {
    uint64_t acc = 0;
    const uint64_t first = position * kPositionMultiplier;
    const uint64_t step = position_stride * kPositionMultiplier;
    for (Index i = 0; i < count; ++i) {
      Bits bits;
      std::memcpy(&bits, values + i * advance, sizeof(Bits));
      acc += FingerprintMix((key ^ (first + static_cast<uint64_t>(i) * step)) + bits);
    }
    return acc;
  } else {
    // The low 32 bits of position i are low(first) + i * low(stride) modulo 2^32, so their
    // products with the multipliers advance by a constant too.
    const auto high = static_cast<uint32_t>(position >> 32);
    const uint32_t key_a = static_cast<uint32_t>(key) ^ (high * kPositionHigh1);
    const uint32_t key_b = static_cast<uint32_t>(key >> 32) ^ (high * kPositionHigh2);
    uint32_t at_a = static_cast<uint32_t>(position) * kPositionLow1;
    uint32_t at_b = static_cast<uint32_t>(position) * kPositionLow2;
    const uint32_t step_a = static_cast<uint32_t>(position_stride) * kPositionLow1;
    const uint32_t step_b = static_cast<uint32_t>(position_stride) * kPositionLow2;
    uint64_t acc_a = 0;
    uint32_t acc_b = 0;                  // only its value modulo 2^32 reaches the sum
    for (Index i = 0; i < count; ++i) {  // 32-bit inductions: no 64-bit lanes but the sum's
      Bits bits;
      std::memcpy(&bits, values + i * advance, sizeof(Bits));
      const uint32_t word = bits;
      acc_a += FingerprintMixA((key_a ^ at_a) + word);
      acc_b += FingerprintMixB((key_b ^ at_b) + RotateLeft16(word));
      at_a += step_a;
      at_b += step_b;
    }
    return acc_a + (static_cast<uint64_t>(acc_b) << 32);
  }
}

// One clone set per element size (target_clones takes no templates).
#define RESHARD_SUM_RUN(NAME, BITS)                                                     \
  RESHARD_FINGERPRINT_CLONES uint64_t NAME(const std::byte* values, Index value_stride, \
                                           uint64_t position, uint64_t position_stride, \
                                           Index count, uint64_t key) {                 \
    return SumRunOf<BITS>(values, value_stride, position, position_stride, count, key); \
  }
RESHARD_SUM_RUN(SumRun8, uint8_t)
RESHARD_SUM_RUN(SumRun16, uint16_t)
RESHARD_SUM_RUN(SumRun32, uint32_t)
RESHARD_SUM_RUN(SumRun64, uint64_t)
#undef RESHARD_SUM_RUN

template <typename Bits>
uint64_t SumSegment(const std::byte* values, Index value_stride, uint64_t position,
                    uint64_t position_stride, Index count, uint64_t key) {
  if constexpr (sizeof(Bits) == 1) {
    return SumRun8(values, value_stride, position, position_stride, count, key);
  } else if constexpr (sizeof(Bits) == 2) {
    return SumRun16(values, value_stride, position, position_stride, count, key);
  } else if constexpr (sizeof(Bits) == 4) {
    return SumRun32(values, value_stride, position, position_stride, count, key);
  } else {
    return SumRun64(values, value_stride, position, position_stride, count, key);
  }
}

// A run cut where its positions' high 32 bits change (never, for 8-byte elements).
template <typename Bits>
uint64_t SumRun(const std::byte* values, Index value_stride, uint64_t position,
                uint64_t position_stride, Index count, uint64_t key) {
  uint64_t acc = 0;
  while (count > 0) {
    Index n = count;
    if (sizeof(Bits) < 8 && position_stride != 0) {
      const uint64_t next = ((position >> 32) + 1) << 32;  // positions are below 2^63
      n = std::min<Index>(
          count, static_cast<Index>((next - position + position_stride - 1) / position_stride));
    }
    acc += SumSegment<Bits>(values, value_stride, position, position_stride, n, key);
    values += n * value_stride * static_cast<Index>(sizeof(Bits));
    position += static_cast<uint64_t>(n) * position_stride;
    count -= n;
  }
  return acc;
}

// The terms of one run into buckets, positions outside the range skipped.
template <typename Bits>
void BucketRun(const std::byte* values, Index value_stride, Index position, Index position_stride,
               Index count, uint64_t key, const FingerprintBuckets& b, Index width,
               uint64_t* sums) {
  for (Index i = 0; i < count; ++i) {
    const Index at = position + i * position_stride;
    if (at < b.lo || at >= b.hi) continue;
    Bits bits;
    std::memcpy(&bits, values + i * value_stride * static_cast<Index>(sizeof(Bits)), sizeof(Bits));
    sums[(at - b.lo) / width] +=
        FingerprintTerm(key, static_cast<uint64_t>(at), static_cast<uint64_t>(bits), sizeof(Bits));
  }
}

template <typename Bits>
void AddRows(const Normal& n, Index row_begin, Index row_end, uint64_t key,
             const FingerprintBuckets& b, Index width, uint64_t* sums) {
  const size_t inner = n.shape.size() - 1;
  Shape index(inner, 0);
  Index rest = row_begin;  // the multi-index of the first row
  for (size_t k = inner; k-- > 0;) {
    index[k] = rest % n.shape[k];
    rest /= n.shape[k];
  }
  const bool all = b.count == 1 && b.lo <= 0 && b.hi >= kMaxIndex;
  for (Index row = row_begin; row < row_end; ++row) {
    Index value = 0, position = n.position;
    for (size_t k = 0; k < inner; ++k) {
      value += index[k] * n.value_strides[k];
      position += index[k] * n.position_strides[k];
    }
    const std::byte* at = n.values + value * static_cast<Index>(sizeof(Bits));
    if (all) {
      sums[0] +=
          SumRun<Bits>(at, n.value_strides[inner], static_cast<uint64_t>(position),
                       static_cast<uint64_t>(n.position_strides[inner]), n.shape[inner], key);
    } else {
      BucketRun<Bits>(at, n.value_strides[inner], position, n.position_strides[inner],
                      n.shape[inner], key, b, width, sums);
    }
    for (size_t k = inner; k-- > 0;) {  // the next row
      if (++index[k] < n.shape[k]) break;
      index[k] = 0;
    }
  }
}

Status CheckView(const FingerprintView& v, size_t i) {
  const std::string what = fmt::format("views[{}]", i);
  if (v.value_strides.size() != v.shape.size() || v.position_strides.size() != v.shape.size()) {
    return InvalidArgumentError(what + ": shape and strides have different ranks");
  }
  for (size_t k = 0; k < v.shape.size(); ++k) {
    if (v.shape[k] < 0 || v.value_strides[k] < 0 || v.position_strides[k] < 0) {
      return InvalidArgumentError(what + ": a negative extent or stride");
    }
  }
  if (v.values == nullptr && ProductOf(v.shape) != 0) {
    return InvalidArgumentError(what + ": a null address with elements");
  }
  if (ProductOf(v.shape) != 0 && !LastOffset(v.position, v.shape, v.position_strides).has_value()) {
    return InvalidArgumentError(what + ": its positions overflow");
  }
  return Status::Ok();
}

struct Task {
  size_t view = 0;
  Index row_begin = 0, row_end = 0;
};

// Cuts the views into tasks of about `grain` elements.
std::vector<Task> Tasks(const std::vector<Normal>& views, Index grain) {
  std::vector<Task> tasks;
  for (size_t i = 0; i < views.size(); ++i) {
    const Normal& n = views[i];
    const Index per_row = std::max<Index>(n.shape.back(), 1);
    const Index rows_per_task = std::max<Index>(grain / per_row, 1);
    for (Index r = 0; r < n.rows; r += rows_per_task) {
      tasks.push_back({i, r, std::min(n.rows, r + rows_per_task)});
    }
  }
  return tasks;
}

template <typename Bits>
void AddAll(const std::vector<Normal>& views, uint64_t key, const FingerprintBuckets& b,
            Index width, std::span<uint64_t> sums, int threads) {
  Index total = 0;
  for (const Normal& n : views) total += n.rows * n.shape.back();
  constexpr Index kInlineElements = Index{1} << 20;
  if (threads <= 1 || total <= kInlineElements) {
    for (const Normal& n : views) AddRows<Bits>(n, 0, n.rows, key, b, width, sums.data());
    return;
  }
  const std::vector<Task> tasks =
      Tasks(views, std::max<Index>(total / (Index{threads} * 8), Index{1} << 16));
  threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), tasks.size()));
  std::vector<std::vector<uint64_t>> partial(static_cast<size_t>(threads),
                                             std::vector<uint64_t>(sums.size(), 0));
  std::atomic<size_t> next{0};
  auto worker = [&](size_t t) {
    for (size_t k = next++; k < tasks.size(); k = next++) {
      const Task& task = tasks[k];
      AddRows<Bits>(views[task.view], task.row_begin, task.row_end, key, b, width,
                    partial[t].data());
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < static_cast<size_t>(threads); ++t) pool.emplace_back(worker, t);
  worker(0);
  for (std::thread& th : pool) th.join();
  for (const std::vector<uint64_t>& p : partial) {
    for (size_t k = 0; k < sums.size(); ++k) sums[k] += p[k];
  }
}

}  // namespace

Status AddFingerprints(DType dtype, std::span<const FingerprintView> views, uint64_t key,
                       const FingerprintBuckets& buckets, std::span<uint64_t> sums,
                       int num_threads) {
  if (buckets.count < 1 || buckets.lo < 0 || buckets.hi <= buckets.lo) {
    return InvalidArgumentError(fmt::format("fingerprint buckets: [{}, {}) in {} buckets",
                                            buckets.lo, buckets.hi, buckets.count));
  }
  if (sums.size() != static_cast<size_t>(buckets.count)) {
    return InvalidArgumentError(
        fmt::format("{} sums for {} fingerprint buckets", sums.size(), buckets.count));
  }
  std::vector<Normal> normal;
  normal.reserve(views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    RESHARD_RETURN_IF_ERROR(CheckView(views[i], i));
    if (ProductOf(views[i].shape) != 0) normal.push_back(Normalize(views[i]));
  }
  const Index width = (buckets.hi - buckets.lo + buckets.count - 1) / buckets.count;
  const int threads = num_threads > 0
                          ? num_threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  switch (DTypeSize(dtype)) {
    case 1:
      AddAll<uint8_t>(normal, key, buckets, width, sums, threads);
      break;
    case 2:
      AddAll<uint16_t>(normal, key, buckets, width, sums, threads);
      break;
    case 4:
      AddAll<uint32_t>(normal, key, buckets, width, sums, threads);
      break;
    case 8:
      AddAll<uint64_t>(normal, key, buckets, width, sums, threads);
      break;
    default:
      return InvalidArgumentError(
          fmt::format("no fingerprint for elements of {} bytes", DTypeSize(dtype)));
  }
  return Status::Ok();
}

}  // namespace reshard
