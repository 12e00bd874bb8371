// What every checkpoint operation does around its own work, alone or as one of several
// processes (communicator.h): which processes take part, the output directory that process 0
// creates and the others join, the progress of the whole job, and the collective end where
// process 0 commits. For the operations' implementations (checkpoint_ops.cc, deepspeed.cc,
// universal/universal.cc), not a public interface.
#ifndef RESHARD_CHECKPOINT_COLLECTIVE_OUTPUT_H_
#define RESHARD_CHECKPOINT_COLLECTIVE_OUTPUT_H_

#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/communicator.h"
#include "reshard/checkpoint/output_dir.h"

namespace reshard {

/// The processes running the operation `options` describes (SingleProcess() without any).
Communicator& CommunicatorOf(const CheckpointOptions& options);

/// The options as this process applies them: only process 0 warns and reports progress.
CheckpointOptions ForThisProcess(const CheckpointOptions& options);

// Counts written bytes and reports them: in one process directly; across processes each
// publishes its count and process 0 reports the whole job's.
class ProgressCounter {
 public:
  ProgressCounter(const CheckpointOptions& options, uint64_t total)
      : comm_(CommunicatorOf(options)), report_(options.progress), total_(total) {
    if (report_) report_(0, total_);
    if (comm_.size() > 1 && report_) {
      comm_.SetProgressListener([this](uint64_t job_done) {
        std::lock_guard<std::mutex> lock(report_mu_);
        if (job_done == reported_) return;  // process 0 hears the same count many times
        reported_ = job_done;
        report_(job_done, total_);
      });
    }
  }
  ~ProgressCounter() {
    if (comm_.size() > 1 && report_) comm_.SetProgressListener({});
  }
  void Add(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ += bytes;
    if (comm_.size() > 1) {
      comm_.PublishProgress(done_);
    } else if (report_) {
      report_(done_, total_);
    }
  }

 private:
  Communicator& comm_;
  std::mutex mu_;
  std::mutex report_mu_;
  std::function<void(uint64_t, uint64_t)> report_;
  uint64_t total_;
  uint64_t done_ = 0;
  uint64_t reported_ = 0;
};

/// Runs fn(i) for every i < count, on up to one thread per core (num_threads <= 0) or
/// num_threads: each file is written by one thread, so the kernel's copies into the page cache
/// and the memory copies of several files overlap. Returns the first error (items not yet
/// started are then skipped).
Status ForEachIndex(size_t count, int num_threads, const std::function<Status(size_t)>& fn);

/// How an operation writes each of its output files: never synced one by one on its writer's
/// thread (a thread would wait for the disk between two files); with options.sync, each file's
/// writeback starts as it closes, so the disk works while the next files are written, and
/// SyncOutputFiles then waits for all of them together, before the commit. For files in the
/// output directory's temporary (OutputDirectory::FilePath): no stale temporaries are looked
/// for there, so writing n files costs n file creations, not n directory listings.
WriteOptions OutputFileOptions(const CheckpointOptions& options);

/// With options.sync and `written` OK: flushes this process's files (`names`, relative to the
/// output) to disk on several threads, then the directories holding them (their entries, as
/// this process renamed them in). Returns `written` when it failed, else the first sync error.
Status SyncOutputFiles(const OutputDirectory& out, const Status& written,
                       std::span<const std::string> names, const CheckpointOptions& options);

/// Collective: process 0 creates the output directory, the others join its temporary. They
/// join before it exists, so that from its creation on a survivor of any process knows what
/// to remove.
Result<OutputDirectory> OpenOutput(Communicator& comm, const std::string& path,
                                   const CheckpointOptions& options,
                                   std::span<const std::string> inputs);

/// Collective, once every process has written its files (`written`: this process's outcome):
/// fills options.stats; when every process succeeded, process 0 runs `commit` (the manifest or
/// index, then the rename). Every process returns the same status.
Status FinishOutput(Communicator& comm, OutputDirectory& out, const Status& written,
                    ProcessStats mine, const CheckpointOptions& options,
                    const std::function<Status()>& commit);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_COLLECTIVE_OUTPUT_H_
