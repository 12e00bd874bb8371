#include "reshard/checkpoint/megatron/megatron.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/megatron/regions.h"
#include "reshard/exec/executor.h"

namespace reshard {
namespace {

DcpChunk Box(Shape offsets, Shape sizes, Rank rank) {
  DcpChunk c;
  c.offsets = std::move(offsets);
  c.sizes = std::move(sizes);
  c.rank = rank;
  return c;
}

// A Megatron tensor of `shape` stored as `chunks` (DCP boxes) whose every element holds its own
// flat index; the region's HF tensor rebuilt from the ranks' shards through RegionPieces.
std::vector<float> RebuildRegion(const Shape& shape, const std::vector<DcpChunk>& chunks, int world,
                                 const TensorRegion& region, const Shape& hf_shape) {
  Result<ParamMap> kmap = ChunksToMap("m", shape, chunks, world);
  EXPECT_TRUE(kmap.ok()) << kmap.status().message();
  const Shape strides = RowMajorStrides(shape);
  std::vector<std::vector<float>> shards(static_cast<size_t>(world));
  ParamMapBuilder b;
  b.set_logical_shape(hf_shape);
  b.set_world_size(world);
  for (Rank r = 0; r < world; ++r) {
    auto& shard = shards[static_cast<size_t>(r)];
    shard.resize(static_cast<size_t>(kmap->shard_num_elements(r)));
    for (const Piece& p : kmap->rank(r).pieces) {
      const Shape off = UnravelIndex(p.source.offset, shape);
      for (Index k = 0; k < p.num_elements(); ++k) {
        const Shape local = UnravelIndex(k, p.shape);
        Index flat = 0;
        for (size_t d = 0; d < shape.size(); ++d) flat += (off[d] + local[d]) * strides[d];
        shard[static_cast<size_t>(p.dest.offset + k)] = static_cast<float>(flat);
      }
      for (Piece& piece : RegionPieces(region, off, p.shape, p.dest, r)) {
        b.add_piece(r, std::move(piece));
      }
    }
    b.set_buffer(r, "m");
    b.set_shard_shape(r, kmap->rank(r).shard_shape);
  }
  Result<ParamMap> map = b.Finalize();
  EXPECT_TRUE(map.ok()) << map.status().message();
  if (!map.ok()) return {};
  std::vector<ConstBuffer> views;
  for (const auto& s : shards) {
    views.push_back({reinterpret_cast<const std::byte*>(s.data()), static_cast<Index>(s.size())});
  }
  std::vector<float> out(static_cast<size_t>(ProductOf(hf_shape)));
  Status st = Rebuild(*map, DType::kF32, views,
                      {reinterpret_cast<std::byte*>(out.data()), static_cast<Index>(out.size())});
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

MegatronModelConfig Gqa(Index groups, Index per_group, Index d, Index hidden) {
  MegatronModelConfig c;
  c.layers = 2;
  c.hidden = hidden;
  c.heads = groups * per_group;
  c.kv_heads = groups;
  c.head_dim = d;
  c.ffn = 6;
  c.vocab = 10;
  return c;
}

// linear_qkv rows: for each group g, its n query heads, its key head, its value head. q_proj's
// head h = g * n + j, k_proj's and v_proj's head g.
Index QkvRow(const MegatronModelConfig& c, char which, Index head, Index i) {
  const Index n = c.heads / c.kv_heads;
  const Index group = which == 'q' ? head / n : head;
  const Index slot = which == 'q' ? head % n : (which == 'k' ? n : n + 1);
  return (group * (n + 2) + slot) * c.head_dim + i;
}

void ExpectQkvSplit(const MegatronModelConfig& c, const std::vector<DcpChunk>& chunks, int world) {
  const Index rows = (c.heads + 2 * c.kv_heads) * c.head_dim;
  const Shape shape = {rows, c.hidden};
  Result<MegatronKeyParts> parts =
      MegatronPartsOf(c, "decoder.layers.1.self_attention.linear_qkv.weight", shape);
  ASSERT_TRUE(parts.ok()) << parts.status().message();
  ASSERT_EQ(parts->parts.size(), 3u);
  const char which[] = {'q', 'k', 'v'};
  for (size_t p = 0; p < 3; ++p) {
    const MegatronPart& part = parts->parts[p];
    EXPECT_EQ(part.name, std::string("model.layers.1.self_attn.") + which[p] + "_proj.weight");
    const Index heads = which[p] == 'q' ? c.heads : c.kv_heads;
    ASSERT_EQ(part.shape, (Shape{heads * c.head_dim, c.hidden}));
    const std::vector<float> got = RebuildRegion(shape, chunks, world, part.region, part.shape);
    ASSERT_EQ(got.size(), static_cast<size_t>(heads * c.head_dim * c.hidden));
    for (Index h = 0; h < heads; ++h) {
      for (Index i = 0; i < c.head_dim; ++i) {
        for (Index col = 0; col < c.hidden; ++col) {
          const Index want = QkvRow(c, which[p], h, i) * c.hidden + col;
          ASSERT_EQ(got[static_cast<size_t>((h * c.head_dim + i) * c.hidden + col)], want)
              << which[p] << " head " << h << " row " << i << " col " << col;
        }
      }
    }
  }
}

TEST(MegatronQkv, GroupedQueryAttentionAtTensorParallelTwo) {
  // 2 groups of 4 query heads, head_dim 3: TP 2 holds one group's 18 rows per rank.
  const MegatronModelConfig c = Gqa(2, 4, 3, 5);
  ExpectQkvSplit(c, {Box({0, 0}, {18, 5}, 0), Box({18, 0}, {18, 5}, 1)}, 2);
}

TEST(MegatronQkv, ChunksAcrossGroupBoundariesAndColumns) {
  // Row ranges that cut heads and groups (7 + 20 + 9 of 36 rows), and a column split: the
  // strided pieces of each chunk still land every element.
  const MegatronModelConfig c = Gqa(2, 4, 3, 4);
  ExpectQkvSplit(c,
                 {Box({0, 0}, {7, 4}, 0), Box({7, 0}, {20, 2}, 1), Box({7, 2}, {20, 2}, 2),
                  Box({27, 0}, {9, 4}, 0)},
                 3);
}

TEST(MegatronQkv, MultiHeadAttentionIsOneGroupPerHead) {
  const MegatronModelConfig c = Gqa(4, 1, 2, 3);
  ExpectQkvSplit(c, {Box({0, 0}, {12, 3}, 0), Box({12, 0}, {12, 3}, 1)}, 2);
}

TEST(MegatronQkv, PiecesAreOnePerGroupWithinAChunk) {
  // At TP 2 with 2 groups, each rank's chunk holds one group: q_proj gets one piece per rank,
  // its rows the group's 4 query heads (contiguous in both).
  const MegatronModelConfig c = Gqa(2, 4, 3, 5);
  Result<MegatronKeyParts> parts =
      MegatronPartsOf(c, "decoder.layers.0.self_attention.linear_qkv.weight", {36, 5});
  ASSERT_TRUE(parts.ok());
  const std::vector<Piece> pieces =
      RegionPieces(parts->parts[0].region, {18, 0}, {18, 5}, {0, {5, 1}}, 1);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].shape, (Shape{60}));
  EXPECT_EQ(pieces[0].source.offset, 60);  // q rows 12.. of q_proj [24, 5]
  EXPECT_EQ(pieces[0].dest.offset, 0);
}

TEST(MegatronMlp, StackedSwigluFc1SplitsIntoGateAndUp) {
  // [L=2, 2F=12, H=2], stored as Megatron's SwiGLU factory does at TP 2: rank t holds gate rows
  // [3t, 3t+3) and up rows [6+3t, 6+3t+3) of each layer.
  MegatronModelConfig c = Gqa(1, 1, 2, 2);
  c.ffn = 6;
  const Shape shape = {2, 12, 2};
  std::vector<DcpChunk> chunks;
  for (Index l = 0; l < 2; ++l) {
    for (Rank t = 0; t < 2; ++t) {
      chunks.push_back(Box({l, 3 * t, 0}, {1, 3, 2}, t));
      chunks.push_back(Box({l, 6 + 3 * t, 0}, {1, 3, 2}, t));
    }
  }
  Result<MegatronKeyParts> parts =
      MegatronPartsOf(c, "decoder.layers.mlp.linear_fc1.weight", shape);
  ASSERT_TRUE(parts.ok()) << parts.status().message();
  ASSERT_EQ(parts->parts.size(), 4u);
  for (size_t p = 0; p < 4; ++p) {
    const MegatronPart& part = parts->parts[p];
    const Index l = static_cast<Index>(p / 2);
    const bool up = p % 2 == 1;
    EXPECT_EQ(part.name, fmt::format("model.layers.{}.mlp.{}_proj.weight", l, up ? "up" : "gate"));
    EXPECT_EQ(part.shape, (Shape{6, 2}));
    const std::vector<float> got = RebuildRegion(shape, chunks, 2, part.region, part.shape);
    for (Index k = 0; k < 12; ++k) {
      EXPECT_EQ(got[static_cast<size_t>(k)], l * 24 + (up ? 12 : 0) + k) << part.name << " " << k;
    }
  }
}

TEST(MegatronNames, ExpertsStackedAndOnTheirOwnInEachFamily) {
  MegatronModelConfig c = Gqa(1, 1, 2, 4);
  c.experts = 2;
  c.moe_ffn = 3;
  c.model_type = "mixtral";
  Result<MegatronKeyParts> stacked =
      MegatronPartsOf(c, "decoder.layers.mlp.experts.experts.linear_fc2.weight", {2, 2, 4, 3});
  ASSERT_TRUE(stacked.ok()) << stacked.status().message();
  ASSERT_EQ(stacked->parts.size(), 4u);
  EXPECT_EQ(stacked->parts[3].name, "model.layers.1.block_sparse_moe.experts.1.w2.weight");
  EXPECT_EQ(stacked->parts[3].shape, (Shape{4, 3}));
  c.model_type = "qwen3_moe";
  Result<MegatronKeyParts> own =
      MegatronPartsOf(c, "decoder.layers.1.mlp.experts.experts.1.linear_fc1.weight", {6, 4});
  ASSERT_TRUE(own.ok()) << own.status().message();
  ASSERT_EQ(own->parts.size(), 2u);
  EXPECT_EQ(own->parts[0].name, "model.layers.1.mlp.experts.1.gate_proj.weight");
  EXPECT_EQ(own->parts[1].name, "model.layers.1.mlp.experts.1.up_proj.weight");
  Result<MegatronKeyParts> router =
      MegatronPartsOf(c, "decoder.layers.0.mlp.router.weight", {2, 4});
  ASSERT_TRUE(router.ok());
  EXPECT_EQ(router->parts[0].name, "model.layers.0.mlp.gate.weight");
}

TEST(MegatronNames, PaddedVocabularyAndTiedOutputLayer) {
  MegatronModelConfig c = Gqa(1, 1, 2, 4);
  Result<MegatronKeyParts> emb = MegatronPartsOf(c, "embedding.word_embeddings.weight", {16, 4});
  ASSERT_TRUE(emb.ok()) << emb.status().message();
  EXPECT_EQ(emb->parts[0].shape, (Shape{10, 4}));
  EXPECT_EQ(emb->padding_from, 10);
  c.tie_word_embeddings = true;
  Result<MegatronKeyParts> out = MegatronPartsOf(c, "output_layer.weight", {16, 4});
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE(out->skipped);
}

TEST(MegatronNames, RefusesWhatTheConfigDoesNotDescribe) {
  const MegatronModelConfig c = Gqa(2, 4, 3, 5);
  // 8 heads and 2 groups of head_dim 3 give 36 rows, not 48.
  Result<MegatronKeyParts> qkv =
      MegatronPartsOf(c, "decoder.layers.0.self_attention.linear_qkv.weight", {48, 5});
  ASSERT_FALSE(qkv.ok());
  EXPECT_EQ(qkv.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(qkv.status().message().find("num_key_value_heads"), std::string::npos)
      << qkv.status().message();
  Result<MegatronKeyParts> layers =
      MegatronPartsOf(c, "decoder.layers.self_attention.linear_proj.weight", {3, 5, 24});
  ASSERT_FALSE(layers.ok());
  EXPECT_NE(layers.status().message().find("num_hidden_layers"), std::string::npos);
  Result<MegatronKeyParts> beyond =
      MegatronPartsOf(c, "decoder.layers.2.self_attention.linear_proj.weight", {5, 24});
  ASSERT_FALSE(beyond.ok());
  Result<MegatronKeyParts> unknown =
      MegatronPartsOf(c, "decoder.layers.0.self_attention.linear_q_down_proj.weight", {5, 5});
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("name table"), std::string::npos);
}

TEST(MegatronConfig, DefaultsAndRefusals) {
  Result<MegatronModelConfig> c = ParseMegatronModelConfig(
      R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8,
          "num_attention_heads": 4, "intermediate_size": 12, "vocab_size": 30})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->kv_heads, 4);
  EXPECT_EQ(c->head_dim, 2);
  EXPECT_EQ(c->moe_ffn, 12);
  EXPECT_FALSE(c->tie_word_embeddings.has_value());
  Result<MegatronModelConfig> missing =
      ParseMegatronModelConfig(R"({"num_hidden_layers": 2})", "config.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("hidden_size"), std::string::npos);
  Result<MegatronModelConfig> groups = ParseMegatronModelConfig(
      R"({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 4,
          "num_key_value_heads": 3, "vocab_size": 30})",
      "config.json");
  ASSERT_FALSE(groups.ok());
}

