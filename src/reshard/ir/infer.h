// Inference of param maps from observed shards (DESIGN.md 6.3): what a framework's partition
// function did, read back from the F offset of every shard element, as a canonical map.
#ifndef RESHARD_IR_INFER_H_
#define RESHARD_IR_INFER_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// What one rank was observed to hold: `index_map[k]` is the flat offset in F of shard
/// element k (shard in row-major order).
///
/// Buffered (DESIGN.md 16): when `buffer` is set, the rank's elements of F lie in that named
/// rank tensor, which other checkpoint tensors share (vLLM's fused `qkv_proj`): `shard_shape`
/// is the buffer's shape, and `index_map[k]` is -1 for an element of the buffer that holds
/// nothing of F. The inferred map's rank names the buffer; exactness over the whole buffer is
/// then BufferSetBuilder::Finalize's to check, with the maps of the other tensors.
struct ObservedShard {
  Rank rank = 0;
  Shape shard_shape;
  std::vector<Index> index_map;
  /// Empty: unscaled. One value: the whole shard holds F times it. Otherwise one value per
  /// shard element.
  std::vector<double> scale;
  std::string buffer;
};

/// The input of `reshard infer` (DESIGN.md 6.3).
struct IndexMaps {
  Shape logical_shape;
  std::optional<Shape> valid_shape;
  std::vector<ObservedShard> ranks;
};

struct InferOptions {
  /// Accept F elements that no rank holds (deliberately partial observations). The map
  /// then fails P1 and is returned unvalidated for coverage.
  bool allow_uncovered = false;
};

/// The canonical map that explains the observed shards. Linear in the number of index map
/// entries. InvalidArgument, naming the rank and shard element (or F multi-index), for: an
/// index outside F, a shard whose shape and index map disagree in size, a rank listed twice
/// or missing, an element of F held twice by one rank, a scale that is not finite and
/// non-zero, and (unless allowed) an element of F that no rank holds. An entry of -1 is
/// accepted only in a buffered shard (an element of the buffer that holds nothing of F).
Result<ParamMap> Infer(const IndexMaps& observed, const InferOptions& options = {});

/// The index maps a map implies: for each rank, the F offset of every shard element (and a
/// per-element scale when any piece is scaled); a buffered rank keeps its buffer's name, with -1
/// for the buffer's elements the map does not write. Costs one step per element: for tests and
/// small maps.
IndexMaps ToIndexMaps(const ParamMap& map);

/// Parses DESIGN.md 6.3 JSON (extra keys ignored; an optional "valid_shape" is accepted, and
/// per rank an optional "buffer" name).
Result<IndexMaps> ParseIndexMapsJson(std::string_view text);

}  // namespace reshard

#endif  // RESHARD_IR_INFER_H_
