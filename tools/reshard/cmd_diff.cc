// reshard diff A B [--json] [--atol X] [--rtol Y] [--dequantize [--dtype D]]: two checkpoints
// compared tensor by tensor without building full tensors (logic in checkpoint/diff.h).
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "commands.h"
#include "exit_status.h"
#include "reshard/checkpoint/diff.h"
#include "reshard/checkpoint/formats/formats.h"
#include "reshard/exec/dequantize.h"

namespace reshard::cli {

namespace {

struct DiffArgs {
  std::string a;
  std::string b;
  bool json = false;
  std::optional<double> atol;
  std::optional<double> rtol;
  bool dequantize = false;
  std::string dtype = "bf16";
  std::string config;
};

nlohmann::ordered_json DifferenceJson(const TensorDifference& d) {
  nlohmann::ordered_json j = {{"name", d.name}, {"kind", DiffKindName(d.kind)}};
  j["dtype_a"] = d.dtype_a ? nlohmann::ordered_json(DTypeName(*d.dtype_a)) : nullptr;
  j["dtype_b"] = d.dtype_b ? nlohmann::ordered_json(DTypeName(*d.dtype_b)) : nullptr;
  j["shape_a"] = d.shape_a ? nlohmann::ordered_json(*d.shape_a) : nullptr;
  j["shape_b"] = d.shape_b ? nlohmann::ordered_json(*d.shape_b) : nullptr;
  if (d.kind == DiffKind::kValue) {
    j["index"] = d.index;
    j["multi_index"] = d.multi_index;
    j["value_a"] = d.value_a;
    j["value_b"] = d.value_b;
  }
  return j;
}

Status RunDiff(const DiffArgs& args) {
  std::optional<DequantizeOptions> dequantize;
  if (args.dequantize) {
    const std::optional<DType> d = DequantizedDTypeFromName(args.dtype);
    if (!d) {
      return InvalidArgumentError(
          fmt::format("--dtype {}: expected bf16, fp16 or fp32", args.dtype));
    }
    dequantize = DequantizeOptions{*d, {}};
  }
  DiffOptions options;
  options.atol = args.atol;
  options.rtol = args.rtol;
  Result<DiffReport> report = DiffCheckpoints(args.a, args.b, dequantize, options, args.config);
  if (!report.ok()) {
    // Exit 1 means "they differ": an input that cannot be read as a checkpoint (a map that
    // does not fit its tensor included) is a malformed input, exit 2.
    const Status& s = report.status();
    if (s.code() == StatusCode::kFailedPrecondition) return InvalidArgumentError(s.message());
    return s;
  }
  if (args.json) {
    nlohmann::ordered_json differences = nlohmann::ordered_json::array();
    for (const TensorDifference& d : report->differences) differences.push_back(DifferenceJson(d));
    nlohmann::ordered_json out = {
        {"a", args.a},
        {"b", args.b},
        {"equal", report->equal()},
        {"tensors_compared", report->tensors_compared},
        {"elements_compared", report->elements_compared},
        {"atol", args.atol ? nlohmann::ordered_json(*args.atol) : nullptr},
        {"rtol", args.rtol ? nlohmann::ordered_json(*args.rtol) : nullptr},
        {"differences", std::move(differences)}};
    fmt::print("{}\n", out.dump(2));
  } else {
    fmt::print("{}", DiffReportText(*report));
  }
  return report->equal() ? Status::Ok() : AlreadyReportedCheckFailure();
}

// A tolerance: a finite number >= 0 (the message says so in those words).
CLI::Validator Tolerance() {
  return {[](const std::string& text) -> std::string {
            char* end = nullptr;
            const double v = std::strtod(text.c_str(), &end);
            if (end == text.c_str() || *end != '\0' || !std::isfinite(v) || v < 0)
              return "a tolerance is a finite number >= 0, not " + text;
            return "";
          },
          "TOLERANCE"};
}

void AddDiffOptions(CLI::App* cmd, DiffArgs* args) {
  cmd->add_option("A", args->a, "a checkpoint (any format reshard reads)")->required();
  cmd->add_option("B", args->b, "the checkpoint to compare it with (any format, any layout)")
      ->required();
  AddJsonFlag(cmd, args->json, "print a machine-readable report on stdout");
  cmd->add_option("--atol", args->atol,
                  "compare values, not bits: elements agree when |a - b| <= atol + rtol * |b| "
                  "(tensors of different dtypes are then compared by value)")
      ->check(Tolerance());
  cmd->add_option("--rtol", args->rtol, "relative tolerance (see --atol)")->check(Tolerance());
  auto dequantize = cmd->add_flag(
      "--dequantize", args->dequantize,
      "read block-quantized tensors (FP8 with block scales, MXFP4) of either side as numbers, "
      "as gather --dequantize writes them; a side without any is read as it is");
  cmd->add_option("--dtype", args->dtype, "with --dequantize: bf16 (default), fp16 or fp32")
      ->needs(dequantize);
  cmd->add_option("--config", args->config,
                  "a model's config.json, for a side that needs one to name and split its "
                  "tensors (a Megatron-Core dist-ckpt)")
      ->check(CLI::ExistingFile);
}

}  // namespace

CommandBody DiffCommand() { return {AddDiffOptions, RunDiff}; }

}  // namespace reshard::cli
