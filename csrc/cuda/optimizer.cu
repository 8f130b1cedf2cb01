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

namespace veloce {
namespace cuda {
namespace {

enum Optimizer : int64_t { kSGD = 0, kAdagrad = 1, kRowWiseAdagrad = 2, kAdam = 3 };

template <typename acc_t>
struct Hyper {
  acc_t lr, eps, wd, b1c, b2c, step_size;  // b1c = 1 - beta1, b2c = 1 - beta2
};

template <typename scalar_t, int V>
__global__ void sparse_update_kernel(scalar_t* __restrict__ weights,                 // (C, D)
                                     at::opmath_type<scalar_t>* __restrict__ state,  // (C, S)
                                     const int64_t* __restrict__ slots,              // (U,)
                                     const scalar_t* __restrict__ grads,             // (U, D)
                                     int64_t U, int64_t D, int64_t S, int64_t opt,
                                     Hyper<at::opmath_type<scalar_t>> h, int lanes) {
  using acc_t = at::opmath_type<scalar_t>;
  using WPack = Pack<scalar_t, V>;
  using SPack = Pack<acc_t, V>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t u = t / lanes;
  const int lane = static_cast<int>(t % lanes);
  const bool active = u < U;
  // Every lane of the warp stays until the RowWiseAdagrad shuffle; others may leave now.
  if (!active && opt != kRowWiseAdagrad) return;
  const int64_t slot = active ? slots[u] : 0;
  scalar_t* w_row = weights + slot * D;
  acc_t* st = state + slot * S;
  const scalar_t* g_row = grads + u * D;
  const int64_t first = static_cast<int64_t>(lane) * V, step = static_cast<int64_t>(lanes) * V;

  // g = grad + weight_decay * w, in acc_t.
  auto gradient = [&](const WPack& w, const WPack& gin, acc_t* g) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      g[j] = static_cast<acc_t>(gin.v[j]);
      if (h.wd != acc_t(0)) g[j] += h.wd * static_cast<acc_t>(w.v[j]);
    }
  };

  acc_t mult = 0;  // RowWiseAdagrad: lr / (sqrt(s) + eps)
  if (opt == kRowWiseAdagrad) {
    acc_t sq = 0;
    const acc_t s_old = active ? st[0] : acc_t(0);  // read before the shuffle, written after it
    if (active) {
      for (int64_t c = first; c < D; c += step) {
        acc_t g[V];
        gradient(load_pack<scalar_t, V>(w_row + c), load_pack<scalar_t, V>(g_row + c), g);
#pragma unroll
        for (int j = 0; j < V; ++j) sq += g[j] * g[j];
      }
    }
    for (int d = lanes / 2; d > 0; d >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, d);
    if (!active) return;
    const acc_t s = s_old + sq / static_cast<acc_t>(D);
    if (lane == 0) st[0] = s;
    mult = h.lr / (std::sqrt(s) + h.eps);
  }

  for (int64_t c = first; c < D; c += step) {
    WPack w = load_pack<scalar_t, V>(w_row + c);
    acc_t g[V];
    gradient(w, load_pack<scalar_t, V>(g_row + c), g);
    if (opt == kSGD) {
#pragma unroll
      for (int j = 0; j < V; ++j) w.v[j] = static_cast<scalar_t>(static_cast<acc_t>(w.v[j]) - h.lr * g[j]);
    } else if (opt == kAdagrad) {
      SPack s = load_pack<acc_t, V>(st + c);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        s.v[j] = s.v[j] + g[j] * g[j];
        w.v[j] = static_cast<scalar_t>(static_cast<acc_t>(w.v[j]) - h.lr * (g[j] / (std::sqrt(s.v[j]) + h.eps)));
      }
      store_pack<acc_t, V>(st + c, s);
    } else if (opt == kRowWiseAdagrad) {
#pragma unroll
      for (int j = 0; j < V; ++j) w.v[j] = static_cast<scalar_t>(static_cast<acc_t>(w.v[j]) - mult * g[j]);
    } else {  // Adam, state [m (D), v (D)]
      SPack m = load_pack<acc_t, V>(st + c);
      SPack v = load_pack<acc_t, V>(st + D + c);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        m.v[j] = m.v[j] + (g[j] - m.v[j]) * h.b1c;
        v.v[j] = v.v[j] + (g[j] * g[j] - v.v[j]) * h.b2c;
        w.v[j] = static_cast<scalar_t>(static_cast<acc_t>(w.v[j]) -
                                       h.step_size * (m.v[j] / (std::sqrt(v.v[j]) + h.eps)));
      }
      store_pack<acc_t, V>(st + c, m);
      store_pack<acc_t, V>(st + D + c, v);
    }
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

  double step_size = 0.0;
  if (optimizer == kAdam) {
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    step_size = lr * std::sqrt(bc2) / bc1;
  }
  const at::Tensor g = grads.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "sparse_update_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Hyper<acc_t> h{static_cast<acc_t>(lr),          static_cast<acc_t>(eps),
                         static_cast<acc_t>(weight_decay), static_cast<acc_t>(1.0 - beta1),
                         static_cast<acc_t>(1.0 - beta2),  static_cast<acc_t>(step_size)};
    acc_t* state = S > 0 ? opt_state.data_ptr<acc_t>() : nullptr;
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const int lanes = lanes_for(D, V);
      sparse_update_kernel<scalar_t, V><<<grid_for(U * lanes), kThreads, 0, stream()>>>(
          weights.data_ptr<scalar_t>(), state, s.data_ptr<int64_t>(), g.data_ptr<scalar_t>(), U, D, S, optimizer, h,
          lanes);
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
