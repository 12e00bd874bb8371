// Fuzz target for the zip reader (io/zip.h).
//
// The input is a whole archive. Parsing must return a Status, never crash, hang or read out of
// bounds. When it parses, every entry's local header and data must lie inside the archive,
// before the central directory, without overlapping another entry, and names must be unique
// and found by Find; a violation aborts.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "reshard/io/zip.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "zip_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> archive(reinterpret_cast<const std::byte*>(data), size);
  reshard::Result<reshard::ZipArchive> zip = reshard::ZipArchive::Parse(archive);
  if (!zip.ok()) {
    const reshard::StatusCode code = zip.status().code();
    Require(code == reshard::StatusCode::kDataLoss || code == reshard::StatusCode::kUnimplemented,
            "refusal is neither DataLoss nor Unimplemented", zip.status().ToString());
    return 0;
  }
  std::vector<const reshard::ZipEntry*> entries;
  for (const reshard::ZipEntry& e : zip->entries()) {
    Require(e.data_offset >= e.header_offset + 30, "data before the end of its local header",
            e.name);
    Require(e.data_offset <= size && e.size <= size - e.data_offset, "data outside the archive",
            e.name);
    Require(zip->Find(e.name) == &e, "Find does not find the entry", e.name);
    const std::span<const std::byte> bytes = zip->data(e);
    Require(bytes.data() == archive.data() + e.data_offset, "data is not in place", e.name);
    (void)reshard::Crc32(bytes);  // reads every byte: out-of-bounds shows under ASan
    entries.push_back(&e);
  }
  std::sort(entries.begin(), entries.end(),
            [](auto* x, auto* y) { return x->header_offset < y->header_offset; });
  for (size_t i = 1; i < entries.size(); ++i) {
    Require(entries[i]->header_offset >= entries[i - 1]->data_offset + entries[i - 1]->size,
            "entries overlap", entries[i]->name);
  }
  return 0;
}
