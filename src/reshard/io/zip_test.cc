#include "reshard/io/zip.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace reshard {
namespace {

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

void Put(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void Set(std::string& out, size_t at, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out[at + static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
}

struct Built {
  std::string bytes;
  std::vector<size_t> local;    // offset of each local header
  std::vector<size_t> central;  // offset of each central record
  size_t directory = 0;         // offset of the central directory
  size_t end = 0;               // offset of the end record
};

struct Options {
  bool zip64 = false;           // sizes and offsets through ZIP64 extra fields and records
  bool data_descriptor = true;  // as torch writes: flag bit 3, zero sizes in local headers
  std::string comment;
};

// A stored zip archive of `entries` (name, data), built the way torch's writer lays it out.
Built Build(const std::vector<std::pair<std::string, std::string>>& entries,
            const Options& opt = {}) {
  Built b;
  const uint16_t flags = opt.data_descriptor ? 0x0808 : 0x0800;
  for (const auto& [name, data] : entries) {
    b.local.push_back(b.bytes.size());
    Put(b.bytes, 0x04034b50, 4);
    Put(b.bytes, 20, 2);
    Put(b.bytes, flags, 2);
    Put(b.bytes, 0, 2);
    Put(b.bytes, 0, 4);
    Put(b.bytes, Crc32(Bytes(data)), 4);
    const uint64_t size = opt.data_descriptor ? 0 : data.size();
    Put(b.bytes, size, 4);
    Put(b.bytes, size, 4);
    Put(b.bytes, name.size(), 2);
    Put(b.bytes, 0, 2);
    b.bytes += name;
    b.bytes += data;
    if (opt.data_descriptor) {
      Put(b.bytes, 0x08074b50, 4);
      Put(b.bytes, Crc32(Bytes(data)), 4);
      Put(b.bytes, data.size(), 4);
      Put(b.bytes, data.size(), 4);
    }
  }
  b.directory = b.bytes.size();
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& [name, data] = entries[i];
    b.central.push_back(b.bytes.size());
    Put(b.bytes, 0x02014b50, 4);
    Put(b.bytes, 45, 2);
    Put(b.bytes, 45, 2);
    Put(b.bytes, flags, 2);
    Put(b.bytes, 0, 2);
    Put(b.bytes, 0, 4);
    Put(b.bytes, Crc32(Bytes(data)), 4);
    Put(b.bytes, opt.zip64 ? 0xffffffffu : data.size(), 4);
    Put(b.bytes, opt.zip64 ? 0xffffffffu : data.size(), 4);
    Put(b.bytes, name.size(), 2);
    Put(b.bytes, opt.zip64 ? 28 : 0, 2);
    Put(b.bytes, 0, 2);
    Put(b.bytes, 0, 2);
    Put(b.bytes, 0, 2);
    Put(b.bytes, 0, 4);
    Put(b.bytes, opt.zip64 ? 0xffffffffu : b.local[i], 4);
    b.bytes += name;
    if (opt.zip64) {
      Put(b.bytes, 0x0001, 2);
      Put(b.bytes, 24, 2);
      Put(b.bytes, data.size(), 8);
      Put(b.bytes, data.size(), 8);
      Put(b.bytes, b.local[i], 8);
    }
  }
  const size_t directory_size = b.bytes.size() - b.directory;
  if (opt.zip64) {
    const size_t record = b.bytes.size();
    Put(b.bytes, 0x06064b50, 4);
    Put(b.bytes, 44, 8);
    Put(b.bytes, 45, 2);
    Put(b.bytes, 45, 2);
    Put(b.bytes, 0, 4);
    Put(b.bytes, 0, 4);
    Put(b.bytes, entries.size(), 8);
    Put(b.bytes, entries.size(), 8);
    Put(b.bytes, directory_size, 8);
    Put(b.bytes, b.directory, 8);
    Put(b.bytes, 0x07064b50, 4);
    Put(b.bytes, 0, 4);
    Put(b.bytes, record, 8);
    Put(b.bytes, 1, 4);
  }
  b.end = b.bytes.size();
  Put(b.bytes, 0x06054b50, 4);
  Put(b.bytes, 0, 4);
  Put(b.bytes, opt.zip64 ? 0xffff : entries.size(), 2);
  Put(b.bytes, opt.zip64 ? 0xffff : entries.size(), 2);
  Put(b.bytes, opt.zip64 ? 0xffffffffu : directory_size, 4);
  Put(b.bytes, opt.zip64 ? 0xffffffffu : b.directory, 4);
  Put(b.bytes, opt.comment.size(), 2);
  b.bytes += opt.comment;
  return b;
}

const std::vector<std::pair<std::string, std::string>> kEntries = {
    {"archive/data.pkl", "\x80\x02N."},
    {"archive/data/0", std::string(24, 'x')},
    {"archive/data/1", ""},
    {"archive/byteorder", "little"}};

void ExpectReads(const Built& b, bool zip64) {
  Result<ZipArchive> zip = ZipArchive::Parse(Bytes(b.bytes));
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  EXPECT_EQ(zip->zip64(), zip64);
  ASSERT_EQ(zip->entries().size(), kEntries.size());
  for (size_t i = 0; i < kEntries.size(); ++i) {
    const ZipEntry* e = zip->Find(kEntries[i].first);
    ASSERT_NE(e, nullptr) << kEntries[i].first;
    EXPECT_EQ(e, &zip->entries()[i]);
    const std::span<const std::byte> data = zip->data(*e);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(data.data()), data.size()),
              kEntries[i].second);
    EXPECT_EQ(data.data(), Bytes(b.bytes).data() + e->data_offset);  // no copy
    EXPECT_EQ(e->crc32, Crc32(data));
  }
  EXPECT_EQ(zip->Find("archive/data/2"), nullptr);
}

