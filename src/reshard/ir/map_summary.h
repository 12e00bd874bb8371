// What a param map amounts to, for people: per-rank piece counts and held elements, how much
// is replicated or scaled, and a small picture of which rank holds which part of F; for a
// buffer (ir/buffer_set.h), which rank holds which of the tensors written into it - for the
// stacked experts of an MoE layer, which rank holds which experts - as a table and as SVG.
#ifndef RESHARD_IR_MAP_SUMMARY_H_
#define RESHARD_IR_MAP_SUMMARY_H_

#include <span>
#include <string>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/buffer_set.h"
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

/// One column of a buffer's picture: an expert (the tensors over the buffer whose names differ
/// only in the expert id: `experts.3.gate_proj.weight`, `experts.3.up_proj.weight`), or, in a
/// buffer whose tensors are not numbered experts (vLLM's qkv_proj), one tensor.
struct BufferColumn {
  std::string label;                 // the expert id, or the tensor's name
  int expert = -1;                   // -1 when the columns are tensors
  std::vector<std::string> tensors;  // in the order the maps were given
  Index elements = 0;                // of those tensors together
  std::vector<Rank> holders;         // ranks whose buffer holds any of it, ascending
  /// The sample grid of the column's first tensor (folded to a matrix as HolderPicture does).
  int sample_rows = 0;
  int sample_cols = 0;
};

/// What one rank's buffer holds of one column.
struct BufferCell {
  /// Indices along the buffer's first dimension its pieces lie in (an expert's slot), for
  /// expert columns of a buffer of two or more dimensions; ascending.
  std::vector<Index> slots;
  Index elements = 0;       // of the column's tensors, in this rank's buffer
  bool replicated = false;  // some of them are held by other ranks too
  /// sample_rows x sample_cols, row-major: which samples of the column's first tensor this
  /// rank holds (a TP slice shows as a band).
  std::vector<bool> samples;
  bool partial(const BufferColumn& c) const { return elements > 0 && elements < c.elements; }
};

/// Which rank holds which columns of one buffer.
struct BufferSummary {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<Shape> rank_shapes;
  std::vector<Index> padding_elements;  // per rank
  /// Expert columns: the tensors' names with the expert id as "{e}", in first-seen order.
  std::vector<std::string> members;
  std::vector<BufferColumn> columns;           // experts by id, or tensors in the maps' order
  std::vector<std::vector<BufferCell>> cells;  // [rank][column]
  /// Other buffers laid out exactly like this one (a model's other layers: names that differ
  /// only in their numbers, the same shapes, columns, holders and cells), set by
  /// MergeSameLayouts.
  std::vector<std::string> same_layout;

  int world_size() const { return static_cast<int>(rank_shapes.size()); }
  bool expert_columns() const { return !columns.empty() && columns[0].expert >= 0; }
};

/// One summary per buffer of `set`, in its (name) order, from the maps over it (`maps` may
/// hold unbuffered maps too; they are skipped). The expert id of a tensor is the number after
/// an "experts" component of its dotted name, or else the one numeric component in which the
/// buffer's tensors differ; without one the columns are the tensors. ResourceExhausted for
/// maps too fragmented to sample.
Result<std::vector<BufferSummary>> SummarizeBuffers(const BufferSet& set,
                                                    std::span<const NamedMapRef> maps);

/// `buffers` with every buffer laid out like an earlier one folded into that one's
/// `same_layout` (so a model of 61 identical MoE layers draws one grid per kind of buffer).
std::vector<BufferSummary> MergeSameLayouts(std::vector<BufferSummary> buffers);

/// The summary as text lines (no newlines): a heading, one line per rank (its shape and the
/// experts in slot order), the replicated experts, and a grid of ranks x columns at most
/// `max_width` characters wide (wrapped into blocks of columns): each cell the slot that
/// holds the column on that rank, "~" when it holds part of it (a TP slice), "+" when another
/// rank holds the same elements too (a redundant expert, a replica), "." when none.
std::vector<std::string> BufferTable(const BufferSummary& summary, int max_width = 64);

/// A standalone SVG picture of the buffers (one grid each: rows = ranks, columns = experts or
/// tensors; a held cell coloured by its rank and shaded where the rank holds only part of the
/// column, its slot written inside, replicas hatched; a tooltip per cell). Deterministic,
/// well-formed XML; names are escaped.
std::string BuffersSvg(std::span<const BufferSummary> buffers);

/// One block-quantized tensor's grid for `show`: a title and its holder picture (HolderPicture
/// of the scales' map: one character a block, the rank that holds its scale, "+" several).
struct BlockDrawing {
  std::string title;
  std::vector<std::string> picture;
};

/// A standalone SVG picture of block grids (one cell a block, coloured by the rank holding its
/// scale, hatched grey where a block is cut between ranks). Deterministic; names escaped.
std::string BlocksSvg(std::span<const BlockDrawing> drawings);

}  // namespace reshard

#endif  // RESHARD_IR_MAP_SUMMARY_H_
