#include "reshard/io/file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "reshard/io/temporaries.h"

namespace reshard {

Status ErrnoStatus(int err, std::string_view what, const std::string& path) {
  std::string message = fmt::format("{} \"{}\": {}", what, path, std::strerror(err));
  switch (err) {
    case ENOENT:
      return NotFoundError(std::move(message));
    case EEXIST:
      return AlreadyExistsError(std::move(message));
    case EACCES:
    case EPERM:
    case EISDIR:
    case ENOTDIR:
    case ELOOP:
    case ENAMETOOLONG:
    case ENXIO:
    case EROFS:
      return InvalidArgumentError(std::move(message));
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return ResourceExhaustedError(std::move(message));
    default:
      return UnavailableError(std::move(message));
  }
}

FileHandle& FileHandle::operator=(FileHandle&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    size_ = other.size_;
    fd_ = other.release();
  }
  return *this;
}

FileHandle::~FileHandle() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

std::string_view FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

}  // namespace

Result<FileHandle> FileHandle::OpenForReading(const std::string& path) {
  // O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
  FileHandle file(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (!file.valid()) return ErrnoStatus(errno, "cannot open", path);
  struct stat st {};
  if (::fstat(file.get(), &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgumentError(
        fmt::format("\"{}\" is {}; expected a regular file", path, FileKind(st.st_mode)));
  }
  const int flags = ::fcntl(file.get(), F_GETFL);
  if (flags >= 0) ::fcntl(file.get(), F_SETFL, flags & ~O_NONBLOCK);
  file.size_ = static_cast<uint64_t>(st.st_size);
  return file;
}

Status ReadAt(const FileHandle& file, std::byte* out, size_t size, uint64_t offset,
              const std::string& path) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n =
        ::pread(file.get(), out + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) return DataLossError(fmt::format("\"{}\" shrank while being read", path));
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

namespace {

// The most a pipe is read for one document.
constexpr size_t kMaxPipeBytes = size_t{1} << 30;

// A pipe whose writer is there (process substitution: `reshard infer <(make_maps)`) is read to
// its end; one with no writer is refused at once rather than waited on.
Result<std::string> ReadPipe(FileHandle file, const std::string& path) {
  std::string contents;
  char buffer[65536];
  const ssize_t first = ::read(file.get(), buffer, sizeof(buffer));
  if (first == 0) {
    return InvalidArgumentError(
        fmt::format("\"{}\" is a FIFO with no writer; expected a regular file or a pipe", path));
  }
  if (first < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    return ErrnoStatus(errno, "cannot read", path);
  }
  if (first > 0) contents.append(buffer, static_cast<size_t>(first));
  const int flags = ::fcntl(file.get(), F_GETFL);
  if (flags < 0 || ::fcntl(file.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return ErrnoStatus(errno, "cannot read", path);
  }
  while (true) {
    const ssize_t n = ::read(file.get(), buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) return contents;
    if (contents.size() + static_cast<size_t>(n) > kMaxPipeBytes) {
      return ResourceExhaustedError(fmt::format(
          "\"{}\": a pipe of more than {} bytes; write it to a file", path, kMaxPipeBytes));
    }
    contents.append(buffer, static_cast<size_t>(n));
  }
}

}  // namespace

Result<std::string> ReadFileToString(const std::string& path) {
  {
    FileHandle pipe(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    struct stat st {};
    if (pipe.valid() && ::fstat(pipe.get(), &st) == 0 && S_ISFIFO(st.st_mode)) {
      return ReadPipe(std::move(pipe), path);
    }
  }
  RESHARD_ASSIGN_OR_RETURN(FileHandle file, FileHandle::OpenForReading(path));
  std::string contents(static_cast<size_t>(file.size()), '\0');
  RESHARD_RETURN_IF_ERROR(
      ReadAt(file, reinterpret_cast<std::byte*>(contents.data()), contents.size(), 0, path));
  return contents;
}

Result<AtomicFileWriter> AtomicFileWriter::Create(const std::string& path,
                                                  const WriteOptions& options) {
  std::error_code ec;
  if (!options.overwrite && std::filesystem::exists(std::filesystem::path(path), ec)) {
    return AlreadyExistsError(fmt::format("\"{}\" already exists", path));
  }
  if (!options.in_fresh_directory) RemoveStaleTemporaries(path);
  std::string tmp = TemporaryPathFor(path);
  int fd = -1;
  RESHARD_RETURN_IF_ERROR(CreateTemporary(tmp, [&]() -> Status {
    // Read and write: AppendInPlace maps it.
    fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoStatus(errno, "cannot create", tmp);
    return Status::Ok();
  }));
  return AtomicFileWriter(path, std::move(tmp), fd, options);
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      tmp_(std::move(other.tmp_)),
      fd_(other.fd_),
      sync_(other.sync_),
      start_writeback_(other.start_writeback_),
      copy_file_ranges_(other.copy_file_ranges_),
      fill_in_place_(other.fill_in_place_) {
  other.fd_ = -1;
}

AtomicFileWriter::~AtomicFileWriter() { Abandon(); }

void AtomicFileWriter::Abandon() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  (void)FinishTemporary(tmp_, [&] {
    ::unlink(tmp_.c_str());
    return Status::Ok();
  });
}

Status AtomicFileWriter::Append(std::string_view bytes) {
  return Append(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())));
}

Status AtomicFileWriter::Append(std::span<const std::byte> bytes) {
  if (fd_ < 0) return InternalError(fmt::format("\"{}\" is no longer open for writing", tmp_));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      Abandon();
      return ErrnoStatus(err, "cannot write", tmp_);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Result<bool> AtomicFileWriter::AppendInPlace(
    uint64_t length, uint64_t window,
    const std::function<Status(uint64_t at, std::span<std::byte> bytes)>& fill) {
  if (fd_ < 0) return InternalError(fmt::format("\"{}\" is no longer open for writing", tmp_));
  if (!fill_in_place_) return false;
  if (length == 0) return true;
  const off_t start = ::lseek(fd_, 0, SEEK_CUR);
  if (start < 0) return false;
  // Reserved first, so that a full disk is an error here rather than a SIGBUS in a page fault.
  int reserved = -1;
  do {
    reserved = ::fallocate(fd_, 0, start, static_cast<off_t>(length));
  } while (reserved != 0 && errno == EINTR);
  if (reserved != 0) {
    const int err = errno;
    if (err == EOPNOTSUPP || err == ENOSYS || err == EINVAL || err == ENODEV) return false;
    Abandon();
    return ErrnoStatus(err, "cannot write", tmp_);
  }
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  window = std::max<uint64_t>(window, 1);
  for (uint64_t at = 0; at < length; at += window) {
    const uint64_t size = std::min(window, length - at);
    const uint64_t begin = static_cast<uint64_t>(start) + at;
    const uint64_t base = begin / page * page;
    const size_t mapped = static_cast<size_t>(begin - base + size);
    void* p =
        ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(base));
    if (p == MAP_FAILED) {
      const int err = errno;
      if (at == 0 && ::ftruncate(fd_, start) == 0) return false;  // appended nothing
      Abandon();
      return ErrnoStatus(err, "cannot map", tmp_);
    }
    Status filled = fill(at, std::span(static_cast<std::byte*>(p) + (begin - base), size));
    ::munmap(p, mapped);
    if (!filled.ok()) {
      Abandon();
      return filled;
    }
    if (start_writeback_) {
      (void)::sync_file_range(fd_, static_cast<off_t>(begin), static_cast<off_t>(size),
                              SYNC_FILE_RANGE_WRITE);
    }
  }
  if (::lseek(fd_, start + static_cast<off_t>(length), SEEK_SET) < 0) {
    const int err = errno;
    Abandon();
    return ErrnoStatus(err, "cannot seek", tmp_);
  }
  return true;
}

Result<bool> CopyFileRange(int in, uint64_t in_offset, int out, uint64_t length,
                           const std::string& out_path) {
  const off_t start = ::lseek(out, 0, SEEK_CUR);
  if (start < 0) return false;  // a pipe or another unseekable output
  auto off = static_cast<off_t>(in_offset);
  uint64_t done = 0;
  while (done < length) {
    // At most 1 GiB a call: the kernel caps one call near 2 GiB anyway.
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(length - done, uint64_t{1} << 30));
    const ssize_t n = ::copy_file_range(in, &off, out, nullptr, chunk, 0);
    if (n > 0) {
      done += static_cast<uint64_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    const int err = n < 0 ? errno : 0;
    const bool unsupported = n == 0 || err == EXDEV || err == ENOSYS || err == EINVAL ||
                             err == EOPNOTSUPP || err == EBADF || err == ETXTBSY || err == EPERM;
    if (!unsupported) return ErrnoStatus(err, "cannot write", out_path);
    // What was copied is overwritten by the caller's own write of the whole range.
    if (::lseek(out, start, SEEK_SET) != start) return ErrnoStatus(errno, "cannot seek", out_path);
    return false;
  }
  return true;
}

Result<bool> AtomicFileWriter::AppendCopyOf(int in, uint64_t offset, uint64_t length) {
  if (fd_ < 0) return InternalError(fmt::format("\"{}\" is no longer open for writing", tmp_));
  if (!copy_file_ranges_) return false;
  Result<bool> copied = CopyFileRange(in, offset, fd_, length, tmp_);
  if (!copied.ok()) Abandon();
  return copied;
}

Status AtomicFileWriter::Commit() {
  if (fd_ < 0) return InternalError(fmt::format("\"{}\" is no longer open for writing", tmp_));
  auto fail = [&](int err, std::string_view what) {
    Abandon();
    return ErrnoStatus(err, what, tmp_);
  };
  if (sync_ && ::fsync(fd_) != 0) return fail(errno, "cannot sync");
  // Best effort: a failure here shows again when the caller syncs the file.
  if (start_writeback_) (void)::sync_file_range(fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
  const int fd = fd_;
  fd_ = -1;
  const int close_result = ::close(fd);
  const int close_err = errno;
  RESHARD_RETURN_IF_ERROR(FinishTemporary(tmp_, [&]() -> Status {
    if (close_result != 0) {
      ::unlink(tmp_.c_str());
      return ErrnoStatus(close_err, "cannot close", tmp_);
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp_.c_str());
      return ErrnoStatus(err, "cannot rename into place", path_);
    }
    return Status::Ok();
  }));
  if (!sync_) return Status::Ok();
  const std::filesystem::path target(path_);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  FileHandle dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() >= 0) ::fsync(dir_fd.get());
  return Status::Ok();
}

void StartWriteback(const std::string& path) {
  FileHandle fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (fd.valid()) (void)::sync_file_range(fd.get(), 0, 0, SYNC_FILE_RANGE_WRITE);
}

Status SyncFiles(const std::vector<std::string>& paths, int threads) {
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first;
  auto worker = [&] {
    for (size_t i = next++; i < paths.size(); i = next++) {
      FileHandle fd(::open(paths[i].c_str(), O_RDONLY | O_CLOEXEC));
      const int err = !fd.valid() ? errno : ::fsync(fd.get()) != 0 ? errno : 0;
      if (err == 0) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (first.ok()) first = ErrnoStatus(err, "cannot sync", paths[i]);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  return first;
}

Status WriteFileAtomically(const std::string& path, std::string_view contents,
                           const WriteOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(AtomicFileWriter writer, AtomicFileWriter::Create(path, options));
  RESHARD_RETURN_IF_ERROR(writer.Append(contents));
  return writer.Commit();
}

}  // namespace reshard
