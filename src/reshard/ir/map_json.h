// JSON form of param maps (DESIGN.md 6.1) and map documents (6.2).
//
// A param map:
//   {"logical_shape": [48, 8], "valid_shape": [40, 8]?,
//    "ranks": {"0": {"shard_shape": [24, 8],
//                    "pieces": [{"shape": [8, 8], "source": [0, [8, 1]], "dest": [0, [8, 1]],
//                                "locations": [0], "scale": 0.5?}, ...]}, ...}}
// Interchangeable with DeepSpeed's `ParamAffineMap.to_dict()` (which has no valid_shape).
// `scale` is written only when it is not 1. Rank keys are decimal strings "0".."N-1", all
// present. Unknown keys are ignored.
//
// A map document: {"version": 1, "<key>": <param map>, ...}, where a key is a parameter name
// or an exact-match pattern `^<regex-escaped name>$` as DeepSpeed emits them; both read to
// the same name. Any other regular expression is refused, as is a version other than 1 or 2.
//
// Version 2 adds buffers (DESIGN.md 16, ir/buffer_set.h): a rank of a param map may name the
// buffer its pieces write into, `"ranks": {"0": {"buffer": "<name>", "shard_shape": <the
// buffer's shape on rank 0>, "pieces": [...]}}`, and the document declares the buffers under
// the reserved key "buffers" (a parameter named "buffers" is written as `^buffers$`):
//   "buffers": {"<name>": {"dtype": "BF16",
//                          "ranks": {"0": {"shape": [2, 64, 64],
//                                          "padding": [{"shape": [...], "view": [offset,
//                                                       [strides]]}]?}, ...}}}
// The writer emits version 1 (DeepSpeed's form) unless the document has buffers.
//
// Reading is strict and two-staged, because a caller must tell malformed input from a
// well-formed map that breaks an invariant: `ParseParamMapJson` checks syntax, types and
// structure and returns an unvalidated builder; `ParamMapBuilder::Finalize` validates.
// `ValidateMapDocumentJson` does both for a document and keeps the two apart: malformed text
// is its error (InvalidArgument), each parameter carries its own validation result. Errors
// carry the JSON path: `ranks["3"].pieces[1].source[1][0]: expected an integer, got 2.5`.
// The text is read by the library's strict JSON reader (base/json_reader.h): duplicate keys,
// nesting deeper than 128 levels and bytes after the JSON value are refused.
#ifndef RESHARD_IR_MAP_JSON_H_
#define RESHARD_IR_MAP_JSON_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/ir/buffer_set.h"
#include "reshard/ir/param_map.h"

namespace reshard {

inline constexpr int kMapDocumentVersion = 1;
/// The version of documents that declare buffers.
inline constexpr int kBufferedMapDocumentVersion = 2;

/// One parameter of a map document, before validation.
struct NamedMapBuilder {
  std::string name;
  ParamMapBuilder builder;
};

/// A map document, before validation, in file order.
struct MapDocumentBuilder {
  std::vector<NamedMapBuilder> params;
  BufferSetBuilder buffers;
};

/// A validated map document, in file order; `buffers` validated with the maps over them.
struct MapDocument {
  std::vector<std::pair<std::string, ParamMap>> params;
  BufferSet buffers;
};

/// Checks `doc.buffers` against `doc.params` (BufferSetBuilder::Finalize) and stores the result.
Status ValidateBuffers(MapDocument& doc, const BufferSetBuilder& buffers);

/// Parses one param map. InvalidArgument (with the JSON path) for malformed JSON, wrong
/// types, missing keys, non-integers where integers belong, integers outside int64, rank
/// keys that are not "0".."N-1".
Result<ParamMapBuilder> ParseParamMapJson(std::string_view text);

/// Parses a map document; also accepts a bare param map, read as one parameter named "".
/// Duplicate names (after decoding `^...$` keys) are refused.
Result<MapDocumentBuilder> ParseMapDocumentJson(std::string_view text);

/// One parameter of a map document after validation: its map, or why it is invalid.
struct ValidatedParam {
  std::string name;
  Result<ParamMap> map;

  /// Ok, or the map's error annotated with the parameter name (none for the unnamed map of a
  /// bare param map) as a failed check of well-formed input: FailedPrecondition (a check
  /// that could not be completed, e.g. ResourceExhausted, keeps its code).
  Status status() const;
};

/// A well-formed map document whose parameters have each been validated, in file order.
struct ValidatedMapDocument {
  std::vector<ValidatedParam> params;
  /// The buffer declarations checked with the maps (when every map is valid; otherwise the
  /// first invalid map's error).
  Result<BufferSet> buffers = BufferSet();

  size_t num_invalid() const;
  /// Ok when every map and the buffer set are valid; otherwise the first invalid parameter's
  /// status(), or the buffer set's (as a failed check).
  Status status() const;
  /// Every map, or status().
  Result<MapDocument> ToDocument() &&;
};

/// Both stages: the Result's error is stage 1 (InvalidArgument for malformed input, as
/// ParseMapDocumentJson); stage 2 is per parameter.
Result<ValidatedMapDocument> ValidateMapDocumentJson(std::string_view text);

/// Parse then validate every parameter: InvalidArgument for malformed input,
/// FailedPrecondition (annotated with the parameter name) for an invalid map.
Result<MapDocument> ReadMapDocumentJson(std::string_view text);

/// Deterministic, compact-per-piece JSON: the same map always gives the same bytes. Keys in
/// the order of DESIGN.md 6.1, ranks in numeric order, one piece per line, doubles in the
/// shortest form that reads back exactly. Ends with a newline.
std::string ParamMapToJson(const ParamMap& map);
std::string MapDocumentToJson(const MapDocument& doc);
std::string BufferSetToJson(const BufferSet& set);
/// Buffer declarations (what a document's "buffers" holds), unvalidated; InvalidArgument with
/// the JSON path for malformed input.
Result<BufferSetBuilder> ParseBufferSetJson(std::string_view text);

/// `^<escaped>$` -> name for an exact-match pattern; plain names are returned unchanged;
/// InvalidArgument for a pattern that matches anything but one literal name.
Result<std::string> DecodeParamKey(std::string_view key);

/// The document key for parameter `name`: the name itself, or its exact-match pattern when
/// the name would read as something else (it starts with "^", or is "version").
std::string EncodeParamKey(std::string_view name);

}  // namespace reshard

#endif  // RESHARD_IR_MAP_JSON_H_
