// FTRL-Proximal (tf.keras.optimizers.Ftrl, without l2 shrinkage), p = lr_power:
//   n' = n + g^2;  z += g - (n'^(-p) - n^(-p)) / lr * w;
//   w = 0 if |z| <= l1, else (sign(z) * l1 - z) / ((beta + n'^(-p)) / lr + 2 * l2);  n = n'.
// State: n (D, the accumulator), z (D, the linear term); the optimizer's initial state
// (veloce.optim.FTRL.initial_state) starts n at initial_accumulator_value.
// hparams: [lr, step, weight_decay, lr_power, l1, l2, beta].
#pragma once

#include <math.h>

#include "veloce/optim/rule.h"

namespace veloce {
namespace optim {

struct FTRL {
  static constexpr const char* kName = "FTRL";
  static constexpr int kHparams = 4;
  static constexpr int kVectors = 2;
  static constexpr int kRowValues = 0;
  static constexpr bool kRowPrologue = false;
  static constexpr const char* kStateFormula = "2 * D";

  template <typename acc_t>
  struct Params {
    acc_t lr, wd, power, l1, l2, beta;  // power = -lr_power
    bool half;                          // power == 0.5: sqrt rather than pow
  };

  template <typename acc_t>
  VELOCE_HD static Params<acc_t> make(const double* h) {
    return {static_cast<acc_t>(h[kLr]),         static_cast<acc_t>(h[kWeightDecay]),
            static_cast<acc_t>(-h[kOwn]),       static_cast<acc_t>(h[kOwn + 1]),
            static_cast<acc_t>(h[kOwn + 2]),    static_cast<acc_t>(h[kOwn + 3]),
            h[kOwn] == -0.5};
  }

  static void check(const char* op, const double* h) {
    check_hparam(op, h[kLr] > 0.0, "lr", kLr, "> 0 for FTRL (it divides by it)", h[kLr]);
    check_hparam(op, std::isfinite(h[kOwn]) && h[kOwn] <= 0.0, "lr_power", kOwn, "a finite number <= 0", h[kOwn]);
    const char* names[] = {"l1", "l2", "beta"};
    for (int i = 1; i <= 3; ++i) {
      const double v = h[kOwn + i];
      check_hparam(op, std::isfinite(v) && v >= 0.0, names[i - 1], kOwn + i, "a finite number >= 0", v);
    }
  }

  VELOCE_HD static float power_of(float x, float y) { return ::powf(x, y); }
  VELOCE_HD static double power_of(double x, double y) { return ::pow(x, y); }

  // The update with n^(-p) taken by sqrt (kHalf) or pow.
  template <bool kHalf>
  struct Fixed {
    template <typename acc_t>
    VELOCE_HD static acc_t update(const Params<acc_t>& p, acc_t w, acc_t g, Elem<acc_t, kVectors>& s, acc_t) {
      const acc_t n = s.v[0];
      const acc_t n_new = n + g * g;
      const acc_t root = kHalf ? std::sqrt(n) : power_of(n, p.power);
      const acc_t root_new = kHalf ? std::sqrt(n_new) : power_of(n_new, p.power);
      const acc_t z = s.v[1] + (g - (root_new - root) / p.lr * w);
      s.v[0] = n_new;
      s.v[1] = z;
      // (clip(z, -l1, l1) - z) / quadratic, as Keras writes it: exactly 0 where |z| <= l1,
      // (sign(z) l1 - z) / quadratic elsewhere; selects the CPU loop vectorizes.
      const acc_t clipped = z < -p.l1 ? -p.l1 : (z > p.l1 ? p.l1 : z);
      return (clipped - z) / ((p.beta + root_new) / p.lr + acc_t(2) * p.l2);
    }
  };

  // The CPU row loop takes Fixed<true> or Fixed<false> once per row (rule.h, with_update).
  static constexpr bool kSpecializes = true;
  template <typename acc_t, class F>
  static void specialize(const Params<acc_t>& p, F&& f) {
    if (p.half) {
      f(Fixed<true>{});
    } else {
      f(Fixed<false>{});
    }
  }

  // The CUDA packs branch per element, the same way in every lane of a warp.
  template <typename acc_t>
  VELOCE_HD static acc_t update(const Params<acc_t>& p, acc_t w, acc_t g, Elem<acc_t, kVectors>& s, acc_t row) {
    return p.half ? Fixed<true>::update(p, w, g, s, row) : Fixed<false>::update(p, w, g, s, row);
  }
};

}  // namespace optim
}  // namespace veloce
