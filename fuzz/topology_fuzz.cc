// Fuzz target for the sync-plan topology reader (reshard sync-plan --topology,
// reshard.plan_sync, WeightSync(topology=)) and the placement of a sync's processes on it.
//
// Input: an optional first line "TRAINER E0,E1,..." (the trainer's ranks and each engine's
// workers, kept small), then a topology's JSON; without that line the whole input is the JSON
// and the processes are 2 trainer ranks and one engine of 2. For any input: parsing and
// placing return a Status, never crash, overflow, hang or exhaust memory. A topology that
// parses has named, distinct hosts with GPUs and positive bandwidths; a placement that
// succeeds puts every process on its own GPU of its host, honours the explicit entries, and
// routes every pair of processes over two links of the right kind.
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/sched/topology.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "topology_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

// Every pair of processes is routed: the count is kept small.
constexpr int kMaxFuzzProcesses = 48;

std::optional<int> ParseCount(std::string_view text) {
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return value;
}

struct Processes {
  int trainer = 2;
  std::vector<int> engines{2};
};

// "TRAINER E0,E1,...": nullopt unless every count parses and the total stays small (counts
// of 0 or below are kept: Place must refuse or tolerate them without crashing).
std::optional<Processes> ParseHeader(std::string_view line) {
  const size_t space = line.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  Processes p;
  std::optional<int> trainer = ParseCount(line.substr(0, space));
  if (!trainer || *trainer < 0 || *trainer > kMaxFuzzProcesses) return std::nullopt;
  p.trainer = *trainer;
  p.engines.clear();
  int total = p.trainer;
  std::string_view rest = line.substr(space + 1);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::optional<int> w = ParseCount(rest.substr(0, comma));
    if (!w || *w < 0 || *w > kMaxFuzzProcesses) return std::nullopt;
    total += *w;
    if (total > kMaxFuzzProcesses) return std::nullopt;
    p.engines.push_back(*w);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
  return p;
}

void CheckSpec(const reshard::TopologySpec& spec, std::string_view json) {
  const std::string text(json);
  Require(!spec.host_names.empty() && spec.host_names.size() == spec.host_gpus.size(),
          "a topology parses without hosts, or with names and GPU counts that disagree", text);
  std::set<std::string_view> names;
  int64_t gpus = 0;
  for (size_t h = 0; h < spec.host_names.size(); ++h) {
    const std::string& name = spec.host_names[h];
    Require(!name.empty() && name.find(':') == std::string::npos, "a host name is empty or has ':'",
            text);
    Require(names.insert(name).second, "a host is named twice", text);
    Require(spec.host_gpus[h] > 0, "a host has no GPUs", text);
    gpus += spec.host_gpus[h];
  }
  Require(gpus == spec.num_slots(), "num_slots is not the sum of the hosts' GPUs", text);
  Require(spec.nvlink_gbps > 0 && spec.nic_gbps > 0, "a bandwidth is not positive", text);
  std::set<std::pair<int, int>> placed;
  auto check_list = [&](const std::vector<reshard::PlacementEntry>& list) {
    for (const reshard::PlacementEntry& e : list) {
      Require(e.slot.host >= 0 && static_cast<size_t>(e.slot.host) < spec.host_gpus.size() &&
                  e.slot.gpu >= 0 && e.slot.gpu < spec.host_gpus[static_cast<size_t>(e.slot.host)],
              "a placement entry names a GPU that does not exist", text);
      Require(placed.insert({e.slot.host, e.slot.gpu}).second, "a GPU is placed twice", text);
      Require(!e.path.empty(), "a placement entry has no JSON path", text);
    }
  };
  if (spec.trainer) check_list(*spec.trainer);
  if (spec.engines) {
    for (const auto& list : *spec.engines) check_list(list);
  }
}

void CheckPlaced(const reshard::Topology& t, const reshard::TopologySpec& spec, const Processes& p,
                 std::string_view json) {
  const std::string text(json);
  int total = p.trainer;
  for (int w : p.engines) total += w;
  Require(t.num_processes() == total && t.trainer_ranks() == p.trainer &&
              t.num_engines() == static_cast<int>(p.engines.size()),
          "the placed topology has other processes than asked", text);
  std::set<std::pair<int, int>> used;
  for (int q = 0; q < total; ++q) {
    const reshard::Slot& s = t.slot(q);
    Require(s.host >= 0 && static_cast<size_t>(s.host) < spec.host_gpus.size() && s.gpu >= 0 &&
                s.gpu < spec.host_gpus[static_cast<size_t>(s.host)],
            "a process is placed on a GPU that does not exist", text);
    Require(used.insert({s.host, s.gpu}).second, "two processes share a GPU", text);
    Require(
        t.SlotName(q) == spec.host_names[static_cast<size_t>(s.host)] + ":" + std::to_string(s.gpu),
        "a slot's name is not host:gpu", text);
  }
  if (spec.trainer) {
    for (int r = 0; r < p.trainer; ++r) {
      Require(t.slot(r) == (*spec.trainer)[static_cast<size_t>(r)].slot,
              "a trainer rank is not where the placement puts it", text);
    }
  }
  for (size_t e = 0; e < p.engines.size(); ++e) {
    Require(t.engine_workers(static_cast<int>(e)) == p.engines[e],
            "an engine has other workers than asked", text);
    for (int w = 0; spec.engines && w < p.engines[e]; ++w) {
      Require(t.slot(t.engine_process(static_cast<int>(e), w)) ==
                  (*spec.engines)[e][static_cast<size_t>(w)].slot,
              "an engine worker is not where the placement puts it", text);
    }
  }
  const int links = t.num_links();
  for (int a = 0; a < total; ++a) {
    for (int b = 0; b < total; ++b) {
      if (a == b) continue;
      int out = -1;
      int in = -1;
      t.Route(a, b, &out, &in);
      Require(out >= 0 && out < links && in >= 0 && in < links && out % 2 == 0 && in % 2 == 1,
              "a route uses a link that does not exist, or the wrong direction", text);
      const bool same_host = t.slot(a).host == t.slot(b).host;
      const std::string out_name = t.LinkName(out);
      const std::string in_name = t.LinkName(in);
      const char* kind = same_host ? " nvlink " : " nic ";
      Require(out_name.find(kind) != std::string::npos && in_name.find(kind) != std::string::npos,
              "a route takes the wrong kind of link", out_name + " / " + in_name + "\n" + text);
      Require(t.LinkBandwidth(out) > 0 && t.LinkBandwidth(in) > 0, "a link has no bandwidth", text);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  Processes processes;
  std::string_view json = input;
  const size_t newline = input.find('\n');
  if (newline != std::string_view::npos) {
    if (std::optional<Processes> p = ParseHeader(input.substr(0, newline))) {
      processes = *std::move(p);
      json = input.substr(newline + 1);
    }
  }
  reshard::Result<reshard::TopologySpec> spec = reshard::ParseTopologyJson(json);
  if (!spec.ok()) {
    Require(!spec.status().message().empty(), "a refusal without a message", std::string(json));
    return 0;
  }
  CheckSpec(*spec, json);
  reshard::Result<reshard::Topology> placed =
      reshard::Topology::Place(*spec, processes.trainer, processes.engines);
  if (!placed.ok()) return 0;
  CheckPlaced(*placed, *spec, processes, json);
  return 0;
}
