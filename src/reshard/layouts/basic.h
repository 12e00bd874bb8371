// Basic layouts as param maps: contiguous splits, replication, and segmented (fused)
// parameters. These are the building blocks the layout-descriptor families are made of.
#ifndef RESHARD_LAYOUTS_BASIC_H_
#define RESHARD_LAYOUTS_BASIC_H_

#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// Every rank holds all of F, at `scale` (a row-parallel bias pre-divided by the world size
/// is held at scale 1/world). One piece per rank, its locations every rank.
Result<ParamMap> ReplicatedMap(const Shape& shape, int world_size, double scale = 1.0);

/// Rank r holds the contiguous block of `sizes[r]` indices along `dim` (uneven and empty
/// blocks allowed; sizes must sum to shape[dim]). One piece per rank.
Result<ParamMap> SplitMap(const Shape& shape, int dim, const std::vector<Index>& sizes);

/// Near-even split of `extent` over `world_size` ranks, the remainder on the first ranks.
std::vector<Index> EvenSplitSizes(Index extent, int world_size);

/// One segment of a parameter cut along one dimension: either split across ranks with
/// per-rank `widths` (which sum to `size`), or held whole by every rank.
struct Segment {
  Index size = 0;
  bool replicated = false;
  std::vector<Index> widths;  // split segments only; one per rank
};

/// A parameter made of consecutive segments along `dim` (a fused QKV: q, k and v segments
/// split together; a multi-query QKV: q split, the key/value block replicated). A rank's
/// shard holds its part of each segment in order; one piece per segment per rank.
/// InvalidArgument for a count of segments that would make a map too large to hold: more
/// than 2^22 pieces (a segment a rank) or 2^24 holder entries (a replicated segment lists
/// every rank on each rank's piece). Checked before anything is allocated per segment.
Result<ParamMap> SegmentedMap(const Shape& shape, int dim, const std::vector<Segment>& segments,
                              int world_size);

/// SegmentedMap's bound on its size, for a caller to check before it builds `segments`
/// (`replicated` of them held whole).
Status CheckSegmentCount(Index segments, Index replicated, int world_size);

/// F's `dim` cut into `num_blocks` equal blocks; rank r's shard holds the blocks
/// `rank_blocks[r]` in that order (Yuan's shared-QK value heads, CodeGen's interleaved QKV).
/// A block listed by several ranks is replicated among them (its locations are every rank
/// that lists it). One piece per block: canonicalise to fold runs. InvalidArgument for a
/// block id out of range, a block listed twice by one rank, a block no rank holds, or an
/// extent that `num_blocks` does not divide.
Result<ParamMap> BlockGatherMap(const Shape& shape, int dim, Index num_blocks,
                                const std::vector<std::vector<Index>>& rank_blocks);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_BASIC_H_
