// A sparse optimizer rule (optim/rule.h) on the device, one 16-byte pack of a row at a time:
// shared by sparse_update (csrc/cuda/optimizer.cu) and the fused accumulate_and_update
// (csrc/cuda/embedding.cu). Each element goes through the rule's update(), as apply_row
// does on the CPU; the kernels are instantiated per rule (optim::dispatch), so everything
// here inlines into straight register code.
#pragma once

#include "veloce/cuda_utils.cuh"
#include "veloce/optim/registry.h"

namespace veloce {
namespace cuda {

// g (V,) += weight_decay * w: the gradient the rules see.
template <class R, typename scalar_t, typename acc_t, int V>
__device__ __forceinline__ void add_weight_decay(const typename R::template Params<acc_t>& p,
                                                 const Pack<scalar_t, V>& w, acc_t (&g)[V]) {
  if (p.wd == acc_t(0)) return;
#pragma unroll
  for (int j = 0; j < V; ++j) g[j] += p.wd * static_cast<acc_t>(w.v[j]);
}

// The state vectors of columns [c, c + V) of one row, in registers (nothing for rules with
// none). Loading them apart from the update lets a kernel issue these loads early.
template <class R, typename acc_t, int V>
struct StatePack {
  Pack<acc_t, V> p[R::kVectors > 0 ? R::kVectors : 1];
};

// st: the row's S entries.
template <class R, typename acc_t, int V>
__device__ __forceinline__ StatePack<R, acc_t, V> load_state(const acc_t* __restrict__ st, int64_t c, int64_t D) {
  StatePack<R, acc_t, V> s;
#pragma unroll
  for (int k = 0; k < R::kVectors; ++k) s.p[k] = load_pack<acc_t, V>(st + k * D + c);
  return s;
}

template <class R, typename acc_t, int V>
__device__ __forceinline__ void store_state(acc_t* __restrict__ st, int64_t c, int64_t D,
                                            const StatePack<R, acc_t, V>& s) {
#pragma unroll
  for (int k = 0; k < R::kVectors; ++k) store_pack<acc_t, V>(st + k * D + c, s.p[k]);
}

// Applies the rule to V columns of one row in registers: w and its state s (load_state);
// g already includes weight decay; `row` is the row's factor (row_factor) or unused.
template <class R, typename scalar_t, typename acc_t, int V>
__device__ __forceinline__ void apply_pack(const typename R::template Params<acc_t>& p, Pack<scalar_t, V>& w,
                                           const acc_t (&g)[V], StatePack<R, acc_t, V>& s, acc_t row) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    optim::Elem<acc_t, R::kVectors> e;
#pragma unroll
    for (int k = 0; k < R::kVectors; ++k) e.v[k] = s.p[k].v[j];
    w.v[j] = static_cast<scalar_t>(R::update(p, static_cast<acc_t>(w.v[j]), g[j], e, row));
#pragma unroll
    for (int k = 0; k < R::kVectors; ++k) s.p[k].v[j] = e.v[k];
  }
}

// The row's factor of a rule with a row prologue, from sq, this lane's sum of g^2 over its
// columns: the sum over the `lanes` lanes of one group (shuffles within `mask`), then the
// rule's row() on the row's state (lane 0 writes it; every lane reads the old value first).
template <class R, typename acc_t>
__device__ __forceinline__ acc_t row_factor(const typename R::template Params<acc_t>& p, acc_t sq,
                                            acc_t* __restrict__ st, int64_t D, int lane, int lanes, unsigned mask) {
  acc_t s = st[R::kVectors * D];
  for (int d = lanes / 2; d > 0; d >>= 1) sq += __shfl_xor_sync(mask, sq, d);
  const acc_t f = R::row(p, sq, s, D);
  if (lane == 0) st[R::kVectors * D] = s;
  return f;
}

}  // namespace cuda
}  // namespace veloce
