#include "reshard/hf/quantized_maps.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <optional>
#include <set>
#include <utility>

#include "reshard/base/status.h"
#include "reshard/ir/block_grid.h"

namespace reshard {

namespace {

// The degrees up to 64 at which the plan takes the model and the data tensor's own map keeps
// its blocks whole (for the message of a refusal).
std::vector<int> DegreesKeepingBlocks(const ConfigMaps& maps, const std::string& plan_name,
                                      const StoredTensor& data, const QuantTie& tie,
                                      const Shape& scale_shape) {
  std::vector<int> out;
  for (int d = 1; d <= 64; ++d) {
    Result<ConfigMaps> at = ConfigMaps::FromPlan(maps.plan(), d);
    if (!at.ok()) continue;
    Result<TensorMap> m = at->Map(plan_name, data.shape);
    if (m.ok() && BlockImage(m->map, tie.block, scale_shape).ok()) out.push_back(d);
  }
  return out;
}

// The scale tensor's suffix after its data tensor's name ("_scale_inv" for "X.weight" and
// "X.weight_scale_inv"), which names a scale buffer after its data buffer.
std::string ScaleSuffix(const QuantTie& tie) {
  if (tie.scale.starts_with(tie.data)) return tie.scale.substr(tie.data.size());
  return "_scale";
}

struct ScaleBuffer {
  DType dtype;
  std::vector<Shape> shapes;  // per rank
  Index written = 0;          // scale elements the maps write into it, all ranks
  std::vector<std::string> writers;
};

// The map of packed data (two FP4 values a byte, `bytes` its stored shape) from the map of the
// values it holds: each byte is a block of two values along the last dimension, so a split
// between the two values of a byte is refused.
Result<ParamMap> PackedMap(const ParamMap& values, const Shape& bytes) {
  for (Rank r = 0; r < values.world_size(); ++r) {
    if (values.rank(r).is_buffered()) {
      return UnimplementedError("packed FP4 data held in a buffer");
    }
  }
  Shape block(bytes.size(), 1);
  block.back() = 2;
  Result<ParamMap> m = BlockImage(values, block, bytes);
  if (!m.ok()) {
    return Status(m.status().code(),
                  fmt::format("its bytes hold two FP4 values each, and the split would cut "
                              "one: {}",
                              m.status().message()));
  }
  return m;
}

}  // namespace

Result<ModelCheckpointMaps> PlanModelCheckpointMaps(const ConfigMaps& maps,
                                                    std::string_view config_json,
                                                    const std::vector<StoredTensor>& tensors) {
  RESHARD_ASSIGN_OR_RETURN(const std::optional<QuantScheme> scheme, ReadQuantScheme(config_json));
  if (!scheme) {
    RESHARD_ASSIGN_OR_RETURN(CheckpointMaps planned, PlanCheckpointMaps(maps, tensors));
    return ModelCheckpointMaps{std::move(planned), {}};
  }
  std::vector<QuantTensor> quant;
  for (const StoredTensor& t : tensors) quant.push_back({t.name, t.dtype, t.shape});
  RESHARD_ASSIGN_OR_RETURN(std::vector<QuantTie> ties, TieQuantizedTensors(*scheme, quant));
  std::map<std::string, size_t> tie_of_scale;
  std::map<std::string, std::string> plan_name;  // data name -> the name the plan knows
  std::set<std::string> packed;                  // FP4 data, two values a byte
  for (size_t k = 0; k < ties.size(); ++k) {
    tie_of_scale.emplace(ties[k].scale, k);
    plan_name.emplace(ties[k].data, PlanNameOfData(ties[k]));
    if (ties[k].format == QuantFormat::kNvfp4) packed.insert(ties[k].data);
  }
  // Everything but the scales, data under its plan name.
  std::vector<StoredTensor> rest;
  std::map<std::string, std::string> stored_name;  // plan name -> stored name
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < tensors.size(); ++i) {
    index.emplace(tensors[i].name, i);
    if (tie_of_scale.contains(tensors[i].name)) continue;
    StoredTensor t = tensors[i];
    // Packed FP4 is laid out as the values it holds; its bytes follow (PackedMap).
    if (packed.contains(t.name) && !t.shape.empty()) t.shape.back() *= 2;
    if (auto it = plan_name.find(t.name); it != plan_name.end() && it->second != t.name) {
      if (index.contains(it->second)) {
        return FailedPreconditionError(fmt::format("\"{}\" and \"{}\" are both the model's \"{}\"",
                                                   t.name, it->second, it->second));
      }
      stored_name.emplace(it->second, t.name);
      t.name = it->second;
    }
    rest.push_back(std::move(t));
  }
  RESHARD_ASSIGN_OR_RETURN(CheckpointMaps planned, PlanCheckpointMaps(maps, rest));
  std::map<std::string, size_t> planned_of;  // stored name -> index into planned.tensors
  for (size_t i = 0; i < planned.tensors.size(); ++i) {
    CheckpointTensorMap& t = planned.tensors[i];
    if (auto it = stored_name.find(t.name); it != stored_name.end()) t.name = it->second;
    planned_of.emplace(t.name, i);
    if (packed.contains(t.name)) {
      Result<ParamMap> bytes = PackedMap(t.map, tensors[index.at(t.name)].shape);
      if (!bytes.ok()) return bytes.status().Annotate(fmt::format("\"{}\"", t.name));
      t.map = *std::move(bytes);
      t.layout.reset();  // its descriptor counts values, not bytes
    }
  }
  // Each scale: the block image of its data's map.
  std::map<std::string, CheckpointTensorMap> scale_maps;
  std::map<std::string, ScaleBuffer> scale_buffers;
  for (const QuantTie& tie : ties) {
    const StoredTensor& scale = tensors[index.at(tie.scale)];
    const ParamMap& data = planned.tensors[planned_of.at(tie.data)].map;
    BlockImageOptions options;
    const std::string suffix = ScaleSuffix(tie);
    options.scale_buffer = [&](Rank r, const std::string& data_buffer) {
      std::string name = data_buffer + suffix;
      ScaleBuffer& b =
          scale_buffers.try_emplace(name, ScaleBuffer{scale.dtype, {}, 0, {}}).first->second;
      if (b.shapes.size() <= static_cast<size_t>(r)) b.shapes.resize(static_cast<size_t>(r) + 1);
      b.shapes[static_cast<size_t>(r)] = *BlockGridShape(data.rank(r).shard_shape, tie.block);
      return name;
    };
    Result<ParamMap> image = BlockImage(data, tie.block, scale.shape, options);
    if (!image.ok()) {
      const StoredTensor& d = tensors[index.at(tie.data)];
      const std::vector<int> work =
          DegreesKeepingBlocks(maps, plan_name.at(tie.data), d, tie, scale.shape);
      return Status(
          image.status().code(),
          fmt::format("\"{}\" ({} {}, blocks of {}) at {} processes: {}; its scales \"{}\" "
                      "cannot follow. Degrees up to 64 that keep its blocks whole: {}",
                      tie.data, DTypeName(d.dtype), FormatShape(d.shape), FormatShape(tie.block),
                      maps.tp(), image.status().message(), tie.scale,
                      work.empty() ? "none" : fmt::format("{}", fmt::join(work, ", "))));
    }
    for (Rank r = 0; r < image->world_size(); ++r) {
      if (!image->rank(r).is_buffered()) continue;
      ScaleBuffer& b = scale_buffers.at(image->rank(r).buffer);
      for (const Piece& p : image->rank(r).pieces) b.written += p.num_elements();
      if (r == 0) b.writers.push_back(tie.scale);
    }
    scale_maps.emplace(tie.scale, CheckpointTensorMap{tie.scale, *std::move(image), std::nullopt});
  }
  // A scale buffer's local blocks straddling two tensors (gate and up rows in one block) are
  // written twice: no byte movement is exact there.
  for (const auto& [name, b] : scale_buffers) {
    Index size = 0;
    for (const Shape& s : b.shapes) size += ProductOf(s);
    if (b.written > size) {
      return FailedPreconditionError(fmt::format(
          "\"{}\": at {} processes some of its blocks would hold elements of two of {}, which "
          "have scales of their own: not exact without requantizing",
          name, maps.tp(), fmt::join(b.writers, ", ")));
    }
    BufferDecl decl{name, b.dtype, {}};
    for (const Shape& s : b.shapes) decl.ranks.push_back({s, {}});
    planned.buffers.add(std::move(decl));
  }
  // In the checkpoint's order.
  ModelCheckpointMaps out;
  out.maps.buffers = std::move(planned.buffers);
  for (const StoredTensor& t : tensors) {
    if (auto it = scale_maps.find(t.name); it != scale_maps.end()) {
      out.maps.tensors.push_back(std::move(it->second));
    } else {
      out.maps.tensors.push_back(std::move(planned.tensors[planned_of.at(t.name)]));
    }
  }
  out.ties = std::move(ties);
  return out;
}

}  // namespace reshard
