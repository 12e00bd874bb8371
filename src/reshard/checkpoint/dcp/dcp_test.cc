#include "reshard/checkpoint/dcp/dcp.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "reshard/exec/executor.h"
#include "reshard/io/pickle.h"

namespace reshard {
namespace {

DcpChunk Box(Shape offsets, Shape sizes, Rank rank) {
  DcpChunk c;
  c.offsets = std::move(offsets);
  c.sizes = std::move(sizes);
  c.rank = rank;
  return c;
}

// Rebuilds F from shards filled with their own F offsets, through the map, and checks that
// every element lands where the chunk boxes say.
void ExpectRebuildsIdentity(const ParamMap& map, const std::vector<DcpChunk>& chunks) {
  const Shape& shape = map.logical_shape();
  const Shape strides = RowMajorStrides(shape);
  std::vector<std::vector<float>> shards(static_cast<size_t>(map.world_size()));
  for (const DcpChunk& c : chunks) {
    const Index n = ProductOf(c.sizes);
    for (Index k = 0; k < n; ++k) {
      const Shape local = UnravelIndex(k, c.sizes);
      Index flat = 0;
      for (size_t d = 0; d < shape.size(); ++d) flat += (c.offsets[d] + local[d]) * strides[d];
      shards[static_cast<size_t>(c.rank)].push_back(static_cast<float>(flat));
    }
  }
  std::vector<ConstBuffer> views;
  for (Rank r = 0; r < map.world_size(); ++r) {
    ASSERT_EQ(static_cast<Index>(shards[static_cast<size_t>(r)].size()), map.shard_num_elements(r));
    views.push_back({reinterpret_cast<const std::byte*>(shards[static_cast<size_t>(r)].data()),
                     map.shard_num_elements(r)});
  }
  std::vector<float> full(static_cast<size_t>(map.num_elements()), -1);
  ASSERT_TRUE(Rebuild(map, DType::kF32, views,
                      {reinterpret_cast<std::byte*>(full.data()), map.num_elements()})
                  .ok());
  for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(full[i], static_cast<float>(i)) << i;
}

TEST(DcpChunksToMap, TwoDimensionalMeshBoxes) {
  // A [10, 6] tensor as (Shard(0) over dp, Shard(1) over tp) on 2 x 2 ranks.
  const std::vector<DcpChunk> chunks = {Box({0, 0}, {5, 3}, 0), Box({0, 3}, {5, 3}, 1),
                                        Box({5, 0}, {5, 3}, 2), Box({5, 3}, {5, 3}, 3)};
  auto map = ChunksToMap("w", {10, 6}, chunks, 4);
  ASSERT_TRUE(map.ok()) << map.status().message();
  EXPECT_EQ(map->world_size(), 4);
  EXPECT_EQ(map->rank(1).shard_shape, Shape({15}));
  ASSERT_EQ(map->rank(1).pieces.size(), 1u);
  EXPECT_EQ(map->rank(1).pieces[0].source.offset, 3);
  EXPECT_EQ(map->rank(1).pieces[0].source.strides, Shape({6, 1}));
  ExpectRebuildsIdentity(*map, chunks);
}

TEST(DcpChunksToMap, UnevenLastChunkEmptyChunksAndSeveralChunksPerRank) {
  // 7 rows over 4 ranks (4, 3 then 2, 2 / 2, 1), an empty chunk, and rank 0 holding two boxes.
  const std::vector<DcpChunk> chunks = {Box({0, 0}, {2, 5}, 0), Box({2, 0}, {2, 5}, 1),
                                        Box({4, 0}, {2, 5}, 2), Box({6, 0}, {1, 5}, 0),
                                        Box({7, 0}, {0, 5}, 3)};
  auto map = ChunksToMap("q", {7, 5}, chunks, 4);
  ASSERT_TRUE(map.ok()) << map.status().message();
  EXPECT_EQ(map->shard_num_elements(0), 15);
  EXPECT_EQ(map->shard_num_elements(3), 0);
  ASSERT_EQ(map->rank(0).pieces.size(), 2u);
  EXPECT_EQ(map->rank(0).pieces[1].dest.offset, 10);
  ExpectRebuildsIdentity(*map, chunks);
}

// Splits the box [offsets, offsets + sizes) at random along random dims, at most `depth` times
// deep, into boxes (some empty), each given to a random rank.
void SplitAtRandom(std::mt19937& rng, Shape offsets, Shape sizes, int depth, int world,
                   std::vector<DcpChunk>& out) {
  std::uniform_int_distribution<int> coin(0, 3);
  if (depth == 0 || coin(rng) == 0) {
    out.push_back(Box(offsets, sizes, std::uniform_int_distribution<int>(0, world - 1)(rng)));
    return;
  }
  const size_t d = std::uniform_int_distribution<size_t>(0, sizes.size() - 1)(rng);
  const Index cut = std::uniform_int_distribution<Index>(0, sizes[d])(rng);
  Shape lo_sizes = sizes, hi_offsets = offsets, hi_sizes = sizes;
  lo_sizes[d] = cut;
  hi_offsets[d] += cut;
  hi_sizes[d] -= cut;
  SplitAtRandom(rng, offsets, lo_sizes, depth - 1, world, out);
  SplitAtRandom(rng, hi_offsets, hi_sizes, depth - 1, world, out);
}

TEST(DcpChunksToMap, RandomBoxPartitionsRebuildTheTensor) {
  // Any partition of F into boxes (empty ones, several per rank, ranks holding nothing) is a
  // valid map whose shards, the boxes row-major in order, rebuild F; removing a non-empty box
  // leaves a hole that is refused.
  std::mt19937 rng(20261201);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t dims = std::uniform_int_distribution<size_t>(1, 3)(rng);
    Shape shape;
    for (size_t d = 0; d < dims; ++d) {
      shape.push_back(std::uniform_int_distribution<Index>(1, 9)(rng));
    }
    const int world = std::uniform_int_distribution<int>(1, 5)(rng);
    std::vector<DcpChunk> chunks;
    SplitAtRandom(rng, Shape(shape.size(), 0), shape, 5, world, chunks);
    std::shuffle(chunks.begin(), chunks.end(), rng);
    auto map = ChunksToMap("w", shape, chunks, world);
    ASSERT_TRUE(map.ok()) << "trial " << trial << ": " << map.status().message();
    ExpectRebuildsIdentity(*map, chunks);  // each rank's shard: its boxes in the given order
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (ProductOf(chunks[i].sizes) == 0) continue;
      std::vector<DcpChunk> holed = chunks;
      holed.erase(holed.begin() + static_cast<std::ptrdiff_t>(i));
      EXPECT_FALSE(ChunksToMap("w", shape, holed, world).ok()) << "trial " << trial;
      break;
    }
  }
}

