#include "reshard/ir/random_map.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>

namespace reshard {
namespace {

std::string Replay(uint64_t seed) {
  return "seed " + std::to_string(seed) + " (replay with RESHARD_SEED=" + std::to_string(seed) +
         ")";
}

bool IsPaddingIndex(const ParamMap& map, Index offset) {
  const Shape index = UnravelIndex(offset, map.logical_shape());
  for (size_t k = 0; k < index.size(); ++k) {
    if (index[k] >= map.valid_shape()[k]) return true;
  }
  return false;
}

// Checks DESIGN 2.1's data-free invariants element by element, independently of the box
// sweep in Finalize. Returns "" or the first violation.
std::string CheckByElements(const ParamMap& map) {
  // Exact shards.
  for (Rank r = 0; r < map.world_size(); ++r) {
    std::vector<int> writes(static_cast<size_t>(map.shard_num_elements(r)), 0);
    for (const Piece& p : map.rank(r).pieces) {
      ForEachPieceElement(p, [&](Index dst, Index) { ++writes[static_cast<size_t>(dst)]; });
    }
    for (size_t d = 0; d < writes.size(); ++d) {
      if (writes[d] != 1) {
        return "rank " + std::to_string(r) + " shard element " + std::to_string(d) + " written " +
               std::to_string(writes[d]) + " times";
      }
    }
  }
  // Holders, coverage, homogeneity.
  const auto n = static_cast<size_t>(map.num_elements());
  std::vector<std::vector<Rank>> holders(n);
  for (Rank r = 0; r < map.world_size(); ++r) {
    for (const Piece& p : map.rank(r).pieces) {
      ForEachPieceElement(
          p, [&](Index, Index src) { holders[static_cast<size_t>(src)].push_back(r); });
    }
  }
  for (size_t e = 0; e < n; ++e) {
    std::vector<Rank>& h = holders[e];
    if (std::adjacent_find(h.begin(), h.end()) != h.end()) {
      return "element " + std::to_string(e) + " held twice by one rank";
    }
    if (h.empty() && !IsPaddingIndex(map, static_cast<Index>(e))) {
      return "element " + std::to_string(e) + " is held by no rank";
    }
  }
  for (Rank r = 0; r < map.world_size(); ++r) {
    for (const Piece& p : map.rank(r).pieces) {
      std::string error;
      ForEachPieceElement(p, [&](Index, Index src) {
        if (error.empty() && holders[static_cast<size_t>(src)] != p.locations) {
          error = "rank " + std::to_string(r) +
                  ": a piece's locations differ from the holders "
                  "of element " +
                  std::to_string(src);
        }
      });
      if (!error.empty()) return error;
    }
  }
  return "";
}

TEST(RandomMapTest, EveryGeneratedMapPassesFinalizeAndTheElementOracle) {
  for (uint64_t seed : PropertyTestSeeds(3000)) {
    SCOPED_TRACE(Replay(seed));
    std::mt19937_64 rng(seed);
    Result<ParamMap> map = RandomParamMapBuilder(rng).Finalize();
    ASSERT_TRUE(map.ok()) << map.status().ToString();
    ASSERT_EQ(CheckByElements(*map), "");
  }
}

TEST(RandomMapTest, SameSeedGivesTheSameMap) {
  for (uint64_t seed : PropertyTestSeeds(50)) {
    SCOPED_TRACE(Replay(seed));
    std::mt19937_64 a(seed);
    std::mt19937_64 b(seed);
    EXPECT_EQ(RandomParamMap(a), RandomParamMap(b));
  }
}

TEST(RandomMapTest, OptionsTurnFeaturesOff) {
  RandomMapOptions options;
  options.padding = false;
  options.scales = false;
  options.replication = false;
  options.max_world = 3;
  options.max_dims = 2;
  for (uint64_t seed : PropertyTestSeeds(300)) {
    SCOPED_TRACE(Replay(seed));
    std::mt19937_64 rng(seed);
    const ParamMap map = RandomParamMap(rng, options);
    EXPECT_FALSE(map.has_padding());
    EXPECT_LE(map.world_size(), 3);
    EXPECT_LE(map.logical_shape().size(), 2u);
    for (const RankShard& shard : map.ranks()) {
      for (const Piece& p : shard.pieces) {
        EXPECT_EQ(p.scale, 1.0);
        EXPECT_EQ(p.locations.size(), 1u);
      }
    }
  }
}

// The generator is only useful if it reaches every feature the format has; count them over
// a fixed range of seeds (so the counts are reproducible) and require each to be common.
TEST(RandomMapTest, GeneratedMapsExerciseEveryFeature) {
  std::map<std::string, int> seen;
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    std::mt19937_64 rng(seed);
    const ParamMap map = RandomParamMap(rng);
    std::map<std::string, bool> has;
    has["dims=" + std::to_string(map.logical_shape().size())] = true;
    has["world>4"] = map.world_size() > 4;
    has["padding"] = map.has_padding();
    const auto offsets = ExpandSourceOffsets(map);
    std::vector<bool> held(static_cast<size_t>(map.num_elements()), false);
    for (const auto& shard : offsets) {
      for (Index src : shard) held[static_cast<size_t>(src)] = true;
    }
    has["unheld padding"] = std::find(held.begin(), held.end(), false) != held.end();
    for (const RankShard& shard : map.ranks()) {
      has["empty shard"] = has["empty shard"] || ProductOf(shard.shard_shape) == 0;
      has["several pieces"] = has["several pieces"] || shard.pieces.size() >= 3;
      for (const Piece& p : shard.pieces) {
        has["scaled"] = has["scaled"] || p.scale != 1.0;
        has["non-dyadic scale"] = has["non-dyadic scale"] || p.scale == 1.0 / 3.0;
        has["replicated"] = has["replicated"] || p.is_replicated();
        has["replicated on all"] =
            has["replicated on all"] ||
            (map.world_size() > 2 && p.locations.size() == static_cast<size_t>(map.world_size()));
        has["more dims than F"] =
            has["more dims than F"] || p.shape.size() > map.logical_shape().size();
        has["transposed or interleaved dest"] =
            has["transposed or interleaved dest"] || p.dest.strides != RowMajorStrides(p.shape);
        has["non-row-major source"] =
            has["non-row-major source"] ||
            !std::is_sorted(p.source.strides.rbegin(), p.source.strides.rend());
        has["empty piece"] = has["empty piece"] || p.num_elements() == 0;
      }
    }
    for (const auto& [name, yes] : has) seen[name] += yes ? 1 : 0;
  }
  for (const char* feature :
       {"dims=1", "dims=2", "dims=3", "dims=4", "world>4", "padding", "unheld padding",
        "empty shard", "several pieces", "scaled", "non-dyadic scale", "replicated",
        "replicated on all", "more dims than F", "transposed or interleaved dest",
        "non-row-major source", "empty piece"}) {
    EXPECT_GE(seen[feature], 10) << feature;
  }
}

TEST(RandomMapTest, ExpandSourceOffsetsOfARowSplit) {
  ParamMapBuilder b;
  b.set_logical_shape({4, 2});
  b.set_shard_shape(0, {2, 2}).add_piece(0, Piece{{2, 2}, {0, {2, 1}}, {0, {2, 1}}, {0}, 1.0});
  b.set_shard_shape(1, {2, 2}).add_piece(1, Piece{{2, 2}, {4, {1, 2}}, {0, {2, 1}}, {1}, 0.5});
  Result<ParamMap> map = b.Finalize();
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_EQ(ExpandSourceOffsets(*map),
            (std::vector<std::vector<Index>>{{0, 1, 2, 3}, {4, 6, 5, 7}}));
  EXPECT_EQ(ExpandScales(*map),
            (std::vector<std::vector<double>>{{1, 1, 1, 1}, {0.5, 0.5, 0.5, 0.5}}));
}

}  // namespace
}  // namespace reshard
