// reshard._core: the checkpoint operations (scatter, gather, convert) and the degree planner.
// They run with the GIL released; a progress callback takes it back for each call.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/deepspeed/pipeline_writer.h"
#include "reshard/checkpoint/diff.h"
#include "reshard/checkpoint/formats/formats.h"
#include "reshard/checkpoint/inspect.h"
#include "reshard/checkpoint/megatron/megatron.h"
#include "reshard/checkpoint/orbax/orbax.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/checkpoint/universal/universal.h"
#include "reshard/exec/dequantize.h"
#include "reshard/hf/checkpoint_maps.h"
#include "reshard/hf/degree.h"
#include "reshard/hf/model_config.h"
#include "reshard/hf/model_maps.h"
#include "reshard/hf/registry.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/layouts_document.h"

namespace reshard::python {
namespace {

// The options of every checkpoint operation. A Python callback runs under the GIL; the first
// exception it raises is kept and raised again once the operation returns.
struct PyCheckpointOptions {
  bool overwrite = false;
  bool sync = true;
  uint64_t max_shard_bytes = 0;
  bool verify_replicas = true;
  bool allow_scaled_optimizer_state = false;
  bool allow_lossy_scale = false;
  int num_threads = 0;
  std::optional<py::function> progress;
  std::optional<py::function> warn;
};

struct CallbackError {
  std::optional<py::error_already_set> error;
};

// `f` as a library callback, callable from any thread without the GIL: each call takes the
// GIL, and once `f` has raised, later calls do nothing. The Python function is held through a
// shared_ptr so that copies of the callback made without the GIL touch no reference count.
template <typename... Args>
std::function<void(Args...)> UnderGil(const py::function& f, std::shared_ptr<CallbackError> err) {
  auto held = std::make_shared<py::function>(f);
  return [held, err](Args... args) {
    py::gil_scoped_acquire acquire;
    if (err->error) return;
    try {
      (*held)(args...);
    } catch (py::error_already_set& e) {
      err->error = std::move(e);
    }
  };
}

CheckpointOptions ToOptions(const PyCheckpointOptions& o, std::shared_ptr<CallbackError> err) {
  CheckpointOptions c;
  c.overwrite = o.overwrite;
  c.sync = o.sync;
  c.max_shard_bytes = o.max_shard_bytes;
  c.verify_replicas = o.verify_replicas;
  c.allow_scaled_optimizer_state = o.allow_scaled_optimizer_state;
  c.allow_lossy_scale = o.allow_lossy_scale;
  c.num_threads = o.num_threads;
  if (o.progress) c.progress = UnderGil<uint64_t, uint64_t>(*o.progress, err);
  if (o.warn) c.warn = UnderGil<const std::string&, const std::string&>(*o.warn, err);
  return c;
}

// Maps handed over from Python as [(name, map)], each validated, as a map document.
MapDocument DocumentOf(const std::vector<std::pair<std::string, MapHandle*>>& maps) {
  MapDocument doc;
  for (const auto& [name, map] : maps) doc.params.emplace_back(name, map->Valid());
  return doc;
}

// Runs `op` without the GIL; raises the callback's exception, else the operation's error.
template <typename Op>
void RunCheckpointOp(const PyCheckpointOptions& py_options, Op op) {
  auto err = std::make_shared<CallbackError>();
  CheckpointOptions options = ToOptions(py_options, err);
  const Status s = [&] {
    py::gil_scoped_release release;
    return op(options);
  }();
  if (err->error) throw std::move(*err->error);
  if (!s.ok()) Raise(s, ErrorKind::kCheckpoint);
}

// The buffers of a version-2 map document (their JSON), unvalidated; none when empty.
BufferSetBuilder BuffersOf(const std::string& buffers_json) {
  if (buffers_json.empty()) return {};
  Result<BufferSetBuilder> b = ParseBufferSetJson(buffers_json);
  if (!b.ok()) Raise(b.status(), ErrorKind::kMap);
  return *std::move(b);
}

void ScatterWithMaps(const std::string& full_dir, const std::string& out_dir,
                     const std::vector<std::pair<std::string, MapHandle*>>& maps,
                     const std::string& buffers_json, const PyCheckpointOptions& o) {
  MapDocument doc = DocumentOf(maps);
  if (doc.params.empty()) throw py::value_error("scatter: no maps given");
  const int world = doc.params.front().second.world_size();
  BufferSetBuilder buffers = BuffersOf(buffers_json);
  if (IsPeftAdapterDir(full_dir)) {  // the maps are the base model's
    if (Status s = ValidateBuffers(doc, buffers); !s.ok()) Raise(s, ErrorKind::kMap);
    Result<MapDocument> adapter = AdapterMapsFromDocument(full_dir, doc);
    if (!adapter.ok()) Raise(adapter.status(), ErrorKind::kCheckpoint);
    doc = *std::move(adapter);
    buffers = BufferSetBuilder(doc.buffers);
  }
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    return Scatter(full_dir, world, MapsFromDocument(doc), buffers, out_dir, options);
  });
}

