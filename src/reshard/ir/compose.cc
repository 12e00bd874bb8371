#include "reshard/ir/compose.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <memory>
#include <numeric>
#include <tuple>
#include <type_traits>

#include "reshard/ir/box_cover.h"

namespace reshard {

using internal::PaddingSpec;
using internal::Radix;

namespace {

// Beyond this many boxes (per map) planning is refused as too fragmented.
constexpr size_t kMaxPlanBoxes = size_t{1} << 22;

// A vector of trivially copyable values with room for N of them in place, on the heap beyond.
// Boxes and regions hold one value per radix digit (a handful) and are made and copied for
// every piece and every move: kept in place, planning a tensor of few pieces allocates little.
template <typename T, size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  SmallVector() = default;
  explicit SmallVector(size_t n, T value = T{}) { resize(n, value); }
  template <typename It>
  SmallVector(It first, It last) {
    Reserve(static_cast<size_t>(std::distance(first, last)));
    for (; first != last; ++first) data()[size_++] = *first;
  }
  SmallVector(const SmallVector& o) { Assign(o.data(), o.size_); }
  SmallVector& operator=(const SmallVector& o) {
    if (this != &o) Assign(o.data(), o.size_);
    return *this;
  }
  SmallVector(SmallVector&& o) noexcept { Steal(o); }
  SmallVector& operator=(SmallVector&& o) noexcept {
    if (this != &o) {
      heap_.reset();
      capacity_ = N;
      Steal(o);
    }
    return *this;
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return heap_ ? heap_.get() : inline_; }
  const T* data() const { return heap_ ? heap_.get() : inline_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& back() { return data()[size_ - 1]; }
  void push_back(const T& v) {
    Reserve(size_ + 1);
    data()[size_++] = v;
  }
  void resize(size_t n, T value = T{}) {
    Reserve(n);
    for (size_t i = size_; i < n; ++i) data()[i] = value;
    size_ = n;
  }
  void erase(T* pos) {
    std::copy(pos + 1, end(), pos);
    --size_;
  }

 private:
  void Reserve(size_t n) {
    if (n <= capacity_) return;
    const size_t capacity = std::max(n, 2 * capacity_);
    auto grown = std::make_unique<T[]>(capacity);
    std::copy_n(data(), size_, grown.get());
    heap_ = std::move(grown);
    capacity_ = capacity;
  }
  void Assign(const T* values, size_t n) {
    size_ = 0;
    Reserve(n);
    std::copy_n(values, n, data());
    size_ = n;
  }
  void Steal(SmallVector& o) {
    if (o.heap_) {
      heap_ = std::move(o.heap_);
      capacity_ = o.capacity_;
    } else {
      std::copy_n(o.inline_, o.size_, inline_);
    }
    size_ = o.size_;
    o.size_ = 0;
    o.capacity_ = N;
  }

  T inline_[N];
  std::unique_ptr<T[]> heap_;
  size_t size_ = 0;
  size_t capacity_ = N;
};

// One value per radix digit.
using DigitVector = SmallVector<Index, 8>;

// A piece (or part of one) as a box of digits of F, with the affine map from digits to the
// shard: shard offset = base + sum_j (digit_j - lo_j) * coef_j.
struct AffineBox {
  Rank rank;
  int32_t piece;
  Index base;
  DigitVector lo, hi, coef;
};

struct BoxDim {
  Index extent;
  Index src;  // stride in F
  Index dst;  // stride in the shard
};

using BoxDims = SmallVector<BoxDim, 8>;

class BoxBuilder {
 public:
  explicit BoxBuilder(const Radix& radix)
      : radix_(radix), digits_(static_cast<size_t>(radix.rank())) {}

  Status AddPiece(const Piece& p, Rank rank, int32_t index, std::vector<AffineBox>& out) {
    if (p.num_elements() == 0) return Status::Ok();
    BoxDims dims;
    for (size_t k = 0; k < p.shape.size(); ++k) {
      if (p.shape[k] > 1) dims.push_back({p.shape[k], p.source.strides[k], p.dest.strides[k]});
    }
    std::stable_sort(dims.begin(), dims.end(),
                     [](const BoxDim& a, const BoxDim& b) { return a.src > b.src; });
    return Add(p.source.offset, p.dest.offset, dims, rank, index, out);
  }

