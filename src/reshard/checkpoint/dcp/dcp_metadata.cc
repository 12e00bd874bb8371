// The `.metadata` pickle of a DCP checkpoint -> DcpMetadata, and the chunk geometry.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/pickle_paths.h"
#include "reshard/io/torch_file.h"

namespace reshard {

using internal::Get;
using internal::IsNone;

namespace {

// A rank past this in a file name is refused: maps hold one shard per rank.
constexpr int64_t kMaxDcpRanks = int64_t{1} << 16;

}  // namespace

const std::vector<std::string>& DcpPickleClasses() {
  static const std::vector<std::string> kClasses = {
      // torch.distributed.checkpoint's metadata (metadata.py).
      "torch.distributed.checkpoint.metadata.Metadata",
      "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
      "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
      "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
      "torch.distributed.checkpoint.metadata.TensorProperties",
      "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
      "torch.distributed.checkpoint.metadata.MetadataIndex",
      "torch.distributed.checkpoint.metadata.StorageMeta",
      // The filesystem writer's records (filesystem.py).
      "torch.distributed.checkpoint.filesystem._StorageInfo",
      "torch.distributed.checkpoint.filesystem._StoragePrefix",
      // Planner records (planner.py): Megatron-Core keeps every rank's SavePlan in the
      // metadata (`all_local_plans`).
      "torch.distributed.checkpoint.planner.SavePlan",
      "torch.distributed.checkpoint.planner.WriteItem",
      "torch.distributed.checkpoint.planner.WriteItemType",
      "torch.distributed.checkpoint.planner.TensorWriteData",
      // Older torch: TensorProperties and shard metadata from torch.distributed._shard.
      "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
      "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
      "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
      "torch.distributed._shard.metadata.ShardMetadata",
      // Megatron-Core's placeholders for records of its older checkpoints.
      "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan",
      "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata",
      // Layouts and memory formats (TensorProperties' fields).
      "torch.serialization._get_layout",
      "torch.strided",
      "torch.sparse_coo",
      "torch.contiguous_format",
      "torch.channels_last",
      "torch.preserve_format",
      // StorageMeta.checkpoint_id: a path (pathlib._local from Python 3.13).
      "pathlib.Path",
      "pathlib.PosixPath",
      "pathlib.WindowsPath",
      "pathlib.PurePath",
      "pathlib.PurePosixPath",
      "pathlib.PureWindowsPath",
      "pathlib._local.Path",
      "pathlib._local.PosixPath",
      "pathlib._local.WindowsPath",
      "pathlib._local.PurePath",
      "pathlib._local.PurePosixPath",
      "pathlib._local.PureWindowsPath",
  };
  return kClasses;
}

bool IsDcpOptimizerState(std::span<const std::string> path) {
  if (path.empty()) return false;
  // The top-level key: the path's first element, up to a dot (a writer that records flat
  // keys as one-element paths, e.g. ("optim.state.w.exp_avg",), names it there).
  const std::string_view first = path.front();
  const std::string_view top = first.substr(0, first.find('.'));
  // Megatron's chain of optimizers (MoE models) puts "chained_{i}" before "optimizer".
  constexpr std::string_view kChained = "chained_";
  if (top.size() > kChained.size() && top.starts_with(kChained) &&
      top.find_first_not_of("0123456789", kChained.size()) == std::string_view::npos) {
    const std::string_view next = top.size() < first.size()
                                      ? first.substr(top.size() + 1)
                                      : (path.size() > 1 ? std::string_view(path[1]) : "");
    return next.substr(0, next.find('.')) == "optimizer";
  }
  return top == "optim" || top == "optimizer" || top == "optimizers";
}

namespace {

std::string KeyText(const PickleTree& t, PickleNodeId id) {
  const PickleNode& n = t.node(id);
  if (n.kind == PickleKind::kStr) return n.text;
  if (n.kind == PickleKind::kInt) return std::to_string(n.int_value);
  return "#";
}

bool IsRecordOf(const PickleTree& t, PickleNodeId id, std::string_view cls) {
  if (id == kNoPickleNode) return false;
  const PickleNode& n = t.node(id);
  if (n.kind != PickleKind::kRecord) return false;
  return n.text.size() >= cls.size() &&
         n.text.compare(n.text.size() - cls.size(), cls.size(), cls) == 0 &&
         (n.text.size() == cls.size() || n.text[n.text.size() - cls.size() - 1] == '.');
}

// A tuple (or list) of ints: torch.Size and the offsets DCP records.
std::optional<Shape> IntsAt(const PickleTree& t, PickleNodeId id) {
  if (id == kNoPickleNode) return std::nullopt;
  const PickleNode& n = t.node(id);
  if (n.kind != PickleKind::kTuple && n.kind != PickleKind::kList) return std::nullopt;
  Shape out;
  for (PickleNodeId item : n.items) {
    const PickleNode& v = t.node(item);
    if (v.kind != PickleKind::kInt) return std::nullopt;
    out.push_back(v.int_value);
  }
  return out;
}

std::optional<std::string> StrAt(const PickleTree& t, PickleNodeId id) {
  if (id == kNoPickleNode || t.node(id).kind != PickleKind::kStr) return std::nullopt;
  return t.node(id).text;
}

// "__3_0.distcp" -> 3.
std::optional<int64_t> RankOfFile(std::string_view name) {
  if (name.size() < 2 || name.substr(0, 2) != "__") return std::nullopt;
  std::string_view rest = name.substr(2);
  int64_t r = 0;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), r);
  if (ec != std::errc() || end == rest.data() || *end != '_' || r < 0) return std::nullopt;
  return r;
}

