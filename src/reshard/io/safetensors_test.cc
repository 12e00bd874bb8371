#include "reshard/io/safetensors.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>

#include "reshard/base/index.h"
#include "reshard/base/temp_dir_testing.h"
#include "reshard/io/file.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

std::span<const std::byte> Bytes(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out;
}

// A file: the header length, the header as given (no padding), then `data_bytes` bytes.
std::string FileWith(std::string_view header, size_t data_bytes) {
  std::string out = LengthPrefix(header.size());
  out += header;
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<char>(i * 7 + 1));
  return out;
}

Result<SafetensorsHeader> Parse(std::string_view file) {
  return ParseSafetensorsHeader(Bytes(file), file.size());
}

// Bytes of a tensor whose values depend on the name, so misplaced data shows.
std::string PatternFor(const std::string& name, size_t size) {
  std::string out(size, '\0');
  uint32_t h = 2166136261u;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 16777619u;
  for (size_t i = 0; i < size; ++i) {
    h = h * 1103515245u + 12345u;
    out[i] = static_cast<char>(h >> 16);
  }
  return out;
}

TensorToWrite Tensor(std::string name, DType dtype, Shape shape) {
  TensorToWrite t{.name = name, .dtype = dtype, .shape = shape, .fill = {}};
  t.fill = [name](std::span<std::byte> out) {
    const std::string bytes = PatternFor(name, out.size());
    std::memcpy(out.data(), bytes.data(), out.size());
    return Status::Ok();
  };
  return t;
}

// What `write` returns with the file size limit at `bytes` (SIGXFSZ ignored, so that a write
// past it fails with EFBIG rather than killing the process).
Status UnderFileSizeLimit(rlim_t bytes, const std::function<Status()>& write) {
  struct rlimit old {};
  if (getrlimit(RLIMIT_FSIZE, &old) != 0) return InternalError("getrlimit failed");
  struct rlimit small = old;
  small.rlim_cur = bytes;
  if (setrlimit(RLIMIT_FSIZE, &small) != 0) return InternalError("setrlimit failed");
  auto previous = std::signal(SIGXFSZ, SIG_IGN);
  Status s = write();
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  return s;
}

// Tensors filled by rows written from memory, not in the file's pages.
constexpr WriteOptions kThroughMemory{.fill_in_place = false};

class SafetensorsTest : public ::testing::Test {
 protected:
  std::string Path(const std::string& name) const { return (tmp_ / name).string(); }
  size_t FileCount() const { return tmp_.Listing().size(); }
  std::string Contents(const std::string& name) const { return *ReadFileToString(Path(name)); }
  test_support::TempDir tmp_;
  const fs::path& dir_ = tmp_.path();
};

TEST_F(SafetensorsTest, EveryDTypeRoundTripsBitExactly) {
  std::vector<TensorToWrite> tensors;
  for (DType dtype : kAllDTypes) {
    tensors.push_back(Tensor(std::string("t.") + std::string(DTypeName(dtype)), dtype, {3, 5}));
  }
  ASSERT_TRUE(WriteSafetensors(Path("all.safetensors"), tensors).ok());
  Result<SafetensorsFile> file = SafetensorsFile::Open(Path("all.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_EQ(file->header().tensors.size(), std::size(kAllDTypes));
  for (DType dtype : kAllDTypes) {
    const std::string name = std::string("t.") + std::string(DTypeName(dtype));
    const TensorInfo* info = file->header().Find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->dtype, dtype);
    EXPECT_EQ(info->shape, (Shape{3, 5}));
    EXPECT_EQ(info->num_bytes(), 15 * DTypeSize(dtype));
    std::span<const std::byte> data = file->data(*info);
    const std::string expected = PatternFor(name, data.size());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(data.data()), data.size()), expected)
        << name;
  }
  // The header alone, read without mapping the file, is the same.
  Result<SafetensorsHeader> header = ReadSafetensorsHeader(Path("all.safetensors"));
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  ASSERT_EQ(header->tensors.size(), file->header().tensors.size());
  for (size_t i = 0; i < header->tensors.size(); ++i) {
    EXPECT_EQ(header->tensors[i].name, file->header().tensors[i].name);
    EXPECT_EQ(header->tensors[i].data_begin, file->header().tensors[i].data_begin);
  }
  EXPECT_EQ(header->data_offset % 8, 0u);
}