 private:
  Status Add(Index src, Index dst, const BoxDims& dims, Rank rank, int32_t index,
             std::vector<AffineBox>& out) {
    if (out.size() >= kMaxPlanBoxes) {
      return ResourceExhaustedError(
          fmt::format("the maps are too fragmented to plan: more than {} blocks", kMaxPlanBoxes));
    }
    const int failed = TryBox(src, dst, dims, rank, index, out);
    if (failed < 0) return Status::Ok();
    const BoxDim walked = dims[static_cast<size_t>(failed)];
    // A run along a digit that is not a box as a whole is cut where it aligns.
    if (const int j = radix_.DigitOfStride(walked.src); j >= 0 && walked.extent > 1) {
      radix_.Digits(src, digits_.data());
      const Index prefix = internal::AlignedPrefix(radix_, digits_.data(), j, walked.extent);
      if (prefix > 0 && prefix < walked.extent) {
        BoxDims head = dims;
        head[static_cast<size_t>(failed)].extent = prefix;
        RESHARD_RETURN_IF_ERROR(Add(src, dst, head, rank, index, out));
        BoxDims tail = dims;
        tail[static_cast<size_t>(failed)].extent = walked.extent - prefix;
        return Add(src + prefix * walked.src, dst + prefix * walked.dst, tail, rank, index, out);
      }
    }
    BoxDims rest = dims;
    rest.erase(rest.begin() + failed);
    for (Index i = 0; i < walked.extent; ++i) {
      RESHARD_RETURN_IF_ERROR(
          Add(src + i * walked.src, dst + i * walked.dst, rest, rank, index, out));
    }
    return Status::Ok();
  }

  // Appends the box and returns -1, or returns the index of the first dim that does not fit.
  int TryBox(Index src, Index dst, const BoxDims& dims, Rank rank, int32_t index,
             std::vector<AffineBox>& out) {
    const int n = radix_.rank();
    radix_.Digits(src, digits_.data());
    AffineBox box{rank, index,
                  dst,  DigitVector(digits_.begin(), digits_.end()),
                  {},   DigitVector(static_cast<size_t>(n), 0)};
    box.hi = box.lo;
    for (Index& h : box.hi) ++h;
    DigitVector used(static_cast<size_t>(n), 0);
    for (size_t k = 0; k < dims.size(); ++k) {
      int j = radix_.DigitOfStride(dims[k].src);
      if (j < 0) return static_cast<int>(k);
      Index remaining = dims[k].extent;
      while (true) {
        const auto J = static_cast<size_t>(j);
        if (used[J] != 0) return static_cast<int>(k);
        const Index extent = radix_.dim(j).extent;
        const Index coef = dims[k].dst * (radix_.dim(j).stride / dims[k].src);
        if (digits_[J] + remaining <= extent) {
          box.hi[J] = digits_[J] + remaining;
          box.coef[J] = coef;
          used[J] = 1;
          break;
        }
        if (digits_[J] != 0 || remaining % extent != 0 || j == 0) return static_cast<int>(k);
        box.lo[J] = 0;
        box.hi[J] = extent;
        box.coef[J] = coef;
        used[J] = 1;
        remaining /= extent;
        --j;
        if (remaining == 1) break;
      }
    }
    out.push_back(std::move(box));
    return -1;
  }

