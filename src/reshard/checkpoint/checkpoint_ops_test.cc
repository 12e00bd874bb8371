#include "reshard/checkpoint/checkpoint_ops.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace reshard {
namespace {

LayoutDescriptor Layout(std::string_view json) {
  Result<LayoutDescriptor> d = ParseLayoutJson(json);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return *d;
}

const char kPreDivided[] = R"({"family": "replicated", "pre_divided": true})";
const char kReplicated[] = R"({"family": "replicated"})";

double ScaleOf(const ResolvedMap& m) { return m.provided.map.rank(0).pieces.at(0).scale; }

TEST(ResolveMapTest, OptimizerStateTakesItsParametersLayoutThroughADefault) {
  // Only a default: the moments take it as their parameter's, with their scale powers.
  const MapProvider star = MapsFromLayouts({{"*", Layout(kPreDivided)}}, 4);
  for (auto [name, power] :
       {std::pair{"b", 1}, std::pair{"b.exp_avg", -1}, std::pair{"b.exp_avg_sq", -2}}) {
    Result<ResolvedMap> m = ResolveMap(star, name, {8});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->scale_power, power) << name;
    EXPECT_EQ(ScaleOf(*m), 0.25) << name;
  }
}

TEST(ResolveMapTest, OptimizerStateTakesItsParametersLayoutBeforeTheDefault) {
  const MapProvider maps =
      MapsFromLayouts({{"b", Layout(kPreDivided)}, {"*", Layout(kReplicated)}}, 4);
  Result<ResolvedMap> m = ResolveMap(maps, "b.exp_avg", {8});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->scale_power, -1);
  EXPECT_EQ(ScaleOf(*m), 0.25);
  ASSERT_TRUE(m->provided.layout.has_value());
  EXPECT_TRUE(m->provided.layout->pre_divided);
  // Other tensors take the default at scale power 1.
  m = ResolveMap(maps, "w", {8});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->scale_power, 1);
  EXPECT_EQ(ScaleOf(*m), 1.0);
}

TEST(ResolveMapTest, OptimizerStateWithoutAParameterLayoutKeepsItsScalePower) {
  // No layout for "b" and no default: the moment's own entry, still at scale power -2.
  const MapProvider maps = MapsFromLayouts({{"b.exp_avg_sq", Layout(kPreDivided)}}, 2);
  Result<ResolvedMap> m = ResolveMap(maps, "b.exp_avg_sq", {8});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->scale_power, -2);
  EXPECT_EQ(ResolveMap(maps, "c.exp_avg", {8}).status().code(), StatusCode::kNotFound);
  // A name that is only the suffix is no optimizer state.
  EXPECT_EQ(ResolveMap(maps, ".exp_avg", {8}).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace reshard
