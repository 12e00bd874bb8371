// OCDBT databases written (OcdbtWriter): the byte layout is in ocdbt.h, and ocdbt.cc reads back
// everything written here.
#include <fmt/format.h>
#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/orbax/ocdbt.h"
#include "reshard/io/file.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

// The version tree's arity (log2) and the zstd level the manifest configures: Orbax's.
constexpr uint8_t kVersionTreeArityLog2 = 4;
constexpr int32_t kConfiguredZstdLevel = 0;
// What a node spends on an entry besides its key and inline value (varints, at most).
constexpr size_t kLeafEntryOverhead = 24;
constexpr size_t kInteriorEntryOverhead = 64;

void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void PutFixed(std::string& out, uint64_t v, int bytes) {  // little-endian
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

size_t CommonPrefix(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

std::string RandomBytes(size_t n) {
  std::random_device device;
  std::string out;
  while (out.size() < n) {
    const uint32_t r = device();
    for (int i = 0; i < 4 && out.size() < n; ++i) out += static_cast<char>((r >> (8 * i)) & 0xff);
  }
  return out;
}

std::string RandomHex(size_t bytes) {
  std::string out;
  for (char c : RandomBytes(bytes)) out += fmt::format("{:02x}", static_cast<uint8_t>(c));
  return out;
}

// A data file as a table names it: its path (relative to the database) and how much of it is
// the base path its children's tables resolve against.
struct TableFile {
  std::string path;
  size_t base = 0;
};

// A data file table. Paths share prefixes with the previous one, never past either base path
// unless both base paths are the same (the format's rule).
void PutDataFileTable(std::string& out, const std::vector<TableFile>& files) {
  PutVarint(out, files.size());
  std::vector<size_t> prefix(files.size(), 0);
  for (size_t i = 1; i < files.size(); ++i) {
    const TableFile& a = files[i - 1];
    const TableFile& b = files[i];
    size_t p = CommonPrefix(a.path, b.path);
    const bool same_base = a.base == b.base && p >= a.base;
    if (!same_base) p = std::min({p, a.base, b.base});
    prefix[i] = p;
    PutVarint(out, p);
  }
  for (size_t i = 0; i < files.size(); ++i) PutVarint(out, files[i].path.size() - prefix[i]);
  for (const TableFile& f : files) PutVarint(out, f.base);
  for (size_t i = 0; i < files.size(); ++i) out += files[i].path.substr(prefix[i]);
}

// Keys prefix-compressed against the previous one: n - 1 prefix lengths, n suffix lengths (and
// `between`, written between the lengths and the suffixes: interior nodes' column), the
// suffixes.
void PutKeys(std::string& out, const std::vector<std::string_view>& keys,
             const std::string& between = {}) {
  std::vector<size_t> prefix(keys.size(), 0);
  for (size_t i = 1; i < keys.size(); ++i) {
    prefix[i] = CommonPrefix(keys[i - 1], keys[i]);
    PutVarint(out, prefix[i]);
  }
  for (size_t i = 0; i < keys.size(); ++i) PutVarint(out, keys[i].size() - prefix[i]);
  out += between;
  for (size_t i = 0; i < keys.size(); ++i) out += keys[i].substr(prefix[i]);
}

// A written node as its parent names it.
struct NodeRef {
  std::string first_key;  // the subtree's first and last keys (full)
  std::string last_key;
  size_t prefix = 0;  // the length of the prefix all its keys share (of first_key)
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t num_keys = 0;
  uint64_t tree_bytes = 0;
  uint64_t indirect_bytes = 0;
};

}  // namespace

struct OcdbtWriter::Entry {
  bool is_inline = true;
  std::string inline_bytes;
  uint64_t offset = 0;  // in the data file
  uint64_t length = 0;
};

struct OcdbtWriter::State {
  std::optional<AtomicFileWriter> data;
  uint64_t data_size = 0;
  std::map<std::string, Entry> entries;
  bool finished = false;
  bool failed = false;
};

namespace {

// Appends encoded nodes to a data file and builds a B+tree of `entries` bottom-up: runs of
// entries filling target_node_bytes per leaf, then runs of children per interior node, up to
// one root. Values out of line are in `values`; nodes in `nodes` (the file `out` writes).
class TreeWriter {
 public:
  TreeWriter(AtomicFileWriter& out, uint64_t& size, TableFile values, TableFile nodes,
             size_t target)
      : out_(out),
        size_(size),
        values_(std::move(values)),
        nodes_(std::move(nodes)),
        target_(target) {}

  template <typename Entries>
  Result<std::optional<NodeRef>> Write(const Entries& entries) {
    std::vector<std::vector<typename Entries::const_iterator>> runs(1);
    size_t bytes = 0;
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      const size_t cost = it->first.size() + kLeafEntryOverhead +
                          (it->second.is_inline ? it->second.inline_bytes.size() : 0);
      if (!runs.back().empty() && bytes + cost > target_) {
        runs.emplace_back();
        bytes = 0;
      }
      runs.back().push_back(it);
      bytes += cost;
    }
    std::vector<NodeRef> level;
    for (const auto& run : runs) {
      if (run.empty()) continue;
      RESHARD_ASSIGN_OR_RETURN(NodeRef leaf, Leaf(run, runs.size() == 1));
      level.push_back(std::move(leaf));
    }
    if (level.empty()) return std::optional<NodeRef>();
    uint8_t height = 0;
    while (level.size() > 1) {
      ++height;
      // Runs of children filling target_node_bytes, at least two a node (the last run joins
      // the one before it when alone), so that every level is smaller than the one below.
      std::vector<std::pair<size_t, size_t>> spans;
      size_t begin = 0;
      bytes = 0;
      for (size_t i = 0; i < level.size(); ++i) {
        const size_t cost = level[i].first_key.size() + kInteriorEntryOverhead;
        if (i - begin >= 2 && bytes + cost > target_) {
          spans.emplace_back(begin, i);
          begin = i;
          bytes = 0;
        }
        bytes += cost;
      }
      spans.emplace_back(begin, level.size());
      if (spans.size() > 1 && spans.back().second - spans.back().first < 2) {
        spans[spans.size() - 2].second = level.size();
        spans.pop_back();
      }
      std::vector<NodeRef> up;
      for (const auto& [b, e] : spans) {
        RESHARD_ASSIGN_OR_RETURN(
            NodeRef node, Interior(height, std::span(level).subspan(b, e - b), spans.size() == 1));
        up.push_back(std::move(node));
      }
      level = std::move(up);
      height_ = height;
    }
    return std::optional<NodeRef>(std::move(level.front()));
  }

  uint8_t height() const { return height_; }

 private:
  Result<NodeRef> Append(std::string_view body, NodeRef ref) {
    RESHARD_ASSIGN_OR_RETURN(const std::string encoded,
                             EncodeOcdbtStructure(kOcdbtBtreeMagic, body, true));
    RESHARD_RETURN_IF_ERROR(out_.Append(encoded));
    ref.offset = size_;
    ref.length = encoded.size();
    ref.tree_bytes += encoded.size();
    size_ += encoded.size();
    return ref;
  }

  // A node's keys are relative to the prefix its subtree shares, which its parent records; the
  // root's (no parent) are whole.
  template <typename It>
  Result<NodeRef> Leaf(const std::vector<It>& run, bool root) {
    NodeRef ref;
    ref.first_key = run.front()->first;
    ref.last_key = run.back()->first;
    ref.prefix = root ? 0 : CommonPrefix(ref.first_key, ref.last_key);
    ref.num_keys = run.size();
    bool indirect = false;
    for (const It& it : run) indirect = indirect || !it->second.is_inline;
    std::string body;
    body += '\0';  // height
    PutDataFileTable(body, indirect ? std::vector<TableFile>{values_} : std::vector<TableFile>{});
    PutVarint(body, run.size());
    std::vector<std::string_view> keys;
    for (const It& it : run) keys.push_back(std::string_view(it->first).substr(ref.prefix));
    PutKeys(body, keys);
    for (const It& it : run) {
      PutVarint(body, it->second.is_inline ? it->second.inline_bytes.size() : it->second.length);
    }
    for (const It& it : run) PutVarint(body, it->second.is_inline ? 0 : 1);
    for (const It& it : run) {
      if (!it->second.is_inline) PutVarint(body, 0);  // the values' data file
    }
    for (const It& it : run) {
      if (!it->second.is_inline) {
        PutVarint(body, it->second.offset);
        ref.indirect_bytes += it->second.length;
      }
    }
    for (const It& it : run) {
      if (it->second.is_inline) body += it->second.inline_bytes;
    }
    return Append(body, std::move(ref));
  }

  Result<NodeRef> Interior(uint8_t height, std::span<const NodeRef> children, bool root) {
    NodeRef ref;
    ref.first_key = children.front().first_key;
    ref.last_key = children.back().last_key;
    ref.prefix = root ? 0 : CommonPrefix(ref.first_key, ref.last_key);
    std::string body;
    body += static_cast<char>(height);
    PutDataFileTable(body, {nodes_});
    PutVarint(body, children.size());
    std::vector<std::string_view> keys;
    std::string common;
    for (const NodeRef& c : children) {
      keys.push_back(std::string_view(c.first_key).substr(ref.prefix));
      PutVarint(common, c.prefix - ref.prefix);
    }
    PutKeys(body, keys, common);
    for (size_t i = 0; i < children.size(); ++i) PutVarint(body, 0);  // the nodes' data file
    for (const NodeRef& c : children) PutVarint(body, c.offset);
    for (const NodeRef& c : children) PutVarint(body, c.length);
    for (const NodeRef& c : children) PutVarint(body, c.num_keys);
    for (const NodeRef& c : children) PutVarint(body, c.tree_bytes);
    for (const NodeRef& c : children) PutVarint(body, c.indirect_bytes);
    for (const NodeRef& c : children) {
      ref.num_keys += c.num_keys;
      ref.tree_bytes += c.tree_bytes;
      ref.indirect_bytes += c.indirect_bytes;
    }
    return Append(body, std::move(ref));
  }

  AtomicFileWriter& out_;
  uint64_t& size_;
  TableFile values_;
  TableFile nodes_;
  size_t target_;
  uint8_t height_ = 0;
};

// The manifest of a database of one version whose root (if any) is in `nodes`.
Result<std::string> Manifest(const OcdbtWriteOptions& options, const TableFile& nodes,
                             const std::optional<NodeRef>& root, uint8_t height) {
  std::string body = RandomBytes(16);  // the database's uuid
  body += '\0';                        // manifest kind: single file
  PutVarint(body, options.max_inline_value_bytes);
  PutVarint(body, options.max_decoded_node_bytes);
  body += static_cast<char>(kVersionTreeArityLog2);
  PutVarint(body, 1);  // zstd
  PutFixed(body, static_cast<uint32_t>(kConfiguredZstdLevel), 4);
  PutDataFileTable(body, {nodes});
  PutVarint(body, 1);  // one version: generation 1
  PutVarint(body, 1);
  body += static_cast<char>(root ? height : 0);
  PutVarint(body, 0);
  PutVarint(body, root ? root->offset : 0);
  PutVarint(body, root ? root->length : 0);
  PutVarint(body, root ? root->num_keys : 0);
  PutVarint(body, root ? root->tree_bytes : 0);
  PutVarint(body, root ? root->indirect_bytes : 0);
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  PutFixed(body, static_cast<uint64_t>(now), 8);  // commit time
  PutVarint(body, 0);                             // no version tree nodes
  return EncodeOcdbtStructure(kOcdbtManifestMagic, body, true);
}

WriteOptions FileOptions(const OcdbtWriteOptions& options) {
  WriteOptions w;
  w.sync = options.sync;
  return w;
}

}  // namespace

