// Megatron's fully_sharded_model_space optimizer layout, as a property: random Llama-style
// models whose every tensor is cut into random blocks (a TP grid: a divisor of each dim) and
// each block's flat elements into random flattened ranges (DP ranks' bucket pieces), written as
// a torch_dist checkpoint; the flattened ranges regrouped into each Hugging Face tensor's
// fp32 weight and moments must equal the tensor read from the model keys, and a range moved
// to overlap its neighbour or to leave a hole is refused, naming the checkpoint and the key.
// Seeds: PropertyTestSeeds (docs/development.md, "Property tests and seeds").
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "reshard/base/temp_dir_testing.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/dcp/dcp_writer.h"
#include "reshard/checkpoint/megatron/megatron.h"
#include "reshard/io/file.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/torch_writer.h"
#include "reshard/ir/random_map.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test_support::TempDir;

constexpr int kWorld = 4;

struct Model {
  Index layers, hidden, heads, groups, head_dim, ffn, vocab, padded;
  std::string ConfigJson() const {
    return fmt::format(
        R"({{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": {}, "hidden_size": {}, "num_attention_heads": {},
            "num_key_value_heads": {}, "head_dim": {}, "intermediate_size": {},
            "vocab_size": {}, "tie_word_embeddings": false, "torch_dtype": "float32"}})",
        layers, hidden, heads, groups, head_dim, ffn, vocab);
  }
  // Megatron's keys (stacked layers) and shapes.
  std::vector<std::pair<std::string, Shape>> Keys() const {
    const Index l = layers, h = hidden;
    return {{"embedding.word_embeddings.weight", {padded, h}},
            {"decoder.layers.self_attention.linear_qkv.layer_norm_weight", {l, h}},
            {"decoder.layers.self_attention.linear_qkv.weight",
             {l, (heads + 2 * groups) * head_dim, h}},
            {"decoder.layers.self_attention.linear_proj.weight", {l, h, heads * head_dim}},
            {"decoder.layers.mlp.linear_fc1.layer_norm_weight", {l, h}},
            {"decoder.layers.mlp.linear_fc1.weight", {l, 2 * ffn, h}},
            {"decoder.layers.mlp.linear_fc2.weight", {l, h, ffn}},
            {"decoder.final_layernorm.weight", {h}},
            {"output_layer.weight", {padded, h}}};
  }
};

Model RandomModel(std::mt19937_64& rng) {
  Model m{};
  m.layers = 1 + static_cast<Index>(rng() % 2);
  m.groups = 1 + static_cast<Index>(rng() % 2);
  m.heads = m.groups * (1 + static_cast<Index>(rng() % 2));
  m.head_dim = 2 * (1 + static_cast<Index>(rng() % 2));
  m.hidden = 2 + 2 * static_cast<Index>(rng() % 3);
  m.ffn = 2 + static_cast<Index>(rng() % 4);
  m.vocab = 5 + static_cast<Index>(rng() % 4);
  m.padded = m.vocab + static_cast<Index>(rng() % 3);
  return m;
}

// A random divisor of n.
Index Divisor(std::mt19937_64& rng, Index n) {
  std::vector<Index> d;
  for (Index k = 1; k <= n; ++k) {
    if (n % k == 0) d.push_back(k);
  }
  return d[rng() % d.size()];
}

// One stored box: its offsets and sizes in the stored tensor, its rank, and the model tensor's
// flat indices of its elements in order.
struct StoredChunk {
  DcpWriteChunk box;
  std::vector<Index> elements;
};