void ScatterWithLayouts(const std::string& full_dir, const std::string& out_dir,
                        const std::string& layouts_json, int world, const PyCheckpointOptions& o) {
  Result<LayoutsDocument> doc = ParseLayoutsDocumentJson(layouts_json);
  if (!doc.ok()) Raise(doc.status(), ErrorKind::kMap);
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    return Scatter(full_dir, world, MapsFromLayouts(std::move(doc->layouts), world), out_dir,
                   options);
  });
}

// A distributed config (JSON text) as plan options; none when empty.
PlanOptions PlanOptionsOf(const std::optional<std::string>& distributed_config_json) {
  PlanOptions options;
  if (distributed_config_json) {
    Result<DistributedConfig> d =
        ParseDistributedConfigJson(BuiltinTpRegistry(), *distributed_config_json);
    if (!d.ok()) Raise(d.status().Annotate("distributed_config"), ErrorKind::kCheckpoint);
    options.distributed = *std::move(d);
  }
  return options;
}

// Every tensor laid out as transformers holds it at `world` processes under the distributed
// config (MoE experts into their stacked buffers), with the plan's degree constraints and the
// config recorded in the manifest (as `reshard scatter --config`).
void ScatterWithConfig(const std::string& full_dir, const std::string& out_dir,
                       const std::string& config_json, int world,
                       const std::optional<std::string>& distributed_config_json,
                       const PyCheckpointOptions& o) {
  const PlanOptions plan_options = PlanOptionsOf(distributed_config_json);
  Result<ConfigScatter> planned = [&] {
    py::gil_scoped_release release;
    return ConfigScatterMaps(full_dir, config_json, world, plan_options);
  }();
  if (!planned.ok()) Raise(planned.status(), ErrorKind::kCheckpoint);
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    options.degree_constraints = planned->constraints;
    options.model_config = planned->model_config;
    options.block_scales = planned->block_scales;
    return Scatter(full_dir, world, planned->maps, planned->buffers, out_dir, options);
  });
}

// Option mistakes are ValueError before anything is opened; what the checkpoint says is
// CheckpointError.
void CheckOptions(const std::string& dir, const SourceOptions& source) {
  const Status valid = CheckSourceOptions(dir, source);
  if (!valid.ok()) throw py::value_error(valid.message());
}

// dequantize="bf16" / "fp16" / "fp32" (None: off) as options; ValueError for another.
std::optional<DequantizeOptions> DequantizeOptionsOf(const std::optional<std::string>& dequantize) {
  if (!dequantize) return std::nullopt;
  const std::optional<DType> d = DequantizedDTypeFromName(*dequantize);
  if (!d) {
    throw py::value_error("dequantize: expected \"bf16\", \"fp16\" or \"fp32\", got \"" +
                          *dequantize + "\"");
  }
  return DequantizeOptions{*d, {}};
}

