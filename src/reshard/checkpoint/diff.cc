#include "reshard/checkpoint/diff.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include "reshard/exec/dequantize.h"
#include "reshard/exec/executor.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/ir/compose.h"

namespace reshard {

std::string_view DiffKindName(DiffKind kind) {
  switch (kind) {
    case DiffKind::kMissing:
      return "missing";
    case DiffKind::kExtra:
      return "extra";
    case DiffKind::kDType:
      return "dtype";
    case DiffKind::kShape:
      return "shape";
    case DiffKind::kValue:
      return "value";
  }
  return "?";
}

namespace {

// The map that cuts F (of valid shape `valid`, `n` elements) into bands of `band` consecutive
// elements in row-major order: band k is the whole shard of rank k.
Result<ParamMap> BandMap(const Shape& valid, Index n, Index band) {
  ParamMapBuilder b;
  b.set_logical_shape(valid);
  const Index bands = (n + band - 1) / band;
  b.set_world_size(static_cast<int>(bands));
  for (Index k = 0; k < bands; ++k) {
    const Index len = std::min(band, n - k * band);
    const auto r = static_cast<Rank>(k);
    b.set_shard_shape(r, {len});
    b.add_piece(r, Piece{{len}, {k * band, {1}}, {0, {1}}, {r}, 1.0});
  }
  return b.Finalize();
}

// The elements of a band: a multiple of F's rows where a row fits, so that bands cut no row.
Index BandElements(const Shape& valid, Index n, size_t elem_bytes, uint64_t band_bytes) {
  const Index target =
      std::max<Index>(1, static_cast<Index>(band_bytes / std::max<size_t>(elem_bytes, 1)));
  const Index row = valid.empty() ? 1 : n / std::max<Index>(valid.front(), 1);
  if (row > 0 && row <= target) return std::min(n, target / row * row);
  return std::min(n, target);
}

// A band's bytes, kept from tensor to tensor: allocated once at the largest band, and never
// zero-filled (every byte is written before it is read).
class BandBuffer {
 public:
  std::byte* Reserve(size_t bytes) {
    if (bytes > capacity_) {
      data_.reset(new std::byte[bytes]);
      capacity_ = bytes;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<std::byte[]> data_;
  size_t capacity_ = 0;
};

// One side of a tensor's comparison: its shards and the plan that copies each band out of them.
class Side {
 public:
  Side(ShardSource& source, size_t param)
      : param_(&source.manifest().params[param]), shards_(source, param) {}

  Status Plan(const ParamMap& bands) {
    RESHARD_RETURN_IF_ERROR(shards_.status());
    RESHARD_ASSIGN_OR_RETURN(plan_, Compose(bands, param_->map));
    moves_of_band_.assign(static_cast<size_t>(bands.world_size()), {});
    for (size_t i = 0; i < plan_.moves.size(); ++i) {
      moves_of_band_[static_cast<size_t>(plan_.moves[i].dst_rank)].push_back(i);
    }
    return Status::Ok();
  }

  DType dtype() const { return param_->dtype; }

  // Band `k` (`len` elements) of F where it is one contiguous run of a shard, read in place;
  // null otherwise.
  const std::byte* InPlace(size_t k, Index len) const {
    const std::vector<size_t>& moves = moves_of_band_[k];
    if (moves.size() != 1) return nullptr;
    const Move& m = plan_.moves[moves.front()];
    const bool unit =
        m.shape.empty() || (m.shape.size() == 1 && m.src.strides[0] == 1 && m.dst.strides[0] == 1);
    const ConstBuffer& shard = shards_.shards()[static_cast<size_t>(m.src_rank)];
    if (unit && Unscaled(m) && m.dst.offset == 0 && m.num_elements() == len && m.src.offset >= 0 &&
        m.src.offset + len <= shard.num_elements) {
      return shard.data + static_cast<size_t>(m.src.offset) * DTypeSize(dtype());
    }
    return nullptr;
  }

  // Whether band `k` equals `band` (the band in this side's dtype) bit for bit, compared
  // straight from the shards with no copy; nullopt when a move is scaled.
  Result<std::optional<bool>> SameAs(size_t k, const std::byte* band, int num_threads) const {
    const size_t elem = DTypeSize(dtype());
    std::vector<StridedCompareMove> compares;
    for (size_t i : moves_of_band_[k]) {
      const Move& m = plan_.moves[i];
      if (!Unscaled(m)) return std::optional<bool>();
      const ConstBuffer& shard = shards_.shards()[static_cast<size_t>(m.src_rank)];
      compares.push_back({m.shape, shard.data + static_cast<size_t>(m.src.offset) * elem,
                          m.src.strides, band + static_cast<size_t>(m.dst.offset) * elem,
                          m.dst.strides, ScaleOp::None()});
    }
    RESHARD_ASSIGN_OR_RETURN(const std::optional<CompareMismatch> mismatch,
                             StridedCompare(dtype(), compares, {}, num_threads));
    return std::optional<bool>(!mismatch.has_value());
  }

  // Band `k` (`len` elements) of F in this side's dtype, copied out of the shards into
  // `buffer` through the band's moves (scales undone as gather undoes them).
  Result<const std::byte*> Copy(size_t k, Index len, BandBuffer& buffer, int num_threads) const {
    ParamPlan band;
    band.source_world = plan_.source_world;
    band.target_world = 1;
    for (size_t i : moves_of_band_[k]) {
      band.moves.push_back(plan_.moves[i]);
      band.moves.back().dst_rank = 0;
    }
    const MutableBuffer target{buffer.Reserve(static_cast<size_t>(len) * DTypeSize(dtype())), len};
    ExecOptions exec;
    exec.scale_power = param_->scale_power;
    // F's values, as gather gives them: scales undone whatever they round.
    exec.allow_scaled_optimizer_state = true;
    exec.allow_lossy_scale = true;
    exec.num_threads = num_threads;
    RESHARD_RETURN_IF_ERROR(ExecutePlan(band, dtype(), shards_.shards(), {&target, 1}, exec));
    return static_cast<const std::byte*>(target.data);
  }

 private:
  bool Unscaled(const Move& m) const { return m.factor == 1.0 || param_->scale_power == 0; }

  const ShardedParam* param_;
  AcquiredShards shards_;
  ParamPlan plan_;
  std::vector<std::vector<size_t>> moves_of_band_;
};

// Whether a (A's) and b (B's) agree within the tolerance.
bool Agree(double a, double b, double atol, double rtol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= atol + rtol * std::fabs(b);
}

// The first of `len` elements where the bands differ, or -1.
Index FirstDifference(const std::byte* a, DType da, const std::byte* b, DType db, Index len,
                      const DiffOptions& options) {
  const bool values = options.atol.has_value() || options.rtol.has_value();
  const size_t ea = DTypeSize(da);
  const size_t eb = DTypeSize(db);
  Index from = 0;
  if (da == db) {
    // Bits first, a block at a time: equal blocks need no look at their values.
    constexpr Index kBlock = 4096;
    for (; from < len; from += kBlock) {
      const Index n = std::min(kBlock, len - from);
      const size_t off = static_cast<size_t>(from) * ea;
      if (std::memcmp(a + off, b + off, static_cast<size_t>(n) * ea) != 0) break;
    }
    if (from >= len) return -1;
    if (!values) {
      for (Index i = from; i < len; ++i) {
        const size_t off = static_cast<size_t>(i) * ea;
        if (std::memcmp(a + off, b + off, ea) != 0) return i;
      }
      return -1;
    }
  }
  const double atol = options.atol.value_or(0.0);
  const double rtol = options.rtol.value_or(0.0);
  for (Index i = from; i < len; ++i) {
    const auto u = static_cast<size_t>(i);
    if (da == db && std::memcmp(a + u * ea, b + u * eb, ea) == 0) continue;
    if (!Agree(ElementToDouble(da, a + u * ea), ElementToDouble(db, b + u * eb), atol, rtol))
      return i;
  }
  return -1;
}

Shape Unravel(Index flat, const Shape& shape) {
  Shape out(shape.size(), 0);
  for (size_t k = shape.size(); k-- > 0;) {
    if (shape[k] == 0) continue;
    out[k] = flat % shape[k];
    flat /= shape[k];
  }
  return out;
}

// Compares parameter `ia` of `a` with parameter `ib` of `b` (same name, dtype and valid shape, or
// dtypes compared by value): the first differing element, if any.
// The band buffers of both sides.
struct BandBuffers {
  BandBuffer a, b;
};

Result<std::optional<TensorDifference>> DiffValues(ShardSource& a, size_t ia, ShardSource& b,
                                                   size_t ib, const DiffOptions& options,
                                                   BandBuffers& buffers, int64_t& elements) {
  const ShardedParam& pa = a.manifest().params[ia];
  const ShardedParam& pb = b.manifest().params[ib];
  const Shape& valid = pa.map.valid_shape();
  const Index n = ProductOf(valid);
  if (n == 0) return std::optional<TensorDifference>();
  const size_t elem = std::max(DTypeSize(pa.dtype), DTypeSize(pb.dtype));
  const Index band = BandElements(valid, n, elem, options.band_bytes);
  RESHARD_ASSIGN_OR_RETURN(const ParamMap bands, BandMap(valid, n, band));
  Side sa(a, ia);
  RESHARD_RETURN_IF_ERROR(sa.Plan(bands).Annotate("A"));
  Side sb(b, ib);
  RESHARD_RETURN_IF_ERROR(sb.Plan(bands).Annotate("B"));
  const bool bits = !options.atol && !options.rtol && pa.dtype == pb.dtype;
  for (Index k = 0; k * band < n; ++k) {
    const Index len = std::min(band, n - k * band);
    const auto kk = static_cast<size_t>(k);
    const std::byte* va = sa.InPlace(kk, len);
    const std::byte* vb = sb.InPlace(kk, len);
    if (bits && (va == nullptr) != (vb == nullptr)) {
      // One side in place: the other's moves compared against it, with no copy; only a band
      // that differs is copied, to find its first differing element in F's order.
      RESHARD_ASSIGN_OR_RETURN(const std::optional<bool> same,
                               va != nullptr ? sb.SameAs(kk, va, options.num_threads)
                                             : sa.SameAs(kk, vb, options.num_threads));
      if (same.value_or(false)) {
        elements += len;
        continue;
      }
    }
    if (va == nullptr) {
      RESHARD_ASSIGN_OR_RETURN(va, sa.Copy(kk, len, buffers.a, options.num_threads));
    }
    if (vb == nullptr) {
      RESHARD_ASSIGN_OR_RETURN(vb, sb.Copy(kk, len, buffers.b, options.num_threads));
    }
    const Index at = FirstDifference(va, pa.dtype, vb, pb.dtype, len, options);
    if (at < 0) {
      elements += len;
      continue;
    }
    elements += at + 1;
    TensorDifference d;
    d.name = pa.name;
    d.kind = DiffKind::kValue;
    d.dtype_a = pa.dtype;
    d.dtype_b = pb.dtype;
    d.shape_a = valid;
    d.shape_b = pb.map.valid_shape();
    d.index = k * band + at;
    d.multi_index = Unravel(d.index, valid);
    d.value_a = FormatElement(pa.dtype, va + static_cast<size_t>(at) * DTypeSize(pa.dtype));
    d.value_b = FormatElement(pb.dtype, vb + static_cast<size_t>(at) * DTypeSize(pb.dtype));
    return std::optional<TensorDifference>(std::move(d));
  }
  return std::optional<TensorDifference>();
}

Status CheckTolerance(const std::optional<double>& t, std::string_view name) {
  if (t && (!std::isfinite(*t) || *t < 0)) {
    return InvalidArgumentError(
        fmt::format("{} is {}: a tolerance is a finite number >= 0", name, *t));
  }
  return Status::Ok();
}

}  // namespace

Result<DiffReport> DiffSources(ShardSource& a, ShardSource& b, const DiffOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckTolerance(options.atol, "atol"));
  RESHARD_RETURN_IF_ERROR(CheckTolerance(options.rtol, "rtol"));
  const bool values = options.atol.has_value() || options.rtol.has_value();
  const Manifest& ma = a.manifest();
  const Manifest& mb = b.manifest();
  std::map<std::string_view, size_t> in_b;
  for (size_t i = 0; i < mb.params.size(); ++i) in_b.emplace(mb.params[i].name, i);
  std::map<std::string_view, size_t> in_a;
  for (size_t i = 0; i < ma.params.size(); ++i) in_a.emplace(ma.params[i].name, i);
  DiffReport report;
  BandBuffers buffers;
  for (size_t ia = 0; ia < ma.params.size(); ++ia) {
    const ShardedParam& pa = ma.params[ia];
    TensorDifference d;
    d.name = pa.name;
    d.dtype_a = pa.dtype;
    d.shape_a = pa.map.valid_shape();
    const auto found = in_b.find(pa.name);
    if (found == in_b.end()) {
      d.kind = DiffKind::kMissing;
      report.differences.push_back(std::move(d));
      continue;
    }
    const ShardedParam& pb = mb.params[found->second];
    d.dtype_b = pb.dtype;
    d.shape_b = pb.map.valid_shape();
    ++report.tensors_compared;
    if (*d.shape_a != *d.shape_b) {
      d.kind = DiffKind::kShape;
      report.differences.push_back(std::move(d));
    } else if (pa.dtype != pb.dtype && !values) {
      d.kind = DiffKind::kDType;
      report.differences.push_back(std::move(d));
    } else {
      Result<std::optional<TensorDifference>> v =
          DiffValues(a, ia, b, found->second, options, buffers, report.elements_compared);
      if (!v.ok()) return v.status().Annotate(fmt::format("tensor \"{}\"", pa.name));
      if (*v) report.differences.push_back(**std::move(v));
    }
    if (options.progress) {
      options.progress(static_cast<uint64_t>(ia + 1), static_cast<uint64_t>(ma.params.size()));
    }
  }
  for (const ShardedParam& pb : mb.params) {
    if (in_a.contains(pb.name)) continue;
    TensorDifference d;
    d.name = pb.name;
    d.kind = DiffKind::kExtra;
    d.dtype_b = pb.dtype;
    d.shape_b = pb.map.valid_shape();
    report.differences.push_back(std::move(d));
  }
  return report;
}

std::string DiffReportText(const DiffReport& report) {
  std::string out;
  auto dtype = [](const std::optional<DType>& d) {
    return d ? std::string(DTypeName(*d)) : std::string("-");
  };
  auto shape = [](const std::optional<Shape>& s) { return s ? FormatShape(*s) : std::string("-"); };
  for (const TensorDifference& d : report.differences) {
    switch (d.kind) {
      case DiffKind::kMissing:
        out += fmt::format("missing {}: in A ({} {}), not in B\n", d.name, dtype(d.dtype_a),
                           shape(d.shape_a));
        break;
      case DiffKind::kExtra:
        out += fmt::format("extra   {}: in B ({} {}), not in A\n", d.name, dtype(d.dtype_b),
                           shape(d.shape_b));
        break;
      case DiffKind::kDType:
        out += fmt::format("dtype   {}: {} (A) vs {} (B)\n", d.name, dtype(d.dtype_a),
                           dtype(d.dtype_b));
        break;
      case DiffKind::kShape:
        out += fmt::format("shape   {}: {} (A) vs {} (B)\n", d.name, shape(d.shape_a),
                           shape(d.shape_b));
        break;
      case DiffKind::kValue:
        out += fmt::format("value   {}: first difference at {} (flat {}): {} (A) vs {} (B)\n",
                           d.name, FormatShape(d.multi_index), d.index, d.value_a, d.value_b);
        break;
    }
  }
  out += fmt::format("{} tensors in both compared ({} elements), {} differences\n",
                     report.tensors_compared, report.elements_compared, report.differences.size());
  return out;
}

}  // namespace reshard
