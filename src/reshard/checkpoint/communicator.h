// The processes that run one checkpoint operation together, and how they agree.
//
// A checkpoint operation (scatter, gather, convert) may run as K cooperating processes (under
// `mpirun -n K`, or `srun` with PMIx): each writes a share of the output files, balanced by
// bytes, into the one temporary output directory that process 0 creates; after every process
// has finished (a collective), process 0 writes the manifest and commits. The operations see
// the processes only through `Communicator`: one process (`SingleProcess()`) or MPI
// (reshard/dist/mpi_communicator.h, built when MPI is found). Every collective is called by
// every process in the same order; a collective that fails (a peer gone, a timeout) leaves the
// processes unable to agree, and the caller fails without calling another one.
#ifndef RESHARD_CHECKPOINT_COMMUNICATOR_H_
#define RESHARD_CHECKPOINT_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

class Communicator {
 public:
  virtual ~Communicator() = default;
  /// This process's index, 0 .. size() - 1. Process 0 creates the output and commits it.
  virtual int rank() const = 0;
  /// The number of processes.
  virtual int size() const = 0;
  /// Collective: every process's `mine`, in rank order. Unavailable when a peer cannot be
  /// reached in time.
  virtual Result<std::vector<std::string>> AllGather(const std::string& mine) = 0;
  /// Not collective, cheap, callable from any thread: publishes this process's count of bytes
  /// done (growing). Process 0 passes the whole job's count (the latest count each process
  /// published, summed) to the listener, also while it waits in a collective.
  virtual void PublishProgress(uint64_t bytes_done) = 0;
  /// Where process 0 sends the whole job's bytes done; empty to stop.
  virtual void SetProgressListener(std::function<void(uint64_t job_bytes_done)> listener) = 0;
};

/// The communicator of a run in one process (rank 0 of 1); its listener sees the bytes
/// published.
Communicator& SingleProcess();

/// Collective: OK when every process's `local` is OK; otherwise, on every process, the failure
/// of the lowest-ranked failing process (with more than one process, its message starts with
/// "process N: "). Unavailable when the processes cannot agree.
Status AgreeOnStatus(Communicator& comm, const Status& local);

/// Collective: every process's `value` of process `root` (what the others pass is ignored).
Result<std::string> Broadcast(Communicator& comm, const std::string& value, int root);

/// What a process was asked to do, as named items compared across the processes of a job:
/// the command, each option's value (paths made absolute), and each input file's identity.
using RunDescription = std::vector<std::pair<std::string, std::string>>;

/// Collective, before any work: every process's `mine` must equal process 0's, item for item;
/// otherwise every process gets InvalidArgument naming the first process and item that differ
/// (both values), so that processes given different commands or inputs (an mpirun with two
/// app contexts, nodes that see different files) fail together before writing anything.
Status AgreeOnRun(Communicator& comm, const RunDescription& mine);

/// Appends the identity of the input `path` to `out`: the path made absolute ("<what>") and,
/// for each regular file at or below it (three levels of directories down, symbolic links
/// followed), its size and modification time ("<what> file <relative path>"). Copies on each
/// node's own disk agree when they keep the modification times (cp -p, rsync -a).
void DescribeInput(const std::string& what, const std::string& path, RunDescription& out);

/// Gives each of `bytes.size()` items (output files, by size in bytes) to one of `processes`,
/// largest first to the least loaded (ties: the earlier item, the lower process), so every
/// process gets about the same number of bytes; returns each item's process. Deterministic:
/// every process computes the same assignment.
std::vector<int> BalanceByBytes(std::span<const uint64_t> bytes, int processes);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_COMMUNICATOR_H_