TEST_F(SafetensorsTest, TensorsAreLaidOutInTheReferenceOrder) {
  // Given in scrambled order; laid out by descending dtype rank, then name.
  std::vector<TensorToWrite> tensors = {
      Tensor("b", DType::kBool, {1}),   Tensor("z", DType::kF32, {1}),
      Tensor("a", DType::kF32, {1}),    Tensor("m", DType::kU64, {1}),
      Tensor("c", DType::kI64, {1}),    Tensor("d", DType::kF64, {1}),
      Tensor("e", DType::kF8E5M2, {1}), Tensor("f", DType::kF8E4M3, {1}),
      Tensor("g", DType::kBF16, {1}),   Tensor("h", DType::kF16, {1}),
      Tensor("i", DType::kU16, {1}),    Tensor("j", DType::kI16, {1}),
      Tensor("k", DType::kI8, {1}),     Tensor("l", DType::kU8, {1}),
      Tensor("n", DType::kU32, {1}),    Tensor("o", DType::kI32, {1})};
  ASSERT_TRUE(WriteSafetensors(Path("o.safetensors"), tensors).ok());
  Result<SafetensorsHeader> header = ReadSafetensorsHeader(Path("o.safetensors"));
  ASSERT_TRUE(header.ok());
  std::string order;
  for (const TensorInfo& t : header->tensors) order += t.name;
  EXPECT_EQ(order, "mcdaznoghijfeklb");
  // The header text lists keys in that same order.
  const std::string text = Contents("o.safetensors");
  EXPECT_LT(text.find("\"m\":"), text.find("\"c\":"));
  EXPECT_LT(text.find("\"l\":"), text.find("\"b\":"));
}

