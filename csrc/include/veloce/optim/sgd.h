// SGD: w -= lr * g (torch.optim.SGD without momentum). No state.
#pragma once

#include "veloce/optim/rule.h"

namespace veloce {
namespace optim {

struct SGD {
  static constexpr const char* kName = "SGD";
  static constexpr int kHparams = 0;
  static constexpr int kVectors = 0;
  static constexpr int kRowValues = 0;
  static constexpr bool kRowPrologue = false;
  static constexpr const char* kStateFormula = "0";

  template <typename acc_t>
  struct Params {
    acc_t lr, wd;
  };

  template <typename acc_t>
  VELOCE_HD static Params<acc_t> make(const double* h) {
    return {static_cast<acc_t>(h[kLr]), static_cast<acc_t>(h[kWeightDecay])};
  }

  static void check(const char*, const double*) {}

  template <typename acc_t>
  VELOCE_HD static acc_t update(const Params<acc_t>& p, acc_t w, acc_t g, Elem<acc_t, kVectors>&, acc_t) {
    return w - p.lr * g;
  }
};

}  // namespace optim
}  // namespace veloce
