// reshard._core: extract, rebuild and transfer plans on caller memory.
//
// The Python layer (reshard/_tensors.py) hands over each tensor as the address of its first
// element after checking its dtype, shape, device and that it is dense and row-major (it makes
// a dense copy of any other input first). Here the copies run with the GIL released, straight
// between those buffers: nothing is allocated or copied twice.
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <sstream>
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

// A mapping of this process's address space, from /proc/self/maps.
struct Mapping {
  uintptr_t begin = 0, end = 0;
  bool readable = false, writable = false;
};

// The process's mappings in address order; empty where /proc/self/maps cannot be read (not
// Linux), in which case nothing is known and nothing is refused.
std::vector<Mapping> ReadMappings() {
  std::vector<Mapping> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream fields(line);
    std::string range, perms;
    if (!(fields >> range >> perms) || perms.size() < 2) continue;
    const size_t dash = range.find('-');
    if (dash == std::string::npos) continue;
    Mapping m;
    m.begin = static_cast<uintptr_t>(std::stoull(range.substr(0, dash), nullptr, 16));
    m.end = static_cast<uintptr_t>(std::stoull(range.substr(dash + 1), nullptr, 16));
    m.readable = perms[0] == 'r';
    m.writable = perms[1] == 'w';
    out.push_back(m);
  }
  return out;
}

// Whether every byte of [begin, end) lies in mappings with the permission asked for.
bool Covered(const std::vector<Mapping>& maps, uintptr_t begin, uintptr_t end, bool write) {
  for (const Mapping& m : maps) {
    if (begin >= end) break;
    if (m.end <= begin || m.begin > begin) continue;
    if (!(write ? m.writable : m.readable)) return false;
    begin = m.end;
  }
  return begin >= end;
}

// Why the `bytes` bytes at `address`, in a buffer whose memory starts at `storage`, must not
// be written; "" when they may. Torch tensors carry no read-only flag: torch.from_numpy of a
// read-only memory map, or torch.frombuffer of a `bytes`, give tensors over memory that must
// not be written (the first faults, the second changes an immutable object). This asks the
// kernel's view of the pages (/proc/self/maps), and whether the buffer is the contents of a
// Python `bytes` object (its header lies just before them).
std::string WhyNotWritable(uintptr_t storage, uintptr_t address, size_t bytes) {
  if (bytes == 0) return "";
  const std::vector<Mapping> maps = ReadMappings();
  if (maps.empty()) return "";
  if (!Covered(maps, address, address + bytes, true)) {
    return "lies in memory mapped read-only (a read-only memory map or file)";
  }
  const size_t header = offsetof(PyBytesObject, ob_sval);
  if (storage >= header && storage <= address && Covered(maps, storage - header, storage, false)) {
    auto* object = reinterpret_cast<PyObject*>(storage - header);
    if (Py_TYPE(object) == &PyBytes_Type &&
        static_cast<size_t>(Py_SIZE(object)) >= address + bytes - storage) {
      return "is the contents of an immutable Python bytes object";
    }
  }
  return "";
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
  m.def("why_not_writable", &WhyNotWritable, py::arg("storage"), py::arg("address"),
        py::arg("bytes"),
        "Why memory must not be written (read-only pages, a bytes object's contents); \"\" "
        "when it may.");
  m.def("advise_huge_pages", &AdviseHugePages, py::arg("address"), py::arg("bytes"),
        "Advises transparent huge pages for the untouched memory of a new output buffer.");
}

}  // namespace reshard::python
