#include "reshard/ir/map_summary.h"

#include <algorithm>

#include "reshard/ir/box_cover.h"

namespace reshard {

namespace {
constexpr size_t kMaxPictureBoxes = size_t{1} << 20;
}

MapSummary Summarize(const ParamMap& map) {
  MapSummary s;
  s.full_elements = map.num_elements();
  s.valid_elements = ProductOf(map.valid_shape());
  for (const RankShard& shard : map.ranks()) {
    RankSummary r;
    r.pieces = static_cast<Index>(shard.pieces.size());
    r.elements = ProductOf(shard.shard_shape);
    for (const Piece& p : shard.pieces) {
      if (p.is_replicated()) r.replicated_elements += p.num_elements();
      if (p.scale != 1.0) r.scaled_elements += p.num_elements();
    }
    s.held_elements += r.elements;
    s.replicated_elements += r.replicated_elements;
    s.scaled_elements += r.scaled_elements;
    s.ranks.push_back(r);
  }
  return s;
}

char RankGlyph(Rank rank) {
  if (rank < 10) return static_cast<char>('0' + rank);
  if (rank < 36) return static_cast<char>('a' + rank - 10);
  return '#';
}

namespace {

struct SourceBoxes {
  internal::Radix radix;
  std::vector<Rank> rank_of_tag;
};

// Builds boxes for every piece's source view, tagged by the holding rank.
Status ForEachHolder(const ParamMap& map, std::span<const Index> offsets,
                     std::vector<std::vector<Rank>>& holders) {
  holders.assign(offsets.size(), {});
  const Index n = map.num_elements();
  if (n == 0) return Status::Ok();
  std::vector<Index> candidates;
  for (const RankShard& shard : map.ranks()) {
    for (const Piece& p : shard.pieces) {
      candidates.insert(candidates.end(), p.source.strides.begin(), p.source.strides.end());
    }
  }
  const internal::Radix radix =
      internal::Radix::Build(n, RowMajorStrides(map.logical_shape()), candidates);
  internal::BoxSet boxes(radix);
  for (Rank r = 0; r < map.world_size(); ++r) {
    for (const Piece& p : map.rank(r).pieces) {
      RESHARD_RETURN_IF_ERROR(
          boxes.AddView(p.source.offset, p.shape, p.source.strides, r, kMaxPictureBoxes));
    }
  }
  std::vector<Index> digits(static_cast<size_t>(radix.rank()));
  for (size_t i = 0; i < offsets.size(); ++i) {
    radix.Digits(offsets[i], digits.data());
    for (size_t b = 0; b < boxes.size(); ++b) {
      bool inside = true;
      for (int k = 0; k < radix.rank() && inside; ++k) {
        const Index d = digits[static_cast<size_t>(k)];
        inside = boxes.lo(b, k) <= d && d < boxes.hi(b, k);
      }
      if (inside) holders[i].push_back(boxes.tag(b));
    }
    std::sort(holders[i].begin(), holders[i].end());
    holders[i].erase(std::unique(holders[i].begin(), holders[i].end()), holders[i].end());
  }
  return Status::Ok();
}

}  // namespace

std::vector<Rank> HoldersOf(const ParamMap& map, Index offset) {
  std::vector<std::vector<Rank>> holders;
  const Index offsets[] = {offset};
  if (!ForEachHolder(map, offsets, holders).ok()) return {};
  return holders[0];
}

Result<std::vector<std::string>> HolderPicture(const ParamMap& map, int max_rows, int max_cols) {
  const Shape& shape = map.logical_shape();
  const Index cols = shape.empty() ? 1 : shape.back();
  const Index rows = cols == 0 ? 0 : map.num_elements() / cols;
  if (rows == 0 || cols == 0) return std::vector<std::string>{};
  const Index draw_rows = std::min<Index>(rows, std::max(max_rows, 1));
  const Index draw_cols = std::min<Index>(cols, std::max(max_cols, 1));
  std::vector<Index> offsets;
  for (Index i = 0; i < draw_rows; ++i) {
    const Index row = i * rows / draw_rows;
    for (Index j = 0; j < draw_cols; ++j) offsets.push_back(row * cols + j * cols / draw_cols);
  }
  std::vector<std::vector<Rank>> holders;
  RESHARD_RETURN_IF_ERROR(ForEachHolder(map, offsets, holders));
  std::vector<std::string> picture;
  for (Index i = 0; i < draw_rows; ++i) {
    std::string line;
    for (Index j = 0; j < draw_cols; ++j) {
      const size_t at = static_cast<size_t>(i * draw_cols + j);
      const std::vector<Rank>& h = holders[at];
      if (map.IsPadding(offsets[at])) {
        line += '.';
      } else if (h.empty()) {
        line += ' ';
      } else if (h.size() == 1) {
        line += RankGlyph(h[0]);
      } else {
        line += static_cast<int>(h.size()) == map.world_size() ? '*' : '+';
      }
    }
    picture.push_back(std::move(line));
  }
  return picture;
}

}  // namespace reshard
