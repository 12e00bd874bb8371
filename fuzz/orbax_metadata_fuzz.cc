// Fuzz target for the Orbax storage parsers (checkpoint/orbax/ocdbt.h, zarr.h).
//
// The first byte picks the parser, the rest is its input:
//   0  an OCDBT manifest (ParseOcdbtManifest)
//   1  an OCDBT B+tree node (ParseOcdbtNode)
//   2  zarr metadata, `.zarray` or `zarr.json` (ParseZarrMetadata)
//   3  zarr metadata and a stored chunk: a little-endian uint16 length, that many bytes of
//      metadata, then the chunk (DecodeZarrChunk), for chunks of at most 1 MiB
// Parsing must return a Status, never crash, hang or read out of bounds; a node's values must
// name files of its table, and a decoded chunk must have its chunk shape's bytes. A violation
// aborts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/checkpoint/orbax/ocdbt.h"
#include "reshard/checkpoint/orbax/zarr.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "orbax_metadata_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

bool Refusal(reshard::StatusCode code) {
  return code == reshard::StatusCode::kDataLoss || code == reshard::StatusCode::kInvalidArgument ||
         code == reshard::StatusCode::kFailedPrecondition ||
         code == reshard::StatusCode::kResourceExhausted;
}

void Check(const reshard::Status& s) {
  if (!s.ok()) Require(Refusal(s.code()), "unexpected refusal code", s.ToString());
}

void Zarr(std::string_view meta, std::span<const std::byte> chunk, bool decode) {
  const auto a = reshard::ParseZarrMetadata(meta, "fuzz");
  if (!a.ok()) return Check(a.status());
  if (!decode) return;
  const auto bytes = reshard::ProductOf(a->chunk_shape) *
                     static_cast<reshard::Index>(reshard::DTypeSize(a->dtype));
  if (bytes > (reshard::Index{1} << 20)) return;
  std::vector<std::byte> out;
  const reshard::Status s = reshard::DecodeZarrChunk(*a, chunk, chunk.empty(), "fuzz", out);
  if (!s.ok()) return Check(s);
  Require(static_cast<reshard::Index>(out.size()) == bytes, "decoded chunk of the wrong size",
          std::to_string(out.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::span<const std::byte> all(reinterpret_cast<const std::byte*>(data), size);
  const auto rest = all.subspan(1);
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: {
      const auto root = reshard::ParseOcdbtManifest(rest, "fuzz");
      if (!root.ok()) Check(root.status());
      break;
    }
    case 1: {
      const auto node = reshard::ParseOcdbtNode(rest, "", "fuzz");
      if (!node.ok()) return Check(node.status()), 0;
      for (const auto& [key, value] : node->values) {
        Require(value.is_inline || value.file < node->files.size(), "value names no file", key);
      }
      for (const auto& child : node->children) {
        Require(child.file < node->files.size(), "child names no file", child.key);
        Require(child.prefix_length <= child.key.size(), "prefix past its key", child.key);
      }
      break;
    }
    case 2:
      Zarr(text, {}, false);
      break;
    default: {
      if (rest.size() < 2) return 0;
      const size_t n = static_cast<size_t>(data[1]) | (static_cast<size_t>(data[2]) << 8);
      if (n > rest.size() - 2) return 0;
      Zarr(std::string_view(reinterpret_cast<const char*>(data) + 3, n), rest.subspan(2 + n), true);
      break;
    }
  }
  return 0;
}