  const Radix& radix_;
  std::vector<Index> digits_;
};

// A box of digits.
struct Region {
  DigitVector lo, hi;
  Index size() const {
    Index n = 1;
    for (size_t j = 0; j < lo.size(); ++j) n *= hi[j] - lo[j];
    return n;
  }
};

// `a` is a Region or an AffineBox.
template <typename Box>
bool Intersect(const Box& a, const AffineBox& b, Region& out) {
  out.lo.resize(a.lo.size());
  out.hi.resize(a.lo.size());
  for (size_t j = 0; j < a.lo.size(); ++j) {
    out.lo[j] = std::max(a.lo[j], b.lo[j]);
    out.hi[j] = std::min(a.hi[j], b.hi[j]);
    if (out.lo[j] >= out.hi[j]) return false;
  }
  return true;
}

// Splits `r` along one padded logical dimension into the part that is valid (index < valid)
// or the part that is padding, as disjoint boxes.
void SplitAlong(const Region& r, const Radix& radix, int first, int last, Index valid,
                bool keep_valid, std::vector<Region>& out) {
  // valid's digits over [first, last].
  DigitVector q(static_cast<size_t>(radix.rank()), 0);
  Index rest = valid;
  for (int j = last; j >= first; --j) {
    const Index e = radix.dim(j).extent;
    q[static_cast<size_t>(j)] = j == first ? rest : rest % e;
    rest /= e;
  }
  Region prefix = r;
  for (int j = first; j <= last; ++j) {
    const auto J = static_cast<size_t>(j);
    // digits before j equal q's: d_j < q_j is valid whatever follows, d_j > q_j is padding.
    Region below = prefix;
    below.hi[J] = std::min(r.hi[J], q[J]);
    Region above = prefix;
    above.lo[J] = std::max(r.lo[J], q[J] + 1);
    if (keep_valid && below.lo[J] < below.hi[J]) out.push_back(below);
    if (!keep_valid && above.lo[J] < above.hi[J]) out.push_back(above);
    if (q[J] < r.lo[J] || q[J] >= r.hi[J]) return;
    prefix.lo[J] = q[J];
    prefix.hi[J] = q[J] + 1;
  }
  // Every digit equal to valid's: index == valid, which is padding.
  if (!keep_valid) out.push_back(prefix);
}

// The valid part (or the padding part) of a region, as disjoint boxes.
std::vector<Region> Clip(const Region& r, const Radix& radix, const PaddingSpec& padding,
                         bool keep_valid) {
  if (padding.valid.empty()) return keep_valid ? std::vector<Region>{r} : std::vector<Region>{};
  std::vector<Region> valid_so_far = {r};
  std::vector<Region> padded;
  for (size_t k = 0; k < padding.valid.size(); ++k) {
    const int first = padding.first_digit[k];
    const int last = padding.last_digit[k];
    if (first > last) {
      // A dimension of extent 1: index 0 is padding only when valid is 0.
      if (padding.valid[k] == 0) {
        if (!keep_valid) padded.insert(padded.end(), valid_so_far.begin(), valid_so_far.end());
        valid_so_far.clear();
      }
      continue;
    }
    std::vector<Region> next;
    for (const Region& v : valid_so_far) {
      if (!keep_valid) SplitAlong(v, radix, first, last, padding.valid[k], false, padded);
      SplitAlong(v, radix, first, last, padding.valid[k], true, next);
    }
    valid_so_far = std::move(next);
  }
  return keep_valid ? valid_so_far : padded;
}

// Calls f on each box of the valid part (or the padding part) of a region, as Clip gives them;
// without padding, on the region itself (the valid part) or on nothing, with no copy.
template <typename F>
void ForEachClipped(const Region& r, const Radix& radix, const PaddingSpec& padding,
                    bool keep_valid, F&& f) {
  if (padding.valid.empty()) {
    if (keep_valid) f(r);
    return;
  }
  for (const Region& v : Clip(r, radix, padding, keep_valid)) f(v);
}

Index ShardOffset(const AffineBox& b, const Region& r) {
  Index offset = b.base;
  for (size_t j = 0; j < r.lo.size(); ++j) offset += (r.lo[j] - b.lo[j]) * b.coef[j];
  return offset;
}

// Drops extent-1 dims, orders dims by destination stride (outermost first) and merges dims
// contiguous on both sides.
void NormalizeMove(Move& m) {
  struct D {
    Index n, s, d;
  };
  SmallVector<D, 8> dims;
  for (size_t k = 0; k < m.shape.size(); ++k) {
    if (m.shape[k] != 1) dims.push_back({m.shape[k], m.src.strides[k], m.dst.strides[k]});
  }
  std::stable_sort(dims.begin(), dims.end(),
                   [](const D& a, const D& b) { return a.d != b.d ? a.d > b.d : a.s > b.s; });
  SmallVector<D, 8> merged;
  for (const D& d : dims) {
    if (!merged.empty() && merged.back().s == d.n * d.s && merged.back().d == d.n * d.d) {
      merged.back() = {merged.back().n * d.n, d.s, d.d};
    } else {
      merged.push_back(d);
    }
  }
  m.shape.clear();
  m.src.strides.clear();
  m.dst.strides.clear();
  for (const D& d : merged) {
    m.shape.push_back(d.n);
    m.src.strides.push_back(d.s);
    m.dst.strides.push_back(d.d);
  }
}

bool SameDims(const Move& a, const Move& b) {
  return a.shape == b.shape && a.src.strides == b.src.strides && a.dst.strides == b.dst.strides;
}

// Folds a group of moves with one (src_rank, dst_rank, factor) into as few as it can: runs of
// equal moves at constant offset steps become one move with an extra dimension, and a move
// that continues another's outermost dimension extends it.
void FoldGroup(std::vector<Move>& group) {
  bool changed = true;
  while (changed && group.size() > 1) {
    changed = false;
    std::sort(group.begin(), group.end(), [](const Move& a, const Move& b) {
      return std::tie(a.dst.offset, a.src.offset) < std::tie(b.dst.offset, b.src.offset);
    });
    std::vector<Move> out;
    size_t i = 0;
    while (i < group.size()) {
      Move cur = group[i];
      size_t j = i + 1;
      if (j < group.size() && SameDims(cur, group[j])) {
        const Index ds = group[j].src.offset - cur.src.offset;
        const Index dd = group[j].dst.offset - cur.dst.offset;
        size_t k = j + 1;
        while (k < group.size() && SameDims(cur, group[k]) &&
               group[k].src.offset - group[k - 1].src.offset == ds &&
               group[k].dst.offset - group[k - 1].dst.offset == dd) {
          ++k;
        }
        if (ds > 0 && dd > 0) {
          cur.shape.insert(cur.shape.begin(), static_cast<Index>(k - i));
          cur.src.strides.insert(cur.src.strides.begin(), ds);
          cur.dst.strides.insert(cur.dst.strides.begin(), dd);
          NormalizeMove(cur);
          out.push_back(std::move(cur));
          i = k;
          changed = true;
          continue;
        }
      }
      // cur's outermost dim continued by the next move (same inner dims).
      if (j < group.size() && !cur.shape.empty()) {
        const Move& next = group[j];
        const Index n = cur.shape[0];
        const Index s = cur.src.strides[0];
        const Index d = cur.dst.strides[0];
        const bool inner_equal =
            std::equal(cur.shape.begin() + 1, cur.shape.end(),
                       next.shape.begin() + (next.shape.size() + 1 == cur.shape.size() ? 0 : 1),
                       next.shape.end()) &&
            (next.shape.size() + 1 == cur.shape.size() ||
             (next.shape.size() == cur.shape.size() && next.src.strides[0] == s &&
              next.dst.strides[0] == d));
        if (inner_equal && next.src.offset == cur.src.offset + n * s &&
            next.dst.offset == cur.dst.offset + n * d) {
          const size_t off = next.shape.size() + 1 == cur.shape.size() ? 0 : 1;
          bool strides_equal =
              std::equal(cur.src.strides.begin() + 1, cur.src.strides.end(),
                         next.src.strides.begin() + static_cast<std::ptrdiff_t>(off)) &&
              std::equal(cur.dst.strides.begin() + 1, cur.dst.strides.end(),
                         next.dst.strides.begin() + static_cast<std::ptrdiff_t>(off));
          if (strides_equal) {
            cur.shape[0] += off == 0 ? 1 : next.shape[0];
            NormalizeMove(cur);
            out.push_back(std::move(cur));
            i = j + 1;
            changed = true;
            continue;
          }
        }
      }
      out.push_back(std::move(cur));
      ++i;
    }
    group = std::move(out);
  }
}

Status CheckSameTensor(const ParamMap& target, const ParamMap& source) {
  const Shape& a = target.logical_shape();
  const Shape& b = source.logical_shape();
  bool ok = a.size() == b.size() && target.valid_shape() == source.valid_shape();
  for (size_t k = 1; ok && k < a.size(); ++k) ok = a[k] == b[k];
  if (!ok) {
    return FailedPreconditionError(fmt::format(
        "the maps describe different tensors: source F {} (valid {}), target F {} (valid {}); "
        "they must have the same valid shape and may differ only in the padding of the first "
        "dimension",
        FormatShape(b), FormatShape(source.valid_shape()), FormatShape(a),
        FormatShape(target.valid_shape())));
  }
  return Status::Ok();
}

}  // namespace

Index ParamPlan::num_moved_elements() const {
  Index n = 0;
  for (const Move& m : moves) n += m.num_elements();
  return n;
}

Rank PreferSameRankThenBalance(const ReplicaChoice& choice) {
  if (std::binary_search(choice.holders.begin(), choice.holders.end(), choice.dst_rank)) {
    return choice.dst_rank;
  }
  if (!choice.continuing.empty()) return choice.continuing.front();
  Rank best = choice.holders.front();
  for (Rank h : choice.holders) {
    if (choice.assigned[static_cast<size_t>(h)] < choice.assigned[static_cast<size_t>(best)]) {
      best = h;
    }
  }
  return best;
}

namespace {

using MoveGroups = std::map<std::tuple<Rank, Rank, double>, std::vector<Move>>;

// Both maps' pieces as boxes of digits of the (larger) logical shape.
struct BoxedMaps {
  Shape logical;
  Radix radix;
  PaddingSpec padding;
  std::vector<AffineBox> source_boxes;
  std::vector<AffineBox> target_boxes;
};

Status AddBoxes(BoxBuilder& builder, const ParamMap& map, std::vector<AffineBox>& boxes) {
  size_t pieces = 0;
  for (const RankShard& shard : map.ranks()) pieces += shard.pieces.size();
  boxes.reserve(pieces);
  for (Rank r = 0; r < map.world_size(); ++r) {
    for (size_t i = 0; i < map.rank(r).pieces.size(); ++i) {
      RESHARD_RETURN_IF_ERROR(
          builder.AddPiece(map.rank(r).pieces[i], r, static_cast<int32_t>(i), boxes));
    }
  }
  return Status::Ok();
}

Result<BoxedMaps> BoxMaps(const ParamMap& target, const ParamMap& source, Shape logical) {
  std::vector<Index> candidates;
  for (const ParamMap* m : {&target, &source}) {
    for (const RankShard& shard : m->ranks()) {
      for (const Piece& p : shard.pieces) {
        candidates.insert(candidates.end(), p.source.strides.begin(), p.source.strides.end());
      }
    }
  }
  BoxedMaps boxed{.logical = logical,
                  .radix = Radix::Build(ProductOf(logical), RowMajorStrides(logical), candidates),
                  .padding = {},
                  .source_boxes = {},
                  .target_boxes = {}};
  boxed.padding = internal::MakePaddingSpec(boxed.radix, logical, target.valid_shape());
  BoxBuilder builder(boxed.radix);
  RESHARD_RETURN_IF_ERROR(AddBoxes(builder, source, boxed.source_boxes));
  RESHARD_RETURN_IF_ERROR(AddBoxes(builder, target, boxed.target_boxes));
  return boxed;
}

// Appends the moves that copy the part of target box `t` inside source box `sb` (padding
// clipped) to `out`.
void MovesBetween(const BoxedMaps& boxed, const AffineBox& t, const AffineBox& sb, double factor,
                  std::vector<Move>& out) {
  Region inter;
  if (!Intersect(t, sb, inter)) return;
  ForEachClipped(inter, boxed.radix, boxed.padding, true, [&](const Region& v) {
    Move m;
    m.src_rank = sb.rank;
    m.dst_rank = t.rank;
    m.src.offset = ShardOffset(sb, v);
    m.dst.offset = ShardOffset(t, v);
    size_t dims = 0;
    for (size_t j = 0; j < v.lo.size(); ++j) dims += v.hi[j] - v.lo[j] == 1 ? 0 : 1;
    m.shape.reserve(dims);
    m.src.strides.reserve(dims);
    m.dst.strides.reserve(dims);
    for (size_t j = 0; j < v.lo.size(); ++j) {
      if (v.hi[j] - v.lo[j] == 1) continue;
      m.shape.push_back(v.hi[j] - v.lo[j]);
      m.src.strides.push_back(sb.coef[j]);
      m.dst.strides.push_back(t.coef[j]);
    }
    m.factor = factor;
    NormalizeMove(m);
    out.push_back(std::move(m));
  });
}

bool IsContiguous(const Move& m) {
  return m.shape.size() == 1 && m.src.strides[0] == 1 && m.dst.strides[0] == 1;
}

// Whether `next` starts where `last` ends, in both shards, both being contiguous runs.
bool Continues(const Move& last, const Move& next) {
  return IsContiguous(last) && IsContiguous(next) &&
         last.src.offset + last.shape[0] == next.src.offset &&
         last.dst.offset + last.shape[0] == next.dst.offset;
}

// The first non-padding element of target box `t` that no source box holds, as an error.
Status UncoveredElement(const BoxedMaps& boxed, const AffineBox& t) {
  for (const Region& v : Clip(Region{t.lo, t.hi}, boxed.radix, boxed.padding, true)) {
    std::vector<Index> digits(v.lo.begin(), v.lo.end());
    while (true) {
      const bool held = std::any_of(boxed.source_boxes.begin(), boxed.source_boxes.end(),
                                    [&](const AffineBox& sb) {
                                      for (size_t j = 0; j < digits.size(); ++j) {
                                        if (digits[j] < sb.lo[j] || digits[j] >= sb.hi[j])
                                          return false;
                                      }
                                      return true;
                                    });
      if (!held) {
        return FailedPreconditionError(fmt::format(
            "element {} of F is held by target rank {} but by no source rank",
            FormatShape(UnravelIndex(internal::OffsetOfDigits(boxed.radix, digits), boxed.logical)),
            t.rank));
      }
      size_t j = digits.size();
      while (j > 0) {
        if (++digits[j - 1] < v.hi[j - 1]) break;
        digits[j - 1] = v.lo[j - 1];
        --j;
      }
      if (j == 0) break;
    }
  }
  return InternalError("a target block is not covered but no uncovered element was found");
}

// The padding of target box `t`, which no move writes.
void AddUnwritten(const BoxedMaps& boxed, const AffineBox& t, ParamPlan& plan) {
  if (boxed.padding.valid.empty()) return;  // no padding: every element is written
  for (const Region& v : Clip(Region{t.lo, t.hi}, boxed.radix, boxed.padding, false)) {
    UnwrittenBlock u;
    u.dst_rank = t.rank;
    u.dst.offset = ShardOffset(t, v);
    for (size_t j = 0; j < v.lo.size(); ++j) {
      if (v.hi[j] - v.lo[j] == 1) continue;
      u.shape.push_back(v.hi[j] - v.lo[j]);
      u.dst.strides.push_back(t.coef[j]);
    }
    plan.unwritten.push_back(std::move(u));
  }
}

// The source boxes that may meet a box, found without trying every one: the boxes sorted by
// their low end on one digit (the digit whose low ends differ most), under a tree of the
// largest high end in each range of that order. A query visits the boxes that overlap it on
// that digit and O(log n) tree nodes for each, so planning many small pieces costs in
// proportion to the pieces, not to their square.
class SourceBoxIndex {
 public:
  explicit SourceBoxIndex(const std::vector<AffineBox>& boxes) {
    const size_t n = boxes.size();
    if (n == 0 || boxes[0].lo.size() == 0) {
      digit_ = -1;
      order_.resize(n);
      std::iota(order_.begin(), order_.end(), size_t{0});
      return;
    }
    digit_ = MostVariedDigit(boxes);
    const auto j = static_cast<size_t>(digit_);
    order_.resize(n);
    std::iota(order_.begin(), order_.end(), size_t{0});
    std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) {
      return std::tie(boxes[a].lo[j], a) < std::tie(boxes[b].lo[j], b);
    });
    lo_.resize(n);
    hi_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      lo_[i] = boxes[order_[i]].lo[j];
      hi_[i] = boxes[order_[i]].hi[j];
    }
    max_hi_.assign(4 * n, 0);
    Build(1, 0, n);
  }

  // Calls f(s) for every source box s whose extent on the index's digit meets [lo, hi) of `t`
  // (each once; the caller intersects the other digits).
  template <typename F>
  void ForEachCandidate(const AffineBox& t, F&& f) const {
    if (digit_ < 0) {
      for (size_t s : order_) f(s);
      return;
    }
    const Index lo = t.lo[static_cast<size_t>(digit_)];
    const Index hi = t.hi[static_cast<size_t>(digit_)];
    const auto end =
        static_cast<size_t>(std::lower_bound(lo_.begin(), lo_.end(), hi) - lo_.begin());
    Visit(1, 0, order_.size(), end, lo, f);
  }

 private:
  static int MostVariedDigit(const std::vector<AffineBox>& boxes) {
    int best = 0;
    size_t best_distinct = 0;
    std::vector<Index> values(boxes.size());
    for (size_t j = 0; j < boxes[0].lo.size(); ++j) {
      for (size_t i = 0; i < boxes.size(); ++i) values[i] = boxes[i].lo[j];
      std::sort(values.begin(), values.end());
      const auto distinct =
          static_cast<size_t>(std::unique(values.begin(), values.end()) - values.begin());
      if (distinct > best_distinct) {
        best = static_cast<int>(j);
        best_distinct = distinct;
      }
    }
    return best;
  }

  Index Build(size_t node, size_t l, size_t r) {
    if (r - l == 1) return max_hi_[node] = hi_[l];
    const size_t mid = l + (r - l) / 2;
    return max_hi_[node] = std::max(Build(2 * node, l, mid), Build(2 * node + 1, mid, r));
  }

  // Boxes among positions [l, r) of the order, before `end`, whose high end is above `lo`.
  template <typename F>
  void Visit(size_t node, size_t l, size_t r, size_t end, Index lo, F& f) const {
    if (l >= end || max_hi_[node] <= lo) return;
    if (r - l == 1) {
      f(order_[l]);
      return;
    }
    const size_t mid = l + (r - l) / 2;
    Visit(2 * node, l, mid, end, lo, f);
    Visit(2 * node + 1, mid, r, end, lo, f);
  }

  int digit_ = -1;
  std::vector<size_t> order_;   // box indices by low end on the digit
  std::vector<Index> lo_, hi_;  // their extents on the digit, in that order
  std::vector<Index> max_hi_;   // the tree: largest high end under each node
};

