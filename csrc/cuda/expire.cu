// CUDA kernel of expire: a time-to-live's bulk erase (semantics: csrc/ops.cpp, docs/ops.md;
// CPU reference csrc/cpu/expire.cpp). One grid-stride pass over the slots, a few waves of
// resident blocks; the count takes one atomic per warp. No host sync: the count stays on
// the device.

#include <torch/library.h>

#include "veloce/cuda_utils.cuh"

namespace veloce {
namespace cuda {
namespace {

__global__ void expire_kernel(uint8_t* __restrict__ digests, const int64_t* __restrict__ scores, int64_t capacity,
                              int64_t before, unsigned long long* __restrict__ erased) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  unsigned n = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < capacity; i += stride) {
    if (digests[i] != kEmptyDigest && scores[i] < before) {
      digests[i] = kEmptyDigest;
      ++n;
    }
  }
  for (int off = 16; off > 0; off >>= 1) n += __shfl_down_sync(kFullWarp, n, off);
  if (threadIdx.x % 32 == 0 && n > 0) atomicAdd(erased, static_cast<unsigned long long>(n));
}

at::Tensor expire_cuda(const at::Tensor& keys, at::Tensor& digests, const at::Tensor& scores, int64_t before) {
  constexpr const char* op = "veloce::expire";
  check_table(op, keys, digests, scores);
  check_cuda_table(op, keys, digests);
  const c10::cuda::CUDAGuard guard(keys.device());
  at::Tensor erased = at::zeros({}, keys.options());
  const int64_t capacity = keys.numel();
  const int64_t waves = static_cast<int64_t>(num_sms()) * resident_blocks_per_sm<expire_kernel>() * 4;
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(grid_for(capacity), waves)));
  expire_kernel<<<grid, kThreads, 0, stream()>>>(digests.data_ptr<uint8_t>(), scores.data_ptr<int64_t>(), capacity,
                                                 before,
                                                 reinterpret_cast<unsigned long long*>(erased.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return erased;
}

}  // namespace
}  // namespace cuda
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CUDA, m) { m.impl("expire", &veloce::cuda::expire_cuda); }