TEST(MegatronRegions, RangeBoxesCoverTheRangeOnce) {
  // [5, 23) of a dim seen as [3, 2, 4] (24 elements).
  const auto boxes = RangeBoxes(5, 23, {3, 2, 4});
  Index covered = 0;
  std::vector<int> hits(24, 0);
  for (const auto& [off, size] : boxes) {
    for (Index a = 0; a < size[0]; ++a)
      for (Index b = 0; b < size[1]; ++b)
        for (Index c = 0; c < size[2]; ++c) {
          ++hits[static_cast<size_t>(((off[0] + a) * 2 + off[1] + b) * 4 + off[2] + c)];
          ++covered;
        }
  }
  EXPECT_EQ(covered, 18);
  for (Index k = 0; k < 24; ++k) EXPECT_EQ(hits[static_cast<size_t>(k)], k >= 5 && k < 23 ? 1 : 0);
  EXPECT_LE(boxes.size(), 5u);
}

// A live model: one layer (Llama, 4 heads in 2 groups of head_dim 2, hidden 8, ffn 6, vocab 10
// padded to 12) at TP 2, every tensor as its ShardedTensors give it: the SwiGLU fc1's gate and up
// boxes in one rank tensor, the norms held by both ranks (replicas).
std::vector<MegatronLiveShard> LiveLlamaAtTp2() {
  std::vector<MegatronLiveShard> out;
  const auto add = [&](std::string key, Shape shape, Rank rank, Shape offsets, Shape sizes,
                       std::string buffer, Index elements, Index at) {
    out.push_back({std::move(key), std::move(shape), DType::kF32, rank, std::move(offsets),
                   std::move(sizes), std::move(buffer), elements, at});
  };
  for (Rank r = 0; r < 2; ++r) {
    const Index k = r;  // the rank along the split dims
    add("embedding.word_embeddings.weight", {12, 8}, r, {6 * k, 0}, {6, 8},
        "embedding.word_embeddings.weight", 48, 0);
    add("output_layer.weight", {12, 8}, r, {6 * k, 0}, {6, 8}, "output_layer.weight", 48, 0);
    add("decoder.final_layernorm.weight", {8}, r, {0}, {8}, "decoder.final_layernorm.weight", 8, 0);
    const std::string l = "decoder.layers.0.";
    add("decoder.layers.self_attention.linear_qkv.layer_norm_weight", {1, 8}, r, {0, 0}, {1, 8},
        l + "input_layernorm.weight", 8, 0);
    add("decoder.layers.mlp.linear_fc1.layer_norm_weight", {1, 8}, r, {0, 0}, {1, 8},
        l + "pre_mlp_layernorm.weight", 8, 0);
    add("decoder.layers.self_attention.linear_qkv.weight", {1, 16, 8}, r, {0, 8 * k, 0}, {1, 8, 8},
        l + "self_attention.linear_qkv.weight", 64, 0);
    add("decoder.layers.self_attention.linear_proj.weight", {1, 8, 8}, r, {0, 0, 4 * k}, {1, 8, 4},
        l + "self_attention.linear_proj.weight", 32, 0);
    add("decoder.layers.mlp.linear_fc1.weight", {1, 12, 8}, r, {0, 3 * k, 0}, {1, 3, 8},
        l + "mlp.linear_fc1.weight", 48, 0);
    add("decoder.layers.mlp.linear_fc1.weight", {1, 12, 8}, r, {0, 6 + 3 * k, 0}, {1, 3, 8},
        l + "mlp.linear_fc1.weight", 48, 24);
    add("decoder.layers.mlp.linear_fc2.weight", {1, 8, 6}, r, {0, 0, 3 * k}, {1, 8, 3},
        l + "mlp.linear_fc2.weight", 24, 0);
  }
  return out;
}

