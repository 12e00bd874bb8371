// Dequantization of block-quantized tensors (DESIGN 20): the elementwise step from stored
// data and one scale per block to numbers, as transformers computes it on the CPU.
//
// Every element is `out_dtype(float(x) * float(s))`: x the element as float (FP8 exactly; a
// packed FP4 E2M1 nibble from its table of 16 values), s its block's scale as float (for NVFP4
// first multiplied by ModelOpt's second-level scale, or divided by compressed-tensors' global
// scale, in float: compressed-tensors' decompression, bit for bit), one
// multiplication in float (round to nearest even), then a round to nearest even into
// `out_dtype` (BF16, F16 or F32). That is transformers' FP8 dequantization
// (`Fp8Dequantize`: both sides promoted to float32, multiplied, cast) and its MXFP4 one
// (`ldexp` of the table value by the E8M0 exponent, exact in float), so the results are equal
// to theirs bit for bit.
#ifndef RESHARD_EXEC_DEQUANTIZE_H_
#define RESHARD_EXEC_DEQUANTIZE_H_

#include <cstddef>
#include <optional>
#include <span>
#include <string_view>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/status.h"

namespace reshard {

struct DequantizeSpec {
  /// F8_E4M3 / F8_E5M2, or U8 holding two FP4 E2M1 values a byte (low nibble first).
  DType data_dtype = DType::kF8E4M3;
  /// The stored data tensor's shape (bytes for packed FP4).
  Shape data_shape;
  /// F32, BF16, F16, F8_E4M3 (NVFP4's per-16 scales) or U8 (E8M0 exponents: 2^(b - 127)).
  DType scale_dtype = DType::kF32;
  /// In stored data elements, one extent per dimension of data_shape; the scales are the grid
  /// ceil(data_shape / block), row-major.
  Shape block;
  /// A second, per-tensor factor applied to every block's scale first (1 when there is none):
  /// ModelOpt NVFP4's `weight_scale_2` multiplies it; compressed-tensors NVFP4's
  /// `weight_global_scale` divides it (`global_divides`), one float division per block, as
  /// compressed-tensors' own decompression computes `scale / global_scale`.
  float global_scale = 1.0f;
  bool global_divides = false;
  /// Rounds each block's factor to bfloat16 (nearest even) before the multiplication: what
  /// compressed-tensors computes when the global scale is 0-d (a bfloat16 scale divided by a
  /// 0-d float32 tensor stays bfloat16); with the [1]-shaped global scale it writes, the
  /// factor stays float.
  bool factor_to_bf16 = false;
};

/// The output dtype a dequantization is asked for by name: "bf16", "fp16" or "fp32" (nullopt
/// for any other name). The CLI's --dtype and Python's dequantize= both read it.
std::optional<DType> DequantizedDTypeFromName(std::string_view name);

/// The number of output elements (packed FP4: two a byte).
Index DequantizedElements(const DequantizeSpec& spec);

/// Dequantizes `data` (dense, row-major) with `scales` into `out` (dense, row-major, of the
/// data's logical elements: a packed byte gives two along the last dimension).
/// \error InvalidArgument  a size or dtype that does not fit the spec.
/// \error FailedPrecondition  a scale that is NaN, infinite or negative (an E8M0 byte of 255 is
///        NaN), naming its block's multi-index.
/// Rows are spread over `num_threads` threads (0: the machine's cores).
Status Dequantize(const DequantizeSpec& spec, std::span<const std::byte> data,
                  std::span<const std::byte> scales, DType out_dtype, std::span<std::byte> out,
                  int num_threads = 0);

/// The float value of an FP8 byte (E4M3 "fn": no infinities, S.1111.111 is NaN; E5M2: IEEE).
float Float8ToFloat(DType dtype, uint8_t bits);

/// The value of one element of `dtype` stored at `bytes`, as a double: exact for every
/// floating-point dtype and for integers up to 2^53; bool is 0 or 1.
double ElementToDouble(DType dtype, const std::byte* bytes);

}  // namespace reshard

#endif  // RESHARD_EXEC_DEQUANTIZE_H_
