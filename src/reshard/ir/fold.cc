#include "reshard/ir/fold.h"

#include <algorithm>
#include <numeric>
#include <optional>

namespace reshard::internal {

namespace {

// Above this many items a failed fold is partitioned by probing prefix lengths rather than
// by trying every one.
constexpr size_t kExhaustivePartitionItems = 64;
// An item that must be cut into rows to be regrouped may not produce more than this.
constexpr Index kMaxExploded = Index{1} << 20;

Index Count(const FoldItem& item) {
  Index n = 1;
  for (const FoldDim& d : item.dims) n *= d.extent;
  return n;
}

Pair LastOffset(const FoldItem& item) {
  Pair last = item.offset;
  for (const FoldDim& d : item.dims) last = last + d.stride * (d.extent - 1);
  return last;
}

// Offset of the second unit of the sequence (the sequence has at least two units).
Pair SecondOffset(const std::vector<FoldItem>& items) {
  const FoldItem& first = items.front();
  if (!first.dims.empty()) return first.offset + first.dims.back().stride;
  return items[1].offset;
}

// The period P of the sequence (1 when it cannot be grouped), given the unit step d.
Index Period(const std::vector<FoldItem>& items, Index total, Pair d) {
  Index p = total;
  Index g = 0;  // global position of the current item's first unit
  for (size_t i = 0; i < items.size() && p > 1; ++i) {
    const FoldItem& item = items[i];
    const Index count = Count(item);
    if (!item.dims.empty()) {
      const FoldDim& inner = item.dims.back();
      if (inner.stride != d) {
        // Every step inside the item is a break: at g + 1, g + 2, ...
        if (count > 2) return 1;
        p = std::gcd(p, g + 1);
      } else {
        // Wraps of dim j happen every N_j (the product of the extents inside it), at
        // multiples r of N_j that are not multiples of the wrap above; the first three of them
        // fix the gcd of all.
        Index inside = inner.extent;
        Pair wrap = inner.stride * (inner.extent - 1);
        for (size_t j = item.dims.size() - 1; j-- > 0;) {
          const FoldDim& dim = item.dims[j];
          if (dim.stride - wrap != d) {
            int taken = 0;
            for (Index r = 1; r * inside < count && taken < 3; ++r) {
              if (r % dim.extent == 0) continue;
              p = std::gcd(p, g + r * inside);
              ++taken;
            }
          }
          wrap = wrap + dim.stride * (dim.extent - 1);
          inside *= dim.extent;
        }
      }
    }
    g += count;
    if (i + 1 < items.size() && items[i + 1].offset - LastOffset(item) != d) p = std::gcd(p, g);
  }
  return p;
}

// Cuts a multi-dim item into its innermost rows (1-dim items).
bool ExplodeRows(const FoldItem& item, std::vector<FoldItem>& out) {
  const Index rows = Count(item) / item.dims.back().extent;
  if (rows > kMaxExploded) return false;
  std::vector<Index> index(item.dims.size() - 1, 0);
  for (Index r = 0; r < rows; ++r) {
    Pair offset = item.offset;
    for (size_t k = 0; k < index.size(); ++k) offset = offset + item.dims[k].stride * index[k];
    out.push_back({offset, {item.dims.back()}});
    for (size_t k = index.size(); k-- > 0;) {
      if (++index[k] < item.dims[k].extent) break;
      index[k] = 0;
    }
  }
  return true;
}

// Keeps the units of a 0- or 1-dim item starting at global position g whose positions are
// multiples of p.
void SubsampleRun(const FoldItem& item, Index g, Index p, std::vector<FoldItem>& out) {
  if (item.dims.empty()) {
    if (g % p == 0) AppendItem(out, item);
    return;
  }
  const FoldDim& d = item.dims[0];
  const Index first = (p - g % p) % p;
  if (first >= d.extent) return;
  const Index kept = (d.extent - first + p - 1) / p;
  FoldItem sub{item.offset + d.stride * first, {}};
  if (kept > 1) sub.dims.push_back({kept, d.stride * p});
  AppendItem(out, std::move(sub));
}

// Keeps the units at global positions that are multiples of p.
bool Subsample(const std::vector<FoldItem>& items, Index p, std::vector<FoldItem>& out) {
  Index g = 0;
  for (const FoldItem& item : items) {
    const Index count = Count(item);
    if (item.dims.size() <= 1) {
      SubsampleRun(item, g, p, out);
    } else if (g % p == 0 && item.dims.back().extent % p == 0) {
      FoldItem sub = item;
      sub.dims.back() = {item.dims.back().extent / p, item.dims.back().stride * p};
      NormalizeDims(sub.dims);
      AppendItem(out, std::move(sub));
    } else {
      // The item's rows do not line up with the groups: regroup row by row.
      std::vector<FoldItem> rows;
      if (!ExplodeRows(item, rows)) return false;
      Index h = g;
      for (const FoldItem& row : rows) {
        SubsampleRun(row, h, p, out);
        h += row.dims[0].extent;
      }
    }
    g += count;
  }
  return true;
}

// Folds the whole sequence into one piece, or nullopt.
std::optional<FoldedPiece> FoldOne(const std::vector<FoldItem>& input) {
  std::vector<FoldItem> items = input;
  std::vector<FoldDim> unit;  // the dims of one unit, outermost first
  Index total = 0;
  for (const FoldItem& item : items) total += Count(item);
  const Index num_elements = total;
  while (true) {
    if (total == 1) {
      FoldedPiece piece{items.front().offset, unit, num_elements};
      NormalizeDims(piece.dims);
      return piece;
    }
    const Pair d = SecondOffset(items) - items.front().offset;
    // A piece's strides are non-negative: a sequence that steps backwards in F does not fold.
    const Index p = d.src > 0 && d.dst > 0 ? Period(items, total, d) : 1;
    if (p <= 1) return std::nullopt;
    std::vector<FoldItem> next;
    if (!Subsample(items, p, next)) return std::nullopt;
    items = std::move(next);
    unit.insert(unit.begin(), FoldDim{p, d});
    total /= p;
  }
}

void Partition(const std::vector<FoldItem>& items, std::vector<FoldedPiece>& out) {
  size_t start = 0;
  while (start < items.size()) {
    const size_t remaining = items.size() - start;
    auto fold_prefix = [&](size_t len) {
      return FoldOne(
          std::vector<FoldItem>(items.begin() + static_cast<std::ptrdiff_t>(start),
                                items.begin() + static_cast<std::ptrdiff_t>(start + len)));
    };
    size_t best_len = 1;
    std::optional<FoldedPiece> best;
    if (remaining <= kExhaustivePartitionItems) {
      for (size_t len = remaining; len >= 1; --len) {
        best = fold_prefix(len);
        if (best) {
          best_len = len;
          break;
        }
      }
    } else {
      // Probe 1, 2, 4, ... then bisect between the last success and the first failure.
      size_t good = 1;
      best = fold_prefix(1);
      size_t bad = 0;
      for (size_t len = 2; len <= remaining; len *= 2) {
        auto attempt = fold_prefix(len);
        if (!attempt) {
          bad = len;
          break;
        }
        good = len;
        best = attempt;
      }
      if (bad == 0 && good < remaining) {
        if (auto all = fold_prefix(remaining)) {
          good = remaining;
          best = all;
        } else {
          bad = remaining;
        }
      }
      while (bad > good + 1) {
        const size_t mid = good + (bad - good) / 2;
        if (auto attempt = fold_prefix(mid)) {
          good = mid;
          best = attempt;
        } else {
          bad = mid;
        }
      }
      best_len = good;
    }
    if (!best) {
      // A single item is always one affine block; only a too-large explosion gets here.
      FoldedPiece piece{items[start].offset, items[start].dims, Count(items[start])};
      best = piece;
      best_len = 1;
    }
    out.push_back(*best);
    start += best_len;
  }
}

}  // namespace

void NormalizeDims(std::vector<FoldDim>& dims) {
  std::vector<FoldDim> out;
  for (const FoldDim& d : dims) {
    if (d.extent == 1) continue;
    if (!out.empty() && out.back().stride == d.stride * d.extent) {
      out.back() = {out.back().extent * d.extent, d.stride};
    } else {
      out.push_back(d);
    }
  }
  dims = std::move(out);
}

void AppendItem(std::vector<FoldItem>& items, FoldItem item) {
  NormalizeDims(item.dims);
  if (!items.empty() && item.dims.size() <= 1) {
    FoldItem& last = items.back();
    if (last.dims.size() <= 1) {
      const Pair gap = item.offset - LastOffset(last);
      const bool last_ok = last.dims.empty() || last.dims[0].stride == gap;
      const bool item_ok = item.dims.empty() || item.dims[0].stride == gap;
      if (last_ok && item_ok && gap.src > 0 && gap.dst > 0) {
        last.dims = {FoldDim{Count(last) + Count(item), gap}};
        return;
      }
    }
  }
  items.push_back(std::move(item));
}

std::vector<FoldedPiece> FoldSequence(const std::vector<FoldItem>& items) {
  std::vector<FoldedPiece> out;
  if (items.empty()) return out;
  if (auto one = FoldOne(items)) {
    out.push_back(*one);
    return out;
  }
  Partition(items, out);
  return out;
}

}  // namespace reshard::internal
