#include "reshard/ir/map_summary.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

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

namespace reshard {

namespace {

constexpr int kMaxSamples = 8;

std::vector<std::string_view> SplitDots(std::string_view name) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t dot = name.find('.', start);
    out.push_back(name.substr(start, dot == std::string_view::npos ? dot : dot - start));
    if (dot == std::string_view::npos) return out;
    start = dot + 1;
  }
}

bool IsNumber(std::string_view s) {
  return !s.empty() && s.size() <= 9 &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The dotted component that numbers the experts of `names`, or -1.
int ExpertComponent(const std::vector<std::vector<std::string_view>>& names) {
  if (names.empty()) return -1;
  const size_t n = names[0].size();
  for (const auto& t : names) {
    if (t.size() != n) return -1;
  }
  auto numeric_at = [&](size_t i) {
    return std::all_of(names.begin(), names.end(), [&](const auto& t) { return IsNumber(t[i]); });
  };
  for (size_t i = 1; i < n; ++i) {
    if (numeric_at(i) && std::all_of(names.begin(), names.end(),
                                     [&](const auto& t) { return t[i - 1] == "experts"; })) {
      return static_cast<int>(i);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!numeric_at(i)) continue;
    if (std::any_of(names.begin(), names.end(), [&](const auto& t) { return t[i] != names[0][i]; }))
      return static_cast<int>(i);
  }
  return -1;
}

std::string JoinDots(const std::vector<std::string_view>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += '.';
    out += parts[i];
  }
  return out;
}

