// Internal to the library's .cc files (it pulls in nlohmann/json): layout descriptors read
// from JSON that is already parsed, for documents that embed them (a layouts document, a
// checkpoint manifest).
#ifndef RESHARD_LAYOUTS_DESCRIPTOR_JSON_H_
#define RESHARD_LAYOUTS_DESCRIPTOR_JSON_H_

#include "reshard/base/json_reader.h"
#include "reshard/base/json_writer.h"
#include "reshard/base/result.h"
#include "reshard/layouts/descriptor.h"

namespace reshard {

/// The descriptor as a JSON value (what LayoutToJson writes), for documents that embed it.
json::OrderedJson LayoutToJsonValue(const LayoutDescriptor& descriptor);

/// ParseLayoutJson of a parsed value; errors carry paths relative to the value.
Result<LayoutDescriptor> LayoutFromJson(const json::Json& value);

}  // namespace reshard

#endif  // RESHARD_LAYOUTS_DESCRIPTOR_JSON_H_
