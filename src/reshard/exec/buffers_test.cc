// Plans between buffers (DESIGN.md 16): per-expert tensors stacked in rank buffers at one
// expert-parallel topology, moved to another by composing each tensor's maps and executing
// the plans buffer to buffer. The result must equal extracting the target maps from each F,
// bit for bit, and F is never built.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "reshard/exec/executor.h"
#include "reshard/ir/compose.h"
#include "reshard/ir/random_map.h"
#include "reshard/layouts/experts.h"

namespace reshard {
namespace {

using Buffers = std::vector<std::vector<float>>;  // per rank

// Every map of `s` extracted from its F into fresh (NaN-filled, so a gap would show) buffers.
Buffers ExtractInto(const StackedExpertMaps& s,
                    const std::map<std::string, std::vector<float>>& f) {
  Buffers out;
  for (const BufferRank& r : s.buffer.ranks) {
    out.emplace_back(static_cast<size_t>(ProductOf(r.shape)), std::nanf(""));
  }
  for (const auto& [name, map] : s.maps) {
    for (Rank r = 0; r < map.world_size(); ++r) {
      auto& b = out[static_cast<size_t>(r)];
      const Status st =
          Extract(map, DType::kF32, r,
                  {reinterpret_cast<const std::byte*>(f.at(name).data()), map.num_elements()},
                  {reinterpret_cast<std::byte*>(b.data()), static_cast<Index>(b.size())});
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  }
  return out;
}

ExpertPlacement RandomPlacement(std::mt19937_64& rng, int experts, int ep) {
  switch (rng() % 4) {
    case 0:
      return *LinearExperts(experts, ep);
    case 1:
      return *RoundRobinExperts(experts, ep);
    default: {
      ExpertPlacement p{experts, std::vector<std::vector<int>>(static_cast<size_t>(ep))};
      for (int e = 0; e < experts; ++e) {
        const int k = static_cast<int>(rng() % static_cast<unsigned>(ep));
        p.experts[static_cast<size_t>(k)].push_back(e);
        const int k2 = static_cast<int>(rng() % static_cast<unsigned>(ep));
        if (k2 != k && rng() % 3 == 0) p.experts[static_cast<size_t>(k2)].push_back(e);
      }
      for (auto& list : p.experts) std::shuffle(list.begin(), list.end(), rng);
      return p;
    }
  }
}

TEST(BufferPlanTest, ExpertTopologiesConvertBufferToBuffer) {
  for (uint64_t seed : PropertyTestSeeds(60)) {
    SCOPED_TRACE(testing::Message() << "replay with RESHARD_SEED=" << seed);
    std::mt19937_64 rng(seed);
    const int experts = 1 + static_cast<int>(rng() % 8);
    const Index inter = 4, hidden = 3;
    const std::vector<ExpertMember> members = {{"e.{e}.gate", {inter, hidden}, 0, 0, {}},
                                               {"e.{e}.up", {inter, hidden}, 0, 0, {}}};
    auto topology = [&] {
      const int ep = 1 + static_cast<int>(rng() % 4);
      const int tp = 1 << (rng() % 3);  // 1, 2, 4: divides the intermediate size
      Result<StackedExpertMaps> s =
          BuildStackedExpertMaps("gate_up", DType::kF32, members, RandomPlacement(rng, experts, ep),
                                 RankOrder{ep, tp, rng() % 2 == 0});
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      return *s;
    };
    const StackedExpertMaps a = topology();
    const StackedExpertMaps b = topology();
    std::map<std::string, std::vector<float>> full;
    for (const auto& [name, map] : a.maps) {
      auto& f = full[name];
      for (Index i = 0; i < map.num_elements(); ++i) f.push_back(static_cast<float>(rng() % 1000));
    }
    const Buffers source = ExtractInto(a, full);
    const Buffers want = ExtractInto(b, full);
    Buffers got;
    for (const BufferRank& r : b.buffer.ranks) {
      got.emplace_back(static_cast<size_t>(ProductOf(r.shape)), std::nanf(""));
    }
    std::vector<ConstBuffer> src;
    for (const auto& s : source) {
      src.push_back({reinterpret_cast<const std::byte*>(s.data()), static_cast<Index>(s.size())});
    }
    std::vector<MutableBuffer> dst;
    for (auto& s : got) {
      dst.push_back({reinterpret_cast<std::byte*>(s.data()), static_cast<Index>(s.size())});
    }
    for (size_t i = 0; i < a.maps.size(); ++i) {
      ASSERT_EQ(a.maps[i].first, b.maps[i].first);
      Result<ParamPlan> plan = Compose(b.maps[i].second, a.maps[i].second);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      for (const Move& m : plan->moves) {
        ASSERT_EQ(plan->src_buffer(m), "gate_up");
        ASSERT_EQ(plan->dst_buffer(m), "gate_up");
      }
      const Status st = ExecutePlan(*plan, DType::kF32, src, dst);
      ASSERT_TRUE(st.ok()) << st.ToString();
      // Rebuild from the buffers gives F back; replicas agree.
      std::vector<float> f(full.at(a.maps[i].first).size());
      ASSERT_TRUE(Rebuild(a.maps[i].second, DType::kF32, src,
                          {reinterpret_cast<std::byte*>(f.data()), static_cast<Index>(f.size())})
                      .ok());
      ASSERT_EQ(f, full.at(a.maps[i].first));
    }
    for (size_t r = 0; r < got.size(); ++r) {
      ASSERT_EQ(got[r].size(), want[r].size());
      if (got[r].empty()) continue;  // a rank holding no expert
      ASSERT_EQ(std::memcmp(got[r].data(), want[r].data(), got[r].size() * sizeof(float)), 0)
          << "target rank " << r;
    }
  }
}

}  // namespace
}  // namespace reshard
