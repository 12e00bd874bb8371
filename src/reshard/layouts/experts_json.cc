#include "reshard/layouts/experts_json.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "reshard/base/json_reader.h"
#include "reshard/base/json_writer.h"

namespace reshard {

namespace {

constexpr int kMaxExperts = 1 << 20;
constexpr int kMaxDegree = 1 << 20;

Status Malformed(std::string_view path, std::string message) {
  return json::ErrorAt(path, std::move(message));
}

// A placement family at `path`: {"family", "num_experts"}.
Result<ExpertPlacementSpec> ReadPlacementFamily(const json::Json& j, std::string_view path) {
  RESHARD_RETURN_IF_ERROR(
      json::CheckKeys(j, path, {"family", "num_experts"}, "an expert placement family"));
  RESHARD_ASSIGN_OR_RETURN(const json::Json* family, json::Require(j, path, "family"));
  ExpertPlacementSpec spec;
  RESHARD_ASSIGN_OR_RETURN(spec.family, json::ReadString(*family, json::Member(path, "family")));
  if (spec.family != "contiguous" && spec.family != "linear" && spec.family != "round_robin") {
    return Malformed(json::Member(path, "family"),
                     fmt::format("unknown expert placement {}; one of \"contiguous\", "
                                 "\"linear\", \"round_robin\" (or a DeepSpeed AutoEP placement "
                                 "descriptor with \"version\": 1 and \"ranks\")",
                                 json::QuoteShort(spec.family)));
  }
  RESHARD_ASSIGN_OR_RETURN(const json::Json* ne, json::Require(j, path, "num_experts"));
  RESHARD_ASSIGN_OR_RETURN(Index n, json::ReadInt(*ne, json::Member(path, "num_experts"),
                                                  json::IntRange{1, kMaxExperts}));
  spec.num_experts = static_cast<int>(n);
  return spec;
}

Result<ExpertPlacementSpec> ReadPlacement(const json::Json& j, std::string_view path) {
  if (!j.is_object()) {
    return json::TypeError(path, "an expert placement (an object)", j);
  }
  if (json::Find(j, "family") != nullptr) {
    if (json::Find(j, "version") != nullptr || json::Find(j, "ranks") != nullptr) {
      return Malformed(path,
                       "a placement is a family (\"family\", \"num_experts\") or a DeepSpeed "
                       "AutoEP descriptor (\"version\", \"num_experts\", \"ep_size\", "
                       "\"ranks\"), not both");
    }
    return ReadPlacementFamily(j, path);
  }
  RESHARD_RETURN_IF_ERROR(json::CheckKeys(j, path, {"version", "num_experts", "ep_size", "ranks"},
                                          "a DeepSpeed AutoEP placement descriptor"));
  Result<ExpertPlacement> p = ParseExpertPlacementJson(j.dump());
  if (!p.ok()) {
    return path.empty() ? p.status() : p.status().Annotate(std::string(path));
  }
  ExpertPlacementSpec spec;
  spec.num_experts = p->num_experts;
  spec.explicit_placement = *std::move(p);
  return spec;
}

Result<int> ReadSmallInt(const json::Json& j, std::string_view path, std::string_view key, int min,
                         int max, int fallback) {
  const json::Json* v = json::Find(j, key);
  if (v == nullptr) return fallback;
  RESHARD_ASSIGN_OR_RETURN(Index n,
                           json::ReadInt(*v, json::Member(path, key), json::IntRange{min, max}));
  return static_cast<int>(n);
}

Result<ExpertMember> ReadMember(const json::Json& j, const std::string& path, int fused_dim) {
  if (!j.is_object()) return json::TypeError(path, "a member (an object)", j);
  RESHARD_RETURN_IF_ERROR(json::CheckKeys(j, path, {"name", "shape", "split_dim", "permutation"},
                                          "a stacked-experts member"));
  ExpertMember m;
  m.fused_dim = fused_dim;
  RESHARD_ASSIGN_OR_RETURN(const json::Json* name, json::Require(j, path, "name"));
  RESHARD_ASSIGN_OR_RETURN(m.name, json::ReadString(*name, json::Member(path, "name")));
  const size_t at = m.name.find("{e}");
  if (at == std::string::npos || m.name.find("{e}", at + 1) != std::string::npos) {
    return Malformed(json::Member(path, "name"),
                     fmt::format("{} needs \"{{e}}\" once, where the expert id goes (e.g. "
                                 "\"model.layers.0.mlp.experts.{{e}}.gate_proj.weight\")",
                                 json::QuoteShort(m.name)));
  }
  RESHARD_ASSIGN_OR_RETURN(const json::Json* shape, json::Require(j, path, "shape"));
  RESHARD_ASSIGN_OR_RETURN(m.shape,
                           json::ReadIntArray(*shape, json::Member(path, "shape"), json::kCount));
  if (m.shape.empty() || m.shape.size() > 8) {
    return Malformed(
        json::Member(path, "shape"),
        fmt::format("an expert's tensor has 1 to 8 dimensions, not {}", m.shape.size()));
  }
  const int nd = static_cast<int>(m.shape.size());
  if (const json::Json* split = json::Find(j, "split_dim")) {
    if (!split->is_null()) {
      RESHARD_ASSIGN_OR_RETURN(Index d,
                               json::ReadInt(*split, json::Member(path, "split_dim"), Index{-1}));
      if (d >= nd) {
        return Malformed(json::Member(path, "split_dim"),
                         fmt::format("{} is not a dimension of {} (-1 or null: not split)", d,
                                     FormatShape(m.shape)));
      }
      m.split_dim = static_cast<int>(d);
    }
  }
  if (const json::Json* perm = json::Find(j, "permutation")) {
    RESHARD_ASSIGN_OR_RETURN(
        std::vector<Index> p,
        json::ReadIntArray(*perm, json::Member(path, "permutation"), json::kCount));
    std::vector<Index> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    bool ok = static_cast<int>(p.size()) == nd;
    for (size_t i = 0; ok && i < sorted.size(); ++i) ok = sorted[i] == static_cast<Index>(i);
    if (!ok) {
      return Malformed(json::Member(path, "permutation"),
                       fmt::format("expected a permutation of the {} dimensions of {}", nd,
                                   FormatShape(m.shape)));
    }
    for (Index d : p) m.permutation.push_back(static_cast<int>(d));
  }
  if (fused_dim >= nd) {
    return Malformed(
        json::Member(path, "shape"),
        fmt::format("fused_dim {} is not a dimension of {}", fused_dim, FormatShape(m.shape)));
  }
  return m;
}

Result<StackedExpertsDescriptor> ReadStacked(const json::Json& j, const std::string& path) {
  if (!j.is_object()) return json::TypeError(path, "a stacked-experts descriptor", j);
  RESHARD_RETURN_IF_ERROR(json::CheckKeys(
      j, path,
      {"family", "buffer", "dtype", "members", "fused_dim", "placement", "tp", "dp", "rank_order"},
      "family \"stacked_experts\""));
  RESHARD_ASSIGN_OR_RETURN(const json::Json* family, json::Require(j, path, "family"));
  RESHARD_ASSIGN_OR_RETURN(std::string f, json::ReadString(*family, json::Member(path, "family")));
  if (f != "stacked_experts") {
    return Malformed(json::Member(path, "family"),
                     fmt::format("expected \"stacked_experts\", got {}", json::QuoteShort(f)));
  }
  StackedExpertsDescriptor d;
  RESHARD_ASSIGN_OR_RETURN(const json::Json* buffer, json::Require(j, path, "buffer"));
  RESHARD_ASSIGN_OR_RETURN(d.buffer, json::ReadString(*buffer, json::Member(path, "buffer")));
  if (d.buffer.empty()) return Malformed(json::Member(path, "buffer"), "the name is empty");
  RESHARD_ASSIGN_OR_RETURN(const json::Json* dtype, json::Require(j, path, "dtype"));
  RESHARD_ASSIGN_OR_RETURN(std::string dname,
                           json::ReadString(*dtype, json::Member(path, "dtype")));
  const std::optional<DType> dt = DTypeFromName(dname);
  if (!dt) {
    return Malformed(json::Member(path, "dtype"),
                     fmt::format("unknown dtype {}; use a safetensors name such as BF16, F16, F32",
                                 json::QuoteShort(dname)));
  }
  d.dtype = *dt;
  RESHARD_ASSIGN_OR_RETURN(d.fused_dim, ReadSmallInt(j, path, "fused_dim", 0, 7, 0));
  RESHARD_ASSIGN_OR_RETURN(d.tp, ReadSmallInt(j, path, "tp", 1, kMaxDegree, 1));
  RESHARD_ASSIGN_OR_RETURN(d.dp, ReadSmallInt(j, path, "dp", 1, kMaxDegree, 1));
  if (const json::Json* order = json::Find(j, "rank_order")) {
    RESHARD_ASSIGN_OR_RETURN(std::string o,
                             json::ReadString(*order, json::Member(path, "rank_order")));
    if (o != "tp_fastest" && o != "ep_fastest") {
      return Malformed(json::Member(path, "rank_order"),
                       fmt::format("expected \"tp_fastest\" (Megatron) or \"ep_fastest\", got {}",
                                   json::QuoteShort(o)));
    }
    d.tp_fastest = o == "tp_fastest";
  }
  RESHARD_ASSIGN_OR_RETURN(const json::Json* members, json::Require(j, path, "members"));
  const std::string mpath = json::Member(path, "members");
  if (!members->is_array() || members->empty()) {
    return json::TypeError(mpath, "a non-empty array of members", *members);
  }
  std::set<std::string> names;
  for (size_t i = 0; i < members->size(); ++i) {
    const std::string at = json::Element(mpath, i);
    RESHARD_ASSIGN_OR_RETURN(ExpertMember m, ReadMember((*members)[i], at, d.fused_dim));
    if (!d.members.empty() && m.shape.size() != d.members[0].shape.size()) {
      return Malformed(
          json::Member(at, "shape"),
          fmt::format("{} has {} dimensions, the first member {}; stacked members "
                      "have the same number",
                      FormatShape(m.shape), m.shape.size(), d.members[0].shape.size()));
    }
    if (!names.insert(m.name).second) {
      return Malformed(json::Member(at, "name"),
                       fmt::format("{} is named twice", json::QuoteShort(m.name)));
    }
    d.members.push_back(std::move(m));
  }
  RESHARD_ASSIGN_OR_RETURN(const json::Json* placement, json::Require(j, path, "placement"));
  RESHARD_ASSIGN_OR_RETURN(d.placement, ReadPlacement(*placement, json::Member(path, "placement")));
  return d;
}

json::OrderedJson PlacementValue(const ExpertPlacementSpec& spec) {
  if (spec.explicit_placement) {
    json::OrderedJson j;
    j["version"] = 1;
    j["num_experts"] = spec.explicit_placement->num_experts;
    j["ep_size"] = spec.explicit_placement->ep_size();
    json::OrderedJson ranks = json::OrderedJson::array();
    for (int k = 0; k < spec.explicit_placement->ep_size(); ++k) {
      ranks.push_back(
          {{"rank", k}, {"experts", spec.explicit_placement->experts[static_cast<size_t>(k)]}});
    }
    j["ranks"] = std::move(ranks);
    return j;
  }
  return {{"family", spec.family}, {"num_experts", spec.num_experts}};
}

}  // namespace

Result<ExpertPlacement> ExpertPlacementSpec::At(int ep_size) const {
  if (explicit_placement) {
    if (explicit_placement->ep_size() != ep_size) {
      return FailedPreconditionError(
          fmt::format("the placement descriptor lists {} EP ranks, not {}; its EP size is fixed",
                      explicit_placement->ep_size(), ep_size));
    }
    return *explicit_placement;
  }
  Result<ExpertPlacement> p = ExpertsByFamily(family, num_experts, ep_size);
  if (!p.ok()) return FailedPreconditionError(p.status().message());
  return p;
}

Result<ExpertPlacementSpec> ParseExpertPlacementSpecJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(json::Json root, json::ParseJson(text));
  return ReadPlacement(root, "");
}

