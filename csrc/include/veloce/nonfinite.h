// NaN / infinity tests on the bits of a floating-point value: the exponent field is all
// ones (what std::isfinite tests). Shared by the CPU and CUDA kernels of nonfinite_flags,
// which read every tensor as its raw bits (wide vector loads, no conversion).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "veloce/macros.h"

namespace veloce {

// bits_t: an unsigned integer of the type's width; kExponent: its exponent field.
template <typename scalar_t>
struct FloatBits;
template <>
struct FloatBits<double> {
  using bits_t = uint64_t;
  static constexpr bits_t kExponent = 0x7ff0000000000000ull;
};
template <>
struct FloatBits<float> {
  using bits_t = uint32_t;
  static constexpr bits_t kExponent = 0x7f800000u;
};
template <>
struct FloatBits<c10::Half> {
  using bits_t = uint16_t;
  static constexpr bits_t kExponent = 0x7c00u;
};
template <>
struct FloatBits<c10::BFloat16> {
  using bits_t = uint16_t;
  static constexpr bits_t kExponent = 0x7f80u;
};

// Whether the value with bits x is a NaN or an infinity.
template <typename scalar_t>
VELOCE_HD bool nonfinite_bits(typename FloatBits<scalar_t>::bits_t x) {
  constexpr auto e = FloatBits<scalar_t>::kExponent;
  return (x & e) == e;
}

}  // namespace veloce
