#include "reshard/checkpoint/orbax/orbax.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/temp_dir_testing.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/orbax/maxtext.h"
#include "reshard/checkpoint/orbax/ocdbt.h"
#include "reshard/checkpoint/orbax/zarr.h"
#include "reshard/exec/executor.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/basic.h"

namespace reshard {
namespace {

std::vector<std::byte> Bytes(std::string_view s) {
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

// An encoded structure: magic, length, version 0, compression 0, `body`, CRC-32C.
std::vector<std::byte> Structure(uint32_t magic, std::string_view body) {
  std::vector<std::byte> out;
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<std::byte>((magic >> (8 * i)) & 0xff));
  const uint64_t length = 4 + 8 + 2 + body.size() + 4;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>((length >> (8 * i)) & 0xff));
  out.push_back(std::byte{0});
  out.push_back(std::byte{0});
  for (char c : body) out.push_back(static_cast<std::byte>(c));
  const uint32_t crc = Crc32c(out);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::byte>((crc >> (8 * i)) & 0xff));
  return out;
}

TEST(Crc32cTest, MatchesTheCheckValueOfTheCastagnoliPolynomial) {
  EXPECT_EQ(Crc32c(Bytes("123456789")), 0xe3069283u);
  EXPECT_EQ(Crc32c({}), 0u);
}

TEST(OcdbtTest, StructureRoundTripsItsBody) {
  const auto s = Structure(0x0cdb20de, "hello");
  auto body = DecodeOcdbtStructure(s, 0x0cdb20de, "node");
  ASSERT_TRUE(body.ok()) << body.status().ToString();
  EXPECT_EQ(*body, Bytes("hello"));
}

// One kind of corrupt structure per case, each refused as DataLoss.
TEST(OcdbtTest, CorruptStructuresAreDataLoss) {
  const auto good = Structure(0x0cdb20de, "some body");
  std::vector<std::pair<std::string, std::vector<std::byte>>> cases;
  cases.emplace_back("wrong magic", Structure(0x0cdb1234, "some body"));
  auto flipped = good;
  flipped[15] ^= std::byte{1};
  cases.emplace_back("flipped body byte", flipped);
  auto truncated = good;
  truncated.pop_back();
  cases.emplace_back("truncated", truncated);
  auto longer = good;
  longer.push_back(std::byte{0});
  cases.emplace_back("extra byte", longer);
  cases.emplace_back("too short", std::vector<std::byte>(good.begin(), good.begin() + 10));
  auto version = good;
  version[12] = std::byte{1};
  cases.emplace_back("version 1", version);
  for (const auto& [name, bytes] : cases) {
    auto r = DecodeOcdbtStructure(bytes, 0x0cdb20de, "node");
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << name << ": " << r.status().ToString();
  }
}

TEST(OcdbtTest, LeafNodeWithInlineAndOutOfLineValues) {
  // height 0; data file table: 1 file "d/x" (no prefix entries, suffix 3, base 2); 2 entries:
  // keys "ab", "ac" (prefix 1, suffixes 2 and 1), values: 3 bytes inline "xyz", 7 bytes at
  // offset 5 of file 0.
  std::string body;
  body += '\0';   // height
  body += '\1';   // one data file
  body += '\3';   // suffix length
  body += '\2';   // base path length
  body += "d/x";  // path
  body += '\2';   // two entries
  body += '\1';   // key prefix of entry 1
  body += '\2';   // key suffix lengths
  body += '\1';
  body += "abc";  // suffixes "ab", "c"
  body += '\3';   // value lengths
  body += '\7';
  body += '\0';  // kinds: inline, out of line
  body += '\1';
  body += '\0';   // data file id
  body += '\5';   // offset
  body += "xyz";  // the inline value
  const auto node = ParseOcdbtNode(Structure(0x0cdb20de, body), "", "node");
  ASSERT_TRUE(node.ok()) << node.status().ToString();
  ASSERT_EQ(node->values.size(), 2u);
  EXPECT_EQ(node->values[0].first, "ab");
  EXPECT_TRUE(node->values[0].second.is_inline);
  EXPECT_EQ(node->values[0].second.inline_bytes, "xyz");
  EXPECT_EQ(node->values[1].first, "ac");
  EXPECT_FALSE(node->values[1].second.is_inline);
  EXPECT_EQ(node->values[1].second.offset, 5u);
  EXPECT_EQ(node->values[1].second.length, 7u);
  EXPECT_EQ(node->files, std::vector<std::string>{"d/x"});
  EXPECT_EQ(node->base_paths, std::vector<std::string>{"d/"});
}

TEST(OcdbtTest, DataFilePathsThatLeaveTheDatabaseAreRefused) {
  for (std::string path : {"../x", "/etc/passwd", "d/../../x"}) {
    std::string body;
    body += '\0';
    body += '\1';
    body += static_cast<char>(path.size());
    body += '\0';
    body += path;
    body += '\0';  // no entries
    const auto node = ParseOcdbtNode(Structure(0x0cdb20de, body), "", "node");
    ASSERT_FALSE(node.ok()) << path;
    EXPECT_EQ(node.status().code(), StatusCode::kDataLoss) << path;
  }
}

TEST(OcdbtTest, CountsBeyondTheBytesLeftAreRefusedBeforeAllocating) {
  std::string body;
  body += '\0';
  body += "\xff\xff\xff\xff\x0f";  // 2^32 - 1 data files in a few bytes
  const auto node = ParseOcdbtNode(Structure(0x0cdb20de, body), "", "node");
  ASSERT_FALSE(node.ok());
  EXPECT_NE(node.status().message().find("more than the"), std::string::npos)
      << node.status().message();
}

