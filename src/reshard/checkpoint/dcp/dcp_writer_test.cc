#include "reshard/checkpoint/dcp/dcp_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "reshard/base/cpu_limit_testing.h"
#include "reshard/base/temp_dir_testing.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/io/file.h"
#include "reshard/io/pickle.h"
#include "reshard/io/torch_file.h"
#include "reshard/layouts/basic.h"

namespace reshard {
namespace {

using test_support::TempDir;

namespace fs = std::filesystem;

Shape Rows(const std::vector<DcpWriteChunk>& chunks) {
  Shape rows;
  for (const DcpWriteChunk& c : chunks) rows.push_back(c.sizes.at(0));
  return rows;
}

TEST(DcpShard0ChunksTest, CeilSizedChunksAsTorchChunkWithTrailingRanksEmpty) {
  // torch.chunk(5 rows, 4): chunks of 2, 2, 1 -- rank 3 holds nothing.
  std::vector<DcpWriteChunk> c = DcpShard0Chunks({5, 3}, 4);
  EXPECT_EQ(Rows(c), (Shape{2, 2, 1}));
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[2], (DcpWriteChunk{2, {4, 0}, {1, 3}}));
  EXPECT_EQ(Rows(DcpShard0Chunks({10, 3}, 4)), (Shape{3, 3, 3, 1}));
  EXPECT_EQ(Rows(DcpShard0Chunks({8}, 4)), (Shape{2, 2, 2, 2}));
  // dim 0 below the world size: one row on each of the first ranks.
  c = DcpShard0Chunks({2, 6}, 4);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[1], (DcpWriteChunk{1, {1, 0}, {1, 6}}));
  // 0-d and empty tensors: whole, on rank 0.
  EXPECT_EQ(DcpShard0Chunks({}, 4), (std::vector<DcpWriteChunk>{{0, {}, {}}}));
  EXPECT_EQ(DcpShard0Chunks({0, 5}, 4), (std::vector<DcpWriteChunk>{{0, {0, 0}, {0, 5}}}));
  EXPECT_EQ(DcpShard0Chunks({7, 2}, 1), (std::vector<DcpWriteChunk>{{0, {0, 0}, {7, 2}}}));
}

ShardedParam Param(std::string name, Shape shape) {
  Result<ParamMap> map = ReplicatedMap(shape, 1);
  EXPECT_TRUE(map.ok());
  return {std::move(name), DType::kF32, *map, std::nullopt, 1};
}

TEST(PlanDcpTensorsTest, OptimizerStateNestsUnderOptimStateOthersKeepTheirNames) {
  Manifest m;
  m.world_size = 1;
  for (const char* name : {"w", "w.exp_avg", "w.exp_avg_sq", "a.b", "a.b.fp32", "x.exp_avg"}) {
    m.params.push_back(Param(name, {4}));
  }
  Result<std::vector<DcpTensorToWrite>> t = PlanDcpTensors(m, 2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->size(), 6u);
  EXPECT_EQ((*t)[0].key, "w");
  EXPECT_EQ((*t)[0].path, (std::vector<std::string>{"w"}));
  EXPECT_EQ((*t)[1].key, "optim.state.w.exp_avg");
  EXPECT_EQ((*t)[1].path, (std::vector<std::string>{"optim", "state", "w", "exp_avg"}));
  EXPECT_EQ((*t)[2].key, "optim.state.w.exp_avg_sq");
  EXPECT_EQ((*t)[4].path, (std::vector<std::string>{"optim", "state", "a.b", "fp32"}));
  // No tensor "x": a name of its own.
  EXPECT_EQ((*t)[5].key, "x.exp_avg");
  EXPECT_EQ((*t)[5].path, (std::vector<std::string>{"x.exp_avg"}));
  EXPECT_EQ(Rows((*t)[0].chunks), (Shape{2, 2}));
}

