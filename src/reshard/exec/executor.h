// The executor: one strided-copy engine for extract (F -> a rank's shard), rebuild
// (shards -> F) and transfer plans (shard -> shard).
//
// Buffers are flat, dense, row-major, and given by the address of their first element: a
// caller's buffer may start part-way into a larger allocation; the executor never looks
// for a storage base. Sizes are in elements unless a name says bytes.
//
// Scale: the shard holds F * scale^p (p = the tensor's scale power: 1 for weights, -1 and -2
// for Adam's moments). Extract multiplies by scale^p; rebuild divides by it (as DeepSpeed's
// reader does). The arithmetic is the dtype's: F64 in double; F32 as float * float(factor);
// F16 and BF16 widened to float, multiplied (or divided), rounded to nearest even. Integer,
// BOOL and FP8 dtypes refuse any factor other than 1 (FailedPrecondition).
#ifndef RESHARD_EXEC_EXECUTOR_H_
#define RESHARD_EXEC_EXECUTOR_H_

#include <cstddef>
#include <span>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/status.h"
#include "reshard/ir/compose.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// A read-only dense buffer: `data` is the address of element 0.
struct ConstBuffer {
  const std::byte* data = nullptr;
  Index num_elements = 0;
};

/// A writable dense buffer: `data` is the address of element 0.
struct MutableBuffer {
  std::byte* data = nullptr;
  Index num_elements = 0;
};

struct ExecOptions {
  /// The scale power p of the tensor being moved (1 for weights).
  int scale_power = 1;
  /// Moving a tensor with p != 1 through a piece whose scale is not 1 is refused unless
  /// this is set: an optimizer's learning rate and epsilon stay in the source coordinate,
  /// so a resumed run would silently diverge.
  bool allow_scaled_optimizer_state = false;
  /// Rebuild: compare every replica against the first holder's data (P2). On by default.
  bool verify_replicas = true;
  /// Apply scales even where a value does not survive them. Off by default: every scaled
  /// element is checked in the copy itself (scaled, then scaled back, it must give its own
  /// bits again) and the first that does not is refused (FailedPrecondition naming the element
  /// and its values). A power-of-two scale loses a value only by overflow to infinity or
  /// underflow into the subnormals or to zero; any other scale rounds most values.
  bool allow_lossy_scale = false;
  /// Worker threads; 0 means one per hardware thread. Small copies always run inline.
  int num_threads = 0;
};

/// F -> the shard of `rank`. `full` has map.num_elements() elements of `dtype`; `shard` has
/// map.shard_num_elements(rank). FailedPrecondition for a buffer of the wrong size or a
/// factor the dtype cannot take.
Status Extract(const ParamMap& map, DType dtype, Rank rank, ConstBuffer full, MutableBuffer shard,
               const ExecOptions& options = {});

/// Shards -> F. `shards[r]` is rank r's shard (world_size entries). Every element of F is
/// written from its lowest-ranked holder; padding that no rank holds is set to zero. With
/// `verify_replicas`, every other holder's data, after undoing its scale, must equal what
/// was written bit for bit, else FailedPrecondition naming the ranks, the parameter offset
/// and the multi-index where they disagree. Disagreement inside padding is ignored.
Status Rebuild(const ParamMap& map, DType dtype, std::span<const ConstBuffer> shards,
               MutableBuffer full, const ExecOptions& options = {});

/// P2 on shards alone, without F: wherever several ranks hold an element of F, their data,
/// each after undoing its own scale, must be bit-identical. FailedPrecondition naming the
/// ranks, the element of F (multi-index and offset) and the two values where they are not.
/// Disagreement inside padding is ignored. Rebuild with `verify_replicas` makes the same check
/// (the same code) against the F it writes. This form first compares each replica with the
/// first holder's bytes directly when both hold the same elements of F at the same scale
/// (byte-identical replicas agree whatever the scale does); only when that is not so, or some
/// bytes differ, does it rebuild the span of F that the replicated pieces cover, to decide and
/// to name the element.
Status VerifyReplicas(const ParamMap& map, DType dtype, std::span<const ConstBuffer> shards,
                      const ExecOptions& options = {});

/// Runs a transfer plan (source shards -> target shards, no full tensor). `sources[r]` is
/// source rank r's shard (plan.source_world entries), `targets[r]` target rank r's
/// (plan.target_world entries). Every move is checked against the buffers before anything is
/// copied (OutOfRange naming the move). Blocks the plan leaves unwritten (target padding) are
/// set to zero. A move's factor applies as factor^p (p = options.scale_power); p != 1 through a
/// factor other than 1 is refused unless allowed, as for Extract.
Status ExecutePlan(const ParamPlan& plan, DType dtype, std::span<const ConstBuffer> sources,
                   std::span<const MutableBuffer> targets, const ExecOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_EXEC_EXECUTOR_H_