// Any checkpoint reshard reads (formats/formats.h), as `reshard gather` reads it: a DeepSpeed
// checkpoint's module weights, or with `fp32` its optimizer's fp32 master weights.
void PyGather(const std::string& dir, const std::string& out_dir, bool fp32, bool optimizer_state,
              const std::optional<std::string>& config,
              const std::optional<std::string>& dequantize, const std::optional<std::string>& names,
              const PyCheckpointOptions& o) {
  SourceOptions source;
  source.use = SourceUse::kGather;
  source.master_weights = fp32;
  source.optimizer_state = optimizer_state;
  source.config_path = config.value_or("");
  source.names = names.value_or("");
  source.dequantize = dequantize.has_value();
  const std::optional<DequantizeOptions> deq = DequantizeOptionsOf(dequantize);
  CheckOptions(dir, source);
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    options.dequantize = deq;
    return GatherCheckpoint(dir, source, out_dir, options);
  });
}

// Any checkpoint reshard reads, as `reshard convert` reads it (a DeepSpeed checkpoint: module
// weights and, unless `weights_only`, its optimizer state).
void PyConvert(const std::string& dir, int world, const std::string& out_dir,
               const std::optional<std::vector<std::pair<std::string, MapHandle*>>>& target_maps,
               const std::string& buffers_json, bool weights_only,
               const std::optional<std::string>& distributed_config_json,
               const std::optional<std::string>& config,
               const std::optional<std::string>& dequantize,
               const std::optional<std::string>& names, const PyCheckpointOptions& o) {
  const std::optional<DequantizeOptions> deq = DequantizeOptionsOf(dequantize);
  std::optional<MapDocument> target;
  if (target_maps) {
    target = DocumentOf(*target_maps);
    const Status valid = ValidateBuffers(*target, BuffersOf(buffers_json));
    if (!valid.ok()) Raise(valid, ErrorKind::kMap);
  }
  if (target_maps && distributed_config_json) {
    throw py::value_error("give target_maps= or distributed_config=, not both");
  }
  SourceOptions source;
  source.use = SourceUse::kConvert;
  source.weights_only = weights_only;
  source.config_path = config.value_or("");
  source.distributed_config = distributed_config_json.value_or("");
  source.names = names.value_or("");
  CheckOptions(dir, source);
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    options.dequantize = deq;
    Status s = ConvertCheckpoint(dir, source, ShardedTargetRun(world), target, out_dir, options);
    if (s.message().ends_with("without target maps")) {
      return Status(s.code(), s.message() +
                                  "; give them with target_maps= (or put the model's "
                                  "config.json in a DeepSpeed save dir)");
    }
    return s;
  });
}

// `reshard convert --to universal`: a DeepSpeed checkpoint, a PyTorch Distributed Checkpoint, a
// Megatron-Core dist-ckpt (with its model's config.json) or an Orbax checkpoint with optax's
// Adam moments -> the universal checkpoint DeepSpeed resumes from at any TP x DP.
void PyConvertToUniversal(const std::string& dir, const std::string& out_dir,
                          const std::optional<std::string>& config,
                          const std::vector<std::string>& drop, const PyCheckpointOptions& o) {
  const bool megatron = IsMegatronCheckpoint(dir);
  const bool dcp = !megatron && IsDcpCheckpoint(dir);
  const bool orbax = !megatron && !dcp && IsOrbaxCheckpoint(dir);
  if (!IsDeepSpeedCheckpoint(dir) && !dcp && !megatron && !orbax) {
    throw py::value_error(
        "to=\"universal\" converts a DeepSpeed checkpoint, a PyTorch Distributed Checkpoint, "
        "a Megatron-Core dist-ckpt or an Orbax checkpoint with Adam's moments; \"" +
        dir + "\" is not one");
  }
  if (megatron != config.has_value()) {
    throw py::value_error(megatron ? "\"" + dir +
                                         "\" is a Megatron-Core checkpoint, which does not record "
                                         "its model's shapes or Hugging Face names: give config="
                                   : std::string("config= applies to to=\"universal\" from a "
                                                 "Megatron-Core checkpoint"));
  }
  if (megatron && !drop.empty()) {
    throw py::value_error(
        "drop= applies to to=\"universal\" from a PyTorch Distributed Checkpoint, a DeepSpeed "
        "checkpoint or an Orbax checkpoint");
  }
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    options.drop = drop;
    if (megatron) return ConvertMegatronToUniversal(dir, *config, out_dir, options);
    if (orbax) return ConvertOrbaxToUniversal(dir, out_dir, options);
    return dcp ? ConvertDcpToUniversal(dir, out_dir, options)
               : ConvertDeepSpeedToUniversal(dir, out_dir, options);
  });
}

