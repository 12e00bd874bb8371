#include "reshard/sched/topology.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "reshard/base/json_reader.h"

namespace reshard {

namespace {

using json::Json;

constexpr int kMaxGpusPerHost = 1 << 16;
constexpr Index kMaxHosts = 1 << 20;
constexpr Index kMaxGpus = Index{1} << 24;  // GPUs of all hosts together

Result<double> ReadBandwidth(const Json& j, std::string_view path) {
  RESHARD_ASSIGN_OR_RETURN(double v, json::ReadNumber(j, path));
  if (!(v >= kMinGbps) || v > kMaxGbps) {
    // The bounds as kMinGbps and kMaxGbps say.
    return json::ErrorAt(
        path, fmt::format("expected a bandwidth in GB/s from 0.001 (1 MB/s) to 1e9, got {}", v));
  }
  return v;
}

Status ReadHosts(const Json& hosts, std::string_view path, TopologySpec* spec) {
  if (!hosts.is_array() || hosts.empty()) {
    return json::TypeError(path, "a non-empty array of hosts", hosts);
  }
  std::set<std::string> names;
  Index total_gpus = 0;
  for (size_t i = 0; i < hosts.size(); ++i) {
    const std::string p = json::Element(path, i);
    const Json& h = hosts[i];
    if (!h.is_object()) return json::TypeError(p, "an object", h);
    RESHARD_RETURN_IF_ERROR(json::CheckKeys(h, p, {"name", "gpus", "count"}, "a host"));
    RESHARD_ASSIGN_OR_RETURN(const Json* name_j, json::Require(h, p, "name"));
    RESHARD_ASSIGN_OR_RETURN(std::string name, json::ReadString(*name_j, json::Member(p, "name")));
    if (name.empty() || name.find(':') != std::string::npos) {
      return json::ErrorAt(json::Member(p, "name"), "a host name must be non-empty, without ':'");
    }
    RESHARD_ASSIGN_OR_RETURN(const Json* gpus_j, json::Require(h, p, "gpus"));
    RESHARD_ASSIGN_OR_RETURN(Index gpus,
                             json::ReadInt(*gpus_j, json::Member(p, "gpus"), {1, kMaxGpusPerHost}));
    std::optional<Index> count;
    if (const Json* c = json::Find(h, "count")) {
      RESHARD_ASSIGN_OR_RETURN(count, json::ReadInt(*c, json::Member(p, "count"), {1, kMaxHosts}));
    }
    const Index n = count.value_or(1);
    if (static_cast<Index>(spec->host_names.size()) + n > kMaxHosts) {
      return json::ErrorAt(p, fmt::format("more than {} hosts", kMaxHosts));
    }
    // Counted before the hosts are listed, and in 64 bits: a count of hosts times their GPUs
    // can exceed an int.
    total_gpus += n * gpus;
    if (total_gpus > kMaxGpus) return json::ErrorAt(p, "more than 2^24 GPUs in all");
    for (Index k = 0; k < n; ++k) {
      std::string full = count ? fmt::format("{}{}", name, k) : name;
      if (!names.insert(full).second) {
        return json::ErrorAt(p, fmt::format("host \"{}\" is named twice", full));
      }
      spec->host_names.push_back(std::move(full));
      spec->host_gpus.push_back(static_cast<int>(gpus));
    }
  }
  return Status::Ok();
}

using HostIndex = std::map<std::string_view, int>;

Result<std::vector<PlacementEntry>> ReadPlacementList(
    const Json& list, std::string_view path, const TopologySpec& spec, const HostIndex& host_index,
    std::map<std::pair<int, int>, std::string>* used) {
  if (!list.is_array()) return json::TypeError(path, "an array of \"host\" or \"host:gpu\"", list);
  std::vector<PlacementEntry> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string p = json::Element(path, i);
    RESHARD_ASSIGN_OR_RETURN(std::string entry, json::ReadString(list[i], p));
    const size_t colon = entry.find(':');
    const std::string host = entry.substr(0, colon);
    auto it = host_index.find(host);
    if (it == host_index.end()) {
      return json::ErrorAt(p, fmt::format("no host named {} in \"hosts\"", json::QuoteShort(host)));
    }
    const int h = it->second;
    const int gpus = spec.host_gpus[static_cast<size_t>(h)];
    int first = 0;
    int last = gpus;
    if (colon != std::string::npos) {
      const std::string g = entry.substr(colon + 1);
      int gpu = -1;
      if (!g.empty() && g.size() <= 6 && g.find_first_not_of("0123456789") == std::string::npos) {
        gpu = std::stoi(g);
      }
      if (gpu < 0 || gpu >= gpus) {
        return json::ErrorAt(p, fmt::format("host \"{}\" has GPUs 0..{}, not {}", host, gpus - 1,
                                            json::QuoteShort(g)));
      }
      first = gpu;
      last = gpu + 1;
    }
    for (int g = first; g < last; ++g) {
      auto [at, fresh] = used->emplace(std::make_pair(h, g), p);
      if (!fresh) {
        return json::ErrorAt(p,
                             fmt::format("GPU {}:{} is already placed by {}", host, g, at->second));
      }
      out.push_back({Slot{h, g}, p});
    }
  }
  return out;
}

Status ReadPlacement(const Json& j, std::string_view path, TopologySpec* spec) {
  if (!j.is_object()) return json::TypeError(path, "an object", j);
  RESHARD_RETURN_IF_ERROR(json::CheckKeys(j, path, {"trainer", "engines"}, "a placement"));
  std::map<std::pair<int, int>, std::string> used;
  // Built once: a placement may list many engines, a topology many hosts.
  HostIndex host_index;
  for (size_t h = 0; h < spec->host_names.size(); ++h)
    host_index[spec->host_names[h]] = static_cast<int>(h);
  if (const Json* t = json::Find(j, "trainer")) {
    RESHARD_ASSIGN_OR_RETURN(spec->trainer, ReadPlacementList(*t, json::Member(path, "trainer"),
                                                              *spec, host_index, &used));
  }
  if (const Json* e = json::Find(j, "engines")) {
    const std::string p = json::Member(path, "engines");
    if (!e->is_array()) return json::TypeError(p, "an array (one list per engine)", *e);
    std::vector<std::vector<PlacementEntry>> engines;
    for (size_t i = 0; i < e->size(); ++i) {
      RESHARD_ASSIGN_OR_RETURN(
          auto list, ReadPlacementList((*e)[i], json::Element(p, i), *spec, host_index, &used));
      engines.push_back(std::move(list));
    }
    spec->engines = std::move(engines);
  }
  return Status::Ok();
}

}  // namespace

