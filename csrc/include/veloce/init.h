// Deterministic initial values: value(seed, id, column) depends on nothing else, so a
// row's first value is the same whatever the insertion order, batch, device or number
// of ranks.
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

// The initial value of column `col` of the row for `id`.
//   zeros: 0;  constant: a;  uniform: U(a, b);  normal: N(mean=a, std=b) (Box-Muller).
VELOCE_HD double init_value(int64_t seed, int64_t id, int64_t col, int64_t kind, double a, double b) {
  if (kind == kInitZeros) return 0.0;
  if (kind == kInitConstant) return a;
  const uint64_t row = splitmix64(static_cast<uint64_t>(seed) ^ fmix64(static_cast<uint64_t>(id)));
  if (kind == kInitUniform) {
    const double u = unit_uniform(splitmix64(row + static_cast<uint64_t>(col)));
    return a + (b - a) * u;
  }
  // Normal: columns 2k and 2k+1 share one Box-Muller pair.
  const uint64_t pair = static_cast<uint64_t>(col >> 1);
  const double u1 = unit_uniform(splitmix64(row + 2 * pair));
  const double u2 = unit_uniform(splitmix64(row + 2 * pair + 1));
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 6.283185307179586 * u2;
  const double z = (col & 1) ? r * std::sin(theta) : r * std::cos(theta);
  return a + b * z;
}

}  // namespace veloce