// `reshard convert --to dcp --world N`: any checkpoint -> a PyTorch Distributed Checkpoint
// saved for `world` ranks.
// convert(pp=...): a DeepSpeed PipelineModule checkpoint at other PP x TP x DP degrees.
void PyConvertToPipeline(const std::string& dir, int pp, int tp, int dp,
                         const std::vector<int>& stage_layers, const std::string& out_dir,
                         const PyCheckpointOptions& o) {
  if (!IsDeepSpeedCheckpoint(dir)) {
    throw py::value_error(
        "pp= writes a DeepSpeed pipeline checkpoint from a DeepSpeed PipelineModule checkpoint; "
        "\"" +
        dir + "\" is not a DeepSpeed checkpoint");
  }
  DeepSpeedPipelineTarget target;
  target.pp = pp;
  target.tp = tp;
  target.dp = dp;
  target.stage_layers = stage_layers;
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    return ConvertDeepSpeedToPipeline(dir, target, out_dir, options);
  });
}

void PyConvertToDcp(const std::string& dir, int world, const std::string& out_dir,
                    bool weights_only, const std::optional<std::string>& config,
                    const std::optional<std::string>& names, const PyCheckpointOptions& o) {
  SourceOptions source;
  source.use = SourceUse::kConvert;
  source.weights_only = weights_only;
  source.config_path = config.value_or("");
  source.names = names.value_or("");
  CheckOptions(dir, source);
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    return WriteDcpCheckpoint(dir, source, DcpTargetRun(world), out_dir, options);
  });
}

// convert(to="orbax"): the mesh ("fsdp=2,tensor=4"), the partition specs as JSON text ("" for
// none) and the storage ("zarr3", "zarr2", "plain"); ValueError for any of them malformed.
void PyConvertToOrbax(const std::string& dir, const std::string& mesh, const std::string& specs,
                      const std::string& storage, const std::string& out_dir, bool weights_only,
                      const std::optional<std::string>& config,
                      const std::optional<std::string>& names, const PyCheckpointOptions& o) {
  SourceOptions source;
  source.use = SourceUse::kConvert;
  source.weights_only = weights_only;
  source.config_path = config.value_or("");
  CheckOptions(dir, source);
  Result<OrbaxTarget> target = ParseOrbaxTarget(mesh, specs);
  if (!target.ok()) throw py::value_error(target.status().message());
  Result<OrbaxStorage> stored = ParseOrbaxStorage(storage);
  if (!stored.ok()) throw py::value_error(stored.status().message());
  target->storage = *stored;
  target->names = names.value_or("");
  RunCheckpointOp(o, [&](CheckpointOptions& options) {
    return WriteOrbaxCheckpoint(dir, source, *target, out_dir, options);
  });
}

py::object OptionalInt(const std::optional<int64_t>& v) {
  return v ? py::object(py::int_(*v)) : py::object(py::none());
}

