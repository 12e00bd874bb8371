// Layout descriptors: recipes that produce a parameter's param map at any world size.
//
// A param map is a fact about one topology. Converting a checkpoint to another degree needs
// the same layout laid out again at the new degree, which is what a descriptor is: a small
// JSON-serialisable value naming a sharding family and its parameters, turned into the
// canonical map of a given logical shape and world size by `BuildMap`.
//
// Families (JSON forms in docs/layouts.md):
//   replicated     every rank holds F, optionally pre-divided (scale 1/world: row-parallel
//                  biases that are summed by an all-reduce)
//   split          one contiguous block per rank along `dim`, sized by a remainder policy
//                  (DeepSpeed's front-loaded near-even split with head or grain alignment,
//                  transformers' ceil split, a back-loaded split, an exact split) or by
//                  explicit per-rank sizes
//   fused          consecutive sub-parameters along `dim` (q, k, v; gate, up), each split by
//                  the same rule; a rank's shard is its part of each, in order
//   segmented      fused, where some segments are held whole by every rank (multi-query)
//   block_gather   equal blocks along `dim`, each rank holding a chosen list of them (Yuan's
//                  shared-QK value heads; a block may be held by two neighbouring ranks)
//   codegen_qkv    CodeGen's fused QKV: mp_num blocks of (q, k, v), interleaved over ranks
//   padded_vocab   a vocabulary padded so it divides, split exactly; `valid_shape` records
//                  the real rows
#ifndef RESHARD_LAYOUTS_DESCRIPTOR_H_
#define RESHARD_LAYOUTS_DESCRIPTOR_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

enum class LayoutFamily {
  kReplicated,
  kSplit,
  kFused,
  kSegmented,
  kBlockGather,
  kCodegenQkv,
  kPaddedVocab,
};

/// How `units` indivisible units are dealt to `world` ranks when they do not divide.
enum class Remainder {
  kFront,  // near-even, one extra unit on each of the first ranks (DeepSpeed AutoTP)
  kBack,   // near-even, the extra units on the last ranks (DeepSpeed's Conv2d)
  kCeil,   // ceil(units/world) per rank; a short or empty last rank (transformers, torch.chunk)
  kExact,  // must divide (Megatron, DeepSpeed's universal-checkpoint restore)
};

/// The rule that sizes the per-rank blocks of one extent. Units: indices along the split
/// dimension.
struct SplitRule {
  Remainder remainder = Remainder::kFront;
  /// Split whole heads: the extent is `heads` equal heads, dealt by `remainder`. A world
  /// larger than the head count leaves ranks with nothing (DeepSpeed's kv-head alignment).
  std::optional<Index> heads;
  /// Split in units of `grain` indices; the `extent % grain` tail goes to the last rank, and
  /// an extent smaller than one grain is split index by index (DeepSpeed's tp_grain_size).
  std::optional<Index> grain;
  /// Explicit per-rank sizes: fixes the world size to `sizes.size()`.
  std::vector<Index> sizes;

  friend bool operator==(const SplitRule&, const SplitRule&) = default;
};

/// One sub-parameter of a fused or segmented layout.
struct LayoutPart {
  Index size = 0;           // indices along the layout's dim
  bool replicated = false;  // segmented only: every rank holds the whole part
  /// Per-part overrides of the layout's rule (DeepSpeed aligns every sub-parameter to the
  /// model's kv-head count; a descriptor can say otherwise per part).
  std::optional<Index> heads;
  std::optional<Index> grain;
  std::vector<Index> widths;  // explicit per-rank widths (fixes the world size)

  friend bool operator==(const LayoutPart&, const LayoutPart&) = default;
};

/// A layout family and its parameters. Fields a family does not use stay at their defaults
/// (the parser refuses keys that do not belong to the family).
struct LayoutDescriptor {
  LayoutFamily family = LayoutFamily::kReplicated;
  /// The dimension split (every family but replicated).
  int dim = 0;

  // replicated: hold F * (1 / world_size) instead of F.
  bool pre_divided = false;

  // split, fused, segmented: the rule (for fused/segmented, the default of every part).
  SplitRule rule;

  // fused, segmented: either `equal_parts` equal sub-parameters, or explicit `parts`.
  std::optional<Index> equal_parts;
  std::vector<LayoutPart> parts;

  // block_gather: `num_blocks` equal blocks along dim; either the shared-QK pairing over
  // `heads` (then one block per head) or explicit `rank_blocks` (fixes the world size).
  bool shared_qk = false;
  std::optional<Index> num_blocks;
  std::vector<std::vector<Index>> rank_blocks;

  // codegen_qkv: `mp_num` (CodeGen's hard-coded 4) blocks of q, k, v; `heads`, when known,
  // must be a multiple of mp_num * world_size (DeepSpeed's requirement). Uses rule.heads.
  Index mp_num = 4;

  // padded_vocab: F's `dim` is padded to `padded_size` when given (must divide by the
  // world size), otherwise rounded up to a multiple of `pad_multiple * world_size`.
  std::optional<Index> padded_size;
  Index pad_multiple = 1;

  friend bool operator==(const LayoutDescriptor&, const LayoutDescriptor&) = default;
};

/// The family's JSON name: "replicated", "split", ...
std::string_view LayoutFamilyName(LayoutFamily family);
std::string_view RemainderName(Remainder remainder);

/// Parses a descriptor (docs/layouts.md). Strict: unknown keys, keys of another family,
/// wrong types, non-integers and duplicate keys are InvalidArgument naming the JSON path,
/// e.g. `parts[1].size: expected a non-negative integer, got -3`.
Result<LayoutDescriptor> ParseLayoutJson(std::string_view text);

/// Deterministic compact JSON (one line, keys in a fixed order, defaults omitted); reads
/// back to an equal descriptor.
std::string LayoutToJson(const LayoutDescriptor& descriptor);

/// The per-rank sizes `rule` gives an extent at a world size. FailedPrecondition when the
/// world cannot take it (an exact split that does not divide; sizes for another world);
/// InvalidArgument when the rule contradicts the extent (heads that do not divide it,
/// explicit sizes that do not sum to it).
Result<std::vector<Index>> SplitSizes(Index extent, int world_size, const SplitRule& rule);

/// The canonical param map of `descriptor` for a parameter of `shape` at `world_size`:
/// equal, byte for byte once serialised, to `Infer` on the shards the layout produces.
/// For padded_vocab, `shape` is the real (unpadded) shape: the map's logical shape is padded
/// and its valid_shape is `shape`.
/// \error FailedPrecondition  the layout does not fit: not the shape (dim outside it, parts
///                         that do not cover it, heads that do not divide it, counts whose
///                         products overflow) or not this world size (the message names the
///                         count that breaks and what would work).
/// \error InvalidArgument  a world size outside 1..65536 or a negative extent.
Result<ParamMap> BuildMap(const LayoutDescriptor& descriptor, const Shape& shape, int world_size);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_DESCRIPTOR_H_
