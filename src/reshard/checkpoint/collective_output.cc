#include "reshard/checkpoint/collective_output.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <exception>
#include <filesystem>
#include <iterator>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "reshard/io/file.h"
#include "reshard/io/temporaries.h"

namespace reshard {

namespace {

// "<read> <verified> <written> <copied> <file>..." (file names hold no spaces).
std::string EncodeStats(const ProcessStats& s) {
  std::string text =
      fmt::format("{} {} {} {}", s.bytes_read, s.bytes_verified, s.bytes_written, s.bytes_copied);
  for (const std::string& f : s.files) text += " " + f;
  return text;
}

ProcessStats DecodeStats(int rank, const std::string& text) {
  ProcessStats s;
  s.rank = rank;
  std::vector<std::string> words;
  for (size_t begin = 0; begin <= text.size();) {
    const size_t space = std::min(text.find(' ', begin), text.size());
    words.push_back(text.substr(begin, space - begin));
    begin = space + 1;
  }
  uint64_t* numbers[] = {&s.bytes_read, &s.bytes_verified, &s.bytes_written, &s.bytes_copied};
  for (size_t k = 0; k < words.size(); ++k) {
    if (k >= std::size(numbers)) {
      s.files.push_back(words[k]);
    } else {
      std::from_chars(words[k].data(), words[k].data() + words[k].size(), *numbers[k]);
    }
  }
  return s;
}

}  // namespace

Communicator& CommunicatorOf(const CheckpointOptions& options) {
  return options.communicator ? *options.communicator : SingleProcess();
}

CheckpointOptions ForThisProcess(const CheckpointOptions& options) {
  CheckpointOptions o = options;
  if (CommunicatorOf(options).rank() != 0) {
    o.warn = nullptr;
    o.progress = nullptr;
  }
  return o;
}

Status ForEachIndex(size_t count, int num_threads, const std::function<Status(size_t)>& fn) {
  int threads =
      num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = static_cast<int>(
      std::clamp<size_t>(static_cast<size_t>(std::max(threads, 1)), 1, std::max<size_t>(count, 1)));
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first;
  // An exception (std::bad_alloc: a size an input claims that cannot be held) is carried to
  // the calling thread and rethrown there once every worker is joined, rather than ending the
  // process from a worker (std::terminate) with no word of what failed.
  std::exception_ptr thrown;
  auto work = [&] {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!first.ok() || thrown) return;
      }
      const size_t i = next.fetch_add(1);
      if (i >= count) return;
      Status s = fn(i);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.ok()) first = std::move(s);
      }
    }
  };
  auto worker = [&] {
    try {
      work();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!thrown) thrown = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  if (thrown) std::rethrow_exception(thrown);
  return first;
}

WriteOptions OutputFileOptions(const CheckpointOptions& options) {
  WriteOptions o;
  o.sync = false;
  o.start_writeback = options.sync;
  o.copy_file_ranges = options.copy_file_ranges;
  o.in_fresh_directory = true;
  return o;
}

Status SyncOutputFiles(const OutputDirectory& out, const Status& written,
                       std::span<const std::string> names, const CheckpointOptions& options) {
  if (!written.ok() || !options.sync) return written;
  std::vector<std::string> files;
  std::set<std::string> dirs;
  for (const std::string& name : names) {
    files.push_back(out.FilePath(name));
    dirs.insert(std::filesystem::path(files.back()).parent_path().string());
  }
  // The disk had the files' writeback started as each closed: most of it is done by now.
  const int threads = std::max(options.num_threads, 8);
  RESHARD_RETURN_IF_ERROR(SyncFiles(files, threads));
  return SyncFiles(std::vector<std::string>(dirs.begin(), dirs.end()), threads);
}

Result<OutputDirectory> OpenOutput(Communicator& comm, const std::string& path,
                                   const CheckpointOptions& options,
                                   std::span<const std::string> inputs) {
  if (comm.size() == 1) return OutputDirectory::Create(path, options.overwrite, inputs);
  RESHARD_ASSIGN_OR_RETURN(
      const std::string temp,
      Broadcast(comm, comm.rank() == 0 ? TemporaryPathFor(path) : std::string(), 0));
  std::optional<Result<OutputDirectory>> out;
  if (comm.rank() != 0) out.emplace(OutputDirectory::Join(path, temp));
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, out ? out->status() : Status::Ok()));
  if (comm.rank() == 0) out.emplace(OutputDirectory::Create(path, options.overwrite, inputs, temp));
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, out->status()));
  return std::move(*out);
}

Status FinishOutput(Communicator& comm, OutputDirectory& out, const Status& written,
                    ProcessStats mine, const CheckpointOptions& options,
                    const std::function<Status()>& commit) {
  mine.rank = comm.rank();
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> all, comm.AllGather(EncodeStats(mine)));
  if (options.stats) {
    options.stats->processes.clear();
    if (comm.rank() != 0) {
      options.stats->processes.push_back(std::move(mine));
    } else {
      for (size_t p = 0; p < all.size(); ++p) {
        options.stats->processes.push_back(DecodeStats(static_cast<int>(p), all[p]));
      }
    }
  }
  // A joined temporary stays recorded on failure (process 0 removes it, and a process that
  // ends the job because an exchange failed removes it too); once every file is written,
  // process 0 alone decides whether the output appears.
  RESHARD_RETURN_IF_ERROR(AgreeOnStatus(comm, written));
  out.Leave();
  return AgreeOnStatus(comm, comm.rank() == 0 ? commit() : Status::Ok());
}

}  // namespace reshard
