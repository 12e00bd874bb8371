#include "reshard/io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include <fmt/format.h>

namespace reshard {

namespace {

Status ErrnoError(int err, std::string_view what, const std::string& path) {
  std::string message = fmt::format("{} \"{}\": {}", what, path, std::strerror(err));
  switch (err) {
    case ENOENT: return NotFoundError(std::move(message));
    case EEXIST: return AlreadyExistsError(std::move(message));
    case EISDIR:
    case ENOTDIR: return InvalidArgumentError(std::move(message));
    case ENOSPC:
    case EDQUOT:
    case EFBIG: return ResourceExhaustedError(std::move(message));
    default: return UnavailableError(std::move(message));
  }
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

}  // namespace

Result<std::string> ReadFileToString(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError(errno, "cannot open", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, "cannot stat", path);
  if (S_ISDIR(st.st_mode)) {
    return InvalidArgumentError(fmt::format("\"{}\" is a directory, not a file", path));
  }
  std::string contents;
  if (S_ISREG(st.st_mode)) contents.reserve(static_cast<size_t>(st.st_size));
  char buffer[1 << 16];
  while (true) {
    ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot read", path);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  return contents;
}

Status WriteFileAtomically(const std::string& path, std::string_view contents,
                           const WriteOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!options.overwrite && fs::exists(fs::path(path), ec)) {
    return AlreadyExistsError(
        fmt::format("\"{}\" already exists; pass --force to replace it", path));
  }
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::random_device rd;
  const std::string tmp =
      (dir / fmt::format(".{}.tmp-{:08x}", target.filename().string(), rd())).string();
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoError(errno, "cannot create", tmp);
  auto fail = [&](int err, std::string_view what) {
    ::unlink(tmp.c_str());
    return ErrnoError(err, what, tmp);
  };
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd.get(), contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno, "cannot write");
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) return fail(errno, "cannot sync");
  if (::close(fd.release()) != 0) return fail(errno, "cannot close");
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoError(err, "cannot rename into place", path);
  }
  Fd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() >= 0) ::fsync(dir_fd.get());
  return Status::Ok();
}

}  // namespace reshard
