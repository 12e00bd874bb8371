// Zarr metadata and chunks: the layouts are in zarr.h.
#include "reshard/checkpoint/orbax/zarr.h"

#include <fmt/format.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/orbax/ocdbt.h"

namespace reshard {

namespace {

using json::Json;

struct DtypeName {
  std::string_view v2;  // zarr v2 dtype
  std::string_view v3;  // zarr v3 data_type
  DType dtype;
};
constexpr DtypeName kDtypes[] = {
    {"<f8", "float64", DType::kF64},
    {"<f4", "float32", DType::kF32},
    {"<f2", "float16", DType::kF16},
    {"bfloat16", "bfloat16", DType::kBF16},
    {"<i8", "int64", DType::kI64},
    {"<i4", "int32", DType::kI32},
    {"<i2", "int16", DType::kI16},
    {"|i1", "int8", DType::kI8},
    {"<u8", "uint64", DType::kU64},
    {"<u4", "uint32", DType::kU32},
    {"<u2", "uint16", DType::kU16},
    {"|u1", "uint8", DType::kU8},
    {"|b1", "bool", DType::kBool},
    {"float8_e4m3fn", "float8_e4m3fn", DType::kF8E4M3},
    {"float8_e5m2", "float8_e5m2", DType::kF8E5M2},
};

Result<DType> ParseDtype(const Json& j, int format, std::string_view path) {
  RESHARD_ASSIGN_OR_RETURN(std::string name, json::ReadString(j, path));
  // zarr v2 writes one-byte types with "|" or "<" and tensorstore accepts both.
  if (format == 2 && name.size() == 3 && name[0] == '<' && name[2] == '1') name[0] = '|';
  for (const DtypeName& d : kDtypes) {
    if (name == (format == 2 ? d.v2 : d.v3)) return d.dtype;
  }
  if (format == 2 && !name.empty() && name[0] == '>') {
    return FailedPreconditionError(
        fmt::format("{}: big-endian data ({}) is not read", path, json::Quote(name)));
  }
  return FailedPreconditionError(
      fmt::format("{}: data type {} is not one reshard holds", path, json::Quote(name)));
}

bool IsZeroFill(const Json& j) {
  if (j.is_null()) return true;
  if (j.is_boolean()) return !j.get<bool>();
  if (j.is_number()) return j.get<double>() == 0.0 && !std::signbit(j.get<double>());
  return false;
}

Result<Shape> ReadShape(const Json& object, std::string_view path, std::string_view key,
                        Index min) {
  RESHARD_ASSIGN_OR_RETURN(const Json* j, json::Require(object, path, key));
  return json::ReadIntArray(*j, json::Member(path, key), min);
}

// The codec chain of one chunk: "bytes" (little-endian), then "zstd" or nothing.
Status ReadInnerCodecs(const Json& codecs, std::string_view path, ZarrArray& a) {
  if (!codecs.is_array() || codecs.empty())
    return json::TypeError(path, "an array of codecs", codecs);
  for (size_t i = 0; i < codecs.size(); ++i) {
    const std::string at = json::Element(path, i);
    RESHARD_ASSIGN_OR_RETURN(const Json* name_j, json::Require(codecs[i], at, "name"));
    RESHARD_ASSIGN_OR_RETURN(const std::string name, json::ReadString(*name_j, at + ".name"));
    const Json* config = codecs[i].is_object() ? json::Find(codecs[i], "configuration") : nullptr;
    if (i == 0 && name == "bytes") {
      const Json* endian =
          config != nullptr && config->is_object() ? json::Find(*config, "endian") : nullptr;
      if (endian != nullptr && !(endian->is_string() && endian->get<std::string>() == "little")) {
        return FailedPreconditionError(fmt::format("{}: only little-endian data is read", at));
      }
    } else if (i == 1 && name == "zstd") {
      a.zstd = true;
    } else {
      return FailedPreconditionError(
          fmt::format("{}: codec {} is not read (reshard reads \"bytes\" then optionally \"zstd\")",
                      at, json::Quote(name)));
    }
  }
  return Status::Ok();
}

Status ReadShardingCodec(const Json& codec, std::string_view path, ZarrArray& a) {
  RESHARD_ASSIGN_OR_RETURN(const Json* config, json::Require(codec, path, "configuration"));
  const std::string cpath = json::Member(path, "configuration");
  if (!config->is_object()) return json::TypeError(cpath, "an object", *config);
  RESHARD_ASSIGN_OR_RETURN(a.inner_shape, ReadShape(*config, cpath, "chunk_shape", 1));
  if (a.inner_shape.size() != a.shape.size()) {
    return json::ErrorAt(cpath, "the inner chunk shape's rank is not the array's");
  }
  for (size_t d = 0; d < a.shape.size(); ++d) {
    if (a.chunk_shape[d] % a.inner_shape[d] != 0) {
      return json::ErrorAt(cpath, "the inner chunks do not divide the chunk");
    }
  }
  RESHARD_ASSIGN_OR_RETURN(const Json* codecs, json::Require(*config, cpath, "codecs"));
  RESHARD_RETURN_IF_ERROR(ReadInnerCodecs(*codecs, json::Member(cpath, "codecs"), a));
  if (const Json* loc = json::Find(*config, "index_location"); loc != nullptr) {
    RESHARD_ASSIGN_OR_RETURN(const std::string where,
                             json::ReadString(*loc, json::Member(cpath, "index_location")));
    if (where != "start" && where != "end") {
      return json::ErrorAt(json::Member(cpath, "index_location"), "expected \"start\" or \"end\"");
    }
    a.index_at_start = where == "start";
  }
  if (const Json* index = json::Find(*config, "index_codecs"); index != nullptr) {
    const std::string ipath = json::Member(cpath, "index_codecs");
    if (!index->is_array()) return json::TypeError(ipath, "an array", *index);
    for (size_t i = 0; i < index->size(); ++i) {
      const Json* name = (*index)[i].is_object() ? json::Find((*index)[i], "name") : nullptr;
      const std::string n = name != nullptr && name->is_string() ? name->get<std::string>() : "";
      if (n == "crc32c" && i + 1 == index->size()) {
        a.index_crc32c = true;
      } else if (n != "bytes" || i != 0) {
        return FailedPreconditionError(
            fmt::format("{}: index codec {} is not read", json::Element(ipath, i), json::Quote(n)));
      }
    }
  }
  a.sharded = true;
  return Status::Ok();
}

Status ReadV3(const Json& j, ZarrArray& a) {
  RESHARD_ASSIGN_OR_RETURN(const Json* dt, json::Require(j, "", "data_type"));
  RESHARD_ASSIGN_OR_RETURN(a.dtype, ParseDtype(*dt, 3, "data_type"));
  RESHARD_ASSIGN_OR_RETURN(const Json* grid, json::Require(j, "", "chunk_grid"));
  if (!grid->is_object()) return json::TypeError("chunk_grid", "an object", *grid);
  const Json* gname = json::Find(*grid, "name");
  if (gname == nullptr || !gname->is_string() || gname->get<std::string>() != "regular") {
    return FailedPreconditionError("chunk_grid: only a \"regular\" chunk grid is read");
  }
  RESHARD_ASSIGN_OR_RETURN(const Json* gconfig,
                           json::Require(*grid, "chunk_grid", "configuration"));
  if (!gconfig->is_object())
    return json::TypeError("chunk_grid.configuration", "an object", *gconfig);
  RESHARD_ASSIGN_OR_RETURN(a.chunk_shape,
                           ReadShape(*gconfig, "chunk_grid.configuration", "chunk_shape", 1));
  a.key_prefix.assign(1, 'c');
  a.separator = '/';
  if (const Json* enc = json::Find(j, "chunk_key_encoding"); enc != nullptr && enc->is_object()) {
    const Json* name = json::Find(*enc, "name");
    const std::string n = name != nullptr && name->is_string() ? name->get<std::string>() : "";
    if (n == "v2") {
      a.key_prefix.clear();
      a.separator = '.';
    } else if (n != "default") {
      return FailedPreconditionError(
          fmt::format("chunk_key_encoding: {} is not read", json::Quote(n)));
    }
    const Json* config = json::Find(*enc, "configuration");
    const Json* sep =
        config != nullptr && config->is_object() ? json::Find(*config, "separator") : nullptr;
    if (sep != nullptr) {
      RESHARD_ASSIGN_OR_RETURN(
          const std::string s,
          json::ReadString(*sep, "chunk_key_encoding.configuration.separator"));
      if (s != "/" && s != ".") {
        return json::ErrorAt("chunk_key_encoding.configuration.separator",
                             "expected \"/\" or \".\"");
      }
      a.separator = s[0];
    }
  }
  if (a.chunk_shape.size() != a.shape.size()) {
    return json::ErrorAt("chunk_grid", "the chunk shape's rank is not the array's");
  }
  a.inner_shape = a.chunk_shape;
  RESHARD_ASSIGN_OR_RETURN(const Json* codecs, json::Require(j, "", "codecs"));
  if (codecs->is_array() && codecs->size() == 1 && (*codecs)[0].is_object() &&
      json::Find((*codecs)[0], "name") != nullptr &&
      *json::Find((*codecs)[0], "name") == "sharding_indexed") {
    return ReadShardingCodec((*codecs)[0], "codecs[0]", a);
  }
  return ReadInnerCodecs(*codecs, "codecs", a);
}

Status ReadV2(const Json& j, ZarrArray& a) {
  RESHARD_ASSIGN_OR_RETURN(const Json* dt, json::Require(j, "", "dtype"));
  RESHARD_ASSIGN_OR_RETURN(a.dtype, ParseDtype(*dt, 2, "dtype"));
  RESHARD_ASSIGN_OR_RETURN(a.chunk_shape, ReadShape(j, "", "chunks", 1));
  if (a.chunk_shape.size() != a.shape.size()) {
    return json::ErrorAt("chunks", "the chunk shape's rank is not the array's");
  }
  a.inner_shape = a.chunk_shape;
  if (const Json* order = json::Find(j, "order"); order != nullptr && *order != "C") {
    return FailedPreconditionError("order: only C order is read");
  }
  if (const Json* f = json::Find(j, "filters"); f != nullptr && !f->is_null() && !f->empty()) {
    return FailedPreconditionError("filters: filters are not read");
  }
  if (const Json* c = json::Find(j, "compressor"); c != nullptr && !c->is_null()) {
    const Json* id = c->is_object() ? json::Find(*c, "id") : nullptr;
    if (id == nullptr || *id != "zstd") {
      return FailedPreconditionError(fmt::format(
          "compressor: {} is not read (reshard reads zstd and uncompressed chunks)", c->dump()));
    }
    a.zstd = true;
  }
  if (const Json* sep = json::Find(j, "dimension_separator"); sep != nullptr) {
    RESHARD_ASSIGN_OR_RETURN(const std::string s, json::ReadString(*sep, "dimension_separator"));
    if (s != "/" && s != ".")
      return json::ErrorAt("dimension_separator", "expected \"/\" or \".\"");
    a.separator = s[0];
  }
  return Status::Ok();
}

// Inflates one zstd-compressed inner chunk to exactly `out.size()` bytes.
Status InflateExactly(std::span<const std::byte> in, std::string_view what,
                      std::span<std::byte> out) {
  const size_t got = ZSTD_decompress(out.data(), out.size(), in.data(), in.size());
  if (ZSTD_isError(got)) {
    return DataLossError(
        fmt::format("{}: its zstd stream is corrupt or decodes to more than {} "
                    "bytes ({})",
                    what, out.size(), ZSTD_getErrorName(got)));
  }
  if (got != out.size()) {
    return DataLossError(
        fmt::format("{}: its zstd stream decodes to {} bytes, expected {}", what, got, out.size()));
  }
  return Status::Ok();
}

Status DecodeInner(const ZarrArray& a, std::span<const std::byte> in, std::string_view what,
                   std::span<std::byte> out) {
  if (a.zstd) return InflateExactly(in, what, out);
  if (in.size() != out.size()) {
    return DataLossError(
        fmt::format("{}: {} bytes stored, expected {}", what, in.size(), out.size()));
  }
  std::memcpy(out.data(), in.data(), in.size());
  return Status::Ok();
}

// Row-major index `flat` of a grid of `counts` as indices.
Shape Unflatten(Index flat, const Shape& counts) {
  Shape idx(counts.size(), 0);
  for (size_t d = counts.size(); d-- > 0;) {
    idx[d] = flat % counts[d];
    flat /= counts[d];
  }
  return idx;
}

Status DecodeShard(const ZarrArray& a, std::span<const std::byte> stored, std::string_view what,
                   std::span<std::byte> out) {
  const size_t esize = DTypeSize(a.dtype);
  Shape counts(a.shape.size());
  for (size_t d = 0; d < counts.size(); ++d) counts[d] = a.chunk_shape[d] / a.inner_shape[d];
  const auto n = static_cast<uint64_t>(ProductOf(counts));
  const uint64_t index_bytes = n * 16 + (a.index_crc32c ? 4 : 0);
  if (stored.size() < index_bytes) {
    return DataLossError(fmt::format("{}: {} bytes, too short for an index of {} inner chunks",
                                     what, stored.size(), n));
  }
  const auto index = a.index_at_start ? stored.first(index_bytes) : stored.last(index_bytes);
  if (a.index_crc32c) {
    uint32_t want = 0;
    for (int i = 3; i >= 0; --i) want = (want << 8) | static_cast<uint8_t>(index[n * 16 + i]);
    if (Crc32c(index.first(n * 16)) != want) {
      return DataLossError(fmt::format("{}: its shard index fails its CRC-32C", what));
    }
  }
  const size_t inner_bytes = static_cast<size_t>(ProductOf(a.inner_shape)) * esize;
  std::vector<std::byte> inner(inner_bytes);
  const Shape origin(a.shape.size(), 0);
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t offset = 0, length = 0;
    for (int b = 7; b >= 0; --b) offset = (offset << 8) | static_cast<uint8_t>(index[i * 16 + b]);
    for (int b = 7; b >= 0; --b)
      length = (length << 8) | static_cast<uint8_t>(index[i * 16 + 8 + b]);
    const std::string inner_what = fmt::format("{}: inner chunk {}", what, i);
    if (offset == ~uint64_t{0} && length == ~uint64_t{0}) {
      if (!a.zero_fill) {
        return FailedPreconditionError(fmt::format(
            "{}: not stored, and the array's fill value {} is not zero", inner_what, a.fill_text));
      }
      std::fill(inner.begin(), inner.end(), std::byte{0});
    } else if (offset > stored.size() || length > stored.size() - offset) {
      return DataLossError(fmt::format("{}: bytes [{}, {}) of a shard of {}", inner_what, offset,
                                       offset + length, stored.size()));
    } else {
      RESHARD_RETURN_IF_ERROR(DecodeInner(a, stored.subspan(offset, length), inner_what, inner));
    }
    Shape at = Unflatten(static_cast<Index>(i), counts);
    for (size_t d = 0; d < at.size(); ++d) at[d] *= a.inner_shape[d];
    CopyChunkIntoBox(at, a.inner_shape, inner, origin, a.chunk_shape, esize, out);
  }
  return Status::Ok();
}

}  // namespace