TEST(ZarrTest, ReadsV2AndV3Metadata) {
  auto v2 = ParseZarrMetadata(
      R"({"chunks":[4,3],"compressor":{"id":"zstd","level":1},"dimension_separator":".",)"
      R"("dtype":"bfloat16","fill_value":null,"filters":null,"order":"C","shape":[8,12],)"
      R"("zarr_format":2})",
      ".zarray");
  ASSERT_TRUE(v2.ok()) << v2.status().ToString();
  EXPECT_EQ(v2->dtype, DType::kBF16);
  EXPECT_TRUE(v2->zstd);
  EXPECT_EQ(ZarrChunkKey(*v2, Shape{1, 2}), "1.2");
  EXPECT_EQ(ZarrChunkGrid(*v2), (Shape{2, 4}));
  auto v3 = ParseZarrMetadata(
      R"({"chunk_grid":{"configuration":{"chunk_shape":[4,4]},"name":"regular"},)"
      R"("chunk_key_encoding":{"name":"default"},"codecs":[{"configuration":{"chunk_shape":[2,4],)"
      R"("codecs":[{"configuration":{"endian":"little"},"name":"bytes"},{"configuration":)"
      R"({"checksum":false,"level":3},"name":"zstd"}],"index_codecs":[{"configuration":)"
      R"({"endian":"little"},"name":"bytes"},{"name":"crc32c"}]},"name":"sharding_indexed"}],)"
      R"("data_type":"float8_e4m3fn","fill_value":0.0,"node_type":"array","shape":[8,4],)"
      R"("zarr_format":3})",
      "zarr.json");
  ASSERT_TRUE(v3.ok()) << v3.status().ToString();
  EXPECT_EQ(v3->dtype, DType::kF8E4M3);
  EXPECT_TRUE(v3->sharded);
  EXPECT_TRUE(v3->index_crc32c);
  EXPECT_EQ(v3->inner_shape, (Shape{2, 4}));
  EXPECT_EQ(ZarrChunkKey(*v3, Shape{1, 0}), "c/1/0");
  EXPECT_EQ(ZarrChunkKey(*v3, Shape{}), "c");
}

TEST(ZarrTest, RefusesWhatItDoesNotRead) {
  const char* cases[] = {
      R"({"zarr_format":2,"shape":[4],"chunks":[4],"dtype":"<f4","compressor":{"id":"blosc"}})",
      R"({"zarr_format":2,"shape":[4],"chunks":[4],"dtype":">f4","compressor":null})",
      R"({"zarr_format":2,"shape":[4],"chunks":[4],"dtype":"<c8","compressor":null})",
      R"({"zarr_format":2,"shape":[4],"chunks":[4],"dtype":"<f4","order":"F"})",
  };
  for (const char* text : cases) {
    auto r = ParseZarrMetadata(text, "m");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  }
  for (const char* text : {R"({"zarr_format":2,"shape":[4],"chunks":[0],"dtype":"<f4"})",
                           R"({"zarr_format":2,"shape":[4,4],"chunks":[4],"dtype":"<f4"})",
                           R"({"zarr_format":4})", "[1]", "{"}) {
    auto r = ParseZarrMetadata(text, "m");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  }
}

TEST(ZarrTest, CopyChunkIntoBoxTakesTheOverlap) {
  // A 2x3 chunk at (2, 3) of an array; the box (3, 2) of size 2x3 overlaps its row 1, columns
  // 3 and 4.
  std::vector<int32_t> chunk = {0, 1, 2, 10, 11, 12};
  std::vector<int32_t> box(6, -1);
  CopyChunkIntoBox(Shape{2, 3}, Shape{2, 3}, std::as_bytes(std::span(chunk)), Shape{3, 2},
                   Shape{2, 3}, 4, std::as_writable_bytes(std::span(box)));
  EXPECT_EQ(box, (std::vector<int32_t>{-1, 10, 11, -1, -1, -1}));
}

TEST(ZarrTest, RawChunkOfTheWrongSizeIsDataLoss) {
  auto a = ParseZarrMetadata(
      R"({"zarr_format":2,"shape":[4],"chunks":[4],"dtype":"<i4","compressor":null})", "m");
  ASSERT_TRUE(a.ok());
  std::vector<std::byte> out;
  std::vector<std::byte> stored(15);
  EXPECT_EQ(DecodeZarrChunk(*a, stored, false, "c", out).code(), StatusCode::kDataLoss);
  stored.resize(16, std::byte{7});
  EXPECT_TRUE(DecodeZarrChunk(*a, stored, false, "c", out).ok());
  EXPECT_EQ(out, stored);
  EXPECT_TRUE(DecodeZarrChunk(*a, {}, true, "c", out).ok());
  EXPECT_EQ(out, std::vector<std::byte>(16));
}

TEST(ZarrTest, AChunkClaimingMoreThanItsBytesCanHoldIsRefusedBeforeAllocating) {
  // 2^40 bytes claimed by the metadata; 10 stored bytes of zstd can hold at most 512 KiB.
  auto a = ParseZarrMetadata(
      R"({"zarr_format":2,"shape":[1099511627776],"chunks":[1099511627776],"dtype":"|u1",)"
      R"("compressor":{"id":"zstd","level":1}})",
      "m");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  std::vector<std::byte> out;
  const Status s = DecodeZarrChunk(*a, std::vector<std::byte>(10), false, "c", out);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("cannot hold"), std::string::npos) << s.message();
  EXPECT_TRUE(out.empty());
}

