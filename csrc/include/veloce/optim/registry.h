// The sparse optimizers, one line each: id (the `optimizer` argument of the updating ops,
// veloce.ops.optimizer.OPTIMIZERS) and rule (optim/<name>.h). Adding an optimizer is a
// rule header, a line here and its Python config (a file of veloce/optim/): no schema changes, since
// the ops take the hyperparameters as one tensor and the insert path the initial state.
#pragma once

#include <cstdint>
#include <string>

#include "veloce/optim/adagrad.h"
#include "veloce/optim/adam.h"
#include "veloce/optim/ftrl.h"
#include "veloce/optim/rowwise_adagrad.h"
#include "veloce/optim/sgd.h"

#define VELOCE_OPTIMIZERS(X) \
  X(0, SGD)                  \
  X(1, Adagrad)              \
  X(2, RowWiseAdagrad)       \
  X(3, Adam)                 \
  X(4, FTRL)

namespace veloce {
namespace optim {

#define VELOCE_COUNT_ONE(id, R) +1
constexpr int64_t kNumOptimizers = 0 VELOCE_OPTIMIZERS(VELOCE_COUNT_ONE);
#undef VELOCE_COUNT_ONE

// A rule's state vectors are loaded in 16-byte packs from state + k * D: no values per row
// may precede or sit between them (RowWiseAdagrad's one value is read alone).
#define VELOCE_CHECK_RULE(id, R)                                                                      \
  static_assert(R::kVectors == 0 || R::kRowValues == 0, #R ": state vectors and row values mixed"); \
  static_assert(id >= 0 && id < kNumOptimizers, #R ": ids run from 0 without gaps");
VELOCE_OPTIMIZERS(VELOCE_CHECK_RULE)
#undef VELOCE_CHECK_RULE

// Raises for an id no line of VELOCE_OPTIMIZERS has (defined in csrc/op_checks.cpp).
[[noreturn]] void fail_unknown_optimizer(int64_t opt);

// f(R{}) for the rule of optimizer id `opt` (checked by the caller: check_optimizer_id).
// The one place that turns the runtime id into a rule type: kernels are instantiated per
// rule from here.
template <typename F>
decltype(auto) dispatch(int64_t opt, F&& f) {
  switch (opt) {
#define VELOCE_CASE(id, R) \
  case id:                 \
    return f(R{});
    VELOCE_OPTIMIZERS(VELOCE_CASE)
#undef VELOCE_CASE
    default:
      fail_unknown_optimizer(opt);
  }
}

// "0 (SGD), 1 (Adagrad), ... or 4 (FTRL)".
inline std::string optimizer_choices() {
  std::string out;
  int64_t i = 0;
#define VELOCE_NAME(id, R)                                                       \
  out += (i == 0 ? "" : i + 1 == kNumOptimizers ? " or " : ", ") + std::to_string(id) + \
         " (" + R::kName + ")";                                                  \
  ++i;
  VELOCE_OPTIMIZERS(VELOCE_NAME)
#undef VELOCE_NAME
  return out;
}

// Raises unless opt is an id of VELOCE_OPTIMIZERS (defined in csrc/op_checks.cpp).
void check_optimizer_id(const char* op, int64_t opt);

// State width S per row for dim D, and the rule's facts for messages.
inline int64_t state_width(int64_t opt, int64_t D) {
  return dispatch(opt, [&](auto r) { return decltype(r)::kVectors * D + decltype(r)::kRowValues; });
}
inline const char* optimizer_name(int64_t opt) {
  return dispatch(opt, [](auto r) { return decltype(r)::kName; });
}
inline const char* state_formula(int64_t opt) {
  return dispatch(opt, [](auto r) { return decltype(r)::kStateFormula; });
}
// The length of hparams: [lr, step, weight_decay] and the rule's own values.
inline int64_t num_hparams(int64_t opt) {
  return dispatch(opt, [](auto r) { return int64_t{kOwn} + decltype(r)::kHparams; });
}

}  // namespace optim
}  // namespace veloce