Result<ZarrArray> ParseZarrMetadata(std::string_view text, std::string_view what) {
  const auto annotate = [&](const Status& s) { return s.Annotate(what); };
  Result<Json> parsed = json::ParseJson(text);
  if (!parsed.ok()) return annotate(parsed.status());
  const Json& j = *parsed;
  if (!j.is_object()) return annotate(json::TypeError("", "an object", j));
  ZarrArray a;
  Result<const Json*> format = json::Require(j, "", "zarr_format");
  if (!format.ok()) return annotate(format.status());
  Result<Index> f = json::ReadInt(**format, "zarr_format", json::IntRange{2, 3});
  if (!f.ok()) return annotate(f.status());
  a.zarr_format = static_cast<int>(*f);
  Result<Shape> shape = ReadShape(j, "", "shape", 0);
  if (!shape.ok()) return annotate(shape.status());
  a.shape = *std::move(shape);
  if (a.shape.size() > 32) return annotate(json::ErrorAt("shape", "more than 32 dimensions"));
  Status s = a.zarr_format == 3 ? ReadV3(j, a) : ReadV2(j, a);
  if (!s.ok()) return annotate(s);
  const Json* fill = json::Find(j, "fill_value");
  a.zero_fill = fill == nullptr || IsZeroFill(*fill);
  a.fill_text = fill == nullptr ? "null" : fill->dump();
  // Every count in range of the checked index arithmetic.
  Shape extents = a.chunk_shape;
  extents.push_back(static_cast<Index>(DTypeSize(a.dtype)));
  if (!CheckedProduct(extents).ok() || !CheckedProduct(a.shape).ok()) {
    return annotate(json::ErrorAt("shape", "too many elements"));
  }
  return a;
}