TEST(DcpChunksToMap, TheSameBoxFromSeveralRanksIsAReplica) {
  // Row 0..2 written by ranks 0 and 2 (replicated over dp), rows 2..4 by ranks 1 and 3.
  const std::vector<DcpChunk> chunks = {Box({0, 0}, {2, 3}, 0), Box({2, 0}, {2, 3}, 1),
                                        Box({0, 0}, {2, 3}, 2), Box({2, 0}, {2, 3}, 3)};
  auto map = ChunksToMap("r", {4, 3}, chunks, 4);
  ASSERT_TRUE(map.ok()) << map.status().message();
  EXPECT_EQ(map->rank(2).pieces[0].locations, std::vector<Rank>({0, 2}));
  EXPECT_EQ(map->rank(1).pieces[0].locations, std::vector<Rank>({1, 3}));
  const std::vector<DcpChunk> twice = {Box({0}, {4}, 0), Box({0}, {4}, 0)};
  auto s = ChunksToMap("t", {4}, twice, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("repeats chunk 0 on the same rank"), std::string::npos)
      << s.status().message();
}

TEST(DcpChunksToMap, ZeroDimensionalTensor) {
  const std::vector<DcpChunk> chunks = {Box({}, {}, 0)};
  auto map = ChunksToMap("scale", {}, chunks, 2);
  ASSERT_TRUE(map.ok()) << map.status().message();
  EXPECT_EQ(map->shard_num_elements(0), 1);
  EXPECT_EQ(map->shard_num_elements(1), 0);
  ExpectRebuildsIdentity(*map, chunks);
}

TEST(DcpChunksToMap, RefusesOverlapHolesAndBoxesOutside) {
  const std::vector<DcpChunk> overlap = {Box({0}, {6}, 0), Box({4}, {6}, 1)};
  auto s = ChunksToMap("b", {10}, overlap, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("overlaps chunk 0"), std::string::npos)
      << s.status().message();
  // The volumes add up to the tensor's, but two boxes overlap at (1, 1) and (2, 0) is a hole.
  const std::vector<DcpChunk> shifted = {Box({0, 0}, {2, 2}, 0), Box({1, 1}, {2, 2}, 1),
                                         Box({0, 2}, {1, 1}, 0), Box({0, 0}, {0, 0}, 0)};
  s = ChunksToMap("c", {3, 3}, shifted, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("overlaps"), std::string::npos) << s.status().message();
  const std::vector<DcpChunk> hole = {Box({0}, {4}, 0), Box({6}, {4}, 1)};
  s = ChunksToMap("h", {10}, hole, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("cover 8 of its 10"), std::string::npos)
      << s.status().message();
  const std::vector<DcpChunk> outside = {Box({0}, {11}, 0)};
  s = ChunksToMap("o", {10}, outside, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("runs past"), std::string::npos) << s.status().message();
  const std::vector<DcpChunk> dims = {Box({0, 0}, {10, 1}, 0)};
  EXPECT_FALSE(ChunksToMap("d", {10}, dims, 1).ok());
  const std::vector<DcpChunk> rank = {Box({0}, {10}, 5)};
  EXPECT_FALSE(ChunksToMap("r", {10}, rank, 2).ok());
}

