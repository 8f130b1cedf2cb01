// CUDA kernels of the exchange family: owner_of, bucketize_bags, combine_parts, regroup_blocks.
// Semantics: docs/ops.md; CPU reference csrc/cpu/exchange.cpp; argument checks shared with
// it (veloce/op_checks.h).
//
// bucketize_bags: key = owner of each position (world_size for padding), a stable CUB radix
// sort of (key, position) on the key's significant bits gives perm; a flag marks the first
// position of every part (a new owner or a new bag), an inclusive scan numbers the parts,
// and W threads binary-search the sorted keys for the per-owner splits. One device-to-host
// copy (the sizes, with the offsets' check) per call; none with exact_sizes=False, where
// the outputs have N rows and the kernels read M and P from device memory.
//
// combine_parts: a stable radix sort of the parts by bag gives each bag its parts in part
// order; a group of lanes per bag sums them in that order with 16-byte accesses
// (deterministic, no atomics). combine_parts_as writes the sums in another dtype, 4
// elements per access.

#include <ATen/Dispatch.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <type_traits>

#include "veloce/cuda_utils.cuh"
#include "veloce/op_checks.h"

namespace veloce {
namespace cuda {
namespace {

__global__ void owner_kernel(const int64_t* __restrict__ ids, int64_t n, uint64_t world_size,
                             int64_t* __restrict__ owner) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) owner[i] = static_cast<int64_t>(owner_hash(ids[i]) % world_size);
}

at::Tensor owner_of_cuda(const at::Tensor& ids, int64_t world_size) {
  constexpr const char* op = "veloce::owner_of";
  check_exchange_ids(op, ids, world_size);
  const c10::cuda::CUDAGuard guard(ids.device());
  const at::Tensor in = ids.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t n = in.numel();
  if (n == 0) return out;
  owner_kernel<<<grid_for(n), kThreads, 0, stream()>>>(in.data_ptr<int64_t>(), n,
                                                      static_cast<uint64_t>(world_size), out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// key = owner of position i (world_size for padding), pos = i, bag = the bag of i.
__global__ void owner_keys_kernel(const int64_t* __restrict__ ids, int64_t n, const int64_t* __restrict__ offsets,
                                  int64_t B, int32_t world_size, bool has_pad, int64_t pad,
                                  int32_t* __restrict__ keys, int32_t* __restrict__ pos,
                                  int32_t* __restrict__ bag) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t id = ids[i];
  keys[i] = (has_pad && id == pad) ? world_size
                                   : static_cast<int32_t>(owner_hash(id) % static_cast<uint64_t>(world_size));
  pos[i] = static_cast<int32_t>(i);
  bag[i] = static_cast<int32_t>(bag_of_position(offsets, B, n, i));
}

// flag[j] = 1 where sorted position j starts a part: a real owner, and a new owner or bag.
__global__ void part_flags_kernel(const int32_t* __restrict__ skeys, const int32_t* __restrict__ spos,
                                  const int32_t* __restrict__ bag, int64_t n, int32_t world_size,
                                  int32_t* __restrict__ flag) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int32_t k = skeys[j];
  flag[j] = k < world_size && (j == 0 || skeys[j - 1] != k || bag[spos[j - 1]] != bag[spos[j]]);
}

// The first index j with skeys[j] >= k (skeys sorted ascending).
__device__ __forceinline__ int64_t lower_bound_key(const int32_t* __restrict__ skeys, int64_t n, int32_t k) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (skeys[mid] < k) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// sizes = [id_splits (W), part_splits (W), M, P].
__global__ void splits_kernel(const int32_t* __restrict__ skeys, const int32_t* __restrict__ part_id, int64_t n,
                              int32_t world_size, int64_t* __restrict__ sizes) {
  const int w = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w > world_size) return;
  const int64_t lo = lower_bound_key(skeys, n, w);
  if (w == world_size) {  // everything before the padding keys
    sizes[2 * world_size] = lo;
    sizes[2 * world_size + 1] = lo > 0 ? part_id[lo - 1] : 0;
    return;
  }
  const int64_t hi = lower_bound_key(skeys, n, w + 1);
  sizes[w] = hi - lo;
  sizes[world_size + w] = (hi > 0 ? part_id[hi - 1] : 0) - (lo > 0 ? part_id[lo - 1] : 0);
}