// The model tensor of `shape` cut into blocks (`counts` per dim), each block one chunk.
std::vector<StoredChunk> BlockChunks(std::mt19937_64& rng, const Shape& shape,
                                     const Shape& counts) {
  Shape block(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) block[d] = shape[d] / counts[d];
  std::vector<StoredChunk> out;
  for (Index b = 0; b < ProductOf(counts); ++b) {
    const Shape at = UnravelIndex(b, counts);
    StoredChunk c{{static_cast<Rank>(rng() % kWorld), Shape(shape.size()), block}, {}};
    for (size_t d = 0; d < shape.size(); ++d) c.box.offsets[d] = at[d] * block[d];
    for (Index k = 0; k < ProductOf(block); ++k) {
      const Shape local = UnravelIndex(k, block);
      Index flat = 0;
      for (size_t d = 0; d < shape.size(); ++d)
        flat = flat * shape[d] + c.box.offsets[d] + local[d];
      c.elements.push_back(flat);
    }
    out.push_back(std::move(c));
  }
  return out;
}

// The flattened layout of the same blocks ([counts..., ProductOf(block)]): each block's elements
// cut into 1 to 3 random ranges, each range a chunk [i..., a] + [1..., b]; with `bent` into two
// of at least 2 elements each (blocks of at least 4).
std::vector<StoredChunk> FlattenedChunks(std::mt19937_64& rng,
                                         const std::vector<StoredChunk>& blocks,
                                         const Shape& counts, bool bent) {
  std::vector<StoredChunk> out;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const Index n = static_cast<Index>(blocks[b].elements.size());
    std::vector<Index> cuts = {0, n};
    if (bent) {
      cuts.push_back(2 + static_cast<Index>(rng() % static_cast<uint64_t>(n - 3)));
    } else {
      const int extra = static_cast<int>(rng() % 3);
      for (int k = 0; k < extra && n > 1; ++k) {
        cuts.push_back(1 + static_cast<Index>(rng() % static_cast<uint64_t>(n - 1)));
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    const Shape at = UnravelIndex(static_cast<Index>(b), counts);
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      StoredChunk c;
      c.box.rank = static_cast<Rank>(rng() % kWorld);
      c.box.offsets = at;
      c.box.offsets.push_back(cuts[k]);
      c.box.sizes = Shape(counts.size(), 1);
      c.box.sizes.push_back(cuts[k + 1] - cuts[k]);
      c.elements.assign(blocks[b].elements.begin() + cuts[k],
                        blocks[b].elements.begin() + cuts[k + 1]);
      out.push_back(std::move(c));
    }
  }
  return out;
}

struct StoredTensor {
  std::string key;
  Shape shape;
  std::vector<StoredChunk> chunks;
  float base = 0, scale = 1;  // element at flat index g of its model tensor: (base + g) * scale
};

// Writes the tensors as a torch_dist checkpoint in `dir`: each chunk a torch.save item in its
// rank's file, .metadata and metadata.json.
void WriteCheckpoint(const fs::path& dir, const std::vector<StoredTensor>& tensors) {
  fs::create_directories(dir);
  std::vector<DcpTensorToWrite> planned;
  std::vector<std::vector<DcpWrittenItem>> items;
  std::vector<std::optional<AtomicFileWriter>> files(kWorld);
  std::vector<uint64_t> offsets(kWorld, 0);
  for (Rank r = 0; r < kWorld; ++r) {
    Result<AtomicFileWriter> w =
        AtomicFileWriter::Create((dir / DcpFileName(r)).string(), {.sync = false});
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    files[static_cast<size_t>(r)].emplace(*std::move(w));
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    const StoredTensor& s = tensors[t];
    DcpTensorToWrite p{t, s.key, {s.key}, DType::kF32, s.shape, {}, {false}};
    std::vector<DcpWrittenItem>& where = items.emplace_back();
    for (const StoredChunk& c : s.chunks) {
      p.chunks.push_back(c.box);
      TorchTreeBuilder b;
      const PickleNodeId root = b.Tensor(DType::kF32, c.box.sizes, [&](std::span<std::byte> out) {
        for (size_t k = 0; k < c.elements.size(); ++k) {
          const float v = (s.base + static_cast<float>(c.elements[k])) * s.scale;
          std::memcpy(out.data() + k * 4, &v, 4);
        }
        return Status::Ok();
      });
      const auto r = static_cast<size_t>(c.box.rank);
      Result<uint64_t> length = b.AppendTo(*files[r], root);
      ASSERT_TRUE(length.ok()) << length.status().ToString();
      where.push_back({DcpFileName(c.box.rank), offsets[r], *length});
      offsets[r] += *length;
    }
    planned.push_back(std::move(p));
  }
  for (auto& f : files) ASSERT_TRUE(f->Commit().ok());
  Result<std::string> metadata = DcpMetadataPickle(planned, items, dir.string());
  ASSERT_TRUE(metadata.ok()) << metadata.status().ToString();
  ASSERT_TRUE(WriteFileAtomically((dir / kDcpMetadataName).string(), *metadata).ok());
  ASSERT_TRUE(WriteFileAtomically((dir / "metadata.json").string(),
                                  R"({"sharded_backend": "torch_dist", )"
                                  R"("sharded_backend_version": 1})")
                  .ok());
}

