// Maps that tests build again and again: pieces from their fields, contiguous splits, and
// GPT-BigCode's fused QKV (DESIGN.md 6.1). Part of the test-support library
// (reshard::ir_testing), never linked by the library or the CLI.
#ifndef RESHARD_IR_FIXTURES_H_
#define RESHARD_IR_FIXTURES_H_

#include <vector>

#include "reshard/ir/param_map.h"

namespace reshard::fixtures {

/// A piece from its fields: `shape`, source view (`src_offset`, `src_strides`), destination
/// view (`dst_offset`, `dst_strides`), holders and scale. Offsets and strides in elements.
Piece MakePiece(Shape shape, Index src_offset, Shape src_strides, Index dst_offset,
                Shape dst_strides, std::vector<Rank> locations, double scale = 1.0);

/// `shape` split contiguously along `dim` into `sizes` (one rank per size, one piece each,
/// held at `scale`), unvalidated.
ParamMapBuilder SplitBuilder(const Shape& shape, size_t dim, const std::vector<Index>& sizes,
                             double scale = 1.0);

/// GPT-BigCode's fused QKV [48, 8] at `world` ranks (a divisor of 32): the 32 query rows
/// split evenly, the 16 key/value rows held by every rank after its query rows; unvalidated.
ParamMapBuilder BigCodeBuilder(int world);

}  // namespace reshard::fixtures

#endif  // RESHARD_IR_FIXTURES_H_
