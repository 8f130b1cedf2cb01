// Deterministic initial values: value(seed, id, column) depends on nothing else, so a
// row's first value is the same whatever the insertion order, batch or number of ranks;
// CPU and CUDA agree up to the last bits of float64 (their log, sin and cos differ by an
// ulp or two, and nvcc fuses multiply-adds), so rows of the row dtype agree bit for bit
// except, rarely, in the last bit.
#pragma once

#include <cmath>
#include <cstdint>

#include "veloce/hash.h"

namespace veloce {

enum InitKind : int64_t { kInitZeros = 0, kInitConstant = 1, kInitUniform = 2, kInitNormal = 3 };

// splitmix64 step: a counter-based generator.
VELOCE_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in the open interval (0, 1), 53-bit resolution.
VELOCE_HD double unit_uniform(uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// The bits every column of the row for `id` derives from.
VELOCE_HD uint64_t init_row_bits(int64_t seed, int64_t id) {
  return splitmix64(static_cast<uint64_t>(seed) ^ fmix64(static_cast<uint64_t>(id)));
}

// Normal columns 2 * pair and 2 * pair + 1: one Box-Muller pair (z0 from cos, z1 from sin).
VELOCE_HD void init_normal_pair(uint64_t row, int64_t pair, double a, double b, double* z0, double* z1) {
  const double u1 = unit_uniform(splitmix64(row + 2 * static_cast<uint64_t>(pair)));
  const double u2 = unit_uniform(splitmix64(row + 2 * static_cast<uint64_t>(pair) + 1));
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 6.283185307179586 * u2;
  *z0 = a + b * (r * std::cos(theta));
  *z1 = a + b * (r * std::sin(theta));
}

// Column `col` of a row whose bits are `row` (init_row_bits).
VELOCE_HD double init_value_at(uint64_t row, int64_t col, int64_t kind, double a, double b) {
  if (kind == kInitZeros) return 0.0;
  if (kind == kInitConstant) return a;
  if (kind == kInitUniform) {
    const double u = unit_uniform(splitmix64(row + static_cast<uint64_t>(col)));
    return a + (b - a) * u;
  }
  double z0, z1;
  init_normal_pair(row, col >> 1, a, b, &z0, &z1);
  return (col & 1) ? z1 : z0;
}

// Columns lane, lane + lanes, ... (below dim) of the row whose bits are `row`
// (init_row_bits): put(col, value) for each. A normal row's Box-Muller pairs are computed
// once each (a lane takes both columns of a pair), so a kernel with a group of `lanes`
// threads per row (or a CPU loop, lane 0 of 1) that hashes each id once fills rows several
// times cheaper than init_value per column, with the same values.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Put>
VELOCE_HD void init_columns(uint64_t row, int64_t dim, int64_t kind, double a, double b, int64_t lane,
                            int64_t lanes, Put&& put) {
  if (kind == kInitZeros || kind == kInitConstant) {
    const double v = kind == kInitZeros ? 0.0 : a;
    for (int64_t c = lane; c < dim; c += lanes) put(c, v);
  } else if (kind == kInitUniform) {
    for (int64_t c = lane; c < dim; c += lanes) put(c, init_value_at(row, c, kind, a, b));
  } else {
    for (int64_t p = lane; 2 * p < dim; p += lanes) {
      double z0, z1;
      init_normal_pair(row, p, a, b, &z0, &z1);
      put(2 * p, z0);
      if (2 * p + 1 < dim) put(2 * p + 1, z1);
    }
  }
}

// The initial value of column `col` of the row for `id`: the definition the row kernels
// (init_columns) follow, and the formula tests/conftest.py's reference reimplements.
//   zeros: 0;  constant: a;  uniform: U(a, b);  normal: N(mean=a, std=b) (Box-Muller: columns
//   2k and 2k+1 share one pair). Kernels that fill whole rows hash the id once per row
//   (init_row_bits) and, for normal rows, compute each pair once (init_normal_pair): the
//   same values.
VELOCE_HD double init_value(int64_t seed, int64_t id, int64_t col, int64_t kind, double a, double b) {
  if (kind == kInitZeros) return 0.0;
  if (kind == kInitConstant) return a;
  return init_value_at(init_row_bits(seed, id), col, kind, a, b);
}

}  // namespace veloce
