#include "reshard/checkpoint/dcp/dcp_writer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/exec/executor.h"
#include "reshard/io/file.h"
#include "reshard/io/torch_writer.h"
#include "reshard/ir/compose.h"
#include "reshard/layouts/basic.h"

namespace reshard {

namespace {

constexpr char kMetadataModule[] = "torch.distributed.checkpoint.metadata.";
constexpr char kStorageInfoClass[] = "torch.distributed.checkpoint.filesystem._StorageInfo";
constexpr char kDcpVersion[] = "1.0.0";  // what FileSystemWriter records (torch 2.4 on)
constexpr char kOptimizerKey[] = "optim";
// The optimizer states a source names "<param>.<state>" (DeepSpeed's and reshard's naming).
const std::set<std::string> kOptimizerStates = {"exp_avg", "exp_avg_sq", "fp32"};

std::string MetadataClass(std::string_view name) { return kMetadataModule + std::string(name); }

uint64_t ElementBytes(Index elements, DType dtype) {
  return static_cast<uint64_t>(elements) * DTypeSize(dtype);
}

}  // namespace

std::string DcpFileName(Rank rank) { return fmt::format("__{}_0.distcp", rank); }

std::vector<DcpWriteChunk> DcpShard0Chunks(const Shape& shape, int world_size) {
  if (shape.empty() || ProductOf(shape) == 0 || world_size <= 1) {
    return {DcpWriteChunk{0, Shape(shape.size(), 0), shape}};
  }
  const Index rows = shape[0];
  const Index per_rank = (rows + world_size - 1) / world_size;
  std::vector<DcpWriteChunk> chunks;
  for (Rank r = 0; r < world_size; ++r) {
    const Index begin = static_cast<Index>(r) * per_rank;
    if (begin >= rows) break;
    DcpWriteChunk c{r, Shape(shape.size(), 0), shape};
    c.offsets[0] = begin;
    c.sizes[0] = std::min(per_rank, rows - begin);
    chunks.push_back(std::move(c));
  }
  return chunks;
}

Result<std::vector<DcpTensorToWrite>> PlanDcpTensors(const Manifest& manifest, int world_size,
                                                     const StateDictStructure* structure) {
  if (world_size < 1) {
    return InvalidArgumentError(fmt::format("{} is not a world size", world_size));
  }
  std::set<std::string> names;
  for (const ShardedParam& p : manifest.params) names.insert(p.name);
  std::vector<DcpTensorToWrite> out;
  std::map<std::string, size_t> by_key;  // key -> tensor
  bool optimizer_state = false;
  for (size_t i = 0; i < manifest.params.size(); ++i) {
    const ShardedParam& p = manifest.params[i];
    DcpTensorToWrite t{i, p.name, {p.name}, p.dtype, p.map.valid_shape(), {}, {}};
    const StateDictPath* recorded = nullptr;
    if (structure != nullptr) {
      const auto it = structure->tensor_paths.find(p.name);
      if (it != structure->tensor_paths.end()) recorded = &it->second;
    }
    const size_t dot = p.name.rfind('.');
    if (recorded != nullptr) {
      // The source's own nesting, and its key: the path dotted, as torch flattens it (a DCP
      // source's key itself).
      t.path = recorded->keys;
      t.path_is_index = recorded->is_index;
      t.key = fmt::format("{}", fmt::join(t.path, "."));
    } else if (dot != std::string::npos && dot > 0 &&
               kOptimizerStates.contains(p.name.substr(dot + 1)) &&
               names.contains(p.name.substr(0, dot))) {
      // "<param>.<state>" of another tensor "<param>": its optimizer state.
      const std::string base = p.name.substr(0, dot);
      const std::string state = p.name.substr(dot + 1);
      t.key = fmt::format("{}.state.{}.{}", kOptimizerKey, base, state);
      t.path = {kOptimizerKey, "state", base, state};
      optimizer_state = true;
    }
    t.chunks = DcpShard0Chunks(t.shape, world_size);
    if (const auto [it, fresh] = by_key.emplace(t.key, i); !fresh) {
      return FailedPreconditionError(
          fmt::format("tensors \"{}\" and \"{}\" would both be stored under the DCP key \"{}\"",
                      manifest.params[it->second].name, p.name, t.key));
    }
    out.push_back(std::move(t));
  }
  if (optimizer_state) {
    for (const DcpTensorToWrite& t : out) {
      if (t.path.size() == 1 &&
          (t.key == kOptimizerKey || t.key.starts_with(std::string(kOptimizerKey) + "."))) {
        return FailedPreconditionError(fmt::format(
            "tensor \"{}\" would be stored among the optimizer's state (DCP keys \"{}.*\"), "
            "which holds the state of other tensors",
            t.key, kOptimizerKey));
      }
    }
  }
  return out;
}

namespace {

// The tuple planner_data records for a path: str keys, and ints where a list was traversed.
Result<PickleNodeId> PathTuple(TorchTreeBuilder& b, const std::string& key,
                               const std::vector<std::string>& keys,
                               const std::vector<bool>& is_index) {
  std::vector<PickleNodeId> path;
  for (size_t k = 0; k < keys.size(); ++k) {
    if (k < is_index.size() && is_index[k]) {
      int64_t index = 0;
      const auto [end, ec] =
          std::from_chars(keys[k].data(), keys[k].data() + keys[k].size(), index);
      if (ec != std::errc() || end != keys[k].data() + keys[k].size()) {
        return InvalidArgumentError(fmt::format(
            "key \"{}\": path element {} (\"{}\") is said to be a list index but is no integer",
            key, k, keys[k]));
      }
      path.push_back(b.Int(index));
    } else {
      path.push_back(b.Str(keys[k]));
    }
  }
  return b.Tuple(std::move(path));
}

// A dataclass as pickle writes one: NEWOBJ of the class, then BUILD with its fields.
PickleNodeId Dataclass(TorchTreeBuilder& b, std::string_view cls,
                       const std::vector<std::pair<std::string, PickleNodeId>>& fields) {
  std::vector<std::pair<PickleNodeId, PickleNodeId>> entries;
  entries.reserve(fields.size());
  for (const auto& [name, value] : fields) entries.emplace_back(b.Str(name), value);
  return b.Object(std::string(cls), b.Dict(std::move(entries)));
}

// The non-tensor values' entries, as torch records a bytes item: a BytesStorageMetadata (no
// fields: NEWOBJ alone), its path, and a MetadataIndex without offset (fqn and index None) to
// its _StorageInfo (transform_descriptors only when there are some).
Status AddObjects(TorchTreeBuilder& b, const std::vector<DcpObjectToWrite>& objects,
                  PickleNodeId state_dict_metadata, PickleNodeId planner_data,
                  PickleNodeId storage_data) {
  for (const DcpObjectToWrite& o : objects) {
    b.Insert(state_dict_metadata, b.Str(o.key),
             b.Record(MetadataClass("BytesStorageMetadata"), {}, kNoPickleNode, /*newobj=*/true));
    RESHARD_ASSIGN_OR_RETURN(const PickleNodeId path, PathTuple(b, o.key, o.path, o.path_is_index));
    b.Insert(planner_data, b.Str(o.key), path);
    const PickleNodeId index =
        Dataclass(b, MetadataClass("MetadataIndex"), {{"fqn", b.Str(o.key)}, {"index", b.None()}});
    std::vector<std::pair<std::string, PickleNodeId>> info = {
        {"relative_path", b.Str(o.item.file)},
        {"offset", b.Int(static_cast<int64_t>(o.item.offset))},
        {"length", b.Int(static_cast<int64_t>(o.item.length))}};
    if (!o.transforms.empty()) {
      std::vector<PickleNodeId> transforms;
      for (const std::string& t : o.transforms) transforms.push_back(b.Str(t));
      info.emplace_back("transform_descriptors", b.List(std::move(transforms)));
    }
    b.Insert(storage_data, index, Dataclass(b, kStorageInfoClass, info));
  }
  return Status::Ok();
}

}  // namespace

Result<std::string> DcpMetadataPickle(const std::vector<DcpTensorToWrite>& tensors,
                                      const std::vector<std::vector<DcpWrittenItem>>& items,
                                      const std::string& checkpoint_id,
                                      const std::vector<DcpObjectToWrite>& objects) {
  if (items.size() != tensors.size()) {
    return InvalidArgumentError(
        fmt::format("{} tensors but items of {}", tensors.size(), items.size()));
  }
  TorchTreeBuilder b;
  const auto object = [&](std::string_view cls,
                          const std::vector<std::pair<std::string, PickleNodeId>>& fields) {
    return Dataclass(b, cls, fields);
  };
  // Nodes shared by every tensor (one memo entry each, as pickle writes them).
  const PickleNodeId strided =
      b.Record("torch.serialization._get_layout", {b.Str("torch.strided")});
  const PickleNodeId contiguous = b.Enum(MetadataClass("_MEM_FORMAT_ENCODING"), b.Int(0));
  std::map<DType, PickleNodeId> properties;
  const PickleNodeId state_dict_metadata = b.Dict();
  const PickleNodeId planner_data = b.Dict();
  const PickleNodeId storage_data = b.Dict();
  for (size_t t = 0; t < tensors.size(); ++t) {
    const DcpTensorToWrite& tensor = tensors[t];
    if (items[t].size() != tensor.chunks.size()) {
      return InvalidArgumentError(fmt::format("tensor \"{}\" has {} chunks but {} items",
                                              tensor.key, tensor.chunks.size(), items[t].size()));
    }
    auto [it, fresh] = properties.emplace(tensor.dtype, kNoPickleNode);
    if (fresh) {
      // TensorProperties pickles its state as a tuple (dtype, layout, requires_grad,
      // memory format, pin_memory).
      it->second = b.Record(
          MetadataClass("TensorProperties"), {},
          b.Tuple({b.DTypeObject(tensor.dtype), strided, b.Bool(false), contiguous, b.Bool(false)}),
          /*newobj=*/true);
    }
    std::vector<PickleNodeId> chunks;
    for (size_t c = 0; c < tensor.chunks.size(); ++c) {
      const DcpWriteChunk& chunk = tensor.chunks[c];
      chunks.push_back(
          object(MetadataClass("ChunkStorageMetadata"),
                 {{"offsets", b.Size(chunk.offsets)}, {"sizes", b.Size(chunk.sizes)}}));
      const DcpWrittenItem& item = items[t][c];
      const PickleNodeId index =
          object(MetadataClass("MetadataIndex"), {{"fqn", b.Str(tensor.key)},
                                                  {"offset", b.Size(chunk.offsets)},
                                                  {"index", b.Int(static_cast<int64_t>(c))}});
      b.Insert(storage_data, index,
               object(kStorageInfoClass, {{"relative_path", b.Str(item.file)},
                                          {"offset", b.Int(static_cast<int64_t>(item.offset))},
                                          {"length", b.Int(static_cast<int64_t>(item.length))}}));
    }
    b.Insert(state_dict_metadata, b.Str(tensor.key),
             object(MetadataClass("TensorStorageMetadata"), {{"properties", it->second},
                                                             {"size", b.Size(tensor.shape)},
                                                             {"chunks", b.List(chunks)}}));
    RESHARD_ASSIGN_OR_RETURN(const PickleNodeId path,
                             PathTuple(b, tensor.key, tensor.path, tensor.path_is_index));
    b.Insert(planner_data, b.Str(tensor.key), path);
  }
  RESHARD_RETURN_IF_ERROR(AddObjects(b, objects, state_dict_metadata, planner_data, storage_data));
  const PickleNodeId storage_meta =
      object(MetadataClass("StorageMeta"), {{"checkpoint_id", b.Str(checkpoint_id)},
                                            {"save_id", b.Str(kDcpSaveId)},
                                            {"load_id", b.None()},
                                            {"modules", b.List()}});
  const PickleNodeId root =
      object(MetadataClass("Metadata"), {{"state_dict_metadata", state_dict_metadata},
                                         {"planner_data", planner_data},
                                         {"storage_data", storage_data},
                                         {"storage_meta", storage_meta},
                                         {"version", b.Str(kDcpVersion)}});
  return SerializePickle(b.tree(), root);
}

namespace {

// A tensor to write: its DCP layout, the map its chunks are the shards of, and the plan from
// the source's map to it, its moves grouped by the chunk they write.
struct PlannedTensor {
  DcpTensorToWrite dcp;
  ParamPlan plan;
  /// moves_into[c]: the indices in plan.moves of the moves into chunk c.
  std::vector<std::vector<size_t>> moves_into;
};

// Groups the plan's moves by the chunk they write (one pass over the moves): the plan's target
// rank c is chunk c (ChunkMap).
void GroupMovesByChunk(PlannedTensor& t) {
  t.moves_into.assign(t.dcp.chunks.size(), {});
  for (size_t i = 0; i < t.plan.moves.size(); ++i) {
    const size_t c = static_cast<size_t>(t.plan.moves[i].dst_rank);
    if (c < t.moves_into.size()) t.moves_into[c].push_back(i);
  }
}

// The plan of the moves into chunk c alone, as a plan to a world of one target rank (so
// executing it costs in proportion to the chunk's moves, not to the world size).
ParamPlan ChunkPlan(const PlannedTensor& t, size_t c) {
  ParamPlan moves;
  moves.source_world = t.plan.source_world;
  moves.target_world = 1;
  moves.source_buffers = t.plan.source_buffers;
  if (!t.plan.target_buffers.empty()) moves.target_buffers = {t.plan.target_buffers[c]};
  moves.moves.reserve(t.moves_into[c].size());
  for (size_t i : t.moves_into[c]) {
    moves.moves.push_back(t.plan.moves[i]);
    moves.moves.back().dst_rank = 0;
  }
  return moves;
}

// The map whose shard c is chunk c: a world of the chunks alone, not of the ranks (most of
// which hold no rows of a small tensor at a large world size), so that planning costs in
// proportion to the chunks written (a 0-d tensor: one rank, its one chunk).
Result<ParamMap> ChunkMap(const DcpTensorToWrite& t) {
  if (t.shape.empty()) return ReplicatedMap(t.shape, 1);
  std::vector<Index> rows;
  rows.reserve(t.chunks.size());
  for (const DcpWriteChunk& c : t.chunks) rows.push_back(c.sizes[0]);
  return SplitMap(t.shape, 0, rows);
}

Result<std::vector<PlannedTensor>> PlanWrite(const Manifest& m, int world_size,
                                             const CheckpointOptions& options,
                                             const StateDictStructure* structure) {
  if (options.max_shard_bytes != 0) {
    return InvalidArgumentError(
        "a DCP checkpoint has one file per rank: no maximum file size applies");
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<DcpTensorToWrite> tensors,
                           PlanDcpTensors(m, world_size, structure));
  std::vector<PlannedTensor> out;
  for (DcpTensorToWrite& t : tensors) {
    const ShardedParam& p = m.params[t.param];
    const std::string where = fmt::format("parameter \"{}\"", p.name);
    PlannedTensor planned{std::move(t), {}, {}};
    if (ProductOf(planned.dcp.shape) > 0) {
      Result<ParamMap> target = ChunkMap(planned.dcp);
      if (!target.ok()) return target.status().Annotate(where);
      Result<ParamPlan> plan = Compose(*target, p.map);
      if (!plan.ok()) return plan.status().Annotate(where);
      planned.plan = *std::move(plan);
    }
    GroupMovesByChunk(planned);
    out.push_back(std::move(planned));
  }
  return out;
}

// The non-tensor values of `structure` (none when null), their items one after the other at
// the start of rank 0's file. FailedPrecondition for one that would take a tensor's key.
Result<std::vector<DcpObjectToWrite>> PlanObjects(const StateDictStructure* structure,
                                                  const std::vector<PlannedTensor>& tensors) {
  std::vector<DcpObjectToWrite> out;
  if (structure == nullptr) return out;
  std::set<std::string> keys;
  for (const PlannedTensor& t : tensors) keys.insert(t.dcp.key);
  uint64_t offset = 0;
  for (const StateDictObject& o : structure->objects) {
    if (!keys.insert(o.key).second) {
      return FailedPreconditionError(
          fmt::format("the non-tensor value \"{}\" would take a key already taken", o.key));
    }
    out.push_back({o.key, o.path.keys, o.path.is_index, o.transforms,
                   DcpWrittenItem{DcpFileName(0), offset, o.stored_bytes}});
    offset += o.stored_bytes;
  }
  return out;
}

// Appends the stored bytes of `structure`'s objects to `file` (as PlanObjects placed them).
Status AppendObjects(AtomicFileWriter& file, const StateDictStructure& structure) {
  for (const StateDictObject& o : structure.objects) {
    RESHARD_ASSIGN_OR_RETURN(const std::span<const std::byte> bytes, o.read());
    if (bytes.size() != o.stored_bytes) {
      return InternalError(fmt::format("\"{}\" holds {} bytes, {} were expected", o.key,
                                       bytes.size(), o.stored_bytes));
    }
    RESHARD_RETURN_IF_ERROR(file.Append(bytes));
  }
  return Status::Ok();
}

// The bytes of `param`'s replicated pieces (what comparing its replicas reads).
uint64_t ReplicatedBytes(const ShardedParam& param) {
  uint64_t bytes = 0;
  for (const RankShard& s : param.map.ranks()) {
    for (const Piece& piece : s.pieces) {
      if (piece.is_replicated()) bytes += ElementBytes(piece.num_elements(), param.dtype);
    }
  }
  return bytes;
}

ExecOptions ExecOptionsOf(const CheckpointOptions& options, int scale_power, int threads) {
  ExecOptions e;
  e.scale_power = scale_power;
  e.allow_scaled_optimizer_state = options.allow_scaled_optimizer_state;
  e.verify_replicas = options.verify_replicas;
  e.allow_lossy_scale = options.allow_lossy_scale;
  e.num_threads = threads;
  return e;
}

// chunks[r]: the (tensor, chunk) pairs rank r's file holds, in the order it writes them.
using ChunksByRank = std::vector<std::vector<std::pair<size_t, size_t>>>;

// Each rank's chunks, adding each chunk's bytes to its rank's `file_bytes` and its item (in
// its rank's file, where it lies not known yet) to `items`.
ChunksByRank ChunksOfRanks(const std::vector<PlannedTensor>& tensors, int world_size,
                           std::vector<uint64_t>& file_bytes,
                           std::vector<std::vector<DcpWrittenItem>>& items) {
  ChunksByRank chunks(static_cast<size_t>(world_size));
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (size_t c = 0; c < tensors[t].dcp.chunks.size(); ++c) {
      const DcpWriteChunk& chunk = tensors[t].dcp.chunks[c];
      items[t].push_back({DcpFileName(chunk.rank), 0, 0});
      file_bytes[static_cast<size_t>(chunk.rank)] +=
          ElementBytes(ProductOf(chunk.sizes), tensors[t].dcp.dtype);
      chunks[static_cast<size_t>(chunk.rank)].emplace_back(t, c);
    }
  }
  return chunks;
}

// Items written by this process, as "tensor chunk offset length" lines.
std::string EncodeItems(const std::vector<std::vector<DcpWrittenItem>>& items,
                        const std::vector<std::vector<bool>>& mine) {
  std::string out;
  for (size_t t = 0; t < items.size(); ++t) {
    for (size_t c = 0; c < items[t].size(); ++c) {
      if (mine[t][c]) {
        out += fmt::format("{} {} {} {}\n", t, c, items[t][c].offset, items[t][c].length);
      }
    }
  }
  return out;
}

Status DecodeItems(const std::string& text, std::vector<std::vector<DcpWrittenItem>>& items) {
  std::istringstream in(text);
  size_t t = 0, c = 0;
  uint64_t offset = 0, length = 0;
  while (in >> t >> c >> offset >> length) {
    if (t >= items.size() || c >= items[t].size()) {
      return InternalError(fmt::format("a process reported item {} of tensor {}", c, t));
    }
    items[t][c].offset = offset;
    items[t][c].length = length;
  }
  return Status::Ok();
}

// Every process tells process 0 where its items lie (called by all, whatever happened).
Status GatherItems(Communicator& comm, const std::vector<std::vector<bool>>& mine,
                   std::vector<std::vector<DcpWrittenItem>>& items) {
  if (comm.size() <= 1) return Status::Ok();
  Result<std::vector<std::string>> all = comm.AllGather(EncodeItems(items, mine));
  Status gathered = all.status();
  if (all.ok() && comm.rank() == 0) {
    for (const std::string& text : *all) {
      if (gathered.ok()) gathered = DecodeItems(text, items);
    }
  }
  return gathered;
}

}  // namespace

