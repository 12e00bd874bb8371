// JSON form of transfer plans (DESIGN.md 6.4):
//
//   {"version": 1,
//    "params": {"<name>": {"source_world": 8, "target_world": 2,
//                          "moves": [{"src_rank": 0, "dst_rank": 0, "shape": [...],
//                                     "src": [offset, [strides]], "dst": [offset, [strides]],
//                                     "factor": 0.5?, "src_buffer": "<name>"?,
//                                     "dst_buffer": "<name>"?}, ...],
//                          "unwritten": {"<dst_rank>": [{"shape": [...],
//                                                        "dst": [offset, [strides]]}]}}}}
//
// Offsets and strides are in elements of the source shard (src) and the target shard (dst);
// `factor` (target scale / source scale) is omitted when 1; `unwritten` lists, per target
// rank, the blocks of its shard that no move writes (target padding) and is omitted when
// empty. `source_world` and `target_world` are the world sizes of the two maps. A move whose
// source or target rank keeps the tensor in a shared buffer (DESIGN.md 16) names it in
// `src_buffer` / `dst_buffer`; its views then index that buffer. Written
// deterministically, one move per line.
#ifndef RESHARD_IR_PLAN_JSON_H_
#define RESHARD_IR_PLAN_JSON_H_

#include <string>
#include <utility>
#include <vector>

#include "reshard/ir/compose.h"

namespace reshard {

inline constexpr int kPlanDocumentVersion = 1;

struct PlanDocument {
  std::vector<std::pair<std::string, ParamPlan>> params;
};

std::string PlanDocumentToJson(const PlanDocument& doc);

}  // namespace reshard

#endif  // RESHARD_IR_PLAN_JSON_H_
