// What every sparse optimizer rule shares: the hyperparameter layout, the per-element state
// in registers, and the row loop of the CPU kernels. A rule is a struct (optim/<name>.h) of
//
//   kHparams            its own hyperparameters, after [lr, step, weight_decay] in hparams
//   kVectors            state vectors of D values per row (state[k * D + j], k < kVectors)
//   kRowValues          state values per row after them (state[kVectors * D + i])
//   kRowPrologue        whether the update needs the row's sum of g^2 first (row())
//   kStateFormula       S in words, for messages ("2 * D")
//   Params<acc_t>       the values one update reads, with `wd` (weight decay) among them
//   make<acc_t>(h)      Params from hparams h, on the host or the device (a kernel reads h
//                       from device memory: a captured CUDA graph sees values written there)
//   check(op, h)        the host checks of its own values (the CPU reads hparams there)
//   row(p, sq, s, D)    (kRowPrologue) from sq = sum of g^2 over the row: updates the row's
//                       state s, returns the factor update() receives as `row`
//   update(p, w, g, s, row)  one element: w and its kVectors state values s (updated in
//                       place); returns the new w. g already holds grad + weight_decay * w.
//   specialize(p, f)    (optional, with kSpecializes) calls f with a type whose static
//                       update() is update() for these parameters with their runtime
//                       choices fixed at compile time (FTRL: sqrt or pow), so that the CPU
//                       row loop has no branch around a call and vectorizes
//
// The CPU loop (apply_row below) and the CUDA pack loop (optim/pack.cuh) call the same
// functions, so both run the same arithmetic per element. The registry (optim/registry.h)
// lists the rules; kernels are instantiated per rule, never branching on the optimizer.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "veloce/macros.h"

namespace veloce {
namespace optim {

// hparams: float64 [lr, step, weight_decay, <the rule's own kHparams values>].
constexpr int kLr = 0;
constexpr int kStep = 1;
constexpr int kWeightDecay = 2;
constexpr int kOwn = 3;  // the index of a rule's first own value

// An element's state values in registers (one unused value for rules without any).
template <typename acc_t, int N>
struct Elem {
  acc_t v[N > 0 ? N : 1];
};

// Host check of one value: unless ok, raises "<op>: <name> must be <want>, got <got>
// (hparams[<index>])". Defined in csrc/op_checks.cpp (no .cu file formats messages).
void check_hparam(const char* op, bool ok, const char* name, int index, const char* want, double got);

// Whether R picks its update() per row (kSpecializes, specialize()).
template <class R, class = void>
struct Specializes : std::false_type {};
template <class R>
struct Specializes<R, std::void_t<decltype(R::kSpecializes)>> : std::bool_constant<R::kSpecializes> {};

// The element loop of apply_row with U's update() (R or what R::specialize picked). Its
// pointers are restrict-qualified here, a state vector each (s0, s1: the row's first and
// second D values), so that the loop vectorizes without an aliasing check.
template <class R, class U, typename scalar_t, typename acc_t>
inline void update_elements(const typename R::template Params<acc_t>& p, scalar_t* __restrict__ w,
                            acc_t* __restrict__ s0, acc_t* __restrict__ s1, const acc_t* __restrict__ g,
                            int64_t D, acc_t row) {
  static_assert(R::kVectors <= 2, "apply_row loads at most two state vectors per row");
  for (int64_t j = 0; j < D; ++j) {
    Elem<acc_t, R::kVectors> e;
    if constexpr (R::kVectors > 0) e.v[0] = s0[j];
    if constexpr (R::kVectors > 1) e.v[R::kVectors > 1 ? 1 : 0] = s1[j];
    w[j] = static_cast<scalar_t>(U::update(p, static_cast<acc_t>(w[j]), g[j], e, row));
    if constexpr (R::kVectors > 0) s0[j] = e.v[0];
    if constexpr (R::kVectors > 1) s1[j] = e.v[R::kVectors > 1 ? 1 : 0];
  }
}

// The CPU update of one row: w (D,) and its state st (S,) with gradient g (D,) (overwritten
// with g + weight_decay * w).
template <class R, typename scalar_t, typename acc_t>
inline void apply_row(const typename R::template Params<acc_t>& p, scalar_t* __restrict__ w,
                      acc_t* __restrict__ st, acc_t* __restrict__ g, int64_t D) {
  if (p.wd != acc_t(0)) {
    for (int64_t j = 0; j < D; ++j) g[j] += p.wd * static_cast<acc_t>(w[j]);
  }
  acc_t row = 0;
  if constexpr (R::kRowPrologue) {
    acc_t sq = 0;
    for (int64_t j = 0; j < D; ++j) sq += g[j] * g[j];
    acc_t s = st[R::kVectors * D];
    row = R::row(p, sq, s, D);
    st[R::kVectors * D] = s;
  }
  acc_t* const s1 = R::kVectors > 1 ? st + D : nullptr;
  if constexpr (Specializes<R>::value) {
    R::specialize(p, [&](auto u) { update_elements<R, decltype(u)>(p, w, st, s1, g, D, row); });
  } else {
    update_elements<R, R>(p, w, st, s1, g, D, row);
  }
}

}  // namespace optim
}  // namespace veloce