class MetadataReader {
 public:
  MetadataReader(const PickleTree& t, std::string_view name) : t_(t), name_(name) {}

  Status Error(std::string_view what) const {
    return DataLossError(fmt::format("{}: {}", name_, what));
  }

  Result<DcpMetadata> Read() {
    const PickleNodeId root = t_.root();
    if (!IsRecordOf(t_, root, "Metadata")) {
      return Error("is not a DCP Metadata record (torch.distributed.checkpoint.metadata.Metadata)");
    }
    DcpMetadata out;
    const PickleNodeId version = Get(t_, root, "version");
    if (!IsNone(t_, version)) {
      const auto v = StrAt(t_, version);
      if (!v) return Error("Metadata.version is not a str");
      out.version = *v;
    }
    if (std::find(std::begin(kDcpVersions), std::end(kDcpVersions), out.version) ==
        std::end(kDcpVersions)) {
      return Error(fmt::format(
          "Metadata.version \"{}\" is not a DCP version torch writes (none, or \"1.0.0\"): a "
          "newer format this reader does not know",
          out.version));
    }
    const PickleNodeId storage_meta = Get(t_, root, "storage_meta");
    if (!IsNone(t_, storage_meta)) {
      if (const auto id = StrAt(t_, Get(t_, storage_meta, "save_id"))) out.save_id = *id;
    }
    RESHARD_RETURN_IF_ERROR(ReadPlannerData(Get(t_, root, "planner_data")));
    RESHARD_RETURN_IF_ERROR(ReadStorageData(Get(t_, root, "storage_data")));
    const PickleNodeId sdm = Get(t_, root, "state_dict_metadata");
    if (sdm == kNoPickleNode || t_.node(sdm).kind != PickleKind::kDict) {
      return Error("Metadata.state_dict_metadata is not a dict");
    }
    for (const auto& [k, v] : t_.node(sdm).entries) {
      const auto fqn = StrAt(t_, k);
      if (!fqn) return Error("a state_dict_metadata key is not a str");
      if (IsRecordOf(t_, v, "BytesStorageMetadata")) {
        RESHARD_RETURN_IF_ERROR(AddBytes(*fqn, out));
      } else if (IsRecordOf(t_, v, "TensorStorageMetadata")) {
        RESHARD_RETURN_IF_ERROR(AddTensor(*fqn, v, out));
      } else {
        return Error(
            fmt::format("\"{}\": neither TensorStorageMetadata nor BytesStorageMetadata", *fqn));
      }
    }
    out.files = std::move(files_);
    return out;
  }

