// DeepSpeed checkpoint -> universal checkpoint (ConvertDeepSpeedToUniversal, universal.h).
//
// The output, as ds_to_universal writes it (docs/formats.md, "The universal checkpoint"):
//   OUT/latest_universal                  "<tag>_universal", no newline
//   OUT/<tag>_universal/<model states>    the input's model-states files, byte for byte
//   OUT/<tag>_universal/zero/optimizer_state.pt
//   OUT/<tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt   full fp32 tensors
//   OUT/<tag>_universal/zero/<param>/step.pt                        ZeRO 0-2
// Every file is one job of a thread pool; a state file rebuilds one parameter's full tensor
// from its TP shards (each from its DP fragments) straight into the writer's buffer. Under
// several processes (communicator.h) each writes the files BalanceByBytes gives it into the
// temporary directory process 0 made, and process 0 commits once all have succeeded.
#include "reshard/checkpoint/universal/universal.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <vector>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/deepspeed/deepspeed.h"
#include "reshard/checkpoint/deepspeed/moe.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/checkpoint/universal/universal_files.h"
#include "reshard/exec/dequantize.h"
#include "reshard/io/file.h"
#include "reshard/io/torch_writer.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

constexpr DeepSpeedState kUniversalStates[] = {DeepSpeedState::kMaster, DeepSpeedState::kExpAvg,
                                               DeepSpeedState::kExpAvgSq};

int ScalePower(DeepSpeedState state) {
  return state == DeepSpeedState::kExpAvg ? -1 : state == DeepSpeedState::kExpAvgSq ? -2 : 1;
}

// One file of the output: what to write and its size (for ordering and progress).
struct UniversalJob {
  enum Kind { kState, kStep, kOptimizer, kCopy, kAutoEp } kind = kState;
  size_t param = 0;
  DeepSpeedState state = DeepSpeedState::kMaster;
  std::string source;  // kCopy: the input file
  std::string name;    // the output file, relative to the output directory
  uint64_t bytes = 0;
  std::function<Status(const std::string&, const TorchWriteOptions&)> write = nullptr;  // kAutoEp
};

// Writes the files of the plan from an open checkpoint (one file per call, any thread).
class UniversalWriter {
 public:
  UniversalWriter(const DeepSpeedCheckpoint& c, const CheckpointOptions& options)
      : c_(c), options_(options) {}

  Status Write(const UniversalJob& job, const std::string& path) const;

 private:
  Status WriteState(size_t i, DeepSpeedState state, const std::string& path) const;
  Status FillState(size_t i, DeepSpeedState state, std::span<std::byte> out) const;
  Status FillFrozen(size_t i, std::span<std::byte> out) const;
  Status WriteStep(size_t i, const std::string& path) const;
  Status WriteOptimizerState(const std::string& path) const;

  const DeepSpeedCheckpoint& c_;
  const CheckpointOptions& options_;
};

// Whether the files hold the ZeRO 3 flat form: DeepSpeed merges ZeRO 3 at TP 1 over DP
// alone and saves bare 1-D tensors.
bool FlatForm(const DeepSpeedCheckpoint& c) { return c.stage() == 3 && c.tp() == 1; }

// The shape of the tensor a state file holds.
Shape UniversalShape(const DeepSpeedCheckpoint& c, const DeepSpeedParam& p) {
  Shape shape = p.tp_map.logical_shape();
  if (FlatForm(c)) return {ProductOf(shape)};
  const DeepSpeedUniversalKeys& k = p.universal;
  if (k.vocab_tensor && k.original_vocab_size && !shape.empty() && *k.original_vocab_size >= 0 &&
      *k.original_vocab_size < shape[0]) {
    shape[0] = *k.original_vocab_size;  // ds_to_universal strips the vocabulary's padding
  }
  return shape;
}

