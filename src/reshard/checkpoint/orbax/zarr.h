// Zarr arrays as tensorstore writes them for Orbax: the metadata (zarr v2 `.zarray`, zarr v3
// `zarr.json`) and the chunks, decoded.
//
// zarr v2 `.zarray`: {"zarr_format": 2, "shape": [...], "chunks": [...], "dtype": "<f4" |
// "bfloat16" | "|b1" | ..., "compressor": null | {"id": "zstd", "level": L}, "filters": null,
// "order": "C", "fill_value": null | number, "dimension_separator": "." | "/"}. Chunk (i, j)
// is the key "i.j" (or "i/j"; "0" for a 0-d array): the chunk's elements row-major, every
// chunk of the full chunk shape (edge chunks padded), zstd-compressed or raw.
//
// zarr v3 `zarr.json`: {"zarr_format": 3, "node_type": "array", "shape": [...], "data_type":
// "float32" | "bfloat16" | ..., "chunk_grid": {"name": "regular", "configuration":
// {"chunk_shape": [...]}}, "chunk_key_encoding": {"name": "default" | "v2", "configuration":
// {"separator": "/" | "."}}, "fill_value": ..., "codecs": [...]}. Chunk (i, j) is "c/i/j"
// ("c" for a 0-d array) with the default encoding, "i.j" with v2. Codecs read: `bytes`
// (little-endian), then optionally `zstd`; or one `sharding_indexed` codec whose chunks
// (shards) hold inner chunks of its `chunk_shape`, each encoded by its `codecs` as above,
// followed (index_location "end", the default) or preceded ("start") by the index: per inner
// chunk in row-major order, offset and length as uint64 little-endian (both 2^64 - 1: absent),
// then a CRC-32C of the index when its `index_codecs` end with `crc32c`.
//
// A chunk that is not stored holds the fill value.
#ifndef RESHARD_CHECKPOINT_ORBAX_ZARR_H_
#define RESHARD_CHECKPOINT_ORBAX_ZARR_H_

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"

namespace reshard {

/// A zarr array's metadata, as far as reading it needs.
struct ZarrArray {
  int zarr_format = 2;
  DType dtype = DType::kF32;
  Shape shape;
  /// The stored unit: a zarr v2 chunk, a zarr v3 chunk (a shard under sharding_indexed).
  Shape chunk_shape;
  /// The unit a codec chain encodes: sharding_indexed's inner chunks, else chunk_shape.
  Shape inner_shape;
  bool sharded = false;
  bool index_at_start = false;
  bool index_crc32c = false;
  bool zstd = false;  // inner chunks zstd-compressed
  /// Chunk keys: `key_prefix` then the grid indices joined by `separator` ("0" or "c" when 0-d).
  std::string key_prefix;
  char separator = '.';
  /// Whether the fill value is zero (null, 0, 0.0, false): the only one a missing chunk is read
  /// with.
  bool zero_fill = true;
  std::string fill_text;  // the fill value as written, for messages
};

/// Parses `.zarray` (`zarr_format` 2) or `zarr.json` (3). InvalidArgument naming `what` and the
/// JSON path for malformed metadata; FailedPrecondition for what is not read: a codec or compressor
/// other than those above, big-endian or Fortran-order data, filters, a dtype reshard lacks.
Result<ZarrArray> ParseZarrMetadata(std::string_view text, std::string_view what);

/// zarr v2's name of `dtype` ("<f4", "bfloat16", "|b1", ...), as tensorstore writes it.
std::string ZarrV2DtypeName(DType dtype);

/// zarr v3's data_type name of `dtype` ("float32", "bfloat16", "float8_e4m3fn", "bool", ...).
std::string ZarrV3DtypeName(DType dtype);

/// The metadata tensorstore writes for Orbax of an array of `dtype` and `shape` stored in chunks
/// of `chunk_shape`, zstd-compressed (level 1): zarr v2's `.zarray` text (`zarr_format` 2;
/// chunk keys "i.j", fill value null) or zarr v3's `zarr.json` (3; keys "c/i/j", fill value
/// zero; one `sharding_indexed` codec whose one inner chunk is the whole chunk: `bytes` (little
/// endian) then `zstd`, and its index at the end, CRC-32C'd, the layout Orbax saves).
std::string ZarrMetadataText(int zarr_format, DType dtype, const Shape& shape,
                             const Shape& chunk_shape);

/// The chunk keys of metadata from ZarrMetadataText: `key_prefix` and `separator` set.
ZarrArray ZarrKeysOf(int zarr_format);

/// Encodes a chunk's elements (row-major, the full chunk) as ZarrMetadataText's metadata says:
/// a zstd frame (v2), or the shard of one inner chunk (v3): the zstd frame, then the index
/// (offset 0, its length; uint64 little-endian) and the index's CRC-32C. Internal for a zstd
/// failure.
Status EncodeZarrChunk(int zarr_format, std::span<const std::byte> elements, std::string& out);

/// The key of chunk `grid` (one index per dimension), relative to the array.
std::string ZarrChunkKey(const ZarrArray& a, std::span<const Index> grid);

/// The number of chunks along each dimension.
Shape ZarrChunkGrid(const ZarrArray& a);

/// Decodes a stored chunk into `out`: prod(chunk_shape) elements, row-major (edge chunks
/// padded). An empty `stored` with `missing` set is a chunk that is not stored: the fill
/// value. DataLoss naming `what` for a chunk that is not what its metadata says (a zstd
/// stream that is corrupt or of another size, a raw chunk of the wrong size, a shard index out
/// of range or failing its CRC); FailedPrecondition for a missing chunk of a non-zero fill value.
Status DecodeZarrChunk(const ZarrArray& a, std::span<const std::byte> stored, bool missing,
                       std::string_view what, std::vector<std::byte>& out);

/// Copies the box [offsets, offsets + sizes) of an array from the chunk at `chunk_origin`
/// (elements; its data `chunk`, of `chunk_shape`) into `box` (the box's elements, row-major,
/// `box_offsets` its origin and `box_sizes` its shape): the part where both overlap.
void CopyChunkIntoBox(const Shape& chunk_origin, const Shape& chunk_shape,
                      std::span<const std::byte> chunk, const Shape& box_offsets,
                      const Shape& box_sizes, size_t element_size, std::span<std::byte> box);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_ORBAX_ZARR_H_