// For every part start j: bag_of_part and part_start; perm[j] = the position at j.
__global__ void parts_kernel(const int32_t* __restrict__ flag, const int32_t* __restrict__ part_id,
                             const int32_t* __restrict__ spos, const int32_t* __restrict__ bag, int64_t m,
                             int64_t* __restrict__ perm, int64_t* __restrict__ bag_of_part,
                             int64_t* __restrict__ part_start) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= m) return;
  const int32_t p = spos[j];
  perm[j] = p;
  if (flag[j]) {
    const int64_t q = part_id[j] - 1;
    bag_of_part[q] = bag[p];
    part_start[q] = j;
  }
}

// lengths[q] for the parts q < P; mp = [M, P] in device memory (read here, not by the host).
__global__ void part_lengths_kernel(const int64_t* __restrict__ part_start, const int64_t* __restrict__ mp,
                                    int64_t limit, int64_t* __restrict__ lengths) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = mp[0], P = mp[1];
  if (q < P && q < limit) lengths[q] = (q + 1 < P ? part_start[q + 1] : m) - part_start[q];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bucketize_bags_cuda(
    const at::Tensor& ids, const at::Tensor& offsets, bool include_last_offset, int64_t world_size,
    std::optional<int64_t> padding_id, bool exact_sizes) {
  constexpr const char* op = "veloce::bucketize_bags";
  // The layout's values are checked on the device and read back with the output sizes (one
  // host sync for both); the kernels before that read are safe on any offsets.
  const int64_t B = check_bucketize_shapes(op, ids, offsets, include_last_offset, world_size);
  const c10::cuda::CUDAGuard guard(ids.device());
  const int64_t N = ids.numel();
  check_num_ids_cuda(op, N);
  check_num_bags_cuda(op, B);
  check_world_size_cuda(op, world_size);
  const auto opts = ids.options();
  const int32_t W = static_cast<int32_t>(world_size);
  if (N == 0) {
    if (exact_sizes) check_offsets(op, offsets, N, include_last_offset);
    at::Tensor none = at::empty({0}, opts);
    return {none, at::zeros({W}, opts), none.clone(), none.clone(), at::zeros({W}, opts)};
  }
  const at::Tensor id_c = ids.contiguous(), off_c = offsets.contiguous();
  const auto iopts = opts.dtype(at::kInt);
  at::Tensor keys = at::empty({N}, iopts), pos = at::empty({N}, iopts), bag = at::empty({N}, iopts);
  owner_keys_kernel<<<grid_for(N), kThreads, 0, stream()>>>(
      id_c.data_ptr<int64_t>(), N, off_c.data_ptr<int64_t>(), B, W, padding_id.has_value(),
      padding_id.value_or(0), keys.data_ptr<int32_t>(), pos.data_ptr<int32_t>(), bag.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Stable: within an owner, positions (hence bags) stay ascending; padding (key W) last.
  at::Tensor skeys = at::empty_like(keys), spos = at::empty_like(pos);
  const int n = static_cast<int>(N);
  const int end_bit = std::max(1, bit_width(static_cast<uint64_t>(W)));
  cub_call(ids, [&](void* temp, size_t& bytes) {
    return cub::DeviceRadixSort::SortPairs(temp, bytes, keys.data_ptr<int32_t>(), skeys.data_ptr<int32_t>(),
                                           pos.data_ptr<int32_t>(), spos.data_ptr<int32_t>(), n, 0, end_bit,
                                           stream());
  });
  at::Tensor flag = at::empty({N}, iopts), part_id = at::empty({N}, iopts);
  part_flags_kernel<<<grid_for(N), kThreads, 0, stream()>>>(skeys.data_ptr<int32_t>(), spos.data_ptr<int32_t>(),
                                                           bag.data_ptr<int32_t>(), N, W, flag.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cub_call(ids, [&](void* temp, size_t& bytes) {
    return cub::DeviceScan::InclusiveSum(temp, bytes, flag.data_ptr<int32_t>(), part_id.data_ptr<int32_t>(), n,
                                         stream());
  });
  at::Tensor sizes = at::empty({2 * world_size + 3}, opts);  // splits, M, P, bad layout
  splits_kernel<<<grid_for(world_size + 1), kThreads, 0, stream()>>>(skeys.data_ptr<int32_t>(),
                                                                      part_id.data_ptr<int32_t>(), N, W,
                                                                      sizes.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Exact sizes: M and P read back (a sync), with the offsets' check. Otherwise N rows
  // each, the kernels reading M and P from device memory: no sync.
  int64_t M = N, P = N;
  if (exact_sizes) {
    sizes.narrow(0, 2 * world_size + 2, 1).copy_(offsets_bad_flag(off_c, N, include_last_offset));
    const at::Tensor host = sizes.narrow(0, 2 * world_size, 3).cpu();  // sync: sizes the outputs
    if (host.data_ptr<int64_t>()[2] != 0) check_offsets(op, offsets, N, include_last_offset);  // raises
    M = host.data_ptr<int64_t>()[0];
    P = host.data_ptr<int64_t>()[1];
  }
  at::Tensor perm = at::empty({M}, opts), part_start = at::empty({P}, opts);
  at::Tensor bag_of_part = exact_sizes ? at::empty({P}, opts) : at::zeros({P}, opts);
  at::Tensor part_lengths = exact_sizes ? at::empty({P}, opts) : at::zeros({P}, opts);
  if (M > 0) {
    // Sorted positions j < M are the sent ones; beyond M (exact_sizes=False) the padding
    // positions, whose flag is 0: perm gets them, the parts do not.
    parts_kernel<<<grid_for(M), kThreads, 0, stream()>>>(flag.data_ptr<int32_t>(), part_id.data_ptr<int32_t>(),
                                                        spos.data_ptr<int32_t>(), bag.data_ptr<int32_t>(), M,
                                                        perm.data_ptr<int64_t>(), bag_of_part.data_ptr<int64_t>(),
                                                        part_start.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (P > 0) {
    part_lengths_kernel<<<grid_for(P), kThreads, 0, stream()>>>(
        part_start.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + 2 * world_size, P,
        part_lengths.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {perm, sizes.narrow(0, 0, world_size).clone(), bag_of_part, part_lengths,
          sizes.narrow(0, world_size, world_size).clone()};
}

// first[b] = the first index of bag b in the sorted bags (P where none follows).
__global__ void bag_starts_kernel(const int32_t* __restrict__ sbags, int64_t P, int64_t num_bags,
                                  int32_t* __restrict__ first) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b <= num_bags) first[b] = static_cast<int32_t>(lower_bound_key(sbags, P, static_cast<int32_t>(b)));
}

// A group of `lanes` threads per bag; each lane owns V consecutive columns (one 16-byte
// access per part row when V > 1), strides over D, and adds the bag's parts in part
// order. Every output element is written (bags without parts get zeros).
template <typename In, typename Out, int V>
__global__ void combine_kernel(const In* __restrict__ parts, const int32_t* __restrict__ order,
                               const int32_t* __restrict__ first, int64_t num_bags, int64_t D, int lanes,
                               Out* __restrict__ out) {
  using acc_t = combine_acc_t<In, Out>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b = t >> (__ffs(lanes) - 1);  // lanes: a power of two
  if (b >= num_bags) return;
  const int lane = static_cast<int>(t & (lanes - 1));
  const int32_t lo = first[b], hi = first[b + 1];
  for (int64_t c = static_cast<int64_t>(lane) * V; c < D; c += static_cast<int64_t>(lanes) * V) {
    acc_t a[V];
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] = 0;
    for (int32_t k = lo; k < hi; ++k) {
      const Pack<In, V> p = load_pack<In, V>(parts + static_cast<int64_t>(order[k]) * D + c);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] += static_cast<acc_t>(p.v[j]);
    }
    Pack<Out, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = static_cast<Out>(a[j]);
    store_pack<Out, V>(out + b * D + c, o);
  }
}

// Elements per access of a conversion between In and Out (regroup_blocks_as, combine_parts_as):
// 4 where `elems` (a row's) and every pointer allow packs of 4 (Pack's alignment), else 1.
template <typename In, typename Out>
int convert_width(int64_t elems, const std::vector<const void*>& in_ptrs, const void* out_ptr) {
  constexpr int V = 4;
  if (elems % V != 0 || reinterpret_cast<uintptr_t>(out_ptr) % alignof(Pack<Out, V>) != 0) return 1;
  for (const void* p : in_ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % alignof(Pack<In, V>) != 0) return 1;
  }
  return V;
}

// check_bags=false skips the range check of bag_of_part (a device read): for callers whose
// parts come from bucketize_bags. The kernels stay in bounds on any input (order and first
// index parts), so a bad index gives wrong sums, never a bad memory access.
at::Tensor combine_cuda(const char* op, const at::Tensor& parts, const at::Tensor& bag_of_part, int64_t num_bags,
                        bool check_bags, at::ScalarType out_dtype) {
  check_combine_parts_args(op, parts, bag_of_part, num_bags);
  check_row_conversion(op, "parts", parts.scalar_type(), out_dtype);
  const c10::cuda::CUDAGuard guard(parts.device());
  const int64_t P = parts.size(0), D = parts.size(1);
  check_num_ids_cuda(op, P);
  check_num_bags_cuda(op, num_bags);
  const auto out_opts = parts.options().dtype(out_dtype);
  if (P == 0 || D == 0) return at::zeros({num_bags, D}, out_opts);
  at::Tensor out = at::empty({num_bags, D}, out_opts);  // the kernel writes every element
  const at::Tensor bags = bag_of_part.contiguous();
  if (check_bags && bags.lt(0).logical_or(bags.ge(num_bags)).any().item<bool>()) {
    const at::Tensor host = bags.cpu();
    check_bag_indices(op, host.data_ptr<int64_t>(), P, num_bags);
  }
  const at::Tensor p_c = parts.contiguous();
  const auto iopts = bags.options().dtype(at::kInt);
  at::Tensor keys = bags.to(at::kInt), order_in = at::arange(P, iopts);
  at::Tensor skeys = at::empty_like(keys), order = at::empty_like(order_in);
  const int end_bit = std::max(1, bit_width(static_cast<uint64_t>(num_bags)));
  cub_call(parts, [&](void* temp, size_t& bytes) {
    return cub::DeviceRadixSort::SortPairs(temp, bytes, keys.data_ptr<int32_t>(), skeys.data_ptr<int32_t>(),
                                           order_in.data_ptr<int32_t>(), order.data_ptr<int32_t>(),
                                           static_cast<int>(P), 0, end_bit, stream());
  });
  at::Tensor first = at::empty({num_bags + 1}, iopts);
  bag_starts_kernel<<<grid_for(num_bags + 1), kThreads, 0, stream()>>>(skeys.data_ptr<int32_t>(), P, num_bags,
                                                                       first.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (num_bags == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, parts.scalar_type(), "combine_parts_cuda", [&] {
    using In = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "combine_parts_cuda", [&] {
      using Out = scalar_t;
      auto launch = [&](auto vec) {
        constexpr int V = decltype(vec)::value;
        const int lanes = lanes_for(D, V);
        combine_kernel<In, Out, V><<<grid_for(num_bags * lanes), kThreads, 0, stream()>>>(
            p_c.data_ptr<In>(), order.data_ptr<int32_t>(), first.data_ptr<int32_t>(), num_bags, D, lanes,
            out.data_ptr<Out>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if constexpr (std::is_same_v<In, Out>) {
        if (can_vectorize<In>(D, {p_c.data_ptr(), out.data_ptr()})) {
          launch(std::integral_constant<int, vec16<In>()>());
          return;
        }
      } else {
        if (convert_width<In, Out>(D, {p_c.data_ptr()}, out.data_ptr()) == 4) {
          launch(std::integral_constant<int, 4>());
          return;
        }
      }
      launch(std::integral_constant<int, 1>());
    });
  });
  return out;
}

at::Tensor combine_parts_cuda(const at::Tensor& parts, const at::Tensor& bag_of_part, int64_t num_bags,
                              bool check_bags) {
  return combine_cuda("veloce::combine_parts", parts, bag_of_part, num_bags, check_bags, parts.scalar_type());
}

at::Tensor combine_parts_as_cuda(const at::Tensor& parts, const at::Tensor& bag_of_part, int64_t num_bags,
                                 bool check_bags, at::ScalarType dtype) {
  return combine_cuda("veloce::combine_parts_as", parts, bag_of_part, num_bags, check_bags, dtype);
}

// regroup_blocks: a launch copies up to kRegroupBlocks blocks, described in its kernel
// parameter (no copy to the device), into one contiguous range of the output. A thread
// copies units of U bytes (the widest of 16, 8, 4, 2 and 1 that divides a row and aligns
// every pointer), grid-stride, each unit's block found by a binary search over the blocks'
// ends (uniform across a warp but at block boundaries). regroup_blocks_as converts V
// elements per unit (4 where rows and pointers allow, else 1) in the same pass.
constexpr int kRegroupBlocks = 128;

struct RegroupLaunch {
  const void* src[kRegroupBlocks];  // each block's first row in its source
  int64_t end[kRegroupBlocks];      // units of the launch's output up to each block's end
  int32_t n;                        // blocks, >= 1
};
static_assert(sizeof(RegroupLaunch) <= 3 * 1024, "RegroupLaunch is too large for a kernel parameter");

// The block (of a.n) that holds unit u of a launch's output, and the units before it.
__device__ __forceinline__ int regroup_block_of(const RegroupLaunch& a, int64_t u, int64_t& begin) {
  int lo = 0, hi = a.n - 1;  // the first block that ends after u
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (a.end[mid] > u) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  begin = lo == 0 ? 0 : a.end[lo - 1];
  return lo;
}

// Unit u of a launch's output (the block it falls in: src, and its index there: i).
template <typename U>
struct CopyUnits {  // regroup_blocks: U bytes as they are
  U* out;
  __device__ __forceinline__ void operator()(const void* src, int64_t i, int64_t u) const {
    out[u] = static_cast<const U*>(src)[i];
  }
};

template <typename In, typename Out, int V>
struct ConvertUnits {  // regroup_blocks_as: V elements converted
  Out* out;
  __device__ __forceinline__ void operator()(const void* src, int64_t i, int64_t u) const {
    const Pack<In, V> p = load_pack<In, V>(static_cast<const In*>(src) + i * V);
    Pack<Out, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = c10::convert<Out>(p.v[j]);
    store_pack<Out, V>(out + u * V, o);
  }
};

template <class Unit>
__global__ void regroup_kernel(const __grid_constant__ RegroupLaunch a, const Unit unit) {
  const int64_t total = a.end[a.n - 1];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < total; u += stride) {
    int64_t begin;
    const int b = regroup_block_of(a, u, begin);
    unit(a.src[b], u - begin, u);
  }
}

// The plan's blocks in launches of up to kRegroupBlocks, each a RegroupLaunch over units of
// src_unit_bytes source bytes (units_per_row to a row): launch(a, units before it, its
// units, grid). Launches whose blocks are all empty are skipped (a grid of no blocks is an
// error).
template <typename F>
void for_each_regroup_launch(const std::vector<RegroupBlock>& plan, const RegroupCopy& c, int64_t src_unit_bytes,
                             int64_t units_per_row, F&& launch) {
  const int64_t max_grid = static_cast<int64_t>(num_sms()) * 16;
  int64_t done = 0;
  for (size_t first = 0; first < plan.size(); first += kRegroupBlocks) {
    RegroupLaunch a{};
    a.n = static_cast<int32_t>(std::min<size_t>(kRegroupBlocks, plan.size() - first));
    int64_t units = 0;
    for (int32_t i = 0; i < a.n; ++i) {
      const RegroupBlock& b = plan[first + static_cast<size_t>(i)];
      a.src[i] = static_cast<const uint8_t*>(c.sources[static_cast<size_t>(b.source)].data_ptr()) +
                 b.row * units_per_row * src_unit_bytes;
      units += b.rows * units_per_row;
      a.end[i] = units;
    }
    if (units == 0) continue;  // defensive: the plan holds no empty block, and rows of no bytes return early
    launch(a, done, static_cast<unsigned>(std::min<int64_t>(grid_for(units), max_grid)));
    done += units;
  }
}

at::Tensor regroup_cuda(const char* op, at::TensorList sources, at::IntArrayRef counts, int64_t num_groups,
                        bool to_group_major, at::ScalarType out_dtype) {
  const std::vector<RegroupBlock> plan = regroup_plan(op, sources, counts, num_groups, to_group_major);
  check_row_conversion(op, "sources", sources[0].scalar_type(), out_dtype);
  const c10::cuda::CUDAGuard guard(sources[0].device());
  const RegroupCopy c = regroup_copy(sources, plan, out_dtype);
  const at::Tensor& out = c.out;
  if (out.numel() == 0) return out;
  if (out_dtype != sources[0].scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, sources[0].scalar_type(), "regroup_blocks_as_cuda", [&] {
      using In = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "regroup_blocks_as_cuda", [&] {
        using Out = scalar_t;
        if constexpr (!std::is_same_v<In, Out>) {  // one dtype takes the byte copy below
          std::vector<const void*> ptrs;
          for (const at::Tensor& t : c.sources) ptrs.push_back(t.data_ptr());
          auto run = [&](auto vec) {
            constexpr int V = decltype(vec)::value;
            for_each_regroup_launch(plan, c, V * static_cast<int64_t>(sizeof(In)), c.row_elems / V,
                                    [&](const RegroupLaunch& a, int64_t done, unsigned grid) {
                                      const ConvertUnits<In, Out, V> unit{out.data_ptr<Out>() + done * V};
                                      regroup_kernel<<<grid, kThreads, 0, stream()>>>(a, unit);
                                      C10_CUDA_KERNEL_LAUNCH_CHECK();
                                    });
          };
          if (convert_width<In, Out>(c.row_elems, ptrs, out.data_ptr()) == 4) {
            run(std::integral_constant<int, 4>());
          } else {
            run(std::integral_constant<int, 1>());
          }
        }
      });
    });
    return out;
  }
  // The unit: rows and every base pointer are multiples of it (blocks start at whole rows).
  const int64_t row_bytes = c.row_bytes;
  uint64_t align = static_cast<uint64_t>(row_bytes) | reinterpret_cast<uintptr_t>(out.data_ptr());
  for (const at::Tensor& t : c.sources) align |= reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t unit = 16;
  while (unit > 1 && align % static_cast<uint64_t>(unit) != 0) unit /= 2;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  auto launch = [&](auto* typed) {
    using U = std::remove_pointer_t<decltype(typed)>;
    for_each_regroup_launch(plan, c, unit, row_bytes / unit, [&](const RegroupLaunch& a, int64_t done, unsigned grid) {
      const CopyUnits<U> unit{reinterpret_cast<U*>(dst) + done};
      regroup_kernel<<<grid, kThreads, 0, stream()>>>(a, unit);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  };
  switch (unit) {
    case 16: launch(static_cast<uint4*>(nullptr)); break;
    case 8: launch(static_cast<uint2*>(nullptr)); break;
    case 4: launch(static_cast<uint32_t*>(nullptr)); break;
    case 2: launch(static_cast<uint16_t*>(nullptr)); break;
    default: launch(static_cast<uint8_t*>(nullptr)); break;
  }
  return out;
}

at::Tensor regroup_blocks_cuda(at::TensorList sources, at::IntArrayRef counts, int64_t num_groups,
                               bool to_group_major) {
  return regroup_cuda("veloce::regroup_blocks", sources, counts, num_groups, to_group_major,
                      sources.empty() ? at::kFloat : sources[0].scalar_type());
}

at::Tensor regroup_blocks_as_cuda(at::TensorList sources, at::IntArrayRef counts, int64_t num_groups,
                                  bool to_group_major, at::ScalarType dtype) {
  return regroup_cuda("veloce::regroup_blocks_as", sources, counts, num_groups, to_group_major, dtype);
}

}  // namespace
}  // namespace cuda
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CUDA, m) {
  m.impl("regroup_blocks", &veloce::cuda::regroup_blocks_cuda);
  m.impl("owner_of", &veloce::cuda::owner_of_cuda);
  m.impl("bucketize_bags", &veloce::cuda::bucketize_bags_cuda);
  m.impl("combine_parts", &veloce::cuda::combine_parts_cuda);
  m.impl("regroup_blocks_as", &veloce::cuda::regroup_blocks_as_cuda);
  m.impl("combine_parts_as", &veloce::cuda::combine_parts_as_cuda);
}
