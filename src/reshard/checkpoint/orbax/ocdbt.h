// OCDBT (tensorstore's Optionally-Cooperative Distributed B+Tree) databases, read and written:
// the key-value store under an Orbax checkpoint saved with `use_ocdbt` (Orbax's default).
//
// A database is a directory with
//   manifest.ocdbt   the manifest: configuration and the tree of versions
//   d/<32 hex>       data files: B+tree nodes, version tree nodes, out-of-line values
// (data files may sit at any relative path; a merged Orbax manifest names those of
// `ocdbt.process_<i>/d/`).
//
// Every integer is a LEB128 varint unless said otherwise; every encoded structure (manifest,
// version tree node, B+tree node) is laid out as
//   [0,4)    magic, uint32 big-endian: 0x0cdb3a2a manifest, 0x0cdb1234 version tree node,
//            0x0cdb20de B+tree node
//   [4,12)   length of the whole structure, uint64 little-endian
//   varint   format version (0)
//   varint   compression (0 none, 1 zstd): how the body is stored
//   body     up to length - 4
//   [-4,)    CRC-32C (Castagnoli) of everything before it, uint32 little-endian
//
// Manifest body: uuid (16 bytes), manifest kind (1 byte: 0 single file, 1 numbered files, which
// is refused), max_inline_value_bytes, max_decoded_node_bytes, version_tree_arity_log2 (1 byte),
// compression method (+ int32le zstd level when 1); then a data file table, the inline versions
// (version tree leaf entries) and the version tree's interior references. The newest version is
// the last inline one: its B+tree root (height, data file, offset, length) is what is read.
//
// Data file table: n; n - 1 prefix lengths; n suffix lengths; n base-path lengths; the
// suffixes. path[i] = path[i-1][0, prefix[i-1]) + suffix[i]; a node reached through path[i]
// resolves its own table against transitive + base_path[i].
//
// B+tree node body: height (1 byte), data file table, n entries; each column of the entries
// follows the previous one whole. Leaf (height 0): n - 1 key prefix lengths, n key suffix
// lengths, the key suffixes, n value lengths, n value kinds (0 inline, 1 in a data file),
// the data file ids then the offsets of the out-of-line values, the inline values. Interior:
// n - 1 key prefix lengths, n key suffix lengths, n subtree common prefix lengths, the key
// suffixes, n data file ids, n offsets, n lengths, then three statistics columns (keys, tree
// bytes, indirect value bytes). Keys below a child are relative to the parent's prefix plus
// the child key's first `subtree common prefix length` bytes.
//
// Everything read is checked against the real size of the file it is in before memory is set
// aside for it; a decompressed structure may grow no larger than kMaxOcdbtNodeBytes.
#ifndef RESHARD_CHECKPOINT_ORBAX_OCDBT_H_
#define RESHARD_CHECKPOINT_ORBAX_OCDBT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

/// The largest decoded manifest or node read (tensorstore writes nodes of at most 8 MiB).
inline constexpr uint64_t kMaxOcdbtNodeBytes = uint64_t{256} << 20;

/// The magic numbers of the encoded structures.
inline constexpr uint32_t kOcdbtManifestMagic = 0x0cdb3a2a;
inline constexpr uint32_t kOcdbtBtreeMagic = 0x0cdb20de;

/// CRC-32C (Castagnoli, reflected), as OCDBT and zarr's crc32c codec check it.
uint32_t Crc32c(std::span<const std::byte> bytes);

/// Where a key's value is: inline in its leaf node, or [offset, offset + length) of a data
/// file (an index into OcdbtDatabase::files()).
struct OcdbtValue {
  bool is_inline = false;
  std::string inline_bytes;
  size_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

/// An encoded structure's header and body, decoded: `body` is the (decompressed) bytes between
/// the header and the CRC.
/// \error DataLoss  wrong magic, a length that is not the bytes', a version other than 0, an
///        unknown compression, a CRC mismatch, a zstd body that is corrupt or decodes to more
///        than kMaxOcdbtNodeBytes
Result<std::vector<std::byte>> DecodeOcdbtStructure(std::span<const std::byte> bytes,
                                                    uint32_t magic, std::string_view what);

/// The B+tree root of a manifest's newest version, and the data file it is in (relative to the
/// database's directory). Empty tree: `length` 0.
struct OcdbtRoot {
  std::string file;
  std::string base;  // the base path its children's data file paths resolve against
  uint64_t offset = 0;
  uint64_t length = 0;
  int height = 0;
  uint64_t generation = 0;
};
/// Parses `manifest.ocdbt` (`bytes`). DataLoss naming `what` for anything malformed.
Result<OcdbtRoot> ParseOcdbtManifest(std::span<const std::byte> bytes, std::string_view what);

/// One decoded B+tree node: its entries with keys relative to the node's prefix.
struct OcdbtNode {
  int height = 0;
  /// Leaf: the values (OcdbtValue::file indexes `files`). Interior: `children`.
  std::vector<std::pair<std::string, OcdbtValue>> values;
  struct Child {
    std::string key;           // relative key
    size_t prefix_length = 0;  // subtree common prefix length (of `key`)
    size_t file = 0;           // index into `files`
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  std::vector<Child> children;
  /// The node's data file table: full paths (relative to the database) and base paths.
  std::vector<std::string> files;
  std::vector<std::string> base_paths;
};
/// Decodes an encoded B+tree node; `transitive` is the base path it was reached through.
Result<OcdbtNode> ParseOcdbtNode(std::span<const std::byte> bytes, const std::string& transitive,
                                 std::string_view what);

/// An OCDBT database opened read-only: its newest version's keys listed (the whole B+tree
/// walked at Open), data files mapped when first read.
class OcdbtDatabase {
 public:
  /// `dir`: a directory with manifest.ocdbt. NotFound when there is none; DataLoss (naming the
  /// file and the structure) for anything malformed, a data file path that leaves the directory
  /// (absolute, "..", a NUL), or a reference past the end of its file.
  static Result<std::shared_ptr<OcdbtDatabase>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  /// Every key of the newest version, sorted.
  const std::map<std::string, OcdbtValue>& keys() const { return keys_; }
  /// The data files the values are in (relative paths).
  const std::vector<std::string>& files() const { return files_; }
  /// The value of `key`: a view into the mapped data file (or the inline bytes), valid while
  /// the database lives. NotFound for a key it does not hold.
  Result<std::span<const std::byte>> Read(const std::string& key) const;
  /// Drops the mapped pages of `key`'s value.
  void Release(const std::string& key) const;

