#include "processes.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <system_error>

#include "reshard/dist/mpi_plugin.h"

namespace reshard::cli {

namespace {

// The job's communicator when MPI runs it (never destroyed before EndProcesses).
MpiJob& Job() {
  static auto* job = new MpiJob;
  return *job;
}

Communicator* current = nullptr;

// Whether an MPI launcher started this process (the environment mpirun, or srun with PMIx,
// sets).
bool LaunchedByMpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr;
}

// Starts the MPI job through the plugin beside this executable. Without the plugin (reshard
// built without MPI) the process runs alone: nullptr.
Result<MpiJob*> StartMpiJob(double timeout_seconds) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::filesystem::path plugin = self.parent_path() / kMpiPluginFile;
  if (ec || !std::filesystem::exists(plugin, ec)) return nullptr;
  void* handle = ::dlopen(plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    return UnavailableError(
        fmt::format("started by an MPI launcher, but the MPI runner \"{}\" cannot be loaded "
                    "(it uses the system's Open MPI, libmpi.so.40): {}",
                    plugin.string(), ::dlerror()));
  }
  auto start = reinterpret_cast<MpiPluginStart>(::dlsym(handle, kMpiPluginEntry));
  if (start == nullptr) {
    return InternalError(
        fmt::format("\"{}\" has no entry point {}", plugin.string(), kMpiPluginEntry));
  }
  Result<MpiJob> job = InternalError("the MPI runner did not start");
  start(timeout_seconds, &job);
  RESHARD_RETURN_IF_ERROR(job.status());
  Job() = *std::move(job);
  return &Job();
}

}  // namespace

Result<Communicator*> Processes(double timeout_seconds) {
  if (current) return current;
  if (LaunchedByMpi()) {
    RESHARD_ASSIGN_OR_RETURN(MpiJob * job, StartMpiJob(timeout_seconds));
    if (job != nullptr) {
      current = job->communicator.get();
      return current;
    }
  }
  current = &SingleProcess();
  return current;
}

bool PrintsResults() { return current == nullptr || current->rank() == 0; }

Status AsReportedHere(Status status) {
  if (status.ok() || PrintsResults()) return status;
  if (Job().communicator && Job().broken()) return status;
  return Status(status.code(), "");
}

void EndProcesses() {
  Job().communicator.reset();
  current = nullptr;
}

}  // namespace reshard::cli