 private:
  struct Info {
    size_t file = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
    std::vector<std::string> transforms;
    bool used = false;
  };

  // Fills `path`, `path_is_index` and `path_recorded` of a tensor or bytes item.
  template <typename Item>
  void SetPath(Item& item) const {
    const auto it = paths_.find(item.fqn);
    if (it != paths_.end()) {
      item.path = it->second.keys;
      item.path_is_index = it->second.is_index;
      item.path_recorded = true;
      return;
    }
    item.path = PathOf(item.fqn);
    item.path_is_index.assign(item.path.size(), false);
  }

  // The key's dotted parts (a key planner_data does not record).
  static std::vector<std::string> PathOf(const std::string& fqn) {
    std::vector<std::string> path;
    size_t begin = 0;
    while (true) {
      const size_t dot = fqn.find('.', begin);
      path.push_back(fqn.substr(begin, dot - begin));
      if (dot == std::string::npos) break;
      begin = dot + 1;
    }
    return path;
  }

  Status ReadPlannerData(PickleNodeId id) {
    if (IsNone(t_, id) || t_.node(id).kind != PickleKind::kDict) return Status::Ok();
    for (const auto& [k, v] : t_.node(id).entries) {
      const auto fqn = StrAt(t_, k);
      const PickleNode& p = t_.node(v);
      if (!fqn || (p.kind != PickleKind::kTuple && p.kind != PickleKind::kList)) continue;
      StateDictPath path;
      bool plain = true;  // str and int elements only
      for (PickleNodeId e : p.items) {
        const PickleKind kind = t_.node(e).kind;
        plain = plain && (kind == PickleKind::kStr || kind == PickleKind::kInt);
        path.keys.push_back(KeyText(t_, e));
        path.is_index.push_back(kind == PickleKind::kInt);
      }
      if (plain) paths_[*fqn] = std::move(path);
    }
    return Status::Ok();
  }

  Status ReadStorageData(PickleNodeId id) {
    if (id == kNoPickleNode || t_.node(id).kind != PickleKind::kDict) {
      return Error(
          "Metadata.storage_data is not a dict (a checkpoint saved by a storage writer "
          "that keeps no item locations)");
    }
    for (const auto& [k, v] : t_.node(id).entries) {
      if (!IsRecordOf(t_, k, "MetadataIndex")) {
        return Error("a storage_data key is not a MetadataIndex");
      }
      const auto fqn = StrAt(t_, Get(t_, k, "fqn"));
      if (!fqn) return Error("a storage_data MetadataIndex has no str fqn");
      const PickleNodeId off = Get(t_, k, "offset");
      std::optional<Shape> offsets;
      if (!IsNone(t_, off)) {
        offsets = IntsAt(t_, off);
        if (!offsets) return Error(fmt::format("\"{}\": MetadataIndex.offset is not ints", *fqn));
      }
      if (!IsRecordOf(t_, v, "_StorageInfo")) {
        return Error(fmt::format("\"{}\": its storage_data value is not a _StorageInfo", *fqn));
      }
      const auto rel = StrAt(t_, Get(t_, v, "relative_path"));
      const auto offset = internal::IntAt(t_, Get(t_, v, "offset"));
      const auto length = internal::IntAt(t_, Get(t_, v, "length"));
      if (!rel || !offset || !length || *offset < 0 || *length < 0) {
        return Error(fmt::format(
            "\"{}\": _StorageInfo needs a str relative_path and non-negative int offset and "
            "length",
            *fqn));
      }
      if (rel->empty() || rel->find_first_of(std::string_view("/\0", 2)) != std::string::npos ||
          *rel == "." || *rel == "..") {
        return Error(
            fmt::format("\"{}\": item file {} is not a file name in the checkpoint directory", *fqn,
                        json::Quote(*rel)));
      }
      Info info;
      const auto [fit, inserted] = file_index_.emplace(*rel, files_.size());
      if (inserted) files_.push_back(*rel);
      info.file = fit->second;
      info.offset = static_cast<uint64_t>(*offset);
      info.length = static_cast<uint64_t>(*length);
      const PickleNodeId tr = Get(t_, v, "transform_descriptors");
      if (!IsNone(t_, tr)) {
        const PickleNode& tn = t_.node(tr);
        if (tn.kind != PickleKind::kList && tn.kind != PickleKind::kTuple) {
          return Error(fmt::format("\"{}\": transform_descriptors is not a list", *fqn));
        }
        for (PickleNodeId e : tn.items) {
          const auto s = StrAt(t_, e);
          if (!s) return Error(fmt::format("\"{}\": a transform descriptor is not a str", *fqn));
          info.transforms.push_back(*s);
        }
      }
      const std::string key = ItemKey(*fqn, offsets);
      if (!infos_.emplace(key, std::move(info)).second) {
        return Error(fmt::format("\"{}\": two storage_data entries for one item", *fqn));
      }
    }
    return AssignRanks();
  }

