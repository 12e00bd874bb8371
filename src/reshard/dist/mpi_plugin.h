// The MPI runner as a plugin: a shared module (kMpiPluginFile) linked against MPI, beside the
// CLI, which loads it only when an MPI launcher started the process. The CLI itself then needs
// no MPI library to run, and a wheel carrying both finds the system's MPI at run time (it never
// carries one: an MPI library must be the launcher's own).
#ifndef RESHARD_DIST_MPI_PLUGIN_H_
#define RESHARD_DIST_MPI_PLUGIN_H_

#include <functional>
#include <memory>

#include "reshard/base/result.h"
#include "reshard/checkpoint/communicator.h"

namespace reshard {

/// The processes of the MPI job, and whether one of its collectives failed (the processes can
/// no longer agree: destroying the communicator then aborts the job).
struct MpiJob {
  std::unique_ptr<Communicator> communicator;
  std::function<bool()> broken;
};

inline constexpr char kMpiPluginFile[] = "libreshard_mpi.so";
/// The entry point, found by name: `void reshard_mpi_start(double timeout_seconds,
/// Result<MpiJob>* out)` (MpiCommunicator::Start).
inline constexpr char kMpiPluginEntry[] = "reshard_mpi_start";
using MpiPluginStart = void (*)(double timeout_seconds, Result<MpiJob>* out);

}  // namespace reshard

#endif  // RESHARD_DIST_MPI_PLUGIN_H_
