// Files: whole-file reads with precise errors, and atomic writes.
//
// Outputs appear atomically: written under a temporary name in the destination directory,
// flushed to disk, then renamed into place. A failure leaves nothing that looks like a
// result, and an existing output is never replaced unless asked.
#ifndef RESHARD_IO_FILE_H_
#define RESHARD_IO_FILE_H_

#include <string>
#include <string_view>

#include "reshard/base/result.h"

namespace reshard {

/// Reads a whole file (opened read-only). NotFound for a missing file, InvalidArgument for
/// a directory, Unavailable for other I/O errors; messages name the file.
Result<std::string> ReadFileToString(const std::string& path);

struct WriteOptions {
  /// Replace an existing file. Without it an existing `path` is AlreadyExists.
  bool overwrite = false;
};

/// Writes `contents` to `path` atomically (temporary file, fsync, rename, fsync of the
/// directory). On failure the temporary file is removed and `path` is untouched.
Status WriteFileAtomically(const std::string& path, std::string_view contents,
                           const WriteOptions& options = {});

}  // namespace reshard

#endif  // RESHARD_IO_FILE_H_