TEST_F(SafetensorsTest, BytesMatchTheReferenceWriter) {
  // Fixed vectors of the reference writer: one F32 tensor; nothing at all; metadata only.
  auto f32 = [](std::span<std::byte> out) {
    const float values[] = {0, 1, 2, 3, 4, 5};
    std::memcpy(out.data(), values, sizeof values);
    return Status::Ok();
  };
  ASSERT_TRUE(
      WriteSafetensors(Path("a.safetensors"),
                       {{.name = "attn.0", .dtype = DType::kF32, .shape = {1, 2, 3}, .fill = f32}})
          .ok());
  std::string expected =
      LengthPrefix(64) + R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  const float values[] = {0, 1, 2, 3, 4, 5};
  expected.append(reinterpret_cast<const char*>(values), sizeof values);
  EXPECT_EQ(Contents("a.safetensors"), expected);

  ASSERT_TRUE(WriteSafetensors(Path("empty.safetensors"), {}).ok());
  EXPECT_EQ(Contents("empty.safetensors"), LengthPrefix(8) + "{}      ");

  ASSERT_TRUE(WriteSafetensors(Path("meta.safetensors"), {}, {{"framework", "pt"}}).ok());
  EXPECT_EQ(Contents("meta.safetensors"),
            LengthPrefix(40) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
}

TEST_F(SafetensorsTest, ZeroElementTensorsAndScalars) {
  ASSERT_TRUE(
      WriteSafetensors(Path("z.safetensors"),
                       {Tensor("empty", DType::kBF16, {0}), Tensor("empty2d", DType::kF32, {4, 0}),
                        Tensor("scalar", DType::kF64, {}), Tensor("x", DType::kF32, {2})})
          .ok());
  Result<SafetensorsFile> file = SafetensorsFile::Open(Path("z.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->header().data_size, 8u + 8u);
  EXPECT_EQ(file->data(*file->header().Find("empty")).size(), 0u);
  EXPECT_EQ(file->header().Find("empty2d")->shape, (Shape{4, 0}));
  const TensorInfo* scalar = file->header().Find("scalar");
  EXPECT_EQ(scalar->shape, Shape{});
  EXPECT_EQ(scalar->num_bytes(), 8u);
  std::span<const std::byte> x = file->data(*file->header().Find("x"));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(x.data()), x.size()), PatternFor("x", 8));
}

TEST_F(SafetensorsTest, FileWithNoTensorsOpens) {
  ASSERT_TRUE(WriteSafetensors(Path("e.safetensors"), {}).ok());
  Result<SafetensorsFile> file = SafetensorsFile::Open(Path("e.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_TRUE(file->header().tensors.empty());
  EXPECT_TRUE(file->header().metadata.empty());
  EXPECT_EQ(file->header().data_offset, 16u);
  EXPECT_EQ(file->header().data_size, 0u);
  // Moving keeps the mapping valid.
  SafetensorsFile moved = std::move(file).value();
  EXPECT_EQ(moved.header().data_offset, 16u);
}

TEST_F(SafetensorsTest, MetadataRoundTripsWithEscapes) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"quote\"back\\slash", "tab\tnewline\nbell\x07"}, {"ünï", "€"}};
  ASSERT_TRUE(
      WriteSafetensors(Path("m.safetensors"), {Tensor("w", DType::kF16, {2})}, metadata).ok());
  Result<SafetensorsHeader> header = ReadSafetensorsHeader(Path("m.safetensors"));
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  EXPECT_EQ(header->metadata, metadata);
  const std::string text = Contents("m.safetensors");
  EXPECT_NE(text.find(R"("quote\"back\\slash":"tab\tnewline\nbell\u0007")"), std::string::npos);
  EXPECT_NE(text.find("\"ünï\":\"€\""), std::string::npos);
}

TEST_F(SafetensorsTest, ReaderAcceptsWhatTheReferenceAccepts) {
  // Unknown keys in an entry, null metadata, any key order, whitespace, no padding.
  const std::string file =
      FileWith(R"( { "b" : {"data_offsets":[2,6],"extra":{"x":[1,[2]]},"shape":[1],"dtype":"I32"},)"
               R"( "__metadata__": null, "a": {"dtype":"U8","shape":[2],"data_offsets":[0,2]} } )",
               6);
  Result<SafetensorsHeader> header = Parse(file);
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  ASSERT_EQ(header->tensors.size(), 2u);
  EXPECT_EQ(header->tensors[0].name, "a");  // data order, not header order
  EXPECT_EQ(header->tensors[1].name, "b");
  EXPECT_TRUE(header->metadata.empty());
  EXPECT_EQ(header->data_size, 6u);
}

enum class Corruption {
  kEmptyFile,
  kShorterThan8,
  kHeaderPastEnd,
  kHeaderOver100MB,
  kInvalidUtf8,
  kInvalidJson,
  kNotAnObject,
  kUnknownDType,
  kShapeBytesMismatch,
  kOverlap,
  kGap,
  kNotStartingAtZero,
  kEndBeforeBegin,
  kDuplicateName,
  kTruncatedData,
  kTrailingBytes,
  kMetadataValueNotString,
  kMetadataNotMap,
  kNegativeShape,
  kNonIntegerShape,
  kMissingOffsets,
  kOffsetsNotPair,
  kTooDeep,
  kEntryNotObject,
  kBytesAfterObject,
  kNulInsideObject,
};

struct CorruptCase {
  Corruption kind;
  std::string file;
  std::string message;
};

std::vector<CorruptCase> CorruptCases() {
  auto one = [](std::string_view entry) { return std::string(R"({"a":)") + entry.data() + "}"; };
  std::string deep = R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":)";
  for (int i = 0; i < 100; ++i) deep += "[";
  for (int i = 0; i < 100; ++i) deep += "]";
  deep += "}}";
  return {
      {Corruption::kEmptyFile, "", "file is 0 bytes, too short to hold the 8-byte header length"},
      {Corruption::kShorterThan8, "abcde",
       "file is 5 bytes, too short to hold the 8-byte header length"},
      {Corruption::kHeaderPastEnd, LengthPrefix(1000) + std::string(60, ' '),
       "header length 1000 runs past the end of the file: 8 + 1000 > 68 bytes"},
      {Corruption::kHeaderOver100MB, LengthPrefix(1000000000) + "{}",
       "header length 1000000000 exceeds the 100 MB limit"},
      {Corruption::kInvalidUtf8,
       FileWith("{\"a\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
       "header is not valid UTF-8: byte 0xff at offset 11"},
      {Corruption::kInvalidJson, FileWith(R"({"a":{"dtype":"U8",}})", 0),
       "header is not valid JSON: parse error at line 1, column 20: syntax error while parsing "
       "object key - unexpected '}'; expected string literal"},
      {Corruption::kNotAnObject, FileWith("[1, 2]", 0), "header is an array, not a JSON object"},
      {Corruption::kUnknownDType,
       FileWith(one(R"({"dtype":"F17","shape":[1],"data_offsets":[0,1]})"), 1),
       "tensor \"a\": unknown dtype \"F17\""},
      {Corruption::kShapeBytesMismatch,
       FileWith(R"({"a.weight":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,30]}})", 30),
       "tensor \"a.weight\": shape [4, 4] of BF16 is 32 bytes but data_offsets [0, 30] span 30"},
      {Corruption::kOverlap,
       FileWith(R"({"b":{"dtype":"F32","shape":[8],"data_offsets":[16,48]},)"
                R"("a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})",
                48),
       "tensors \"a\" [0, 32) and \"b\" [16, 48) overlap"},
      {Corruption::kGap,
       FileWith(R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]},)"
                R"("b":{"dtype":"F32","shape":[8],"data_offsets":[40,72]}})",
                72),
       "gap in the data section: bytes [32, 40) belong to no tensor"},
      {Corruption::kNotStartingAtZero,
       FileWith(one(R"({"dtype":"F32","shape":[2],"data_offsets":[8,16]})"), 16),
       "data_offsets do not start at 0: the first tensor \"a\" begins at 8"},
      {Corruption::kEndBeforeBegin,
       FileWith(one(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})"), 8),
       "tensor \"a\": data_offsets [8, 0] end before they begin"},
      {Corruption::kDuplicateName,
       FileWith(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                2),
       "duplicate tensor name \"a\""},
      {Corruption::kTruncatedData,
       FileWith(one(R"({"dtype":"F32","shape":[16],"data_offsets":[0,64]})"), 40),
       "file is truncated: the header declares 64 data bytes but only 40 follow it"},
      {Corruption::kTrailingBytes,
       FileWith(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), 18),
       "data section has 10 trailing bytes after the last tensor"},
      {Corruption::kMetadataValueNotString, FileWith(R"({"__metadata__":{"k":1}})", 0),
       "__metadata__[\"k\"] is a number, not a string"},
      {Corruption::kMetadataNotMap, FileWith(R"({"__metadata__":["k"]})", 0),
       "__metadata__ is an array, not a string-to-string map"},
      {Corruption::kNegativeShape,
       FileWith(one(R"({"dtype":"U8","shape":[-2],"data_offsets":[0,0]})"), 0),
       "tensor \"a\": shape[0] is -2, not a non-negative integer"},
      {Corruption::kNonIntegerShape,
       FileWith(one(R"({"dtype":"U8","shape":[2.0],"data_offsets":[0,2]})"), 2),
       "tensor \"a\": shape[0] is 2.0, not a non-negative integer"},
      {Corruption::kMissingOffsets, FileWith(one(R"({"dtype":"U8","shape":[2]})"), 2),
       "tensor \"a\": no \"data_offsets\""},
      {Corruption::kOffsetsNotPair,
       FileWith(one(R"({"dtype":"U8","shape":[2],"data_offsets":[2]})"), 2),
       "tensor \"a\": data_offsets [2] is not a [begin, end] pair"},
      {Corruption::kTooDeep, FileWith(deep, 0), "header nests deeper than 64 levels"},
      {Corruption::kEntryNotObject, FileWith(R"({"a":"U8"})", 0),
       "tensor \"a\": entry is a string, not an object"},
      {Corruption::kBytesAfterObject,
       FileWith(one(R"({"dtype":"U8","shape":[2],"data_offsets":[0,2]})") +
                    std::string("\0{\"evil\":{\"dtype\":\"U8\",\"shape\":[2]}}", 36),
                2),
       "header has 36 bytes after its JSON object, from a NUL byte at offset 61; only "
       "whitespace may follow the object"},
      {Corruption::kNulInsideObject,
       FileWith(
           std::string("{\"a\0\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 54), 1),
       "header is not valid JSON: a NUL byte at offset 11"},
  };
}