MegatronModelConfig LiveLlamaConfig() {
  Result<MegatronModelConfig> c = ParseMegatronModelConfig(
      R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 6,
          "vocab_size": 10})",
      "config.json");
  EXPECT_TRUE(c.ok()) << c.status().message();
  return *c;
}

TEST(MegatronLive, RankTensorsAreBuffersOfTheHuggingFaceTensors) {
  const std::vector<MegatronLiveShard> shards = LiveLlamaAtTp2();
  Result<Manifest> m = MegatronLiveManifest(LiveLlamaConfig(), shards, 2, "the model");
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->params.size(), 12u);
  const auto find = [&](std::string_view name) -> const ParamMap& {
    for (const ShardedParam& p : m->params) {
      if (p.name == name) return p.map;
    }
    ADD_FAILURE() << name;
    return m->params[0].map;
  };
  // up_proj: rank 1 holds rows 3-5 at element 24 of its fc1 tensor.
  const ParamMap& up = find("model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(up.rank(1).buffer, "decoder.layers.0.mlp.linear_fc1.weight");
  ASSERT_EQ(up.rank(1).pieces.size(), 1u);
  EXPECT_EQ(up.rank(1).pieces[0].source.offset, 3 * 8);
  EXPECT_EQ(up.rank(1).pieces[0].dest.offset, 24);
  // The final norm: one piece both ranks hold.
  const ParamMap& norm = find("model.norm.weight");
  EXPECT_EQ(norm.rank(0).pieces[0].locations, (std::vector<Rank>{0, 1}));
  // Rows 10-11 of the vocabulary are padding of rank 1's tensors.
  const BufferDecl* embed = m->buffers.Find("embedding.word_embeddings.weight");
  ASSERT_NE(embed, nullptr);
  ASSERT_EQ(embed->ranks[1].padding.size(), 1u);
  EXPECT_EQ(embed->ranks[1].padding[0].view.offset, 4 * 8);
}