void Write(const std::filesystem::path& p, std::string_view text) {
  std::filesystem::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

// An item without OCDBT, written by hand: "w", int32 [10, 6] on a mesh x=4 with P('x'): the
// boxes JAX would give an uneven split (ceil: rows 3, 3, 3, 1), stored in zarr chunks of 3 x 6
// whose third is not stored (the fill value), and "r", replicated, on a (2, 2) mesh.
class OrbaxItemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Write(dir_ / "_METADATA",
          R"j({"tree_metadata": {"('w',)": {"key_metadata": [{"key": "w", "key_type": 2}],)j"
          R"j( "value_metadata": {"value_type": "jax.Array", "write_shape": [3, 6]}},)j"
          R"j( "('r', '0')": {"key_metadata": [{"key": "r", "key_type": 2}, {"key": "0",)j"
          R"j( "key_type": 1}], "value_metadata": {"value_type": "jax.Array"}},)j"
          R"j( "('note',)": {"key_metadata": [{"key": "note", "key_type": 2}],)j"
          R"j( "value_metadata": {"value_type": "string"}}}})j");
    const std::string mesh4 =
        R"j({\"sharding_type\": \"NamedSharding\", \"shape\": [4], \"axis_names\": [\"x\"],)j"
        R"j( \"partition_spec\": [\"x\"], \"device_mesh\": {\"mesh\": [{\"id\": 0}, {\"id\": 1},)j"
        R"j( {\"id\": 2}, {\"id\": 3}]}})j";
    const std::string mesh22 =
        R"j({\"sharding_type\": \"NamedSharding\", \"shape\": [2, 2], \"axis_names\": [\"a\",)j"
        R"j( \"b\"], \"partition_spec\": [], \"device_mesh\": {\"mesh\": [[{\"id\": 0}, {\"id\":)j"
        R"j( 1}], [{\"id\": 2}, {\"id\": 3}]]}})j";
    Write(dir_ / "_sharding", R"({"dw==": ")" + mesh4 + R"(", "ci4w": ")" + mesh22 + R"("})");
    Write(dir_ / "w" / ".zarray",
          R"({"zarr_format": 2, "shape": [10, 6], "chunks": [3, 6], "dtype": "<i4",)"
          R"( "compressor": null, "fill_value": null, "order": "C", "filters": null})");
    for (int c : {0, 1, 3}) {  // chunk 2 is not stored
      std::vector<int32_t> v(18);
      for (int i = 0; i < 18; ++i) v[static_cast<size_t>(i)] = c * 18 + i;
      Write(dir_ / "w" / (std::to_string(c) + ".0"),
            std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
    }
    Write(dir_ / "r.0" / ".zarray",
          R"({"zarr_format": 2, "shape": [2], "chunks": [2], "dtype": "|u1", "compressor": null})");
    Write(dir_ / "r.0" / "0", "\x07\x09");
  }
  test_support::TempDir dir_;
};

TEST_F(OrbaxItemTest, UnevenBoxesMissingChunksAndReplicas) {
  auto c = OrbaxCheckpoint::Open(dir_.path().string());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const OrbaxCheckpoint& ck = **c;
  ASSERT_EQ(ck.world_size(), 4);
  ASSERT_EQ(ck.arrays().size(), 2u);
  EXPECT_EQ(ck.others().size(), 1u);
  const size_t w = ck.arrays()[0].name == "w" ? 0 : 1;
  const size_t r = 1 - w;
  EXPECT_EQ(ck.arrays()[r].name, "r.0");
  EXPECT_EQ(ck.arrays()[r].path_is_index, (std::vector<bool>{false, true}));
  EXPECT_EQ(ck.Box(w, 2), (std::pair<Shape, Shape>{{6, 0}, {3, 6}}));
  EXPECT_EQ(ck.Box(w, 3), (std::pair<Shape, Shape>{{9, 0}, {1, 6}}));
  // Every device holds the replicated array whole.
  EXPECT_EQ(ck.map(r).num_elements(), 2);
  for (Rank rank = 0; rank < 4; ++rank) EXPECT_EQ(ck.map(r).shard_num_elements(rank), 2);
  std::vector<int32_t> box(18, -1);
  ASSERT_TRUE(ck.ReadBox(w, {6, 0}, {3, 6}, std::as_writable_bytes(std::span(box))).ok());
  EXPECT_EQ(box, std::vector<int32_t>(18, 0));  // the fill value
  std::vector<int32_t> last(6, -1);
  ASSERT_TRUE(ck.ReadBox(w, {9, 0}, {1, 6}, std::as_writable_bytes(std::span(last))).ok());
  EXPECT_EQ(last, (std::vector<int32_t>{54, 55, 56, 57, 58, 59}));
  // A box across chunks: rows 2..4.
  std::vector<int32_t> across(12, -1);
  ASSERT_TRUE(ck.ReadBox(w, {2, 0}, {2, 6}, std::as_writable_bytes(std::span(across))).ok());
  EXPECT_EQ(across[0], 12);
  EXPECT_EQ(across[6], 18);
  // The whole array decoded on one thread and on three: the same elements.
  std::vector<int32_t> one(60, -1), three(60, -2);
  ASSERT_TRUE(ck.ReadBox(w, {0, 0}, {10, 6}, std::as_writable_bytes(std::span(one)), 1).ok());
  ASSERT_TRUE(ck.ReadBox(w, {0, 0}, {10, 6}, std::as_writable_bytes(std::span(three)), 3).ok());
  EXPECT_EQ(one, three);
  EXPECT_EQ(one[59], 59);
  EXPECT_EQ(one[36], 0);  // the chunk not stored
}

// A source that reads regions only: a consumer that acquired its shards fails.
class RegionsOnly : public ShardSource {
 public:
  explicit RegionsOnly(std::unique_ptr<ShardSource> inner) : inner_(std::move(inner)) {}
  const Manifest& manifest() const override { return inner_->manifest(); }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t) override {
    return InternalError("the shards were acquired, not regions read");
  }
  void ReleaseShards(size_t) override {}
  std::vector<std::string> inputs() const override { return inner_->inputs(); }
  bool ReadsRegions() const override { return true; }
  Status ReadRegion(size_t i, const Shape& offsets, const Shape& sizes, std::span<std::byte> out,
                    int threads) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!offsets.empty()) regions_[manifest().params[i].name].emplace_back(offsets[0], sizes[0]);
    return inner_->ReadRegion(i, offsets, sizes, out, threads);
  }
  Index RegionRows(size_t i, uint64_t band_bytes) const override {
    return inner_->RegionRows(i, band_bytes);
  }
  std::vector<std::pair<Shape, Shape>> StoredChunks(size_t i) const override {
    return inner_->StoredChunks(i);
  }
  // The rows (first, count) of each region read, by parameter name.
  std::map<std::string, std::vector<std::pair<Index, Index>>> regions() const { return regions_; }

 private:
  std::unique_ptr<ShardSource> inner_;
  std::mutex mu_;
  std::map<std::string, std::vector<std::pair<Index, Index>>> regions_;
};

