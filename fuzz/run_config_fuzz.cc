// Fuzz target for the reader of Megatron-Bridge's run_config.yaml (checkpoint/megatron/
// run_config.h): the input is the file's text. Reading must give the PEFT section or a refusal
// (InvalidArgument), never crash, hang or read out of bounds; a section given has a positive
// rank and a positive, finite alpha. A violation aborts.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "reshard/checkpoint/megatron/run_config.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "run_config_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto peft = reshard::ParseMegatronPeftConfig(text, "fuzz");
  if (!peft.ok()) {
    Require(peft.status().code() == reshard::StatusCode::kInvalidArgument,
            "unexpected refusal code", peft.status().ToString());
    return 0;
  }
  Require(peft->dim > 0, "a rank that is not positive", std::to_string(peft->dim));
  Require(std::isfinite(peft->alpha) && peft->alpha > 0, "an alpha that is not positive",
          std::to_string(peft->alpha));
  return 0;
}