  static std::string ItemKey(const std::string& fqn, const std::optional<Shape>& offsets) {
    std::string key = fqn;
    key.push_back('\0');
    if (!offsets) return key + "bytes";
    for (Index o : *offsets) key += std::to_string(o) + ",";
    return key;
  }

  Result<DcpItemLocation> Locate(const std::string& fqn, const std::optional<Shape>& offsets,
                                 std::string_view what, Rank* rank) {
    const auto it = infos_.find(ItemKey(fqn, offsets));
    if (it == infos_.end()) {
      return Error(
          fmt::format("\"{}\"{}: no storage_data entry says where its data is", fqn, what));
    }
    if (it->second.used) return Error(fmt::format("\"{}\"{}: listed twice", fqn, what));
    it->second.used = true;
    *rank = file_rank_[it->second.file];
    return DcpItemLocation{it->second.file, it->second.offset, it->second.length,
                           it->second.transforms};
  }

  // Ranks by file: "__{r}_{n}.distcp" is rank r; files named otherwise get ranks after the
  // highest named one, in first-use order.
  Status AssignRanks() {
    int64_t high = -1;
    for (const std::string& f : files_) {
      const auto r = RankOfFile(f);
      if (!r) continue;
      if (*r >= kMaxDcpRanks) {
        return Error(fmt::format("item file \"{}\" names rank {}, past the {} ranks read", f, *r,
                                 kMaxDcpRanks));
      }
      high = std::max(high, *r);
    }
    for (const std::string& f : files_) {
      const auto r = RankOfFile(f);
      file_rank_.push_back(static_cast<Rank>(r ? *r : ++high));
    }
    if (high >= kMaxDcpRanks) return Error("too many item files");
    return Status::Ok();
  }

  Status AddBytes(const std::string& fqn, DcpMetadata& out) {
    DcpBytesItem item;
    item.fqn = fqn;
    SetPath(item);
    RESHARD_ASSIGN_OR_RETURN(item.location, Locate(fqn, std::nullopt, " (bytes)", &item.rank));
    out.bytes_items.push_back(std::move(item));
    return Status::Ok();
  }

  Status AddTensor(const std::string& fqn, PickleNodeId v, DcpMetadata& out) {
    DcpTensor tensor;
    tensor.fqn = fqn;
    SetPath(tensor);
    tensor.optimizer_state = IsDcpOptimizerState(tensor.path);
    const auto shape = IntsAt(t_, Get(t_, v, "size"));
    if (!shape) return Error(fmt::format("\"{}\": TensorStorageMetadata.size is not ints", fqn));
    for (Index d : *shape) {
      if (d < 0) return Error(fmt::format("\"{}\": a negative size {}", fqn, d));
    }
    if (!CheckedProduct(*shape).ok()) {
      return Error(fmt::format("\"{}\": its size overflows the element count", fqn));
    }
    tensor.shape = *shape;
    RESHARD_ASSIGN_OR_RETURN(tensor.dtype, DTypeOf(fqn, Get(t_, v, "properties")));
    const PickleNodeId chunks = Get(t_, v, "chunks");
    if (chunks == kNoPickleNode || t_.node(chunks).kind != PickleKind::kList) {
      return Error(fmt::format("\"{}\": TensorStorageMetadata.chunks is not a list", fqn));
    }
    for (size_t c = 0; c < t_.node(chunks).items.size(); ++c) {
      const PickleNodeId ch = t_.node(chunks).items[c];
      if (!IsRecordOf(t_, ch, "ChunkStorageMetadata")) {
        return Error(fmt::format("\"{}\" chunk {}: not a ChunkStorageMetadata", fqn, c));
      }
      DcpChunk chunk;
      const auto offsets = IntsAt(t_, Get(t_, ch, "offsets"));
      const auto sizes = IntsAt(t_, Get(t_, ch, "sizes"));
      if (!offsets || !sizes) {
        return Error(fmt::format("\"{}\" chunk {}: offsets and sizes are not ints", fqn, c));
      }
      chunk.offsets = *offsets;
      chunk.sizes = *sizes;
      RESHARD_ASSIGN_OR_RETURN(
          chunk.location, Locate(fqn, chunk.offsets, fmt::format(" chunk {}", c), &chunk.rank));
      tensor.chunks.push_back(std::move(chunk));
    }
    out.tensors.push_back(std::move(tensor));
    return Status::Ok();
  }