std::string FormatShapeText(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string Ranks(const std::vector<Rank>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

std::string CellText(const BufferColumn& col, const BufferCell& cell) {
  if (cell.elements == 0) return ".";
  std::string out = cell.slots.empty() ? "#" : std::to_string(cell.slots[0]);
  if (cell.slots.size() > 1) out += "-" + std::to_string(cell.slots.back());
  if (cell.partial(col)) out += '~';
  if (cell.replicated) out += '+';
  return out;
}

// The columns of a buffer's summary (one per expert when the maps over it name experts, else
// one per map), its member patterns, and the column of each map in `over`. `ec` is the
// dot-separated component of the names that holds the expert's number, or -1.
std::vector<size_t> AddBufferColumns(const std::vector<const NamedMapRef*>& over, BufferSummary& s,
                                     int& ec) {
  std::vector<std::vector<std::string_view>> parts;
  for (const NamedMapRef* m : over) parts.push_back(SplitDots(m->name));
  ec = ExpertComponent(parts);
  std::vector<size_t> column_of(over.size());
  if (ec < 0) {
    for (size_t i = 0; i < over.size(); ++i) {
      BufferColumn col;
      col.label = std::string(over[i]->name);
      s.columns.push_back(std::move(col));
      column_of[i] = i;
    }
    return column_of;
  }
  std::vector<int> ids;
  for (const auto& t : parts) ids.push_back(std::stoi(std::string(t[static_cast<size_t>(ec)])));
  std::vector<int> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  for (int e : sorted) {
    BufferColumn col;
    col.label = std::to_string(e);
    col.expert = e;
    s.columns.push_back(std::move(col));
  }
  for (size_t i = 0; i < over.size(); ++i) {
    column_of[i] = static_cast<size_t>(std::lower_bound(sorted.begin(), sorted.end(), ids[i]) -
                                       sorted.begin());
    std::vector<std::string_view> pattern = parts[i];
    pattern[static_cast<size_t>(ec)] = "{e}";
    std::string member = JoinDots(pattern);
    if (std::find(s.members.begin(), s.members.end(), member) == s.members.end()) {
      s.members.push_back(std::move(member));
    }
  }
  return column_of;
}

}  // namespace

Result<std::vector<BufferSummary>> SummarizeBuffers(const BufferSet& set,
                                                    std::span<const NamedMapRef> maps) {
  // The maps over each buffer, in the order given (a map may write into several).
  std::map<std::string_view, std::vector<const NamedMapRef*>> maps_over;
  for (const NamedMapRef& m : maps) {
    std::string_view last;
    for (const RankShard& r : m.map->ranks()) {
      if (!r.is_buffered() || r.buffer == last) continue;
      last = r.buffer;
      auto& list = maps_over[r.buffer];
      if (list.empty() || list.back() != &m) list.push_back(&m);
    }
  }
  std::vector<BufferSummary> out;
  for (const BufferDecl& decl : set.buffers()) {
    BufferSummary s;
    s.name = decl.name;
    s.dtype = decl.dtype;
    const int world = static_cast<int>(decl.ranks.size());
    for (const BufferRank& br : decl.ranks) {
      s.rank_shapes.push_back(br.shape);
      Index pad = 0;
      for (const BufferBlock& b : br.padding) pad += ProductOf(b.shape);
      s.padding_elements.push_back(pad);
    }
    const auto found = maps_over.find(decl.name);
    const std::vector<const NamedMapRef*> over =
        found == maps_over.end() ? std::vector<const NamedMapRef*>{} : found->second;
    int ec = -1;
    const std::vector<size_t> column_of = AddBufferColumns(over, s, ec);
    s.cells.assign(static_cast<size_t>(world), std::vector<BufferCell>(s.columns.size()));
    for (size_t i = 0; i < over.size(); ++i) {
      const ParamMap& map = *over[i]->map;
      BufferColumn& col = s.columns[column_of[i]];
      const bool first = col.tensors.empty();
      col.tensors.emplace_back(over[i]->name);
      col.elements += map.num_elements();
      for (Rank r = 0; r < map.world_size() && r < world; ++r) {
        const RankShard& shard = map.rank(r);
        if (shard.buffer != decl.name) continue;
        BufferCell& cell = s.cells[static_cast<size_t>(r)][column_of[i]];
        const Shape& bshape = s.rank_shapes[static_cast<size_t>(r)];
        const Index row =
            bshape.size() >= 2 ? ProductOf(Shape(bshape.begin() + 1, bshape.end())) : 0;
        for (const Piece& p : shard.pieces) {
          if (p.num_elements() == 0) continue;
          cell.elements += p.num_elements();
          cell.replicated = cell.replicated || p.is_replicated();
          if (ec >= 0 && row > 0) {
            Index last = p.dest.offset;
            for (size_t d = 0; d < p.shape.size(); ++d)
              last += (p.shape[d] - 1) * p.dest.strides[d];
            for (Index slot = p.dest.offset / row; slot <= last / row; ++slot) {
              if (std::find(cell.slots.begin(), cell.slots.end(), slot) == cell.slots.end()) {
                cell.slots.push_back(slot);
              }
            }
          }
        }
        std::sort(cell.slots.begin(), cell.slots.end());
      }
      if (!first) continue;
      // Sample the column's first tensor.
      const Shape& shape = map.logical_shape();
      const Index cols = shape.empty() ? 1 : shape.back();
      const Index rows = cols == 0 ? 0 : map.num_elements() / cols;
      if (rows == 0 || cols == 0) continue;
      col.sample_rows = static_cast<int>(std::min<Index>(rows, kMaxSamples));
      col.sample_cols = static_cast<int>(std::min<Index>(cols, kMaxSamples));
      std::vector<Index> offsets;
      for (Index a = 0; a < col.sample_rows; ++a) {
        for (Index b = 0; b < col.sample_cols; ++b) {
          offsets.push_back((a * rows / col.sample_rows) * cols + b * cols / col.sample_cols);
        }
      }
      std::vector<std::vector<Rank>> holders;
      RESHARD_RETURN_IF_ERROR(ForEachHolder(map, offsets, holders));
      for (Rank r = 0; r < world; ++r) {
        s.cells[static_cast<size_t>(r)][column_of[i]].samples.assign(offsets.size(), false);
      }
      for (size_t k = 0; k < offsets.size(); ++k) {
        for (Rank r : holders[k]) {
          if (r < world) s.cells[static_cast<size_t>(r)][column_of[i]].samples[k] = true;
        }
      }
    }
    for (size_t c = 0; c < s.columns.size(); ++c) {
      for (Rank r = 0; r < world; ++r) {
        if (s.cells[static_cast<size_t>(r)][c].elements > 0) s.columns[c].holders.push_back(r);
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

namespace {

// `name` with every run of digits as "#".
std::string WithoutNumbers(std::string_view name) {
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] >= '0' && name[i] <= '9') {
      if (out.empty() || out.back() != '#') out += '#';
    } else {
      out += name[i];
    }
  }
  return out;
}

bool SameLayout(const BufferSummary& a, const BufferSummary& b) {
  if (a.dtype != b.dtype || a.rank_shapes != b.rank_shapes ||
      a.padding_elements != b.padding_elements || a.columns.size() != b.columns.size() ||
      a.members.size() != b.members.size() || WithoutNumbers(a.name) != WithoutNumbers(b.name)) {
    return false;
  }
  for (size_t i = 0; i < a.members.size(); ++i) {
    if (WithoutNumbers(a.members[i]) != WithoutNumbers(b.members[i])) return false;
  }
  for (size_t c = 0; c < a.columns.size(); ++c) {
    const BufferColumn& x = a.columns[c];
    const BufferColumn& y = b.columns[c];
    if (x.expert != y.expert || x.elements != y.elements || x.holders != y.holders ||
        x.sample_rows != y.sample_rows || x.sample_cols != y.sample_cols ||
        x.tensors.size() != y.tensors.size() ||
        (x.expert < 0 && WithoutNumbers(x.label) != WithoutNumbers(y.label))) {
      return false;
    }
  }
  for (size_t r = 0; r < a.cells.size(); ++r) {
    for (size_t c = 0; c < a.columns.size(); ++c) {
      const BufferCell& x = a.cells[r][c];
      const BufferCell& y = b.cells[r][c];
      if (x.slots != y.slots || x.elements != y.elements || x.replicated != y.replicated ||
          x.samples != y.samples) {
        return false;
      }
    }
  }
  return true;
}

// "a, b, ..., z (N)" for long lists.
std::string NameList(const std::vector<std::string>& names) {
  if (names.size() <= 3) {
    std::string out;
    for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
    return out;
  }
  return fmt::format("{}, {}, ..., {}", names[0], names[1], names.back());
}

}  // namespace

std::vector<BufferSummary> MergeSameLayouts(std::vector<BufferSummary> buffers) {
  std::vector<BufferSummary> out;
  for (BufferSummary& b : buffers) {
    auto like = std::find_if(out.begin(), out.end(),
                             [&](const BufferSummary& o) { return SameLayout(o, b); });
    if (like == out.end()) {
      out.push_back(std::move(b));
    } else {
      like->same_layout.push_back(b.name);
      like->same_layout.insert(like->same_layout.end(), b.same_layout.begin(), b.same_layout.end());
    }
  }
  return out;
}

std::vector<std::string> BufferTable(const BufferSummary& s, int max_width) {
  std::vector<std::string> lines;
  const bool experts = s.expert_columns();
  std::string heading =
      fmt::format("buffer \"{}\" ({}): {} {} on {} ranks", s.name, DTypeName(s.dtype),
                  s.columns.size(), experts ? "experts" : "tensors", s.world_size());
  if (experts) {
    heading += "; tensors";
    for (size_t i = 0; i < s.members.size(); ++i) heading += (i ? ", " : " ") + s.members[i];
  }
  lines.push_back(std::move(heading));
  if (!s.same_layout.empty()) {
    lines.push_back(fmt::format("  and {} more buffer(s) laid out the same: {}",
                                s.same_layout.size(), NameList(s.same_layout)));
  }
  lines.push_back(fmt::format("  {:>4}  {:<18}  {}", "rank", "buffer shape",
                              experts ? "experts in slot order" : "tensors"));
  for (int r = 0; r < s.world_size(); ++r) {
    const auto& row = s.cells[static_cast<size_t>(r)];
    std::string held;
    bool partial = false;
    if (experts) {
      const Shape& shape = s.rank_shapes[static_cast<size_t>(r)];
      const Index nslots = shape.size() >= 2 ? shape[0] : 0;
      for (Index slot = 0; slot < nslots; ++slot) {
        std::string in;
        for (size_t c = 0; c < row.size(); ++c) {
          const auto& sl = row[c].slots;
          if (std::find(sl.begin(), sl.end(), slot) != sl.end()) {
            in += (in.empty() ? "" : "/") + s.columns[c].label;
          }
        }
        held += (slot ? " " : "") + (in.empty() ? std::string("-") : in);
      }
    } else {
      for (size_t c = 0; c < row.size(); ++c) {
        if (row[c].elements > 0) held += (held.empty() ? "" : " ") + std::to_string(c);
      }
    }
    for (size_t c = 0; c < row.size(); ++c) partial = partial || row[c].partial(s.columns[c]);
    if (held.empty()) held = "(none)";
    if (partial) held += "  (part of each: a TP slice)";
    if (s.padding_elements[static_cast<size_t>(r)] > 0) {
      held += fmt::format("  ({} padding elements)", s.padding_elements[static_cast<size_t>(r)]);
    }
    lines.push_back(fmt::format("  {:>4}  {:<18}  {}", r,
                                FormatShapeText(s.rank_shapes[static_cast<size_t>(r)]), held));
  }
  for (const BufferColumn& c : s.columns) {
    // A column whose elements are held more than once (a redundant expert, a replica).
    Index held = 0;
    for (int r = 0; r < s.world_size(); ++r) {
      held += s.cells[static_cast<size_t>(r)][static_cast<size_t>(&c - s.columns.data())].elements;
    }
    if (c.elements > 0 && held > c.elements) {
      lines.push_back(fmt::format(
          "  {} {} is replicated: held {}x, on ranks {}", experts ? "expert" : "tensor", c.label,
          fmt::format("{:.3g}", static_cast<double>(held) / static_cast<double>(c.elements)),
          Ranks(c.holders)));
    }
  }
  if (!experts) {
    for (size_t c = 0; c < s.columns.size(); ++c) {
      lines.push_back(fmt::format("  column {}: {}", c, s.columns[c].label));
    }
  }
  lines.push_back(fmt::format(
      "  holders (row = rank, column = {}; {}, ~ part of it, + also on another rank, . none):",
      experts ? "expert" : "tensor", experts ? "the slot it is in" : "# held"));
  // Cell width: the widest cell or label.
  size_t width = 1;
  for (size_t c = 0; c < s.columns.size(); ++c) {
    width = std::max(width, experts ? s.columns[c].label.size() : std::to_string(c).size());
    for (int r = 0; r < s.world_size(); ++r) {
      width = std::max(width, CellText(s.columns[c], s.cells[static_cast<size_t>(r)][c]).size());
    }
  }
  const std::string rank_label = fmt::format("rank {}", std::max(s.world_size() - 1, 0));
  const size_t lead = std::max<size_t>(rank_label.size(), 6);
  const size_t per_block =
      std::max<size_t>(1, (static_cast<size_t>(std::max(max_width, 1)) > lead + 4
                               ? static_cast<size_t>(max_width) - lead - 4
                               : 0) /
                              (width + 1));
  for (size_t start = 0; start < s.columns.size(); start += per_block) {
    const size_t end = std::min(s.columns.size(), start + per_block);
    std::string header = fmt::format("    {:>{}}", experts ? "expert" : "tensor", lead);
    for (size_t c = start; c < end; ++c) {
      header += fmt::format(" {:>{}}", experts ? s.columns[c].label : std::to_string(c), width);
    }
    lines.push_back(std::move(header));
    for (int r = 0; r < s.world_size(); ++r) {
      std::string line = fmt::format("    {:>{}}", fmt::format("rank {}", r), lead);
      for (size_t c = start; c < end; ++c) {
        line += fmt::format(" {:>{}}", CellText(s.columns[c], s.cells[static_cast<size_t>(r)][c]),
                            width);
      }
      lines.push_back(std::move(line));
    }
  }
  return lines;
}

namespace {

constexpr const char* kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759",
                                    "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                                    "#9c755f", "#bab0ac", "#1f77b4", "#8c564b"};

std::string Xml(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') {
          out += '?';
        } else {
          out += c;
        }
    }
  }
  return out;
}

