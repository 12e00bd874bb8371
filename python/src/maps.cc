// reshard._core: param maps, map documents and transfer plans as Python objects.
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "core.h"
#include "reshard/base/dtype.h"
#include "reshard/hf/quantization.h"
#include "reshard/io/file.h"
#include "reshard/ir/block_grid.h"
#include "reshard/ir/canonicalize.h"
#include "reshard/ir/infer.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_summary.h"
#include "reshard/ir/plan_json.h"

namespace reshard::python {
namespace {

py::tuple ToTuple(const Shape& shape) { return py::tuple(py::cast(shape)); }

MapHandle MapFromJson(const std::string& text, bool validate) {
  Result<ParamMapBuilder> builder = ParseParamMapJson(text);
  if (!builder.ok()) Raise(builder.status(), ErrorKind::kMap);
  MapHandle map(*std::move(builder));
  if (validate) map.Valid();
  return map;
}

Rank CheckRank(const ParamMapBuilder& map, Rank rank) {
  if (rank < 0 || rank >= map.world_size()) {
    throw py::index_error("rank " + std::to_string(rank) + " is outside the map's world of " +
                          std::to_string(map.world_size()) + " ranks");
  }
  return rank;
}

// A map document's text, read from `path` ("" for text given as such) as the CLI reads it.
Result<MapDocument> ParseDocument(const std::string& text, const std::string& path) {
  Result<MapDocument> doc = ReadMapDocumentJson(text);
  if (!doc.ok() && !path.empty()) return doc.status().Annotate("error reading \"" + path + "\"");
  return doc;
}

// {"version": 1, ...} (or a bare map, named "") -> [(name, map)] in file order, every map
// validated.
std::vector<std::pair<std::string, MapHandle>> ReadDocument(const std::string& text,
                                                            const std::string& path) {
  Result<MapDocument> doc = ParseDocument(text, path);
  if (!doc.ok()) Raise(doc.status(), ErrorKind::kMap);
  std::vector<std::pair<std::string, MapHandle>> out;
  for (auto& [name, map] : doc->params) out.emplace_back(name, MapHandle(std::move(map)));
  return out;
}

std::string WriteDocument(std::vector<std::pair<std::string, MapHandle*>>& params,
                          const std::string& buffers_json) {
  MapDocument doc;
  for (auto& [name, map] : params) doc.params.emplace_back(name, map->Valid());
  if (!buffers_json.empty()) {
    Result<BufferSetBuilder> buffers = ParseBufferSetJson(buffers_json);
    if (!buffers.ok()) Raise(buffers.status(), ErrorKind::kMap);
    const Status valid = ValidateBuffers(doc, *buffers);
    if (!valid.ok()) Raise(valid, ErrorKind::kMap);
  }
  return MapDocumentToJson(doc);
}

// A document's buffer declarations as JSON ("{}" when it has none), validated with its maps.
std::string ReadDocumentBuffers(const std::string& text, const std::string& path) {
  Result<MapDocument> doc = ParseDocument(text, path);
  if (!doc.ok()) Raise(doc.status(), ErrorKind::kMap);
  return BufferSetToJson(doc->buffers);
}

py::list Summary(MapHandle& self) {
  const MapSummary summary = Summarize(self.Valid());
  py::list ranks;
  for (const RankSummary& r : summary.ranks) {
    ranks.append(py::make_tuple(r.pieces, r.elements, r.replicated_elements, r.scaled_elements));
  }
  return ranks;
}

void BindMap(py::module_& m) {
  py::class_<MapHandle>(m, "Map")
      .def_static("from_json", &MapFromJson, py::arg("text"), py::arg("validate") = true)
      .def("validate", [](MapHandle& self) { self.Valid(); })
      .def("to_json", [](MapHandle& self) { return ParamMapToJson(self.Valid()); })
      .def("canonical",
           [](MapHandle& self) {
             Result<ParamMap> c = Canonicalize(self.Valid());
             if (!c.ok()) Raise(c.status(), ErrorKind::kMap);
             return MapHandle(*std::move(c));
           })
      .def_property_readonly(
          "logical_shape",
          [](const MapHandle& self) { return ToTuple(self.builder().logical_shape()); })
      .def_property_readonly("valid_shape",
                             [](MapHandle& self) { return ToTuple(self.Valid().valid_shape()); })
      .def_property_readonly("world_size",
                             [](const MapHandle& self) { return self.builder().world_size(); })
      .def("shard_shape",
           [](const MapHandle& self, Rank rank) {
             return ToTuple(self.builder().ranks()[CheckRank(self.builder(), rank)].shard_shape);
           })
      .def("num_pieces",
           [](const MapHandle& self, Rank rank) {
             return self.builder().ranks()[CheckRank(self.builder(), rank)].pieces.size();
           })
      .def("buffer",
           [](const MapHandle& self, Rank rank) {
             return self.builder().ranks()[CheckRank(self.builder(), rank)].buffer;
           })
      .def("summary", &Summary)
      .def("__eq__", [](MapHandle& a, MapHandle& b) { return a.Valid() == b.Valid(); });
}

py::dict MoveToDict(const Move& move) {
  py::dict d;
  d["src_rank"] = move.src_rank;
  d["dst_rank"] = move.dst_rank;
  d["shape"] = ToTuple(move.shape);
  d["src"] = py::make_tuple(move.src.offset, ToTuple(move.src.strides));
  d["dst"] = py::make_tuple(move.dst.offset, ToTuple(move.dst.strides));
  d["factor"] = move.factor;
  return d;
}

void BindPlan(py::module_& m) {
  py::class_<ParamPlan>(m, "Plan")
      .def_readonly("source_world", &ParamPlan::source_world)
      .def_readonly("target_world", &ParamPlan::target_world)
      .def_property_readonly("num_moves", [](const ParamPlan& p) { return p.moves.size(); })
      .def("move", [](const ParamPlan& p, size_t i) { return MoveToDict(p.moves.at(i)); })
      .def("num_moved_elements", &ParamPlan::num_moved_elements)
      .def("to_json", [](const ParamPlan& p) {
        return PlanDocumentToJson({{{"", p}}});
      });
  m.def(
      "compose",
      [](MapHandle& target, MapHandle& source) {
        const ParamMap& t = target.Valid();
        const ParamMap& s = source.Valid();
        Result<ParamPlan> plan = [&] {
          py::gil_scoped_release release;
          return Compose(t, s);
        }();
        if (!plan.ok()) Raise(plan.status(), ErrorKind::kMap);
        return *std::move(plan);
      },
      py::arg("target"), py::arg("source"));
}

// The scale tensors of a checkpoint and the data each scales, as config.json's
// quantization_config pairs them (hf/quantization.h): [(scale, data, block, format)], empty
// without a quantization_config. `tensors`: (name, safetensors dtype, shape).
py::list BlockTies(const std::string& config_json,
                   const std::vector<std::tuple<std::string, std::string, Shape>>& tensors) {
  Result<std::optional<QuantScheme>> scheme = ReadQuantScheme(config_json);
  if (!scheme.ok()) Raise(scheme.status(), ErrorKind::kMap);
  py::list out;
  if (!*scheme) return out;
  std::vector<QuantTensor> quant;
  for (const auto& [name, dtype_name, shape] : tensors) {
    const std::optional<DType> dtype = DTypeFromName(dtype_name);
    if (!dtype) throw py::value_error("tensor \"" + name + "\": unknown dtype " + dtype_name);
    quant.push_back({name, *dtype, shape});
  }
  Result<std::vector<QuantTie>> ties = TieQuantizedTensors(**scheme, quant);
  if (!ties.ok()) Raise(ties.status(), ErrorKind::kMap);
  for (const QuantTie& t : *ties) {
    if (!t.dequantizes) continue;  // per-tensor second-level scales: no block grid to check
    out.append(py::make_tuple(t.scale, t.data, py::tuple(py::cast(t.block)),
                              std::string(QuantFormatName(t.format))));
  }
  return out;
}

void BindBlocks(py::module_& m) {
  m.def("block_ties", &BlockTies, py::arg("config_json"), py::arg("tensors"));
  // MapError saying how `scale` differs from the block image of `data` in blocks of `block`
  // (CheckBlockTie), or why there is none (a local block taking elements of two data blocks).
  m.def(
      "check_block_tie",
      [](MapHandle& data, MapHandle& scale, const Shape& block) {
        const Status tied = CheckBlockTie(data.Valid(), scale.Valid(), block);
        if (!tied.ok()) Raise(tied, ErrorKind::kMap);
      },
      py::arg("data"), py::arg("scale"), py::arg("block"));
}

}  // namespace

void BindMaps(py::module_& m) {
  BindBlocks(m);
  BindMap(m);
  BindPlan(m);
  m.def("read_map_document", &ReadDocument, py::arg("text"), py::arg("path") = "");
  m.def("write_map_document", &WriteDocument, py::arg("params"), py::arg("buffers_json") = "");
  m.def("read_map_document_buffers", &ReadDocumentBuffers, py::arg("text"), py::arg("path") = "");
  // A whole file as the CLI reads its inputs (a FIFO with no writer refused at once, never
  // waited on): bytes, or FileNotFoundError / MapError naming the file.
  m.def(
      "read_text_file",
      [](const std::string& path) {
        Result<std::string> text = [&] {
          py::gil_scoped_release release;
          return ReadFileToString(path);
        }();
        if (!text.ok()) Raise(text.status(), ErrorKind::kMap);
        return py::bytes(*text);
      },
      py::arg("path"));
  m.def(
      "infer",
      [](const std::string& index_maps_json, bool allow_uncovered) {
        Result<IndexMaps> observed = ParseIndexMapsJson(index_maps_json);
        if (!observed.ok()) Raise(observed.status(), ErrorKind::kMap);
        Result<ParamMap> map = Infer(*observed, {.allow_uncovered = allow_uncovered});
        if (!map.ok()) Raise(map.status(), ErrorKind::kMap);
        return MapHandle(*std::move(map));
      },
      py::arg("index_maps_json"), py::arg("allow_uncovered") = false);
  // The same from index maps held in memory (int64 buffers: what a marker pass over a model's
  // parameters yields), without a JSON text of every element.
  m.def(
      "infer_observed",
      [](const Shape& logical_shape, const py::list& ranks, bool allow_uncovered) {
        IndexMaps observed;
        observed.logical_shape = logical_shape;
        for (const py::handle& item : ranks) {
          const auto [rank, shard_shape, buffer, index_map] =
              py::cast<std::tuple<Rank, Shape, std::string, py::buffer>>(item);
          const py::buffer_info info = index_map.request();
          if (info.itemsize != 8 || (info.format != "l" && info.format != "q") || info.ndim != 1 ||
              info.strides[0] != static_cast<py::ssize_t>(sizeof(int64_t))) {
            throw py::value_error("rank " + std::to_string(rank) +
                                  ": index_map must be a contiguous 1-D int64 buffer");
          }
          const auto* data = static_cast<const int64_t*>(info.ptr);
          observed.ranks.push_back(
              {rank, shard_shape, std::vector<Index>(data, data + info.shape[0]), {}, buffer});
        }
        Result<ParamMap> map = [&] {
          py::gil_scoped_release release;
          return Infer(observed, {.allow_uncovered = allow_uncovered});
        }();
        if (!map.ok()) Raise(map.status(), ErrorKind::kMap);
        return MapHandle(*std::move(map));
      },
      py::arg("logical_shape"), py::arg("ranks"), py::arg("allow_uncovered") = false);
}

}  // namespace reshard::python
