#include "reshard/layouts/experts.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>

#include "reshard/base/json_reader.h"
#include "reshard/base/json_writer.h"
#include "reshard/ir/canonicalize.h"

namespace reshard {

std::vector<int> ExpertPlacement::HoldersOf(int e) const {
  std::vector<int> out;
  for (int k = 0; k < ep_size(); ++k) {
    const auto& list = experts[static_cast<size_t>(k)];
    if (std::find(list.begin(), list.end(), e) != list.end()) out.push_back(k);
  }
  return out;
}

std::vector<std::vector<ExpertSlot>> ExpertPlacement::SlotsByExpert() const {
  std::vector<std::vector<ExpertSlot>> out(static_cast<size_t>(std::max(num_experts, 0)));
  for (size_t k = 0; k < experts.size(); ++k) {
    const auto& list = experts[k];
    for (size_t i = 0; i < list.size(); ++i) {
      out[static_cast<size_t>(list[i])].push_back({static_cast<int>(k), static_cast<Index>(i)});
    }
  }
  return out;
}

Status ExpertPlacement::Validate() const {
  if (num_experts < 1) {
    return InvalidArgumentError(fmt::format("num_experts {} is not a positive count", num_experts));
  }
  if (experts.empty()) return InvalidArgumentError("an expert placement needs at least one rank");
  std::vector<int> held(static_cast<size_t>(num_experts), 0);
  std::vector<size_t> last_rank(static_cast<size_t>(num_experts), experts.size());
  for (size_t k = 0; k < experts.size(); ++k) {
    for (int e : experts[k]) {
      if (e < 0 || e >= num_experts) {
        return InvalidArgumentError(
            fmt::format("EP rank {} holds expert {}, outside the {} experts 0..{}", k, e,
                        num_experts, num_experts - 1));
      }
      if (last_rank[static_cast<size_t>(e)] == k) {
        return InvalidArgumentError(
            fmt::format("EP rank {} names expert {} twice; a rank holds an expert once", k, e));
      }
      last_rank[static_cast<size_t>(e)] = k;
      ++held[static_cast<size_t>(e)];
    }
  }
  for (int e = 0; e < num_experts; ++e) {
    if (held[static_cast<size_t>(e)] == 0) {
      return InvalidArgumentError(
          fmt::format("expert {} is on no EP rank; every expert needs a holder", e));
    }
  }
  return Status::Ok();
}

namespace {

Status CheckCounts(int num_experts, int ep_size) {
  if (num_experts < 1) {
    return InvalidArgumentError(fmt::format("{} experts: the count must be positive", num_experts));
  }
  if (ep_size < 1) {
    return InvalidArgumentError(fmt::format("EP size {} is not a positive count", ep_size));
  }
  return Status::Ok();
}

}  // namespace

Result<ExpertPlacement> ContiguousExperts(int num_experts, int ep_size) {
  RESHARD_RETURN_IF_ERROR(CheckCounts(num_experts, ep_size));
  if (num_experts % ep_size != 0) {
    return InvalidArgumentError(fmt::format(
        "{} experts do not split into {} equal contiguous blocks (EP size {} must divide the "
        "expert count; the \"linear\" placement gives the first ranks one more)",
        num_experts, ep_size, ep_size));
  }
  return LinearExperts(num_experts, ep_size);
}

Result<ExpertPlacement> LinearExperts(int num_experts, int ep_size) {
  RESHARD_RETURN_IF_ERROR(CheckCounts(num_experts, ep_size));
  ExpertPlacement p{num_experts, std::vector<std::vector<int>>(static_cast<size_t>(ep_size))};
  const int base = num_experts / ep_size;
  const int extra = num_experts % ep_size;
  int next = 0;
  for (int k = 0; k < ep_size; ++k) {
    const int n = base + (k < extra ? 1 : 0);
    for (int i = 0; i < n; ++i) p.experts[static_cast<size_t>(k)].push_back(next++);
  }
  return p;
}

Result<ExpertPlacement> RoundRobinExperts(int num_experts, int ep_size) {
  RESHARD_RETURN_IF_ERROR(CheckCounts(num_experts, ep_size));
  ExpertPlacement p{num_experts, std::vector<std::vector<int>>(static_cast<size_t>(ep_size))};
  for (int e = 0; e < num_experts; ++e) p.experts[static_cast<size_t>(e % ep_size)].push_back(e);
  return p;
}

Result<ExpertPlacement> ExpertsByFamily(std::string_view family, int num_experts, int ep_size) {
  if (family == "contiguous") return ContiguousExperts(num_experts, ep_size);
  if (family == "linear") return LinearExperts(num_experts, ep_size);
  if (family == "round_robin") return RoundRobinExperts(num_experts, ep_size);
  return InvalidArgumentError(fmt::format(
      "unknown expert placement \"{}\"; one of contiguous, linear, round_robin", family));
}

Result<ExpertPlacement> ParseExpertPlacementJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(json::Json root, json::ParseJson(text));
  if (!root.is_object()) return json::TypeError("", "a placement descriptor (an object)", root);
  RESHARD_ASSIGN_OR_RETURN(const json::Json* version, json::Require(root, "", "version"));
  RESHARD_ASSIGN_OR_RETURN(Index v, json::ReadInt(*version, "version"));
  if (v != 1) {
    return InvalidArgumentError(
        fmt::format("version: {} is not supported; this reader knows version 1", v));
  }
  RESHARD_ASSIGN_OR_RETURN(const json::Json* ne, json::Require(root, "", "num_experts"));
  RESHARD_ASSIGN_OR_RETURN(Index num_experts, json::ReadInt(*ne, "num_experts"));
  RESHARD_ASSIGN_OR_RETURN(const json::Json* ep, json::Require(root, "", "ep_size"));
  RESHARD_ASSIGN_OR_RETURN(Index ep_size, json::ReadInt(*ep, "ep_size"));
  if (num_experts < 1 || num_experts > (1 << 20)) {
    return json::ErrorAt("num_experts", fmt::format("{} is not an expert count", num_experts));
  }
  if (ep_size < 1 || ep_size > (1 << 20)) {
    return json::ErrorAt("ep_size", fmt::format("{} is not an EP size", ep_size));
  }
  RESHARD_ASSIGN_OR_RETURN(const json::Json* ranks, json::Require(root, "", "ranks"));
  if (!ranks->is_array()) return json::TypeError("ranks", "an array of ranks", *ranks);
  ExpertPlacement p{static_cast<int>(num_experts),
                    std::vector<std::vector<int>>(static_cast<size_t>(ep_size))};
  std::vector<bool> listed(static_cast<size_t>(ep_size), false);
  std::vector<Index> listed_on(static_cast<size_t>(num_experts), -1);  // last rank naming e
  for (size_t i = 0; i < ranks->size(); ++i) {
    const std::string path = json::Element("ranks", i);
    const json::Json& entry = (*ranks)[i];
    if (!entry.is_object()) return json::TypeError(path, "a rank (an object)", entry);
    RESHARD_ASSIGN_OR_RETURN(const json::Json* rank, json::Require(entry, path, "rank"));
    RESHARD_ASSIGN_OR_RETURN(Index k, json::ReadInt(*rank, json::Member(path, "rank")));
    if (k < 0 || k >= ep_size) {
      return json::ErrorAt(json::Member(path, "rank"),
                           fmt::format("{} is outside the EP ranks 0..{}", k, ep_size - 1));
    }
    if (listed[static_cast<size_t>(k)]) {
      return json::ErrorAt(json::Member(path, "rank"), fmt::format("rank {} is listed twice", k));
    }
    listed[static_cast<size_t>(k)] = true;
    RESHARD_ASSIGN_OR_RETURN(const json::Json* experts, json::Require(entry, path, "experts"));
    RESHARD_ASSIGN_OR_RETURN(Shape ids,
                             json::ReadIntArray(*experts, json::Member(path, "experts")));
    for (size_t j = 0; j < ids.size(); ++j) {
      const Index e = ids[j];
      const std::string at = json::Element(json::Member(path, "experts"), j);
      if (e < 0 || e >= num_experts) {
        return json::ErrorAt(at, fmt::format("expert {} is outside 0..{}", e, num_experts - 1));
      }
      if (listed_on[static_cast<size_t>(e)] == k) {
        return json::ErrorAt(at, fmt::format("rank {} names expert {} twice", k, e));
      }
      listed_on[static_cast<size_t>(e)] = k;
      p.experts[static_cast<size_t>(k)].push_back(static_cast<int>(e));
    }
  }
  for (Index k = 0; k < ep_size; ++k) {
    if (!listed[static_cast<size_t>(k)]) {
      return json::ErrorAt("ranks", fmt::format("rank {} is missing; every EP rank 0..{} is "
                                                "listed (with an empty list when it holds none)",
                                                k, ep_size - 1));
    }
  }
  RESHARD_RETURN_IF_ERROR(p.Validate());
  return p;
}

