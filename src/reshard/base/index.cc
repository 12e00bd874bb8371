#include "reshard/base/index.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace reshard {

std::optional<Index> CheckedAdd(Index a, Index b) {
  Index out;
  if (__builtin_add_overflow(a, b, &out) || out > kMaxIndex || out < -kMaxIndex) {
    return std::nullopt;
  }
  return out;
}

std::optional<Index> CheckedMul(Index a, Index b) {
  Index out;
  if (__builtin_mul_overflow(a, b, &out) || out > kMaxIndex || out < -kMaxIndex) {
    return std::nullopt;
  }
  return out;
}

Result<Index> CheckedProduct(std::span<const Index> shape) {
  Index n = 1;
  for (size_t k = 0; k < shape.size(); ++k) {
    if (shape[k] < 0) {
      return InvalidArgumentError(
          fmt::format("shape {} has a negative extent at dimension {}", FormatShape(shape), k));
    }
  }
  for (Index extent : shape) {
    if (extent == 0) return Index{0};
  }
  for (Index extent : shape) {
    auto next = CheckedMul(n, extent);
    if (!next) {
      return InvalidArgumentError(
          fmt::format("shape {} has more than 2^62 elements", FormatShape(shape)));
    }
    n = *next;
  }
  return n;
}

Index ProductOf(std::span<const Index> shape) {
  Index n = 1;
  for (Index extent : shape) n *= extent;
  return n;
}

Shape RowMajorStrides(std::span<const Index> shape) {
  Shape strides(shape.size(), 1);
  for (size_t k = shape.size(); k > 1; --k) {
    strides[k - 2] = strides[k - 1] * (shape[k - 1] > 0 ? shape[k - 1] : 1);
  }
  return strides;
}

Shape UnravelIndex(Index offset, std::span<const Index> shape) {
  Shape index(shape.size(), 0);
  for (size_t k = shape.size(); k > 0; --k) {
    Index extent = shape[k - 1];
    if (extent <= 0) continue;
    index[k - 1] = offset % extent;
    offset /= extent;
  }
  return index;
}

std::string FormatShape(std::span<const Index> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

std::optional<Index> LastOffset(Index offset, std::span<const Index> shape,
                                std::span<const Index> strides) {
  Index last = offset;
  for (size_t k = 0; k < shape.size(); ++k) {
    auto step = CheckedMul(shape[k] - 1, strides[k]);
    if (!step) return std::nullopt;
    auto sum = CheckedAdd(last, *step);
    if (!sum) return std::nullopt;
    last = *sum;
  }
  return last;
}

}  // namespace reshard
