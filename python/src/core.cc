// reshard._core: the extension module behind the `reshard` package. Maps and plans
// (maps.cc), the executor on caller memory (exec.cc), files (files.cc); here the module, the
// errors, and safetensors files as {name: (dtype, shape, bytes)} for the cross-checks.
#include "core.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/json_reader.h"
#include "reshard/io/safetensors.h"

namespace reshard::python {
namespace {

// Set once by the package at import and kept for the life of the process.
PyObject* g_map_error = nullptr;
PyObject* g_checkpoint_error = nullptr;
PyObject* g_degree_error = nullptr;

PyObject* ExceptionType(StatusCode code, ErrorKind kind) {
  if (code == StatusCode::kNotFound) return PyExc_FileNotFoundError;
  switch (kind) {
    case ErrorKind::kMap:
      return g_map_error;
    case ErrorKind::kData:
      return code == StatusCode::kInvalidArgument ? g_map_error : PyExc_ValueError;
    case ErrorKind::kFile:
      return PyExc_ValueError;
    case ErrorKind::kCheckpoint:
      return g_checkpoint_error;
    case ErrorKind::kDegree:
      return g_degree_error;
  }
  return PyExc_RuntimeError;
}

DType LoadDType(const std::string& name) {
  std::optional<DType> dtype = DTypeFromName(name);
  if (!dtype) throw py::value_error("unknown dtype \"" + name + "\"");
  return *dtype;
}

// name -> (dtype, shape, bytes), in file order (the dict keeps it).
py::dict ReadSafetensors(const std::string& path) {
  Result<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) Raise(file.status(), ErrorKind::kFile);
  py::dict out;
  for (const TensorInfo& t : file->header().tensors) {
    std::span<const std::byte> data = file->data(t);
    out[py::str(t.name)] =
        py::make_tuple(std::string(DTypeName(t.dtype)), py::tuple(py::cast(t.shape)),
                       py::bytes(reinterpret_cast<const char*>(data.data()), data.size()));
  }
  return out;
}

// JSON text read by the library's strict reader (duplicate keys, nesting past its bound, bytes
// after the value refused), which must be an object: ValueError naming the problem otherwise.
void CheckJsonObject(const std::string& text) {
  Result<json::Json> value = json::ParseJson(text);
  if (!value.ok()) Raise(value.status(), ErrorKind::kFile);
  if (!value->is_object()) Raise(json::TypeError("", "an object", *value), ErrorKind::kFile);
}

std::map<std::string, std::string> SafetensorsMetadata(const std::string& path) {
  Result<SafetensorsHeader> header = ReadSafetensorsHeader(path);
  if (!header.ok()) Raise(header.status(), ErrorKind::kFile);
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
    if (!numel.ok()) Raise(numel.status().Annotate("tensor \"" + name + "\""), ErrorKind::kFile);
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
                         metadata.value_or(std::map<std::string, std::string>{}),
                         {.overwrite = overwrite});
  }
  if (!s.ok()) Raise(s, ErrorKind::kFile);
}

}  // namespace

[[noreturn]] void Raise(const Status& status, ErrorKind kind) {
  PyObject* type = ExceptionType(status.code(), kind);
  if (type == nullptr) type = PyExc_ValueError;  // before the package registered its classes
  py::object error = py::reinterpret_borrow<py::object>(type)(status.message());
  error.attr("code") = std::string(StatusCodeName(status.code()));
  PyErr_SetObject(type, error.ptr());
  throw py::error_already_set();
}

void RegisterErrorClasses(py::object map_error, py::object checkpoint_error,
                          py::object degree_error) {
  g_map_error = map_error.release().ptr();
  g_checkpoint_error = checkpoint_error.release().ptr();
  g_degree_error = degree_error.release().ptr();
}

const ParamMap& MapHandle::Valid() {
  if (!map_) {
    Result<ParamMap> map = builder_.Finalize();
    if (!map.ok()) Raise(map.status(), ErrorKind::kMap);
    map_ = *std::move(map);
  }
  return *map_;
}

}  // namespace reshard::python

PYBIND11_MODULE(_core, m) {
  using namespace reshard::python;
  m.doc() = "reshard's compiled core; use the `reshard` package, not this module.";
  m.attr("__version__") = RESHARD_VERSION;
  m.def("register_errors", &RegisterErrorClasses);
  BindMaps(m);
  BindExec(m);
  BindFiles(m);
  BindSync(m);
  BindDist(m);
  m.def("read_safetensors", &ReadSafetensors, py::arg("path"),
        "A safetensors file as {name: (dtype, shape, bytes)} in file order; ValueError naming "
        "the rule for a corrupt file.");
  m.def("check_json_object", &CheckJsonObject, py::arg("text"),
        "Reads JSON text strictly, as reshard reads its inputs; ValueError unless it is one "
        "object.");
  m.def("safetensors_metadata", &SafetensorsMetadata, py::arg("path"),
        "The __metadata__ string map of a safetensors file (header only).");
  m.def("write_safetensors", &PyWriteSafetensors, py::arg("path"), py::arg("tensors"),
        py::arg("metadata") = py::none(), py::arg("overwrite") = false,
        "Writes {name: (dtype, shape, buffer)} as the safetensors package would, atomically.");
}
