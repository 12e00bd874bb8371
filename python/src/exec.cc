// reshard._core: extract, rebuild and transfer plans on caller memory.
//
// The Python layer (reshard/_tensors.py) hands over each tensor as the address of its first
// element after checking its dtype, shape, device and that it is dense and row-major (it makes
// a dense copy of any other input first). Here the copies run with the GIL released, straight
// between those buffers: nothing is allocated or copied twice.
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core.h"
#include "reshard/base/dtype.h"
#include "reshard/exec/executor.h"

namespace reshard::python {
namespace {

DType LoadDType(const std::string& name) {
  std::optional<DType> dtype = DTypeFromName(name);
  if (!dtype) throw py::value_error("unknown dtype \"" + name + "\"");
  return *dtype;
}

const std::byte* In(uintptr_t address) { return reinterpret_cast<const std::byte*>(address); }
std::byte* Out(uintptr_t address) { return reinterpret_cast<std::byte*>(address); }

ExecOptions Options(int scale_power, bool verify_replicas, bool allow_scaled_optimizer_state,
                    bool allow_lossy_scale, int num_threads) {
  ExecOptions o;
  o.scale_power = scale_power;
  o.verify_replicas = verify_replicas;
  o.allow_scaled_optimizer_state = allow_scaled_optimizer_state;
  o.allow_lossy_scale = allow_lossy_scale;
  o.num_threads = num_threads;
  return o;
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status, ErrorKind::kData);
}

void ExtractInto(MapHandle& handle, const std::string& dtype_name, Rank rank, uintptr_t full,
                 uintptr_t shard, const ExecOptions& options) {
  const ParamMap& map = handle.Valid();
  const DType dtype = LoadDType(dtype_name);
  Check([&] {
    py::gil_scoped_release release;
    return Extract(map, dtype, rank, {In(full), map.num_elements()},
                   {Out(shard), map.shard_num_elements(rank)}, options);
  }());
}

void RebuildInto(MapHandle& handle, const std::string& dtype_name,
                 const std::vector<uintptr_t>& shards, uintptr_t full, const ExecOptions& options) {
  const ParamMap& map = handle.Valid();
  const DType dtype = LoadDType(dtype_name);
  std::vector<ConstBuffer> views;
  for (size_t r = 0; r < shards.size(); ++r) {
    views.push_back({In(shards[r]), map.shard_num_elements(static_cast<Rank>(r))});
  }
  Check([&] {
    py::gil_scoped_release release;
    return Rebuild(map, dtype, views, {Out(full), map.num_elements()}, options);
  }());
}

// sources / targets: (address, number of elements) per rank.
void TransferInto(const ParamPlan& plan, const std::string& dtype_name,
                  const std::vector<std::pair<uintptr_t, Index>>& sources,
                  const std::vector<std::pair<uintptr_t, Index>>& targets,
                  const ExecOptions& options) {
  const DType dtype = LoadDType(dtype_name);
  std::vector<ConstBuffer> in;
  std::vector<MutableBuffer> out;
  for (const auto& [address, n] : sources) in.push_back({In(address), n});
  for (const auto& [address, n] : targets) out.push_back({Out(address), n});
  Check([&] {
    py::gil_scoped_release release;
    return ExecutePlan(plan, dtype, in, out, options);
  }());
}

// Asks the kernel to back the whole pages of [address, address + bytes) with transparent huge
// pages when it faults them in, as numpy does for its arrays of 4 MiB and more. A freshly
// allocated output is otherwise faulted in one 4 KiB page at a time during the copy, and those
// faults (not the copy) are most of the time an allocating extract or rebuild takes. Advice
// only: where the kernel has no huge pages it is ignored, so errors are too.
void AdviseHugePages(uintptr_t address, size_t bytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (address + page - 1) / page * page;
  const uintptr_t end = (address + bytes) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)address;
  (void)bytes;
#endif
}

}  // namespace

void BindExec(py::module_& m) {
  py::class_<ExecOptions>(m, "ExecOptions")
      .def(py::init(&Options), py::arg("scale_power") = 1, py::arg("verify_replicas") = true,
           py::arg("allow_scaled_optimizer_state") = false, py::arg("allow_lossy_scale") = false,
           py::arg("num_threads") = 0);
  m.def("extract_into", &ExtractInto, py::arg("map"), py::arg("dtype"), py::arg("rank"),
        py::arg("full"), py::arg("shard"), py::arg("options"),
        "F at address `full` -> rank's shard at address `shard` (dense, row-major buffers).");
  m.def("rebuild_into", &RebuildInto, py::arg("map"), py::arg("dtype"), py::arg("shards"),
        py::arg("full"), py::arg("options"),
        "Shards (one address per rank) -> F at address `full`, checking replicas.");
  m.def("transfer_into", &TransferInto, py::arg("plan"), py::arg("dtype"), py::arg("sources"),
        py::arg("targets"), py::arg("options"),
        "Runs a plan: source shards -> target shards, each (address, number of elements).");
  m.def("advise_huge_pages", &AdviseHugePages, py::arg("address"), py::arg("bytes"),
        "Advises transparent huge pages for the untouched memory of a new output buffer.");
}

}  // namespace reshard::python
