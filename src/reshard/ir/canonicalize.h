// Canonical maps (DESIGN.md 3). Inference of maps from observed shards is in ir/infer.h.
//
// A map is canonical when every piece is homogeneous and each rank uses as few pieces as
// the fold finds (ir/fold.h), listed in shard order, each piece's destination a contiguous
// row-major block of the shard and its dimensions split where they cross a dimension of F
// (so a row split reads [rows, cols] with strides [cols, 1], not [rows * cols] with [1]).
// The same input always gives byte-identical JSON.
#ifndef RESHARD_IR_CANONICALIZE_H_
#define RESHARD_IR_CANONICALIZE_H_

#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// The canonical form of `map`. Idempotent, and never changes which element goes where.
/// Costs in proportion to the pieces (more exactly, to the blocks in which a piece's
/// destination is contiguous), never to elements.
Result<ParamMap> Canonicalize(const ParamMap& map);

}  // namespace reshard

#endif  // RESHARD_IR_CANONICALIZE_H_