Result<std::string> EncodeOcdbtStructure(uint32_t magic, std::string_view body, bool compress) {
  std::string payload;
  if (compress) {
    payload.resize(ZSTD_compressBound(body.size()));
    const size_t n = ZSTD_compress(payload.data(), payload.size(), body.data(), body.size(), 1);
    if (ZSTD_isError(n)) return InternalError(fmt::format("zstd: {}", ZSTD_getErrorName(n)));
    payload.resize(n);
  }
  const std::string_view stored = compress ? std::string_view(payload) : body;
  std::string out;
  for (int i = 3; i >= 0; --i) out += static_cast<char>((magic >> (8 * i)) & 0xff);
  PutFixed(out, 0, 8);  // the length, once known
  PutVarint(out, 0);    // format version
  PutVarint(out, compress ? 1 : 0);
  out += stored;
  const uint64_t length = out.size() + 4;
  for (int i = 0; i < 8; ++i) out[4 + i] = static_cast<char>((length >> (8 * i)) & 0xff);
  PutFixed(out, Crc32c(std::as_bytes(std::span(out.data(), out.size()))), 4);
  return out;
}

Result<std::unique_ptr<OcdbtWriter>> OcdbtWriter::Create(const std::string& dir,
                                                         const OcdbtWriteOptions& options) {
  std::unique_ptr<OcdbtWriter> w(new OcdbtWriter());
  w->dir_ = dir;
  w->options_ = options;
  w->data_file_ = "d/" + RandomHex(16);
  w->state_ = std::make_unique<State>();
  std::error_code ec;
  fs::create_directories(fs::path(dir) / "d", ec);
  if (ec) return ErrnoStatus(ec.value(), "creating the OCDBT database", dir);
  RESHARD_ASSIGN_OR_RETURN(
      AtomicFileWriter data,
      AtomicFileWriter::Create((fs::path(dir) / w->data_file_).string(), FileOptions(options)));
  w->state_->data.emplace(std::move(data));
  return w;
}

