#include "processes.h"

#include <chrono>
#include <memory>

#ifdef RESHARD_HAVE_MPI
#include "reshard/dist/mpi_communicator.h"
#endif

namespace reshard::cli {

namespace {

#ifdef RESHARD_HAVE_MPI
std::unique_ptr<MpiCommunicator>& Job() {
  static auto* job = new std::unique_ptr<MpiCommunicator>;
  return *job;
}
#endif

Communicator* current = nullptr;

}  // namespace

Result<Communicator*> Processes(double timeout_seconds) {
  if (current) return current;
#ifdef RESHARD_HAVE_MPI
  if (MpiCommunicator::LaunchedByMpi()) {
    RESHARD_ASSIGN_OR_RETURN(
        Job(), MpiCommunicator::Start(std::chrono::duration<double>(timeout_seconds)));
    current = Job().get();
    return current;
  }
#else
  (void)timeout_seconds;
#endif
  current = &SingleProcess();
  return current;
}

bool PrintsResults() { return current == nullptr || current->rank() == 0; }

Status AsReportedHere(Status status) {
  if (status.ok() || PrintsResults()) return status;
#ifdef RESHARD_HAVE_MPI
  if (Job() && Job()->broken()) return status;
#endif
  return Status(status.code(), "");
}

void EndProcesses() {
#ifdef RESHARD_HAVE_MPI
  Job().reset();
#endif
  current = nullptr;
}

}  // namespace reshard::cli