std::string ZarrV2DtypeName(DType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype == dtype) return std::string(d.v2);
  }
  return std::string(DTypeName(dtype));
}

std::string ZarrV3DtypeName(DType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype == dtype) return std::string(d.v3);
  }
  return std::string(DTypeName(dtype));
}

std::string ZarrMetadataText(int zarr_format, DType dtype, const Shape& shape,
                             const Shape& chunk_shape) {
  using Ordered = nlohmann::ordered_json;
  if (zarr_format == 2) {
    return Ordered({{"chunks", chunk_shape},
                    {"compressor", {{"id", "zstd"}, {"level", 1}}},
                    {"dimension_separator", "."},
                    {"dtype", ZarrV2DtypeName(dtype)},
                    {"fill_value", nullptr},
                    {"filters", nullptr},
                    {"order", "C"},
                    {"shape", shape},
                    {"zarr_format", 2}})
        .dump();
  }
  // tensorstore names no byte order for one-byte types.
  const Ordered bytes = DTypeSize(dtype) == 1
                            ? Ordered{{"name", "bytes"}}
                            : Ordered{{"configuration", {{"endian", "little"}}}, {"name", "bytes"}};
  const Ordered zstd = {{"configuration", {{"checksum", false}, {"level", 1}}}, {"name", "zstd"}};
  const Ordered index =
      Ordered::array({Ordered{{"configuration", {{"endian", "little"}}}, {"name", "bytes"}},
                      Ordered{{"name", "crc32c"}}});
  const Ordered sharding = {{"configuration",
                             {{"chunk_shape", chunk_shape},
                              {"codecs", Ordered::array({bytes, zstd})},
                              {"index_codecs", index}}},
                            {"name", "sharding_indexed"}};
  Ordered fill = 0;
  if (DTypeKindOf(dtype) == DTypeKind::kBool) fill = false;
  if (DTypeKindOf(dtype) == DTypeKind::kFloat || DTypeKindOf(dtype) == DTypeKind::kFloat8) {
    fill = 0.0;
  }
  return Ordered({{"chunk_grid",
                   {{"configuration", {{"chunk_shape", chunk_shape}}}, {"name", "regular"}}},
                  {"chunk_key_encoding", {{"name", "default"}}},
                  {"codecs", Ordered::array({sharding})},
                  {"data_type", ZarrV3DtypeName(dtype)},
                  {"fill_value", fill},
                  {"node_type", "array"},
                  {"shape", shape},
                  {"zarr_format", 3}})
      .dump();
}

