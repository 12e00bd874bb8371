#include "reshard/ir/buffer_set.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <unordered_map>

#include "reshard/ir/box_cover.h"

namespace reshard {

using internal::BoxSet;
using internal::PaddingSpec;
using internal::Radix;

namespace {

// As for one map (param_map.cc): the sweep's box-digits are bounded over the whole set.
constexpr size_t kMaxBoxDigits = size_t{1} << 23;

// Who writes a box of a buffer: a piece of a map, or a declared padding block (map == -1).
struct Writer {
  int32_t map = -1;
  int32_t piece = 0;
};

Status CheckBlockInside(const BufferBlock& b, Index elems, std::string_view path) {
  if (b.shape.size() != b.view.strides.size()) {
    return InvalidArgumentError(fmt::format("{}: shape has {} dimensions but {} strides", path,
                                            b.shape.size(), b.view.strides.size()));
  }
  auto n = CheckedProduct(b.shape);
  if (!n.ok()) return n.status().Annotate(path);
  if (b.view.offset < 0) return OutOfRangeError(fmt::format("{}: negative offset", path));
  for (size_t k = 0; k < b.shape.size(); ++k) {
    if (b.view.strides[k] < 0 || (b.shape[k] > 1 && b.view.strides[k] == 0 && *n > 0)) {
      return InvalidArgumentError(
          fmt::format("{}: stride {} on dimension {} of extent {}; strides are positive", path,
                      b.view.strides[k], k, b.shape[k]));
    }
  }
  if (*n == 0) return Status::Ok();
  auto end = LastOffset(b.view.offset, b.shape, b.view.strides);
  if (!end || *end >= elems) {
    return OutOfRangeError(fmt::format("{}: ends at offset {} but the buffer has {} elements", path,
                                       end ? *end + 1 : -1, elems));
  }
  return Status::Ok();
}

}  // namespace

std::string BufferRankPath(std::string_view buffer, Rank rank) {
  return fmt::format("buffers[\"{}\"].ranks[\"{}\"]", buffer, rank);
}

const BufferDecl* BufferSet::Find(std::string_view name) const {
  auto it = std::lower_bound(buffers_.begin(), buffers_.end(), name,
                             [](const BufferDecl& b, std::string_view n) { return b.name < n; });
  return it != buffers_.end() && it->name == name ? &*it : nullptr;
}

namespace {

template <typename T>
std::vector<std::byte> BytesOf(T v) {
  static_assert(std::endian::native == std::endian::little, "safetensors is little-endian");
  std::vector<std::byte> out(sizeof(T));
  std::memcpy(out.data(), &v, sizeof(T));
  return out;
}

// An exact IEEE half, or nullopt: value = m * 2^e with m an integer of at most 11 bits.
std::optional<uint16_t> ExactHalf(double value) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  const double a = std::fabs(value);
  if (a == 0) return sign;
  int e = 0;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  if (e - 1 < -14) {  // subnormal: a = k * 2^-24, k < 1024
    const double k = std::ldexp(a, 24);
    if (k != std::floor(k) || k >= 1024) return std::nullopt;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(k));
  }
  if (e - 1 > 15) return std::nullopt;
  const double frac = std::ldexp(a, 11 - e) - 1024;  // 10 mantissa bits below the leading one
  if (frac != std::floor(frac)) return std::nullopt;
  return static_cast<uint16_t>(sign | static_cast<uint16_t>((e - 1 + 15) << 10) |
                               static_cast<uint16_t>(frac));
}

template <typename T>
std::optional<std::vector<std::byte>> ExactInt(double value) {
  const double end = std::ldexp(1.0, std::numeric_limits<T>::digits);  // 2^63 for int64
  const double low = std::numeric_limits<T>::is_signed ? -end : 0.0;
  if (value != std::floor(value) || value < low || value >= end) {
    return std::nullopt;
  }
  return BytesOf(static_cast<T>(value));
}

}  // namespace

Result<std::vector<std::byte>> ElementBytes(DType dtype, double value) {
  std::optional<std::vector<std::byte>> bytes;
  if (std::isfinite(value)) {
    switch (dtype) {
      case DType::kF64:
        bytes = BytesOf(value);
        break;
      case DType::kF32:
        if (static_cast<double>(static_cast<float>(value)) == value)
          bytes = BytesOf(static_cast<float>(value));
        break;
      case DType::kBF16: {
        const auto bits = std::bit_cast<uint32_t>(static_cast<float>(value));
        if (static_cast<double>(static_cast<float>(value)) == value && (bits & 0xFFFF) == 0)
          bytes = BytesOf(static_cast<uint16_t>(bits >> 16));
        break;
      }
      case DType::kF16:
        if (std::optional<uint16_t> h = ExactHalf(value)) bytes = BytesOf(*h);
        break;
      case DType::kI64:
        bytes = ExactInt<int64_t>(value);
        break;
      case DType::kI32:
        bytes = ExactInt<int32_t>(value);
        break;
      case DType::kI16:
        bytes = ExactInt<int16_t>(value);
        break;
      case DType::kI8:
        bytes = ExactInt<int8_t>(value);
        break;
      case DType::kU64:
        bytes = ExactInt<uint64_t>(value);
        break;
      case DType::kU32:
        bytes = ExactInt<uint32_t>(value);
        break;
      case DType::kU16:
        bytes = ExactInt<uint16_t>(value);
        break;
      case DType::kU8:
        bytes = ExactInt<uint8_t>(value);
        break;
      case DType::kBool:
        if (value == 0 || value == 1) bytes = BytesOf(static_cast<uint8_t>(value));
        break;
      case DType::kF8E4M3:
      case DType::kF8E5M2:
        if (value == 0) bytes = BytesOf(static_cast<uint8_t>(0));
        break;
    }
  }
  if (!bytes) {
    return InvalidArgumentError(
        fmt::format("{} is not exactly a {} value", value, DTypeName(dtype)));
  }
  return *std::move(bytes);
}

