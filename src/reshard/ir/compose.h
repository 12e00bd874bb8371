// Transfer plans: compose two maps of one parameter into the moves that take a source
// topology's shards to a target topology's shards, without ever building F (DESIGN.md 4).
//
// A move copies `shape` elements from rank `src_rank`'s source shard (at the strided view
// `src`) to rank `dst_rank`'s target shard (at `dst`), multiplying by `factor` = target scale /
// source scale. Executing every move of a plan on the source shards gives, bit for bit, what
// extracting the target map from the rebuilt F would give, on every non-padding element.
// Target elements that are padding are listed as unwritten: padding is not data, so the plan
// neither reads the source's padding nor invents the target's.
#ifndef RESHARD_IR_COMPOSE_H_
#define RESHARD_IR_COMPOSE_H_

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// One copy between shards. Offsets and strides are in elements of the source shard (`src`)
/// and of the target shard (`dst`).
struct Move {
  Rank src_rank = 0;
  Rank dst_rank = 0;
  Shape shape;
  StridedView src;
  StridedView dst;
  double factor = 1.0;  // target scale / source scale; 1 when neither is scaled
  Index num_elements() const { return ProductOf(shape); }
  friend bool operator==(const Move&, const Move&) = default;
};

/// A block of a target shard that no move writes (target padding).
struct UnwrittenBlock {
  Rank dst_rank = 0;
  Shape shape;
  StridedView dst;
  friend bool operator==(const UnwrittenBlock&, const UnwrittenBlock&) = default;
};

/// The plan for one parameter: canonical (folded, grouped by (src_rank, dst_rank), ordered by
/// src_rank, dst_rank, then destination offset).
struct ParamPlan {
  int source_world = 0;
  int target_world = 0;
  std::vector<Move> moves;
  std::vector<UnwrittenBlock> unwritten;
  /// The buffers the moves read and write (DESIGN.md 16): per source rank and per target rank,
  /// the buffer that rank's map puts the tensor's pieces in ("" for its own shard). Empty
  /// vectors when neither map has buffers. A move's `src` and `dst` views index them.
  std::vector<std::string> source_buffers;
  std::vector<std::string> target_buffers;
  Index num_moved_elements() const;
  /// The buffer move `m` reads from and writes into ("" for the parameter's own shards).
  std::string_view src_buffer(const Move& m) const {
    return source_buffers.empty() ? std::string_view()
                                  : source_buffers[static_cast<size_t>(m.src_rank)];
  }
  std::string_view dst_buffer(const Move& m) const {
    return target_buffers.empty() ? std::string_view()
                                  : target_buffers[static_cast<size_t>(m.dst_rank)];
  }
  friend bool operator==(const ParamPlan&, const ParamPlan&) = default;
};

/// What a replica policy chooses between: the source ranks holding a block that target rank
/// `dst_rank` needs.
struct ReplicaChoice {
  Rank dst_rank = 0;
  std::span<const Rank> holders;  // ascending
  Index elements = 0;             // the block's size
  /// Elements already assigned to each source rank for this parameter.
  std::span<const Index> assigned;
  /// The holders whose read of the block would continue a move already planned to
  /// `dst_rank` (adjacent in both shards, so the two fold into one move): choosing one of
  /// them costs no move of its own. Ascending.
  std::span<const Rank> continuing;
};

/// Picks which holder a target rank reads a replicated block from. Must return one of
/// `choice.holders`, and be deterministic.
using ReplicaPolicy = std::function<Rank(const ReplicaChoice& choice)>;

/// The default policy: the target rank itself when it holds the block; otherwise a holder that
/// continues a planned move (the lowest); otherwise the holder with the fewest elements
/// assigned so far, ties to the lowest rank.
Rank PreferSameRankThenBalance(const ReplicaChoice& choice);

struct ComposeOptions {
  ReplicaPolicy policy = PreferSameRankThenBalance;
};

/// The plan that takes shards laid out by `source` to shards laid out by `target`.
/// The maps must describe the same tensor: equal valid shapes, and logical shapes that are
/// equal or differ only in their first dimension (a vocabulary padded to different heights).
/// FailedPrecondition otherwise, or when a non-padding target element has no source holder
/// (naming it as a multi-index); ResourceExhausted for maps too fragmented to plan.
Result<ParamPlan> Compose(const ParamMap& target, const ParamMap& source,
                          const ComposeOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_IR_COMPOSE_H_