// The fields of `reshard degree --json`.
py::dict Degree(const std::string& config_json, std::optional<int64_t> tp,
                const std::string& engine, const std::optional<std::string>& transformers_version,
                const std::optional<std::string>& distributed_config_json) {
  const TpRegistry& registry = BuiltinTpRegistry();
  PlanOptions options;
  if (engine != "transformers" && engine != "vllm") {
    throw py::value_error("engine must be \"transformers\" or \"vllm\", not \"" + engine + "\"");
  }
  options.engine = engine == "vllm" ? Engine::kVllm : Engine::kTransformers;
  if (transformers_version) {
    Result<Version> v = ParseVersion(*transformers_version);
    if (!v.ok()) Raise(v.status().Annotate("transformers_version"), ErrorKind::kDegree);
    options.transformers_version = *v;
  }
  if (distributed_config_json) {
    Result<DistributedConfig> d = ParseDistributedConfigJson(registry, *distributed_config_json);
    if (!d.ok()) Raise(d.status().Annotate("distributed config"), ErrorKind::kDegree);
    options.distributed = *std::move(d);
  }
  Result<std::optional<int64_t>> requested = RequestedDegree(tp, options.distributed);
  if (!requested.ok()) Raise(requested.status(), ErrorKind::kDegree);
  Result<ModelConfig> config = ReadModelConfigJson(registry, config_json);
  if (!config.ok()) Raise(config.status(), ErrorKind::kDegree);
  const DegreeAnswer a = PlanDegree(ResolvePlan(registry, *config, options), *requested);
  py::list constraints;
  for (const ResolvedEntry& e : a.constraints) {
    py::dict c;
    c["module"] = e.pattern;
    c["style"] = e.style;
    c["count"] = *e.count;
    c["meaning"] = e.meaning;
    constraints.append(c);
  }
  py::dict d;
  d["max_tp_degree"] = OptionalInt(a.max_tp_degree);
  d["degrees"] = a.degrees;
  d["requested"] = OptionalInt(a.requested);
  d["chosen"] = OptionalInt(a.chosen);
  d["constraints"] = constraints;
  d["refusal"] = a.refusal ? py::object(py::make_tuple(a.refusal->reason, a.refusal->message))
                           : py::object(py::none());
  d["notes"] = a.notes;
  return d;
}

// The report of `reshard inspect` (JSON, or the text for a person) on a file or directory.
std::string PyInspect(const std::string& path, bool json) {
  Result<std::string> report = [&] {
    py::gil_scoped_release release;
    return Inspect(path, json ? InspectFormat::kJson : InspectFormat::kText, BlockScalesOfDir);
  }();
  if (!report.ok()) Raise(report.status(), ErrorKind::kCheckpoint);
  return *std::move(report);
}

// reshard diff: (tensors compared, elements compared, differences), each difference a tuple
// (name, kind, dtype_a, dtype_b, shape_a, shape_b, index, multi_index, value_a, value_b) with
// None for what the side lacks (and for the element of a difference that is not of values).
using PyDifference =
    std::tuple<std::string, std::string, std::optional<std::string>, std::optional<std::string>,
               std::optional<Shape>, std::optional<Shape>, std::optional<Index>,
               std::optional<Shape>, std::optional<std::string>, std::optional<std::string>>;

std::tuple<int64_t, int64_t, std::vector<PyDifference>> PyDiff(
    const std::string& a, const std::string& b, std::optional<double> atol,
    std::optional<double> rtol, const std::optional<std::string>& dequantize,
    const std::optional<std::string>& config) {
  const std::optional<DequantizeOptions> deq = DequantizeOptionsOf(dequantize);
  DiffOptions options;
  options.atol = atol;
  options.rtol = rtol;
  if ((atol && !(*atol >= 0 && std::isfinite(*atol))) ||
      (rtol && !(*rtol >= 0 && std::isfinite(*rtol)))) {
    throw py::value_error("atol and rtol are finite numbers >= 0");
  }
  Result<DiffReport> report = [&] {
    py::gil_scoped_release release;
    return DiffCheckpoints(a, b, deq, options, config.value_or(""));
  }();
  if (!report.ok()) Raise(report.status(), ErrorKind::kCheckpoint);
  auto name = [](const std::optional<DType>& d) {
    return d ? std::optional<std::string>(DTypeName(*d)) : std::nullopt;
  };
  std::vector<PyDifference> out;
  for (const TensorDifference& d : report->differences) {
    const bool value = d.kind == DiffKind::kValue;
    out.emplace_back(d.name, std::string(DiffKindName(d.kind)), name(d.dtype_a), name(d.dtype_b),
                     d.shape_a, d.shape_b, value ? std::optional<Index>(d.index) : std::nullopt,
                     value ? std::optional<Shape>(d.multi_index) : std::nullopt,
                     value ? std::optional<std::string>(d.value_a) : std::nullopt,
                     value ? std::optional<std::string>(d.value_b) : std::nullopt);
  }
  return {report->tensors_compared, report->elements_compared, std::move(out)};
}