struct SvgRect {
  int x, y, w, h;
};

// The part of a `size` x `size` square at (x, y) that a cell holds: all of it, or the held
// samples of the column's first tensor (a TP slice is a band), as runs of held samples in a
// row merged with the rows below while they hold the same.
std::vector<SvgRect> HeldRects(const BufferColumn& col, const BufferCell& bc, int x, int y,
                               int size) {
  const bool all = std::all_of(bc.samples.begin(), bc.samples.end(), [](bool b) { return b; });
  if (all || col.sample_rows == 0 || col.sample_cols == 0) return {{x, y, size, size}};
  const auto held = [&](int a, int b) {
    return static_cast<bool>(bc.samples[static_cast<size_t>(a) * col.sample_cols + b]);
  };
  const auto same_row = [&](int a, int a2) {
    for (int b = 0; b < col.sample_cols; ++b) {
      if (held(a, b) != held(a2, b)) return false;
    }
    return true;
  };
  std::vector<SvgRect> out;
  for (int a = 0; a < col.sample_rows;) {
    int a_end = a + 1;
    while (a_end < col.sample_rows && same_row(a, a_end)) ++a_end;
    for (int b = 0; b < col.sample_cols;) {
      if (!held(a, b)) {
        ++b;
        continue;
      }
      int b_end = b + 1;
      while (b_end < col.sample_cols && held(a, b_end)) ++b_end;
      const int sx = b * size / col.sample_cols;
      const int sy = a * size / col.sample_rows;
      out.push_back({x + sx, y + sy, b_end * size / col.sample_cols - sx,
                     a_end * size / col.sample_rows - sy});
      b = b_end;
    }
    a = a_end;
  }
  return out;
}

}  // namespace

