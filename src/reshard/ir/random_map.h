// Test support: random valid param maps, and an element-by-element oracle to check them.
//
// `RandomParamMap` builds a map by construction rather than by rejection: it partitions F
// into source views (segments, splits along a dimension, replicated blocks, rank-strided
// interleaves), gives each view a set of holders and a scale, and lays each rank's views out
// densely in its shard (in random order, some transposed, some interleaved element by
// element). Every map it returns has passed `ParamMapBuilder::Finalize`; the generator test
// re-checks them against `ExpandSourceOffsets`, which walks elements and so is independent
// of the validator's box sweep.
//
// Maps are small (F has at most `max_elements` elements) so that element-level oracles stay
// cheap. The same seed always gives the same map.
#ifndef RESHARD_IR_RANDOM_MAP_H_
#define RESHARD_IR_RANDOM_MAP_H_

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/ir/param_map.h"

namespace reshard {

struct RandomMapOptions {
  int max_dims = 4;           // F has 1..max_dims dimensions
  int max_world = 8;          // 1..max_world ranks
  Index max_extent = 12;      // per dimension of F
  Index max_elements = 4096;  // of F; extents are shrunk until the product fits
  bool padding = true;        // sometimes valid_shape < logical_shape
  bool scales = true;         // sometimes scale != 1
  bool replication = true;    // sometimes pieces with several locations
  /// When set, F has exactly this shape (and this valid shape, when given) instead of a
  /// random one: for pairs of maps of one tensor.
  std::optional<Shape> logical_shape;
  std::optional<Shape> valid_shape;
};

/// The unvalidated map `RandomParamMap` would return (for tests of the generator itself).
ParamMapBuilder RandomParamMapBuilder(std::mt19937_64& rng, const RandomMapOptions& options = {});

/// A random valid map; aborts (a generator bug) if it does not pass Finalize. Exercises: 1-4
/// dimensions, worlds of 1-8 ranks, uneven and empty splits, replicated and scaled pieces,
/// segmented layouts (each segment split or replicated its own way), rank-strided interleaves (a
/// dimension viewed as (blocks, rank, block)), reshaped and transposed pieces, element-interleaved
/// dest layouts, padding (possibly unheld), and pieces listed in random order.
ParamMap RandomParamMap(std::mt19937_64& rng, const RandomMapOptions& options = {});

/// The oracle: for each rank r and each element d of its shard (flat row-major offset), the
/// offset into F of the element held there, or -1 where no piece writes. When several
/// pieces write one element the last one wins (a valid map has none). Costs one step per
/// element: for tests on small maps only.
std::vector<std::vector<Index>> ExpandSourceOffsets(const ParamMap& map);

/// Like `ExpandSourceOffsets`, the scale of the piece that writes each shard element (0 where
/// none does).
std::vector<std::vector<double>> ExpandScales(const ParamMap& map);

/// The first seed of every property test's run by default.
inline constexpr uint64_t kPropertyTestBaseSeed = 20240611;

/// Seeds for a property test: `count` consecutive seeds from `kPropertyTestBaseSeed`, so that
/// a test run is repeatable (CI passes or fails on the code, not on the draw). The environment
/// variable RESHARD_SEED changes that: a number replays that one seed (tests log the seed of a
/// failing case); `random` explores, from a fresh random base, `count` times
/// RESHARD_PROPERTY_SCALE (default 1) seeds.
std::vector<uint64_t> PropertyTestSeeds(size_t count);

/// Calls `visit(dest_offset, source_offset)` for every element of `piece`, in row-major order
/// of its shape.
template <typename Visit>
void ForEachPieceElement(const Piece& piece, Visit&& visit) {
  const size_t nd = piece.shape.size();
  for (Index n : piece.shape) {
    if (n <= 0) return;
  }
  std::vector<Index> i(nd, 0);
  while (true) {
    Index src = piece.source.offset;
    Index dst = piece.dest.offset;
    for (size_t k = 0; k < nd; ++k) {
      src += i[k] * piece.source.strides[k];
      dst += i[k] * piece.dest.strides[k];
    }
    visit(dst, src);
    size_t k = nd;
    while (k > 0 && ++i[k - 1] == piece.shape[k - 1]) i[--k] = 0;
    if (k == 0) return;
  }
}

}  // namespace reshard

#endif  // RESHARD_IR_RANDOM_MAP_H_
