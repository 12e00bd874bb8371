// Internal to the library's .cc files (it pulls in nlohmann/json through json_reader.h):
// param maps and map documents read from JSON that is already parsed, for documents that
// embed them (a checkpoint manifest, DeepSpeed's metadata, a layouts document).
#ifndef RESHARD_IR_MAP_JSON_VALUE_H_
#define RESHARD_IR_MAP_JSON_VALUE_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/base/json_reader.h"
#include "reshard/base/json_writer.h"
#include "reshard/base/result.h"
#include "reshard/ir/buffer_set.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// The param map as a JSON value (what ParamMapToJson writes), for documents that embed it.
json::OrderedJson ParamMapToJsonValue(const ParamMap& map);

/// Buffer declarations (the value of a document's "buffers") as JSON, and back.
json::OrderedJson BufferSetToJsonValue(const BufferSet& set);
Result<BufferSetBuilder> BufferSetFromJson(const json::Json& value, std::string_view path);

/// ParseParamMapJson of a parsed value; errors carry paths relative to the value.
Result<ParamMapBuilder> ParamMapFromJson(const json::Json& value);

/// The document's version: InvalidArgument unless `version` is an integer this reader knows,
/// kMapDocumentVersion or, when `allow_buffers`, kBufferedMapDocumentVersion (path "version").
Result<int> CheckDocumentVersion(const json::Json& version, bool allow_buffers = false);

/// The members of a document object `root` but "version" (and "buffers" when `skip_buffers`),
/// with `keys` (in file order) decoded by DecodeParamKey; InvalidArgument when two keys name
/// the same `what` ("parameter").
Result<std::vector<std::pair<std::string, const json::Json*>>> DecodeDocumentKeys(
    const json::Json& root, const std::vector<std::string>& keys, std::string_view what,
    bool skip_buffers = false);

/// A validation failure of well-formed input as a failed check: InvalidArgument, OutOfRange
/// and DataLoss become FailedPrecondition (message kept); other codes are kept.
Status AsFailedCheck(Status status);

}  // namespace reshard

#endif  // RESHARD_IR_MAP_JSON_VALUE_H_