TEST(PlanDcpTensorsTest, OnlyTheOptimizersStatesAreOptimizerState) {
  // "a.b" beside "a" is a model's tensor: only exp_avg, exp_avg_sq and fp32 are states.
  Manifest m;
  m.world_size = 1;
  for (const char* name : {"a", "a.b", "a.fp32", "a.exp_avg", "a.exp_avg_sq", "a.b.c", "a.step"}) {
    m.params.push_back(Param(name, {4}));
  }
  Result<std::vector<DcpTensorToWrite>> t = PlanDcpTensors(m, 2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  std::vector<std::string> keys;
  for (const DcpTensorToWrite& w : *t) keys.push_back(w.key);
  EXPECT_EQ(keys,
            (std::vector<std::string>{"a", "a.b", "optim.state.a.fp32", "optim.state.a.exp_avg",
                                      "optim.state.a.exp_avg_sq", "a.b.c", "a.step"}));
  EXPECT_EQ((*t)[1].path, (std::vector<std::string>{"a.b"}));
  EXPECT_EQ((*t)[5].path, (std::vector<std::string>{"a.b.c"}));
}

TEST(PlanDcpTensorsTest, KeysThatCollideAreRefused) {
  Manifest m;
  m.world_size = 1;
  for (const char* name : {"w", "w.exp_avg", "optim.state.w.exp_avg"}) {
    m.params.push_back(Param(name, {4}));
  }
  Result<std::vector<DcpTensorToWrite>> t = PlanDcpTensors(m, 2);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("optim.state.w.exp_avg"), std::string::npos)
      << t.status().ToString();
  m.params.pop_back();
  m.params.push_back(Param("optim", {4}));
  t = PlanDcpTensors(m, 2);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition);
}