// F[row][col] = 6 * row + col of OrbaxItemTest's w, but rows 6-8 (a chunk not stored) hold the
// fill value 0.
int32_t StoredW(Index row, Index col) {
  return row >= 6 && row < 9 ? 0 : static_cast<int32_t>(6 * row + col);
}

// Converts through `source` to 2 ranks by a map document that gives w the ranks `w_ranks` (the
// JSON of its "ranks" object) and r.0 whole on both ranks, and returns w's two shards.
void ConvertW(ShardSource& source, std::string_view w_ranks,
              std::array<std::vector<int32_t>, 2>* shards) {
  auto doc = ReadMapDocumentJson(R"({"version": 1, "w": {"logical_shape": [10, 6], "ranks": )" +
                                 std::string(w_ranks) +
                                 R"(}, "^r\\.0$": {"logical_shape": [2], "ranks": {
      "0": {"shard_shape": [2], "pieces": [
          {"shape": [2], "source": [0, [1]], "dest": [0, [1]], "locations": [0, 1]}]},
      "1": {"shard_shape": [2], "pieces": [
          {"shape": [2], "source": [0, [1]], "dest": [0, [1]], "locations": [0, 1]}]}}}})");
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  test_support::TempDir out("_out");
  const std::string tp2 = (out.path() / "tp2").string();
  const Status s = ConvertFrom(source, 2, *doc, tp2, {});
  ASSERT_TRUE(s.ok()) << s.ToString();
  auto converted = ShardedCheckpoint::Open(tp2);
  ASSERT_TRUE(converted.ok()) << converted.status().ToString();
  const std::vector<ShardedParam>& params = converted->manifest().params;
  const auto w =
      static_cast<size_t>(std::find_if(params.begin(), params.end(),
                                       [](const ShardedParam& p) { return p.name == "w"; }) -
                          params.begin());
  ASSERT_LT(w, params.size());
  for (Rank r = 0; r < 2; ++r) {
    const std::span<const std::byte> bytes = converted->shard(w, r);
    std::vector<int32_t>& v = (*shards)[static_cast<size_t>(r)];
    v.resize(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
  }
}

// gather writes a tensor read by regions in bands of whole chunk rows: the same file as read
// whole, each band read once, the stored chunk missing in the third band given as fill values.
TEST_F(OrbaxItemTest, GatherInBandsOfChunkRowsWritesWhatAWholeReadWrites) {
  auto c = OrbaxCheckpoint::Open(dir_.path().string());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  test_support::TempDir out("_out");
  CheckpointOptions whole;
  whole.band_bytes = 1 << 20;  // more than w: one band, read whole
  RegionsOnly a(OrbaxSource(*c, false)), b(OrbaxSource(*c, false));
  ASSERT_TRUE(GatherFrom(a, (out.path() / "whole").string(), whole).ok());
  CheckpointOptions banded;
  banded.band_bytes = 1;  // one chunk row (3 rows of w) a band
  const Status s = GatherFrom(b, (out.path() / "banded").string(), banded);
  ASSERT_TRUE(s.ok()) << s.ToString();
  using Rows = std::vector<std::pair<Index, Index>>;
  EXPECT_EQ(a.regions().at("w"), (Rows{{0, 10}}));
  EXPECT_EQ(b.regions().at("w"), (Rows{{0, 3}, {3, 3}, {6, 3}, {9, 1}}));
  const auto read = [&](const char* name) {
    return *ReadFileToString((out.path() / name / "model.safetensors").string());
  };
  EXPECT_EQ(read("banded"), read("whole"));
}

// A target layout of several pieces per shard (two row blocks, as a fused gate_up): each piece
// is read from the chunks it overlaps and put in its place, without the array's shards.
TEST_F(OrbaxItemTest, ATargetShardOfSeveralPiecesIsReadFromTheChunksItOverlaps) {
  auto c = OrbaxCheckpoint::Open(dir_.path().string());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  RegionsOnly source(OrbaxSource(*c, false));
  std::array<std::vector<int32_t>, 2> shards;
  ASSERT_NO_FATAL_FAILURE(ConvertW(source, R"({
      "0": {"shard_shape": [4, 6], "pieces": [
          {"shape": [2, 6], "source": [0, [6, 1]], "dest": [0, [6, 1]], "locations": [0]},
          {"shape": [2, 6], "source": [30, [6, 1]], "dest": [12, [6, 1]], "locations": [0]}]},
      "1": {"shard_shape": [6, 6], "pieces": [
          {"shape": [3, 6], "source": [42, [6, 1]], "dest": [0, [6, 1]], "locations": [1]},
          {"shape": [3, 6], "source": [12, [6, 1]], "dest": [18, [6, 1]], "locations": [1]}]}})",
                                   &shards));
  auto rows = [](std::initializer_list<Index> which) {
    std::vector<int32_t> v;
    for (Index row : which) {
      for (Index col = 0; col < 6; ++col) v.push_back(StoredW(row, col));
    }
    return v;
  };
  EXPECT_EQ(shards[0], rows({0, 1, 5, 6}));
  EXPECT_EQ(shards[1], rows({7, 8, 9, 2, 3, 4}));
}