// Plans one target box: for each set of source holders of a part of it, picks a holder and
// adds that holder's moves to `groups`.
class TargetBoxPlanner {
 public:
  TargetBoxPlanner(const ParamMap& target, const ParamMap& source, const BoxedMaps& boxed,
                   const ComposeOptions& options)
      : target_(target),
        source_(source),
        boxed_(boxed),
        options_(options),
        index_(boxed.source_boxes),
        assigned_(static_cast<size_t>(source.world_size()), 0) {}

  Status Plan(const AffineBox& t, MoveGroups& groups) {
    const Piece& tp = target_.rank(t.rank).pieces[static_cast<size_t>(t.piece)];
    // Source boxes that meet t, grouped by their holder set (sets in ascending order, each
    // set's boxes in ascending order).
    Region inter;
    meeting_.clear();
    index_.ForEachCandidate(t, [&](size_t s) {
      if (Intersect(t, boxed_.source_boxes[s], inter)) {
        meeting_.push_back({&SourcePiece(boxed_.source_boxes[s]).locations, s});
      }
    });
    std::sort(meeting_.begin(), meeting_.end(), [](const Meeting& a, const Meeting& b) {
      return *a.holders != *b.holders ? *a.holders < *b.holders : a.box < b.box;
    });
    Index covered = 0;
    for (size_t i = 0; i < meeting_.size();) {
      const std::vector<Rank>& holders = *meeting_[i].holders;
      boxes_.clear();
      for (; i < meeting_.size() && *meeting_[i].holders == holders; ++i) {
        boxes_.push_back(meeting_[i].box);
      }
      RESHARD_ASSIGN_OR_RETURN(const Index elements, PlanBlock(t, tp, holders, boxes_, groups));
      covered += elements;
    }
    Index needed = 0;
    if (boxed_.padding.valid.empty()) {
      needed = Region{t.lo, t.hi}.size();
    } else {
      for (const Region& v : Clip(Region{t.lo, t.hi}, boxed_.radix, boxed_.padding, true)) {
        needed += v.size();
      }
    }
    if (covered != needed) return UncoveredElement(boxed_, t);
    return Status::Ok();
  }

