#include "reshard/ir/box_cover.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <unordered_set>

namespace reshard::internal {

Radix Radix::Build(Index n, std::span<const Index> required, std::span<const Index> candidates) {
  std::set<Index> chain = {1, n};
  for (Index stride : required) {
    if (stride > 1 && stride < n) chain.insert(stride);
  }
  std::vector<Index> sorted(candidates.begin(), candidates.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  for (Index c : sorted) {
    if (c <= 1 || c >= n || chain.count(c)) continue;
    auto hi = chain.upper_bound(c);
    auto lo = std::prev(hi);
    if (c % *lo == 0 && *hi % c == 0) chain.insert(c);
  }
  Radix radix;
  std::vector<Index> ascending(chain.begin(), chain.end());
  for (size_t i = ascending.size() - 1; i > 0; --i) {
    radix.dims_.push_back({ascending[i] / ascending[i - 1], ascending[i - 1]});
  }
  if (radix.dims_.empty()) radix.dims_.push_back({1, 1});
  return radix;
}

int Radix::DigitOfStride(Index stride) const {
  // Strides decrease with the digit index.
  auto it = std::lower_bound(dims_.begin(), dims_.end(), stride,
                             [](const RadixDim& d, Index s) { return d.stride > s; });
  if (it == dims_.end() || it->stride != stride) return -1;
  return static_cast<int>(it - dims_.begin());
}

void Radix::Digits(Index offset, Index* digits) const {
  for (size_t k = dims_.size(); k > 0; --k) {
    const RadixDim& d = dims_[k - 1];
    digits[k - 1] = offset % d.extent;
    offset /= d.extent;
  }
}

Index OffsetOfDigits(const Radix& radix, std::span<const Index> digits) {
  Index offset = 0;
  for (int k = 0; k < radix.rank(); ++k)
    offset += digits[static_cast<size_t>(k)] * radix.dim(k).stride;
  return offset;
}

int BoxSet::TryAddBox(Index offset, const std::vector<Dim>& dims, int32_t tag) {
  const int rank = radix_->rank();
  Index digits[64];
  Index lo[64];
  Index hi[64];
  bool used[64] = {};
  radix_->Digits(offset, digits);
  for (int j = 0; j < rank; ++j) {
    lo[j] = digits[j];
    hi[j] = digits[j] + 1;
  }
  for (size_t idx = 0; idx < dims.size(); ++idx) {
    int j = radix_->DigitOfStride(dims[idx].stride);
    if (j < 0) return static_cast<int>(idx);
    Index remaining = dims[idx].extent;
    while (true) {
      if (used[j]) return static_cast<int>(idx);
      const Index extent = radix_->dim(j).extent;
      if (digits[j] + remaining <= extent) {
        lo[j] = digits[j];
        hi[j] = digits[j] + remaining;
        used[j] = true;
        break;
      }
      if (digits[j] != 0 || remaining % extent != 0 || j == 0) return static_cast<int>(idx);
      lo[j] = 0;
      hi[j] = extent;
      used[j] = true;
      remaining /= extent;
      --j;
      if (remaining == 1) break;
    }
  }
  for (int j = 0; j < rank; ++j) {
    bounds_.push_back(lo[j]);
    bounds_.push_back(hi[j]);
  }
  tags_.push_back(tag);
  return -1;
}

Index AlignedPrefix(const Radix& radix, const Index* digits, int j, Index n) {
  // Walk up from digit j with `unit` = steps per unit of digit k; the run starts aligned to
  // `unit` as long as the digits below k are zero.
  Index unit = 1;
  for (int k = j; k >= 0; --k) {
    const Index e = radix.dim(k).extent;
    const Index d = digits[k];
    if (d != 0) {
      // Cut where digit k wraps, or else after the whole units of this level.
      const Index until_wrap = unit * (e - d);
      if (until_wrap < n) return until_wrap;
      const Index whole = n / unit * unit;
      return whole > 0 && whole < n ? whole : n;
    }
    if (unit > n / e) {
      // Digit k cannot be covered whole: cut after the whole units of the level below it.
      const Index whole = n / unit * unit;
      return whole > 0 && whole < n ? whole : n;
    }
    unit *= e;
  }
  return n;
}

Status BoxSet::AddDims(Index offset, std::vector<Dim>& dims, int32_t tag, size_t max_boxes) {
  if (tags_.size() >= max_boxes) {
    return ResourceExhaustedError(fmt::format(
        "the map is too fragmented to check: more than {} contiguous blocks", max_boxes));
  }
  const int failed = TryAddBox(offset, dims, tag);
  if (failed < 0) return Status::Ok();
  // A run along a digit that is not a box as a whole is cut where it aligns: a few boxes.
  const Dim walked = dims[static_cast<size_t>(failed)];
  if (const int j = radix_->DigitOfStride(walked.stride); j >= 0 && walked.extent > 1) {
    Index digits[64];
    radix_->Digits(offset, digits);
    const Index prefix = AlignedPrefix(*radix_, digits, j, walked.extent);
    if (prefix > 0 && prefix < walked.extent) {
      std::vector<Dim> head = dims;
      head[static_cast<size_t>(failed)].extent = prefix;
      RESHARD_RETURN_IF_ERROR(AddDims(offset, head, tag, max_boxes));
      std::vector<Dim> tail = dims;
      tail[static_cast<size_t>(failed)].extent = walked.extent - prefix;
      return AddDims(offset + prefix * walked.stride, tail, tag, max_boxes);
    }
  }
  // Otherwise the dimension is walked explicitly.
  std::vector<Dim> rest = dims;
  rest.erase(rest.begin() + failed);
  for (Index i = 0; i < walked.extent; ++i) {
    RESHARD_RETURN_IF_ERROR(AddDims(offset + i * walked.stride, rest, tag, max_boxes));
  }
  return Status::Ok();
}

Status BoxSet::AddView(Index offset, std::span<const Index> shape, std::span<const Index> strides,
                       int32_t tag, size_t max_boxes) {
  if (radix_->rank() > 64) return InternalError("radix of more than 64 digits");
  std::vector<Dim> dims;
  for (size_t k = 0; k < shape.size(); ++k) {
    if (shape[k] == 0) return Status::Ok();
    if (shape[k] > 1) dims.push_back({shape[k], strides[k]});
  }
  // The set of offsets does not depend on dimension order: sort outermost first and merge
  // dimensions that are contiguous with each other.
  std::stable_sort(dims.begin(), dims.end(),
                   [](const Dim& a, const Dim& b) { return a.stride > b.stride; });
  std::vector<Dim> merged;
  for (const Dim& d : dims) {
    if (!merged.empty() && merged.back().stride == d.extent * d.stride) {
      merged.back() = {merged.back().extent * d.extent, d.stride};
    } else {
      merged.push_back(d);
    }
  }
  return AddDims(offset, merged, tag, max_boxes);
}

PaddingSpec MakePaddingSpec(const Radix& radix, const Shape& logical, const Shape& valid) {
  PaddingSpec spec;
  if (valid == logical) return spec;
  const Shape strides = RowMajorStrides(logical);
  for (size_t k = 0; k < logical.size(); ++k) {
    int first = radix.rank();
    int last = -1;
    for (int j = 0; j < radix.rank(); ++j) {
      const Index s = radix.dim(j).stride;
      if (s >= strides[k] && s < strides[k] * logical[k]) {
        first = std::min(first, j);
        last = std::max(last, j);
      }
    }
    spec.first_digit.push_back(first);
    spec.last_digit.push_back(last);
  }
  spec.valid = valid;
  return spec;
}

namespace {

struct KeyHash {
  size_t operator()(const std::vector<Index>& key) const {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ key.size();
    for (Index v : key) {
      h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

class Sweeper {
 public:
  Sweeper(const BoxSet& boxes, const PaddingSpec& padding, const CellVisitor& visit)
      : boxes_(boxes),
        radix_(boxes.radix()),
        padding_(padding),
        visit_(visit),
        cell_lo_(static_cast<size_t>(radix_.rank()), 0),
        memo_(static_cast<size_t>(radix_.rank())) {}

  Status Run() {
    std::vector<int32_t> all(boxes_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i);
    return Level(0, all);
  }

 private:
  // Minimum index along logical dimension k over the cell whose digits up to `level` are set.
  Index PartialIndex(size_t k, int level) const {
    Index index = 0;
    const int first = padding_.first_digit[k];
    const int last = std::min(padding_.last_digit[k], level);
    if (first > padding_.last_digit[k]) return 0;
    const Index unit = radix_.dim(padding_.last_digit[k]).stride;
    for (int j = first; j <= last; ++j) {
      index += cell_lo_[static_cast<size_t>(j)] * (radix_.dim(j).stride / unit);
    }
    return index;
  }

  bool CellIsPadding() const {
    const int last_level = radix_.rank() - 1;
    for (size_t k = 0; k < padding_.valid.size(); ++k) {
      if (PartialIndex(k, last_level) >= padding_.valid[k]) return true;
    }
    return false;
  }

  Status Level(int level, const std::vector<int32_t>& active) {
    const size_t L = static_cast<size_t>(level);
    const Index extent = radix_.dim(level).extent;
    std::vector<int32_t> by_lo = active;
    std::sort(by_lo.begin(), by_lo.end(), [&](int32_t a, int32_t b) {
      return boxes_.lo(static_cast<size_t>(a), level) < boxes_.lo(static_cast<size_t>(b), level);
    });
    std::vector<Index> breaks = {0, extent};
    for (int32_t id : active) {
      breaks.push_back(boxes_.lo(static_cast<size_t>(id), level));
      breaks.push_back(boxes_.hi(static_cast<size_t>(id), level));
    }
    std::sort(breaks.begin(), breaks.end());
    breaks.erase(std::unique(breaks.begin(), breaks.end()), breaks.end());

    std::vector<int32_t> current;
    std::vector<int32_t> sorted;
    size_t next = 0;
    for (size_t s = 0; s + 1 < breaks.size(); ++s) {
      const Index a = breaks[s];
      current.erase(std::remove_if(
                        current.begin(), current.end(),
                        [&](int32_t id) { return boxes_.hi(static_cast<size_t>(id), level) <= a; }),
                    current.end());
      while (next < by_lo.size() && boxes_.lo(static_cast<size_t>(by_lo[next]), level) <= a) {
        current.push_back(by_lo[next++]);
      }
      sorted = current;
      std::sort(sorted.begin(), sorted.end());
      cell_lo_[L] = a;
      if (level + 1 == radix_.rank()) {
        RESHARD_RETURN_IF_ERROR(
            visit_(cell_lo_, sorted, !padding_.valid.empty() && CellIsPadding()));
        continue;
      }
      std::vector<Index> key(sorted.begin(), sorted.end());
      if (!padding_.valid.empty()) {
        key.push_back(-1);
        for (size_t k = 0; k < padding_.valid.size(); ++k) {
          if (padding_.first_digit[k] > level) continue;
          const Index partial = PartialIndex(k, level);
          if (padding_.last_digit[k] <= level) {
            key.push_back(partial >= padding_.valid[k] ? 1 : 0);
          } else {
            key.push_back(partial);
          }
        }
      }
      if (!memo_[L].insert(std::move(key)).second) continue;
      RESHARD_RETURN_IF_ERROR(Level(level + 1, sorted));
    }
    return Status::Ok();
  }

  const BoxSet& boxes_;
  const Radix& radix_;
  const PaddingSpec& padding_;
  const CellVisitor& visit_;
  std::vector<Index> cell_lo_;
  std::vector<std::unordered_set<std::vector<Index>, KeyHash>> memo_;
};

}  // namespace

Status SweepCells(const BoxSet& boxes, const PaddingSpec& padding, const CellVisitor& visit) {
  return Sweeper(boxes, padding, visit).Run();
}

}  // namespace reshard::internal
