// Fuzz target for DCP's `.metadata` reader (checkpoint/dcp/dcp.h).
//
// The input is a whole `.metadata` pickle. Reading must return a Status, never crash, hang or
// read out of bounds. When it reads, every item must name one of the files it lists, and each
// tensor's chunks, turned into a map (ChunksToMap), must either be refused with InvalidArgument
// or make a valid map whose shards hold exactly the tensor's elements. A violation aborts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>

#include "reshard/checkpoint/dcp/dcp.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "dcp_metadata_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

bool Refusal(reshard::StatusCode code) {
  return code == reshard::StatusCode::kDataLoss || code == reshard::StatusCode::kInvalidArgument ||
         code == reshard::StatusCode::kUnimplemented ||
         code == reshard::StatusCode::kResourceExhausted;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const auto md = reshard::ParseDcpMetadata(bytes, "fuzz.metadata");
  if (!md.ok()) {
    Require(Refusal(md.status().code()), "unexpected refusal code", md.status().ToString());
    return 0;
  }
  reshard::Rank high = 0;
  for (const reshard::DcpTensor& t : md->tensors) {
    for (const reshard::DcpChunk& c : t.chunks) {
      Require(c.location.file < md->files.size(), "chunk names no listed file", t.fqn);
      Require(c.rank >= 0, "negative rank", t.fqn);
      high = std::max(high, c.rank);
    }
  }
  for (const reshard::DcpBytesItem& b : md->bytes_items) {
    Require(b.location.file < md->files.size(), "bytes item names no listed file", b.fqn);
  }
  if (high >= 64) return 0;  // maps of many ranks cost more than they test
  for (const reshard::DcpTensor& t : md->tensors) {
    const auto map = reshard::ChunksToMap(t.fqn, t.shape, t.chunks, high + 1);
    if (!map.ok()) {
      Require(map.status().code() == reshard::StatusCode::kInvalidArgument ||
                  map.status().code() == reshard::StatusCode::kResourceExhausted,
              "unexpected geometry refusal", map.status().ToString());
      continue;
    }
    reshard::Index held = 0;
    for (reshard::Rank r = 0; r < map->world_size(); ++r) held += map->shard_num_elements(r);
    Require(held == map->num_elements(), "shards do not hold the tensor exactly once", t.fqn);
  }
  return 0;
}