Status UniversalWriter::FillState(size_t i, DeepSpeedState state, std::span<std::byte> out) const {
  if (!c_.Holds(i, state)) return FillFrozen(i, out);
  const DeepSpeedParam& p = c_.params()[i];
  const ParamMap& map = p.tp_map;
  // Every byte of these buffers is written before it is read: none is zeroed first.
  std::vector<std::unique_ptr<std::byte[]>> shards;
  std::vector<ConstBuffer> views;
  for (Rank r = 0; r < map.world_size(); ++r) {
    if (std::optional<ConstBuffer> view = c_.TpShardView(i, state, r)) {
      views.push_back(*view);  // read where it lies, no copy
      continue;
    }
    const Index n = map.shard_num_elements(r);
    shards.push_back(std::make_unique_for_overwrite<std::byte[]>(static_cast<size_t>(n) * 4));
    RESHARD_RETURN_IF_ERROR(c_.ReadTpShard(i, state, r, {shards.back().get(), n}));
    views.push_back({shards.back().get(), n});
  }
  const Index full = ProductOf(map.logical_shape());
  std::unique_ptr<std::byte[]> scratch;
  MutableBuffer dest{out.data(), full};
  if (out.size() != static_cast<size_t>(full) * sizeof(float)) {  // a vocabulary cut short
    scratch = std::make_unique_for_overwrite<std::byte[]>(static_cast<size_t>(full) * 4);
    dest.data = scratch.get();
  }
  ExecOptions o;
  o.num_threads = 1;
  o.scale_power = ScalePower(state);
  o.allow_scaled_optimizer_state = true;  // the universal files are in F's own coordinates
  o.allow_lossy_scale = options_.allow_lossy_scale;
  o.verify_replicas = options_.verify_replicas;
  RESHARD_RETURN_IF_ERROR(Rebuild(map, DType::kF32, views, dest, o));
  if (scratch) std::memcpy(out.data(), scratch.get(), out.size());
  return Status::Ok();
}

// A frozen parameter's fp32.pt: its module weights, rebuilt in their dtype and widened to fp32
// (exact from bf16 and fp16).
Status UniversalWriter::FillFrozen(size_t i, std::span<std::byte> out) const {
  const ParamMap& map = c_.params()[i].tp_map;
  const DType dtype = c_.ParamDType(i, DeepSpeedState::kModule);
  const size_t size = DTypeSize(dtype);
  std::vector<std::vector<std::byte>> shards(static_cast<size_t>(map.world_size()));
  std::vector<ConstBuffer> views;
  for (Rank r = 0; r < map.world_size(); ++r) {
    const Index n = map.shard_num_elements(r);
    auto& bytes = shards[static_cast<size_t>(r)];
    bytes.resize(static_cast<size_t>(n) * size);
    RESHARD_RETURN_IF_ERROR(c_.ReadTpShard(i, DeepSpeedState::kModule, r, {bytes.data(), n}));
    views.push_back({bytes.data(), n});
  }
  const Index full = ProductOf(map.logical_shape());
  std::vector<std::byte> whole(static_cast<size_t>(full) * size);
  ExecOptions o;
  o.num_threads = 1;
  o.verify_replicas = options_.verify_replicas;
  RESHARD_RETURN_IF_ERROR(Rebuild(map, dtype, views, {whole.data(), full}, o));
  const Index kept = static_cast<Index>(out.size() / sizeof(float));  // a vocabulary cut short
  for (Index k = 0; k < kept; ++k) {
    const auto v = static_cast<float>(ElementToDouble(dtype, whole.data() + k * size));
    std::memcpy(out.data() + k * sizeof(float), &v, sizeof v);
  }
  return Status::Ok();
}

// What ds_to_universal writes under "sub_param_shape": its SubparamShape dataclass made from
// the universal_checkpoint_info entry, fields in declaration order; before version 0.4 a
// count of equal sub-parameters at partition_dim becomes their sizes, and the shape a tuple.
Result<PickleNodeId> SubParamShapeRecord(TorchTreeBuilder& b, const DeepSpeedSubParamShape& s) {
  const PickleTree& t = s.file->tree();
  auto field = [&](std::string_view key) {
    for (const auto& [k, v] : t.node(s.entry).entries) {
      if (t.node(k).kind == PickleKind::kStr && t.node(k).text == key) return v;
    }
    return kNoPickleNode;
  };
  const PickleNodeId patterns = field("patterns"), shape = field("shape"),
                     dim = field("partition_dim");
  if (patterns == kNoPickleNode || shape == kNoPickleNode || dim == kNoPickleNode)
    return InvalidArgumentError("parameter_with_sub_params: an entry lacks a field");
  const PickleNodeId state = b.Dict();
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId p, b.Copy(*s.file, patterns));
  b.Insert(state, b.Str("patterns"), p);
  if (s.legacy_size == 0) {
    RESHARD_ASSIGN_OR_RETURN(const PickleNodeId copied, b.Copy(*s.file, shape));
    b.Insert(state, b.Str("shape"), copied);
  } else {
    const auto& dims = t.node(shape).items;
    const size_t at = static_cast<size_t>(t.node(dim).int_value);
    std::vector<PickleNodeId> items;
    for (size_t d = 0; d < dims.size(); ++d) {
      if (d != at) {
        RESHARD_ASSIGN_OR_RETURN(const PickleNodeId item, b.Copy(*s.file, dims[d]));
        items.push_back(item);
        continue;
      }
      std::vector<PickleNodeId> sizes(static_cast<size_t>(t.node(dims[d]).int_value));
      for (PickleNodeId& size : sizes) size = b.Int(s.legacy_size);
      items.push_back(b.Tuple(std::move(sizes)));
    }
    b.Insert(state, b.Str("shape"), b.Tuple(std::move(items)));
  }
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId d, b.Copy(*s.file, dim));
  b.Insert(state, b.Str("partition_dim"), d);
  return b.Object("deepspeed.checkpoint.universal_checkpoint.SubparamShape", state);
}

