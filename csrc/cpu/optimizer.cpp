// CPU kernel of the optimizer family: sparse_update, the fused sparse optimizer step.
// Semantics (docs/ops.md, "optimizer"): for each unique slot, one pass reads the row and
// its state, applies the rule with g = grad + weight_decay * w, and writes both back.
// Every argument is validated before anything is written, so a bad call changes nothing.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "veloce/check.h"
#include "veloce/optimizer.h"

namespace veloce {
namespace {

constexpr int64_t kPrefetch = 8;  // rows ahead to prefetch

const char* optimizer_name(int64_t opt) {
  switch (opt) {
    case kSGD: return "SGD";
    case kAdagrad: return "Adagrad";
    case kRowWiseAdagrad: return "RowWiseAdagrad";
    default: return "Adam";
  }
}

const char* state_formula(int64_t opt) {
  switch (opt) {
    case kSGD: return "0";
    case kAdagrad: return "D";
    case kRowWiseAdagrad: return "1";
    default: return "2 * D";
  }
}

template <typename scalar_t>
void sparse_update_kernel(scalar_t* weights,                  // (C, D)
                          at::opmath_type<scalar_t>* state,   // (C, S)
                          const int64_t* slots,               // (U,)
                          const scalar_t* grads,              // (U, D)
                          int64_t U, int64_t D, int64_t S, const UpdateRule<at::opmath_type<scalar_t>>& rule) {
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
      rule.apply(weights + slot * D, state + slot * S, g, D);
    }
  });
}

}  // namespace

int64_t check_update_args(const char* op, const at::Tensor& weights, const at::Tensor& opt_state, int64_t optimizer,
                          double lr, double eps, double beta1, double beta2, int64_t step) {
  TORCH_CHECK(optimizer >= kSGD && optimizer <= kAdam, op,
              ": optimizer must be 0 (SGD), 1 (Adagrad), 2 (RowWiseAdagrad) or 3 (Adam), got ", optimizer);
  const auto st = weights.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16, op,
              ": weights must be float32, float64, float16 or bfloat16, got ", dtype_name(st));
  check_dim(op, "weights", weights, 2);
  TORCH_CHECK(weights.is_contiguous(), op, ": weights must be contiguous (it is updated in place)");
  const int64_t C = weights.size(0);
  const int64_t D = weights.size(1);
  const at::ScalarType state_dtype = st == at::kDouble ? at::kDouble : at::kFloat;
  check_dtype(op, "opt_state", opt_state, state_dtype);
  check_dim(op, "opt_state", opt_state, 2);
  check_same_device(op, "opt_state", opt_state, "weights", weights);
  TORCH_CHECK(opt_state.is_contiguous(), op, ": opt_state must be contiguous (it is updated in place)");
  check_size(op, "opt_state", opt_state, 0, C, "weights.size(0)");
  const int64_t S = state_width(optimizer, D);
  TORCH_CHECK(opt_state.size(1) == S, op, ": opt_state.size(1) must be the state width of ",
              optimizer_name(optimizer), " (S = ", state_formula(optimizer), " = ", S, " for D = ", D, "), got ",
              opt_state.size(1));
  if (optimizer == kAdam) {
    TORCH_CHECK(step >= 1, op, ": step must be >= 1 for Adam (it is the 1-based step count), got ", step);
    TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1) for Adam, got ", beta1);
    TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1) for Adam, got ", beta2);
  }
  TORCH_CHECK(std::isfinite(lr) && lr >= 0.0, op, ": lr must be a finite number >= 0, got ", lr);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
  return S;
}

namespace {

void sparse_update_cpu(const at::Tensor& weights, const at::Tensor& opt_state, const at::Tensor& slots,
                       const at::Tensor& grads, int64_t optimizer, double lr, double eps, double beta1,
                       double beta2, double weight_decay, int64_t step) {
  constexpr const char* op = "veloce::sparse_update";
  const int64_t S = check_update_args(op, weights, opt_state, optimizer, lr, eps, beta1, beta2, step);
  const auto st = weights.scalar_type();
  const int64_t C = weights.size(0);
  const int64_t D = weights.size(1);
  check_dtype(op, "slots", slots, at::kLong);
  check_dim(op, "slots", slots, 1);
  check_same_device(op, "slots", slots, "weights", weights);
  const int64_t U = slots.numel();
  TORCH_CHECK(grads.scalar_type() == st, op, ": grads must have the dtype of weights (", dtype_name(st),
              "), got ", dtype_name(grads.scalar_type()));
  check_dim(op, "grads", grads, 2);
  check_same_device(op, "grads", grads, "weights", weights);
  check_size(op, "grads", grads, 0, U, "slots.numel()");
  check_size(op, "grads", grads, 1, D, "weights.size(1)");
  const at::Tensor s_t = slots.contiguous();
  const int64_t* s = s_t.data_ptr<int64_t>();
  bool increasing = true;
  for (int64_t u = 0; u < U; ++u) {
    TORCH_CHECK(s[u] >= 0 && s[u] < C, op, ": slots[", u, "] = ", s[u], " is out of range for weights with ", C,
                " rows");
    if (u > 0 && s[u] <= s[u - 1]) increasing = false;
  }
  if (!increasing) {  // Unique but unsorted is allowed; a duplicate would race.
    std::vector<int64_t> sorted(s, s + U);
    std::sort(sorted.begin(), sorted.end());
    const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    TORCH_CHECK(dup == sorted.end(), op, ": slots must be unique, got slot ", (dup == sorted.end() ? 0 : *dup),
                " more than once");
  }
  if (U == 0 || D == 0) return;

  const at::Tensor g = grads.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "sparse_update_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto rule = UpdateRule<acc_t>::make(optimizer, lr, eps, beta1, beta2, weight_decay, step);
    sparse_update_kernel<scalar_t>(weights.data_ptr<scalar_t>(), opt_state.data_ptr<acc_t>(), s,
                                   g.data_ptr<scalar_t>(), U, D, S, rule);
  });
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CPU, m) { m.impl("sparse_update", &veloce::sparse_update_cpu); }