// A random checkpoint of `m`: each model key as blocks, and its fp32 main weight and moments
// as flattened ranges of the same blocks (values: the weight's, times 1, 2 and 4). With
// `bent`, the key whose ranges a refusal case moves: one block, cut in two ranges.
std::vector<StoredTensor> RandomCheckpoint(std::mt19937_64& rng, const Model& m,
                                           const std::string& bent = "") {
  std::vector<StoredTensor> out;
  float base = 0;
  for (const auto& [key, shape] : m.Keys()) {
    Shape counts(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) {
      counts[d] = key == bent ? 1 : Divisor(rng, shape[d]);
    }
    std::vector<StoredChunk> blocks = BlockChunks(rng, shape, counts);
    Shape state_shape = counts;
    state_shape.push_back(static_cast<Index>(blocks[0].elements.size()));
    out.push_back({key, shape, blocks, base, 1});
    for (const auto& [state, scale] :
         {std::pair{"fp32_param", 1.0F}, {"exp_avg", 2.0F}, {"exp_avg_sq", 4.0F}}) {
      out.push_back({fmt::format("optimizer.state.{}.{}", state, key), state_shape,
                     FlattenedChunks(rng, blocks, counts, key == bent), base, scale});
    }
    base += 1000;
  }
  return out;
}