std::string ExpertPlacementToJson(const ExpertPlacement& placement) {
  json::OrderedJson j;
  j["version"] = 1;
  j["num_experts"] = placement.num_experts;
  j["ep_size"] = placement.ep_size();
  json::OrderedJson ranks = json::OrderedJson::array();
  for (int k = 0; k < placement.ep_size(); ++k) {
    ranks.push_back({{"rank", k}, {"experts", placement.experts[static_cast<size_t>(k)]}});
  }
  j["ranks"] = std::move(ranks);
  return json::WriteJson(j) + "\n";
}

namespace {

std::string ExpertName(std::string_view pattern, int e) {
  std::string out(pattern);
  const size_t at = out.find("{e}");
  if (at != std::string::npos) out.replace(at, 3, std::to_string(e));
  return out;
}

// How the members stack in the buffer: each member's permutation, its slice shape (after the
// expert TP split) in buffer order, and its offset along the fused dimension; `inner` is one
// expert's slot of the buffer.
struct MemberStack {
  std::vector<std::vector<int>> perms;
  std::vector<Shape> sliced;  // in buffer order
  std::vector<Index> fused_offset;
  Shape inner;
};

Result<MemberStack> StackMembers(const std::vector<ExpertMember>& members, const RankOrder& order,
                                 size_t nd, int fused) {
  MemberStack stack;
  std::vector<std::vector<int>>& perms = stack.perms;
  std::vector<Shape>& sliced = stack.sliced;
  std::vector<Index>& fused_offset = stack.fused_offset;
  Shape& inner = stack.inner;
  for (const ExpertMember& m : members) {
    const std::string where = fmt::format("member \"{}\"", m.name);
    if (m.shape.size() != nd || m.fused_dim != fused) {
      return InvalidArgumentError(where + ": members must have the same rank and fused_dim");
    }
    if (m.name.find("{e}") == std::string::npos) {
      return InvalidArgumentError(where + ": the name needs \"{e}\" where the expert id goes");
    }
    std::vector<int> perm = m.permutation;
    if (perm.empty()) {
      perm.resize(nd);
      std::iota(perm.begin(), perm.end(), 0);
    }
    std::vector<int> sorted = perm;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < nd; ++i) {
      if (perm.size() != nd || sorted[i] != static_cast<int>(i)) {
        return InvalidArgumentError(where + ": permutation is not a permutation of its dims");
      }
    }
    Shape s = m.shape;
    if (m.split_dim >= 0) {
      if (static_cast<size_t>(m.split_dim) >= nd) {
        return InvalidArgumentError(where + ": split_dim is not a dimension");
      }
      if (s[static_cast<size_t>(m.split_dim)] % order.tp != 0) {
        return InvalidArgumentError(
            fmt::format("{}: expert TP {} does not divide dimension {} of {} ({})", where, order.tp,
                        m.split_dim, FormatShape(m.shape), s[static_cast<size_t>(m.split_dim)]));
      }
      s[static_cast<size_t>(m.split_dim)] /= order.tp;
    }
    Shape b(nd);
    for (size_t i = 0; i < nd; ++i) b[i] = s[static_cast<size_t>(perm[i])];
    if (inner.empty()) {
      inner = b;
      fused_offset.push_back(0);
    } else {
      for (size_t i = 0; i < nd; ++i) {
        if (static_cast<int>(i) != fused && b[i] != inner[i]) {
          return InvalidArgumentError(fmt::format(
              "{}: its slice {} does not stack with the others' {} (they differ off fused_dim)",
              where, FormatShape(b), FormatShape(inner)));
        }
      }
      fused_offset.push_back(inner[static_cast<size_t>(fused)]);
      inner[static_cast<size_t>(fused)] += b[static_cast<size_t>(fused)];
    }
    perms.push_back(std::move(perm));
    sliced.push_back(std::move(b));
  }
  return stack;
}

}  // namespace

