#include "reshard/ir/buffer_set.h"

#include <fmt/format.h>

#include <algorithm>
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

BufferSetBuilder::BufferSetBuilder(const BufferSet& set) : buffers_(set.buffers()) {}

BufferSetBuilder& BufferSetBuilder::add(BufferDecl decl) {
  buffers_.push_back(std::move(decl));
  return *this;
}

Result<BufferSet> BufferSetBuilder::Finalize(std::span<const NamedMapRef> maps,
                                             std::span<const DType> dtypes) const {
  BufferSet set;
  set.buffers_ = buffers_;
  std::sort(set.buffers_.begin(), set.buffers_.end(),
            [](const BufferDecl& a, const BufferDecl& b) { return a.name < b.name; });
  for (size_t i = 0; i < set.buffers_.size(); ++i) {
    const BufferDecl& b = set.buffers_[i];
    if (b.name.empty()) return InvalidArgumentError("buffers: a buffer has an empty name");
    if (i > 0 && set.buffers_[i - 1].name == b.name) {
      return InvalidArgumentError(fmt::format("buffers: \"{}\" is declared twice", b.name));
    }
    if (b.ranks.empty()) {
      return InvalidArgumentError(fmt::format("buffers[\"{}\"]: ranks is empty", b.name));
    }
    if (i > 0 && b.ranks.size() != set.buffers_[0].ranks.size()) {
      return InvalidArgumentError(fmt::format(
          "buffers[\"{}\"] has {} ranks but buffers[\"{}\"] has {}; a buffer set is one world",
          b.name, b.ranks.size(), set.buffers_[0].name, set.buffers_[0].ranks.size()));
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
  set.world_size_ = set.buffers_.empty() ? 0 : static_cast<int>(set.buffers_[0].ranks.size());

  // Every buffered rank of every map: a declared buffer of the map's dtype, at its shape.
  // writers[buffer][rank]: (map, rank's pieces) that write it.
  std::vector<std::vector<std::vector<int32_t>>> writers(set.buffers_.size());
  for (auto& w : writers) w.resize(static_cast<size_t>(set.world_size_));
  for (size_t m = 0; m < maps.size(); ++m) {
    const ParamMap& map = *maps[m].map;
    if (!map.has_buffers()) continue;
    const std::string param = fmt::format("params[\"{}\"]", maps[m].name);
    if (!set.buffers_.empty() && map.world_size() != set.world_size_) {
      return InvalidArgumentError(fmt::format("{} has {} ranks but its buffers have {}", param,
                                              map.world_size(), set.world_size_));
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
      writers[static_cast<size_t>(b - set.buffers_.data())][static_cast<size_t>(r)].push_back(
          static_cast<int32_t>(m));
    }
  }

  // Exactness, per buffer and rank, by one box sweep over every writer's views.
  size_t used_digits = 0;
  std::vector<Writer> tags;
  for (size_t bi = 0; bi < set.buffers_.size(); ++bi) {
    const BufferDecl& b = set.buffers_[bi];
    for (Rank r = 0; r < set.world_size_; ++r) {
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
  return set;
}

}  // namespace reshard