TEST_F(SafetensorsTest, EveryCorruptionIsRefusedWithItsOwnMessage) {
  const std::vector<CorruptCase> cases = CorruptCases();
  std::set<Corruption> kinds;
  std::set<std::string> messages;
  for (const CorruptCase& c : cases) {
    SCOPED_TRACE(static_cast<int>(c.kind));
    kinds.insert(c.kind);
    Result<SafetensorsHeader> parsed = Parse(c.file);
    ASSERT_FALSE(parsed.ok()) << c.message;
    EXPECT_EQ(parsed.status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(parsed.status().message(), c.message);
    messages.insert(parsed.status().message());

    // The same through the file readers, which name the file.
    const std::string path = Path("bad.safetensors");
    ASSERT_TRUE(WriteFileAtomically(path, c.file, {.overwrite = true}).ok());
    const std::string expected = "reading \"" + path + "\": " + c.message;
    Result<SafetensorsFile> opened = SafetensorsFile::Open(path);
    ASSERT_FALSE(opened.ok());
    EXPECT_EQ(opened.status(), Status(StatusCode::kDataLoss, expected));
    Result<SafetensorsHeader> header = ReadSafetensorsHeader(path);
    ASSERT_FALSE(header.ok());
    EXPECT_EQ(header.status(), Status(StatusCode::kDataLoss, expected));
  }
  EXPECT_EQ(kinds.size(), cases.size()) << "one case per kind";
  EXPECT_EQ(messages.size(), cases.size()) << "each kind its own message";
}

TEST_F(SafetensorsTest, EveryTruncationAndByteFlipOfAValidFileIsHandled) {
  ASSERT_TRUE(WriteSafetensors(Path("v.safetensors"),
                               {Tensor("a", DType::kF32, {2, 2}), Tensor("b", DType::kU8, {3})},
                               {{"k", "v"}})
                  .ok());
  const std::string good = Contents("v.safetensors");
  ASSERT_TRUE(Parse(good).ok());
  for (size_t n = 0; n < good.size(); ++n) {
    Result<SafetensorsHeader> r = Parse(std::string_view(good).substr(0, n));
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << "prefix of " << n << " bytes";
  }
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const uint64_t header_end = Parse(good)->data_offset;
  for (int i = 0; i < 2000; ++i) {
    std::string bad = good;
    const size_t at = rng() % header_end;
    bad[at] = static_cast<char>(rng());
    Result<SafetensorsHeader> r = Parse(bad);
    if (r.ok()) {
      // Whatever still parses must still tile the data section.
      uint64_t end = 0;
      for (const TensorInfo& t : r->tensors) {
        EXPECT_EQ(t.data_begin, end);
        end = t.data_end;
      }
      EXPECT_EQ(r->data_offset + r->data_size, bad.size());
    } else {
      EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
    }
  }
}

TEST_F(SafetensorsTest, ParserRefusesAPrefixThatIsTooShort) {
  const std::string file = FileWith(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1);
  Result<SafetensorsHeader> r =
      ParseSafetensorsHeader(Bytes(std::string_view(file).substr(0, 20)), file.size());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  // The exact header (without data) is enough.
  EXPECT_TRUE(
      ParseSafetensorsHeader(Bytes(std::string_view(file).substr(0, file.size() - 1)), file.size())
          .ok());
}

TEST_F(SafetensorsTest, WriterRefusesBadTensorsBeforeWriting) {
  auto code = [&](std::vector<TensorToWrite> tensors) {
    return WriteSafetensors(Path("w.safetensors"), std::move(tensors)).code();
  };
  EXPECT_EQ(code({Tensor("a", DType::kU8, {1}), Tensor("a", DType::kF32, {1})}),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code({Tensor("__metadata__", DType::kU8, {1})}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({Tensor("a", DType::kU8, {2, -1})}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({Tensor("bad\xff", DType::kU8, {1})}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{.name = "a", .dtype = DType::kU8, .shape = {1}, .fill = {}}}),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code({Tensor("a", DType::kF64, {Index{1} << 61, 4})}), StatusCode::kInvalidArgument);
  EXPECT_EQ(FileCount(), 0u);
}

TEST_F(SafetensorsTest, RangesCopiedByTheFileSystemGiveTheBytesTheFillsGive) {
  // A source file whose bytes the tensors of the output take, as ranges, in pieces.
  const std::string source = PatternFor("source", 400000);
  ASSERT_TRUE(WriteFileAtomically(Path("source.bin"), source).ok());
  auto from_source = [&](std::string name, Shape shape, const std::vector<FileRange>& ranges) {
    TensorToWrite t{.name = name, .dtype = DType::kU8, .shape = shape, .fill = {}};
    t.fill = [&source, ranges](std::span<std::byte> out) {
      size_t at = 0;
      for (const FileRange& r : ranges) {
        std::memcpy(out.data() + at, source.data() + r.offset, r.length);
        at += r.length;
      }
      return Status::Ok();
    };
    return t;
  };
  const std::string src = Path("source.bin");
  ASSERT_TRUE(WriteFileAtomically(Path("short.bin"), "12345").ok());
  struct Run {
    const char* name;
    bool copy;
    int copied = 0;
    int filled = 0;
  } runs[] = {{"fast.safetensors", true}, {"slow.safetensors", false}};
  for (Run& run : runs) {
    const std::vector<std::vector<FileRange>> ranges = {
        {{src, 5, 1000}},
        {{src, 300000, 100000}, {src, 0, 100000}, {src, 100000, 100000}},
        {},
        // A range past the source's end: the file system copies less, the fill writes it all.
        {{Path("short.bin"), 0, 10}},
    };
    std::vector<TensorToWrite> tensors = {
        from_source("whole", {1000}, ranges[0]),
        from_source("stacked", {3, 100000}, ranges[1]),
        Tensor("filled", DType::kF32, {10}),
        from_source("short", {10}, {}),
    };
    tensors[3].fill = [](std::span<std::byte> out) {
      std::memset(out.data(), 'z', out.size());
      return Status::Ok();
    };
    std::vector<TensorCopy> copies;
    for (size_t i = 0; i < tensors.size(); ++i) {
      copies.push_back({ranges[i], [&run] { ++run.copied; }});
      tensors[i].fill = [&run, inner = tensors[i].fill](std::span<std::byte> out) {
        ++run.filled;
        return inner(out);
      };
    }
    ASSERT_TRUE(WriteSafetensors(Path(run.name), std::move(tensors), {},
                                 {.copy_file_ranges = run.copy}, std::move(copies))
                    .ok());
  }
  EXPECT_EQ(Contents("fast.safetensors"), Contents("slow.safetensors"));
  EXPECT_EQ(runs[0].copied, 2);  // whole and stacked
  EXPECT_EQ(runs[0].filled, 2);  // filled and short
  EXPECT_EQ(runs[1].copied, 0);
  EXPECT_EQ(runs[1].filled, 4);
  Result<SafetensorsFile> f = SafetensorsFile::Open(Path("fast.safetensors"));
  ASSERT_TRUE(f.ok());
  auto bytes_of = [&](const std::string& name) {
    for (const TensorInfo& t : f->header().tensors) {
      if (t.name != name) continue;
      const std::span<const std::byte> d = f->data(t);
      return std::string(reinterpret_cast<const char*>(d.data()), d.size());
    }
    return std::string();
  };
  EXPECT_EQ(bytes_of("stacked"), source.substr(300000, 100000) + source.substr(0, 200000));
  EXPECT_EQ(bytes_of("short"), std::string(10, 'z'));
}

TEST_F(SafetensorsTest, RangesThatDoNotAddUpToTheTensorAreRefusedBeforeWriting) {
  for (const uint64_t length : {uint64_t{3}, uint64_t{5}, uint64_t{0}}) {
    const Status s = WriteSafetensors(Path("r.safetensors"), {Tensor("r", DType::kU8, {4})}, {}, {},
                                      {{{{Path("any"), 0, length}}, {}}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << length;
    EXPECT_NE(s.message().find("tensor \"r\": its file ranges hold"), std::string::npos)
        << s.message();
  }
  // One copy for two tensors.
  EXPECT_EQ(WriteSafetensors(Path("r.safetensors"),
                             {Tensor("a", DType::kU8, {4}), Tensor("b", DType::kU8, {4})}, {}, {},
                             {TensorCopy{}})
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(FileCount(), 0u);
}

TEST_F(SafetensorsTest, ExistingOutputIsKeptWithoutOverwrite) {
  ASSERT_TRUE(WriteSafetensors(Path("x.safetensors"), {Tensor("a", DType::kU8, {1})}).ok());
  const std::string before = Contents("x.safetensors");
  EXPECT_EQ(WriteSafetensors(Path("x.safetensors"), {Tensor("b", DType::kU8, {1})}).code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(Contents("x.safetensors"), before);
  ASSERT_TRUE(WriteSafetensors(Path("x.safetensors"), {Tensor("b", DType::kU8, {1})}, {},
                               {.overwrite = true})
                  .ok());
  EXPECT_NE(Contents("x.safetensors"), before);
  EXPECT_EQ(FileCount(), 1u);
}

TEST_F(SafetensorsTest, FillsShareOneBufferInFileOrder) {
  std::vector<const std::byte*> buffers;
  std::vector<std::string> calls;
  auto tracked = [&](std::string name, DType dtype, Shape shape) {
    TensorToWrite t = Tensor(name, dtype, shape);
    t.fill = [&, name, inner = t.fill](std::span<std::byte> out) {
      calls.push_back(name);
      if (!out.empty()) buffers.push_back(out.data());
      return inner(out);
    };
    return t;
  };
  ASSERT_TRUE(WriteSafetensors(Path("s.safetensors"), {tracked("small", DType::kU8, {3}),
                                                       tracked("big", DType::kF32, {1000}),
                                                       tracked("mid", DType::kF16, {10})})
                  .ok());
  EXPECT_EQ(calls, (std::vector<std::string>{"big", "mid", "small"}));
  ASSERT_EQ(buffers.size(), 3u);
  EXPECT_EQ(buffers[0], buffers[1]);
  EXPECT_EQ(buffers[1], buffers[2]);
}

// Writing through memory (WriteOptions::fill_in_place off, or a file system that cannot
// reserve and map a range), a tensor filled by rows gives the bytes its whole fill gives, band
// by band, in two bands of memory, the fill itself never called.
TEST_F(SafetensorsTest, TensorsFilledByBandsOfRowsGiveTheBytesOfTheirFill) {
  const Shape shape = {23, 5};  // 7 bands of 3 rows and one of 2: the last band is short
  TensorToWrite banded = Tensor("w", DType::kF32, shape);
  const std::string whole = PatternFor("w", 23 * 5 * 4);
  std::vector<std::pair<Index, Index>> bands;
  std::set<const std::byte*> memory;
  banded.fill = [](std::span<std::byte>) { return InternalError("the whole fill was called"); };
  banded.band_rows = 3;
  banded.fill_rows = [&](Index begin, Index end, std::span<std::byte> out) {
    bands.emplace_back(begin, end);
    memory.insert(out.data());
    EXPECT_EQ(out.size(), static_cast<size_t>(end - begin) * 20);
    std::memcpy(out.data(), whole.data() + begin * 20, out.size());
    return Status::Ok();
  };
  ASSERT_TRUE(WriteSafetensors(Path("b.safetensors"), {banded, Tensor("s", DType::kU8, {3})}, {},
                               kThroughMemory)
                  .ok());
  ASSERT_TRUE(WriteSafetensors(Path("w.safetensors"),
                               {Tensor("w", DType::kF32, shape), Tensor("s", DType::kU8, {3})})
                  .ok());
  EXPECT_EQ(Contents("b.safetensors"), Contents("w.safetensors"));
  ASSERT_EQ(bands.size(), 8u);
  for (size_t b = 0; b < bands.size(); ++b) {
    EXPECT_EQ(bands[b].first, static_cast<Index>(3 * b));
    EXPECT_EQ(bands[b].second, std::min<Index>(23, static_cast<Index>(3 * b + 3)));
  }
  EXPECT_EQ(memory.size(), 2u);  // two bands' buffers, used in turn
}

// A band that fails to fill (on the thread beside the writing) leaves nothing behind.
TEST_F(SafetensorsTest, ABandThatFailsLeavesNothingBehind) {
  TensorToWrite banded = Tensor("w", DType::kF32, {10, 4});
  banded.band_rows = 2;
  banded.fill_rows = [](Index begin, Index, std::span<std::byte> out) {
    if (begin == 6) return UnavailableError("source went away");
    std::memset(out.data(), 1, out.size());
    return Status::Ok();
  };
  for (const WriteOptions& options : {kThroughMemory, WriteOptions{}}) {
    Status s = WriteSafetensors(Path("f.safetensors"), {banded}, {}, options);
    EXPECT_EQ(s, Status(StatusCode::kUnavailable, "tensor \"w\": source went away"));
    EXPECT_EQ(FileCount(), 0u);
  }
}

// The path of the file mapped at `address` in this process ("" where none is).
std::string MappedFileAt(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  for (std::string line; std::getline(maps, line);) {
    std::istringstream in(line);
    std::string range, perms, offset, device, inode, path;
    in >> range >> perms >> offset >> device >> inode >> path;
    const size_t dash = range.find('-');
    const uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (at >= lo && at < hi) return path;
  }
  return "";
}

// By default a tensor filled by rows is filled band by band straight into the pages of the
// file being written (no band in memory), a tensor of one band too, and the file holds the
// bytes its whole fill gives.
TEST_F(SafetensorsTest, TensorsFilledByRowsAreFilledInTheFilesPages) {
  const Shape shape = {23, 5};
  std::map<std::string, std::vector<std::pair<Index, Index>>> bands;
  std::set<std::string> mapped;
  auto banded = [&](const std::string& name, Shape s, Index band_rows) {
    TensorToWrite t = Tensor(name, DType::kF32, s);
    const std::string whole = PatternFor(name, static_cast<size_t>(ProductOf(s)) * 4);
    const auto row = static_cast<size_t>(ProductOf(s) / s[0]) * 4;
    t.fill = [](std::span<std::byte>) { return InternalError("the whole fill was called"); };
    t.band_rows = band_rows;
    t.fill_rows = [&, name, whole, row](Index begin, Index end, std::span<std::byte> out) {
      bands[name].emplace_back(begin, end);
      mapped.insert(MappedFileAt(out.data()));
      EXPECT_EQ(out.size(), static_cast<size_t>(end - begin) * row);
      std::memcpy(out.data(), whole.data() + static_cast<size_t>(begin) * row, out.size());
      return Status::Ok();
    };
    return t;
  };
  ASSERT_TRUE(WriteSafetensors(
                  Path("b.safetensors"),
                  {banded("w", shape, 3), Tensor("s", DType::kU8, {3}), banded("one", {2, 3}, 4)})
                  .ok());
  ASSERT_TRUE(WriteSafetensors(Path("w.safetensors"),
                               {Tensor("w", DType::kF32, shape), Tensor("s", DType::kU8, {3}),
                                Tensor("one", DType::kF32, {2, 3})})
                  .ok());
  EXPECT_EQ(Contents("b.safetensors"), Contents("w.safetensors"));
  ASSERT_EQ(bands["w"].size(), 8u);  // the last band short
  for (size_t b = 0; b < 8; ++b) {
    EXPECT_EQ(bands["w"][b].first, static_cast<Index>(3 * b));
    EXPECT_EQ(bands["w"][b].second, std::min<Index>(23, static_cast<Index>(3 * b + 3)));
  }
  EXPECT_EQ(bands["one"], (std::vector<std::pair<Index, Index>>{{0, 2}}));  // in one band
  // Every band lay in a mapping of the file being written (its temporary beside the output).
  ASSERT_EQ(mapped.size(), 1u);
  EXPECT_EQ(fs::path(*mapped.begin()).parent_path(), dir_);
  EXPECT_NE(*mapped.begin(), Path("b.safetensors"));
}

// A file size limit is found when the range is reserved, before any band is filled.
TEST_F(SafetensorsTest, AFileSizeLimitStopsAnInPlaceFillBeforeItStarts) {
  TensorToWrite banded = Tensor("w", DType::kF32, {64, 64});
  int fills = 0;
  banded.band_rows = 8;
  banded.fill_rows = [&](Index, Index, std::span<std::byte>) {
    ++fills;
    return Status::Ok();
  };
  Status s =
      UnderFileSizeLimit(4096, [&] { return WriteSafetensors(Path("big.safetensors"), {banded}); });
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_EQ(fills, 0);
  EXPECT_EQ(FileCount(), 0u);
}

TEST_F(SafetensorsTest, FailingFillLeavesNothingBehind) {
  TensorToWrite bad = Tensor("bad", DType::kU8, {4});
  bad.fill = [](std::span<std::byte>) { return UnavailableError("source went away"); };
  Status s = WriteSafetensors(Path("f.safetensors"), {Tensor("a", DType::kF32, {4}), bad});
  EXPECT_EQ(s, Status(StatusCode::kUnavailable, "tensor \"bad\": source went away"));
  EXPECT_EQ(FileCount(), 0u);
}

TEST_F(SafetensorsTest, FullDiskLeavesNothingBehind) {
  // A file size limit makes write() fail part-way.
  Status s = UnderFileSizeLimit(4096, [&] {
    return WriteSafetensors(Path("big.safetensors"),
                            {Tensor("a", DType::kF32, {1024}), Tensor("b", DType::kF32, {1024})});
  });
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_EQ(FileCount(), 0u);
}

TEST_F(SafetensorsTest, MissingAndNonRegularFilesAreNamed) {
  Result<SafetensorsFile> missing = SafetensorsFile::Open(Path("nope.safetensors"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.safetensors"), std::string::npos);
  EXPECT_EQ(SafetensorsFile::Open(dir_.string()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadSafetensorsHeader(dir_.string()).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace reshard
