// Writing `.pt` files as torch.save writes a state dict, readable by
// `torch.load(path, weights_only=True)`.
//
// The layout is torch.save's (PyTorch 2.x), described byte by byte in torch_file.h and
// docs/formats.md: a zip of stored entries `<root>/data.pkl`, `<root>/.format_version` ("1"),
// `<root>/.storage_alignment` ("64"), `<root>/byteorder` ("little"), one `<root>/data/<i>` per
// tensor, `<root>/version` ("3\n"); each entry's data starts at a multiple of 64 bytes (padding
// in an "FB" extra field of the local header), CRC-32 and sizes follow the data in a data
// descriptor (flag bit 3) and are repeated in the central directory; ZIP64 records appear when
// an entry, an offset or the entry count needs them. The pickle (protocol 2) is an
// `collections.OrderedDict` of name -> `torch._utils._rebuild_tensor_v2(("storage",
// torch.<T>Storage, "<i>", "cpu", numel), 0, size, stride, False, OrderedDict())`, or
// `_rebuild_tensor_v3(..., torch.<dtype>)` over a `torch.storage.UntypedStorage` for the
// dtypes without a typed storage class (U16, U32, U64, F8_E4M3, F8_E5M2), as torch does.
#ifndef RESHARD_IO_TORCH_WRITER_H_
#define RESHARD_IO_TORCH_WRITER_H_

#include <string>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/io/safetensors.h"

namespace reshard {

struct TorchWriteOptions {
  /// The archive's root directory (torch.load accepts any).
  std::string root = "archive";
  /// Replace an existing file. Without it an existing `path` is AlreadyExists.
  bool overwrite = false;
};

/// Writes `tensors` (in the given order, each its own storage, dense row-major) as the state
/// dict torch.save would write, atomically. Each `fill` is called once, in order, on one
/// reused buffer as large as the largest tensor. InvalidArgument for duplicate or non-UTF-8
/// names, a bad shape or a missing fill (checked before anything is written); AlreadyExists,
/// ResourceExhausted and a failing fill's Status as for WriteSafetensors. Nothing is left
/// behind on failure.
Status WriteTorchStateDict(const std::string& path, std::vector<TensorToWrite> tensors,
                           const TorchWriteOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_IO_TORCH_WRITER_H_