BufferSetBuilder::BufferSetBuilder(const BufferSet& set) : buffers_(set.buffers()) {}

BufferSetBuilder& BufferSetBuilder::add(BufferDecl decl) {
  buffers_.push_back(std::move(decl));
  return *this;
}

namespace {

// Each declaration on its own, and the set one world: names unique and not empty, ranks, a
// fill the dtype holds exactly, shapes and padding blocks inside them. `buffers` is sorted by
// name.
Status CheckBufferDecls(const std::vector<BufferDecl>& buffers) {
  for (size_t i = 0; i < buffers.size(); ++i) {
    const BufferDecl& b = buffers[i];
    if (b.name.empty()) return InvalidArgumentError("buffers: a buffer has an empty name");
    if (i > 0 && buffers[i - 1].name == b.name) {
      return InvalidArgumentError(fmt::format("buffers: \"{}\" is declared twice", b.name));
    }
    if (b.ranks.empty()) {
      return InvalidArgumentError(fmt::format("buffers[\"{}\"]: ranks is empty", b.name));
    }
    if (b.fill != 0.0 || std::signbit(b.fill)) {  // -0.0 is a fill of its own
      Result<std::vector<std::byte>> fill = ElementBytes(b.dtype, b.fill);
      if (!fill.ok()) return fill.status().Annotate(fmt::format("buffers[\"{}\"].fill", b.name));
    }
    if (i > 0 && b.ranks.size() != buffers[0].ranks.size()) {
      return InvalidArgumentError(fmt::format(
          "buffers[\"{}\"] has {} ranks but buffers[\"{}\"] has {}; a buffer set is one world",
          b.name, b.ranks.size(), buffers[0].name, buffers[0].ranks.size()));
    }
    for (size_t r = 0; r < b.ranks.size(); ++r) {
      const std::string path = BufferRankPath(b.name, static_cast<Rank>(r));
      auto n = CheckedProduct(b.ranks[r].shape);
      if (!n.ok()) return n.status().Annotate(path + ".shape");
      for (size_t k = 0; k < b.ranks[r].padding.size(); ++k) {
        RESHARD_RETURN_IF_ERROR(
            CheckBlockInside(b.ranks[r].padding[k], *n, fmt::format("{}.padding[{}]", path, k)));
      }
    }
  }
  return Status::Ok();
}

// writers[buffer][rank]: the maps (indices into `maps`) whose pieces write it. Every buffered
// rank of every map is a declared buffer of the map's dtype, at its shape.
Result<std::vector<std::vector<std::vector<int32_t>>>> BufferWriters(
    const BufferSet& set, std::span<const NamedMapRef> maps, std::span<const DType> dtypes) {
  std::vector<std::vector<std::vector<int32_t>>> writers(set.buffers().size());
  for (auto& w : writers) w.resize(static_cast<size_t>(set.world_size()));
  for (size_t m = 0; m < maps.size(); ++m) {
    const ParamMap& map = *maps[m].map;
    if (!map.has_buffers()) continue;
    const std::string param = fmt::format("params[\"{}\"]", maps[m].name);
    if (!set.buffers().empty() && map.world_size() != set.world_size()) {
      return InvalidArgumentError(fmt::format("{} has {} ranks but its buffers have {}", param,
                                              map.world_size(), set.world_size()));
    }
    for (Rank r = 0; r < map.world_size(); ++r) {
      const RankShard& shard = map.rank(r);
      if (!shard.is_buffered()) continue;
      const BufferDecl* b = set.Find(shard.buffer);
      if (b == nullptr) {
        return InvalidArgumentError(
            fmt::format("{}.{}: buffer \"{}\" is not declared", param, RankPath(r), shard.buffer));
      }
      const BufferRank& br = b->ranks[static_cast<size_t>(r)];
      if (br.shape != shard.shard_shape) {
        return InvalidArgumentError(fmt::format(
            "{}.{}: shard_shape {} but buffer \"{}\" has shape {} on that rank", param, RankPath(r),
            FormatShape(shard.shard_shape), b->name, FormatShape(br.shape)));
      }
      if (m < dtypes.size() && dtypes[m] != b->dtype) {
        return InvalidArgumentError(fmt::format("{} is {} but buffer \"{}\" is {}", param,
                                                DTypeName(dtypes[m]), b->name,
                                                DTypeName(b->dtype)));
      }
      writers[static_cast<size_t>(b - set.buffers().data())][static_cast<size_t>(r)].push_back(
          static_cast<int32_t>(m));
    }
  }
  return writers;
}

// Exactness, per buffer and rank, by one box sweep over every writer's views: every element
// written by exactly one piece of one map, or declared padding.
Status CheckBuffersExact(const BufferSet& set, std::span<const NamedMapRef> maps,
                         const std::vector<std::vector<std::vector<int32_t>>>& writers) {
  size_t used_digits = 0;
  std::vector<Writer> tags;
  for (size_t bi = 0; bi < set.buffers().size(); ++bi) {
    const BufferDecl& b = set.buffers()[bi];
    for (Rank r = 0; r < set.world_size(); ++r) {
      const BufferRank& br = b.ranks[static_cast<size_t>(r)];
      const Index n = ProductOf(br.shape);
      const std::vector<int32_t>& ws = writers[bi][static_cast<size_t>(r)];
      if (n == 0) continue;
      std::vector<Index> candidates;
      for (int32_t m : ws) {
        for (const Piece& p : maps[static_cast<size_t>(m)].map->rank(r).pieces) {
          candidates.insert(candidates.end(), p.dest.strides.begin(), p.dest.strides.end());
        }
      }
      for (const BufferBlock& pad : br.padding) {
        candidates.insert(candidates.end(), pad.view.strides.begin(), pad.view.strides.end());
      }
      const Radix radix = Radix::Build(n, RowMajorStrides(br.shape), candidates);
      const size_t limit =
          used_digits >= kMaxBoxDigits
              ? 0
              : (kMaxBoxDigits - used_digits) / static_cast<size_t>(std::max(radix.rank(), 1));
      BoxSet boxes(radix);
      tags.clear();
      const std::string path = BufferRankPath(b.name, r);
      for (int32_t m : ws) {
        const auto& pieces = maps[static_cast<size_t>(m)].map->rank(r).pieces;
        for (size_t i = 0; i < pieces.size(); ++i) {
          const Piece& p = pieces[i];
          const auto tag = static_cast<int32_t>(tags.size());
          tags.push_back({m, static_cast<int32_t>(i)});
          RESHARD_RETURN_IF_ERROR(
              boxes.AddView(p.dest.offset, p.shape, p.dest.strides, tag, limit).Annotate(path));
        }
      }
      for (size_t k = 0; k < br.padding.size(); ++k) {
        const BufferBlock& pad = br.padding[k];
        const auto tag = static_cast<int32_t>(tags.size());
        tags.push_back({-1, static_cast<int32_t>(k)});
        RESHARD_RETURN_IF_ERROR(
            boxes.AddView(pad.view.offset, pad.shape, pad.view.strides, tag, limit).Annotate(path));
      }
      used_digits += boxes.size() * static_cast<size_t>(radix.rank());
      auto writer_path = [&](int32_t box) {
        const Writer& w = tags[static_cast<size_t>(boxes.tag(static_cast<size_t>(box)))];
        if (w.map < 0) return fmt::format("{}.padding[{}]", path, w.piece);
        return fmt::format("params[\"{}\"].{}", maps[static_cast<size_t>(w.map)].name,
                           PiecePath(r, static_cast<size_t>(w.piece)));
      };
      RESHARD_RETURN_IF_ERROR(internal::SweepCells(
          boxes, PaddingSpec{},
          [&](std::span<const Index> cell_lo, std::span<const int32_t> active, bool) -> Status {
            if (active.size() == 1) return Status::Ok();
            const Shape where = UnravelIndex(internal::OffsetOfDigits(radix, cell_lo), br.shape);
            if (active.empty()) {
              return InvalidArgumentError(fmt::format(
                  "{}: element {} (shape {}) is written by no map and is not declared padding",
                  path, FormatShape(where), FormatShape(br.shape)));
            }
            return InvalidArgumentError(
                fmt::format("{}: element {} is written by {} and by {}", path, FormatShape(where),
                            writer_path(active[0]), writer_path(active[1])));
          }));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<BufferSet> BufferSetBuilder::Finalize(std::span<const NamedMapRef> maps,
                                             std::span<const DType> dtypes) const {
  BufferSet set;
  set.buffers_ = buffers_;
  std::sort(set.buffers_.begin(), set.buffers_.end(),
            [](const BufferDecl& a, const BufferDecl& b) { return a.name < b.name; });
  RESHARD_RETURN_IF_ERROR(CheckBufferDecls(set.buffers_));
  set.world_size_ = set.buffers_.empty() ? 0 : static_cast<int>(set.buffers_[0].ranks.size());
  RESHARD_ASSIGN_OR_RETURN(const auto writers, BufferWriters(set, maps, dtypes));
  RESHARD_RETURN_IF_ERROR(CheckBuffersExact(set, maps, writers));
  return set;
}

}  // namespace reshard