const std::vector<std::string> kDcpClasses = {
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.serialization._get_layout"};

// The value of `key` in the state dict of record `id` (a dataclass as pickled).
PickleNodeId Field(const PickleTree& tree, PickleNodeId id, const std::string& key) {
  const PickleNode& n = tree.node(id);
  if (n.state == kNoPickleNode) return kNoPickleNode;
  for (const auto& [k, v] : tree.node(n.state).entries) {
    if (tree.node(k).text == key) return v;
  }
  return kNoPickleNode;
}

std::vector<int64_t> Ints(const PickleTree& tree, PickleNodeId id) {
  std::vector<int64_t> out;
  for (PickleNodeId i : tree.node(id).items) out.push_back(tree.node(i).int_value);
  return out;
}

TEST(DcpMetadataPickleTest, HoldsDcpsRecordsWithChunksAndWhereTheirItemsLie) {
  DcpTensorToWrite w{0, "w", {"w"}, DType::kBF16, {5, 3}, DcpShard0Chunks({5, 3}, 4), {}};
  DcpTensorToWrite s{1,
                     "optim.state.w.step",
                     {"optim", "state", "w", "step"},
                     DType::kF32,
                     {},
                     DcpShard0Chunks({}, 4),
                     {}};
  const std::vector<std::vector<DcpWrittenItem>> items = {
      {{"__0_0.distcp", 0, 100}, {"__1_0.distcp", 0, 101}, {"__2_0.distcp", 0, 99}},
      {{"__0_0.distcp", 100, 7}}};
  Result<std::string> bytes = DcpMetadataPickle({w, s}, items, "/out/ckpt");
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_TRUE(bytes->starts_with(kDcpMetadataPrefix));
  // The mark an output that replaces it recognises, read back by the DCP reader.
  Result<DcpMetadata> read = ParseDcpMetadata(std::as_bytes(std::span(*bytes)), ".metadata");
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->save_id, kDcpSaveId);
  PickleOptions options;
  options.extra_record_classes = kDcpClasses;
  Result<PickleTree> tree = ParsePickle(std::as_bytes(std::span(*bytes)), options);
  ASSERT_TRUE(tree.ok()) << tree.status().ToString();
  const PickleTree& t = *tree;
  const PickleNode& root = t.node(t.root());
  EXPECT_EQ(root.text, "torch.distributed.checkpoint.metadata.Metadata");
  EXPECT_EQ(t.node(Field(t, t.root(), "version")).text, "1.0.0");
  const PickleNodeId meta = Field(t, t.root(), "storage_meta");
  EXPECT_EQ(t.node(Field(t, meta, "checkpoint_id")).kind, PickleKind::kStr);
  EXPECT_EQ(t.node(Field(t, meta, "checkpoint_id")).text, "/out/ckpt");
  EXPECT_EQ(t.node(Field(t, meta, "save_id")).text, kDcpSaveId);
  // state_dict_metadata: w's global size and its three chunks.
  const PickleNode& sdm = t.node(Field(t, t.root(), "state_dict_metadata"));
  ASSERT_EQ(sdm.entries.size(), 2u);
  EXPECT_EQ(t.node(sdm.entries[0].first).text, "w");
  const PickleNodeId w_md = sdm.entries[0].second;
  EXPECT_EQ(Ints(t, Field(t, w_md, "size")), (std::vector<int64_t>{5, 3}));
  const PickleNode& chunks = t.node(Field(t, w_md, "chunks"));
  ASSERT_EQ(chunks.items.size(), 3u);
  EXPECT_EQ(Ints(t, Field(t, chunks.items[2], "offsets")), (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(Ints(t, Field(t, chunks.items[2], "sizes")), (std::vector<int64_t>{1, 3}));
  // TensorProperties' state is a tuple starting with the dtype.
  const PickleNode& props = t.node(Field(t, w_md, "properties"));
  ASSERT_NE(props.state, kNoPickleNode);
  const PickleNode& state = t.node(props.state);
  ASSERT_EQ(state.kind, PickleKind::kTuple);
  ASSERT_EQ(state.items.size(), 5u);
  EXPECT_EQ(t.node(state.items[0]).text, "torch.bfloat16");
  // planner_data: the nested path.
  const PickleNode& planner = t.node(Field(t, t.root(), "planner_data"));
  ASSERT_EQ(planner.entries.size(), 2u);
  EXPECT_EQ(t.node(planner.entries[1].second).items.size(), 4u);
  // storage_data: one MetadataIndex per chunk, to its file, offset and length.
  const PickleNode& storage = t.node(Field(t, t.root(), "storage_data"));
  ASSERT_EQ(storage.entries.size(), 4u);
  const auto& [index, info] = storage.entries[3];
  EXPECT_EQ(t.node(Field(t, index, "fqn")).text, "optim.state.w.step");
  EXPECT_TRUE(t.node(Field(t, index, "offset")).items.empty());
  EXPECT_EQ(t.node(Field(t, info, "relative_path")).text, "__0_0.distcp");
  EXPECT_EQ(t.node(Field(t, info, "offset")).int_value, 100);
  EXPECT_EQ(t.node(Field(t, info, "length")).int_value, 7);
  EXPECT_EQ(t.node(Field(t, storage.entries[1].first, "index")).int_value, 1);

  // Items that do not match the chunks are refused.
  EXPECT_EQ(DcpMetadataPickle({w, s}, {items[0]}, "x").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DcpMetadataPickle({w, s}, {items[1], items[1]}, "x").status().code(),
            StatusCode::kInvalidArgument);
}

// Tensors held in memory at some world size, as a shard source.
class MemorySource : public ShardSource {
 public:
  // Adds tensor `name` of F32 elements 0, 1, ... (plus `base`), laid out by `map`.
  void Add(std::string name, const ParamMap& map, float base) {
    manifest_.world_size = map.world_size();
    std::vector<float> full(static_cast<size_t>(map.num_elements()));
    for (size_t i = 0; i < full.size(); ++i) full[i] = base + static_cast<float>(i);
    std::vector<std::vector<float>> shards;
    for (Rank r = 0; r < map.world_size(); ++r) {
      shards.emplace_back(static_cast<size_t>(map.shard_num_elements(r)));
      EXPECT_TRUE(
          Extract(map, DType::kF32, r,
                  {reinterpret_cast<const std::byte*>(full.data()), map.num_elements()},
                  {reinterpret_cast<std::byte*>(shards.back().data()), map.shard_num_elements(r)})
              .ok());
    }
    manifest_.params.push_back({std::move(name), DType::kF32, map, std::nullopt, 1});
    data_.push_back(std::move(shards));
  }
  const Manifest& manifest() const override { return manifest_; }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    std::vector<ConstBuffer> out;
    for (const std::vector<float>& s : data_[i]) {
      out.push_back({reinterpret_cast<const std::byte*>(s.data()), static_cast<Index>(s.size())});
    }
    return out;
  }
  void ReleaseShards(size_t) override {}
  std::vector<std::string> inputs() const override { return {}; }

 private:
  Manifest manifest_;
  std::vector<std::vector<std::vector<float>>> data_;
};

// The floats of the torch.save archive at [offset, offset + length) of `file`.
std::vector<float> ItemFloats(const std::string& file, uint64_t offset, uint64_t length,
                              Shape* shape) {
  Result<std::string> bytes = ReadFileToString(file);
  EXPECT_TRUE(bytes.ok());
  EXPECT_LE(offset + length, bytes->size());
  const std::string item = bytes->substr(offset, length);
  Result<TorchFile> f = TorchFile::Parse(std::as_bytes(std::span(item)));
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok() || f->tensors().size() != 1) return {};
  const TorchTensor& t = f->tensors()[0];
  *shape = t.shape;
  std::vector<float> out(static_cast<size_t>(t.numel()));
  EXPECT_TRUE(f->CopyTo(t, std::as_writable_bytes(std::span(out))).ok());
  return out;
}

