#include "reshard/ir/plan_json.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <nlohmann/json.hpp>

namespace reshard {

namespace {

std::string View(const StridedView& v) {
  return fmt::format("[{}, [{}]]", v.offset, fmt::join(v.strides, ", "));
}

std::string Number(double x) {
  // nlohmann prints the shortest representation that reads back exactly.
  return nlohmann::json(x).dump();
}

}  // namespace

std::string PlanDocumentToJson(const PlanDocument& doc) {
  std::string out = fmt::format("{{\"version\": {}, \"params\": {{", kPlanDocumentVersion);
  for (size_t i = 0; i < doc.params.size(); ++i) {
    const auto& [name, plan] = doc.params[i];
    out += fmt::format("{}\n  {}: {{\"source_world\": {}, \"target_world\": {}, \"moves\": [",
                       i ? "," : "", nlohmann::json(name).dump(), plan.source_world,
                       plan.target_world);
    for (size_t m = 0; m < plan.moves.size(); ++m) {
      const Move& mv = plan.moves[m];
      std::string buffers;
      if (!plan.src_buffer(mv).empty()) {
        buffers += ", \"src_buffer\": " + nlohmann::json(plan.src_buffer(mv)).dump();
      }
      if (!plan.dst_buffer(mv).empty()) {
        buffers += ", \"dst_buffer\": " + nlohmann::json(plan.dst_buffer(mv)).dump();
      }
      out += fmt::format(
          "{}\n    {{\"src_rank\": {}, \"dst_rank\": {}, \"shape\": [{}], \"src\": {}, \"dst\": "
          "{}{}{}}}",
          m ? "," : "", mv.src_rank, mv.dst_rank, fmt::join(mv.shape, ", "), View(mv.src),
          View(mv.dst), mv.factor == 1.0 ? "" : ", \"factor\": " + Number(mv.factor), buffers);
    }
    out += plan.moves.empty() ? "]" : "\n  ]";
    std::map<Rank, std::vector<const UnwrittenBlock*>> unwritten;
    for (const UnwrittenBlock& u : plan.unwritten) unwritten[u.dst_rank].push_back(&u);
    if (!unwritten.empty()) {
      out += ", \"unwritten\": {";
      bool first_rank = true;
      for (const auto& [rank, blocks] : unwritten) {
        out += fmt::format("{}\n    \"{}\": [", first_rank ? "" : ",", rank);
        first_rank = false;
        for (size_t b = 0; b < blocks.size(); ++b) {
          out += fmt::format("{}{{\"shape\": [{}], \"dst\": {}}}", b ? ", " : "",
                             fmt::join(blocks[b]->shape, ", "), View(blocks[b]->dst));
        }
        out += "]";
      }
      out += "\n  }";
    }
    out += "}";
  }
  out += doc.params.empty() ? "}}\n" : "\n}}\n";
  return out;
}

}  // namespace reshard
