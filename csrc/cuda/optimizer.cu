// CUDA kernels of the optimizer family: sparse_update, the fused sparse optimizer step, and
// nonfinite_flags, the NaN/Inf check of gradients before an update.
// Semantics (docs/ops.md, "optimizer"); CPU reference csrc/cpu/optimizer.cpp (argument
// checks shared with it in veloce/op_checks.h, same arithmetic per element).
//
// A group of `lanes` threads (a power of two <= 32) per updated row; each lane owns V
// consecutive columns and reads the row, its gradient and its state with 16-byte loads,
// applies the rule in float (double for float64) and writes row and state back: one pass.
// A rule with a row prologue (RowWiseAdagrad) first reduces sum(g^2) over the group with
// shuffles. One kernel instance per rule (optim::dispatch); each thread makes the rule's
// parameters from hparams in device memory.

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <map>
#include <vector>

#include "veloce/cuda_utils.cuh"
#include "veloce/nonfinite.h"
#include "veloce/op_checks.h"
#include "veloce/optim/pack.cuh"

namespace veloce {
namespace cuda {
namespace {

template <class R, typename scalar_t, int V>
__global__ void sparse_update_kernel(scalar_t* __restrict__ weights,                 // (C, D)
                                     at::opmath_type<scalar_t>* __restrict__ state,  // (C, S)
                                     const int64_t* __restrict__ slots,              // (U,)
                                     const scalar_t* __restrict__ grads,             // (U, D)
                                     int64_t U, int64_t D, int64_t S, const double* __restrict__ hparams,
                                     int lanes) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t u = t / lanes;
  if (u >= U) return;  // the whole group: its lanes share u
  const auto p = R::template make<acc_t>(hparams);
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
    add_weight_decay<R>(p, w, g);
  };

