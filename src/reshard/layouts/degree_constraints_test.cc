#include "reshard/layouts/degree_constraints.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

const std::vector<DegreeConstraint> kQwen2 = {
    {"layers.*.self_attn.q_proj", "colwise", 14, "attention heads"},
    {"layers.*.self_attn.k_proj", "colwise", 2, "key/value heads"},
    {"layers.*.mlp.up_proj", "colwise", 4864, "intermediate features"},
};

TEST(DegreeConstraintsTest, WorkingDegreesDivideEveryCount) {
  EXPECT_EQ(WorkingDegrees(kQwen2), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(WorkingDegrees({}), (std::vector<int64_t>{1}));
}

TEST(DegreeConstraintsTest, FirstBrokenConstraintNamesModuleCountAndMeaning) {
  EXPECT_EQ(FirstBrokenConstraint(kQwen2, 2), std::nullopt);
  EXPECT_EQ(FirstBrokenConstraint(kQwen2, 4),
            "layers.*.self_attn.q_proj (colwise) splits 14 attention heads; 4 does not divide 14");
  EXPECT_EQ(FirstBrokenConstraint(kQwen2, 7),
            "layers.*.self_attn.k_proj (colwise) splits 2 key/value heads; 7 does not divide 2");
}

TEST(DegreeConstraintsTest, RefusalSaysWhatWorksInstead) {
  const std::string message =
      DegreeRefusalMessage(kQwen2, 8, TransformersBrokenDegreeConsequence(8));
  EXPECT_NE(message.find("14 attention heads; 8 does not divide 14. At tp 8 transformers"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("No degree >= 8 works (the largest is 2)"), std::string::npos) << message;
  EXPECT_EQ(DegreeRefusalMessage(kQwen2, 2, "x"), "");
  std::vector<DegreeConstraint> heads9 = {{"q", "colwise", 9, "attention heads"}};
  EXPECT_NE(DegreeRefusalMessage(heads9, 2, "x")
                .find("The smallest degree >= 2 that works is 3 "
                      "(working degrees: 1, 3, 9)."),
            std::string::npos);
}

TEST(DegreeConstraintsTest, ReplicateAboveAllowsMultiples) {
  DegreeConstraint kv{"k_proj", "colwise", 2, "key/value heads", true};
  EXPECT_TRUE(kv.Allows(1));
  EXPECT_TRUE(kv.Allows(8));
  EXPECT_FALSE(kv.Allows(3));
  EXPECT_FALSE(kv.Allows(0));
}

}  // namespace
}  // namespace reshard
