// The sparse optimizer rules on the device, one 16-byte pack of a row at a time: shared by
// sparse_update (csrc/cuda/optimizer.cu) and the fused accumulate_and_update
// (csrc/cuda/embedding.cu), so both run the same arithmetic as UpdateRule::apply on the
// CPU (veloce/optimizer.h).
#pragma once

#include "veloce/cuda_utils.cuh"
#include "veloce/optimizer.h"

namespace veloce {
namespace cuda {

// g (V,) += weight_decay * w: the gradient the rules see.
template <typename scalar_t, typename acc_t, int V>
__device__ __forceinline__ void add_weight_decay(const UpdateRule<acc_t>& r, const Pack<scalar_t, V>& w,
                                                 acc_t (&g)[V]) {
  if (r.wd == acc_t(0)) return;
#pragma unroll
  for (int j = 0; j < V; ++j) g[j] += r.wd * static_cast<acc_t>(w.v[j]);
}

// The state of columns [c, c + V) of one row, in registers: Adagrad's sum of squares (a),
// Adam's m (a) and v (b); nothing for SGD and RowWiseAdagrad (one value per row, see
// rowwise_factor). Loading it apart from the update lets a kernel issue these loads early.
template <typename acc_t, int V>
struct StatePack {
  Pack<acc_t, V> a, b;
};

// st: the row's S entries.
template <typename acc_t, int V>
__device__ __forceinline__ StatePack<acc_t, V> load_state(const UpdateRule<acc_t>& r, const acc_t* __restrict__ st,
                                                          int64_t c, int64_t D) {
  StatePack<acc_t, V> s;
  if (r.opt == kAdagrad || r.opt == kAdam) s.a = load_pack<acc_t, V>(st + c);
  if (r.opt == kAdam) s.b = load_pack<acc_t, V>(st + D + c);
  return s;
}

template <typename acc_t, int V>
__device__ __forceinline__ void store_state(const UpdateRule<acc_t>& r, acc_t* __restrict__ st, int64_t c,
                                            int64_t D, const StatePack<acc_t, V>& s) {
  if (r.opt == kAdagrad || r.opt == kAdam) store_pack<acc_t, V>(st + c, s.a);
  if (r.opt == kAdam) store_pack<acc_t, V>(st + D + c, s.b);
}

// Applies the rule to V columns of one row in registers: w and its state s (load_state);
// g already includes weight decay. RowWiseAdagrad uses `mult` (lr / (sqrt(s) + eps), from
// the whole row) and leaves its state to the caller.
template <typename scalar_t, typename acc_t, int V>
__device__ __forceinline__ void apply_pack(const UpdateRule<acc_t>& r, Pack<scalar_t, V>& w, const acc_t (&g)[V],
                                           StatePack<acc_t, V>& s, acc_t mult) {
  if (r.opt == kSGD) {
#pragma unroll
    for (int j = 0; j < V; ++j) w.v[j] = static_cast<scalar_t>(static_cast<acc_t>(w.v[j]) - r.lr * g[j]);
  } else if (r.opt == kAdagrad) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      s.a.v[j] = s.a.v[j] + g[j] * g[j];
      w.v[j] = static_cast<scalar_t>(static_cast<acc_t>(w.v[j]) - r.lr * (g[j] / (std::sqrt(s.a.v[j]) + r.eps)));
    }
  } else if (r.opt == kRowWiseAdagrad) {
#pragma unroll
    for (int j = 0; j < V; ++j) w.v[j] = static_cast<scalar_t>(static_cast<acc_t>(w.v[j]) - mult * g[j]);
  } else {  // Adam, state [m (D), v (D)]
#pragma unroll
    for (int j = 0; j < V; ++j) {
      s.a.v[j] = s.a.v[j] + (g[j] - s.a.v[j]) * r.b1c;
      s.b.v[j] = s.b.v[j] + (g[j] * g[j] - s.b.v[j]) * r.b2c;
      w.v[j] = static_cast<scalar_t>(static_cast<acc_t>(w.v[j]) -
                                     r.step_size * (s.a.v[j] / (std::sqrt(s.b.v[j]) + r.eps)));
    }
  }
}

// Applies the rule to columns [c, c + V) of one row: w (in registers) and its state st
// (the row's S entries), loaded and stored here.
template <typename scalar_t, typename acc_t, int V>
__device__ __forceinline__ void update_pack(const UpdateRule<acc_t>& r, Pack<scalar_t, V>& w, const acc_t (&g)[V],
                                            acc_t* __restrict__ st, int64_t c, int64_t D, acc_t mult) {
  StatePack<acc_t, V> s = load_state<acc_t, V>(r, st, c, D);
  apply_pack(r, w, g, s, mult);
  store_state(r, st, c, D, s);
}

// RowWiseAdagrad's per-row factor from sq, this lane's sum of g^2 over its columns: the
// sum over the `lanes` lanes of one group (shuffles within `mask`), s += sum / D (lane 0
// writes it; every lane reads the old value first), lr / (sqrt(s) + eps).
template <typename acc_t>
__device__ __forceinline__ acc_t rowwise_factor(const UpdateRule<acc_t>& r, acc_t sq, acc_t* __restrict__ st,
                                                int64_t D, int lane, int lanes, unsigned mask) {
  const acc_t s_old = st[0];
  for (int d = lanes / 2; d > 0; d >>= 1) sq += __shfl_xor_sync(mask, sq, d);
  const acc_t s = s_old + sq / static_cast<acc_t>(D);
  if (lane == 0) st[0] = s;
  return r.lr / (std::sqrt(s) + r.eps);
}

}  // namespace cuda
}  // namespace veloce