 private:
  const Piece& SourcePiece(const AffineBox& b) const {
    return source_.rank(b.rank).pieces[static_cast<size_t>(b.piece)];
  }

  // The moves from holder `h` for the block of t that `boxes` hold.
  std::vector<Move> HolderMoves(const AffineBox& t, const Piece& tp, Rank h,
                                const std::vector<size_t>& boxes) const {
    std::vector<Move> moves;
    for (size_t s : boxes) {
      const AffineBox& sb = boxed_.source_boxes[s];
      if (sb.rank != h) continue;
      MovesBetween(boxed_, t, sb, tp.scale / SourcePiece(sb).scale, moves);
    }
    return moves;
  }

  // One block (the part of t held by `holders`): returns its size in elements.
  Result<Index> PlanBlock(const AffineBox& t, const Piece& tp, const std::vector<Rank>& holders,
                          const std::vector<size_t>& boxes, MoveGroups& groups) {
    // The size of the block is measured on one holder's moves (each holder tiles it).
    std::vector<std::vector<Move>> candidates;
    for (Rank h : holders) candidates.push_back(HolderMoves(t, tp, h, boxes));
    Index elements = 0;
    for (const Move& m : candidates.front()) elements += m.num_elements();
    if (elements == 0) return Index{0};
    std::vector<Rank> continuing;
    for (size_t k = 0; k < holders.size(); ++k) {
      if (candidates[k].empty()) continue;
      const Move& first = candidates[k].front();
      auto group = groups.find({holders[k], t.rank, first.factor});
      if (group != groups.end() && !group->second.empty() &&
          Continues(group->second.back(), first)) {
        continuing.push_back(holders[k]);
      }
    }
    const Rank chosen = options_.policy(ReplicaChoice{.dst_rank = t.rank,
                                                      .holders = holders,
                                                      .elements = elements,
                                                      .assigned = assigned_,
                                                      .continuing = continuing});
    const auto it = std::lower_bound(holders.begin(), holders.end(), chosen);
    if (it == holders.end() || *it != chosen) {
      return InternalError(fmt::format(
          "the replica policy chose rank {}, which does not hold the block (holders {})", chosen,
          fmt::join(holders, ", ")));
    }
    assigned_[static_cast<size_t>(chosen)] += elements;
    for (Move& m : candidates[static_cast<size_t>(it - holders.begin())]) {
      groups[{m.src_rank, m.dst_rank, m.factor}].push_back(std::move(m));
    }
    return elements;
  }