TEST(WriteDcpTest, EachRanksFileHoldsItsChunksOfEveryTensorInOrder) {
  const TempDir tmp;
  MemorySource source;
  // w: 5 x 2 split over 2 source ranks by columns; b: replicated, 3 rows; s: 0-d.
  Result<ParamMap> w = SplitMap({5, 2}, 1, {1, 1});
  Result<ParamMap> b = ReplicatedMap({3}, 2);
  Result<ParamMap> s = ReplicatedMap({}, 2);
  ASSERT_TRUE(w.ok() && b.ok() && s.ok());
  source.Add("w", *w, 0);
  source.Add("b", *b, 100);
  source.Add("s", *s, 7);
  const std::string out = (tmp / "dcp").string();
  ASSERT_TRUE(WriteDcp(source, 4, out).ok());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp",
                                             "__2_0.distcp", "__3_0.distcp"}));
  // Rank 0: w rows 0-1, b row 0, s; rank 2: w row 4, b row 2; rank 3: nothing but w's...
  // (5 rows at 4 ranks: 2, 2, 1, none).
  EXPECT_EQ(fs::file_size(out + "/__3_0.distcp"), 0u);
  // Read the items back in file order: their lengths follow one another.
  Result<std::string> meta = ReadFileToString(out + "/.metadata");
  ASSERT_TRUE(meta.ok());
  PickleOptions options;
  options.extra_record_classes = kDcpClasses;
  Result<PickleTree> tree = ParsePickle(std::as_bytes(std::span(*meta)), options);
  ASSERT_TRUE(tree.ok()) << tree.status().ToString();
  const PickleTree& t = *tree;
  std::map<std::pair<std::string, std::vector<int64_t>>, std::vector<float>> got;
  for (const auto& [index, info] : t.node(Field(t, t.root(), "storage_data")).entries) {
    Shape shape;
    const std::string file = out + "/" + t.node(Field(t, info, "relative_path")).text;
    got[{t.node(Field(t, index, "fqn")).text, Ints(t, Field(t, index, "offset"))}] =
        ItemFloats(file, static_cast<uint64_t>(t.node(Field(t, info, "offset")).int_value),
                   static_cast<uint64_t>(t.node(Field(t, info, "length")).int_value), &shape);
  }
  using Key = std::pair<std::string, std::vector<int64_t>>;
  EXPECT_EQ(got.size(), 3u + 3u + 1u);
  EXPECT_EQ(got[Key("w", {0, 0})], (std::vector<float>{0, 1, 2, 3}));
  EXPECT_EQ(got[Key("w", {2, 0})], (std::vector<float>{4, 5, 6, 7}));
  EXPECT_EQ(got[Key("w", {4, 0})], (std::vector<float>{8, 9}));
  EXPECT_EQ(got[Key("b", {0})], (std::vector<float>{100}));
  EXPECT_EQ(got[Key("b", {2})], (std::vector<float>{102}));
  EXPECT_EQ(got[Key("s", {})], (std::vector<float>{7}));
  // The output is refused when it exists, and replaced with overwrite.
  EXPECT_EQ(WriteDcp(source, 2, out).code(), StatusCode::kAlreadyExists);
  CheckpointOptions overwrite;
  overwrite.overwrite = true;
  ASSERT_TRUE(WriteDcp(source, 2, out, overwrite).ok());
  EXPECT_FALSE(fs::exists(out + "/__2_0.distcp"));
  // Not once it holds a file reshard did not write, nor a .metadata of another writer's.
  ASSERT_TRUE(WriteFileAtomically(out + "/notes.txt", "mine").ok());
  EXPECT_EQ(WriteDcp(source, 2, out, overwrite).code(), StatusCode::kAlreadyExists);
  fs::remove(out + "/notes.txt");
  // Nor one that begins as reshard's does but is not (a user's file, or DCP metadata without
  // reshard's save_id).
  for (const std::string& other :
       {std::string("\x80\x04other"), std::string(kDcpMetadataPrefix) + "my notes"}) {
    ASSERT_TRUE(WriteFileAtomically(out + "/.metadata", other, {.overwrite = true}).ok());
    EXPECT_EQ(WriteDcp(source, 2, out, overwrite).code(), StatusCode::kAlreadyExists);
    EXPECT_TRUE(fs::exists(out + "/__1_0.distcp"));
    Result<std::string> kept = ReadFileToString(out + "/.metadata");
    ASSERT_TRUE(kept.ok());
    EXPECT_EQ(*kept, other);
  }
}

