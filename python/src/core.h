// Shared pieces of the extension module reshard._core: how a library Status becomes a Python
// exception, and the Python-side value types around validated maps and plans.
#ifndef RESHARD_PYTHON_CORE_H_
#define RESHARD_PYTHON_CORE_H_

#include <pybind11/pybind11.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/status.h"
#include "reshard/ir/compose.h"
#include "reshard/ir/param_map.h"

namespace reshard::python {

namespace py = pybind11;

/// Which exception a failed Status becomes. Every kind turns NotFound into FileNotFoundError;
/// otherwise kMap raises reshard.MapError (a ValueError), kData ValueError (MapError for a
/// malformed map), kFile ValueError, kCheckpoint reshard.CheckpointError and kDegree
/// reshard.DegreeError.
/// The exception's message is the library's (the CLI prints the same text) and its `code`
/// attribute the status code's name.
enum class ErrorKind { kMap, kData, kFile, kCheckpoint, kDegree };

[[noreturn]] void Raise(const Status& status, ErrorKind kind);

/// Sets the exception classes defined in reshard/_errors.py.
void RegisterErrorClasses(py::object map_error, py::object checkpoint_error,
                          py::object degree_error);

/// A param map as Python holds it: parsed, and validated on first use (or at once). Invalid
/// maps exist only until something needs their validity.
class MapHandle {
 public:
  explicit MapHandle(ParamMapBuilder builder) : builder_(std::move(builder)) {}
  explicit MapHandle(ParamMap map) : builder_(map), map_(std::move(map)) {}

  /// The validated map; raises MapError naming the first violation.
  const ParamMap& Valid();
  const ParamMapBuilder& builder() const { return builder_; }

 private:
  ParamMapBuilder builder_;
  std::optional<ParamMap> map_;
};

/// Composed plans handed from one binding to another without a trip through Python objects
/// (a sync schedule's steps -> an Exchange).
struct PlanSet {
  std::vector<ParamPlan> plans;
};

void BindMaps(py::module_& m);
void BindExec(py::module_& m);
void BindFiles(py::module_& m);
void BindDist(py::module_& m);
void BindSync(py::module_& m);

}  // namespace reshard::python

#endif  // RESHARD_PYTHON_CORE_H_