TEST(ZipTest, ReadsStoredEntriesInPlace) { ExpectReads(Build(kEntries), false); }

TEST(ZipTest, ReadsWithoutDataDescriptorsAndWithAComment) {
  ExpectReads(Build(kEntries, {.zip64 = false, .data_descriptor = false, .comment = "PK\x05\x06"}),
              false);
}

TEST(ZipTest, ReadsZip64RecordsAndExtraFields) {
  ExpectReads(Build(kEntries, {.zip64 = true, .data_descriptor = true, .comment = ""}), true);
}

TEST(ZipTest, EmptyArchive) {
  Result<ZipArchive> zip = ZipArchive::Parse(Bytes(Build({}).bytes));
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  EXPECT_TRUE(zip->entries().empty());
}

TEST(ZipTest, Crc32OfKnownString) { EXPECT_EQ(Crc32(Bytes("123456789")), 0xcbf43926u); }

TEST(ZipTest, Crc32EqualsTheBitwiseDefinitionAtManyLengthsAndOffsets) {
  std::vector<std::byte> data(300);
  uint32_t x = 12345;  // a fixed sequence: the test is the same every run
  for (std::byte& b : data) b = static_cast<std::byte>((x = x * 1103515245u + 12345u) >> 24);
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t length = 0; offset + length <= data.size(); length += 7) {
      uint32_t c = 0xffffffffu;
      for (size_t i = offset; i < offset + length; ++i) {
        c ^= static_cast<uint32_t>(data[i]);
        for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      }
      EXPECT_EQ(Crc32(std::span<const std::byte>(data).subspan(offset, length)), ~c)
          << offset << " " << length;
    }
  }
}

enum class Corruption {
  kTruncated,
  kTooShort,
  kNoEndRecord,
  kDirectoryPastEnd,
  kEntryCountTooLarge,
  kDirectoryBadSignature,
  kDirectorySizeLeavesBytes,
  kCompressed,
  kEncrypted,
  kSizesDisagree,
  kLocalHeaderOutOfFile,
  kLocalHeaderBadSignature,
  kLocalNameMismatch,
  kLocalSizeMismatch,
  kDataIntoDirectory,
  kOverlap,
  kDuplicateName,
  kMultiDisk,
  kZip64LocatorMissing,
  kZip64RecordOutOfRange,
  kEmptyName,
};

struct Case {
  Corruption kind;
  const char* message;  // a part of the expected message
  StatusCode code = StatusCode::kDataLoss;
};

