// Mixture-of-experts layouts (DESIGN.md 17): where the experts of a layer live over the
// expert-parallel (EP) ranks, and the maps of per-expert checkpoint tensors into the stacked
// rank tensors (buffers, DESIGN.md 16) that frameworks compute with.
//
// A placement says, for each EP rank, which experts its buffers hold and in which order (the
// buffer's first dimension, "slots"). The families engines use:
//   contiguous   rank k holds experts [k·E/p, (k+1)·E/p) (transformers, Megatron); p | E
//   linear       the same, but the first E mod p ranks take one more expert (vLLM)
//   round_robin  rank k holds experts k, k+p, k+2p, ... (vLLM)
//   explicit     any list per rank: uneven, non-contiguous, empty ranks, and an expert on
//                several ranks (redundant experts, as EPLB makes: one logical expert, several
//                physical copies, which the maps say with multi-holder pieces). DeepSpeed AutoEP
//                placement descriptors read and write this form.
//
// Inside a rank, expert tensor parallelism (expert TP) splits each expert's tensors over `tp`
// ranks; the world is ep × tp ranks, ordered by a RankOrder (Megatron's order puts tp fastest:
// global rank = ep_rank · tp + tp_rank).
#ifndef RESHARD_LAYOUTS_EXPERTS_H_
#define RESHARD_LAYOUTS_EXPERTS_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/buffer_set.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// Where one copy of an expert lives: an EP rank and the expert's slot in that rank's buffers.
struct ExpertSlot {
  int rank = 0;
  Index slot = 0;
};

/// Which experts each EP rank holds, in slot order.
struct ExpertPlacement {
  int num_experts = 0;
  /// experts[k]: the experts EP rank k holds, in the order of its buffers' first dimension.
  std::vector<std::vector<int>> experts;

  int ep_size() const { return static_cast<int>(experts.size()); }
  /// The EP ranks holding expert `e`, ascending.
  std::vector<int> HoldersOf(int e) const;
  /// For every expert 0..E-1, the copies of it by ascending EP rank, in one pass over the
  /// placement (HoldersOf for every expert would cost E x the placement). Requires Validate().
  std::vector<std::vector<ExpertSlot>> SlotsByExpert() const;
  /// Every expert 0..E-1 on at least one rank, none outside that range, none twice on one rank,
  /// at least one rank. InvalidArgument naming the rank and the expert otherwise.
  Status Validate() const;
  friend bool operator==(const ExpertPlacement&, const ExpertPlacement&) = default;
};

/// Rank k holds [k·E/p, (k+1)·E/p). InvalidArgument unless p divides E (transformers and
/// Megatron refuse other counts; `LinearExperts` is the uneven form).
Result<ExpertPlacement> ContiguousExperts(int num_experts, int ep_size);
/// vLLM's "linear": contiguous blocks, the first E mod p ranks one expert more.
Result<ExpertPlacement> LinearExperts(int num_experts, int ep_size);
/// vLLM's "round_robin": expert e on rank e mod p.
Result<ExpertPlacement> RoundRobinExperts(int num_experts, int ep_size);
/// A placement family by name: "contiguous", "linear" or "round_robin".
Result<ExpertPlacement> ExpertsByFamily(std::string_view family, int num_experts, int ep_size);

/// DeepSpeed AutoEP placement descriptors:
///   {"version": 1, "num_experts": E, "ep_size": p,
///    "ranks": [{"rank": k, "experts": [e, ...]}, ...]}
/// every rank 0..p-1 listed once (an empty list for a rank that holds none). Strict: unknown
/// version, a missing or repeated rank, an expert out of range or twice on a rank, an expert
/// on no rank are InvalidArgument with the JSON path.
Result<ExpertPlacement> ParseExpertPlacementJson(std::string_view text);
std::string ExpertPlacementToJson(const ExpertPlacement& placement);

/// How EP, expert-TP and expert-DP ranks make the world's ranks.
struct RankOrder {
  int ep = 1;
  int tp = 1;
  /// true: global rank = (dp_rank · ep + ep_rank) · tp + tp_rank — Megatron's order (tp, cp, ep,
  /// dp, pp) with context and pipeline parallelism 1: tp fastest, then ep, then dp;
  /// false: (dp_rank · tp + tp_rank) · ep + ep_rank.
  bool tp_fastest = true;
  /// Expert data parallelism: `dp` replicas of the whole EP x TP layout, every expert slice
  /// held by one rank of each replica (its pieces' locations name all of them).
  int dp = 1;
  int world() const { return ep * tp * dp; }
  Rank Of(int ep_rank, int tp_rank, int dp_rank = 0) const {
    return tp_fastest ? (dp_rank * ep + ep_rank) * tp + tp_rank
                      : (dp_rank * tp + tp_rank) * ep + ep_rank;
  }
};

/// One per-expert tensor kind stacked into a buffer, e.g. "gate_proj.weight" [I, H] in
/// `gate_up_proj` [E_local, 2I, H] (with "up_proj.weight" after it along `fused_dim`).
struct ExpertMember {
  /// The checkpoint tensor of expert e: `name` with "{e}" replaced by e.
  std::string name;
  /// Shape of one expert's tensor.
  Shape shape;
  /// The dimension of `shape` expert TP splits (evenly, tp | extent); -1 when not split.
  int split_dim = -1;
  /// The buffer's inner dimension (0-based, excluding the expert dimension) along which the
  /// members are concatenated in order. Members must agree on it.
  int fused_dim = 0;
  /// Transposed into the buffer: the buffer's inner dims are this member's dims in this order
  /// (empty: identity). gpt-oss-style [H, 2I] buffers of [I, H] tensors use {1, 0}.
  std::vector<int> permutation;
};

/// A stacked expert buffer and the maps of its members.
struct StackedExpertMaps {
  BufferDecl buffer;
  std::vector<std::pair<std::string, ParamMap>> maps;  // per member, per expert
};

/// The buffer `buffer_name` on every rank of `order` ([len(experts on the rank's EP rank),
/// inner...]) and the maps of every member of every expert into it. An expert's slice on a
/// (ep, tp) rank is its `split_dim` block tp_rank of tp (whole when not split); its pieces'
/// locations are every rank holding that same slice (an expert placed on several EP ranks
/// is replicated there; so is every expert-DP replica). Members are concatenated along
/// `fused_dim` in order (a checkpoint that already stores them fused, such as gpt-oss' gate/up
/// interleaved on the last dim, keeps its fused tensor as its F and needs no buffer).
Result<StackedExpertMaps> BuildStackedExpertMaps(std::string buffer_name, DType dtype,
                                                 const std::vector<ExpertMember>& members,
                                                 const ExpertPlacement& placement,
                                                 const RankOrder& order);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_EXPERTS_H_