// A target shard of pieces that are not boxes (every other row; a transpose) is read from the
// stored chunks one at a time, each chunk once, through a source that cannot give its shards.
TEST_F(OrbaxItemTest, ATargetShardOfPiecesThatAreNotBoxesIsReadChunkByChunk) {
  auto c = OrbaxCheckpoint::Open(dir_.path().string());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  RegionsOnly source(OrbaxSource(*c, false));
  std::array<std::vector<int32_t>, 2> shards;
  ASSERT_NO_FATAL_FAILURE(ConvertW(source, R"({
      "0": {"shard_shape": [5, 6], "pieces": [
          {"shape": [5, 6], "source": [0, [12, 1]], "dest": [0, [6, 1]], "locations": [0]}]},
      "1": {"shard_shape": [6, 5], "pieces": [
          {"shape": [6, 5], "source": [6, [1, 12]], "dest": [0, [5, 1]], "locations": [1]}]}})",
                                   &shards));
  std::vector<int32_t> even, odd_transposed;
  for (Index row = 0; row < 10; row += 2) {
    for (Index col = 0; col < 6; ++col) even.push_back(StoredW(row, col));
  }
  for (Index col = 0; col < 6; ++col) {
    for (Index row = 1; row < 10; row += 2) odd_transposed.push_back(StoredW(row, col));
  }
  EXPECT_EQ(shards[0], even);
  EXPECT_EQ(shards[1], odd_transposed);
  // Each rank read each stored chunk that feeds it once, a whole chunk of 3 rows (1 the last):
  // rank 1 all four, rank 0 three (the last chunk, row 9, holds no even row).
  const auto regions = source.regions().at("w");
  EXPECT_EQ(regions.size(), 7u);
  EXPECT_EQ(std::count(regions.begin(), regions.end(), std::pair<Index, Index>{9, 1}), 1);
  for (const auto& [first, count] : regions) {
    EXPECT_EQ(first % 3, 0);
    EXPECT_EQ(count, first == 9 ? 1 : 3);
  }
}

TEST_F(OrbaxItemTest, ASpecNamingAnAxisTheMeshLacksIsDataLoss) {
  std::ifstream in(dir_ / "_sharding");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string spec = R"(\"partition_spec\": [\"x\"])";
  ASSERT_NE(text.find(spec), std::string::npos);
  text.replace(text.find(spec), spec.size(), R"(\"partition_spec\": [\"y\"])");
  Write(dir_ / "_sharding", text);
  auto c = OrbaxCheckpoint::Open(dir_.path().string());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(c.status().message().find("\"y\" is not an axis of the mesh"), std::string::npos)
      << c.status().message();
}

// optax's Adam state for an optimizer given `params`' subtree: moments of "a.w" could be those
// of "params.a.w" or "params.b.a.w" by their path; the prefix every moment shares ("params")
// decides. A moment of another shape than its parameter's is matched to nothing.
// A leaf of an item written by hand: its path, zarr shape and dtype (no chunk stored).
struct Leaf {
  std::vector<std::string> path;
  std::string shape, dtype;
};

void WriteTree(const std::filesystem::path& dir, const std::vector<Leaf>& leaves) {
  std::string tree;
  for (const Leaf& l : leaves) {
    std::string keys, name, text;
    for (const std::string& k : l.path) {
      const bool index = k.find_first_not_of("0123456789") == std::string::npos;
      keys += fmt::format(R"({}{{"key": "{}", "key_type": {}}})", keys.empty() ? "" : ", ", k,
                          index ? 1 : 2);
      name += (name.empty() ? "" : ".") + k;
      text += (text.empty() ? "'" : ", '") + k + "'";
    }
    tree += fmt::format(R"j({}"({},)": {{"key_metadata": [{}], "value_metadata": )j"
                        R"j({{"value_type": "jax.Array"}}}})j",
                        tree.empty() ? "" : ", ", text, keys);
    Write(dir / name / ".zarray",
          fmt::format(R"({{"zarr_format": 2, "shape": {}, "chunks": {}, "dtype": "{}", )"
                      R"("compressor": null, "fill_value": null, "order": "C", "filters": null}})",
                      l.shape, l.shape == "[]" ? "[]" : l.shape, l.dtype));
  }
  Write(dir / "_METADATA", R"({"tree_metadata": {)" + tree + "}}");
}

TEST(OrbaxMomentsTest, MuAndNuMatchTheParameterUnderThePrefixTheyShare) {
  test_support::TempDir dir;
  const std::vector<Leaf> leaves = {
      {{"params", "a", "w"}, "[2, 3]", "<f4"},
      {{"params", "b", "a", "w"}, "[2, 3]", "<f4"},
      {{"params", "c"}, "[4]", "<f4"},
      {{"opt_state", "0", "count"}, "[]", "<i4"},
      {{"opt_state", "0", "mu", "a", "w"}, "[2, 3]", "<f4"},
      {{"opt_state", "0", "mu", "b", "a", "w"}, "[2, 3]", "<f4"},
      {{"opt_state", "0", "mu", "c"}, "[5]", "<f4"},
      {{"opt_state", "0", "nu", "a", "w"}, "[2, 3]", "<f4"},
      {{"opt_state", "0", "nu", "b", "a", "w"}, "[2, 3]", "<f4"},
  };
  WriteTree(dir.path(), leaves);
  auto c = OrbaxCheckpoint::Open(dir.path().string());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < (*c)->arrays().size(); ++i) index[(*c)->arrays()[i].name] = i;
  ASSERT_EQ(index.size(), leaves.size());
  const OrbaxMoments m = FindOrbaxMoments(**c);
  const auto of = [&](const std::string& name) -> std::pair<std::string, std::string> {
    const auto it = m.moments.find(index.at(name));
    if (it == m.moments.end()) return {};
    return {(*c)->arrays()[it->second.first].name, it->second.second};
  };
  using Pair = std::pair<std::string, std::string>;
  EXPECT_EQ(of("opt_state.0.mu.a.w"), (Pair{"params.a.w", "exp_avg"}));
  EXPECT_EQ(of("opt_state.0.nu.a.w"), (Pair{"params.a.w", "exp_avg_sq"}));
  EXPECT_EQ(of("opt_state.0.mu.b.a.w"), (Pair{"params.b.a.w", "exp_avg"}));
  EXPECT_EQ(of("opt_state.0.nu.b.a.w"), (Pair{"params.b.a.w", "exp_avg_sq"}));
  EXPECT_EQ(of("opt_state.0.mu.c"), Pair{});
  EXPECT_EQ(m.moments.size(), 4u);
  EXPECT_EQ(m.counts.at(index.at("params.a.w")), index.at("opt_state.0.count"));
  EXPECT_EQ(m.counts.at(index.at("params.b.a.w")), index.at("opt_state.0.count"));
  // The source names them as a parameter's moments; the count keeps its name.
  auto source = OrbaxSource(*c, false);
  std::set<std::string> names;
  for (const ShardedParam& p : source->manifest().params) names.insert(p.name);
  EXPECT_TRUE(names.contains("params.a.w.exp_avg"));
  EXPECT_TRUE(names.contains("params.b.a.w.exp_avg_sq"));
  EXPECT_TRUE(names.contains("opt_state.0.mu.c"));
  EXPECT_TRUE(names.contains("opt_state.0.count"));
  // and reads a region of any array from its chunks (none stored here: the fill value)
  ASSERT_TRUE(source->ReadsRegions());
  const std::vector<ShardedParam>& params = source->manifest().params;
  const auto w = static_cast<size_t>(
      std::find_if(params.begin(), params.end(),
                   [](const ShardedParam& p) { return p.name == "params.a.w"; }) -
      params.begin());
  ASSERT_LT(w, params.size());
  std::vector<float> box(4, -1.0f);
  ASSERT_TRUE(
      source->ReadRegion(w, {0, 1}, {2, 2}, std::as_writable_bytes(std::span(box)), 1).ok());
  EXPECT_EQ(box, std::vector<float>(4, 0.0f));
  EXPECT_EQ(source->ReadRegion(w, {1, 2}, {2, 2}, std::as_writable_bytes(std::span(box)), 2).code(),
            StatusCode::kOutOfRange);
}

