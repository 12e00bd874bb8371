// Divisibility constraints a model's tensor-parallel plan puts on the degree.
//
// A plan that splits attention by head and the MLP by its intermediate size only works at a
// degree that divides those counts: 2 ranks cannot hold 9 heads. The degree planner derives
// the constraints from config.json (hf/degree.h); a sharded checkpoint scattered from a config
// records them in its manifest, so that a later conversion refuses the degrees the model cannot
// take, with the same words.
#ifndef RESHARD_LAYOUTS_DEGREE_CONSTRAINTS_H_
#define RESHARD_LAYOUTS_DEGREE_CONSTRAINTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace reshard {

/// One count the degree must divide: "layers.*.self_attn.k_proj (colwise) splits 2 key/value
/// heads".
struct DegreeConstraint {
  std::string module;   // the plan entry's module pattern
  std::string style;    // its parallel style
  int64_t count = 1;    // the count it splits (> 0)
  std::string meaning;  // what the count counts: "attention heads", "vocabulary entries", ...
  /// A degree that is a multiple of `count` works too (vLLM replicates key/value heads).
  bool replicate_above = false;

  bool Allows(int64_t degree) const;
  friend bool operator==(const DegreeConstraint&, const DegreeConstraint&) = default;
};

/// The first constraint `degree` breaks, phrased for a person:
/// "layers.*.self_attn.q_proj (colwise) splits 9 attention heads; 2 does not divide 9".
std::optional<std::string> FirstBrokenConstraint(const std::vector<DegreeConstraint>& constraints,
                                                 int64_t degree);

/// Every degree all constraints allow, ascending, up to the largest that divides every count
/// (1 is always among them; multiples allowed by `replicate_above` alone are not listed).
std::vector<int64_t> WorkingDegrees(const std::vector<DegreeConstraint>& constraints);

/// What transformers does at a degree that breaks a constraint.
std::string TransformersBrokenDegreeConsequence(int64_t degree);

/// The refusal of `degree`: the broken constraint, `consequence`, and the smallest working
/// degree at or above it (or that none is). Empty when no constraint is broken.
std::string DegreeRefusalMessage(const std::vector<DegreeConstraint>& constraints, int64_t degree,
                                 std::string_view consequence);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_DEGREE_CONSTRAINTS_H_
