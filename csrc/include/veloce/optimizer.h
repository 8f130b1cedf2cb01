// The sparse optimizer rules, shared by sparse_update and accumulate_and_update.
// Semantics: docs/ops.md, "optimizer". One call of UpdateRule::apply reads a row and its
// state and writes both (g already holds the row's summed gradient, in acc_t).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <math.h>
#include <cstdint>

#include "veloce/macros.h"

namespace veloce {

enum Optimizer : int64_t { kSGD = 0, kAdagrad = 1, kRowWiseAdagrad = 2, kAdam = 3 };

// State width S per row for dim D.
VELOCE_HD int64_t state_width(int64_t opt, int64_t D) {
  return opt == kSGD ? 0 : opt == kAdagrad ? D : opt == kRowWiseAdagrad ? 1 : 2 * D;
}

// Argument checks of the updating ops (check_update_args, ...): veloce/op_checks.h.

template <typename acc_t>
struct UpdateRule {
  int64_t opt;
  acc_t lr, eps, wd, b1c, b2c, step_size;

  // On the host, or on the device from a tensor's values (accumulate_and_update's lr_step).
  VELOCE_HD static UpdateRule make(int64_t opt, double lr, double eps, double beta1, double beta2,
                                   double weight_decay, int64_t step) {
    double step_size = 0.0;
    if (opt == kAdam) {  // torch.optim.SparseAdam: lr * sqrt(1 - b2^t) / (1 - b1^t)
      const double bc1 = 1.0 - ::pow(beta1, static_cast<double>(step));
      const double bc2 = 1.0 - ::pow(beta2, static_cast<double>(step));
      step_size = lr * ::sqrt(bc2) / bc1;
    }
    return {opt,
            static_cast<acc_t>(lr),
            static_cast<acc_t>(eps),
            static_cast<acc_t>(weight_decay),
            static_cast<acc_t>(1.0 - beta1),
            static_cast<acc_t>(1.0 - beta2),
            static_cast<acc_t>(step_size)};
  }

  // w (D,) row, st (S,) its state, g (D,) its gradient (overwritten with g + wd * w).
  template <typename scalar_t>
  void apply(scalar_t* __restrict__ w, acc_t* __restrict__ st, acc_t* __restrict__ g, int64_t D) const {
    if (wd != acc_t(0)) {
      for (int64_t j = 0; j < D; ++j) g[j] += wd * static_cast<acc_t>(w[j]);
    }
    switch (opt) {
      case kSGD:
        for (int64_t j = 0; j < D; ++j) w[j] = static_cast<scalar_t>(static_cast<acc_t>(w[j]) - lr * g[j]);
        break;
      case kAdagrad:
        for (int64_t j = 0; j < D; ++j) {
          const acc_t s = st[j] + g[j] * g[j];
          st[j] = s;
          w[j] = static_cast<scalar_t>(static_cast<acc_t>(w[j]) - lr * (g[j] / (std::sqrt(s) + eps)));
        }
        break;
      case kRowWiseAdagrad: {
        acc_t sq = 0;
        for (int64_t j = 0; j < D; ++j) sq += g[j] * g[j];
        const acc_t s = st[0] + (D > 0 ? sq / static_cast<acc_t>(D) : acc_t(0));
        st[0] = s;
        const acc_t mult = lr / (std::sqrt(s) + eps);
        for (int64_t j = 0; j < D; ++j) w[j] = static_cast<scalar_t>(static_cast<acc_t>(w[j]) - mult * g[j]);
        break;
      }
      default: {  // Adam, state [m (D), v (D)]; SparseAdam's m += (g - m) * (1 - b1)
        acc_t* __restrict__ m = st;
        acc_t* __restrict__ v = st + D;
        for (int64_t j = 0; j < D; ++j) {
          const acc_t mj = m[j] + (g[j] - m[j]) * b1c;
          const acc_t vj = v[j] + (g[j] * g[j] - v[j]) * b2c;
          m[j] = mj;
          v[j] = vj;
          w[j] = static_cast<scalar_t>(static_cast<acc_t>(w[j]) - step_size * (mj / (std::sqrt(vj) + eps)));
        }
      }
    }
  }
};

}  // namespace veloce
