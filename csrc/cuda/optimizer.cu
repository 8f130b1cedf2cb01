// CUDA kernel of the optimizer family: sparse_update, the fused sparse optimizer step.
// Semantics (docs/ops.md, "optimizer"); CPU reference csrc/cpu/optimizer.cpp (argument
// checks shared with it in veloce/op_checks.h, same arithmetic per element).
//
// A group of `lanes` threads (a power of two <= 32) per updated row; each lane owns V
// consecutive columns and reads the row, its gradient and its state with 16-byte loads,
// applies the rule in float (double for float64) and writes row and state back: one pass.
// RowWiseAdagrad first reduces sum(g^2) over the group with shuffles.

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "veloce/cuda_utils.cuh"
#include "veloce/op_checks.h"
#include "veloce/update_rule.cuh"

namespace veloce {
namespace cuda {
namespace {

template <typename scalar_t, int V>
__global__ void sparse_update_kernel(scalar_t* __restrict__ weights,                 // (C, D)
                                     at::opmath_type<scalar_t>* __restrict__ state,  // (C, S)
                                     const int64_t* __restrict__ slots,              // (U,)
                                     const scalar_t* __restrict__ grads,             // (U, D)
                                     int64_t U, int64_t D, int64_t S, UpdateRule<at::opmath_type<scalar_t>> rule,
                                     int lanes) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t u = t / lanes;
  if (u >= U) return;  // the whole group: its lanes share u
  const int lane = static_cast<int>(t % lanes);
  const int64_t slot = slots[u];
  scalar_t* w_row = weights + slot * D;
  acc_t* st = state + slot * S;
  const scalar_t* g_row = grads + u * D;
  const int64_t first = static_cast<int64_t>(lane) * V, step = static_cast<int64_t>(lanes) * V;

  // g = grad + weight_decay * w, in acc_t.
  auto gradient = [&](const Pack<scalar_t, V>& w, const Pack<scalar_t, V>& gin, acc_t (&g)[V]) {
#pragma unroll
    for (int j = 0; j < V; ++j) g[j] = static_cast<acc_t>(gin.v[j]);
    add_weight_decay(rule, w, g);
  };

  acc_t mult = 0;  // RowWiseAdagrad: lr / (sqrt(s) + eps) from the whole row
  if (rule.opt == kRowWiseAdagrad) {
    acc_t sq = 0;
    for (int64_t c = first; c < D; c += step) {
      acc_t g[V];
      gradient(load_pack<scalar_t, V>(w_row + c), load_pack<scalar_t, V>(g_row + c), g);
#pragma unroll
      for (int j = 0; j < V; ++j) sq += g[j] * g[j];
    }
    mult = rowwise_factor(rule, sq, st, D, lane, lanes, group_mask(lanes));
  }
  for (int64_t c = first; c < D; c += step) {
    Pack<scalar_t, V> w = load_pack<scalar_t, V>(w_row + c);
    acc_t g[V];
    gradient(w, load_pack<scalar_t, V>(g_row + c), g);
    update_pack(rule, w, g, st, c, D, mult);
    store_pack<scalar_t, V>(w_row + c, w);
  }
}

// slots must be in [0, C) and unique. Fast path: min, max and "strictly increasing" in
// one device-to-host copy (a sync); the sort for duplicates runs only when unsorted.
void check_update_slots(const char* op, const at::Tensor& s, int64_t C) {
  const int64_t U = s.numel();
  if (U == 0) return;
  const auto mm = at::aminmax(s);
  const at::Tensor unsorted =
      U > 1 ? (s.slice(0, 1) <= s.slice(0, 0, U - 1)).any().to(at::kLong).reshape({1}) : at::zeros({1}, s.options());
  const at::Tensor host = at::cat({std::get<0>(mm).reshape({1}), std::get<1>(mm).reshape({1}), unsorted}).cpu();
  const int64_t* v = host.data_ptr<int64_t>();
  if (v[0] < 0 || v[1] >= C) {
    const at::Tensor all = s.cpu();
    check_update_slot_range(op, all.data_ptr<int64_t>(), U, C);
  }
  if (v[2] == 0) return;  // strictly increasing: unique
  const at::Tensor sorted = std::get<0>(s.sort());
  const at::Tensor dup = (sorted.slice(0, 1) == sorted.slice(0, 0, U - 1)).nonzero();  // sync
  check_update_slots_unique(op, dup.numel() == 0, dup.numel() ? sorted[dup[0][0]].item<int64_t>() : 0);
}

void sparse_update_cuda(const at::Tensor& weights, const at::Tensor& opt_state, const at::Tensor& slots,
                        const at::Tensor& grads, int64_t optimizer, double lr, double eps, double beta1,
                        double beta2, double weight_decay, int64_t step) {
  constexpr const char* op = "veloce::sparse_update";
  const int64_t S = check_update_rows(op, weights, opt_state, optimizer);
  check_update_grads(op, weights, slots, grads);
  check_update_hyper(op, optimizer, lr, eps, beta1, beta2, step);
  const auto st = weights.scalar_type();
  const int64_t C = weights.size(0);
  const int64_t D = weights.size(1);
  const int64_t U = slots.numel();
  const c10::cuda::CUDAGuard guard(weights.device());
  const at::Tensor s = slots.contiguous();
  check_update_slots(op, s, C);
  if (U == 0 || D == 0) return;

  const at::Tensor g = grads.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "sparse_update_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto rule = UpdateRule<acc_t>::make(optimizer, lr, eps, beta1, beta2, weight_decay, step);
    acc_t* state = S > 0 ? opt_state.data_ptr<acc_t>() : nullptr;
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const int lanes = lanes_for(D, V);
      sparse_update_kernel<scalar_t, V><<<grid_for(U * lanes), kThreads, 0, stream()>>>(
          weights.data_ptr<scalar_t>(), state, s.data_ptr<int64_t>(), g.data_ptr<scalar_t>(), U, D, S, rule, lanes);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int kVec = vec16<scalar_t>();
    const bool vec = D % kVec == 0 && aligned16(weights.data_ptr()) && aligned16(g.data_ptr()) &&
                     (state == nullptr || S == 1 || aligned16(state));
    if (vec) {
      launch(std::integral_constant<int, kVec>());
    } else {
      launch(std::integral_constant<int, 1>());
    }
  });
}

}  // namespace
}  // namespace cuda
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CUDA, m) { m.impl("sparse_update", &veloce::cuda::sparse_update_cuda); }
