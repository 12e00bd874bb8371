#include "reshard/io/mapped_file.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <utility>

#include "reshard/io/file.h"

namespace reshard {

Result<MappedFile> MappedFile::Open(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(const FileHandle fd, FileHandle::OpenForReading(path));
  MappedFile file;
  file.path_ = path;
  if (fd.size() > 0) {
    const auto size = static_cast<size_t>(fd.size());
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (map == MAP_FAILED) return ErrnoStatus(errno, "cannot map", path);
    file.data_ = static_cast<const std::byte*>(map);
    file.size_ = size;
  }
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

void MappedFile::AdviseSequential() const {
  if (data_ != nullptr) ::madvise(const_cast<std::byte*>(data_), size_, MADV_SEQUENTIAL);
}

void MappedFile::Unmap() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

void ReleaseMappedPages(std::span<const std::byte> range) {
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<uintptr_t>(range.data()) + page - 1) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(range.data()) + range.size()) / page * page;
  // madvise takes whole pages: the range rounded inwards, as an address again.
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace reshard