// A reshard sharded checkpoint opened as `reshard gather` opens it (ShardedCheckpoint::Open:
// the manifest read strictly, every rank's files checked against it before any data is read),
// for reshard.checkpoint.load_rank. Its files stay mapped while the object lives.
class PyShardedCheckpoint {
 public:
  static std::shared_ptr<PyShardedCheckpoint> Open(const std::string& dir) {
    Result<ShardedCheckpoint> ckpt = [&] {
      py::gil_scoped_release release;
      return ShardedCheckpoint::Open(dir);
    }();
    if (!ckpt.ok()) Raise(ckpt.status(), ErrorKind::kCheckpoint);
    return std::make_shared<PyShardedCheckpoint>(*std::move(ckpt));
  }
  explicit PyShardedCheckpoint(ShardedCheckpoint ckpt) : ckpt_(std::move(ckpt)) {}

  int world_size() const { return ckpt_.manifest().world_size; }

  // [(name, dtype, map, scale_power)] in manifest order.
  py::list Params() const {
    py::list out;
    for (const ShardedParam& p : ckpt_.manifest().params) {
      out.append(
          py::make_tuple(p.name, std::string(DTypeName(p.dtype)), MapHandle(p.map), p.scale_power));
    }
    return out;
  }

  // Rank `rank`'s tensors: [(name, dtype, shape, [indices into Params()])], a buffer once
  // (with every parameter whose pieces it holds; none for a buffer that is all padding).
  py::list RankTensors(Rank rank) const {
    py::list out;
    for (const RankTensor& t : RankTensorsOf(ckpt_.manifest(), CheckRank(rank))) {
      out.append(py::make_tuple(t.name, std::string(DTypeName(t.dtype)),
                                py::tuple(py::cast(t.shape)), py::cast(t.params)));
    }
    return out;
  }

  // Copies the bytes of rank `rank`'s tensor `index` (of RankTensors) to `address`, which
  // holds `bytes` bytes (exactly the tensor's).
  void CopyTensor(Rank rank, size_t index, uintptr_t address, uint64_t bytes) const {
    const std::vector<RankTensor> tensors = RankTensorsOf(ckpt_.manifest(), CheckRank(rank));
    if (index >= tensors.size() || tensors[index].params.empty()) {
      throw py::index_error("rank " + std::to_string(rank) + " has no stored tensor " +
                            std::to_string(index));
    }
    const std::span<const std::byte> data = ckpt_.shard(tensors[index].params.front(), rank);
    if (data.size() != bytes) {
      throw py::value_error("tensor \"" + tensors[index].name + "\" holds " +
                            std::to_string(data.size()) + " bytes, not " + std::to_string(bytes));
    }
    py::gil_scoped_release release;
    if (bytes) std::memcpy(reinterpret_cast<void*>(address), data.data(), bytes);
  }

 private:
  Rank CheckRank(Rank rank) const {
    if (rank < 0 || rank >= world_size()) {
      throw py::index_error("rank " + std::to_string(rank) + " is outside the checkpoint's " +
                            std::to_string(world_size()) + " ranks");
    }
    return rank;
  }

  ShardedCheckpoint ckpt_;
};

// The Hugging Face tensors of a live Megatron model over its ranks' tensors, as a version-2 map
// document: `shards` are (key, global shape, dtype name, rank, offsets, sizes, rank tensor,
// its elements, the box's offset in it).
using LiveShardTuple =
    std::tuple<std::string, Shape, std::string, Rank, Shape, Shape, std::string, Index, Index>;