namespace {
// A standalone SVG document of `width` x `height` around `body` (styles and the hatching).
std::string SvgDocument(int width, int height, const std::string& body);
}  // namespace

std::string BuffersSvg(std::span<const BufferSummary> buffers) {
  constexpr int kLeft = 84;
  constexpr int kWidth = 960;
  std::string body;
  int y = 16;
  int width = 640;
  for (const BufferSummary& s : buffers) {
    const bool experts = s.expert_columns();
    const int ncols = std::max<int>(1, static_cast<int>(s.columns.size()));
    const int cell = std::clamp((kWidth - kLeft - 16) / ncols, 6, 32);
    width = std::max(width, kLeft + ncols * cell + 16);
    body += fmt::format(
        "<g class=\"buffer\">\n<text x=\"8\" y=\"{}\" class=\"title\">{}</text>\n", y + 12,
        Xml(fmt::format("{} ({}): {} {} on {} ranks", s.name, DTypeName(s.dtype), s.columns.size(),
                        experts ? "experts" : "tensors", s.world_size())));
    y += 22;
    if (experts && !s.members.empty()) {
      std::string members;
      for (size_t i = 0; i < s.members.size(); ++i) members += (i ? ", " : "") + s.members[i];
      body +=
          fmt::format("<text x=\"8\" y=\"{}\" class=\"note\">{}</text>\n", y + 10, Xml(members));
      y += 16;
    }
    if (!s.same_layout.empty()) {
      body += fmt::format("<text x=\"8\" y=\"{}\" class=\"note\">{}</text>\n", y + 10,
                          Xml(fmt::format("and {} more buffer(s) laid out the same: {}",
                                          s.same_layout.size(), NameList(s.same_layout))));
      y += 16;
    }
    // Column labels: every one when they fit, else every k-th.
    const int label_every = std::max(1, 16 / cell);
    body += fmt::format("<text x=\"8\" y=\"{}\" class=\"note\">{}</text>\n", y + 11,
                        experts ? "expert" : "tensor");
    for (int c = 0; c < static_cast<int>(s.columns.size()); c += label_every) {
      body +=
          fmt::format("<text x=\"{}\" y=\"{}\" class=\"label\" text-anchor=\"middle\">{}</text>\n",
                      kLeft + c * cell + cell / 2, y + 11,
                      Xml(experts ? s.columns[static_cast<size_t>(c)].label : std::to_string(c)));
    }
    y += 16;
    for (int r = 0; r < s.world_size(); ++r) {
      const char* colour = kPalette[static_cast<size_t>(r) % std::size(kPalette)];
      body += fmt::format("<text x=\"8\" y=\"{}\" class=\"label\">rank {}</text>\n",
                          y + cell / 2 + 4, r);
      for (size_t c = 0; c < s.columns.size(); ++c) {
        const BufferColumn& col = s.columns[c];
        const BufferCell& bc = s.cells[static_cast<size_t>(r)][c];
        const int x0 = kLeft + static_cast<int>(c) * cell;
        std::string tip =
            fmt::format("rank {}, {} {}", r, experts ? "expert" : "tensor", col.label);
        if (bc.elements == 0) {
          tip += ": not held";
        } else {
          if (!bc.slots.empty()) tip += fmt::format(", slot {}", bc.slots[0]);
          tip += fmt::format(", {} of {} elements", bc.elements, col.elements);
          if (bc.replicated) tip += fmt::format(", replicated on ranks {}", Ranks(col.holders));
        }
        body += fmt::format(
            "<g><title>{}</title><rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" "
            "class=\"cell\"/>",
            Xml(tip), x0, y, cell, cell);
        if (bc.elements > 0) {
          // The held part in the rank's colour, hatched over when other ranks hold it too.
          for (const SvgRect& rect : HeldRects(col, bc, x0 + 1, y + 1, cell - 2)) {
            body += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>",
                                rect.x, rect.y, rect.w, rect.h, colour);
            if (bc.replicated) {
              body += fmt::format(
                  "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" "
                  "fill=\"url(#replica)\"/>",
                  rect.x, rect.y, rect.w, rect.h);
            }
          }
          if (!bc.slots.empty() && cell >= 16) {
            body += fmt::format(
                "<text x=\"{}\" y=\"{}\" class=\"slot\" text-anchor=\"middle\">{}</text>",
                x0 + cell / 2, y + cell / 2 + 4, bc.slots[0]);
          }
        }
        body += "</g>\n";
      }
      y += cell;
    }
    body += "</g>\n";
    y += 18;
  }
  const char* legend[] = {
      "colour: the rank holding it; number: its slot in the rank's buffer (first dimension)",
      "a partly filled cell: the part of the expert's tensor the rank holds (a TP slice)",
      "hatched: held by several ranks (a replica or a redundant expert)"};
  for (const char* line : legend) {
    body += fmt::format("<text x=\"8\" y=\"{}\" class=\"note\">{}</text>\n", y + 4, line);
    y += 15;
  }
  y += 4;
  return SvgDocument(width, y, body);
}

