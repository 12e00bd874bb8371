// Fuzz target for the .pt reader (io/torch_file.h) over whole files: zip, pickle and the
// tensors built from them.
//
// Reading must return a Status, never crash, hang or read out of bounds. When it reads, every
// tensor must be a view inside its storage of at most 2^62 bytes, naming the tensors must have
// walked no more objects than the bound (shared objects are not expanded without limit), and
// copying every tensor out (which touches every byte the view reaches) must succeed; a
// violation aborts. Seeds include a DAG of memo-shared tuples 60 deep and stride-0 views.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "reshard/io/torch_file.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "torch_file_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  reshard::PickleOptions options;
  options.limits.max_nodes = 1 << 16;
  reshard::Result<reshard::TorchFile> file = reshard::TorchFile::Parse(bytes, options);
  if (!file.ok()) {
    const reshard::StatusCode code = file.status().code();
    Require(code != reshard::StatusCode::kInternal && code != reshard::StatusCode::kOk,
            "unexpected refusal code", file.status().ToString());
    return 0;
  }
  for (const reshard::TorchStorage& s : file->storages()) {
    Require(
        s.bytes.data() >= bytes.data() && s.bytes.data() + s.bytes.size() <= bytes.data() + size,
        "storage outside the file", s.key);
  }
  Require(file->objects_walked() <= options.limits.max_expanded, "walk past max_expanded",
          std::to_string(file->objects_walked()));
  for (const reshard::TorchTensor& t : file->tensors()) {
    Require(t.storage < file->storages().size(), "storage index out of range", t.name);
    Require(t.num_bytes() <= (uint64_t{1} << 62), "view of more than 2^62 bytes", t.name);
    // Keep the copies small: a zero-stride view of a tiny storage may name many elements.
    if (t.num_bytes() > (1u << 20)) continue;
    std::vector<std::byte> out(t.num_bytes());
    const reshard::Status s = file->CopyTo(t, out);
    Require(s.ok(), "copying an accepted tensor failed", t.name + ": " + s.ToString());
  }
  return 0;
}
