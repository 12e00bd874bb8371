// Files: whole-file reads with precise errors, and atomic writes.
//
// Outputs appear atomically: written under a temporary name in the destination directory,
// flushed to disk, then renamed into place. A failure leaves nothing that looks like a
// result, and an existing output is never replaced unless asked.
#ifndef RESHARD_IO_FILE_H_
#define RESHARD_IO_FILE_H_

#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "reshard/base/result.h"

namespace reshard {

/// Reads a whole file (opened read-only). NotFound for a missing file, InvalidArgument for
/// a directory, Unavailable for other I/O errors; messages name the file.
Result<std::string> ReadFileToString(const std::string& path);

struct WriteOptions {
  /// Replace an existing file. Without it an existing `path` is AlreadyExists.
  bool overwrite = false;
};

/// A Status for a failed system call: "<what> \"<path>\": <strerror>", coded by errno (ENOENT
/// NotFound, EEXIST AlreadyExists, EISDIR/ENOTDIR InvalidArgument, ENOSPC/EDQUOT/EFBIG
/// ResourceExhausted, anything else Unavailable).
Status ErrnoStatus(int err, std::string_view what, const std::string& path);

/// An output file written in pieces and published atomically: the bytes go to a temporary file
/// in the destination directory, and only `Commit` (fsync, rename, fsync of the directory)
/// makes them appear at `path`. Destroyed uncommitted (an error part-way, an early return) it
/// removes the temporary file, so a failed write leaves nothing behind. Lets a writer stream
/// an output larger than memory with the same guarantees as WriteFileAtomically.
class AtomicFileWriter {
 public:
  /// AlreadyExists if `path` exists and !options.overwrite; errors of creating the temporary.
  static Result<AtomicFileWriter> Create(const std::string& path, const WriteOptions& options);
  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&&) = delete;
  ~AtomicFileWriter();

  /// Appends bytes; ResourceExhausted on a full disk or a file size limit.
  Status Append(std::span<const std::byte> bytes);
  Status Append(std::string_view bytes);
  /// Flushes to disk and renames into place. Once called (ok or not) the writer is spent.
  Status Commit();

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd)
      : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}
  void Abandon();
  std::string path_;
  std::string tmp_;
  int fd_ = -1;  // -1 once committed or abandoned
};

/// Writes `contents` to `path` atomically (temporary file, fsync, rename, fsync of the
/// directory). On failure the temporary file is removed and `path` is untouched.
Status WriteFileAtomically(const std::string& path, std::string_view contents,
                           const WriteOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_IO_FILE_H_