namespace {

// The rank a picture glyph names (RankGlyph's inverse); -1 for any other character.
int RankOfGlyph(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'z') return c - 'a' + 10;
  return -1;
}

}  // namespace

std::string BlocksSvg(std::span<const BlockDrawing> drawings) {
  constexpr int kLeft = 8;
  std::string body;
  int y = 16;
  int width = 640;
  for (const BlockDrawing& d : drawings) {
    const int ncols = d.picture.empty() ? 1 : static_cast<int>(d.picture.front().size());
    const int cell = std::clamp(900 / std::max(ncols, 1), 6, 24);
    width = std::max(width, kLeft + ncols * cell + 16);
    body += fmt::format("<g class=\"blocks\">\n<text x=\"8\" y=\"{}\" class=\"title\">{}</text>\n",
                        y + 12, Xml(d.title));
    y += 22;
    for (size_t row = 0; row < d.picture.size(); ++row) {
      const std::string& line = d.picture[row];
      for (size_t c = 0; c < line.size(); ++c) {
        const int rank = RankOfGlyph(line[c]);
        const char* fill = rank >= 0 ? kPalette[static_cast<size_t>(rank) % std::size(kPalette)]
                           : line[c] == '*' ? "#444444"
                           : line[c] == '+' ? "#9a9a9a"
                                            : "#f2f2f2";
        const std::string tip = rank >= 0        ? fmt::format("rank {}", rank)
                                : line[c] == '*' ? std::string("every rank")
                                : line[c] == '+'
                                    ? std::string("several ranks: a block cut between them")
                                    : std::string("no rank");
        body += fmt::format(
            "<g><title>{}</title><rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" "
            "class=\"block\"/>{}</g>\n",
            Xml(fmt::format("block row {}, column {}: {}", row, c, tip)),
            kLeft + static_cast<int>(c) * cell, y, cell, cell, fill,
            line[c] == '+' ? fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" "
                                         "fill=\"url(#replica)\"/>",
                                         kLeft + static_cast<int>(c) * cell, y, cell, cell)
                           : std::string());
      }
      y += cell;
    }
    body += "</g>\n";
    y += 18;
  }
  body += fmt::format(
      "<text x=\"8\" y=\"{}\" class=\"note\">one cell a block (sampled when there are many): "
      "colour = the rank holding its scale; grey, hatched = several ranks (a block cut between "
      "them); dark = every rank</text>\n",
      y + 4);
  return SvgDocument(width, y + 24, body);
}

namespace {

std::string SvgDocument(int width, int y, const std::string& body) {
  std::string out = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\">\n"
      "<defs><pattern id=\"replica\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
      "patternTransform=\"rotate(45)\"><rect width=\"2\" height=\"6\" fill=\"#ffffff\" "
      "fill-opacity=\"0.7\"/></pattern>\n"
      "<style>text {{ font-family: monospace; font-size: 11px; fill: #222; }} "
      ".title {{ font-size: 13px; font-weight: bold; }} .note {{ fill: #555; }} "
      ".slot {{ fill: #111; font-weight: bold; stroke: #fff; stroke-width: 2px; "
      "paint-order: stroke; }} "
      ".cell {{ fill: #f2f2f2; stroke: #c8c8c8; stroke-width: 1; }} "
      ".block {{ stroke: #ffffff; stroke-width: 1; }}</style></defs>\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n",
      width, y);
  out += body;
  out += "</svg>\n";
  return out;
}

}  // namespace

}  // namespace reshard
