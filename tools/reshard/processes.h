// The processes a run of the CLI belongs to. Under `mpirun -n K` (or `srun` with PMIx), when
// reshard is built with MPI, scatter, gather and convert run as the K processes of the job
// (checkpoint/communicator.h): process 0 prints the results, the progress bar and the job's
// errors. The MPI runner is a plugin beside the CLI (reshard/dist/mpi_plugin.h), loaded, with
// the system's MPI library, only then. Started any other way, every command runs in this process
// alone and MPI is never initialised.
#ifndef RESHARD_TOOLS_PROCESSES_H_
#define RESHARD_TOOLS_PROCESSES_H_

#include "reshard/base/result.h"
#include "reshard/checkpoint/communicator.h"

namespace reshard::cli {

/// The communicator of this run, started on first use. `timeout_seconds`: the longest a
/// process waits for the others at one exchange.
Result<Communicator*> Processes(double timeout_seconds);

/// Whether this process prints results: process 0 of the job, or a process alone.
bool PrintsResults();

/// `status` as this process reports it: a process other than 0 stays quiet about a failure
/// the processes agreed on (process 0 reports it) but reports its own when they could not
/// agree. The exit status is unchanged.
Status AsReportedHere(Status status);

/// Ends the job's use of MPI (at the end of main): finalizes, or aborts every process when an
/// exchange failed.
void EndProcesses();

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_PROCESSES_H_
