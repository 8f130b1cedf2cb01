// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): s += mean(g^2) over the row;
// w -= lr * g / (sqrt(s) + eps). State: s (1 per row). hparams: [lr, step, weight_decay, eps].
#pragma once

#include "veloce/optim/rule.h"

namespace veloce {
namespace optim {

struct RowWiseAdagrad {
  static constexpr const char* kName = "RowWiseAdagrad";
  static constexpr int kHparams = 1;
  static constexpr int kVectors = 0;
  static constexpr int kRowValues = 1;
  static constexpr bool kRowPrologue = true;
  static constexpr const char* kStateFormula = "1";

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

  // s += sq / D; the factor lr / (sqrt(s) + eps).
  template <typename acc_t>
  VELOCE_HD static acc_t row(const Params<acc_t>& p, acc_t sq, acc_t& s, int64_t D) {
    s = s + (D > 0 ? sq / static_cast<acc_t>(D) : acc_t(0));
    return p.lr / (std::sqrt(s) + p.eps);
  }

  template <typename acc_t>
  VELOCE_HD static acc_t update(const Params<acc_t>&, acc_t w, acc_t g, Elem<acc_t, kVectors>&, acc_t row) {
    return w - row * g;
  }
};

}  // namespace optim
}  // namespace veloce
