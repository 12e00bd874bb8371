// JSON forms of expert layouts (docs/layouts.md, "Mixture of experts"): the placement of a
// layer's experts over the EP ranks, and the "stacked experts" descriptor that lays per-expert
// checkpoint tensors out into a stacked buffer at any world size (layouts/experts.h).
//
// A placement is a family, which holds at any EP size,
//   {"family": "contiguous" | "linear" | "round_robin", "num_experts": E}
// or a DeepSpeed AutoEP placement descriptor, which fixes the EP size,
//   {"version": 1, "num_experts": E, "ep_size": p, "ranks": [{"rank": k, "experts": [...]}]}
//
// A stacked-experts descriptor:
//   {"family": "stacked_experts", "buffer": "model.layers.0.mlp.experts.gate_up_proj",
//    "dtype": "BF16",
//    "members": [{"name": "model.layers.0.mlp.experts.{e}.gate_proj.weight", "shape": [I, H],
//                 "split_dim": 0, "permutation": [0, 1]?}, ...],
//    "fused_dim": 0, "placement": <placement>, "tp": 1, "dp": 1, "rank_order": "tp_fastest"}
// laid out at a world of ep × tp × dp ranks: expert TP `tp` splits each member along its
// `split_dim`, `dp` replicates the whole EP x TP layout (expert data parallelism), and the rank
// order (layouts/experts.h RankOrder) puts tp fastest (Megatron's (tp, cp, ep, dp, pp) with
// cp = pp = 1: rank = (dp_rank · ep + ep_rank) · tp + tp_rank) or EP fastest
// ((dp_rank · tp + tp_rank) · ep + ep_rank).
//
// Reading is strict: unknown keys, a key of the other placement form, wrong types, a member
// name without "{e}", a dimension outside the member's shape, an AutoEP descriptor that misses
// an expert or names one twice on a rank are InvalidArgument with the JSON path (exit 2).
// A world the descriptor cannot take (not a multiple of tp × dp, an EP size that does not
// divide the experts of a contiguous placement, not the ep_size of an AutoEP descriptor
// times tp × dp, a split the expert TP does not divide) is FailedPrecondition (exit 1).
#ifndef RESHARD_LAYOUTS_EXPERTS_JSON_H_
#define RESHARD_LAYOUTS_EXPERTS_JSON_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/result.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/experts.h"

namespace reshard {

/// A placement as a family (any EP size) or an explicit AutoEP placement (its own EP size).
struct ExpertPlacementSpec {
  std::string family;  // "contiguous", "linear", "round_robin"; empty: `explicit_placement`
  int num_experts = 0;
  std::optional<ExpertPlacement> explicit_placement;

  /// The placement at `ep_size` EP ranks. FailedPrecondition when the family cannot take it,
  /// or it is not the explicit placement's EP size.
  Result<ExpertPlacement> At(int ep_size) const;
  friend bool operator==(const ExpertPlacementSpec&, const ExpertPlacementSpec&) = default;
};

/// Either JSON form of a placement. InvalidArgument with the JSON path for malformed input.
Result<ExpertPlacementSpec> ParseExpertPlacementSpecJson(std::string_view text);
/// One line for a family, ExpertPlacementToJson for an explicit placement; reads back equal.
std::string ExpertPlacementSpecToJson(const ExpertPlacementSpec& spec);

/// A stacked-experts layout: per-expert tensors stacked into one buffer (layouts/experts.h).
struct StackedExpertsDescriptor {
  std::string buffer;
  DType dtype = DType::kBF16;
  /// Each member's `fused_dim` is the descriptor's.
  std::vector<ExpertMember> members;
  int fused_dim = 0;
  ExpertPlacementSpec placement;
  int tp = 1;
  int dp = 1;
  bool tp_fastest = true;
};
bool operator==(const StackedExpertsDescriptor& a, const StackedExpertsDescriptor& b);

/// True when `text` is a JSON object whose "family" is "stacked_experts", or an array of
/// them (how `reshard layout` tells these from single-parameter descriptors).
bool IsStackedExpertsJson(std::string_view text);

/// One descriptor (an object), or several (an array: one document of several buffers, e.g. a
/// layer's gate_up_proj and down_proj). InvalidArgument with the JSON path.
Result<std::vector<StackedExpertsDescriptor>> ParseStackedExpertsJson(std::string_view text);
/// Deterministic JSON of one descriptor (every key written); reads back equal.
std::string StackedExpertsToJson(const StackedExpertsDescriptor& d);

/// The version-2 map document (maps and buffers, validated) of the descriptors at `world`
/// ranks. FailedPrecondition naming the buffer when the world does not fit; InvalidArgument
/// when buffer or tensor names collide between descriptors.
Result<MapDocument> BuildStackedExpertsDocument(const std::vector<StackedExpertsDescriptor>& ds,
                                                int world);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_EXPERTS_JSON_H_