std::string Corrupt(Corruption kind) {
  const bool zip64 =
      kind == Corruption::kZip64LocatorMissing || kind == Corruption::kZip64RecordOutOfRange;
  const bool descriptor = kind != Corruption::kLocalSizeMismatch;
  Built b = Build(kEntries, {.zip64 = zip64, .data_descriptor = descriptor, .comment = ""});
  std::string& s = b.bytes;
  switch (kind) {
    case Corruption::kTruncated:
      s.resize(s.size() - 5);
      break;
    case Corruption::kTooShort:
      s = "PK\x05\x06";
      break;
    case Corruption::kNoEndRecord:
      s[b.end] = 'Q';
      break;
    case Corruption::kDirectoryPastEnd:
      Set(s, b.end + 16, b.directory + 1, 4);
      break;
    case Corruption::kEntryCountTooLarge:
      Set(s, b.end + 8, 1000, 2);
      Set(s, b.end + 10, 1000, 2);
      break;
    case Corruption::kDirectoryBadSignature:
      s[b.central[2]] = 'X';
      break;
    case Corruption::kDirectorySizeLeavesBytes:
      Set(s, b.end + 8, 3, 2);
      Set(s, b.end + 10, 3, 2);
      break;
    case Corruption::kCompressed:
      Set(s, b.central[1] + 10, 8, 2);
      break;
    case Corruption::kEncrypted:
      Set(s, b.central[1] + 8, 0x0809, 2);
      break;
    case Corruption::kSizesDisagree:
      Set(s, b.central[1] + 20, 23, 4);
      break;
    case Corruption::kLocalHeaderOutOfFile:
      Set(s, b.central[1] + 42, 0x7fffffff, 4);
      break;
    case Corruption::kLocalHeaderBadSignature:
      s[b.local[1] + 2] = 'Z';
      break;
    case Corruption::kLocalNameMismatch:
      s[b.local[1] + 30] = 'B';
      break;
    case Corruption::kLocalSizeMismatch:
      Set(s, b.local[1] + 22, 25, 4);
      break;
    case Corruption::kDataIntoDirectory: {
      // The last entry claims more data than lies before the directory.
      Set(s, b.central[3] + 20, 600, 4);
      Set(s, b.central[3] + 24, 600, 4);
      break;
    }
    case Corruption::kOverlap:
      // Entry 1's data runs 20 bytes past its descriptor, into entry 2's local header.
      Set(s, b.central[1] + 20, 24 + 16 + 20, 4);
      Set(s, b.central[1] + 24, 24 + 16 + 20, 4);
      break;
    case Corruption::kDuplicateName: {
      // Entry 2 renamed to entry 1's name ("archive/data/1" -> "archive/data/0").
      s[b.local[2] + 30 + 13] = '0';
      s[b.central[2] + 46 + 13] = '0';
      break;
    }
    case Corruption::kMultiDisk:
      Set(s, b.end + 4, 1, 2);
      break;
    case Corruption::kZip64LocatorMissing:
      s[b.end - 20] = 'Q';
      break;
    case Corruption::kZip64RecordOutOfRange:
      Set(s, b.end - 20 + 8, s.size(), 8);
      break;
    case Corruption::kEmptyName: {
      Built empty = Build({{"", "x"}});
      return empty.bytes;
    }
  }
  return s;
}

TEST(ZipTest, EveryCorruptionRefusedWithItsOwnMessage) {
  const std::vector<Case> cases = {
      {Corruption::kTruncated, "no end-of-central-directory record"},
      {Corruption::kTooShort, "shorter than an end-of-central-directory record"},
      {Corruption::kNoEndRecord, "no end-of-central-directory record"},
      {Corruption::kDirectoryPastEnd, "does not end before its end record"},
      {Corruption::kEntryCountTooLarge, "claims 1000 entries"},
      {Corruption::kDirectoryBadSignature, "central directory record 2 at byte"},
      {Corruption::kDirectorySizeLeavesBytes, "records end after"},
      {Corruption::kCompressed, "is compressed (method 8)", StatusCode::kUnimplemented},
      {Corruption::kEncrypted, "is encrypted", StatusCode::kUnimplemented},
      {Corruption::kSizesDisagree, "compressed size 23 but uncompressed size 24"},
      {Corruption::kLocalHeaderOutOfFile, "no local header at byte 2147483647"},
      {Corruption::kLocalHeaderBadSignature, "no local header at byte"},
      {Corruption::kLocalNameMismatch, "names \"Brchive/data/0\""},
      {Corruption::kLocalSizeMismatch,
       "24 bytes compressed and 25 uncompressed, the central directory 24"},
      {Corruption::kDataIntoDirectory, "runs past the start of the central directory"},
      {Corruption::kOverlap, "overlap"},
      {Corruption::kDuplicateName, "duplicate entry name \"archive/data/0\""},
      {Corruption::kMultiDisk, "multi-disk", StatusCode::kUnimplemented},
      {Corruption::kZip64LocatorMissing, "no ZIP64 locator"},
      {Corruption::kZip64RecordOutOfRange, "no ZIP64 end-of-central-directory record"},
      {Corruption::kEmptyName, "empty entry name"},
  };
  for (const Case& c : cases) {
    const std::string file = Corrupt(c.kind);
    Result<ZipArchive> zip = ZipArchive::Parse(Bytes(file));
    ASSERT_FALSE(zip.ok()) << "corruption " << static_cast<int>(c.kind) << " accepted";
    EXPECT_EQ(zip.status().code(), c.code) << zip.status().ToString();
    EXPECT_NE(zip.status().message().find(c.message), std::string::npos)
        << "corruption " << static_cast<int>(c.kind) << ": " << zip.status().ToString();
  }
}

TEST(ZipTest, EveryTruncationRefused) {
  const std::string file = Build(kEntries).bytes;
  for (size_t n = 0; n < file.size(); ++n) {
    const std::string prefix = file.substr(0, n);
    EXPECT_FALSE(ZipArchive::Parse(Bytes(prefix)).ok()) << "prefix of " << n << " bytes";
  }
}

}  // namespace
}  // namespace reshard