// {"cat_dim": d, "param_n_sub_params": 2, "vocab_tensor": True, "param": tensor}, the keys in
// ds_to_universal's order and only those it writes; a bare tensor in the flat form. The fp32
// tensor is saved with requires_grad, as DeepSpeed's is.
Status UniversalWriter::WriteState(size_t i, DeepSpeedState state, const std::string& path) const {
  const DeepSpeedParam& p = c_.params()[i];
  TorchTreeBuilder b;
  const PickleNodeId tensor = b.Tensor(
      DType::kF32, UniversalShape(c_, p),
      [this, i, state](std::span<std::byte> out) { return FillState(i, state, out); },
      state == DeepSpeedState::kMaster);
  PickleNodeId root = tensor;
  if (!FlatForm(c_)) {
    const DeepSpeedUniversalKeys& k = p.universal;
    root = b.Dict();
    if (k.cat_dim) b.Insert(root, b.Str("cat_dim"), b.Int(*k.cat_dim));
    if (k.n_sub_params) b.Insert(root, b.Str("param_n_sub_params"), b.Int(*k.n_sub_params));
    if (k.sub_param_shape) {
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId s, SubParamShapeRecord(b, *k.sub_param_shape));
      b.Insert(root, b.Str("sub_param_shape"), s);
    }
    if (k.vocab_tensor) b.Insert(root, b.Str("vocab_tensor"), b.Bool(true));
    b.Insert(root, b.Str("param"), tensor);
  }
  return b.Write(path, root, WriteOptionsFor(path, options_));
}

Status UniversalWriter::WriteStep(size_t i, const std::string& path) const {
  const DeepSpeedStep& step = c_.params()[i].steps.front();
  TorchTreeBuilder b;
  RESHARD_ASSIGN_OR_RETURN(PickleNodeId root, b.Copy(*step.file, step.node));
  return b.Write(path, root, WriteOptionsFor(path, options_));
}

// The value under str key `key` of dict node `id`, or kNoPickleNode.
PickleNodeId DictGet(const PickleTree& t, PickleNodeId id, std::string_view key) {
  if (id == kNoPickleNode || t.node(id).kind != PickleKind::kDict) return kNoPickleNode;
  for (const auto& [k, v] : t.node(id).entries) {
    if (t.node(k).kind == PickleKind::kStr && t.node(k).text == key) return v;
  }
  return kNoPickleNode;
}

