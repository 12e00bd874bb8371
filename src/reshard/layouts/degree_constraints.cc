#include "reshard/layouts/degree_constraints.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace reshard {

bool DegreeConstraint::Allows(int64_t degree) const {
  if (degree < 1 || count < 1) return false;
  if (count % degree == 0) return true;
  return replicate_above && degree % count == 0;
}

std::optional<std::string> FirstBrokenConstraint(const std::vector<DegreeConstraint>& constraints,
                                                 int64_t degree) {
  for (const DegreeConstraint& c : constraints) {
    if (c.Allows(degree)) continue;
    if (c.replicate_above) {
      return fmt::format(
          "{} ({}) splits {} {}; vLLM splits them when the degree divides {} and replicates "
          "them when it is a multiple of {}: {} is neither",
          c.module, c.style, c.count, c.meaning, c.count, c.count, degree);
    }
    return fmt::format("{} ({}) splits {} {}; {} does not divide {}", c.module, c.style, c.count,
                       c.meaning, degree, c.count);
  }
  return std::nullopt;
}

std::vector<int64_t> WorkingDegrees(const std::vector<DegreeConstraint>& constraints) {
  int64_t g = 0;
  int64_t g_all = 0;
  for (const DegreeConstraint& c : constraints) {
    g_all = std::gcd(g_all, c.count);
    if (!c.replicate_above) g = std::gcd(g, c.count);
  }
  if (g == 0) g = g_all;
  if (g == 0) return {1};
  std::vector<int64_t> degrees;
  for (int64_t d = 1; d <= g / d; ++d) {
    if (g % d != 0) continue;
    for (int64_t c : {d, g / d}) {
      if (std::all_of(constraints.begin(), constraints.end(),
                      [&](const DegreeConstraint& k) { return k.Allows(c); }) &&
          std::find(degrees.begin(), degrees.end(), c) == degrees.end())
        degrees.push_back(c);
    }
  }
  std::sort(degrees.begin(), degrees.end());
  return degrees;
}

std::string TransformersBrokenDegreeConsequence(int64_t degree) {
  return fmt::format(
      "At tp {} transformers would load the weights and then fail in the first forward with a "
      "reshape error that does not mention tensor parallelism.",
      degree);
}

std::string DegreeRefusalMessage(const std::vector<DegreeConstraint>& constraints, int64_t degree,
                                 std::string_view consequence) {
  const std::optional<std::string> broken = FirstBrokenConstraint(constraints, degree);
  if (!broken) return "";
  const std::vector<int64_t> degrees = WorkingDegrees(constraints);
  const auto next =
      std::find_if(degrees.begin(), degrees.end(), [&](int64_t d) { return d >= degree; });
  const std::string after =
      next != degrees.end()
          ? fmt::format("The smallest degree >= {} that works is {} (working degrees: {}).", degree,
                        *next, fmt::join(degrees, ", "))
          : fmt::format(
                "No degree >= {} works (the largest is {}): spread the model another way "
                "(pipeline or expert parallelism), or use {} ranks for tensor parallelism.",
                degree, degrees.back(), degrees.back());
  return fmt::format("{}. {} {}", *broken, consequence, after);
}

}  // namespace reshard
