// A whole file mapped read-only into memory, for readers that use its bytes in place.
#ifndef RESHARD_IO_MAPPED_FILE_H_
#define RESHARD_IO_MAPPED_FILE_H_

#include <cstddef>
#include <span>
#include <string>

#include "reshard/base/result.h"

namespace reshard {

/// A regular file opened read-only and mapped whole (MAP_PRIVATE, PROT_READ); the descriptor
/// is closed once mapped. Move-only; unmapped on destruction. As with any mapping, another
/// process truncating the file while it is mapped makes reads of the lost pages fault
/// (SIGBUS); checkpoints are not rewritten in place.
class MappedFile {
 public:
  /// NotFound for a missing file; InvalidArgument for a directory or another non-regular
  /// file; errors of open/mmap as ErrnoStatus. An empty file maps to an empty span.
  static Result<MappedFile> Open(const std::string& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }

  /// Tells the kernel the file will be read front to back (more read-ahead, pages dropped
  /// sooner). A hint: nothing fails.
  void AdviseSequential() const;

 private:
  MappedFile() = default;
  void Unmap();
  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

/// Drops the whole pages inside `range` (bytes of a MappedFile) from this process: they stay in
/// the page cache and fault back in on the next read, so resident memory follows the tensor
/// being worked on rather than everything read so far.
void ReleaseMappedPages(std::span<const std::byte> range);

}  // namespace reshard

#endif  // RESHARD_IO_MAPPED_FILE_H_