  acc_t row = 0;  // the rule's factor from the whole row (RowWiseAdagrad: lr / (sqrt(s) + eps))
  if constexpr (R::kRowPrologue) {
    acc_t sq = 0;
    for (int64_t c = first; c < D; c += step) {
      acc_t g[V];
      gradient(load_pack<scalar_t, V>(w_row + c), load_pack<scalar_t, V>(g_row + c), g);
#pragma unroll
      for (int j = 0; j < V; ++j) sq += g[j] * g[j];
    }
    row = row_factor<R>(p, sq, st, D, lane, lanes, group_mask(lanes));
  }
  for (int64_t c = first; c < D; c += step) {
    Pack<scalar_t, V> w = load_pack<scalar_t, V>(w_row + c);
    acc_t g[V];
    gradient(w, load_pack<scalar_t, V>(g_row + c), g);
    StatePack<R, acc_t, V> s = load_state<R, acc_t, V>(st, c, D);
    apply_pack<R>(p, w, g, s, row);
    store_state<R>(st, c, D, s);
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
                        const at::Tensor& grads, int64_t optimizer, const at::Tensor& hparams) {
  constexpr const char* op = "veloce::sparse_update";
  const int64_t S = check_update_args(op, weights, opt_state, optimizer, hparams);
  check_update_grads(op, weights, slots, grads);
  const auto st = weights.scalar_type();
  const int64_t C = weights.size(0);
  const int64_t D = weights.size(1);
  const int64_t U = slots.numel();
  const c10::cuda::CUDAGuard guard(weights.device());
  const at::Tensor s = slots.contiguous();
  check_update_slots(op, s, C);
  if (U == 0 || D == 0) return;

  const at::Tensor g = grads.contiguous();
  const at::Tensor h = hparams.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "sparse_update_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* state = S > 0 ? opt_state.data_ptr<acc_t>() : nullptr;
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const int lanes = lanes_for(D, V);
      optim::dispatch(optimizer, [&](auto rule) {
        sparse_update_kernel<decltype(rule), scalar_t, V><<<grid_for(U * lanes), kThreads, 0, stream()>>>(
            weights.data_ptr<scalar_t>(), state, s.data_ptr<int64_t>(), g.data_ptr<scalar_t>(), U, D, S,
            h.data_ptr<double>(), lanes);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
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

// ---- nonfinite_flags ----------------------------------------------------------------------
//
// Up to kFlagGroup tensors of one dtype per launch, passed as a kernel parameter. Their
// elements are cut into units of 16 bytes (V elements), numbered across the tensors
// (base: each tensor's first unit); a grid-stride loop reads kFlagUnroll units per thread
// at a time, as raw bits, and a thread that finds a NaN or infinity sets its tensor's
// owner flag and the "any" flag (plain stores of true: racing writers write the same).
constexpr int kFlagGroup = 32;
constexpr int kFlagUnroll = 4;

struct FlagGroup {
  int32_t K;                      // tensors in the launch, 1 <= K <= kFlagGroup
  int32_t owner[kFlagGroup];      // the flag of each tensor
  int64_t base[kFlagGroup + 1];   // tensor k's units: [base[k], base[k + 1])
  int64_t numel[kFlagGroup];      // its elements
  const void* data[kFlagGroup];   // its elements
  bool aligned[kFlagGroup];       // 16-byte aligned: whole units are read with one vector load
};

template <typename scalar_t>
__global__ void nonfinite_flags_kernel(const __grid_constant__ FlagGroup g, bool* __restrict__ flags,
                                       int64_t num_owners) {
  using bits_t = typename FloatBits<scalar_t>::bits_t;
  constexpr int V = 16 / sizeof(bits_t);
  const int64_t total = g.base[g.K];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u0 < total;
       u0 += kFlagUnroll * stride) {
    int k[kFlagUnroll];
    alignas(16) bits_t x[kFlagUnroll][V];  // each row is one 16-byte vector
#pragma unroll
    for (int r = 0; r < kFlagUnroll; ++r) {  // every load first, then the tests
      const int64_t u = u0 + r * stride;
      k[r] = -1;
      if (u >= total) continue;
      const int lo = segment_of(g.base, g.K, u);  // the tensor of unit u
      k[r] = lo;
      const int64_t start = (u - g.base[lo]) * V;
      const bits_t* p = static_cast<const bits_t*>(g.data[lo]) + start;
      if (g.aligned[lo] && start + V <= g.numel[lo]) {
        *reinterpret_cast<uint4*>(x[r]) = *reinterpret_cast<const uint4*>(p);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) x[r][j] = start + j < g.numel[lo] ? p[j] : bits_t{0};
      }
    }
#pragma unroll
    for (int r = 0; r < kFlagUnroll; ++r) {
      if (k[r] < 0) continue;
      bool bad = false;
#pragma unroll
      for (int j = 0; j < V; ++j) bad |= nonfinite_bits<scalar_t>(x[r][j]);
      if (bad) {
        flags[g.owner[k[r]]] = true;
        flags[num_owners] = true;
      }
    }
  }
}

at::Tensor nonfinite_flags_cuda(at::TensorList tensors, at::IntArrayRef owner, int64_t num_owners) {
  constexpr const char* op = "veloce::nonfinite_flags";
  check_nonfinite_args(op, tensors, owner, num_owners);
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  at::Tensor flags = at::zeros({num_owners + 1}, tensors[0].options().dtype(at::kBool));
  // The tensors by dtype (one kernel instance each), kept alive contiguous until launched.
  std::map<at::ScalarType, std::vector<size_t>> by_dtype;
  std::vector<at::Tensor> data(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;
    data[i] = tensors[i].contiguous();
    by_dtype[tensors[i].scalar_type()].push_back(i);
  }
  const int64_t max_blocks = int64_t{8} * num_sms();  // 2048 threads each
  for (const auto& [dtype, idx] : by_dtype) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "nonfinite_flags_cuda", [&] {
      constexpr int64_t V = 16 / sizeof(scalar_t);
      for (size_t first = 0; first < idx.size(); first += kFlagGroup) {
        FlagGroup g{};
        g.K = static_cast<int32_t>(std::min<size_t>(kFlagGroup, idx.size() - first));
        for (int k = 0; k < g.K; ++k) {
          const size_t i = idx[first + k];
          g.owner[k] = static_cast<int32_t>(owner[i]);
          g.numel[k] = data[i].numel();
          g.data[k] = data[i].data_ptr();
          g.aligned[k] = aligned16(g.data[k]);
          g.base[k + 1] = g.base[k] + ceil_div(g.numel[k], V);
        }
        const int64_t blocks = std::min(max_blocks, ceil_div(g.base[g.K], int64_t{kThreads} * kFlagUnroll));
        nonfinite_flags_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream()>>>(
            g, flags.data_ptr<bool>(), num_owners);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  }
  return flags;
}

}  // namespace
}  // namespace cuda
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CUDA, m) {
  m.impl("sparse_update", &veloce::cuda::sparse_update_cuda);
  m.impl("nonfinite_flags", &veloce::cuda::nonfinite_flags_cuda);
}