TEST(MegatronLive, RefusesShardsThatDisagreeOrDoNotFit) {
  std::vector<MegatronLiveShard> shards = LiveLlamaAtTp2();
  shards.back().shape = {1, 8, 8};  // rank 1's fc2 says another shape
  Result<Manifest> m = MegatronLiveManifest(LiveLlamaConfig(), shards, 2, "the model");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("\"decoder.layers.mlp.linear_fc2.weight\" is F32 [1, 8, 6] "
                                      "on rank 0 but F32 [1, 8, 8] on rank 1"),
            std::string::npos)
      << m.status().message();
  shards = LiveLlamaAtTp2();
  shards.back().buffer_offset = 1;  // past the end of its 24-element tensor
  m = MegatronLiveManifest(LiveLlamaConfig(), shards, 2, "the model");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("at element 1 of its 24-element tensor"), std::string::npos)
      << m.status().message();
  shards = LiveLlamaAtTp2();
  shards.pop_back();  // rank 1 without its half of fc2: down_proj is not whole
  shards.pop_back();
  shards.pop_back();  // nor its half of fc1
  m = MegatronLiveManifest(LiveLlamaConfig(), shards, 2, "the model");
  EXPECT_FALSE(m.ok());
}

}  // namespace
}  // namespace reshard
