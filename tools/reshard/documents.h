// Reading the JSON documents the commands take as files: the library parses and validates,
// these add the file name to the message.
#ifndef RESHARD_TOOLS_DOCUMENTS_H_
#define RESHARD_TOOLS_DOCUMENTS_H_

#include <string>

#include "reshard/base/result.h"
#include "reshard/ir/map_json.h"
#include "reshard/layouts/layouts_document.h"

namespace reshard::cli {

/// A map document, parsed; each parameter validated on its own. The error is the file's
/// (unreadable) or the text's (malformed), prefixed `error reading "PATH"`.
Result<ValidatedMapDocument> ReadValidatedMapDocument(const std::string& path);

/// A map document whose maps are all valid: ReadValidatedMapDocument, then the first invalid
/// map as a failed check (FailedPrecondition), prefixed `"PATH"`.
Result<MapDocument> ReadMapDocument(const std::string& path);

/// A layouts document; errors prefixed `error reading "PATH"`.
Result<LayoutsDocument> ReadLayoutsDocument(const std::string& path);

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_DOCUMENTS_H_