OcdbtWriter::~OcdbtWriter() = default;

Status OcdbtWriter::Put(const std::string& key, std::string_view value) {
  return Put(key, std::as_bytes(std::span(value.data(), value.size())));
}

Status OcdbtWriter::Put(const std::string& key, std::span<const std::byte> value) {
  State& s = *state_;
  if (s.finished || s.failed) {
    return FailedPreconditionError(fmt::format("\"{}\": no key is put after Finish", dir_));
  }
  Entry e;
  if (value.size() <= options_.max_inline_value_bytes) {
    e.inline_bytes.assign(reinterpret_cast<const char*>(value.data()), value.size());
  } else {
    e.is_inline = false;
    e.offset = s.data_size;
    e.length = value.size();
  }
  if (!s.entries.emplace(key, std::move(e)).second) {
    return InvalidArgumentError(
        fmt::format("\"{}\": key {} is put twice", dir_, json::QuoteShort(key)));
  }
  if (value.size() > options_.max_inline_value_bytes) {
    Status appended = s.data->Append(value);
    if (!appended.ok()) {
      s.failed = true;
      return appended;
    }
    s.data_size += value.size();
  }
  return Status::Ok();
}

Status OcdbtWriter::Finish() {
  State& s = *state_;
  if (s.finished || s.failed) {
    return FailedPreconditionError(fmt::format("\"{}\": Finish called twice", dir_));
  }
  s.finished = true;
  const TableFile file{data_file_, 0};
  TreeWriter tree(*s.data, s.data_size, file, file, options_.target_node_bytes);
  RESHARD_ASSIGN_OR_RETURN(const std::optional<NodeRef> root, tree.Write(s.entries));
  RESHARD_RETURN_IF_ERROR(s.data->Commit());
  RESHARD_ASSIGN_OR_RETURN(const std::string manifest,
                           Manifest(options_, file, root, tree.height()));
  return WriteFileAtomically((fs::path(dir_) / "manifest.ocdbt").string(), manifest,
                             FileOptions(options_));
}