Result<StackedExpertMaps> BuildStackedExpertMaps(std::string buffer_name, DType dtype,
                                                 const std::vector<ExpertMember>& members,
                                                 const ExpertPlacement& placement,
                                                 const RankOrder& order) {
  RESHARD_RETURN_IF_ERROR(placement.Validate());
  if (order.ep != placement.ep_size()) {
    return InvalidArgumentError(fmt::format("the rank order has {} EP ranks but the placement {}",
                                            order.ep, placement.ep_size()));
  }
  if (order.tp < 1) return InvalidArgumentError("expert TP must be at least 1");
  if (order.dp < 1) return InvalidArgumentError("expert DP must be at least 1");
  if (members.empty()) return InvalidArgumentError("a stacked buffer needs members");
  const size_t nd = members[0].shape.size();
  const int fused = members[0].fused_dim;
  if (fused < 0 || static_cast<size_t>(fused) >= nd) {
    return InvalidArgumentError(
        fmt::format("fused_dim {} is not a dimension of {}", fused, FormatShape(members[0].shape)));
  }
  RESHARD_ASSIGN_OR_RETURN(MemberStack stack, StackMembers(members, order, nd, fused));
  const std::vector<std::vector<int>>& perms = stack.perms;
  const std::vector<Shape>& sliced = stack.sliced;
  const std::vector<Index>& fused_offset = stack.fused_offset;
  const Shape& inner = stack.inner;

  StackedExpertMaps out;
  out.buffer.name = std::move(buffer_name);
  out.buffer.dtype = dtype;
  const int world = order.world();
  out.buffer.ranks.resize(static_cast<size_t>(world));
  std::vector<Shape> buffer_shape(static_cast<size_t>(world));
  for (int d = 0; d < order.dp; ++d) {
    for (int k = 0; k < order.ep; ++k) {
      for (int t = 0; t < order.tp; ++t) {
        Shape shape = {static_cast<Index>(placement.experts[static_cast<size_t>(k)].size())};
        shape.insert(shape.end(), inner.begin(), inner.end());
        buffer_shape[static_cast<size_t>(order.Of(k, t, d))] = shape;
        out.buffer.ranks[static_cast<size_t>(order.Of(k, t, d))].shape = std::move(shape);
      }
    }
  }
  const std::vector<std::vector<ExpertSlot>> slots = placement.SlotsByExpert();
  for (size_t mi = 0; mi < members.size(); ++mi) {
    const ExpertMember& m = members[mi];
    const Shape f_strides = RowMajorStrides(m.shape);
    for (int e = 0; e < placement.num_experts; ++e) {
      const std::vector<ExpertSlot>& holders = slots[static_cast<size_t>(e)];
      ParamMapBuilder b;
      b.set_logical_shape(m.shape);
      b.set_world_size(world);
      for (Rank r = 0; r < world; ++r) {
        b.set_shard_shape(r, buffer_shape[static_cast<size_t>(r)]);
        b.set_buffer(r, out.buffer.name);
      }
      for (int d = 0; d < order.dp; ++d) {
        for (const auto [k, slot] : holders) {
          for (int t = 0; t < order.tp; ++t) {
            const Rank r = order.Of(k, t, d);
            const Shape b_strides = RowMajorStrides(buffer_shape[static_cast<size_t>(r)]);
            Piece piece;
            piece.shape = sliced[mi];
            if (m.split_dim >= 0) {
              const Index slice = m.shape[static_cast<size_t>(m.split_dim)] / order.tp;
              piece.source.offset = t * slice * f_strides[static_cast<size_t>(m.split_dim)];
            }
            piece.dest.offset =
                slot * b_strides[0] + fused_offset[mi] * b_strides[static_cast<size_t>(fused) + 1];
            for (size_t i = 0; i < nd; ++i) {
              piece.source.strides.push_back(f_strides[static_cast<size_t>(perms[mi][i])]);
              piece.dest.strides.push_back(b_strides[i + 1]);
            }
            // Every EP rank holding e holds this same slice: on its TP rank t, or, when the
            // member is not split, on all its TP ranks.
            for (int d2 = 0; d2 < order.dp; ++d2) {
              for (const ExpertSlot& k2 : holders) {
                if (m.split_dim >= 0) {
                  piece.locations.push_back(order.Of(k2.rank, t, d2));
                } else {
                  for (int t2 = 0; t2 < order.tp; ++t2) {
                    piece.locations.push_back(order.Of(k2.rank, t2, d2));
                  }
                }
              }
            }
            std::sort(piece.locations.begin(), piece.locations.end());
            b.add_piece(r, std::move(piece));
          }
        }
      }
      const std::string name = ExpertName(m.name, e);
      Result<ParamMap> map = b.Finalize();
      if (!map.ok()) return map.status().Annotate(fmt::format("the map of \"{}\"", name));
      Result<ParamMap> canonical = Canonicalize(*map);
      if (!canonical.ok()) return canonical.status().Annotate(fmt::format("\"{}\"", name));
      out.maps.emplace_back(name, *std::move(canonical));
    }
  }
  return out;
}

}  // namespace reshard