// The offset in the Hugging Face tensor of MaxText's element at multi-index `at` of one layer.
Index HfOffsetOf(const MaxTextTensor& t, const Shape& at) {
  Index offset = 0;
  for (size_t j = 0; j < t.factors.size(); ++j) {
    Index rest = at[j];
    for (const MaxTextFactor& f : t.factors[j]) {
      offset += rest / f.inner * f.hf_stride;
      rest %= f.inner;
    }
  }
  return offset;
}

TEST(MaxTextLayoutTest, EveryTensorIsAPermutationOfItsArraysLayer) {
  for (const char* type : {"llama", "qwen3"}) {
    const auto config = ParseMaxTextModelConfig(
        fmt::format(R"({{"model_type": "{}", "num_hidden_layers": 2, "hidden_size": 8,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                       "intermediate_size": 6, "vocab_size": 10}})",
                    type),
        "config");
    ASSERT_TRUE(config.ok()) << config.status().message();
    const std::vector<MaxTextTensor> tensors = MaxTextTensors(*config);
    EXPECT_EQ(tensors.size(), std::string_view(type) == "llama" ? 3 + 2 * 9 : 3 + 2 * 11);
    for (const MaxTextTensor& t : tensors) {
      ASSERT_EQ(ProductOf(t.layer_shape), ProductOf(t.hf_shape)) << t.hf_name;
      std::vector<int> hits(static_cast<size_t>(ProductOf(t.hf_shape)), 0);
      for (Index e = 0; e < ProductOf(t.layer_shape); ++e) {
        const Index offset = HfOffsetOf(t, UnravelIndex(e, t.layer_shape));
        ASSERT_GE(offset, 0);
        ASSERT_LT(offset, ProductOf(t.hf_shape)) << t.hf_name;
        ++hits[static_cast<size_t>(offset)];
      }
      EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; })) << t.hf_name;
    }
  }
}

TEST(MaxTextLayoutTest, LlamaQueryIsTransposedPerHeadWithRotaryPairsAndScaled) {
  const auto config = ParseMaxTextModelConfig(
      R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
          "num_attention_heads": 2, "head_dim": 4, "intermediate_size": 6, "vocab_size": 10})",
      "config");
  ASSERT_TRUE(config.ok()) << config.status().message();
  for (const MaxTextTensor& t : MaxTextTensors(*config)) {
    if (t.hf_name != "model.layers.0.self_attn.q_proj.weight") continue;
    EXPECT_EQ(t.leaf, "self_attention.query.kernel");
    EXPECT_EQ(t.layer_shape, (Shape{8, 2, 4}));
    EXPECT_EQ(t.hf_shape, (Shape{8, 8}));
    EXPECT_DOUBLE_EQ(t.scale, 0.5);
    // MaxText's [embed 3, head 1, d 1] is the odd half of rotary pair 0 of head 1: Hugging Face
    // row 1 * 4 + (1 * 2 + 0), column 3.
    EXPECT_EQ(HfOffsetOf(t, {3, 1, 1}), (4 + 2) * 8 + 3);
    EXPECT_EQ(HfOffsetOf(t, {0, 0, 2}), 1 * 8);  // pair 1, even: row 1
    return;
  }
  FAIL() << "no q_proj";
}

TEST(MaxTextLayoutTest, ConfigsWithoutALayoutAreRefused) {
  const auto gemma = ParseMaxTextModelConfig(
      R"({"model_type": "gemma", "num_hidden_layers": 1, "hidden_size": 8,
          "num_attention_heads": 2, "intermediate_size": 6, "vocab_size": 10})",
      "config");
  EXPECT_EQ(gemma.status().code(), StatusCode::kFailedPrecondition);
  const auto moe = ParseMaxTextModelConfig(
      R"({"model_type": "qwen3", "num_hidden_layers": 1, "hidden_size": 8, "num_experts": 4,
          "num_attention_heads": 2, "intermediate_size": 6, "vocab_size": 10})",
      "config");
  EXPECT_EQ(moe.status().code(), StatusCode::kFailedPrecondition);
  const auto missing = ParseMaxTextModelConfig(R"({"model_type": "llama"})", "config");
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
}

