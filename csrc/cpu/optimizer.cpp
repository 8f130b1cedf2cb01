// CPU kernel of the optimizer family: sparse_update, the fused sparse optimizer step.
// Semantics (docs/ops.md, "optimizer"): for each unique slot, one pass reads the row and
// its state, applies the rule (veloce/optim/<name>.h) with g = grad + weight_decay * w, and
// writes both back.
// Every argument is validated before anything is written, so a bad call changes nothing.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "veloce/check.h"
#include "veloce/nonfinite.h"
#include "veloce/op_checks.h"
#include "veloce/optim/registry.h"

namespace veloce {
namespace {

constexpr int64_t kPrefetch = 8;  // rows ahead to prefetch

template <class R, typename scalar_t>
void sparse_update_kernel(scalar_t* weights,                  // (C, D)
                          at::opmath_type<scalar_t>* state,   // (C, S)
                          const int64_t* slots,               // (U,)
                          const scalar_t* grads,              // (U, D)
                          int64_t U, int64_t D, int64_t S,
                          const typename R::template Params<at::opmath_type<scalar_t>>& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, 4 * D));
  at::parallel_for(0, U, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> gbuf(D);
    acc_t* __restrict__ g = gbuf.data();
    for (int64_t u = begin; u < end; ++u) {
      const int64_t slot = slots[u];
      if (u + kPrefetch < end) {  // rows and states are random accesses into a large table
        const int64_t next = slots[u + kPrefetch];
        const char* pw = reinterpret_cast<const char*>(weights + next * D);
        for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64) __builtin_prefetch(pw + off, 1);
        const char* ps = reinterpret_cast<const char*>(state + next * S);
        for (int64_t off = 0; off < S * (int64_t)sizeof(acc_t); off += 64) __builtin_prefetch(ps + off, 1);
      }
      const scalar_t* __restrict__ gin = grads + u * D;
      for (int64_t j = 0; j < D; ++j) g[j] = static_cast<acc_t>(gin[j]);
      optim::apply_row<R>(p, weights + slot * D, state + slot * S, g, D);
    }
  });
}

void sparse_update_cpu(const at::Tensor& weights, const at::Tensor& opt_state, const at::Tensor& slots,
                       const at::Tensor& grads, int64_t optimizer, const at::Tensor& hparams) {
  constexpr const char* op = "veloce::sparse_update";
  const int64_t S = check_update_args(op, weights, opt_state, optimizer, hparams);
  check_hparam_values(op, hparams, optimizer);
  check_update_grads(op, weights, slots, grads);
  const auto st = weights.scalar_type();
  const int64_t C = weights.size(0);
  const int64_t D = weights.size(1);
  const int64_t U = slots.numel();
  const at::Tensor s_t = slots.contiguous();
  const int64_t* s = s_t.data_ptr<int64_t>();
  if (!check_update_slot_range(op, s, U, C)) {  // Unique but unsorted is allowed; a duplicate would race.
    std::vector<int64_t> sorted(s, s + U);
    std::sort(sorted.begin(), sorted.end());
    const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    check_update_slots_unique(op, dup == sorted.end(), dup == sorted.end() ? 0 : *dup);
  }
  if (U == 0 || D == 0) return;

  const at::Tensor g = grads.contiguous();
  const at::Tensor h = hparams.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "sparse_update_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    optim::dispatch(optimizer, [&](auto rule) {
      using R = decltype(rule);
      sparse_update_kernel<R, scalar_t>(weights.data_ptr<scalar_t>(), opt_state.data_ptr<acc_t>(), s,
                                        g.data_ptr<scalar_t>(), U, D, S,
                                        R::template make<acc_t>(h.data_ptr<double>()));
    });
  });
}

// Whether any of the n values at p is a NaN or an infinity (on their bits: see nonfinite.h).
template <typename scalar_t>
bool any_nonfinite(const scalar_t* p, int64_t n) {
  using bits_t = typename FloatBits<scalar_t>::bits_t;
  const bits_t* x = reinterpret_cast<const bits_t*>(p);
  return at::parallel_reduce(
      0, n, at::internal::GRAIN_SIZE, false,
      [&](int64_t begin, int64_t end, bool bad) {
        for (int64_t i = begin; i < end; ++i) bad |= nonfinite_bits<scalar_t>(x[i]);  // vectorizes: no early exit
        return bad;
      },
      [](bool a, bool b) { return a || b; });
}

at::Tensor nonfinite_flags_cpu(at::TensorList tensors, at::IntArrayRef owner, int64_t num_owners) {
  constexpr const char* op = "veloce::nonfinite_flags";
  check_nonfinite_args(op, tensors, owner, num_owners);
  at::Tensor flags = at::zeros({num_owners + 1}, tensors[0].options().dtype(at::kBool));
  bool* f = flags.data_ptr<bool>();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (f[owner[i]]) continue;  // this owner is flagged already
    const at::Tensor t = tensors[i].contiguous();
    bool bad = false;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "nonfinite_flags_cpu", [&] {
      bad = any_nonfinite(t.data_ptr<scalar_t>(), t.numel());
    });
    if (bad) f[owner[i]] = f[num_owners] = true;
  }
  return flags;
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CPU, m) {
  m.impl("sparse_update", &veloce::sparse_update_cpu);
  m.impl("nonfinite_flags", &veloce::nonfinite_flags_cpu);
}