Status WriteDcp(ShardSource& source, int world_size, const std::string& out_dir,
                const CheckpointOptions& all_options, const StateDictStructure* structure) {
  if (world_size < 1) {
    return InvalidArgumentError(fmt::format("{} is not a world size", world_size));
  }
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  const Manifest& m = source.manifest();
  Result<std::vector<PlannedTensor>> planned = PlanWrite(m, world_size, options, structure);
  Result<std::vector<DcpObjectToWrite>> objects =
      planned.ok() ? PlanObjects(structure, *planned) : planned.status();
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, objects.status()));
  const std::vector<PlannedTensor>& tensors = *planned;

  // Rank files, their bytes (rank 0's begins with the objects), and the process writing each.
  std::vector<uint64_t> file_bytes(static_cast<size_t>(world_size), 0);
  for (const DcpObjectToWrite& o : *objects) file_bytes[0] += o.item.length;
  const uint64_t objects_bytes = file_bytes[0];
  std::vector<std::vector<DcpWrittenItem>> items(tensors.size());
  const ChunksByRank chunks_of = ChunksOfRanks(tensors, world_size, file_bytes, items);
  const std::vector<int> owners = BalanceByBytes(file_bytes, comm.size());
  std::vector<std::vector<bool>> mine(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (const DcpWriteChunk& c : tensors[t].dcp.chunks) {
      mine[t].push_back(owners[static_cast<size_t>(c.rank)] == comm.rank());
    }
  }

  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out,
                           OpenOutput(comm, out_dir, options, source.inputs()));
  uint64_t total = 0;
  for (uint64_t bytes : file_bytes) total += bytes;
  ProgressCounter progress(options, total);
  ProcessStats stats;
  std::vector<Rank> own;
  for (Rank r = 0; r < world_size; ++r) {
    if (owners[static_cast<size_t>(r)] != comm.rank()) continue;
    own.push_back(r);
    stats.files.push_back(DcpFileName(r));
    stats.bytes_written += file_bytes[static_cast<size_t>(r)];
  }
  // Replicas agree (P2): each parameter's are compared once, by the first writer to reach it.
  std::vector<std::once_flag> verify_once(tensors.size());
  std::vector<Status> verified(tensors.size());
  std::atomic<uint64_t> bytes_read{0}, bytes_verified{0};
  const Status written = ForEachIndex(own.size(), options.num_threads, [&](size_t k) -> Status {
    const Rank r = own[k];
    const std::string name = DcpFileName(r);
    RESHARD_ASSIGN_OR_RETURN(
        AtomicFileWriter file,
        AtomicFileWriter::Create(out.FilePath(name), OutputFileOptions(options)));
    uint64_t position = 0;
    if (r == 0 && structure != nullptr) {
      RESHARD_RETURN_IF_ERROR(AppendObjects(file, *structure).Annotate(name));
      position = objects_bytes;
      progress.Add(objects_bytes);
    }
    for (const std::pair<size_t, size_t>& chunk_index : chunks_of[static_cast<size_t>(r)]) {
      const size_t t = chunk_index.first;
      const size_t c = chunk_index.second;
      const PlannedTensor& pt = tensors[t];
      const ShardedParam& param = m.params[pt.dcp.param];
      const DcpWriteChunk& chunk = pt.dcp.chunks[c];
      const auto fill = [&](std::span<std::byte> buffer) -> Status {
        if (buffer.empty()) return Status::Ok();
        if (source.ReadsRegions()) {  // the chunk's box alone, from the stored chunks
          bytes_read += buffer.size();
          RESHARD_RETURN_IF_ERROR(
              source.ReadRegion(pt.dcp.param, chunk.offsets, chunk.sizes, buffer, 1));
          progress.Add(buffer.size());
          return Status::Ok();
        }
        AcquiredShards shards(source, pt.dcp.param);
        RESHARD_RETURN_IF_ERROR(shards.status());
        if (options.verify_replicas) {
          std::call_once(verify_once[t], [&] {
            bytes_verified += ReplicatedBytes(param);
            verified[t] = VerifyReplicas(param.map, param.dtype, shards.shards(),
                                         ExecOptionsOf(options, param.scale_power, 1));
          });
          RESHARD_RETURN_IF_ERROR(verified[t]);
        }
        const ParamPlan moves = ChunkPlan(pt, c);
        bytes_read += ElementBytes(moves.num_moved_elements(), param.dtype);
        std::vector<MutableBuffer> targets = {{buffer.data(), ProductOf(chunk.sizes)}};
        RESHARD_RETURN_IF_ERROR(ExecutePlan(moves, param.dtype, shards.shards(), targets,
                                            ExecOptionsOf(options, param.scale_power, 1)));
        progress.Add(buffer.size());
        return Status::Ok();
      };
      TorchTreeBuilder item;
      const PickleNodeId root = item.Tensor(param.dtype, chunk.sizes, fill);
      Result<uint64_t> length = item.AppendTo(file, root);
      if (!length.ok()) {
        return length.status().Annotate(fmt::format("tensor \"{}\", chunk at {} of \"{}\"",
                                                    pt.dcp.key, FormatShape(chunk.offsets), name));
      }
      items[t][c].offset = position;
      items[t][c].length = *length;
      position += *length;
    }
    return file.Commit();
  });
  const Status synced = SyncOutputFiles(out, written, stats.files, options);
  stats.bytes_read = bytes_read;
  stats.bytes_verified = bytes_verified;
  const Status gathered = GatherItems(comm, mine, items);
  const Status outcome = synced.ok() ? gathered : synced;
  return FinishOutput(comm, out, outcome, std::move(stats), options, [&]() -> Status {
    std::vector<DcpTensorToWrite> layout;
    for (const PlannedTensor& pt : tensors) layout.push_back(pt.dcp);
    RESHARD_ASSIGN_OR_RETURN(const std::string metadata,
                             DcpMetadataPickle(layout, items, out_dir, *objects));
    RESHARD_RETURN_IF_ERROR(
        WriteFileAtomically(out.FilePath(kDcpMetadataName), metadata, {.sync = options.sync}));
    return out.Commit(options.sync);
  });
}

}  // namespace reshard
