#include "reshard/io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "reshard/io/file.h"

namespace reshard {

Result<MappedFile> MappedFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  struct stat st {};
  Status status;
  if (::fstat(fd, &st) != 0) {
    status = ErrnoStatus(errno, "cannot stat", path);
  } else if (S_ISDIR(st.st_mode)) {
    status = InvalidArgumentError("\"" + path + "\" is a directory, not a file");
  } else if (!S_ISREG(st.st_mode)) {
    status = InvalidArgumentError("\"" + path + "\" is not a regular file");
  }
  MappedFile file;
  file.path_ = path;
  if (status.ok() && st.st_size > 0) {
    void* map = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      status = ErrnoStatus(errno, "cannot map", path);
    } else {
      file.data_ = static_cast<const std::byte*>(map);
      file.size_ = static_cast<size_t>(st.st_size);
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() { Unmap(); }

void MappedFile::Unmap() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace reshard
