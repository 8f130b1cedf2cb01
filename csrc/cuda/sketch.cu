// CUDA kernels of feature admission (semantics: csrc/ops.cpp, docs/ops.md; CPU reference
// csrc/cpu/sketch.cpp). sketch_count and sketch_admit: two launches on the current stream,
// one thread per position adding its sightings (an atomicAdd per sketch row), then one
// thread per position reading the minimum of its counters after every add of the call
// (sketch_admit decides from it there). Each thread recomputes the rows' salts (a few
// multiplies) rather than reading them from memory. admission_tally: a memset and one
// reduction. No host sync.

#include <torch/library.h>

#include "veloce/cuda_utils.cuh"
#include "veloce/sketch.h"

namespace veloce {

namespace cuda {
namespace {

// skip: the op's (1,) flag, or null; when it holds true nothing is added (sketch_admit).
__global__ void sketch_add_kernel(int32_t* __restrict__ counters, const int64_t* __restrict__ ids,
                                  const bool* __restrict__ counted, const int64_t* __restrict__ sightings,
                                  const bool* __restrict__ skip, int64_t n, int64_t depth, int64_t width,
                                  int64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n || (counted != nullptr && !counted[i]) || (skip != nullptr && *skip)) return;
  const int add = sketch_add(sightings, i);
  if (add == 0) return;
  const int64_t id = ids[i];
  for (int64_t d = 0; d < depth; ++d) atomicAdd(counters + sketch_slot(id, sketch_salt(seed, d), d, width), add);
}

// The estimate of position i after every add of the call (the minimum of its counters),
// saturating them: a counter past kSketchCountLimit (it reaches at most 2^31 - 1, see
// sketch.h) is brought back to it by an atomicMin, which every reader may race to do.
__device__ __forceinline__ int32_t sketch_estimate(int32_t* __restrict__ counters, int64_t id, int64_t depth,
                                                   int64_t width, int64_t seed) {
  int32_t low = kSketchCountLimit;
  for (int64_t d = 0; d < depth; ++d) {
    int32_t* const slot = counters + sketch_slot(id, sketch_salt(seed, d), d, width);
    const int32_t v = *slot;
    if (v > kSketchCountLimit) atomicMin(slot, kSketchCountLimit);
    low = min(low, v);
  }
  return low;
}

__global__ void sketch_estimate_kernel(int32_t* __restrict__ counters, const int64_t* __restrict__ ids,
                                       int64_t* __restrict__ estimate, int64_t n, int64_t depth, int64_t width,
                                       int64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  estimate[i] = sketch_estimate(counters, ids[i], depth, width, seed);
}

__global__ void sketch_decide_kernel(int32_t* __restrict__ counters, const int64_t* __restrict__ ids,
                                     bool* __restrict__ admit, int64_t n, int64_t depth, int64_t width, int64_t seed,
                                     int64_t min_count, double p, uint64_t draw_salt) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t id = ids[i];
  admit[i] = sketch_decide(id, sketch_estimate(counters, id, depth, width, seed), min_count, p, draw_salt);
}

// admission_tally: per block the two counts (warp shuffles, then across the block's warps),
// added by one thread to stats[0:2] and stats[2:4] (zeroed first by the launcher).
__global__ void tally_kernel(unsigned long long* __restrict__ stats, const int64_t* __restrict__ slots,
                             const int64_t* __restrict__ sightings, int64_t n, int64_t capacity) {
  unsigned long long own = 0, refused = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = slots[i];
    const unsigned long long times = sightings != nullptr ? static_cast<unsigned long long>(sightings[i]) : 1ull;
    own += (s >= 0 && s < capacity) ? times : 0ull;
    refused += s == capacity ? times : 0ull;
  }
  auto warp_sum = [](unsigned long long v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
  };
  own = warp_sum(own);
  refused = warp_sum(refused);
  __shared__ unsigned long long part[2][kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (lane == 0) {
    part[0][warp] = own;
    part[1][warp] = refused;
  }
  __syncthreads();
  if (warp != 0) return;
  own = lane < kThreads / 32 ? part[0][lane] : 0ull;
  refused = lane < kThreads / 32 ? part[1][lane] : 0ull;
  own = warp_sum(own);
  refused = warp_sum(refused);
  if (lane != 0 || (own == 0 && refused == 0)) return;
  atomicAdd(stats + 0, own);
  atomicAdd(stats + 1, refused);
  atomicAdd(stats + 2, own);
  atomicAdd(stats + 3, refused);
}

at::Tensor contiguous_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

// The adds of sketch_count and sketch_admit (n > 0 positions of contiguous ids), on the
// current stream.
void launch_adds(at::Tensor& counters, const at::Tensor& ids_c, const c10::optional<at::Tensor>& counted,
                 const c10::optional<at::Tensor>& sightings, const bool* skip, int64_t seed) {
  const int64_t n = ids_c.numel();
  const at::Tensor counted_c = contiguous_or_undefined(counted);
  const at::Tensor sightings_c = contiguous_or_undefined(sightings);
  sketch_add_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
      counters.data_ptr<int32_t>(), ids_c.data_ptr<int64_t>(), counted_c.defined() ? counted_c.data_ptr<bool>() : nullptr,
      sightings_c.defined() ? sightings_c.data_ptr<int64_t>() : nullptr, skip, n, counters.size(0),
      counters.size(1), seed);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor sketch_count_cuda(at::Tensor& counters, const at::Tensor& ids, int64_t seed,
                             const c10::optional<at::Tensor>& counted, const c10::optional<at::Tensor>& sightings) {
  constexpr const char* op = "veloce::sketch_count";
  check_sketch_count(op, counters, ids, counted, sightings);
  const c10::cuda::CUDAGuard guard(ids.device());
  const int64_t n = ids.numel(), depth = counters.size(0), width = counters.size(1);
  at::Tensor estimate = at::empty({n}, ids.options());
  if (n == 0) return estimate;
  const at::Tensor ids_c = ids.contiguous();
  launch_adds(counters, ids_c, counted, sightings, nullptr, seed);
  sketch_estimate_kernel<<<grid_for(n), kThreads, 0, stream()>>>(counters.data_ptr<int32_t>(),
                                                                 ids_c.data_ptr<int64_t>(),
                                                                 estimate.data_ptr<int64_t>(), n, depth, width, seed);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return estimate;
}

at::Tensor sketch_admit_cuda(at::Tensor& counters, const at::Tensor& ids, int64_t seed, int64_t min_count, double p,
                             int64_t draw_seed, const c10::optional<at::Tensor>& counted,
                             const c10::optional<at::Tensor>& sightings, const c10::optional<at::Tensor>& skip) {
  constexpr const char* op = "veloce::sketch_admit";
  check_sketch_admit(op, counters, ids, counted, sightings, min_count, p, skip);
  const c10::cuda::CUDAGuard guard(ids.device());
  const int64_t n = ids.numel(), depth = counters.size(0), width = counters.size(1);
  at::Tensor admit = at::empty({n}, ids.options().dtype(at::kBool));
  if (n == 0) return admit;
  const at::Tensor ids_c = ids.contiguous();
  launch_adds(counters, ids_c, counted, sightings, skip.has_value() ? skip->data_ptr<bool>() : nullptr, seed);
  sketch_decide_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
      counters.data_ptr<int32_t>(), ids_c.data_ptr<int64_t>(), admit.data_ptr<bool>(), n, depth, width, seed,
      min_count, p, splitmix64(static_cast<uint64_t>(draw_seed)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return admit;
}

void admission_tally_cuda(at::Tensor& stats, const at::Tensor& slots, int64_t capacity,
                          const c10::optional<at::Tensor>& sightings) {
  constexpr const char* op = "veloce::admission_tally";
  check_admission_tally(op, stats, slots, capacity, sightings);
  const c10::cuda::CUDAGuard guard(stats.device());
  const at::Tensor s_c = slots.contiguous();
  const at::Tensor w_c = contiguous_or_undefined(sightings);
  const int64_t n = s_c.numel();
  C10_CUDA_CHECK(cudaMemsetAsync(stats.data_ptr<int64_t>() + 2, 0, 2 * sizeof(int64_t), stream()));
  if (n == 0) return;
  // A grid-stride loop over a few blocks per SM: each block adds its counts with 4 atomics.
  const int64_t blocks = std::min<int64_t>(grid_for(n), 4 * static_cast<int64_t>(num_sms()));
  tally_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream()>>>(
      reinterpret_cast<unsigned long long*>(stats.data_ptr<int64_t>()), s_c.data_ptr<int64_t>(),
      w_c.defined() ? w_c.data_ptr<int64_t>() : nullptr, n, capacity);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CUDA, m) {
  m.impl("sketch_count", &veloce::cuda::sketch_count_cuda);
  m.impl("sketch_admit", &veloce::cuda::sketch_admit_cuda);
  m.impl("admission_tally", &veloce::cuda::admission_tally_cuda);
}
