#include "reshard/io/zip.h"

#include <libdeflate.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

namespace reshard {
namespace {

constexpr uint64_t kMaxCommentBytes = 65535;

// Little-endian reads at a position already checked to be in bounds.
uint16_t U16(std::span<const std::byte> b, uint64_t at) {
  return static_cast<uint16_t>(static_cast<uint16_t>(b[at]) |
                               (static_cast<uint16_t>(b[at + 1]) << 8));
}
uint32_t U32(std::span<const std::byte> b, uint64_t at) {
  return static_cast<uint32_t>(U16(b, at)) | (static_cast<uint32_t>(U16(b, at + 2)) << 16);
}
uint64_t U64(std::span<const std::byte> b, uint64_t at) {
  return static_cast<uint64_t>(U32(b, at)) | (static_cast<uint64_t>(U32(b, at + 4)) << 32);
}

// Whether [begin, begin + size) lies inside [0, limit) without overflow.
bool Fits(uint64_t begin, uint64_t size, uint64_t limit) {
  return begin <= limit && size <= limit - begin;
}

std::string Hex(uint32_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x00000000";
  for (int i = 9; i >= 2; --i, v >>= 4) s[static_cast<size_t>(i)] = kDigits[v & 15];
  return s;
}

Status ZipError(std::string message) { return DataLossError("zip: " + std::move(message)); }

struct Directory {
  uint64_t offset = 0;   // of the first central record
  uint64_t size = 0;     // bytes of central records
  uint64_t entries = 0;  // number of records
  uint64_t end = 0;      // where the records must stop: the first end-of-directory record
  bool zip64 = false;
};

// The end-of-central-directory record: the last position p where the signature sits and the
// comment length reaches exactly the end of the archive.
Result<uint64_t> FindEndRecord(std::span<const std::byte> a) {
  const uint64_t n = a.size();
  if (n < zip::kEndBytes) {
    return ZipError("not a zip archive: " + std::to_string(n) +
                    " bytes, shorter than an end-of-central-directory record (22 bytes)");
  }
  const uint64_t lowest =
      n - zip::kEndBytes > kMaxCommentBytes ? n - zip::kEndBytes - kMaxCommentBytes : 0;
  for (uint64_t p = n - zip::kEndBytes + 1; p-- > lowest;) {
    if (U32(a, p) == zip::kEndSig && p + zip::kEndBytes + U16(a, p + 20) == n) return p;
  }
  return ZipError("not a zip archive: no end-of-central-directory record in the last " +
                  std::to_string(n - lowest) + " bytes");
}

Status ReadZip64End(std::span<const std::byte> a, uint64_t end_at, Directory& dir) {
  if (end_at < zip::kZip64LocatorBytes ||
      U32(a, end_at - zip::kZip64LocatorBytes) != zip::kZip64LocatorSig) {
    return ZipError("the end-of-central-directory record at byte " + std::to_string(end_at) +
                    " defers to ZIP64 but no ZIP64 locator precedes it");
  }
  const uint64_t locator = end_at - zip::kZip64LocatorBytes;
  if (U32(a, locator + 4) != 0 || U32(a, locator + 16) > 1) {
    return UnimplementedError("zip: multi-disk archives are not supported (ZIP64 locator at byte " +
                              std::to_string(locator) + ")");
  }
  const uint64_t at = U64(a, locator + 8);
  if (!Fits(at, zip::kZip64EndBytes, locator) || U32(a, at) != zip::kZip64EndSig) {
    return ZipError("the ZIP64 locator points at byte " + std::to_string(at) +
                    ", where no ZIP64 end-of-central-directory record lies before it");
  }
  if (U32(a, at + 16) != 0 || U32(a, at + 20) != 0 || U64(a, at + 24) != U64(a, at + 32)) {
    return UnimplementedError("zip: multi-disk archives are not supported (ZIP64 record at byte " +
                              std::to_string(at) + ")");
  }
  dir.entries = U64(a, at + 32);
  dir.size = U64(a, at + 40);
  dir.offset = U64(a, at + 48);
  dir.end = at;
  dir.zip64 = true;
  return Status::Ok();
}

Result<Directory> ReadDirectory(std::span<const std::byte> a) {
  RESHARD_ASSIGN_OR_RETURN(const uint64_t end_at, FindEndRecord(a));
  const uint16_t disk = U16(a, end_at + 4), directory_disk = U16(a, end_at + 6);
  if ((disk != 0 && disk != zip::kOverflow16) ||
      (directory_disk != 0 && directory_disk != zip::kOverflow16) ||
      U16(a, end_at + 8) != U16(a, end_at + 10)) {
    return UnimplementedError("zip: multi-disk archives are not supported (end record at byte " +
                              std::to_string(end_at) + ")");
  }
  Directory dir;
  dir.entries = U16(a, end_at + 10);
  dir.size = U32(a, end_at + 12);
  dir.offset = U32(a, end_at + 16);
  dir.end = end_at;
  if (dir.entries == zip::kOverflow16 || dir.size == zip::kOverflow32 ||
      dir.offset == zip::kOverflow32) {
    RESHARD_RETURN_IF_ERROR(ReadZip64End(a, end_at, dir));
  } else if (end_at >= zip::kZip64LocatorBytes &&
             U32(a, end_at - zip::kZip64LocatorBytes) == zip::kZip64LocatorSig) {
    RESHARD_RETURN_IF_ERROR(ReadZip64End(a, end_at, dir));
  }
  if (!Fits(dir.offset, dir.size, dir.end)) {
    return ZipError("the central directory [" + std::to_string(dir.offset) + ", +" +
                    std::to_string(dir.size) + ") does not end before its end record at byte " +
                    std::to_string(dir.end));
  }
  if (dir.entries > dir.size / zip::kCentralHeaderBytes) {
    return ZipError("the end record claims " + std::to_string(dir.entries) +
                    " entries but the central directory holds only " + std::to_string(dir.size) +
                    " bytes (46 or more per entry)");
  }
  return dir;
}

// Overrides the 32-bit fields that read FF FF FF FF with the ZIP64 extra field's values.
Status ApplyZip64Extra(std::span<const std::byte> extra, uint64_t& usize, uint64_t& csize,
                       uint64_t& offset, const std::string& where) {
  uint64_t p = 0;
  while (p + 4 <= extra.size()) {
    const uint16_t id = U16(extra, p);
    const uint16_t len = U16(extra, p + 2);
    if (!Fits(p + 4, len, extra.size())) {
      return ZipError(where + ": extra field id " + Hex(id) + " of " + std::to_string(len) +
                      " bytes runs past the extra area");
    }
    if (id == zip::kZip64ExtraId) {
      uint64_t q = p + 4;
      const uint64_t stop = q + len;
      for (uint64_t* field : {&usize, &csize, &offset}) {
        if (*field != zip::kOverflow32) continue;
        if (q + 8 > stop) return ZipError(where + ": ZIP64 extra field too short");
        *field = U64(extra, q);
        q += 8;
      }
      return Status::Ok();
    }
    p += 4 + static_cast<uint64_t>(len);
  }
  if (usize == zip::kOverflow32 || csize == zip::kOverflow32 || offset == zip::kOverflow32) {
    return ZipError(where + ": a size or offset reads FF FF FF FF but there is no ZIP64 field");
  }
  return Status::Ok();
}

// Checks the local header of `e` against its central record and sets e.data_offset.
Status ReadLocalHeader(std::span<const std::byte> a, const Directory& dir, uint16_t method,
                       uint16_t flags, ZipEntry& e) {
  const std::string where = "entry \"" + e.name + "\"";
  if (!Fits(e.header_offset, zip::kLocalHeaderBytes, dir.offset) ||
      U32(a, e.header_offset) != zip::kLocalHeaderSig) {
    return ZipError(where + ": no local header at byte " + std::to_string(e.header_offset) +
                    " (before the central directory at byte " + std::to_string(dir.offset) + ")");
  }
  const uint64_t h = e.header_offset;
  const uint64_t name_len = U16(a, h + 26);
  const uint64_t extra_len = U16(a, h + 28);
  const uint64_t names_at = h + zip::kLocalHeaderBytes;
  if (!Fits(names_at, name_len + extra_len, dir.offset)) {
    return ZipError(where + ": local header at byte " + std::to_string(h) +
                    " runs into the central directory");
  }
  const std::string_view local_name(reinterpret_cast<const char*>(a.data() + names_at), name_len);
  if (local_name != e.name) {
    return ZipError(where + ": the local header at byte " + std::to_string(h) + " names \"" +
                    std::string(local_name) + "\"");
  }
  if (U16(a, h + 8) != method ||
      ((U16(a, h + 6) ^ flags) & (zip::kFlagEncrypted | zip::kFlagDataDescriptor))) {
    return ZipError(where + ": the local header at byte " + std::to_string(h) +
                    " disagrees with the central directory on method or flags");
  }
  if (!(flags & zip::kFlagDataDescriptor)) {
    uint64_t usize = U32(a, h + 22), csize = U32(a, h + 18), unused = 0;
    RESHARD_RETURN_IF_ERROR(
        ApplyZip64Extra(a.subspan(names_at + name_len, extra_len), usize, csize, unused, where));
    if (usize != e.size || csize != e.size) {
      return ZipError(where + ": the local header says " + std::to_string(csize) +
                      " bytes compressed and " + std::to_string(usize) +
                      " uncompressed, the central directory " + std::to_string(e.size));
    }
  }
  e.data_offset = names_at + name_len + extra_len;
  if (!Fits(e.data_offset, e.size, dir.offset)) {
    return ZipError(
        where + ": data [" + std::to_string(e.data_offset) + ", +" + std::to_string(e.size) +
        ") runs past the start of the central directory at byte " + std::to_string(dir.offset));
  }
  return Status::Ok();
}

// Reads the central record at `p` (inside the directory) into `e`; returns its length.
Result<uint64_t> ReadCentralRecord(std::span<const std::byte> a, const Directory& dir, uint64_t p,
                                   uint64_t index, ZipEntry& e, uint16_t& method, uint16_t& flags) {
  const uint64_t dir_end = dir.offset + dir.size;
  const std::string where =
      "central directory record " + std::to_string(index) + " at byte " + std::to_string(p);
  if (!Fits(p, zip::kCentralHeaderBytes, dir_end) || U32(a, p) != zip::kCentralHeaderSig) {
    return ZipError(where + ": no central directory signature (50 4B 01 02) within the directory");
  }
  const uint64_t name_len = U16(a, p + 28);
  const uint64_t extra_len = U16(a, p + 30);
  const uint64_t comment_len = U16(a, p + 32);
  const uint64_t total = zip::kCentralHeaderBytes + name_len + extra_len + comment_len;
  if (!Fits(p, total, dir_end)) return ZipError(where + ": runs past the central directory");
  e.name.assign(reinterpret_cast<const char*>(a.data() + p + zip::kCentralHeaderBytes), name_len);
  const std::string named = "entry \"" + e.name + "\" (" + where + ")";
  if (e.name.empty()) return ZipError(where + ": empty entry name");
  flags = U16(a, p + 8);
  method = U16(a, p + 10);
  if (flags & (zip::kFlagEncrypted | zip::kFlagStrongEncryption)) {
    return UnimplementedError("zip: " + named + " is encrypted; encrypted entries are not read");
  }
  if (method != 0) {
    return UnimplementedError("zip: " + named + " is compressed (method " + std::to_string(method) +
                              "); only stored entries are read");
  }
  if (U16(a, p + 34) != 0 && U16(a, p + 34) != zip::kOverflow16) {
    return UnimplementedError("zip: " + named + " starts on another disk");
  }
  e.crc32 = U32(a, p + 16);
  uint64_t csize = U32(a, p + 20), usize = U32(a, p + 24);
  e.header_offset = U32(a, p + 42);
  RESHARD_RETURN_IF_ERROR(
      ApplyZip64Extra(a.subspan(p + zip::kCentralHeaderBytes + name_len, extra_len), usize, csize,
                      e.header_offset, named));
  if (csize != usize) {
    return ZipError(named + ": stored entry with compressed size " + std::to_string(csize) +
                    " but uncompressed size " + std::to_string(usize));
  }
  e.size = usize;
  return total;
}

}  // namespace

Result<ZipArchive> ZipArchive::Parse(std::span<const std::byte> archive) {
  RESHARD_ASSIGN_OR_RETURN(const Directory dir, ReadDirectory(archive));
  ZipArchive zip;
  zip.archive_ = archive;
  zip.zip64_ = dir.zip64;
  zip.entries_.reserve(static_cast<size_t>(dir.entries));
  uint64_t p = dir.offset;
  for (uint64_t i = 0; i < dir.entries; ++i) {
    ZipEntry e;
    uint16_t method = 0, flags = 0;
    RESHARD_ASSIGN_OR_RETURN(const uint64_t length,
                             ReadCentralRecord(archive, dir, p, i, e, method, flags));
    RESHARD_RETURN_IF_ERROR(ReadLocalHeader(archive, dir, method, flags, e));
    p += length;
    zip.entries_.push_back(std::move(e));
  }
  if (p != dir.offset + dir.size) {
    return ZipError("the central directory holds " + std::to_string(dir.size) + " bytes but its " +
                    std::to_string(dir.entries) + " records end after " +
                    std::to_string(p - dir.offset));
  }
  for (size_t i = 0; i < zip.entries_.size(); ++i) {
    const std::string& name = zip.entries_[i].name;
    if (!zip.index_.emplace(name, i).second) {
      return ZipError("duplicate entry name \"" + name + "\"");
    }
  }
  std::vector<const ZipEntry*> by_offset;
  by_offset.reserve(zip.entries_.size());
  for (const ZipEntry& e : zip.entries_) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const ZipEntry* x, const ZipEntry* y) {
    return x->header_offset < y->header_offset;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const ZipEntry& prev = *by_offset[i - 1];
    if (by_offset[i]->header_offset < prev.data_offset + prev.size) {
      return ZipError("entries \"" + prev.name + "\" (data up to byte " +
                      std::to_string(prev.data_offset + prev.size) + ") and \"" +
                      by_offset[i]->name + "\" (header at byte " +
                      std::to_string(by_offset[i]->header_offset) + ") overlap");
    }
  }
  return zip;
}

const ZipEntry* ZipArchive::Find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &entries_[it->second];
}

// libdeflate's CRC-32 folds 16 bytes at a time with carry-less multiplication where the CPU
// has it (~13 GB/s a core here, against 2.4 for slicing by 8): the writers checksum every byte
// they write.
uint32_t Crc32(std::span<const std::byte> bytes) {
  return libdeflate_crc32(0, bytes.data(), bytes.size());
}

}  // namespace reshard