// Before: of two Adam states over one tree (two chains) the first was taken as the parameters'
// moments, and a nu without its mu was named as the parameter's exp_avg_sq in a DCP output.
TEST(OrbaxMomentsTest, TwoStatesOfOneParameterOrOneMomentAloneAreNoParametersState) {
  test_support::TempDir dir;
  WriteTree(dir.path(), {{{"params", "a", "w"}, "[2, 3]", "<f4"},
                         {{"params", "c"}, "[4]", "<f4"},
                         {{"opt_state", "0", "count"}, "[]", "<i4"},
                         {{"opt_state", "0", "mu", "a", "w"}, "[2, 3]", "<f4"},
                         {{"opt_state", "0", "nu", "a", "w"}, "[2, 3]", "<f4"},
                         {{"opt_state", "1", "mu", "a", "w"}, "[2, 3]", "<f4"},
                         {{"opt_state", "1", "nu", "a", "w"}, "[2, 3]", "<f4"},
                         {{"opt_state", "0", "nu", "c"}, "[4]", "<f4"}});
  auto c = OrbaxCheckpoint::Open(dir.path().string());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const OrbaxMoments m = FindOrbaxMoments(**c);
  for (const auto& [moment, of] : m.moments) {
    EXPECT_NE((*c)->arrays()[of.first].name, "params.a.w") << (*c)->arrays()[moment].name;
  }
  EXPECT_TRUE(m.counts.empty());
  auto source = OrbaxSource(*c, false);
  std::set<std::string> names;
  for (const ShardedParam& p : source->manifest().params) names.insert(p.name);
  EXPECT_EQ(names,
            (std::set<std::string>{"params.a.w", "params.c", "opt_state.0.count",
                                   "opt_state.0.mu.a.w", "opt_state.0.nu.a.w", "opt_state.1.mu.a.w",
                                   "opt_state.1.nu.a.w", "opt_state.0.nu.c"}));
}

// An OCDBT database written with small nodes (a tree three levels deep), values inline and out
// of line, put in reverse order: the reader finds every key and value, in the database and in
// the merged one over it that names its data file through a base path.
TEST(OcdbtWriterTest, RoundTripsThroughInteriorNodesAndTheMergedManifest) {
  test_support::TempDir dir;
  OcdbtWriteOptions options;
  options.max_inline_value_bytes = 16;
  options.target_node_bytes = 256;
  options.sync = false;
  auto w = OcdbtWriter::Create((dir / "ocdbt.process_0").string(), options);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  std::map<std::string, std::string> want;
  for (int i = 299; i >= 0; --i) {
    const std::string key = fmt::format("params.layer{}/c/{}/0", i / 7, i % 7);
    std::string value(static_cast<size_t>(i % 40), '\0');
    for (size_t k = 0; k < value.size(); ++k) value[k] = static_cast<char>(i * 31 + k);
    ASSERT_TRUE((*w)->Put(key, value).ok());
    want[key] = value;
  }
  EXPECT_EQ((*w)->Put("params.layer0/c/0/0", "again").code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*w)->Finish().ok());
  ASSERT_TRUE((*w)->WriteMerged(dir.path().string(), "ocdbt.process_0").ok());
  for (const std::string db : {"ocdbt.process_0", ""}) {
    const std::string path = (dir / db).string();
    auto manifest = ReadFileToString(path + "/manifest.ocdbt");
    ASSERT_TRUE(manifest.ok());
    auto root = ParseOcdbtManifest(std::as_bytes(std::span(*manifest)), "manifest");
    ASSERT_TRUE(root.ok()) << root.status().ToString();
    EXPECT_GE(root->height, 2) << db;
    EXPECT_EQ(root->generation, 1u);
    auto opened = OcdbtDatabase::Open(path);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    const OcdbtDatabase& read = **opened;
    ASSERT_EQ(read.keys().size(), want.size()) << db;
    for (const auto& [key, value] : want) {
      auto got = read.Read(key);
      ASSERT_TRUE(got.ok()) << key << " " << got.status().ToString() << " first "
                            << read.keys().begin()->first;
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(got->data()), got->size()), value)
          << db << " " << key;
      EXPECT_EQ(read.keys().at(key).is_inline, value.size() <= 16) << key;
    }
  }
}

TEST(OcdbtWriterTest, AnEmptyDatabaseOpensEmpty) {
  test_support::TempDir dir;
  auto w = OcdbtWriter::Create(dir.path().string());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE((*w)->Finish().ok());
  auto read = OcdbtDatabase::Open(dir.path().string());
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_TRUE((*read)->keys().empty());
}

// Parameters held in memory by a source's shards: int32 elements (plus `base`).
class MemorySource : public ShardSource {
 public:
  void Add(std::string name, const ParamMap& map, int32_t base) {
    manifest_.world_size = map.world_size();
    std::vector<int32_t> full(static_cast<size_t>(map.num_elements()));
    for (size_t i = 0; i < full.size(); ++i) {  // scattered bits: zstd cannot squeeze them
      full[i] = base + static_cast<int32_t>(static_cast<uint32_t>(i) * 2654435761u);
    }
    std::vector<std::vector<int32_t>> shards;
    for (Rank r = 0; r < map.world_size(); ++r) {
      shards.emplace_back(static_cast<size_t>(map.shard_num_elements(r)));
      EXPECT_TRUE(
          Extract(map, DType::kI32, r,
                  {reinterpret_cast<const std::byte*>(full.data()), map.num_elements()},
                  {reinterpret_cast<std::byte*>(shards.back().data()), map.shard_num_elements(r)})
              .ok());
    }
    manifest_.params.push_back({std::move(name), DType::kI32, map, std::nullopt, 1});
    data_.push_back(std::move(shards));
    full_.push_back(std::move(full));
  }
  const Manifest& manifest() const override { return manifest_; }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    std::vector<ConstBuffer> out;
    for (const std::vector<int32_t>& s : data_[i]) {
      out.push_back({reinterpret_cast<const std::byte*>(s.data()), static_cast<Index>(s.size())});
    }
    return out;
  }
  void ReleaseShards(size_t) override {}
  std::vector<std::string> inputs() const override { return {}; }
  const std::vector<int32_t>& full(size_t i) const { return full_[i]; }

 private:
  Manifest manifest_;
  std::vector<std::vector<std::vector<int32_t>>> data_;
  std::vector<std::vector<int32_t>> full_;
};