ZarrArray ZarrKeysOf(int zarr_format) {
  ZarrArray a;
  a.zarr_format = zarr_format;
  if (zarr_format == 3) {
    a.key_prefix.push_back('c');
    a.separator = '/';
  }
  return a;
}

Status EncodeZarrChunk(int zarr_format, std::span<const std::byte> elements, std::string& out) {
  out.resize(ZSTD_compressBound(elements.size()) + 20);
  const size_t n = ZSTD_compress(out.data(), out.size(), elements.data(), elements.size(), 1);
  if (ZSTD_isError(n)) return InternalError(fmt::format("zstd: {}", ZSTD_getErrorName(n)));
  out.resize(n);
  if (zarr_format == 3) {
    std::string index;
    for (const uint64_t v : {uint64_t{0}, uint64_t{n}}) {
      for (int i = 0; i < 8; ++i) index += static_cast<char>((v >> (8 * i)) & 0xff);
    }
    const uint32_t crc = Crc32c(std::as_bytes(std::span(index.data(), index.size())));
    for (int i = 0; i < 4; ++i) index += static_cast<char>((crc >> (8 * i)) & 0xff);
    out += index;
  }
  return Status::Ok();
}

std::string ZarrChunkKey(const ZarrArray& a, std::span<const Index> grid) {
  std::string key = a.key_prefix;
  if (grid.empty()) return key.empty() ? "0" : key;
  for (size_t d = 0; d < grid.size(); ++d) {
    if (!key.empty()) key += a.separator;
    key += std::to_string(grid[d]);
  }
  return key;
}

