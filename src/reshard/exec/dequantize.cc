#include "reshard/exec/dequantize.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "reshard/exec/strided_copy.h"

namespace reshard {

namespace {

// FP4 E2M1: sign, two exponent bits (bias 1), one mantissa bit.
constexpr std::array<float, 16> kFp4Values = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                              4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                              -2.0f, -3.0f, -4.0f, -6.0f};

std::array<float, 256> Float8Table(DType dtype) {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b)
    t[static_cast<size_t>(b)] = Float8ToFloat(dtype, static_cast<uint8_t>(b));
  return t;
}

float ScaleAt(DType dtype, const std::byte* p) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return dtype == DType::kBF16 ? BFloat16ToFloat(h) : HalfToFloat(h);
    }
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return Float8ToFloat(dtype, static_cast<uint8_t>(*p));
    case DType::kU8: {
      const int e = static_cast<int>(static_cast<uint8_t>(*p));
      return e == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, e - 127);
    }
    default:
      return std::numeric_limits<float>::quiet_NaN();
  }
}

// float -> bfloat16, to nearest even, NaN as torch makes it (0x7FC0); inline for the loop.
inline uint16_t ToBFloat16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <DType kOut>
void StoreAs(float v, std::byte* p) {
  if constexpr (kOut == DType::kF32) {
    std::memcpy(p, &v, 4);
  } else {
    const uint16_t h = kOut == DType::kBF16 ? ToBFloat16(v) : FloatToHalf(v);
    std::memcpy(p, &h, 2);
  }
}

// Rows [first, last) of the data (its last dimension), each block of columns with its scale.
template <DType kOut>
void DequantizeRows(const DequantizeSpec& spec, bool fp4, const std::array<float, 256>& table,
                    const std::vector<float>& s, const Shape& gstrides, const Shape& row_shape,
                    const uint8_t* in, std::span<std::byte> out, Index first, Index last) {
  constexpr size_t kSize = kOut == DType::kF32 ? 4 : 2;
  const size_t nd = spec.data_shape.size();
  const Index cols = spec.data_shape[nd - 1], bcols = spec.block[nd - 1];
  const size_t per_row = static_cast<size_t>(cols) * (fp4 ? 2 : 1) * kSize;
  for (Index r = first; r < last; ++r) {
    const Shape idx = UnravelIndex(r, row_shape);
    Index base = 0;
    for (size_t j = 0; j + 1 < nd; ++j) base += idx[j] / spec.block[j] * gstrides[j];
    const uint8_t* x = in + r * cols;
    std::byte* o = out.data() + static_cast<size_t>(r) * per_row;
    for (Index c0 = 0, b = 0; c0 < cols; c0 += bcols, ++b) {
      const float sc = s[static_cast<size_t>(base + b)];
      const Index c1 = std::min(cols, c0 + bcols);
      if (fp4) {
        for (Index c = c0; c < c1; ++c, o += 2 * kSize) {
          StoreAs<kOut>(kFp4Values[x[c] & 0x0F] * sc, o);
          StoreAs<kOut>(kFp4Values[x[c] >> 4] * sc, o + kSize);
        }
      } else {
        for (Index c = c0; c < c1; ++c, o += kSize) StoreAs<kOut>(table[x[c]] * sc, o);
      }
    }
  }
}

}  // namespace

float Float8ToFloat(DType dtype, uint8_t bits) {
  const bool negative = (bits & 0x80) != 0;
  const int exp_bits = dtype == DType::kF8E4M3 ? 4 : 5;
  const int man_bits = 7 - exp_bits;
  const int bias = dtype == DType::kF8E4M3 ? 7 : 15;
  const int e = (bits >> man_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << man_bits) - 1);
  float v;
  if (dtype == DType::kF8E4M3 && e == 15 && m == 7) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (dtype == DType::kF8E5M2 && e == 31) {
    v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
  } else {
    v = std::ldexp(static_cast<float>(m + (1 << man_bits)), e - bias - man_bits);
  }
  return negative ? -v : v;
}

std::optional<DType> DequantizedDTypeFromName(std::string_view name) {
  if (name == "bf16") return DType::kBF16;
  if (name == "fp16") return DType::kF16;
  if (name == "fp32") return DType::kF32;
  return std::nullopt;
}

Index DequantizedElements(const DequantizeSpec& spec) {
  const Index n = ProductOf(spec.data_shape);
  return spec.data_dtype == DType::kU8 ? 2 * n : n;
}

