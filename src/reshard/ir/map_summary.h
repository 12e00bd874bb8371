// What a param map amounts to, for people: per-rank piece counts and held elements, how much
// is replicated or scaled, and a small picture of which rank holds which part of F.
#ifndef RESHARD_IR_MAP_SUMMARY_H_
#define RESHARD_IR_MAP_SUMMARY_H_

#include <string>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

struct RankSummary {
  Index pieces = 0;
  Index elements = 0;             // shard size
  Index replicated_elements = 0;  // held in pieces that other ranks hold too
  Index scaled_elements = 0;      // held in pieces whose scale is not 1
};

struct MapSummary {
  std::vector<RankSummary> ranks;
  Index full_elements = 0;   // of F, padding included
  Index valid_elements = 0;  // of F, padding excluded
  Index held_elements = 0;   // sum over ranks
  Index replicated_elements = 0;
  Index scaled_elements = 0;
};

MapSummary Summarize(const ParamMap& map);

/// The ranks that hold element `offset` of F, ascending (empty for unheld padding).
std::vector<Rank> HoldersOf(const ParamMap& map, Index offset);

/// A picture of F as at most `max_rows` x `max_cols` characters, one per sampled element:
/// the holding rank as 0-9 then a-z, '*' when every rank holds it, '+' when several (but not
/// all) do, '.' for padding. F is drawn as a matrix: leading dimensions are folded into
/// rows, the last dimension is the columns (a 1-D F is one row). Pieces at scale != 1 are
/// not marked; the summary counts them. ResourceExhausted for maps too fragmented to draw.
Result<std::vector<std::string>> HolderPicture(const ParamMap& map, int max_rows, int max_cols);

/// The character that names `rank` in a picture.
char RankGlyph(Rank rank);

}  // namespace reshard

#endif  // RESHARD_IR_MAP_SUMMARY_H_
