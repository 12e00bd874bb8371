// safetensors files, exactly as the reference implementation reads and writes them.
//
// Layout, byte by byte:
//   [0, 8)          N: the header length, u64 little-endian
//   [8, 8 + N)      the header: UTF-8 JSON object, padded at the end with spaces (0x20) so
//                   that 8 + N is a multiple of 8 (writers pad; readers accept any N)
//   [8 + N, end)    the data section: every tensor's bytes, contiguous, no gaps
// The header maps each tensor name to {"dtype": "BF16", "shape": [..], "data_offsets":
// [begin, end]} (byte offsets relative to the data section, end - begin = numel * dtype size),
// plus an optional "__metadata__": {string: string}. Readers refuse: N > 100 MB, a header
// past the end of the file, invalid UTF-8 or JSON, a non-object, an unknown dtype, a shape
// whose byte size disagrees with its offsets, offsets that overlap or leave gaps or do not
// start at 0, a data section longer or shorter than the tensors (trailing bytes, truncated
// data), duplicate names, and a __metadata__ that is not a string-to-string map.
// Like the reference, readers ignore unknown keys inside a tensor entry and read
// "__metadata__": null as no metadata. Dtypes outside base/dtype.h's table (the reference
// also knows F4, F6_*, F8_E8M0, C64) are refused as unknown.
//
// Writers produce the reference writer's exact bytes: tensors laid out by descending dtype in
// its ranking (U64 I64 F64 F32 U32 I32 BF16 F16 U16 I16 F8_E4M3 F8_E5M2 I8 U8 BOOL), then by
// name (bytewise); header keys in that same order after "__metadata__"; compact JSON with
// only '"', '\\' and control characters escaped. The reference keeps metadata in a hash map,
// so with two or more metadata keys its order varies from run to run; ours is sorted, one of
// the orders it produces. An empty metadata map is omitted, as the reference does for None.
#ifndef RESHARD_IO_SAFETENSORS_H_
#define RESHARD_IO_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/io/file.h"
#include "reshard/io/mapped_file.h"

namespace reshard {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t data_begin = 0;  // bytes, relative to the data section
  uint64_t data_end = 0;    // bytes, relative to the data section
  uint64_t num_bytes() const { return data_end - data_begin; }
};

struct SafetensorsHeader {
  /// In data order (ascending data_begin).
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  /// Absolute offset of the data section in the file: 8 + header length.
  uint64_t data_offset = 0;
  /// Total bytes of the data section.
  uint64_t data_size = 0;
  const TensorInfo* Find(std::string_view name) const;
};

/// Parses and validates a header given the file's first bytes (at least 8 + N of them, or the
/// whole file) and the file's total size. DataLoss for every corruption above, with a message
/// naming the rule, the tensor and the offending values.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> prefix,
                                                 uint64_t file_size);

/// Reads only the header of a file (names, dtypes, shapes, offsets): no weights are read.
Result<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path);

/// A safetensors file opened read-only and memory-mapped (MAP_PRIVATE): tensor data is
/// zero-copy. As with any mapping, another process truncating the file while it is open makes
/// reads of the lost pages fault (SIGBUS); checkpoints are not rewritten in place.
class SafetensorsFile {
 public:
  static Result<SafetensorsFile> Open(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  /// The bytes of `tensor` (one of header().tensors), in the mapping.
  std::span<const std::byte> data(const TensorInfo& tensor) const;

 private:
  SafetensorsFile(MappedFile file, SafetensorsHeader header)
      : file_(std::move(file)), header_(std::move(header)) {}
  MappedFile file_;
  SafetensorsHeader header_;
};

/// A byte range of a file: `length` bytes from `offset`.
struct FileRange {
  std::string path;
  uint64_t offset = 0;
  uint64_t length = 0;
};

/// One tensor to write: its bytes are produced on demand (so a writer can stream tensors
/// without holding the whole file in memory).
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  /// Fills `out` (exactly numel * dtype size bytes) with the tensor's data.
  std::function<Status(std::span<std::byte> out)> fill;
  /// Optional: fills rows [begin, end) of the first dimension into `out` (exactly their bytes).
  /// With band_rows > 0 the writer fills the tensor a band of band_rows rows at a time, each
  /// band straight into the file's pages where the file system allows it
  /// (AtomicFileWriter::AppendInPlace: no band in memory, no copy by write()); elsewhere, with
  /// more rows than one band, into two bands of memory in turn, the next filled on a thread of
  /// its own while the last is written. `fill` is then not called (it is for a tensor of one
  /// band that cannot be filled in place).
  std::function<Status(Index begin, Index end, std::span<std::byte> out)> fill_rows{};
  Index band_rows = 0;
};

/// The bytes a tensor's fill gives, as ranges of files, in order, adding up to the tensor's
/// size: the writer has the file system copy them (copy_file_range: no pass through memory)
/// and calls `copied` instead of the fill; where the kernel cannot copy them it calls the fill.
struct TensorCopy {
  std::vector<FileRange> ranges;  // none: the fill writes the tensor
  std::function<void()> copied;
};

/// Writes a safetensors file atomically (temporary name in the same directory, fsync, rename),
/// tensors and header keys in the reference writer's order (above, whatever the order of
/// `tensors`), header padded with spaces to 8 bytes. Each `fill` is called once, in file
/// order, on one reused buffer as large as the largest tensor (or two bands of a tensor filled
/// by rows): that buffer is the writer's peak memory. InvalidArgument for duplicate or non-UTF-8
/// names, "__metadata__" as a name, a bad shape, a missing fill or copies that do not add up to
/// their tensors (checked before anything is written); AlreadyExists if `path` exists and
/// !options.overwrite; ResourceExhausted on a full disk; a failing fill's Status is returned.
/// Nothing is left behind on failure. `copies`: none, or one per tensor (copies[i] for tensors[i]);
/// used where options.copy_file_ranges allows.
Status WriteSafetensors(const std::string& path, std::vector<TensorToWrite> tensors,
                        const std::map<std::string, std::string>& metadata = {},
                        const WriteOptions& options = {}, std::vector<TensorCopy> copies = {});

}  // namespace reshard

#endif  // RESHARD_IO_SAFETENSORS_H_