Status Dequantize(const DequantizeSpec& spec, std::span<const std::byte> data,
                  std::span<const std::byte> scales, DType out_dtype, std::span<std::byte> out,
                  int num_threads) {
  const bool fp4 = spec.data_dtype == DType::kU8;
  if (!fp4 && spec.data_dtype != DType::kF8E4M3 && spec.data_dtype != DType::kF8E5M2) {
    return InvalidArgumentError(
        fmt::format("cannot dequantize {} data", DTypeName(spec.data_dtype)));
  }
  if (out_dtype != DType::kBF16 && out_dtype != DType::kF16 && out_dtype != DType::kF32) {
    return InvalidArgumentError(fmt::format("cannot dequantize into {}", DTypeName(out_dtype)));
  }
  switch (spec.scale_dtype) {
    case DType::kF32:
    case DType::kBF16:
    case DType::kF16:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kU8:
      break;
    default:
      return InvalidArgumentError(
          fmt::format("cannot read scales stored as {}", DTypeName(spec.scale_dtype)));
  }
  const size_t nd = spec.data_shape.size();
  if (spec.block.size() != nd || nd == 0) {
    return InvalidArgumentError(
        fmt::format("block {} for data {}", FormatShape(spec.block), FormatShape(spec.data_shape)));
  }
  Shape grid(nd);
  for (size_t j = 0; j < nd; ++j)
    grid[j] = (spec.data_shape[j] + spec.block[j] - 1) / spec.block[j];
  const size_t ssize = DTypeSize(spec.scale_dtype), osize = DTypeSize(out_dtype);
  const Index n = ProductOf(spec.data_shape);
  if (data.size() != static_cast<size_t>(n) ||
      scales.size() != static_cast<size_t>(ProductOf(grid)) * ssize ||
      out.size() != static_cast<size_t>(DequantizedElements(spec)) * osize) {
    return InvalidArgumentError("dequantize: buffer sizes do not fit the shapes");
  }
  // Scales first: each checked once.
  std::vector<float> s(static_cast<size_t>(ProductOf(grid)));
  for (size_t i = 0; i < s.size(); ++i) {
    const float stored = ScaleAt(spec.scale_dtype, scales.data() + i * ssize);
    float v = spec.global_divides ? stored / spec.global_scale : stored * spec.global_scale;
    if (spec.factor_to_bf16) v = BFloat16ToFloat(ToBFloat16(v));
    if (!std::isfinite(v) || v < 0) {
      return FailedPreconditionError(
          fmt::format("the scale of block {} is {}",
                      FormatShape(UnravelIndex(static_cast<Index>(i), grid)), v));
    }
    s[i] = v;
  }
  const std::array<float, 256> table = Float8Table(fp4 ? DType::kF8E4M3 : spec.data_dtype);
  // Rows of the last dimension: the block index varies along it by block[last].
  const Index cols = spec.data_shape[nd - 1];
  const Index rows = cols == 0 ? 0 : n / cols;
  const Shape gstrides = RowMajorStrides(grid);
  Shape row_shape(spec.data_shape.begin(), spec.data_shape.end() - 1);
  const auto* in = reinterpret_cast<const uint8_t*>(data.data());
  auto run_rows = [&](Index first, Index last) {
    switch (out_dtype) {
      case DType::kF32:
        DequantizeRows<DType::kF32>(spec, fp4, table, s, gstrides, row_shape, in, out, first, last);
        break;
      case DType::kF16:
        DequantizeRows<DType::kF16>(spec, fp4, table, s, gstrides, row_shape, in, out, first, last);
        break;
      default:
        DequantizeRows<DType::kBF16>(spec, fp4, table, s, gstrides, row_shape, in, out, first,
                                     last);
        break;
    }
  };
  if (rows == 0) return Status::Ok();
  // Threads for tensors of at least a few MB; each takes a contiguous range of rows.
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = static_cast<int>(std::clamp<Index>(
      std::min<Index>(num_threads > 0 ? num_threads : hw, n / (Index{1} << 21)), 1, rows));
  if (threads <= 1) {
    run_rows(0, rows);
    return Status::Ok();
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const Index first = rows * t / threads, last = rows * (t + 1) / threads;
    pool.emplace_back(run_rows, first, last);
  }
  for (std::thread& th : pool) th.join();
  return Status::Ok();
}

double ElementToDouble(DType dtype, const std::byte* bytes) {
  auto load = [&](auto v) {
    std::memcpy(&v, bytes, sizeof(v));
    return v;
  };
  switch (dtype) {
    case DType::kF64:
      return load(double{});
    case DType::kF32:
      return load(float{});
    case DType::kF16:
      return HalfToFloat(load(uint16_t{}));
    case DType::kBF16:
      return BFloat16ToFloat(load(uint16_t{}));
    case DType::kI64:
      return static_cast<double>(load(int64_t{}));
    case DType::kI32:
      return load(int32_t{});
    case DType::kI16:
      return load(int16_t{});
    case DType::kI8:
      return load(int8_t{});
    case DType::kU64:
      return static_cast<double>(load(uint64_t{}));
    case DType::kU32:
      return load(uint32_t{});
    case DType::kU16:
      return load(uint16_t{});
    case DType::kU8:
      return load(uint8_t{});
    case DType::kBool:
      return load(uint8_t{}) != 0 ? 1.0 : 0.0;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return Float8ToFloat(dtype, load(uint8_t{}));
  }
  return 0.0;
}

}  // namespace reshard
