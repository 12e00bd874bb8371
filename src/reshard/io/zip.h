// Zip archives of stored (uncompressed) entries, read in place: the reader of the containers
// that torch.save writes (a `.pt` file is a zip, see torch_file.h).
//
// Layout read, byte by byte (all integers little-endian; APPNOTE 6.3):
//   per entry, in file order:
//     local header     [0,4) 50 4B 03 04, [4,6) version needed, [6,8) flags, [8,10) method,
//                      [10,14) time/date, [14,18) CRC-32, [18,22) compressed size,
//                      [22,26) uncompressed size, [26,28) name length n, [28,30) extra length e,
//                      then the name (n bytes), the extra field (e bytes), then the data
//     data             `size` bytes, stored as is
//     data descriptor  present when flag bit 3 is set (torch sets it): optional 50 4B 07 08,
//                      CRC-32, sizes (4 or 8 bytes each); the central directory is the truth
//   central directory, one record per entry:
//                      [0,4) 50 4B 01 02, [4,8) versions, [8,10) flags, [10,12) method,
//                      [12,16) time/date, [16,20) CRC-32, [20,24) compressed size,
//                      [24,28) uncompressed size, [28,30) name length n, [30,32) extra length e,
//                      [32,34) comment length c, [34,36) disk number, [36,38) internal attrs,
//                      [38,42) external attrs, [42,46) local header offset, then name, extra,
//                      comment. A size or offset of FF FF FF FF is in the ZIP64 extra field
//                      (id 0x0001): in order, only the fields that overflowed, 8 bytes each
//                      (uncompressed size, compressed size, local header offset).
//   ZIP64 end record   (archives over 4 GiB or 65535 entries) 50 4B 06 06, [4,12) record size,
//                      [12,16) versions, [16,24) disk numbers, [24,32) entries on this disk,
//                      [32,40) entries, [40,48) directory size, [48,56) directory offset
//   ZIP64 locator      50 4B 06 07, [4,8) disk, [8,16) offset of the ZIP64 end record,
//                      [16,20) disk count; immediately before the end record
//   end record         50 4B 05 06, [4,8) disk numbers, [8,10) entries on this disk,
//                      [10,12) entries, [12,16) directory size, [16,20) directory offset,
//                      [20,22) comment length c, then the comment; the last 22 + c bytes
//
// The end record is searched for backwards over at most the last 22 + 65535 bytes, and only
// where its comment length reaches exactly the end of the file. Refused (DataLoss unless
// noted, each with its own message naming the entry and the values): no end record; a
// directory or ZIP64 record outside the file or overlapping what follows it; multi-disk
// archives (Unimplemented); a directory whose records do not fill it exactly or disagree with
// the entry count; a record with a bad signature or running past the directory; encrypted
// entries and compressed entries (Unimplemented: only stored entries are read, as torch
// writes them); sizes that disagree between compressed and uncompressed; empty or duplicate
// names; a local header outside the file, with a bad signature, or whose name, method or
// (without a data descriptor) sizes disagree with the directory; data running into the
// central directory; two entries whose ranges overlap.
//
// Why not a library: Debian ships libzip and minizip, but both read an entry through their
// own read calls into a caller's buffer; neither hands out the position of an entry's data
// for zero-copy access to a memory map, and neither refuses overlapping entries. Reading
// only stored entries needs nothing more than this directory walk, which is fuzzed.
#ifndef RESHARD_IO_ZIP_H_
#define RESHARD_IO_ZIP_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

/// The numbers of the layout above, for the reader here and the writer of torch .pt files.
namespace zip {
inline constexpr uint32_t kLocalHeaderSig = 0x04034b50;     // 50 4B 03 04
inline constexpr uint32_t kDataDescriptorSig = 0x08074b50;  // 50 4B 07 08
inline constexpr uint32_t kCentralHeaderSig = 0x02014b50;   // 50 4B 01 02
inline constexpr uint32_t kZip64EndSig = 0x06064b50;        // 50 4B 06 06
inline constexpr uint32_t kZip64LocatorSig = 0x07064b50;    // 50 4B 06 07
inline constexpr uint32_t kEndSig = 0x06054b50;             // 50 4B 05 06
// Sizes in bytes of the fixed part of each record.
inline constexpr uint64_t kLocalHeaderBytes = 30;
inline constexpr uint64_t kCentralHeaderBytes = 46;
inline constexpr uint64_t kZip64EndBytes = 56;
inline constexpr uint64_t kZip64LocatorBytes = 20;
inline constexpr uint64_t kEndBytes = 22;
inline constexpr uint16_t kZip64ExtraId = 0x0001;  // the extra field holding ZIP64 sizes
// "Version needed to extract": 2.0 for stored entries, 4.5 once ZIP64 records are used.
inline constexpr uint16_t kVersionStored = 20;
inline constexpr uint16_t kVersionZip64 = 45;
// General-purpose flag bits.
inline constexpr uint16_t kFlagEncrypted = 1u << 0;
inline constexpr uint16_t kFlagDataDescriptor = 1u << 3;
inline constexpr uint16_t kFlagStrongEncryption = 1u << 6;
inline constexpr uint16_t kFlagUtf8Name = 1u << 11;
// A 32- or 16-bit field holding these says the value is in a ZIP64 record.
inline constexpr uint32_t kOverflow32 = 0xffffffffu;
inline constexpr uint16_t kOverflow16 = 0xffffu;
}  // namespace zip

struct ZipEntry {
  std::string name;
  uint64_t header_offset = 0;  // bytes from the start of the archive: the local header
  uint64_t data_offset = 0;    // bytes from the start of the archive: the first data byte
  uint64_t size = 0;           // bytes of data (stored: compressed size = uncompressed size)
  uint32_t crc32 = 0;          // as recorded in the central directory (not verified here)
};

/// The central directory of a zip archive held in memory (typically a read-only mapping).
/// The archive bytes are not owned: they must outlive the ZipArchive.
class ZipArchive {
 public:
  /// Reads and checks the whole central directory and every local header (see above).
  static Result<ZipArchive> Parse(std::span<const std::byte> archive);

  /// In central-directory order.
  const std::vector<ZipEntry>& entries() const { return entries_; }
  /// The entry named exactly `name`, or nullptr.
  const ZipEntry* Find(std::string_view name) const;
  /// The data of `entry` (one of entries()), inside the archive bytes: no copy.
  std::span<const std::byte> data(const ZipEntry& entry) const {
    return archive_.subspan(entry.data_offset, entry.size);
  }
  /// True when the archive needed ZIP64 records.
  bool zip64() const { return zip64_; }

 private:
  std::span<const std::byte> archive_;
  std::vector<ZipEntry> entries_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in entries_
  bool zip64_ = false;
};

/// The CRC-32 (IEEE, as zip uses) of `bytes`, for callers that want to verify an entry.
uint32_t Crc32(std::span<const std::byte> bytes);

}  // namespace reshard

#endif  // RESHARD_IO_ZIP_H_
