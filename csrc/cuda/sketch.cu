// CUDA kernel of sketch_count: feature admission's count-min sketch (semantics: csrc/ops.cpp,
// docs/ops.md; CPU reference csrc/cpu/sketch.cpp). Two launches on the current stream: one
// thread per position adds its sightings (an atomicAdd per sketch row), then one thread per
// position reads the minimum of its counters after every add of the call. Each thread
// recomputes the rows' salts (a few multiplies) rather than reading them from memory.
// No host sync.

#include <torch/library.h>

#include "veloce/cuda_utils.cuh"
#include "veloce/sketch.h"

namespace veloce {

namespace cuda {
namespace {

__global__ void sketch_add_kernel(int32_t* __restrict__ counters, const int64_t* __restrict__ ids,
                                  const bool* __restrict__ counted, const int64_t* __restrict__ sightings,
                                  int64_t n, int64_t depth, int64_t width, int64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n || (counted != nullptr && !counted[i])) return;
  const int add = sightings != nullptr ? static_cast<int>(sightings[i]) : 1;
  if (add == 0) return;
  const int64_t id = ids[i];
  for (int64_t d = 0; d < depth; ++d) atomicAdd(counters + sketch_slot(id, sketch_salt(seed, d), d, width), add);
}

__global__ void sketch_estimate_kernel(int32_t* __restrict__ counters, const int64_t* __restrict__ ids,
                                       int64_t* __restrict__ estimate, int64_t n, int64_t depth, int64_t width,
                                       int64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t id = ids[i];
  int32_t low = kSketchCountLimit;
  for (int64_t d = 0; d < depth; ++d) {
    int32_t* const slot = counters + sketch_slot(id, sketch_salt(seed, d), d, width);
    const int32_t v = *slot;
    if (v > kSketchCountLimit) *slot = kSketchCountLimit;  // every writer stores the same value
    low = min(low, v);
  }
  estimate[i] = low;
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
  const at::Tensor counted_c = counted.has_value() ? counted->contiguous() : at::Tensor();
  const bool* take = counted_c.defined() ? counted_c.data_ptr<bool>() : nullptr;
  const at::Tensor sightings_c = sightings.has_value() ? sightings->contiguous() : at::Tensor();
  const int64_t* times = sightings_c.defined() ? sightings_c.data_ptr<int64_t>() : nullptr;
  sketch_add_kernel<<<grid_for(n), kThreads, 0, stream()>>>(counters.data_ptr<int32_t>(), ids_c.data_ptr<int64_t>(),
                                                            take, times, n, depth, width, seed);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sketch_estimate_kernel<<<grid_for(n), kThreads, 0, stream()>>>(counters.data_ptr<int32_t>(),
                                                                 ids_c.data_ptr<int64_t>(),
                                                                 estimate.data_ptr<int64_t>(), n, depth, width, seed);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return estimate;
}

}  // namespace
}  // namespace cuda
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CUDA, m) { m.impl("sketch_count", &veloce::cuda::sketch_count_cuda); }