  Result<DType> DTypeOf(const std::string& fqn, PickleNodeId props) {
    if (!IsRecordOf(t_, props, "TensorProperties")) {
      return Error(
          fmt::format("\"{}\": TensorStorageMetadata.properties is not TensorProperties", fqn));
    }
    // torch >= 2.2 pickles the state as a tuple (dtype, layout, requires_grad, memory format,
    // pin_memory); older torch as the dataclass's dict.
    const PickleNode& p = t_.node(props);
    PickleNodeId dtype = kNoPickleNode;
    if (p.state != kNoPickleNode && t_.node(p.state).kind == PickleKind::kTuple &&
        !t_.node(p.state).items.empty()) {
      dtype = t_.node(p.state).items[0];
    } else {
      dtype = Get(t_, props, "dtype");
    }
    if (dtype == kNoPickleNode || t_.node(dtype).kind != PickleKind::kGlobal) {
      return Error(fmt::format("\"{}\": TensorProperties has no dtype", fqn));
    }
    const auto td = TorchDTypeOf(t_.node(dtype).text);
    if (!td || !td->dtype) {
      return Error(
          fmt::format("\"{}\": dtype {} is not one reshard reads", fqn, t_.node(dtype).text));
    }
    return *td->dtype;
  }

  const PickleTree& t_;
  std::string_view name_;
  std::map<std::string, StateDictPath> paths_;
  std::map<std::string, Info> infos_;
  std::map<std::string, size_t> file_index_;
  std::vector<std::string> files_;
  std::vector<Rank> file_rank_;
};

std::string BoxText(const DcpChunk& c) {
  return fmt::format("offsets [{}] sizes [{}]", fmt::join(c.offsets, ", "),
                     fmt::join(c.sizes, ", "));
}

bool Intersect(const DcpChunk& a, const DcpChunk& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.sizes[d] == 0 || b.sizes[d] == 0) return false;
    if (a.offsets[d] + a.sizes[d] <= b.offsets[d] || b.offsets[d] + b.sizes[d] <= a.offsets[d]) {
      return false;
    }
  }
  return true;
}

}  // namespace

Result<DcpMetadata> ParseDcpMetadata(std::span<const std::byte> bytes, std::string_view name) {
  PickleOptions options;
  options.extra_record_classes = DcpPickleClasses();
  // A large job's metadata lists every rank's chunks (Megatron's also every rank's save plan):
  // millions of objects. Each still costs bytes of the input.
  options.limits.max_nodes = size_t{1} << 25;
  options.limits.max_memo = size_t{1} << 25;
  auto tree = ParsePickle(bytes, options);
  if (!tree.ok()) {
    return Status(tree.status().code(), fmt::format("{}: {}", name, tree.status().message()));
  }
  return MetadataReader(*tree, name).Read();
}