// A state dict's structure (a DCP source's) is kept: each tensor's key and nested path, and its
// non-tensor values' stored bytes as bytes items on rank 0, list indices as ints.
TEST(WriteDcpTest, AStateDictsPathsAndObjectsAreKeptAsStored) {
  const TempDir tmp;
  MemorySource source;
  Result<ParamMap> w = SplitMap({4, 2}, 0, {2, 2});
  Result<ParamMap> step = ReplicatedMap({}, 2);
  ASSERT_TRUE(w.ok() && step.ok());
  source.Add("model.w", *w, 0);
  source.Add("optim.state.w.exp_avg", *w, 10);
  source.Add("optim.state.w.step", *step, 3);
  StateDictStructure structure;
  structure.tensor_paths["model.w"] = {{"model", "w"}, {false, false}};
  structure.tensor_paths["optim.state.w.exp_avg"] = {{"optim", "state", "w", "exp_avg"},
                                                     {false, false, false, false}};
  // "optim.state.w.step" has none: it keeps the default rule (its name alone).
  const std::string lr = "stored bytes of param_groups[0]['lr']";
  const std::string zstd = "a zstd stream, copied untouched";
  const auto object = [](std::string key, StateDictPath path, const std::string& bytes,
                         std::vector<std::string> transforms) {
    StateDictObject o{std::move(key), std::move(path), std::move(transforms), bytes.size(), {}};
    o.read = [&bytes]() -> Result<std::span<const std::byte>> {
      return std::as_bytes(std::span(bytes));
    };
    return o;
  };
  structure.objects.push_back(
      object("optim.param_groups.0.lr",
             {{"optim", "param_groups", "0", "lr"}, {false, false, true, false}}, lr, {}));
  structure.objects.push_back(object("loader", {{"loader"}, {false}}, zstd, {"stream.zstd/1"}));
  const std::string out = (tmp / "dcp").string();
  ASSERT_TRUE(WriteDcp(source, 3, out, {}, &structure).ok());

  Result<std::shared_ptr<const DcpCheckpoint>> read = DcpCheckpoint::Open(out);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  const DcpCheckpoint& c = **read;
  ASSERT_EQ(c.tensors().size(), 3u);
  EXPECT_EQ(c.tensors()[0].fqn, "model.w");
  EXPECT_EQ(c.tensors()[0].path, (std::vector<std::string>{"model", "w"}));
  EXPECT_TRUE(c.tensors()[0].path_recorded);
  EXPECT_EQ(c.tensors()[1].path, (std::vector<std::string>{"optim", "state", "w", "exp_avg"}));
  EXPECT_EQ(c.tensors()[2].path, (std::vector<std::string>{"optim.state.w.step"}));
  ASSERT_EQ(c.bytes_items().size(), 2u);
  const DcpBytesItem& b0 = c.bytes_items()[0];
  EXPECT_EQ(b0.fqn, "optim.param_groups.0.lr");
  EXPECT_EQ(b0.path, (std::vector<std::string>{"optim", "param_groups", "0", "lr"}));
  EXPECT_EQ(b0.path_is_index, (std::vector<bool>{false, false, true, false}));
  EXPECT_EQ(b0.rank, 0);
  EXPECT_TRUE(b0.location.transforms.empty());
  const std::span<const std::byte> got0 = c.StoredBytesItem(0);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(got0.data()), got0.size()), lr);
  const DcpBytesItem& b1 = c.bytes_items()[1];
  EXPECT_EQ(b1.location.transforms, (std::vector<std::string>{"stream.zstd/1"}));
  const std::span<const std::byte> got1 = c.StoredBytesItem(1);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(got1.data()), got1.size()), zstd);
  // The tensors' chunks follow the objects in rank 0's file and read back as written.
  std::vector<std::byte> owned;
  Result<std::span<const std::byte>> chunk = c.ReadChunk(1, 0, owned);
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  std::vector<float> values(chunk->size() / sizeof(float));
  std::memcpy(values.data(), chunk->data(), chunk->size());
  EXPECT_EQ(values, (std::vector<float>{10, 11, 12, 13}));

  // A value that would take a tensor's key is refused, and nothing is written.
  structure.objects.push_back(object("model.w", {{"model", "w"}, {false, false}}, lr, {}));
  const Status clash = WriteDcp(source, 3, (tmp / "clash").string(), {}, &structure);
  EXPECT_EQ(clash.code(), StatusCode::kFailedPrecondition) << clash.ToString();
  EXPECT_NE(clash.message().find("\"model.w\""), std::string::npos) << clash.ToString();
  EXPECT_FALSE(fs::exists(tmp / "clash"));
}

// Writing at a large world costs in proportion to the chunks and files written. Each rank's
// file scanned every tensor's chunks, each chunk's moves were picked out of the tensor's and
// run against a target vector of the world's size, and each file's creation listed the
// directory for stale temporaries (n files: n^2 entries): 8 rows at world 16 384 took more
// than 60 s of CPU. Now a fraction of a second (plus creating the empty files).
TEST(WriteDcpDeathTest, ALargeWorldCostsInProportionToTheChunksAndFiles) {
  const TempDir tmp;
  const std::string out = (tmp / "dcp").string();
  const auto write = [&] {
    MemorySource source;
    Result<ParamMap> w = SplitMap({8, 1}, 0, {4, 4});
    if (!w.ok()) return false;
    source.Add("w", *w, 0);
    return WriteDcp(source, test_support::CostInput(16384), out).ok() &&
           fs::file_size(out + "/__7_0.distcp") > 0;
  };
  EXPECT_EXIT(test_support::RunUnderCpuLimit(10, write), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace reshard
