// scatter: a full checkpoint (Hugging Face safetensors) cut into a sharded one by maps, and
// the maps a scatter takes (a map document, layout descriptors, the optimizer states' rule).
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>

#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/collective_output.h"
#include "reshard/checkpoint/sharded_io.h"
#include "reshard/layouts/basic.h"

namespace reshard {

using internal::CopyValidRegion;
using internal::Counters;
using internal::ExecOptionsFor;
using internal::OutputFile;
using internal::OwnersOf;
using internal::PlacedRange;
using internal::ShardedFiles;
using internal::WarnAboutScales;
using internal::WriteSharded;

namespace {

// Whether `strides` lay out `shape` densely in row-major order (dimensions of one element
// aside).
bool IsDenseRowMajor(const Shape& shape, const Shape& strides) {
  Index expected = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

// A range copy costs a system call: pieces smaller than this go through memory, unless the
// shard is one piece.
constexpr uint64_t kMinRangeBytes = uint64_t{64} * 1024;

// Rank r's shard of `map` as ranges of the file `path` holding the full tensor at `offset`:
// when every piece is an unscaled dense block of the tensor, densely placed in the shard.
std::optional<std::vector<PlacedRange>> FullTensorRanges(const ParamMap& map, DType dtype, Rank r,
                                                         const std::string& path, uint64_t offset) {
  if (map.has_padding()) return std::nullopt;
  const std::vector<Piece>& pieces = map.rank(r).pieces;
  const uint64_t element = DTypeSize(dtype);
  std::vector<PlacedRange> out;
  for (const Piece& p : pieces) {
    const uint64_t bytes = static_cast<uint64_t>(p.num_elements()) * element;
    if (p.scale != 1.0 || !IsDenseRowMajor(p.shape, p.source.strides) ||
        !IsDenseRowMajor(p.shape, p.dest.strides) ||
        (bytes < kMinRangeBytes && pieces.size() > 1)) {
      return std::nullopt;
    }
    out.push_back(
        {static_cast<uint64_t>(p.dest.offset) * element,
         FileRange{path, offset + static_cast<uint64_t>(p.source.offset) * element, bytes}});
  }
  return out;
}

}  // namespace

MapProvider MapsFromDocument(const MapDocument& doc) {
  auto by_name = std::make_shared<std::map<std::string, ParamMap>>();
  for (const auto& [name, map] : doc.params) by_name->emplace(name, map);
  return [by_name](const std::string& name, const Shape&) -> Result<ProvidedMap> {
    auto it = by_name->find(name);
    if (it == by_name->end()) return NotFoundError(fmt::format("no map for \"{}\"", name));
    return ProvidedMap{it->second, std::nullopt, true};
  };
}

MapProvider MapsFromLayouts(std::map<std::string, LayoutDescriptor> layouts, int world_size) {
  auto shared = std::make_shared<std::map<std::string, LayoutDescriptor>>(std::move(layouts));
  return [shared, world_size](const std::string& name, const Shape& shape) -> Result<ProvidedMap> {
    auto it = shared->find(name);
    if (it == shared->end()) it = shared->find("*");
    if (it == shared->end()) return NotFoundError(fmt::format("no layout for \"{}\"", name));
    Result<ParamMap> map = BuildMap(it->second, shape, world_size);
    if (!map.ok()) return map.status().Annotate(fmt::format("layout of \"{}\"", name));
    return ProvidedMap{*std::move(map), it->second};
  };
}

namespace {

// A provider's NotFound for tensor `name` as scatter says it; other errors as they are.
Status NoMapError(const Status& st, const std::string& name, const Shape& shape) {
  if (st.code() != StatusCode::kNotFound) return st;
  return FailedPreconditionError(
      fmt::format("tensor \"{}\" (shape {}) has no map; give it one in the maps or layouts (a "
                  "layouts file may set a default with the key \"*\")",
                  name, FormatShape(shape)));
}

}  // namespace

Result<MapDocument> DocumentOfMaps(const MapProvider& maps, const BufferSetBuilder& buffers,
                                   const Manifest& m) {
  MapDocument doc;
  for (const ShardedParam& p : m.params) {
    Result<ProvidedMap> provided = maps(p.name, p.map.valid_shape());
    if (!provided.ok()) return NoMapError(provided.status(), p.name, p.map.valid_shape());
    doc.params.emplace_back(p.name, std::move(provided->map));
  }
  RESHARD_RETURN_IF_ERROR(ValidateBuffers(doc, buffers));
  return doc;
}

Result<ResolvedMap> ResolveMap(const MapProvider& maps, const std::string& name,
                               const Shape& shape) {
  for (auto [suffix, power] :
       {std::pair{".exp_avg_sq", -2}, std::pair{".exp_avg", -1}, std::pair{".fp32", 1}}) {
    const std::string_view s(suffix);
    if (name.size() <= s.size() || !name.ends_with(s)) continue;
    if (Result<ProvidedMap> own = maps(name, shape); own.ok() && own->exact) {
      return ResolvedMap{*std::move(own), power};
    }
    Result<ProvidedMap> base = maps(name.substr(0, name.size() - s.size()), shape);
    if (!base.ok() && base.status().code() == StatusCode::kNotFound) {
      RESHARD_ASSIGN_OR_RETURN(ProvidedMap own, maps(name, shape));
      return ResolvedMap{std::move(own), power};
    }
    if (!base.ok()) return base.status();
    return ResolvedMap{*std::move(base), power, true};
  }
  RESHARD_ASSIGN_OR_RETURN(ProvidedMap own, maps(name, shape));
  return ResolvedMap{std::move(own), 1};
}

namespace {

// An optimizer state that takes its parameter's map over buffers lies in buffers of its own,
// "<buffer><suffix>" (".exp_avg"), each declared as the parameter's buffer is but of the state's
// dtype (added to `buffers` unless declared already): the state never writes its parameter's
// elements.
Result<ParamMap> StateInOwnBuffers(const ParamMap& map, std::string_view name, DType dtype,
                                   BufferSetBuilder& buffers) {
  const std::string suffix(name.substr(name.rfind('.')));
  ParamMapBuilder b(map);
  for (Rank r = 0; r < map.world_size(); ++r) {
    if (!map.rank(r).is_buffered()) continue;
    const std::string& base = map.buffer(r);
    const std::string own = base + suffix;
    b.set_buffer(r, own);
    const auto named = [&](const std::string& n) {
      return [&n](const BufferDecl& d) { return d.name == n; };
    };
    const std::vector<BufferDecl>& declared = buffers.buffers();
    if (std::any_of(declared.begin(), declared.end(), named(own))) continue;
    const auto it = std::find_if(declared.begin(), declared.end(), named(base));
    if (it == declared.end()) continue;  // undeclared: the buffer set's check names it
    BufferDecl decl = *it;
    decl.name = own;
    decl.dtype = dtype;
    buffers.add(std::move(decl));
  }
  return b.Finalize();
}

// The sharded manifest of a scatter and, per parameter, its source tensor.
Result<Manifest> PlanScatter(const FullCheckpoint& full, int world_size, const MapProvider& maps,
                             const BufferSetBuilder& given_buffers,
                             const CheckpointOptions& options,
                             std::vector<const TensorRef*>& sources) {
  BufferSetBuilder buffers = given_buffers;
  Manifest manifest;
  manifest.world_size = world_size;
  manifest.constraints = options.degree_constraints;
  manifest.model_config = options.model_config;
  for (const TensorRef& t : full.tensors()) {
    const std::string& name = t.info->name;
    Result<ResolvedMap> resolved = ResolveMap(maps, name, t.info->shape);
    if (!resolved.ok()) {
      return NoMapError(resolved.status(), name, t.info->shape);
    }
    const ProvidedMap* provided = &resolved->provided;
    const ParamMap& map = provided->map;
    if (map.world_size() != world_size) {
      return FailedPreconditionError(fmt::format("the map of \"{}\" has {} ranks, not {}", name,
                                                 map.world_size(), world_size));
    }
    if (map.valid_shape() != t.info->shape) {
      return FailedPreconditionError(
          fmt::format("the map of \"{}\" is for a tensor of shape {} but the checkpoint stores {}",
                      name, FormatShape(map.valid_shape()), FormatShape(t.info->shape)));
    }
    ParamMap placed = map;
    if (resolved->inherited && map.has_buffers()) {
      Result<ParamMap> own = StateInOwnBuffers(map, name, t.info->dtype, buffers);
      if (!own.ok()) return own.status().Annotate(fmt::format("\"{}\"", name));
      placed = *std::move(own);
    }
    manifest.params.push_back(ShardedParam{name, t.info->dtype, std::move(placed), provided->layout,
                                           resolved->scale_power});
    WarnAboutScales(options, manifest.params.back(), "holding it at");
    sources.push_back(&t);
  }
  RESHARD_RETURN_IF_ERROR(ValidateManifestBuffers(manifest, buffers));
  for (const ShardedParam& p : manifest.params) {
    if (auto tie = options.block_scales.find(p.name); tie != options.block_scales.end())
      manifest.block_scales.insert(*tie);
  }
  RESHARD_RETURN_IF_ERROR(CheckBlockTies(manifest));
  return manifest;
}

}  // namespace

Status Scatter(const std::string& full_dir, int world_size, const MapProvider& maps,
               const std::string& out_dir, const CheckpointOptions& all_options) {
  return Scatter(full_dir, world_size, maps, BufferSetBuilder(), out_dir, all_options);
}

Status Scatter(const std::string& full_dir, int world_size, const MapProvider& maps,
               const BufferSetBuilder& buffers, const std::string& out_dir,
               const CheckpointOptions& all_options) {
  const CheckpointOptions options = ForThisProcess(all_options);
  Communicator& comm = CommunicatorOf(options);
  Result<FullCheckpoint> full = FullCheckpoint::Open(full_dir);
  std::vector<const TensorRef*> sources;
  Result<Manifest> planned =
      full.ok() ? PlanScatter(*full, world_size, maps, buffers, options, sources) : full.status();
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, planned.status()));
  Manifest& manifest = *planned;
  const std::vector<OutputFile> files = ShardedFiles(manifest, options.max_shard_bytes);
  const std::vector<int> owners = OwnersOf(files, comm.size());
  // Files are written in parallel; each copies on its own thread.
  CheckpointOptions per_file = options;
  per_file.num_threads = 1;
  std::vector<std::string> inputs = {full_dir};
  const std::vector<std::string> input_paths = full->file_paths();
  inputs.insert(inputs.end(), input_paths.begin(), input_paths.end());
  Counters counters;
  return WriteSharded(
      out_dir, inputs, manifest, options, files, owners, counters,
      [&](size_t i, Rank r, std::span<std::byte> buffer) -> Status {
        const ShardedParam& param = manifest.params[i];
        const ParamMap& map = param.map;
        const TensorRef* src = sources[i];
        std::vector<std::byte> padded;
        ConstBuffer f{src->data.data(), map.num_elements()};
        if (map.has_padding()) {
          padded.assign(static_cast<size_t>(map.num_elements()) * DTypeSize(param.dtype),
                        std::byte{0});
          RESHARD_RETURN_IF_ERROR(
              CopyValidRegion(map, param.dtype, src->data.data(), padded.data(), false, 1));
          f.data = padded.data();
        }
        counters.read += map.has_padding() ? src->data.size() : HeldBytes(param, r);
        RESHARD_RETURN_IF_ERROR(Extract(map, param.dtype, r, f,
                                        {buffer.data(), map.shard_num_elements(r)},
                                        ExecOptionsFor(per_file, param.scale_power)));
        ReleaseMappedPages(src->data);
        return Status::Ok();
      },
      [&](size_t i, Rank r) {
        const TensorRef* src = sources[i];
        return FullTensorRanges(manifest.params[i].map, manifest.params[i].dtype, r,
                                input_paths[src->file], src->offset);
      });
}
}  // namespace reshard