  // A source box that meets the target box being planned, and its holders.
  struct Meeting {
    const std::vector<Rank>* holders;
    size_t box;
  };

  const ParamMap& target_;
  const ParamMap& source_;
  const BoxedMaps& boxed_;
  const ComposeOptions& options_;
  const SourceBoxIndex index_;
  std::vector<Index> assigned_;
  std::vector<Meeting> meeting_;  // scratch of Plan
  std::vector<size_t> boxes_;     // scratch of Plan
};

// The moves of `groups`, each group folded, in the plan's canonical order.
void FoldAndSort(MoveGroups& groups, ParamPlan& plan) {
  size_t total = 0;
  for (auto& [key, moves] : groups) {
    FoldGroup(moves);
    total += moves.size();
  }
  plan.moves.reserve(total);
  for (auto& [key, moves] : groups) {
    for (Move& m : moves) plan.moves.push_back(std::move(m));
  }
  std::sort(plan.moves.begin(), plan.moves.end(), [](const Move& a, const Move& b) {
    return std::tie(a.src_rank, a.dst_rank, a.dst.offset, a.src.offset) <
           std::tie(b.src_rank, b.dst_rank, b.dst.offset, b.src.offset);
  });
  std::sort(plan.unwritten.begin(), plan.unwritten.end(),
            [](const UnwrittenBlock& a, const UnwrittenBlock& b) {
              return std::tie(a.dst_rank, a.dst.offset) < std::tie(b.dst_rank, b.dst.offset);
            });
}

}  // namespace

Result<ParamPlan> Compose(const ParamMap& target, const ParamMap& source,
                          const ComposeOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckSameTensor(target, source));
  ParamPlan plan;
  plan.source_world = source.world_size();
  plan.target_world = target.world_size();
  if (source.has_buffers() || target.has_buffers()) {
    for (const RankShard& r : source.ranks()) plan.source_buffers.push_back(r.buffer);
    for (const RankShard& r : target.ranks()) plan.target_buffers.push_back(r.buffer);
  }
  Shape logical = target.logical_shape();
  if (!logical.empty()) logical[0] = std::max(logical[0], source.logical_shape()[0]);
  if (ProductOf(logical) == 0) return plan;
  RESHARD_ASSIGN_OR_RETURN(const BoxedMaps boxed, BoxMaps(target, source, logical));
  TargetBoxPlanner planner(target, source, boxed, options);
  MoveGroups groups;
  for (const AffineBox& t : boxed.target_boxes) {
    RESHARD_RETURN_IF_ERROR(planner.Plan(t, groups));
    AddUnwritten(boxed, t, plan);
  }
  FoldAndSort(groups, plan);
  return plan;
}

}  // namespace reshard