Shape ZarrChunkGrid(const ZarrArray& a) {
  Shape g(a.shape.size());
  for (size_t d = 0; d < g.size(); ++d) {
    g[d] = (a.shape[d] + a.chunk_shape[d] - 1) / a.chunk_shape[d];
  }
  return g;
}

Status DecodeZarrChunk(const ZarrArray& a, std::span<const std::byte> stored, bool missing,
                       std::string_view what, std::vector<std::byte>& out) {
  const size_t bytes = static_cast<size_t>(ProductOf(a.chunk_shape)) * DTypeSize(a.dtype);
  // What the stored bytes can hold, checked before the chunk's claimed size is allocated: a
  // raw chunk is exactly its bytes; a zstd frame yields at most 128 KiB per block of at least
  // 3 bytes.
  if (!missing && !a.sharded) {
    const uint64_t most = a.zstd ? (stored.size() / 3 + 1) * (uint64_t{128} << 10) : stored.size();
    if ((a.zstd && bytes > most) || (!a.zstd && bytes != most)) {
      return DataLossError(fmt::format("{}: {} bytes stored cannot hold a chunk of {} bytes", what,
                                       stored.size(), bytes));
    }
  }
  try {
    out.assign(bytes, std::byte{0});
  } catch (const std::bad_alloc&) {
    return DataLossError(fmt::format(
        "{}: a chunk of {} bytes is more memory than this process can have", what, bytes));
  }
  if (missing) {
    if (!a.zero_fill) {
      return FailedPreconditionError(fmt::format(
          "{}: not stored, and the array's fill value {} is not zero", what, a.fill_text));
    }
    return Status::Ok();
  }
  if (a.sharded) return DecodeShard(a, stored, what, out);
  return DecodeInner(a, stored, what, out);
}