Status OcdbtWriter::WriteMerged(const std::string& parent, const std::string& relative) const {
  const State& s = *state_;
  if (!s.finished || s.failed) {
    return FailedPreconditionError(fmt::format("\"{}\": merged before Finish", dir_));
  }
  const TableFile nodes{"d/" + RandomHex(16), 0};
  std::error_code ec;
  fs::create_directories(fs::path(parent) / "d", ec);
  if (ec) return ErrnoStatus(ec.value(), "creating the OCDBT database", parent);
  RESHARD_ASSIGN_OR_RETURN(
      AtomicFileWriter out,
      AtomicFileWriter::Create((fs::path(parent) / nodes.path).string(), FileOptions(options_)));
  uint64_t size = 0;
  TreeWriter tree(out, size, TableFile{relative + "/" + data_file_, relative.size() + 1}, nodes,
                  options_.target_node_bytes);
  RESHARD_ASSIGN_OR_RETURN(const std::optional<NodeRef> root, tree.Write(s.entries));
  RESHARD_RETURN_IF_ERROR(out.Commit());
  RESHARD_ASSIGN_OR_RETURN(const std::string manifest,
                           Manifest(options_, nodes, root, tree.height()));
  return WriteFileAtomically((fs::path(parent) / "manifest.ocdbt").string(), manifest,
                             FileOptions(options_));
}

}  // namespace reshard