// zero/optimizer_state.pt. ZeRO 1/2: TP 0, DP 0's optimizer_state_dict without its
// partitioned entries (base_optimizer_state, param_slice_mappings,
// single_partition_of_fp32_groups), group_paddings zeroed and partition_count set to DP for
// every group, then base_optimizer_state's param_groups. ZeRO 3: the whole
// optimizer_state_dict, then its inner optimizer_state_dict's param_groups (the same object).
// ZeRO 0: ds_version and the torch optimizer's param_groups.
Status UniversalWriter::WriteOptimizerState(const std::string& path) const {
  const TorchFile& f = *c_.optimizer_file();
  const PickleTree& t = f.tree();
  TorchTreeBuilder b;
  auto missing = [&](std::string_view what) {
    return InvalidArgumentError(
        fmt::format("the optimizer state of \"{}\": {} is missing", c_.tag_dir(), what));
  };
  if (c_.stage() == 0) {
    PickleNodeId opt = DictGet(t, t.root(), "optimizer");
    if (PickleNodeId inner = DictGet(t, opt, "optimizer_state_dict"); inner != kNoPickleNode)
      opt = inner;
    const PickleNodeId groups = DictGet(t, opt, "param_groups");
    const PickleNodeId version = DictGet(t, t.root(), "ds_version");
    if (groups == kNoPickleNode) return missing("optimizer.param_groups");
    const PickleNodeId root = b.Dict();
    if (version != kNoPickleNode) {
      RESHARD_ASSIGN_OR_RETURN(PickleNodeId v, b.Copy(f, version));
      b.Insert(root, b.Str("ds_version"), v);
    }
    RESHARD_ASSIGN_OR_RETURN(PickleNodeId g, b.Copy(f, groups));
    b.Insert(root, b.Str("param_groups"), g);
    return b.Write(path, root, WriteOptionsFor(path, options_));
  }
  const PickleNodeId sd = DictGet(t, t.root(), "optimizer_state_dict");
  if (sd == kNoPickleNode) return missing("optimizer_state_dict");
  if (c_.stage() == 3) {
    const PickleNodeId groups = DictGet(t, DictGet(t, sd, "optimizer_state_dict"), "param_groups");
    if (groups == kNoPickleNode) return missing("optimizer_state_dict.optimizer_state_dict");
    RESHARD_ASSIGN_OR_RETURN(PickleNodeId root, b.Copy(f, sd));
    RESHARD_ASSIGN_OR_RETURN(PickleNodeId g, b.Copy(f, groups));
    b.Insert(root, b.Str("param_groups"), g);
    return b.Write(path, root, WriteOptionsFor(path, options_));
  }
  const PickleNodeId groups = DictGet(t, DictGet(t, sd, "base_optimizer_state"), "param_groups");
  if (groups == kNoPickleNode) return missing("optimizer_state_dict.base_optimizer_state");
  const PickleNodeId root = b.Dict();
  for (const auto& [k, v] : t.node(sd).entries) {
    const std::string& key = t.node(k).text;
    if (key == "base_optimizer_state" || key == "param_slice_mappings" ||
        key == "single_partition_of_fp32_groups") {
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(PickleNodeId key_copy, b.Copy(f, k));
    const PickleNode& value = t.node(v);
    if ((key == "group_paddings" || key == "partition_count") && value.kind == PickleKind::kList &&
        !value.items.empty()) {
      std::vector<PickleNodeId> items;
      for (size_t g = 0; g < value.items.size(); ++g)
        items.push_back(b.Int(key == "group_paddings" ? 0 : c_.dp()));
      b.Insert(root, key_copy, b.List(std::move(items)));
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(PickleNodeId value_copy, b.Copy(f, v));
    b.Insert(root, key_copy, value_copy);
  }
  RESHARD_ASSIGN_OR_RETURN(PickleNodeId g, b.Copy(f, groups));
  b.Insert(root, b.Str("param_groups"), g);
  return b.Write(path, root, WriteOptionsFor(path, options_));
}

Status UniversalWriter::Write(const UniversalJob& job, const std::string& path) const {
  switch (job.kind) {
    case UniversalJob::kState:
      return WriteState(job.param, job.state, path);
    case UniversalJob::kStep:
      return WriteStep(job.param, path);
    case UniversalJob::kOptimizer:
      return WriteOptimizerState(path);
    case UniversalJob::kAutoEp:
      return job.write(path, WriteOptionsFor(path, options_));
    case UniversalJob::kCopy: {
      std::error_code ec;
      fs::copy_file(job.source, path, ec);
      if (ec) return ErrnoStatus(ec.value(), "copying \"" + job.source + "\" to", path);
      if (options_.sync) StartWriteback(path);
      return Status::Ok();
    }
  }
  return InternalError("unknown job");
}

// The files to write, largest first (so the pool ends evenly), and the folders they need.
Result<std::vector<UniversalJob>> PlanUniversal(
    const std::shared_ptr<const DeepSpeedCheckpoint>& ckpt, const std::string& folder,
    const CheckpointOptions& options) {
  const DeepSpeedCheckpoint& c = *ckpt;
  std::vector<UniversalJob> jobs;
  const std::string zero = folder + "/zero";
  // The tensors the caller asks to leave out: buffers, which the folder has no place for.
  std::set<std::string> dropped(options.drop.begin(), options.drop.end());
  for (size_t i = 0; i < c.params().size(); ++i) {
    const DeepSpeedParam& p = c.params()[i];
    if (p.name.empty() || p.name == "." || p.name == ".." ||
        p.name.find('/') != std::string::npos || p.name.find('\0') != std::string::npos) {
      return InvalidArgumentError(
          fmt::format("parameter \"{}\" cannot name a folder of the universal checkpoint", p.name));
    }
    if (p.kind != DeepSpeedParamKind::kBuffer && dropped.contains(p.name)) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": \"{}\", asked to be dropped, is a {} parameter, which the universal "
          "checkpoint holds (DeepSpeed's loader would miss its folder); only a buffer, which it "
          "has no place for, is dropped",
          c.tag_dir(), p.name, DeepSpeedParamKindName(p.kind)));
    }
    if (p.kind == DeepSpeedParamKind::kBuffer) {
      if (dropped.erase(p.name) == 1) continue;
      return FailedPreconditionError(fmt::format(
          "\"{}\": \"{}\" is a module buffer (buffer_names lists it): a universal checkpoint "
          "holds the optimizer's parameters only; dropping \"{}\" by name leaves it out",
          c.tag_dir(), p.name, p.name));
    }
    const uint64_t bytes = static_cast<uint64_t>(ProductOf(UniversalShape(c, p))) * 4;
    for (DeepSpeedState s : kUniversalStates) {
      // A frozen parameter, which no param group holds: fp32.pt alone (DeepSpeed's loader
      // visits its optimizer's parameters' folders only).
      if (s != DeepSpeedState::kMaster && !c.Holds(i, s)) continue;
      jobs.push_back({UniversalJob::kState, i, s, "",
                      fmt::format("{}/{}/{}.pt", zero, p.name, DeepSpeedStateName(s)), bytes});
    }
    if (p.kind == DeepSpeedParamKind::kTrained && c.stage() != 3 &&
        p.steps.front().file != nullptr && p.steps.front().node != kNoPickleNode) {
      jobs.push_back({UniversalJob::kStep, i, DeepSpeedState::kMaster, "",
                      fmt::format("{}/{}/step.pt", zero, p.name), 4});
    }
  }
  if (!dropped.empty()) {
    return InvalidArgumentError(
        fmt::format("\"{}\", asked to be dropped: \"{}\" holds no buffer or parameter of that name",
                    *dropped.begin(), c.tag_dir()));
  }
  jobs.push_back(
      {UniversalJob::kOptimizer, 0, DeepSpeedState::kMaster, "", zero + "/optimizer_state.pt", 0});
  if (c.experts() != nullptr) {  // the experts' files, and the model states rewritten
    for (AutoEpUniversalFile& f : AutoEpUniversalFiles(ckpt, folder, options)) {
      UniversalJob job{UniversalJob::kAutoEp, 0, DeepSpeedState::kMaster, "", f.name, f.bytes};
      job.write = std::move(f.write);
      jobs.push_back(std::move(job));
    }
  }
  for (const std::string& path : c.model_states_paths()) {
    if (c.experts() != nullptr) break;
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    jobs.push_back({UniversalJob::kCopy, 0, DeepSpeedState::kMaster, path,
                    fmt::format("{}/{}", folder, fs::path(path).filename().string()),
                    ec ? 0 : size});
  }
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const UniversalJob& a, const UniversalJob& b) { return a.bytes > b.bytes; });
  return jobs;
}

}  // namespace