// "a.w" [8, 6] in row halves on two ranks, written split over both axes of an x=2,y=2 mesh
// (four chunks of 4 x 3), and "b" [5] replicated; `big` makes "a.w" [256, 6], chunks of
// 3 KiB that land out of line in the data file.
MemorySource TwoArrays(bool big = false) {
  MemorySource source;
  const Index rows = big ? 256 : 8;
  auto w = SplitMap({rows, 6}, 0, {rows / 2, rows / 2});
  EXPECT_TRUE(w.ok());
  source.Add("a.w", *w, 100);
  auto b = ReplicatedMap({5}, 2);
  EXPECT_TRUE(b.ok());
  source.Add("b", *b, -3);
  return source;
}

OrbaxTarget MeshTarget(OrbaxStorage storage, std::string_view specs) {
  auto t = ParseOrbaxTarget("x=2,y=2", specs);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  t->storage = storage;
  return *t;
}

TEST(OrbaxWriterTest, EveryStorageReadsBackWhatItWrote) {
  const std::pair<OrbaxStorage, std::string> storages[] = {{OrbaxStorage::kZarr3, "ocdbt+zarr3"},
                                                           {OrbaxStorage::kZarr2, "ocdbt+zarr2"},
                                                           {OrbaxStorage::kPlain, "zarr2"}};
  for (const auto& [storage, name] : storages) {
    for (const bool big : {false, true}) {
      SCOPED_TRACE(name + (big ? " big" : ""));
      test_support::TempDir dir;
      MemorySource source = TwoArrays(big);
      CheckpointOptions options;
      options.sync = false;
      const std::string out = (dir / "out").string();
      const Status written =
          WriteOrbax(source, MeshTarget(storage, R"({"a.w": ["x", "y"]})"), out, options);
      ASSERT_TRUE(written.ok()) << written.ToString();
      EXPECT_EQ(std::filesystem::exists(dir / "out" / "manifest.ocdbt"),
                storage != OrbaxStorage::kPlain);
      EXPECT_EQ(std::filesystem::exists(dir / "out" / "ocdbt.process_0" / "manifest.ocdbt"),
                storage != OrbaxStorage::kPlain);
      auto c = OrbaxCheckpoint::Open(out);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      EXPECT_EQ((*c)->storage(), name);
      ASSERT_EQ((*c)->arrays().size(), 2u);
      EXPECT_EQ((*c)->world_size(), 4);
      for (size_t i = 0; i < 2; ++i) {
        const OrbaxArray& a = (*c)->arrays()[i];
        const size_t k = a.name == "a.w" ? 0 : 1;
        const Shape chunk = k == 0 ? Shape{big ? 128 : 4, 3} : Shape{5};
        EXPECT_EQ(a.zarr.chunk_shape, chunk);
        EXPECT_EQ(a.zarr.zarr_format, storage == OrbaxStorage::kZarr3 ? 3 : 2);
        std::vector<int32_t> got(source.full(k).size(), -1);
        ASSERT_TRUE((*c)->ReadBox(i, Shape(a.zarr.shape.size(), 0), a.zarr.shape,
                                  std::as_writable_bytes(std::span(got)))
                        .ok());
        EXPECT_EQ(got, source.full(k)) << a.name;
      }
      if (storage != OrbaxStorage::kPlain) {
        auto db = OcdbtDatabase::Open((dir / "out" / "ocdbt.process_0").string());
        ASSERT_TRUE(db.ok()) << db.status().ToString();
        EXPECT_EQ((*db)->keys().size(), 2u + 4u + 1u);  // metadata of each, 4 + 1 chunks
        EXPECT_EQ(
            (*db)->keys().at(storage == OrbaxStorage::kZarr3 ? "a.w/c/1/1" : "a.w/1.1").is_inline,
            !big);
      }
    }
  }
}

// A failure part-way, after an array's chunks were written (a split of the second array that
// JAX refuses; a file size limit the data file runs into), leaves nothing where the output
// was to be: no output, no temporary.
TEST(OrbaxWriterTest, AWriteThatFailsPartWayLeavesNothing) {
  for (const OrbaxStorage storage :
       {OrbaxStorage::kZarr3, OrbaxStorage::kZarr2, OrbaxStorage::kPlain}) {
    test_support::TempDir dir;
    MemorySource source = TwoArrays(true);
    CheckpointOptions options;
    options.sync = false;
    const Status uneven =
        WriteOrbax(source, MeshTarget(storage, R"({"b": ["x"]})"), (dir / "out").string(), options);
    EXPECT_EQ(uneven.code(), StatusCode::kFailedPrecondition) << uneven.ToString();
    EXPECT_TRUE(dir.Listing().empty());
    // Writes past 4 KiB fail (EFBIG): the first out-of-line chunk is 3 KiB.
    struct rlimit old {};
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
    void (*handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = old;
    small.rlim_cur = 4096;
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
    const Status full = WriteOrbax(source, MeshTarget(storage, R"({"a.w": ["x", "y"]})"),
                                   (dir / "out").string(), options);
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
    std::signal(SIGXFSZ, handler);
    if (storage != OrbaxStorage::kPlain) {  // plain: each chunk a file of its own, under 4 KiB
      EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full.ToString();
      EXPECT_TRUE(dir.Listing().empty());
    }
  }
}

}  // namespace
}  // namespace reshard