int TopologySpec::num_slots() const {
  int n = 0;
  for (int g : host_gpus) n += g;
  return n;
}

Result<TopologySpec> ParseTopologyJson(std::string_view text) {
  RESHARD_ASSIGN_OR_RETURN(Json j, json::ParseJson(text));
  if (!j.is_object()) return json::TypeError("", "a topology object", j);
  RESHARD_RETURN_IF_ERROR(json::CheckKeys(
      j, "", {"hosts", "nvlink_gbps", "nic_gbps", "nic", "placement"}, "a topology"));
  TopologySpec spec;
  RESHARD_ASSIGN_OR_RETURN(const Json* hosts, json::Require(j, "", "hosts"));
  RESHARD_RETURN_IF_ERROR(ReadHosts(*hosts, "hosts", &spec));
  if (const Json* v = json::Find(j, "nvlink_gbps")) {
    RESHARD_ASSIGN_OR_RETURN(spec.nvlink_gbps, ReadBandwidth(*v, "nvlink_gbps"));
  }
  if (const Json* v = json::Find(j, "nic_gbps")) {
    RESHARD_ASSIGN_OR_RETURN(spec.nic_gbps, ReadBandwidth(*v, "nic_gbps"));
  }
  if (const Json* v = json::Find(j, "nic")) {
    RESHARD_ASSIGN_OR_RETURN(std::string nic, json::ReadString(*v, "nic"));
    if (nic == "host") {
      spec.nic = NicKind::kPerHost;
    } else if (nic == "gpu") {
      spec.nic = NicKind::kPerGpu;
    } else {
      return json::ErrorAt(
          "nic", fmt::format("expected \"host\" or \"gpu\", got {}", json::QuoteShort(nic)));
    }
  }
  if (const Json* v = json::Find(j, "placement")) {
    RESHARD_RETURN_IF_ERROR(ReadPlacement(*v, "placement", &spec));
  }
  return spec;
}

