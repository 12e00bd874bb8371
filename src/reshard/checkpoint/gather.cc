// gather: a sharded checkpoint (any ShardSource) rebuilt into a full one, optionally with its
// block-quantized tensors dequantized.
#include "reshard/checkpoint/gather.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/ir/block_grid.h"
#include "reshard/layouts/basic.h"

namespace reshard {

using internal::CopyValidRegion;
using internal::Counters;
using internal::ElementBytes;
using internal::ExecOptionsFor;
using internal::GatherOutput;
using internal::OutputFile;
using internal::OwnersOf;
using internal::Rebuilt;
using internal::ReplicaBytes;
using internal::SplitIntoParts;
using internal::WarnAboutScales;
using internal::WriteOwnFiles;

namespace {

// The files of a full output: `single` (model.safetensors), or parts of at most max_bytes.
std::vector<OutputFile> FullFiles(const Manifest& m, uint64_t max_bytes,
                                  const std::string& single) {
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (const ShardedParam& p : m.params) {
    sizes.push_back(ElementBytes(ProductOf(p.map.valid_shape()), p.dtype));
    total += sizes.back();
  }
  const bool split = max_bytes > 0 && total > max_bytes;
  const auto parts = SplitIntoParts(sizes, split ? max_bytes : 0);
  std::vector<OutputFile> files;
  for (size_t part = 0; part < parts.size(); ++part) {
    OutputFile f{
        !split ? single : fmt::format("model-{:05d}-of-{:05d}.safetensors", part + 1, parts.size()),
        0,
        parts[part],
        0,
        {}};
    for (size_t i : f.params) f.bytes += sizes[i];
    files.push_back(std::move(f));
  }
  return files;
}

// model.safetensors.index.json of a full output in parts.
Status WriteFullIndex(const OutputDirectory& out, const Manifest& m, bool sync,
                      const std::vector<OutputFile>& files) {
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total = 0;
  for (const OutputFile& f : files) {
    for (size_t i : f.params) weight_map[m.params[i].name] = f.name;
    total += f.bytes;
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return WriteFileAtomically(out.FilePath("model.safetensors.index.json"), index.dump(2) + "\n",
                             {.sync = sync});
}

// The threads that read one region of a source that ReadsRegions: files are written one after
// the other, so every core.
int RegionThreads(const CheckpointOptions& options) {
  return options.num_threads > 0
             ? options.num_threads
             : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// Rebuilds parameter i of `source` (its valid region) into `buffer`.
Status RebuildInto(ShardSource& source, size_t i, const CheckpointOptions& options,
                   std::span<std::byte> buffer, Counters& counters) {
  const ShardedParam& param = source.manifest().params[i];
  const ParamMap& map = param.map;
  if (source.ReadsRegions()) {  // straight from the stored chunks, one at a time
    counters.read += buffer.size();
    return source.ReadRegion(i, Shape(map.valid_shape().size(), 0), map.valid_shape(), buffer,
                             RegionThreads(options));
  }
  AcquiredShards shards(source, i);
  RESHARD_RETURN_IF_ERROR(shards.status());
  std::vector<std::byte> padded;
  MutableBuffer f{buffer.data(), map.num_elements()};
  if (map.has_padding()) {
    padded.resize(static_cast<size_t>(map.num_elements()) * DTypeSize(param.dtype));
    f.data = padded.data();
  }
  uint64_t held = 0;
  for (Rank r = 0; r < map.world_size(); ++r) held += HeldBytes(param, r);
  counters.read += std::min(held, ElementBytes(map.num_elements(), param.dtype));
  if (options.verify_replicas) counters.verified += ReplicaBytes(param);
  // The writer names the tensor in any error.
  RESHARD_RETURN_IF_ERROR(
      Rebuild(map, param.dtype, shards.shards(), f, ExecOptionsFor(options, param.scale_power)));
  if (map.has_padding()) {
    RESHARD_RETURN_IF_ERROR(
        CopyValidRegion(map, param.dtype, padded.data(), buffer.data(), true, options.num_threads));
  }
  return Status::Ok();
}

// A tensor read by regions is written by bands of rows (TensorToWrite::fill_rows): two bands
// in memory, not the tensor, and the next band read while the last is written.
void AddBandedFill(ShardSource& source, const GatherOutput& o, const CheckpointOptions& options,
                   Counters& counters, ProgressCounter& progress, TensorToWrite& t) {
  const Shape& valid = source.manifest().params[o.param].map.valid_shape();
  if (valid.empty() || valid != o.shape) return;
  t.band_rows = source.RegionRows(o.param, options.band_bytes);
  t.fill_rows = [&source, &counters, &progress, i = o.param, valid,
                 threads = RegionThreads(options)](Index begin, Index end,
                                                   std::span<std::byte> out) -> Status {
    Shape offsets(valid.size(), 0), sizes = valid;
    offsets[0] = begin;
    sizes[0] = end - begin;
    RESHARD_RETURN_IF_ERROR(source.ReadRegion(i, offsets, sizes, out, threads));
    counters.read += out.size();
    progress.Add(out.size());
    return Status::Ok();
  };
}

Result<Rebuilt> RebuildOwned(ShardSource& source, size_t i, const CheckpointOptions& options,
                             Counters& counters) {
  const ShardedParam& p = source.manifest().params[i];
  Rebuilt out;
  out.size = static_cast<size_t>(ElementBytes(ProductOf(p.map.valid_shape()), p.dtype));
  out.bytes.reset(new (std::nothrow) std::byte[std::max<size_t>(out.size, 1)]);
  if (!out.bytes) {
    return ResourceExhaustedError(
        fmt::format("cannot allocate {} bytes for \"{}\"", out.size, p.name));
  }
  RESHARD_RETURN_IF_ERROR(RebuildInto(source, i, options, out.span(), counters));
  return out;
}

// Whether `v` walks `shape` row-major from offset 0 (dimensions of one element aside).
bool IsDenseView(const StridedView& v, const Shape& shape) {
  if (v.offset != 0) return false;
  Index expect = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && v.strides[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

// A rank whose shard is the whole tensor as it is, held by no other rank (one unscaled piece,
// row-major in F and in the shard): its shard can be read in place of a rebuild, with no
// replica to compare.
std::optional<Rank> SoleWholeHolder(const ParamMap& map) {
  if (map.has_padding()) return std::nullopt;
  for (Rank r = 0; r < map.world_size(); ++r) {
    const RankShard& s = map.rank(r);
    if (s.is_buffered() || s.pieces.size() != 1) continue;
    const Piece& p = s.pieces[0];
    if (p.scale != 1.0 || p.is_replicated() || p.num_elements() != map.num_elements() ||
        ProductOf(s.shard_shape) != map.num_elements()) {
      continue;
    }
    if (IsDenseView(p.source, p.shape) && IsDenseView(p.dest, p.shape)) return r;
  }
  return std::nullopt;
}

// A parameter's valid bytes: the shard of its sole whole holder read in place (a Hugging Face
// file's tensor, mapped), else rebuilt into memory of its own.
struct ParamBytes {
  std::unique_ptr<AcquiredShards> held;
  Rebuilt rebuilt;
  std::span<const std::byte> bytes;
};

Result<ParamBytes> ReadParamBytes(ShardSource& source, size_t i, const CheckpointOptions& options,
                                  Counters& counters) {
  const ShardedParam& p = source.manifest().params[i];
  ParamBytes out;
  if (const std::optional<Rank> r = SoleWholeHolder(p.map)) {
    out.held = std::make_unique<AcquiredShards>(source, i);
    RESHARD_RETURN_IF_ERROR(out.held->status());
    const ConstBuffer& shard = out.held->shards()[static_cast<size_t>(*r)];
    out.bytes = {shard.data, static_cast<size_t>(ElementBytes(shard.num_elements, p.dtype))};
    counters.read += out.bytes.size();
    return out;
  }
  RESHARD_ASSIGN_OR_RETURN(out.rebuilt, RebuildOwned(source, i, options, counters));
  out.bytes = out.rebuilt.span();
  return out;
}

// The dequantized output of data parameter `d` scaled by parameter `s` under `tie`.
Result<GatherOutput> DequantizedOutput(const Manifest& m, size_t d, size_t s,
                                       const BlockScales& tie, DType dtype) {
  const ShardedParam& data = m.params[d];
  const ShardedParam& scales = m.params[s];
  GatherOutput o{data.name, dtype, data.map.valid_shape(), d, s, std::nullopt, {}, false};
  o.spec = DequantizeSpec{data.dtype, data.map.valid_shape(), scales.dtype, tie.block, 1.0f};
  RESHARD_RETURN_IF_ERROR(CheckBlockScaleDType(tie.format, scales.name, data.name, scales.dtype));
  const bool packed = tie.format == "mxfp4" || tie.format == "nvfp4";
  if (packed != (data.dtype == DType::kU8)) {
    return FailedPreconditionError(fmt::format("\"{}\" is {}, which {} does not store", data.name,
                                               DTypeName(data.dtype), tie.format));
  }
  if (packed) o.shape.back() *= 2;
  // compressed-tensors' packed `X.weight_packed` holds the numbers of `X.weight`.
  if (data.name.ends_with(".weight_packed")) o.name = data.name.substr(0, data.name.size() - 7);
  if (tie.format == "mxfp4") {
    // gpt-oss: X_blocks [E, R, G, 16] -> X [E, G * 32, R] (transformers' dequantized experts).
    if (o.shape.size() != 4 || !data.name.ends_with("_blocks")) {
      return FailedPreconditionError(
          fmt::format("MXFP4 blocks \"{}\" {}: expected [experts, rows, groups, 16] named *_blocks",
                      data.name, FormatShape(data.map.valid_shape())));
    }
    o.name = data.name.substr(0, data.name.size() - 7);
    o.shape = {o.shape[0], o.shape[2] * o.shape[3], o.shape[1]};
    o.mxfp4 = true;
  }
  return o;
}

}  // namespace

namespace internal {

Status FillDequantized(ShardSource& source, const GatherOutput& o, const CheckpointOptions& options,
                       std::span<std::byte> buffer, Counters& counters) {
  const Manifest& m = source.manifest();
  RESHARD_ASSIGN_OR_RETURN(ParamBytes data, ReadParamBytes(source, o.param, options, counters));
  RESHARD_ASSIGN_OR_RETURN(ParamBytes scales, ReadParamBytes(source, *o.scales, options, counters));
  DequantizeSpec spec = o.spec;
  if (o.global) {
    const ShardedParam& gp = m.params[*o.global];
    RESHARD_ASSIGN_OR_RETURN(Rebuilt g, RebuildOwned(source, *o.global, options, counters));
    if (gp.dtype != DType::kF32 || g.size != 4) {
      return FailedPreconditionError(fmt::format("\"{}\": expected one F32 value", gp.name));
    }
    std::memcpy(&spec.global_scale, g.bytes.get(), 4);
    if (!std::isfinite(spec.global_scale) || spec.global_scale <= 0) {
      return FailedPreconditionError(
          fmt::format("\"{}\": the per-tensor scale of \"{}\" is {}, not a positive number",
                      gp.name, m.params[o.param].name, spec.global_scale));
    }
    // compressed-tensors divides by its global scale; a 0-d one keeps the factor bfloat16.
    spec.global_divides = gp.name.ends_with(".weight_global_scale");
    spec.factor_to_bf16 = spec.global_divides && gp.map.valid_shape().empty();
  }
  const auto annotate = [&](const Status& st) {
    return st.ok() ? st
                   : Status(st.code(), fmt::format("dequantizing \"{}\" with \"{}\": {}",
                                                   m.params[o.param].name, m.params[*o.scales].name,
                                                   st.message()));
  };
  if (!o.mxfp4) return annotate(Dequantize(spec, data.bytes, scales.bytes, o.dtype, buffer));
  // [E, R, G * 32] dequantized, then its last two dimensions swapped.
  Rebuilt flat;
  flat.size = buffer.size();
  flat.bytes.reset(new (std::nothrow) std::byte[std::max<size_t>(flat.size, 1)]);
  if (!flat.bytes) return ResourceExhaustedError("cannot allocate the dequantized experts");
  RESHARD_RETURN_IF_ERROR(
      annotate(Dequantize(spec, data.bytes, scales.bytes, o.dtype, flat.span())));
  const Shape& out_shape = o.shape;  // [..., cols, rows]
  const size_t nd = out_shape.size();
  const Index rows = out_shape[nd - 1], cols = out_shape[nd - 2];
  const Index outer = ProductOf(std::span(out_shape).first(nd - 2));
  const size_t es = DTypeSize(o.dtype);
  for (Index e = 0; e < outer; ++e) {
    const std::byte* from = flat.bytes.get() + static_cast<size_t>(e * rows * cols) * es;
    std::byte* to = buffer.data() + static_cast<size_t>(e * rows * cols) * es;
    for (Index r = 0; r < rows; ++r) {
      for (Index c = 0; c < cols; ++c) {
        std::memcpy(to + static_cast<size_t>(c * rows + r) * es,
                    from + static_cast<size_t>(r * cols + c) * es, es);
      }
    }
  }
  return Status::Ok();
}

Result<std::vector<GatherOutput>> GatherOutputs(const Manifest& m,
                                                const CheckpointOptions& options) {
  std::vector<GatherOutput> out;
  if (!options.dequantize) {
    for (size_t i = 0; i < m.params.size(); ++i) {
      const ShardedParam& p = m.params[i];
      out.push_back(
          {p.name, p.dtype, p.map.valid_shape(), i, std::nullopt, std::nullopt, {}, false});
    }
    return out;
  }
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < m.params.size(); ++i) index.emplace(m.params[i].name, i);
  std::map<size_t, std::pair<size_t, BlockScales>> scales_of;  // data -> block scale
  std::map<size_t, size_t> global_of;                          // data -> second-level scale
  std::set<size_t> dropped;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ShardedParam& p = m.params[i];
    auto given = options.dequantize->ties.find(p.name);
    auto recorded = m.block_scales.find(p.name);
    const BlockScales* tie = given != options.dequantize->ties.end() ? &given->second
                             : recorded != m.block_scales.end()      ? &recorded->second
                                                                     : nullptr;
    if (tie == nullptr) continue;
    auto d = index.find(tie->data);
    if (d == index.end()) {
      return FailedPreconditionError(fmt::format(
          "\"{}\" scales \"{}\", which the checkpoint does not hold", p.name, tie->data));
    }
    dropped.insert(i);
    if (tie->dequantizes) {
      if (!scales_of.emplace(d->second, std::pair{i, *tie}).second) {
        return FailedPreconditionError(fmt::format("\"{}\" has two block scales", tie->data));
      }
    } else if (p.name.ends_with(".weight_scale_2") || p.name.ends_with(".weight_global_scale")) {
      if (!global_of.emplace(d->second, i).second) {
        return FailedPreconditionError(
            fmt::format("\"{}\" has two per-tensor weight scales", tie->data));
      }
    }
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    if (dropped.contains(i)) continue;
    const ShardedParam& p = m.params[i];
    auto sc = scales_of.find(i);
    if (sc == scales_of.end()) {
      // FP8 numbers mean nothing without their scales: written as they are under a config
      // without quantization_config, they would load as the wrong weights.
      if (p.dtype == DType::kF8E4M3 || p.dtype == DType::kF8E5M2) {
        return FailedPreconditionError(fmt::format(
            "\"{}\" is {} but the checkpoint records no block scale for it (no scale tensor "
            "whose block_scales names it and dequantizes): its numbers are unknown",
            p.name, DTypeName(p.dtype)));
      }
      out.push_back(
          {p.name, p.dtype, p.map.valid_shape(), i, std::nullopt, std::nullopt, {}, false});
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(
        GatherOutput o,
        DequantizedOutput(m, i, sc->second.first, sc->second.second, options.dequantize->dtype));
    if (auto g = global_of.find(i); g != global_of.end()) {
      o.global = g->second;
    } else if (sc->second.second.format == "nvfp4" && p.name.ends_with(".weight")) {
      // ModelOpt's NVFP4 (compressed-tensors' is `weight_packed`): a per-tensor factor too.
      return FailedPreconditionError(fmt::format(
          "\"{}\" is ModelOpt NVFP4, whose values are the FP4 value times its per-16 scale "
          "times \"{}_scale_2\", which the checkpoint does not hold",
          p.name, p.name));
    }
    out.push_back(std::move(o));
  }
  return out;
}

}  // namespace internal

Status Gather(const std::string& sharded_dir, const std::string& out_dir,
              const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<ShardedCheckpoint> opened = ShardedCheckpoint::Open(sharded_dir);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, opened.status()));
  const std::unique_ptr<ShardSource> source = SourceOfShardedDir(
      sharded_dir, std::make_shared<const ShardedCheckpoint>(*std::move(opened)));
  return GatherFrom(*source, out_dir, all_options);
}

Status GatherFrom(ShardSource& source, const std::string& out_dir,
                  const CheckpointOptions& all_options, const std::vector<ExtraFile>& extra_files) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  const Manifest& m = source.manifest();
  for (const ShardedParam& p : m.params) WarnAboutScales(options, p, "undoing");
  Result<std::vector<GatherOutput>> outputs_or = internal::GatherOutputs(m, options);
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, outputs_or.status()));
  const std::vector<GatherOutput>& outputs = *outputs_or;
  // What is written, as a manifest of full tensors (for the file plan and the index).
  Manifest written_m;
  for (const GatherOutput& o : outputs) {
    RESHARD_ASSIGN_OR_RETURN(ParamMap full, ReplicatedMap(o.shape, 1));
    written_m.params.push_back({o.name, o.dtype, std::move(full), std::nullopt, 1});
  }
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out,
                           OpenOutput(comm, out_dir, options, source.inputs()));
  // A PEFT adapter (its adapter_config.json among the extra files) is one file of its own name,
  // as PEFT reads it.
  const bool adapter = std::any_of(extra_files.begin(), extra_files.end(),
                                   [](const ExtraFile& f) { return f.name == kAdapterConfigName; });
  const std::string single = adapter ? kAdapterWeightsName : "model.safetensors";
  const std::vector<OutputFile> files =
      FullFiles(written_m, adapter ? 0 : options.max_shard_bytes, single);
  const std::vector<int> owners = OwnersOf(files, comm.size());
  uint64_t total = 0;
  for (const OutputFile& f : files) total += f.bytes;
  ProgressCounter progress(options, total);
  Counters counters;
  ProcessStats mine;
  // Files are written one after the other; each tensor is rebuilt on every core.
  const Status written =
      WriteOwnFiles(comm, files, owners, 1, mine, [&](const OutputFile& f) -> Status {
        std::vector<TensorToWrite> tensors;
        for (const size_t k : f.params) {
          const GatherOutput& o = outputs[k];
          tensors.push_back(
              {o.name, o.dtype, o.shape, [&](std::span<std::byte> buffer) {
                 RESHARD_RETURN_IF_ERROR(
                     o.scales ? internal::FillDequantized(source, o, options, buffer, counters)
                              : RebuildInto(source, o.param, options, buffer, counters));
                 progress.Add(buffer.size());
                 return Status::Ok();
               }});
          if (!o.scales && source.ReadsRegions()) {
            AddBandedFill(source, o, options, counters, progress, tensors.back());
          }
        }
        return WriteSafetensors(out.FilePath(f.name), std::move(tensors), ProducerMetadata(),
                                OutputFileOptions(options));
      });
  const Status synced = SyncOutputFiles(out, written, mine.files, options);
  mine.bytes_read = counters.read;
  mine.bytes_verified = counters.verified;
  return FinishOutput(comm, out, synced, std::move(mine), options, [&]() -> Status {
    if (files.front().name != single) {
      RESHARD_RETURN_IF_ERROR(WriteFullIndex(out, written_m, options.sync, files));
    }
    for (const ExtraFile& f : extra_files) {
      RESHARD_RETURN_IF_ERROR(
          WriteFileAtomically(out.FilePath(f.name), f.contents, {.sync = options.sync}));
    }
    return out.Commit(options.sync);
  });
}

}  // namespace reshard