std::map<std::string, std::vector<float>> Gathered(ShardSource& source, const fs::path& out) {
  std::map<std::string, std::vector<float>> tensors;
  const Status s = GatherFrom(source, out.string(), {});
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (!s.ok()) return tensors;
  Result<SafetensorsFile> f = SafetensorsFile::Open((out / "model.safetensors").string());
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  for (const TensorInfo& t : f->header().tensors) {
    const std::span<const std::byte> bytes = f->data(t);
    std::vector<float>& v = tensors[t.name];
    v.resize(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
  }
  return tensors;
}

TEST(MegatronFlattenedRanges, RegroupedIntoEachParameterWhateverTheBlocksAndRanges) {
  for (const uint64_t seed : PropertyTestSeeds(25)) {
    SCOPED_TRACE(testing::Message() << "replay with RESHARD_SEED=" << seed);
    std::mt19937_64 rng(seed);
    const Model m = RandomModel(rng);
    TempDir tmp;
    const fs::path dir = tmp.path() / "ckpt";
    WriteCheckpoint(dir, RandomCheckpoint(rng, m));
    Result<std::unique_ptr<ShardSource>> source =
        OpenMegatronSource(dir.string(), {m.ConfigJson(), "", true});
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    const std::map<std::string, std::vector<float>> got = Gathered(**source, tmp.path() / "hf");
    int weights = 0;
    for (const auto& [name, values] : got) {
      if (name.ends_with(".fp32") || name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq")) {
        continue;
      }
      ++weights;
      for (const auto& [suffix, scale] :
           {std::pair{".fp32", 1.0F}, {".exp_avg", 2.0F}, {".exp_avg_sq", 4.0F}}) {
        const auto it = got.find(name + suffix);
        ASSERT_NE(it, got.end()) << name << suffix;
        ASSERT_EQ(it->second.size(), values.size()) << name << suffix;
        for (size_t k = 0; k < values.size(); ++k) {
          ASSERT_EQ(it->second[k], values[k] * scale) << name << suffix << " element " << k;
        }
      }
    }
    EXPECT_EQ(weights, 3 + 9 * static_cast<int>(m.layers)) << "tensors: " << got.size();
  }
}

TEST(MegatronFlattenedRanges, OverlapsAndHolesAreRefusedNamingTheKey) {
  for (const uint64_t seed : PropertyTestSeeds(20)) {
    SCOPED_TRACE(testing::Message() << "replay with RESHARD_SEED=" << seed);
    std::mt19937_64 rng(seed);
    const Model m = RandomModel(rng);
    const std::vector<std::pair<std::string, Shape>> keys = m.Keys();
    std::vector<std::string> big;  // keys of at least 4 elements
    for (const auto& [k, shape] : keys) {
      if (ProductOf(shape) >= 4) big.push_back(k);
    }
    const std::string model_key = big[rng() % big.size()];
    std::vector<StoredTensor> tensors = RandomCheckpoint(rng, m, model_key);
    const char* states[] = {"fp32_param", "exp_avg", "exp_avg_sq"};
    const std::string key = fmt::format("optimizer.state.{}.{}", states[rng() % 3], model_key);
    auto it = std::find_if(tensors.begin(), tensors.end(),
                           [&](const StoredTensor& t) { return t.key == key; });
    ASSERT_NE(it, tensors.end());
    // A range that starts inside a block, moved one element back (overlapping the range
    // before it) or forward (a hole between them).
    const bool overlap = rng() % 2 == 0;
    std::vector<size_t> inner;
    for (size_t c = 0; c < it->chunks.size(); ++c) {
      if (it->chunks[c].box.offsets.back() > 0 && it->chunks[c].box.sizes.back() > 1) {
        inner.push_back(c);
      }
    }
    ASSERT_FALSE(inner.empty());
    StoredChunk& c = it->chunks[inner[rng() % inner.size()]];
    const Index block = static_cast<Index>(it->shape.back());
    if (overlap) {
      // Index of the element before the range, in its block: the block's elements are
      // consecutive in the chunk's model indices only within a row, so take it from the
      // previous range of the same block, which ends where this one starts.
      const auto prev =
          std::find_if(it->chunks.begin(), it->chunks.end(), [&](const StoredChunk& p) {
            return std::equal(p.box.offsets.begin(), p.box.offsets.end() - 1,
                              c.box.offsets.begin()) &&
                   p.box.offsets.back() + p.box.sizes.back() == c.box.offsets.back();
          });
      ASSERT_NE(prev, it->chunks.end());
      c.elements.insert(c.elements.begin(), prev->elements.back());
      --c.box.offsets.back();
      ++c.box.sizes.back();
    } else {
      c.elements.erase(c.elements.begin());
      ++c.box.offsets.back();
      --c.box.sizes.back();
    }
    ASSERT_LE(c.box.offsets.back() + c.box.sizes.back(), block);
    TempDir tmp;
    const fs::path dir = tmp.path() / "ckpt";
    WriteCheckpoint(dir, tensors);
    Result<std::unique_ptr<ShardSource>> source =
        OpenMegatronSource(dir.string(), {m.ConfigJson(), "", true});
    Status s = source.status();
    const fs::path out = tmp.path() / "hf";
    if (s.ok()) s = GatherFrom(**source, out.string(), {});
    ASSERT_FALSE(s.ok()) << (overlap ? "overlap" : "hole") << " in " << key;
    EXPECT_NE(s.message().find(dir.string()), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find(key), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find(overlap ? "overlap" : "cover"), std::string::npos) << s.ToString();
    EXPECT_FALSE(fs::exists(out));
  }
}

}  // namespace
}  // namespace reshard