Result<Topology> Topology::Place(TopologySpec spec, int trainer_ranks,
                                 const std::vector<int>& engine_workers) {
  Topology t;
  t.trainer_ranks_ = trainer_ranks;
  Index total = trainer_ranks;
  for (int w : engine_workers) total += w;
  Index total_gpus = 0;
  for (int g : spec.host_gpus) total_gpus += g;
  if (total > total_gpus) {
    return json::ErrorAt(
        "hosts", fmt::format("{} trainer ranks and {} engines ({} processes) need "
                             "{} GPUs, but the hosts have {}",
                             trainer_ranks, engine_workers.size(), total, total, total_gpus));
  }
  std::set<std::pair<int, int>> explicit_slots;
  if (spec.trainer) {
    if (static_cast<int>(spec.trainer->size()) != trainer_ranks) {
      return json::ErrorAt("placement.trainer",
                           fmt::format("places {} GPUs, the trainer has {} ranks",
                                       spec.trainer->size(), trainer_ranks));
    }
  }
  if (spec.engines) {
    if (spec.engines->size() != engine_workers.size()) {
      return json::ErrorAt("placement.engines",
                           fmt::format("places {} engines, there are {}", spec.engines->size(),
                                       engine_workers.size()));
    }
    for (size_t e = 0; e < engine_workers.size(); ++e) {
      if (static_cast<int>((*spec.engines)[e].size()) != engine_workers[e]) {
        return json::ErrorAt(json::Element("placement.engines", e),
                             fmt::format("places {} GPUs, the engine has {} workers",
                                         (*spec.engines)[e].size(), engine_workers[e]));
      }
    }
  }
  // Explicit entries first; the rest fill the free GPUs in host order.
  auto mark = [&](const std::vector<PlacementEntry>& list) {
    for (const PlacementEntry& p : list) explicit_slots.insert({p.slot.host, p.slot.gpu});
  };
  if (spec.trainer) mark(*spec.trainer);
  if (spec.engines) {
    for (const auto& list : *spec.engines) mark(list);
  }
  size_t next_host = 0;
  int next_gpu = 0;
  auto next_free = [&]() {
    for (;;) {
      if (next_gpu >= spec.host_gpus[next_host]) {
        ++next_host;
        next_gpu = 0;
        continue;
      }
      Slot s{static_cast<int>(next_host), next_gpu++};
      if (!explicit_slots.count({s.host, s.gpu})) return s;
    }
  };
  for (int r = 0; r < trainer_ranks; ++r) {
    t.slots_.push_back(spec.trainer ? (*spec.trainer)[static_cast<size_t>(r)].slot : next_free());
  }
  for (size_t e = 0; e < engine_workers.size(); ++e) {
    t.engine_first_.push_back(static_cast<int>(t.slots_.size()));
    t.engine_size_.push_back(engine_workers[e]);
    for (int w = 0; w < engine_workers[e]; ++w) {
      t.slots_.push_back(spec.engines ? (*spec.engines)[e][static_cast<size_t>(w)].slot
                                      : next_free());
    }
  }
  t.spec_ = std::move(spec);
  t.NumberLinks();
  return t;
}

void Topology::NumberLinks() {
  auto before = [](const Slot& a, const Slot& b) {
    return a.host != b.host ? a.host < b.host : a.gpu < b.gpu;
  };
  gpus_ = slots_;
  std::sort(gpus_.begin(), gpus_.end(), before);
  gpus_.erase(std::unique(gpus_.begin(), gpus_.end()), gpus_.end());
  for (const Slot& g : gpus_) {
    if (nic_hosts_.empty() || nic_hosts_.back() != g.host) nic_hosts_.push_back(g.host);
  }
  for (const Slot& s : slots_) {
    const auto g = std::lower_bound(gpus_.begin(), gpus_.end(), s, before) - gpus_.begin();
    const auto h =
        std::lower_bound(nic_hosts_.begin(), nic_hosts_.end(), s.host) - nic_hosts_.begin();
    gpu_of_.push_back(static_cast<int>(g));
    host_of_.push_back(static_cast<int>(h));
    nic_of_.push_back(static_cast<int>(spec_.nic == NicKind::kPerGpu ? g : h));
  }
}

std::string Topology::SlotName(int process) const {
  const Slot& s = slot(process);
  return fmt::format("{}:{}", spec_.host_names[static_cast<size_t>(s.host)], s.gpu);
}

int Topology::num_links() const {
  const size_t nics = spec_.nic == NicKind::kPerHost ? nic_hosts_.size() : gpus_.size();
  return static_cast<int>(2 * gpus_.size() + 2 * nics);
}

double Topology::LinkBandwidth(int link) const {
  return (link < 2 * static_cast<int>(gpus_.size()) ? spec_.nvlink_gbps : spec_.nic_gbps) * 1e9;
}

std::string Topology::LinkName(int link) const {
  const char* dir = link % 2 == 0 ? "out" : "in";
  auto gpu_name = [&](int g) {
    const Slot& s = gpus_[static_cast<size_t>(g)];
    return fmt::format("{}:{}", spec_.host_names[static_cast<size_t>(s.host)], s.gpu);
  };
  const int nvlinks = 2 * static_cast<int>(gpus_.size());
  if (link < nvlinks) return fmt::format("{} nvlink {}", gpu_name(link / 2), dir);
  const int n = (link - nvlinks) / 2;
  if (spec_.nic == NicKind::kPerHost) {
    return fmt::format("{} nic {}",
                       spec_.host_names[static_cast<size_t>(nic_hosts_[static_cast<size_t>(n)])],
                       dir);
  }
  return fmt::format("{} nic {}", gpu_name(n), dir);
}

int Topology::NicOutLink(int process) const {
  return 2 * static_cast<int>(gpus_.size()) + 2 * nic_of_[static_cast<size_t>(process)];
}

int Topology::NicInLink(int process) const { return NicOutLink(process) + 1; }

void Topology::Route(int from, int to, int* out_link, int* in_link) const {
  if (slot(from).host == slot(to).host) {
    *out_link = 2 * gpu_of_[static_cast<size_t>(from)];
    *in_link = 2 * gpu_of_[static_cast<size_t>(to)] + 1;
    return;
  }
  *out_link = NicOutLink(from);
  *in_link = NicInLink(to);
}

}  // namespace reshard
