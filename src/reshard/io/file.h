// Files: whole-file reads with precise errors, and atomic writes.
//
// Outputs appear atomically: written under a temporary name in the destination directory,
// flushed to disk, then renamed into place. A failure leaves nothing that looks like a
// result, and an existing output is never replaced unless asked.
#ifndef RESHARD_IO_FILE_H_
#define RESHARD_IO_FILE_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

/// An open file descriptor, closed when the handle is destroyed (move-only). The one handle
/// type of the library: every input is opened through `OpenForReading`.
class FileHandle {
 public:
  FileHandle() = default;
  explicit FileHandle(int fd) : fd_(fd) {}
  FileHandle(FileHandle&& other) noexcept : fd_(other.release()), size_(other.size_) {}
  FileHandle& operator=(FileHandle&& other) noexcept;
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;
  ~FileHandle();

  /// Opens `path` read-only, refusing anything but a regular file (a directory, FIFO, socket or
  /// device is InvalidArgument) without ever blocking on it: the open is non-blocking and the
  /// type is checked with fstat before a byte is read. Errors as ErrnoStatus.
  static Result<FileHandle> OpenForReading(const std::string& path);

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  /// The file's size in bytes when it was opened by OpenForReading (0 otherwise).
  uint64_t size() const { return size_; }
  /// Gives up ownership of the descriptor.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

/// Reads `size` bytes at `offset` of an open file; DataLoss if it ends first.
Status ReadAt(const FileHandle& file, std::byte* out, size_t size, uint64_t offset,
              const std::string& path);

/// Reads a whole regular file (opened read-only), or a pipe to its end (process substitution;
/// a FIFO with no writer is refused, never waited on). NotFound for a missing file,
/// InvalidArgument for a directory, a writerless FIFO or another non-regular file and for one
/// that cannot be read (permissions, a symlink loop); messages name the file.
Result<std::string> ReadFileToString(const std::string& path);

struct WriteOptions {
  /// Replace an existing file. Without it an existing `path` is AlreadyExists.
  bool overwrite = false;
  /// Flush the file and its directory to disk before the rename. Off only for a writer that
  /// syncs every file itself before publishing them together (SyncFiles), e.g. the files of
  /// an output directory that appears by one rename.
  bool sync = true;
  /// With sync off: have the kernel start writing the file to disk at the commit, without
  /// waiting, for a writer that syncs it later with others (SyncFiles): the disk then works
  /// while the next files are written, and the final sync has little left to do.
  bool start_writeback = false;
  /// Let the file system copy unchanged byte ranges of other files (AppendCopyOf with
  /// copy_file_range(2): in the kernel, a reflink where the file system has them). Off: every
  /// byte is written from memory; the bytes written are the same.
  bool copy_file_ranges = true;
  /// Let a writer fill bytes straight into the file's pages (AppendInPlace: the range reserved
  /// with fallocate(2), then mapped). Off: they are written from memory; the bytes are the same.
  bool fill_in_place = true;
  /// The file's directory is an output directory's temporary that this operation made
  /// (checkpoint/output_dir.h): no earlier run left temporaries in it, so none is looked for.
  /// Looking lists the directory, so writing n files there would list n^2 entries.
  bool in_fresh_directory = false;
};

/// Copies `length` bytes of `in` from `in_offset` to `out` at its current position with
/// copy_file_range(2), the position advancing by what was copied. True once all were copied;
/// false, with `out`'s position back where it was, where the kernel cannot copy this pair (one
/// end not a regular file, the files on different or unsupporting file systems: EXDEV, ENOSYS,
/// EINVAL, EOPNOTSUPP, EBADF, ETXTBSY) or `in` ends early: the caller then writes the bytes
/// itself. A real failure of the output (ENOSPC, EIO) is an error naming `out_path`.
Result<bool> CopyFileRange(int in, uint64_t in_offset, int out, uint64_t length,
                           const std::string& out_path);

/// A Status for a failed system call: "<what> \"<path>\": <strerror>", coded by errno: what
/// the caller named wrongly or may not use is its input's fault (ENOENT NotFound, EEXIST
/// AlreadyExists; EACCES, EPERM, EISDIR, ENOTDIR, ELOOP, ENAMETOOLONG, ENXIO, EROFS
/// InvalidArgument); a limit is ResourceExhausted (ENOSPC, EDQUOT, EFBIG, EMFILE, ENFILE,
/// ENOMEM); anything else (EIO, ...) is a failure of the environment, Unavailable.
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
  /// Appends `length` bytes of `in` from `offset` through the file system (CopyFileRange)
  /// when options.copy_file_ranges allows it: true once appended, false when the caller is to
  /// Append them itself (nothing appended then).
  Result<bool> AppendCopyOf(int in, uint64_t offset, uint64_t length);
  /// Appends `length` bytes written in place: the range is reserved on disk (fallocate), then
  /// mapped `window` bytes at a time and `fill(at, bytes)` writes bytes [at, at + size) of it
  /// straight into the page cache (no buffer of the caller's, no copy by write(); `fill` may
  /// spread the window over threads). False, with nothing appended, where the file system
  /// cannot reserve or map the range, or with WriteOptions::fill_in_place off: the caller then
  /// Appends the bytes itself.
  /// ResourceExhausted on a full disk or a file size limit (found before anything is mapped);
  /// an error of `fill` abandons the file and is returned.
  Result<bool> AppendInPlace(
      uint64_t length, uint64_t window,
      const std::function<Status(uint64_t at, std::span<std::byte> bytes)>& fill);
  /// Flushes to disk and renames into place. Once called (ok or not) the writer is spent.
  Status Commit();

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd, const WriteOptions& options)
      : path_(std::move(path)),
        tmp_(std::move(tmp)),
        fd_(fd),
        sync_(options.sync),
        start_writeback_(!options.sync && options.start_writeback),
        copy_file_ranges_(options.copy_file_ranges),
        fill_in_place_(options.fill_in_place) {}
  void Abandon();
  std::string path_;
  std::string tmp_;
  int fd_ = -1;  // -1 once committed or abandoned
  bool sync_ = true;
  bool start_writeback_ = false;
  bool copy_file_ranges_ = true;
  bool fill_in_place_ = true;
};

/// Has the kernel start writing `path` to disk without waiting (WriteOptions::start_writeback
/// for a file written otherwise); best effort, as a later SyncFiles reports any failure.
void StartWriteback(const std::string& path);

/// Flushes each of `paths` (files or directories) to disk, on up to `threads` threads; the
/// first failure (Unavailable for EIO, naming the path) is returned after all have been tried.
Status SyncFiles(const std::vector<std::string>& paths, int threads);

/// Writes `contents` to `path` atomically (temporary file, fsync, rename, fsync of the
/// directory). On failure the temporary file is removed and `path` is untouched.
Status WriteFileAtomically(const std::string& path, std::string_view contents,
                           const WriteOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_IO_FILE_H_