std::string ExpertPlacementSpecToJson(const ExpertPlacementSpec& spec) {
  if (spec.explicit_placement) return ExpertPlacementToJson(*spec.explicit_placement);
  return json::WriteJson(PlacementValue(spec)) + "\n";
}

bool operator==(const StackedExpertsDescriptor& a, const StackedExpertsDescriptor& b) {
  auto member_eq = [](const ExpertMember& x, const ExpertMember& y) {
    return x.name == y.name && x.shape == y.shape && x.split_dim == y.split_dim &&
           x.fused_dim == y.fused_dim && x.permutation == y.permutation;
  };
  return a.buffer == b.buffer && a.dtype == b.dtype && a.fused_dim == b.fused_dim &&
         a.placement == b.placement && a.tp == b.tp && a.dp == b.dp &&
         a.tp_fastest == b.tp_fastest &&
         std::equal(a.members.begin(), a.members.end(), b.members.begin(), b.members.end(),
                    member_eq);
}

bool IsStackedExpertsJson(std::string_view text) {
  Result<json::Json> root = json::ParseJson(text);
  if (!root.ok()) return false;
  auto is_stacked = [](const json::Json& j) {
    const json::Json* f = j.is_object() ? json::Find(j, "family") : nullptr;
    return f != nullptr && f->is_string() && f->get<std::string>() == "stacked_experts";
  };
  if (root->is_array()) return !root->empty() && is_stacked((*root)[0]);
  return is_stacked(*root);
}

