// Comparing two checkpoints tensor by tensor without building either's full tensors
// (DESIGN.md 22, `reshard diff`).
//
// Each side is a ShardSource (any format, any layout). For a tensor both sides hold, its valid
// region of F is cut into bands of consecutive elements in row-major order, each of about
// DiffOptions::band_bytes; the bands are a map of their own (band k is the shard of "rank" k),
// so composing it with each side's map (ir/compose.h) gives, per band, the moves that copy
// that band of F out of that side's shards. Band by band, both sides' copies are made into two
// band buffers (or read in place where a band is one contiguous run of a shard, as in a Hugging
// Face file) and compared; the first band that differs, and the first element in it, is the
// first differing element of F in row-major order. Memory: two bands, beside what a source
// holds while a tensor's shards are acquired (views of mapped files for the reshard sharded and
// Hugging Face formats).
//
// Where a map holds an element on several ranks (replicas), the composed plan reads it from
// one holder, as gather does; gather is what checks replicas against each other.
#ifndef RESHARD_CHECKPOINT_DIFF_H_
#define RESHARD_CHECKPOINT_DIFF_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"

namespace reshard {

/// How a tensor differs between checkpoint A and checkpoint B.
enum class DiffKind {
  kMissing,  // A holds it, B does not
  kExtra,    // B holds it, A does not
  kDType,    // different dtypes (compared bit for bit, without a tolerance)
  kShape,    // different (valid) shapes
  kValue,    // an element differs
};

/// "missing", "extra", "dtype", "shape", "value".
std::string_view DiffKindName(DiffKind kind);

/// One tensor that differs.
struct TensorDifference {
  std::string name;
  DiffKind kind = DiffKind::kValue;
  /// A's and B's dtype and valid shape (the side that lacks the tensor has none).
  std::optional<DType> dtype_a, dtype_b;
  std::optional<Shape> shape_a, shape_b;
  /// kValue: the first differing element in F's row-major order, as a flat index into F's
  /// valid shape and as a multi-index, and its value on each side (FormatElement's text).
  Index index = 0;
  Shape multi_index;
  std::string value_a, value_b;
};

struct DiffReport {
  /// A's tensors in its order (missing, dtype, shape and value differences), then B's extras in
  /// B's order.
  std::vector<TensorDifference> differences;
  /// Tensors both hold, and the elements of those compared (a tensor's comparison stops at its
  /// first difference).
  int64_t tensors_compared = 0;
  int64_t elements_compared = 0;
  bool equal() const { return differences.empty(); }
};

struct DiffOptions {
  /// Compare values, not bits: a pair agrees when |a - b| <= atol + rtol * |b| (both NaN, or
  /// equal infinities, agree too), and tensors of different dtypes are compared value by value.
  /// Neither set: every element must be bit-identical, and dtypes equal.
  std::optional<double> atol, rtol;
  /// Elements are compared a band of about this many bytes of F at a time (per side).
  uint64_t band_bytes = uint64_t{64} << 20;
  int num_threads = 0;
  /// Called after each tensor with the tensors compared so far and the total.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

/// Compares every tensor of `a` with the tensor of the same name in `b`.
/// \returns the differences (none: the checkpoints hold the same tensors, bit for bit or
///          within the tolerance)
/// \error InvalidArgument  a negative or non-finite tolerance
/// \error what a source gives when its shards cannot be read (DataLoss for a corrupt file)
Result<DiffReport> DiffSources(ShardSource& a, ShardSource& b, const DiffOptions& options = {});

/// The report as text: one line per difference, e.g.
/// `value  h.0.attn.weight: first difference at [3, 17] (flat 1553): 0.25 (A) vs 0.5 (B)`,
/// then a summary line.
std::string DiffReportText(const DiffReport& report);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_DIFF_H_
