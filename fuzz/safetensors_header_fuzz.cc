// Fuzz target for the safetensors header parser (io/safetensors.h).
//
// The input is a whole file. Parsing must return a Status, never crash, hang or read out of
// bounds. When it parses, the header must describe a file that can be read safely: tensors in
// data order, tiling the data section from 0 with no gap or overlap, each as large as its
// shape says, the data section ending exactly at the end of the file; a violation aborts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <span>
#include <string>

#include "reshard/io/safetensors.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "safetensors_header_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  reshard::Result<reshard::SafetensorsHeader> header = reshard::ParseSafetensorsHeader(file, size);
  if (!header.ok()) {
    Require(header.status().code() == reshard::StatusCode::kDataLoss, "refusal is not DataLoss",
            header.status().ToString());
    return 0;
  }
  Require(header->data_offset >= 8 && header->data_offset <= size, "data offset outside file",
          std::to_string(header->data_offset));
  Require(header->data_offset + header->data_size == size, "data section does not end the file",
          std::to_string(header->data_size));
  uint64_t end = 0;
  std::set<std::string> names;
  for (const reshard::TensorInfo& t : header->tensors) {
    Require(t.data_begin == end, "tensors not contiguous and sorted", t.name);
    Require(t.data_end >= t.data_begin, "tensor ends before it begins", t.name);
    reshard::Result<reshard::Index> numel = reshard::CheckedProduct(t.shape);
    Require(numel.ok(), "accepted shape overflows", t.name);
    Require(static_cast<uint64_t>(*numel) * reshard::DTypeSize(t.dtype) == t.num_bytes(),
            "size disagrees with shape", t.name);
    Require(names.insert(t.name).second, "duplicate name accepted", t.name);
    Require(header->Find(t.name) == &t, "Find does not find the tensor", t.name);
    end = t.data_end;
  }
  Require(end == header->data_size, "data size is not the last tensor's end", std::to_string(end));
  return 0;
}
