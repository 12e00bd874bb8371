#include "reshard/checkpoint/merge_lora.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <vector>

#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/io/file.h"
#include "reshard/io/safetensors.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

bool Mergeable(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

// A float, bfloat16 or float16 element as float (exact).
float ElementAt(const TensorRef& t, size_t i) {
  const std::byte* p = t.data.data();
  if (t.info->dtype == DType::kF32) {
    float f = 0;
    std::memcpy(&f, p + i * 4, 4);
    return f;
  }
  uint16_t h = 0;
  std::memcpy(&h, p + i * 2, 2);
  return t.info->dtype == DType::kBF16 ? BFloat16ToFloat(h) : HalfToFloat(h);
}

// `f` rounded to `dtype` (nearest, ties to even), as float.
float Rounded(float f, DType dtype) {
  if (dtype == DType::kBF16) return BFloat16ToFloat(FloatToBFloat16(f));
  if (dtype == DType::kF16) return HalfToFloat(FloatToHalf(f));
  return f;
}

void Store(float f, DType dtype, std::byte* at) {
  if (dtype == DType::kF32) {
    std::memcpy(at, &f, 4);
  } else {
    const uint16_t h = dtype == DType::kBF16 ? FloatToBFloat16(f) : FloatToHalf(f);
    std::memcpy(at, &h, 2);
  }
}

// One targeted module: its A and B, and whether B @ A is the weight's transpose.
struct LoraPair {
  const TensorRef* a = nullptr;
  const TensorRef* b = nullptr;
  bool transposed = false;
};

// W + scaling * B @ A into `out`: W [rows, cols]; B @ A is [rows, cols], or [cols, rows] when
// transposed. As PEFT computes its merge on the CPU: each element of B @ A summed over r in
// float (fused multiply-adds), times the scaling in float, rounded to the adapter's dtype (PEFT
// casts 16-bit A and B up, and the product back), added to W in float and rounded to W's dtype.
Status MergeInto(const TensorRef& w, const LoraPair& lora, float scaling,
                 std::span<std::byte> out) {
  const DType dtype = w.info->dtype;
  const size_t size = DTypeSize(dtype);
  const Index r = lora.a->info->shape[0];
  const Index out_dim = lora.b->info->shape[0];
  const Index in_dim = lora.a->info->shape[1];
  std::vector<float> a(static_cast<size_t>(r * in_dim));
  for (size_t i = 0; i < a.size(); ++i) a[i] = ElementAt(*lora.a, i);
  std::vector<float> b_row(static_cast<size_t>(r));
  for (Index o = 0; o < out_dim; ++o) {
    for (Index k = 0; k < r; ++k) {
      b_row[static_cast<size_t>(k)] = ElementAt(*lora.b, static_cast<size_t>(o * r + k));
    }
    for (Index i = 0; i < in_dim; ++i) {
      float acc = 0;
      for (Index k = 0; k < r; ++k) {
        acc = std::fma(b_row[static_cast<size_t>(k)], a[static_cast<size_t>(k * in_dim + i)], acc);
      }
      const float delta = Rounded(acc * scaling, lora.b->info->dtype);
      const auto at = static_cast<size_t>(lora.transposed ? i * out_dim + o : o * in_dim + i);
      Store(ElementAt(w, at) + delta, dtype, out.data() + at * size);
    }
  }
  return Status::Ok();
}

// The adapter's pairs by base weight name and its whole copies of base weights, checked
// against the base.
Status PairAdapter(const LoraConfig& config, const FullCheckpoint& adapter,
                   const FullCheckpoint& base, std::map<std::string, LoraPair>& pairs,
                   std::map<std::string, const TensorRef*>& copies) {
  for (const TensorRef& t : adapter.tensors()) {
    const LoraTensorName n = *ParseLoraTensorName(t.info->name);  // checked by the caller
    const TensorRef* w = base.Find(n.base);
    if (w == nullptr) {
      return FailedPreconditionError(fmt::format(
          "adapter tensor \"{}\" targets \"{}\", which the base checkpoint does not hold",
          t.info->name, n.base));
    }
    if (n.part == LoraPart::kBaseCopy) {
      if (t.info->shape != w->info->shape || t.info->dtype != w->info->dtype) {
        return FailedPreconditionError(fmt::format(
            "adapter tensor \"{}\" ({} [{}]) is not of the shape and dtype of the base's \"{}\" "
            "({} [{}])",
            t.info->name, DTypeName(t.info->dtype), fmt::join(t.info->shape, ", "), n.base,
            DTypeName(w->info->dtype), fmt::join(w->info->shape, ", ")));
      }
      copies[n.base] = &t;
      continue;
    }
    LoraPair& pair = pairs[n.base];
    const bool is_a = n.part == LoraPart::kA || n.part == LoraPart::kEmbeddingA;
    (is_a ? pair.a : pair.b) = &t;
    pair.transposed =
        config.fan_in_fan_out || n.part == LoraPart::kEmbeddingA || n.part == LoraPart::kEmbeddingB;
  }
  for (const auto& [name, pair] : pairs) {
    const TensorRef& w = *base.Find(name);
    const Shape want = LoraBaseShape(
        pair.transposed && !config.fan_in_fan_out ? LoraPart::kEmbeddingA : LoraPart::kA,
        pair.a->info->shape, pair.b->info->shape, config.fan_in_fan_out);
    if (w.info->shape != want) {
      return FailedPreconditionError(fmt::format(
          "adapter tensors \"{}\" and \"{}\" make a [{}] update, but the base's \"{}\" is [{}]",
          pair.a->info->name, pair.b->info->name, fmt::join(want, ", "), name,
          fmt::join(w.info->shape, ", ")));
    }
    for (const TensorRef* t : {&w, pair.a, pair.b}) {
      if (!Mergeable(t->info->dtype)) {
        return FailedPreconditionError(
            fmt::format("\"{}\" is {}: merging takes float32, bfloat16 or float16 weights",
                        t->info->name, DTypeName(t->info->dtype)));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<MergeLoraReport> MergeLora(const std::string& base_dir, const std::string& adapter_dir,
                                  const std::string& out_dir, const CheckpointOptions& options) {
  if (!IsPeftAdapterDir(adapter_dir)) {
    return InvalidArgumentError(fmt::format("\"{}\" is not a PEFT adapter (no {} beside {})",
                                            adapter_dir, kAdapterConfigName, kAdapterWeightsName));
  }
  RESHARD_ASSIGN_OR_RETURN(const std::string text,
                           ReadFileToString((fs::path(adapter_dir) / kAdapterConfigName).string()));
  Result<LoraConfig> config = ParseLoraConfigJson(text);
  if (!config.ok()) return config.status().Annotate(fmt::format("\"{}\"", adapter_dir));
  RESHARD_ASSIGN_OR_RETURN(const FullCheckpoint adapter, FullCheckpoint::Open(adapter_dir));
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const TensorRef& t : adapter.tensors()) shapes.emplace_back(t.info->name, t.info->shape);
  RESHARD_RETURN_IF_ERROR(
      CheckLoraTensors(*config, shapes).Annotate(fmt::format("\"{}\"", adapter_dir)));
  RESHARD_ASSIGN_OR_RETURN(const FullCheckpoint base, FullCheckpoint::Open(base_dir));
  std::map<std::string, LoraPair> pairs;
  std::map<std::string, const TensorRef*> copies;
  RESHARD_RETURN_IF_ERROR(PairAdapter(*config, adapter, base, pairs, copies));
  std::vector<std::string> inputs = {base_dir, adapter_dir};
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out,
                           OutputDirectory::Create(out_dir, options.overwrite, inputs));
  const auto scaling = static_cast<float>(config->Scaling());
  MergeLoraReport report;
  std::vector<TensorToWrite> tensors;
  for (const TensorRef& t : base.tensors()) {
    const std::string& name = t.info->name;
    const auto pair = pairs.find(name);
    const auto copy = copies.find(name);
    const TensorRef* w = copy != copies.end() ? copy->second : &t;
    std::function<Status(std::span<std::byte>)> fill;
    if (pair != pairs.end()) {
      ++report.merged;
      fill = [w, lora = pair->second, scaling](std::span<std::byte> bytes) {
        return MergeInto(*w, lora, scaling, bytes);
      };
    } else {
      fill = [w](std::span<std::byte> bytes) {
        std::memcpy(bytes.data(), w->data.data(), bytes.size());
        return Status::Ok();
      };
    }
    if (copy != copies.end()) ++report.replaced;
    tensors.push_back({name, t.info->dtype, t.info->shape, std::move(fill)});
  }
  RESHARD_RETURN_IF_ERROR(WriteSafetensors(out.FilePath("model.safetensors"), std::move(tensors),
                                           {{"format", "pt"}, {"producer", "reshard"}},
                                           {.sync = options.sync}));
  std::error_code ec;
  for (const char* name : ModelSideFiles()) {
    const fs::path path = fs::path(base_dir) / name;
    if (std::string_view(name) == kAdapterConfigName || !fs::is_regular_file(path, ec)) continue;
    RESHARD_ASSIGN_OR_RETURN(std::string contents, ReadFileToString(path.string()));
    RESHARD_RETURN_IF_ERROR(
        WriteFileAtomically(out.FilePath(name), contents, {.sync = options.sync}));
  }
  RESHARD_RETURN_IF_ERROR(out.Commit(options.sync));
  return report;
}

}  // namespace reshard