void CopyChunkIntoBox(const Shape& chunk_origin, const Shape& chunk_shape,
                      std::span<const std::byte> chunk, const Shape& box_offsets,
                      const Shape& box_sizes, size_t element_size, std::span<std::byte> box) {
  const size_t rank = chunk_shape.size();
  Shape lo(rank), hi(rank);
  for (size_t d = 0; d < rank; ++d) {
    lo[d] = std::max(chunk_origin[d], box_offsets[d]);
    hi[d] = std::min(chunk_origin[d] + chunk_shape[d], box_offsets[d] + box_sizes[d]);
    if (lo[d] >= hi[d]) return;
  }
  if (rank == 0) {
    std::memcpy(box.data(), chunk.data(), element_size);
    return;
  }
  // Row-major strides (elements) of the chunk and the box.
  Shape cs(rank, 1), bs(rank, 1);
  for (size_t d = rank - 1; d-- > 0;) {
    cs[d] = cs[d + 1] * chunk_shape[d + 1];
    bs[d] = bs[d + 1] * box_sizes[d + 1];
  }
  const size_t run = static_cast<size_t>(hi[rank - 1] - lo[rank - 1]) * element_size;
  Shape at = lo;
  while (true) {
    Index c = 0, b = 0;
    for (size_t d = 0; d < rank; ++d) {
      c += (at[d] - chunk_origin[d]) * cs[d];
      b += (at[d] - box_offsets[d]) * bs[d];
    }
    std::memcpy(box.data() + static_cast<size_t>(b) * element_size,
                chunk.data() + static_cast<size_t>(c) * element_size, run);
    size_t d = rank - 1;
    while (d-- > 0) {
      if (++at[d] < hi[d]) break;
      at[d] = lo[d];
    }
    if (d == static_cast<size_t>(-1)) return;
  }
}

}  // namespace reshard