Status ConvertDeepSpeedToUniversal(const std::string& ckpt_dir, const std::string& out_dir,
                                   const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<DeepSpeedCheckpoint> opened = DeepSpeedCheckpoint::Open(ckpt_dir);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  const auto shared = std::make_shared<const DeepSpeedCheckpoint>(*std::move(opened));
  const DeepSpeedCheckpoint& c = *shared;
  // Every process reads the same files, so these checks and the plan agree without a word.
  if (!c.has_optimizer_state() || c.optimizer_file() == nullptr) {
    return FailedPreconditionError(fmt::format(
        "\"{}\" holds no optimizer state, which a universal checkpoint is made of", c.tag_dir()));
  }
  const std::string folder = fs::path(c.tag_dir()).filename().string() + "_universal";
  RESHARD_ASSIGN_OR_RETURN(std::vector<UniversalJob> jobs, PlanUniversal(shared, folder, options));
  std::vector<std::string> inputs = {c.tag_dir()};
  for (const std::string& p : c.file_paths()) inputs.push_back(p);
  const UniversalWriter writer(c, options);
  std::vector<UniversalFile> files;
  files.reserve(jobs.size());
  for (const UniversalJob& job : jobs) {
    files.push_back(
        {job.name, job.bytes, [&writer, &job](const std::string& path, const TorchWriteOptions&) {
           return writer.Write(job, path);  // its own options (UniversalWriter)
         }});
  }
  return WriteUniversalFiles(comm, out_dir, options, inputs, folder, files);
}

}  // namespace reshard
