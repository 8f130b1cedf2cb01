// Lazy Adam (torch.optim.SparseAdam): m += (g - m) * (1 - beta1); v += (g^2 - v) * (1 - beta2);
// w -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps), t the 1-based step.
// State: m (D), v (D). hparams: [lr, step, weight_decay, eps, beta1, beta2].
#pragma once

#include <math.h>

#include "veloce/optim/rule.h"

namespace veloce {
namespace optim {

struct Adam {
  static constexpr const char* kName = "Adam";
  static constexpr int kHparams = 3;
  static constexpr int kVectors = 2;
  static constexpr int kRowValues = 0;
  static constexpr bool kRowPrologue = false;
  static constexpr const char* kStateFormula = "2 * D";

  template <typename acc_t>
  struct Params {
    acc_t wd, eps, b1c, b2c, step_size;
  };

  // The bias correction in double, from the step count (on the device when a kernel makes it).
  template <typename acc_t>
  VELOCE_HD static Params<acc_t> make(const double* h) {
    const double lr = h[kLr], step = h[kStep], beta1 = h[kOwn + 1], beta2 = h[kOwn + 2];
    const double bc1 = 1.0 - ::pow(beta1, step);
    const double bc2 = 1.0 - ::pow(beta2, step);
    return {static_cast<acc_t>(h[kWeightDecay]), static_cast<acc_t>(h[kOwn]), static_cast<acc_t>(1.0 - beta1),
            static_cast<acc_t>(1.0 - beta2), static_cast<acc_t>(lr * ::sqrt(bc2) / bc1)};
  }

  static void check(const char* op, const double* h) {
    check_hparam(op, h[kStep] >= 1.0, "step", kStep, ">= 1 for Adam (the 1-based step count)", h[kStep]);
    check_hparam(op, std::isfinite(h[kOwn]) && h[kOwn] >= 0.0, "eps", kOwn, "a finite number >= 0", h[kOwn]);
    check_hparam(op, h[kOwn + 1] >= 0.0 && h[kOwn + 1] < 1.0, "beta1", kOwn + 1, "in [0, 1) for Adam", h[kOwn + 1]);
    check_hparam(op, h[kOwn + 2] >= 0.0 && h[kOwn + 2] < 1.0, "beta2", kOwn + 2, "in [0, 1) for Adam", h[kOwn + 2]);
  }

  template <typename acc_t>
  VELOCE_HD static acc_t update(const Params<acc_t>& p, acc_t w, acc_t g, Elem<acc_t, kVectors>& s, acc_t) {
    s.v[0] = s.v[0] + (g - s.v[0]) * p.b1c;
    s.v[1] = s.v[1] + (g * g - s.v[1]) * p.b2c;
    return w - p.step_size * (s.v[0] / (std::sqrt(s.v[1]) + p.eps));
  }
};

}  // namespace optim
}  // namespace veloce
