// reshard._core: the C++ library's maps and executor, exposed on raw buffers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/exec/executor.h"
#include "reshard/io/safetensors.h"
#include "reshard/ir/canonicalize.h"
#include "reshard/ir/compose.h"
#include "reshard/ir/infer.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/plan_json.h"

namespace py = pybind11;

namespace reshard {
namespace {

// Raised for a map that does not parse or does not validate; ValueError for bad arguments.
PyObject* g_map_error = nullptr;

[[noreturn]] void Raise(const Status& status) {
  const std::string text = std::string(StatusCodeName(status.code())) + ": " + status.message();
  if (status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kOutOfRange) {
    PyErr_SetString(g_map_error, text.c_str());
    throw py::error_already_set();
  }
  throw py::value_error(text);
}

ParamMap LoadMap(const std::string& json) {
  Result<ParamMapBuilder> builder = ParseParamMapJson(json);
  if (!builder.ok()) Raise(builder.status());
  Result<ParamMap> map = builder->Finalize();
  if (!map.ok()) Raise(map.status());
  return *std::move(map);
}

DType LoadDType(const std::string& name) {
  std::optional<DType> dtype = DTypeFromName(name);
  if (!dtype) throw py::value_error("unknown dtype \"" + name + "\"");
  return *dtype;
}

// A read-only view of a C-contiguous buffer, in elements of `dtype`.
ConstBuffer ViewOf(const py::buffer_info& info, DType dtype, const char* what) {
  const size_t bytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
  if (bytes % DTypeSize(dtype) != 0) {
    throw py::value_error(std::string(what) + " is not a whole number of elements");
  }
  return {static_cast<const std::byte*>(info.ptr), static_cast<Index>(bytes / DTypeSize(dtype))};
}

py::bytes PyExtract(const std::string& map_json, py::buffer full, const std::string& dtype_name,
                    Rank rank, int scale_power, bool allow_scaled_optimizer_state,
                    bool allow_lossy_scale) {
  const ParamMap map = LoadMap(map_json);
  const DType dtype = LoadDType(dtype_name);
  if (rank < 0 || rank >= map.world_size()) throw py::value_error("rank outside the map's world");
  py::buffer_info info = full.request();
  const ConstBuffer in = ViewOf(info, dtype, "full");
  std::string out(static_cast<size_t>(map.shard_num_elements(rank)) * DTypeSize(dtype), '\0');
  ExecOptions options;
  options.scale_power = scale_power;
  options.allow_scaled_optimizer_state = allow_scaled_optimizer_state;
  options.allow_lossy_scale = allow_lossy_scale;
  Status s;
  {
    py::gil_scoped_release release;
    s = reshard::Extract(map, dtype, rank, in,
                         {reinterpret_cast<std::byte*>(out.data()), map.shard_num_elements(rank)},
                         options);
  }
  if (!s.ok()) Raise(s);
  return py::bytes(out);
}

py::bytes PyRebuild(const std::string& map_json, const std::vector<py::buffer>& shards,
                    const std::string& dtype_name, int scale_power, bool verify_replicas,
                    bool allow_scaled_optimizer_state, bool allow_lossy_scale) {
  const ParamMap map = LoadMap(map_json);
  const DType dtype = LoadDType(dtype_name);
  std::vector<py::buffer_info> infos;
  std::vector<ConstBuffer> views;
  for (const py::buffer& b : shards) infos.push_back(b.request());
  for (const py::buffer_info& info : infos) views.push_back(ViewOf(info, dtype, "shard"));
  std::string out(static_cast<size_t>(map.num_elements()) * DTypeSize(dtype), '\0');
  ExecOptions options;
  options.scale_power = scale_power;
  options.verify_replicas = verify_replicas;
  options.allow_scaled_optimizer_state = allow_scaled_optimizer_state;
  options.allow_lossy_scale = allow_lossy_scale;
  Status s;
  {
    py::gil_scoped_release release;
    s = reshard::Rebuild(map, dtype, views,
                         {reinterpret_cast<std::byte*>(out.data()), map.num_elements()}, options);
  }
  if (!s.ok()) Raise(s);
  return py::bytes(out);
}

std::string InferJson(const std::string& index_maps_json, bool allow_uncovered) {
  Result<IndexMaps> observed = ParseIndexMapsJson(index_maps_json);
  if (!observed.ok()) Raise(observed.status());
  Result<ParamMap> map = Infer(*observed, {.allow_uncovered = allow_uncovered});
  if (!map.ok()) Raise(map.status());
  return ParamMapToJson(*map);
}

std::string CanonicalizeJson(const std::string& map_json) {
  Result<ParamMap> map = Canonicalize(LoadMap(map_json));
  if (!map.ok()) Raise(map.status());
  return ParamMapToJson(*map);
}

std::string ComposeJson(const std::string& target_json, const std::string& source_json) {
  const ParamMap target = LoadMap(target_json);
  const ParamMap source = LoadMap(source_json);
  Result<ParamPlan> plan = Compose(target, source);
  if (!plan.ok()) Raise(plan.status());
  return PlanDocumentToJson({{{"", *plan}}});
}

// Composes the plan and runs it on the source shards: target shards as bytes.
std::vector<py::bytes> Transfer(const std::string& target_json, const std::string& source_json,
                                const std::vector<py::buffer>& shards,
                                const std::string& dtype_name, int scale_power,
                                bool allow_lossy_scale) {
  const ParamMap target = LoadMap(target_json);
  const ParamMap source = LoadMap(source_json);
  const DType dtype = LoadDType(dtype_name);
  Result<ParamPlan> plan = Compose(target, source);
  if (!plan.ok()) Raise(plan.status());
  std::vector<py::buffer_info> infos;
  std::vector<ConstBuffer> views;
  for (const py::buffer& b : shards) infos.push_back(b.request());
  for (const py::buffer_info& info : infos) views.push_back(ViewOf(info, dtype, "shard"));
  std::vector<std::string> outs;
  std::vector<MutableBuffer> targets;
  for (Rank r = 0; r < target.world_size(); ++r) {
    outs.emplace_back(static_cast<size_t>(target.shard_num_elements(r)) * DTypeSize(dtype), '\0');
  }
  for (Rank r = 0; r < target.world_size(); ++r) {
    targets.push_back({reinterpret_cast<std::byte*>(outs[static_cast<size_t>(r)].data()),
                       target.shard_num_elements(r)});
  }
  ExecOptions options;
  options.scale_power = scale_power;
  options.allow_lossy_scale = allow_lossy_scale;
  Status s;
  {
    py::gil_scoped_release release;
    s = ExecutePlan(*plan, dtype, views, targets, options);
  }
  if (!s.ok()) Raise(s);
  std::vector<py::bytes> result;
  for (const std::string& o : outs) result.emplace_back(o);
  return result;
}

// name -> (dtype, shape, bytes), in file order (the dict keeps it).
py::dict ReadSafetensors(const std::string& path) {
  Result<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) Raise(file.status());
  py::dict out;
  for (const TensorInfo& t : file->header().tensors) {
    std::span<const std::byte> data = file->data(t);
    out[py::str(t.name)] =
        py::make_tuple(std::string(DTypeName(t.dtype)), py::tuple(py::cast(t.shape)),
                       py::bytes(reinterpret_cast<const char*>(data.data()), data.size()));
  }
  return out;
}

std::map<std::string, std::string> SafetensorsMetadata(const std::string& path) {
  Result<SafetensorsHeader> header = ReadSafetensorsHeader(path);
  if (!header.ok()) Raise(header.status());
  return header->metadata;
}

// tensors: name -> (dtype, shape, C-contiguous buffer of exactly the tensor's bytes).
void PyWriteSafetensors(const std::string& path, const py::dict& tensors,
                        const std::optional<std::map<std::string, std::string>>& metadata,
                        bool overwrite) {
  std::vector<TensorToWrite> to_write;
  std::vector<py::buffer_info> buffers;
  buffers.reserve(tensors.size());
  for (const auto& [key, value] : tensors) {
    const std::string name = py::cast<std::string>(key);
    const auto [dtype_name, shape, buffer] =
        py::cast<std::tuple<std::string, Shape, py::buffer>>(value);
    const DType dtype = LoadDType(dtype_name);
    py::buffer_info& info = buffers.emplace_back(buffer.request());
    Index stride = info.itemsize;
    for (size_t d = info.shape.size(); d-- > 0;) {
      if (info.shape[d] > 1 && info.strides[d] != stride) {
        throw py::value_error("tensor \"" + name + "\": buffer is not C-contiguous");
      }
      stride *= info.shape[d];
    }
    const size_t bytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
    Result<Index> numel = CheckedProduct(shape);
    if (!numel.ok()) Raise(numel.status().Annotate("tensor \"" + name + "\""));
    if (static_cast<size_t>(*numel) * DTypeSize(dtype) != bytes) {
      throw py::value_error("tensor \"" + name + "\": buffer has " + std::to_string(bytes) +
                            " bytes, shape " + FormatShape(shape) + " of " + dtype_name +
                            " needs " + std::to_string(*numel * DTypeSize(dtype)));
    }
    const void* ptr = info.ptr;
    to_write.push_back(
        {.name = name, .dtype = dtype, .shape = shape, .fill = [ptr](std::span<std::byte> out) {
           if (!out.empty()) std::memcpy(out.data(), ptr, out.size());
           return Status::Ok();
         }});
  }
  Status s;
  {
    py::gil_scoped_release release;
    s = WriteSafetensors(path, std::move(to_write),
                         metadata.value_or(std::map<std::string, std::string>{}), overwrite);
  }
  if (!s.ok()) Raise(s);
}

}  // namespace
}  // namespace reshard