Result<std::vector<StackedExpertsDescriptor>> ParseStackedExpertsJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(json::Json root, json::ParseJson(text));
  std::vector<StackedExpertsDescriptor> out;
  if (root.is_array()) {
    if (root.empty()) return json::TypeError("", "a non-empty array of descriptors", root);
    for (size_t i = 0; i < root.size(); ++i) {
      RESHARD_ASSIGN_OR_RETURN(StackedExpertsDescriptor d,
                               ReadStacked(root[i], json::Element("", i)));
      out.push_back(std::move(d));
    }
  } else {
    RESHARD_ASSIGN_OR_RETURN(StackedExpertsDescriptor d, ReadStacked(root, ""));
    out.push_back(std::move(d));
  }
  return out;
}

std::string StackedExpertsToJson(const StackedExpertsDescriptor& d) {
  json::OrderedJson j;
  j["family"] = "stacked_experts";
  j["buffer"] = d.buffer;
  j["dtype"] = std::string(DTypeName(d.dtype));
  json::OrderedJson members = json::OrderedJson::array();
  for (const ExpertMember& m : d.members) {
    json::OrderedJson mj = {{"name", m.name}, {"shape", m.shape}, {"split_dim", m.split_dim}};
    if (!m.permutation.empty()) mj["permutation"] = m.permutation;
    members.push_back(std::move(mj));
  }
  j["members"] = std::move(members);
  j["fused_dim"] = d.fused_dim;
  j["placement"] = PlacementValue(d.placement);
  j["tp"] = d.tp;
  j["dp"] = d.dp;
  j["rank_order"] = d.tp_fastest ? "tp_fastest" : "ep_fastest";
  return json::WriteJson(j) + "\n";
}