std::string MegatronLiveMaps(const std::string& config_json,
                             const std::vector<LiveShardTuple>& shards, int world,
                             const std::string& what) {
  Result<MegatronModelConfig> config = ParseMegatronModelConfig(config_json, "config.json");
  if (!config.ok()) Raise(config.status(), ErrorKind::kMap);
  std::vector<MegatronLiveShard> live;
  live.reserve(shards.size());
  for (const auto& [key, shape, dtype, rank, offsets, sizes, buffer, elements, offset] : shards) {
    const std::optional<DType> d = DTypeFromName(dtype);
    if (!d) {
      std::string message = "Megatron tensor \"";
      message.append(key).append("\" has dtype ").append(dtype);
      Raise(InvalidArgumentError(message.append(", which reshard does not know")), ErrorKind::kMap);
    }
    live.push_back({key, shape, *d, rank, offsets, sizes, buffer, elements, offset});
  }
  Result<Manifest> manifest = [&] {
    py::gil_scoped_release release;
    return MegatronLiveManifest(*config, live, world, what);
  }();
  if (!manifest.ok()) Raise(manifest.status(), ErrorKind::kMap);
  MapDocument doc;
  for (ShardedParam& p : manifest->params) doc.params.emplace_back(p.name, std::move(p.map));
  doc.buffers = std::move(manifest->buffers);
  return MapDocumentToJson(doc);
}

}  // namespace

void BindFiles(py::module_& m) {
  m.def("megatron_live_maps", &MegatronLiveMaps, py::arg("config_json"), py::arg("shards"),
        py::arg("world"), py::arg("what"));
  py::class_<PyCheckpointOptions>(m, "CheckpointOptions")
      .def(py::init<>())
      .def_readwrite("overwrite", &PyCheckpointOptions::overwrite)
      .def_readwrite("sync", &PyCheckpointOptions::sync)
      .def_readwrite("max_shard_bytes", &PyCheckpointOptions::max_shard_bytes)
      .def_readwrite("verify_replicas", &PyCheckpointOptions::verify_replicas)
      .def_readwrite("allow_scaled_optimizer_state",
                     &PyCheckpointOptions::allow_scaled_optimizer_state)
      .def_readwrite("allow_lossy_scale", &PyCheckpointOptions::allow_lossy_scale)
      .def_readwrite("num_threads", &PyCheckpointOptions::num_threads)
      .def_readwrite("progress", &PyCheckpointOptions::progress)
      .def_readwrite("warn", &PyCheckpointOptions::warn);
  m.def("scatter_with_maps", &ScatterWithMaps);
  m.def("scatter_with_layouts", &ScatterWithLayouts);
  m.def("scatter_with_config", &ScatterWithConfig);
  m.def("gather", &PyGather);
  m.def("convert", &PyConvert);
  m.def("convert_to_universal", &PyConvertToUniversal);
  m.def("convert_to_dcp", &PyConvertToDcp);
  m.def("convert_to_orbax", &PyConvertToOrbax);
  m.def("convert_to_pipeline", &PyConvertToPipeline);
  m.def("degree", &Degree, py::arg("config_json"), py::arg("tp"), py::arg("engine"),
        py::arg("transformers_version"), py::arg("distributed_config_json"));
  m.def("inspect", &PyInspect, py::arg("path"), py::arg("json"));
  m.def("diff", &PyDiff, py::arg("a"), py::arg("b"), py::arg("atol"), py::arg("rtol"),
        py::arg("dequantize"), py::arg("config"));
  py::class_<PyShardedCheckpoint, std::shared_ptr<PyShardedCheckpoint>>(m, "ShardedCheckpoint")
      .def_static("open", &PyShardedCheckpoint::Open, py::arg("dir"))
      .def_property_readonly("world_size", &PyShardedCheckpoint::world_size)
      .def("params", &PyShardedCheckpoint::Params)
      .def("rank_tensors", &PyShardedCheckpoint::RankTensors, py::arg("rank"))
      .def("copy_tensor", &PyShardedCheckpoint::CopyTensor, py::arg("rank"), py::arg("index"),
           py::arg("address"), py::arg("bytes"));
  m.def("parse_byte_size", [](const std::string& text) {
    Result<uint64_t> bytes = ParseByteSize(text);
    if (!bytes.ok()) Raise(bytes.status(), ErrorKind::kCheckpoint);
    return *bytes;
  });
}

}  // namespace reshard::python