 private:
  OcdbtDatabase() = default;
  Result<std::span<const std::byte>> FileBytes(const std::string& relative) const;
  Status Walk(const std::string& file, uint64_t offset, uint64_t length, int height,
              const std::string& transitive, const std::string& prefix, int depth);
  size_t FileIndex(const std::string& relative);
  std::string dir_;
  std::map<std::string, OcdbtValue> keys_;
  std::vector<std::string> files_;
  struct Mapped;
  std::shared_ptr<Mapped> mapped_;
};

/// Encodes a structure: the header (`magic`, length, version 0, compression), `body`
/// (zstd-compressed when `compress`), the CRC-32C. What DecodeOcdbtStructure reads back.
/// Internal for a zstd failure.
Result<std::string> EncodeOcdbtStructure(uint32_t magic, std::string_view body, bool compress);

/// How an OcdbtWriter writes: Orbax's configuration by default.
struct OcdbtWriteOptions {
  /// Values up to this many bytes are stored inline in their leaf node (Orbax: 1024).
  uint64_t max_inline_value_bytes = 1024;
  /// Recorded in the manifest as the largest decoded node a writer of the database may make
  /// (Orbax: 100,000,000).
  uint64_t max_decoded_node_bytes = 100000000;
  /// A node takes entries until its decoded size would pass this many bytes (at least one
  /// entry each); more entries make more nodes under interior nodes. Orbax wants few nodes (a
  /// single root "for faster traversal"); 1 MiB holds thousands of keys, and decoding one
  /// stays cheap.
  size_t target_node_bytes = size_t{1} << 20;
  /// Flush each file to disk before it is renamed into place.
  bool sync = true;
};

/// Writes one OCDBT database of one version (generation 1) into the directory `dir`, as
/// tensorstore lays one out: values longer than max_inline_value_bytes are appended to the data
/// file `d/<32 random hex digits>` as they are put (so memory holds the keys and the inline
/// values, never a large value after its Put); Finish appends the B+tree's nodes to the same
/// file (leaves, then interior levels up to the root; each node's keys relative to the prefix
/// its subtree shares, zstd-compressed), then writes `manifest.ocdbt` (zstd level 0
/// configured, like Orbax's). Every file is written to a temporary name and renamed into place
/// (io/file.h): a writer destroyed before Finish leaves no data file behind.
class OcdbtWriter {
 public:
  /// Creates `dir` (and its `d/`) and opens the data file.
  static Result<std::unique_ptr<OcdbtWriter>> Create(const std::string& dir,
                                                     const OcdbtWriteOptions& options = {});
  ~OcdbtWriter();
  OcdbtWriter(const OcdbtWriter&) = delete;
  OcdbtWriter& operator=(const OcdbtWriter&) = delete;

  /// Stores `value` under `key`. InvalidArgument for a key put twice; the data file's errors.
  Status Put(const std::string& key, std::span<const std::byte> value);
  Status Put(const std::string& key, std::string_view value);

  /// Writes the B+tree and the manifest. Once called (ok or not) the writer takes no more Puts.
  Status Finish();

  /// After Finish: writes, in `parent` (a directory above `dir` that holds it at the relative
  /// path `relative`, e.g. "ocdbt.process_0"), a database of the same keys whose leaves name
  /// this database's data file through `relative` (as base path): Orbax's merged manifest
  /// beside its per-process databases. Its nodes go to a data file of its own in `parent`/d/.
  Status WriteMerged(const std::string& parent, const std::string& relative) const;

  /// The data file's path relative to `dir` ("d/...").
  const std::string& data_file() const { return data_file_; }

 private:
  struct Entry;
  struct State;
  OcdbtWriter() = default;
  std::string dir_;
  std::string data_file_;
  OcdbtWriteOptions options_;
  std::unique_ptr<State> state_;
};

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_ORBAX_OCDBT_H_