Result<MapDocument> BuildStackedExpertsDocument(const std::vector<StackedExpertsDescriptor>& ds,
                                                int world) {
  MapDocument doc;
  BufferSetBuilder buffers;
  std::set<std::string> buffer_names;
  std::set<std::string> tensor_names;
  for (const StackedExpertsDescriptor& d : ds) {
    const std::string where = fmt::format("stacked experts \"{}\"", d.buffer);
    if (!buffer_names.insert(d.buffer).second) {
      return InvalidArgumentError(fmt::format("{}: the buffer is described twice", where));
    }
    const Index group = Index{d.tp} * d.dp;
    if (world < 1 || world % group != 0) {
      return FailedPreconditionError(fmt::format(
          "{} at {} ranks: the world is EP x TP {} x DP {}, so it must be a multiple of {}", where,
          world, d.tp, d.dp, group));
    }
    const int ep = static_cast<int>(world / group);
    Result<ExpertPlacement> placed = d.placement.At(ep);
    if (!placed.ok()) {
      return FailedPreconditionError(fmt::format("{} at {} ranks (EP {} x TP {} x DP {}): {}",
                                                 where, world, ep, d.tp, d.dp,
                                                 placed.status().message()));
    }
    std::vector<ExpertMember> members = d.members;
    for (ExpertMember& m : members) m.fused_dim = d.fused_dim;
    RankOrder order;
    order.ep = ep;
    order.tp = d.tp;
    order.tp_fastest = d.tp_fastest;
    order.dp = d.dp;
    Result<StackedExpertMaps> built =
        BuildStackedExpertMaps(d.buffer, d.dtype, members, *placed, order);
    if (!built.ok()) {
      return FailedPreconditionError(
          fmt::format("{} at {} ranks: {}", where, world, built.status().message()));
    }
    for (auto& [name, map] : built->maps) {
      if (!tensor_names.insert(name).second) {
        return InvalidArgumentError(
            fmt::format("{}: tensor \"{}\" is laid out by two descriptors", where, name));
      }
      doc.params.emplace_back(std::move(name), std::move(map));
    }
    buffers.add(std::move(built->buffer));
  }
  RESHARD_RETURN_IF_ERROR(ValidateBuffers(doc, buffers));
  return doc;
}

}  // namespace reshard