std::vector<std::byte> ReadSeed(const std::string& name) {
  const char* root = std::getenv("RESHARD_SOURCE_DIR");
  std::ifstream in(std::string(root ? root : ".") + "/fuzz/corpus/dcp_metadata/" + name,
                   std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(chars.size());
  for (size_t i = 0; i < chars.size(); ++i) out[i] = static_cast<std::byte>(chars[i]);
  return out;
}

// `.metadata` files written by torch.distributed.checkpoint.save (DTensors on a 2 x 2 mesh).
TEST(DcpMetadata, ReadsTorchsMeshMetadata) {
  const auto bytes = ReadSeed("mesh.metadata");
  ASSERT_FALSE(bytes.empty());
  auto md = ParseDcpMetadata(bytes, "mesh.metadata");
  ASSERT_TRUE(md.ok()) << md.status().message();
  EXPECT_EQ(md->version, "1.0.0");
  const DcpTensor* embed = nullptr;
  const DcpTensor* exp_avg = nullptr;
  for (const DcpTensor& t : md->tensors) {
    if (t.fqn == "model.embed.weight") embed = &t;
    if (t.fqn == "optim.state.model.embed.weight.exp_avg") exp_avg = &t;
  }
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->shape, Shape({10, 6}));
  EXPECT_EQ(embed->dtype, DType::kF32);
  ASSERT_EQ(embed->chunks.size(), 4u);
  EXPECT_FALSE(embed->optimizer_state);
  ASSERT_NE(exp_avg, nullptr);
  EXPECT_TRUE(exp_avg->optimizer_state);
  EXPECT_EQ(exp_avg->path.front(), "optim");
  bool step = false;
  for (const DcpBytesItem& b : md->bytes_items) step |= b.fqn == "step";
  EXPECT_TRUE(step);
  for (const DcpTensor& t : md->tensors) {
    auto map = ChunksToMap(t.fqn, t.shape, t.chunks, 4);
    EXPECT_TRUE(map.ok()) << map.status().message();
  }
}

// Megatron-Core keeps every rank's SavePlan in the metadata (all_local_plans).
TEST(DcpMetadata, ReadsMegatronPlannerRecords) {
  auto md = ParseDcpMetadata(ReadSeed("megatron_plans.metadata"), "m");
  ASSERT_TRUE(md.ok()) << md.status().message();
  ASSERT_EQ(md->tensors.size(), 1u);
  EXPECT_EQ(md->tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(md->tensors[0].chunks[1].rank, 1);
  ASSERT_EQ(md->bytes_items.size(), 1u);
  EXPECT_EQ(md->bytes_items[0].location.offset, 100u);
}

// torch 2.0/2.1: TensorProperties from torch.distributed._shard, pickle protocol 2.
TEST(DcpMetadata, ReadsOlderTorchsShardTensorProperties) {
  auto md = ParseDcpMetadata(ReadSeed("shard_properties.metadata"), "old");
  ASSERT_TRUE(md.ok()) << md.status().message();
  ASSERT_EQ(md->tensors.size(), 1u);
  EXPECT_EQ(md->tensors[0].dtype, DType::kF16);
  EXPECT_EQ(md->tensors[0].shape, Shape({3}));
  EXPECT_EQ(md->tensors[0].chunks[0].location.length, 10u);
}

TEST(DcpMetadata, RefusesGlobalsOutsideTheAllowlist) {
  const std::string evil =
      "\x80\x02"
      "cos\nsystem\n"
      "X\x02\x00\x00\x00id\x85R.";
  std::vector<std::byte> bytes(evil.size());
  for (size_t i = 0; i < evil.size(); ++i) bytes[i] = static_cast<std::byte>(evil[i]);
  auto md = ParseDcpMetadata(bytes, "evil.metadata");
  ASSERT_FALSE(md.ok());
  EXPECT_EQ(md.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(md.status().message().find("os.system"), std::string::npos);
  EXPECT_NE(md.status().message().find("evil.metadata"), std::string::npos);
  // The general allowlist stays as it was: DCP's records are allowed only here.
  EXPECT_FALSE(IsAllowedPickleGlobal("torch.distributed.checkpoint.metadata.Metadata"));
}

TEST(DcpMetadata, TruncatedMetadataIsDataLoss) {
  auto bytes = ReadSeed("mesh.metadata");
  bytes.resize(bytes.size() / 2);
  auto md = ParseDcpMetadata(bytes, "half.metadata");
  ASSERT_FALSE(md.ok());
  EXPECT_EQ(md.status().code(), StatusCode::kDataLoss);
}

TEST(DcpMetadata, OptimizerStateRule) {
  const std::vector<std::string> a = {"optim", "state", "w", "exp_avg"};
  const std::vector<std::string> b = {"optimizer", "state", "x"};
  const std::vector<std::string> c = {"model", "optim"};
  EXPECT_TRUE(IsDcpOptimizerState(a));
  EXPECT_TRUE(IsDcpOptimizerState(b));
  EXPECT_FALSE(IsDcpOptimizerState(c));
  const std::vector<std::string> flat = {"optimizer.state.w.exp_avg"};
  const std::vector<std::string> model = {"model.optimizer_head.weight"};
  EXPECT_TRUE(IsDcpOptimizerState(flat));
  EXPECT_FALSE(IsDcpOptimizerState(model));
}

}  // namespace
}  // namespace reshard
