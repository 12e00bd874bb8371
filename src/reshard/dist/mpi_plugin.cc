// The entry point of the MPI plugin (mpi_plugin.h): the only symbol it exports.
#include "reshard/dist/mpi_plugin.h"

#include <chrono>

#include "reshard/dist/mpi_communicator.h"

extern "C" __attribute__((visibility("default"))) void reshard_mpi_start(
    double timeout_seconds, reshard::Result<reshard::MpiJob>* out) {
  using reshard::MpiCommunicator;
  reshard::Result<std::unique_ptr<MpiCommunicator>> started =
      MpiCommunicator::Start(std::chrono::duration<double>(timeout_seconds));
  if (!started.ok()) {
    *out = started.status();
    return;
  }
  const MpiCommunicator* job = started->get();
  *out = reshard::MpiJob{*std::move(started), [job] { return job->broken(); }};
}

// Checked here, where the plugin is compiled, against the type the CLI calls it through.
static_assert(std::is_same_v<decltype(&reshard_mpi_start), reshard::MpiPluginStart>);