PYBIND11_MODULE(_core, m) {
  using namespace reshard;
  m.doc() = "reshard core: validate param maps and run extract / rebuild on raw buffers.";
  g_map_error = PyErr_NewException("reshard._core.MapError", PyExc_ValueError, nullptr);
  m.attr("MapError") = py::handle(g_map_error);
  m.def(
      "validate", [](const std::string& json) { LoadMap(json); }, py::arg("map_json"),
      "Parse and validate a param map (JSON text); raises MapError naming the violation.");
  m.def(
      "canonical_json", [](const std::string& json) { return ParamMapToJson(LoadMap(json)); },
      py::arg("map_json"), "The map as reshard writes it (deterministic JSON).");
  m.def("infer", &InferJson, py::arg("index_maps_json"), py::arg("allow_uncovered") = false,
        "The canonical param map (JSON) explaining observed index maps (DESIGN 6.3 JSON).");
  m.def("canonicalize", &CanonicalizeJson, py::arg("map_json"),
        "The canonical form of a param map (JSON in, JSON out).");
  m.def("compose", &ComposeJson, py::arg("target_map_json"), py::arg("source_map_json"),
        "The transfer plan (plan document JSON, one parameter named \"\") from source to target.");
  m.def("transfer", &Transfer, py::arg("target_map_json"), py::arg("source_map_json"),
        py::arg("shards"), py::arg("dtype"), py::arg("scale_power") = 1,
        py::arg("allow_lossy_scale") = false,
        "Composes the plan and executes it on the source shards; returns the target shards.");
  m.def("extract", &PyExtract, py::arg("map_json"), py::arg("full"), py::arg("dtype"),
        py::arg("rank"), py::arg("scale_power") = 1,
        py::arg("allow_scaled_optimizer_state") = false, py::arg("allow_lossy_scale") = false,
        "F (a buffer of the map's full element count) -> rank's shard, as bytes.");
  m.def("rebuild", &PyRebuild, py::arg("map_json"), py::arg("shards"), py::arg("dtype"),
        py::arg("scale_power") = 1, py::arg("verify_replicas") = true,
        py::arg("allow_scaled_optimizer_state") = false, py::arg("allow_lossy_scale") = false,
        "Shards (one buffer per rank) -> F, as bytes, checking replicas.");
  m.def("read_safetensors", &ReadSafetensors, py::arg("path"),
        "A safetensors file as {name: (dtype, shape, bytes)} in file order; ValueError naming "
        "the rule for a corrupt file.");
  m.def("safetensors_metadata", &SafetensorsMetadata, py::arg("path"),
        "The __metadata__ string map of a safetensors file (header only).");
  m.def("write_safetensors", &PyWriteSafetensors, py::arg("path"), py::arg("tensors"),
        py::arg("metadata") = py::none(), py::arg("overwrite") = false,
        "Writes {name: (dtype, shape, buffer)} as the safetensors package would, atomically.");
}
