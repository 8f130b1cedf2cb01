// Adagrad: s += g^2; w -= lr * g / (sqrt(s) + eps) (torch.optim.Adagrad, lr_decay 0).
// State: s (D). hparams: [lr, step, weight_decay, eps].
#pragma once

#include "veloce/optim/rule.h"

namespace veloce {
namespace optim {

struct Adagrad {
  static constexpr const char* kName = "Adagrad";
  static constexpr int kHparams = 1;
  static constexpr int kVectors = 1;
  static constexpr int kRowValues = 0;
  static constexpr bool kRowPrologue = false;
  static constexpr const char* kStateFormula = "D";

  template <typename acc_t>
  struct Params {
    acc_t lr, wd, eps;
  };

  template <typename acc_t>
  VELOCE_HD static Params<acc_t> make(const double* h) {
    return {static_cast<acc_t>(h[kLr]), static_cast<acc_t>(h[kWeightDecay]), static_cast<acc_t>(h[kOwn])};
  }

  static void check(const char* op, const double* h) {
    check_hparam(op, std::isfinite(h[kOwn]) && h[kOwn] >= 0.0, "eps", kOwn, "a finite number >= 0", h[kOwn]);
  }

  template <typename acc_t>
  VELOCE_HD static acc_t update(const Params<acc_t>& p, acc_t w, acc_t g, Elem<acc_t, kVectors>& s, acc_t) {
    s.v[0] = s.v[0] + g * g;
    return w - p.lr * (g / (std::sqrt(s.v[0]) + p.eps));
  }
};

}  // namespace optim
}  // namespace veloce