Result<ParamMap> ChunksToMap(std::string_view what, const Shape& shape,
                             std::span<const DcpChunk> chunks, int world_size) {
  const auto error = [&](size_t c, std::string_view why) {
    return InvalidArgumentError(
        fmt::format("{} chunk {} ({}): {}", what, c, BoxText(chunks[c]), why));
  };
  RESHARD_ASSIGN_OR_RETURN(const Index total, CheckedProduct(shape));
  const Shape strides = RowMajorStrides(shape);
  ParamMapBuilder b;
  b.set_logical_shape(shape);
  b.set_world_size(world_size);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const DcpChunk& ch = chunks[c];
    if (ch.offsets.size() != shape.size() || ch.sizes.size() != shape.size()) {
      return error(c, fmt::format("the tensor has {} dims", shape.size()));
    }
    if (ch.rank < 0 || ch.rank >= world_size) {
      return error(c, fmt::format("rank {} is outside the {} ranks", ch.rank, world_size));
    }
    for (size_t d = 0; d < shape.size(); ++d) {
      if (ch.offsets[d] < 0 || ch.sizes[d] < 0 || ch.offsets[d] > shape[d] ||
          ch.sizes[d] > shape[d] - ch.offsets[d]) {
        return error(c, fmt::format("dim {} runs past the tensor's size {}", d, shape[d]));
      }
    }
  }
  // The same box from several ranks (a replicated tensor saved without DCP's deduplication,
  // as per-rank saves do) is one piece those ranks hold together.
  std::map<std::pair<Shape, Shape>, std::vector<Rank>> holders;
  std::map<std::pair<Shape, Shape>, size_t> first;
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (ProductOf(chunks[c].sizes) == 0) continue;
    const auto key = std::make_pair(chunks[c].offsets, chunks[c].sizes);
    std::vector<Rank>& ranks = holders[key];
    const auto [it, inserted] = first.emplace(key, c);
    if (std::find(ranks.begin(), ranks.end(), chunks[c].rank) != ranks.end()) {
      return error(c, fmt::format("repeats chunk {} on the same rank", it->second));
    }
    ranks.push_back(chunks[c].rank);
  }
  for (auto& [key, ranks] : holders) std::sort(ranks.begin(), ranks.end());
  std::vector<Index> cursor(static_cast<size_t>(world_size), 0);
  Index volume = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const DcpChunk& ch = chunks[c];
    const Index n = ProductOf(ch.sizes);
    if (n == 0) continue;
    const auto key = std::make_pair(ch.offsets, ch.sizes);
    // Each box lies in the tensor, so the sum of distinct boxes only passes total by overlaps.
    if (first[key] == c) volume += n;
    Index source = 0;
    for (size_t d = 0; d < shape.size(); ++d) source += ch.offsets[d] * strides[d];
    Piece p;
    p.shape = ch.sizes;
    p.source = {source, strides};
    p.dest = {cursor[static_cast<size_t>(ch.rank)], RowMajorStrides(ch.sizes)};
    p.locations = holders[key];
    cursor[static_cast<size_t>(ch.rank)] += n;
    b.add_piece(ch.rank, std::move(p));
    if (volume > total) break;
  }
  const auto overlap = [&]() -> Status {
    constexpr size_t kMaxPairwise = 8192;
    const size_t n = std::min(chunks.size(), kMaxPairwise);
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = i + 1; j < n; ++j) {
        if (Intersect(chunks[i], chunks[j]) &&
            (chunks[i].offsets != chunks[j].offsets || chunks[i].sizes != chunks[j].sizes)) {
          return error(j, fmt::format("overlaps chunk {} ({})", i, BoxText(chunks[i])));
        }
      }
    }
    return InvalidArgumentError(fmt::format("{}: its chunks overlap", what));
  };
  if (volume > total) return overlap();
  for (Rank r = 0; r < world_size; ++r) b.set_shard_shape(r, {cursor[static_cast<size_t>(r)]});
  auto map = b.Finalize();
  if (!map.ok() || volume < total) {
    if (volume == total) return overlap();  // covered by volume but not by boxes: two overlap
    return InvalidArgumentError(fmt::format(
        "{}: its chunks cover {} of its {} elements (shape [{}]); the checkpoint is incomplete",
        what, volume, total, fmt::join(shape, ", ")));
  }
  return map;
}

}  // namespace reshard
