// The processes of an MPI job (Open MPI's mpirun, or srun with PMIx under Slurm) as a
// Communicator (reshard/checkpoint/communicator.h), so that the checkpoint operations run
// across them.
//
// Collectives are non-blocking MPI calls polled against a deadline: a process that waits longer
// than `timeout` for its peers (one has died or hung where the launcher did not notice) gets
// Unavailable instead of waiting forever, and the communicator is then broken: destroying it
// aborts the whole job (MPI_Abort) rather than finalizing. Progress travels as small
// point-to-point messages to process 0 (at most ten a second per process), which drains them
// whenever it publishes its own progress or waits in a collective; every message is received
// by the end of the next collective.
#ifndef RESHARD_DIST_MPI_COMMUNICATOR_H_
#define RESHARD_DIST_MPI_COMMUNICATOR_H_

#include <chrono>
#include <memory>

#include "reshard/checkpoint/communicator.h"

namespace reshard {

class MpiCommunicator final : public Communicator {
 public:
  /// Initialises MPI (threads: serialized) for the job's processes, with errors returned, not
  /// fatal. `timeout`: the longest a process waits in one collective for its peers.
  /// Unavailable when MPI cannot be initialised.
  static Result<std::unique_ptr<MpiCommunicator>> Start(std::chrono::duration<double> timeout);

  /// Finalizes MPI, or, when a collective failed, aborts every process of the job with exit
  /// status 3.
  ~MpiCommunicator() override;

  int rank() const override;
  int size() const override;
  Result<std::vector<std::string>> AllGather(const std::string& mine) override;
  void PublishProgress(uint64_t bytes_done) override;
  void SetProgressListener(std::function<void(uint64_t)> listener) override;

  /// Whether a collective failed (the processes can no longer agree).
  bool broken() const;

  struct State;

 private:
  explicit MpiCommunicator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace reshard

#endif  // RESHARD_DIST_MPI_COMMUNICATOR_H_
