// Block-quantized checkpoints (DESIGN 20): what a config.json's `quantization_config` says,
// and which tensors of a checkpoint are the scales of which data tensor, with what block.
//
// Formats (docs/quantization.md):
//   fp8 block     quant_method "fp8" (transformers' FineGrainedFP8, DeepSeek-V3, Qwen3-FP8):
//                 `X.weight` F8_E4M3 [N, K], `X.weight_scale_inv` (or `X.weight_scale`) F32
//                 [ceil(N/bn), ceil(K/bk)] for weight_block_size [bn, bk]
//   fp8 tensor / channel   compressed-tensors "float-quantized", ModelOpt "FP8": `X.weight`
//                 F8_E4M3, `X.weight_scale` of one element or [N, 1]; `X.input_scale`
//   mxfp4         quant_method "mxfp4" (gpt-oss): `X_blocks` U8 [..., G, 16] (two FP4 E2M1
//                 values a byte, 32 per group), `X_scales` U8 [..., G] (E8M0 exponents)
//   nvfp4         ModelOpt "NVFP4" / compressed-tensors "nvfp4-pack-quantized": `X.weight`
//                 (`X.weight_packed`) U8 [N, K/2], `X.weight_scale` F8_E4M3 [N, K/16],
//                 `X.weight_scale_2` (`X.weight_global_scale`) and `X.input_scale`
//                 (`X.input_global_scale`) of one element
// Blocks are in elements of the stored data tensor (bytes for packed FP4): [128, 128], [1, 16]
// over the MXFP4 block bytes, [1, 8] bytes for NVFP4, [1, K] per channel, the whole tensor
// per tensor. Scalars beside a quantized tensor (activation scales) are per-tensor scales:
// every rank holds them.
#ifndef RESHARD_HF_QUANTIZATION_H_
#define RESHARD_HF_QUANTIZATION_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"

namespace reshard {

enum class QuantFormat { kFp8Block, kFp8Tensor, kFp8Channel, kMxfp4, kNvfp4 };

/// "fp8-block", "fp8-tensor", "fp8-channel", "mxfp4", "nvfp4".
std::string_view QuantFormatName(QuantFormat format);

/// What a config.json's quantization_config says.
struct QuantScheme {
  QuantFormat format = QuantFormat::kFp8Block;
  /// The quant_method as written ("fp8", "compressed-tensors", "modelopt", "mxfp4").
  std::string method;
  /// fp8 block: weight_block_size [bn, bk]. nvfp4: [group_size] in FP4 values (16 unless the
  /// config says otherwise: ModelOpt's `group_size`, compressed-tensors' `weights.group_size`).
  Shape block;
  /// Module name patterns left unquantized (modules_to_not_convert, ignore, exclude_modules).
  std::vector<std::string> not_converted;
};

/// The scheme of a config.json (JSON text); nullopt when it has no quantization_config.
/// \error InvalidArgument  malformed config, or a quantization_config reshard does not know
///        (the message names its quant_method and the formats known).
Result<std::optional<QuantScheme>> ReadQuantScheme(std::string_view config_json);

/// A config.json (JSON text, an object) without its quantization_config: a dequantized
/// model's, which transformers and vLLM load as unquantized. Key order is kept.
/// \error InvalidArgument  not a JSON object
Result<std::string> WithoutQuantizationConfig(std::string_view config_json);

/// A tensor of a checkpoint as the pairing sees it.
struct QuantTensor {
  std::string name;
  DType dtype;
  Shape shape;
};

/// One scale tensor and the data tensor it scales.
struct QuantTie {
  std::string scale;  // the scale tensor's name
  std::string data;   // the data tensor's name
  /// In elements of the stored data tensor, one extent per dimension of it.
  Shape block;
  QuantFormat format = QuantFormat::kFp8Block;
  /// Whether this is the block scale that dequantization multiplies by (false: a per-tensor
  /// second-level or activation scale, moved but not applied).
  bool dequantizes = true;
};

/// The ties of a checkpoint's tensors under `scheme`, in tensor order of the scales.
///
/// A tensor is quantized data when its dtype says so under the scheme: F8_E4M3 / F8_E5M2 under
/// the FP8 formats, U8 `X.weight` / `X.weight_packed` under NVFP4, `X_blocks` under MXFP4
/// (modules_to_not_convert / ignore name tensors stored unquantized; a list naming quantized
/// data does not make it numbers). Each needs the block scale dequantization multiplies by
/// (per-tensor activation scalars beside it are no such scale), and ModelOpt NVFP4 data its
/// `weight_scale_2` too.
/// \error FailedPrecondition  quantized data without its block scale (or ModelOpt NVFP4 without
///        `weight_scale_2`; the message names the data and the missing tensor), a scale without
///        its data, a scale whose shape is not the data's block grid under the scheme or whose
///        dtype the format does not store (the message names both tensors), NVFP4 `X.weight`
///        beside `X.weight_packed`.
Result<std::vector<QuantTie>> TieQuantizedTensors(const QuantScheme& scheme,
                                                  const std::vector<QuantTensor>& tensors);

/// The name under which the model's plan knows a data tensor: MXFP4's `X_blocks` is `X`.
std::string PlanNameOfData(const QuantTie& tie);

}  // namespace reshard

#endif  // RESHARD_HF_QUANTIZATION_H_
