// CUDA kernels of the embedding family: pooled_lookup (forward), accumulate_grad (the
// backward w.r.t. the table rows, reduced per unique slot) and the fused backward + optimizer
// step accumulate_and_update, of one table or of several at once (_many), and
// bag_layouts_bad (the offsets' check behind every op's check_inputs). Semantics:
// docs/ops.md; CPU reference csrc/cpu/embedding.cpp; argument checks shared with it
// (veloce/op_checks.h).
//
// pooled_lookup: a group of `lanes` threads (a power of two <= 32) per bag, or per up to
// 4 consecutive bags when bags are short; each lane owns V consecutive columns (one
// 16-byte load per row) and walks the group's positions (contiguous across its bags) with
// 4 rows in flight, accumulating in float (double for float64) in position order and
// writing a bag's columns where it ends.
//
// accumulate_grad: keys = slot (or a sentinel num_rows for slots that get no gradient),
// stable CUB radix sort of (key, position) on the key's significant bits, run-length
// encode -> unique slots and run lengths, exclusive scan -> run starts; then one group
// of lanes per unique slot sums the gradients of its positions in position order
// (deterministic: no atomics, a fixed summation order).

#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "veloce/cuda_utils.cuh"
#include "veloce/op_checks.h"
#include "veloce/optim/pack.cuh"

namespace veloce {
namespace cuda {
namespace {

constexpr int64_t kMean = 1;
constexpr int kUnroll = 4;  // rows in flight per lane

// The bag layout (check_offsets) and the slot values (every slot -1, -2 or in [0, limit);
// limit < 0: no upper bound), checked on the device with one read-back (a sync); the
// messages are built from host copies only when something is wrong. Returns B.
int64_t check_bags_and_slots_cuda(const char* op, const at::Tensor& offsets, const at::Tensor& slots, int64_t n,
                                  bool include_last_offset, int64_t limit, const char* limit_what) {
  const int64_t B = check_offsets_shape(op, offsets, n, include_last_offset);
  std::vector<at::Tensor> parts;
  if (offsets.numel() > 0) parts.push_back(offsets_bad_flag(offsets, n, include_last_offset).to(at::kLong));
  if (slots.numel() > 0) {
    const auto mm = at::aminmax(slots);
    parts.push_back(std::get<0>(mm).reshape({1}));
    parts.push_back(std::get<1>(mm).reshape({1}));
  }
  if (parts.empty()) return B;
  const at::Tensor host = at::cat(parts).cpu();
  const int64_t* h = host.data_ptr<int64_t>();
  if (offsets.numel() > 0 && h[0] != 0) check_offsets(op, offsets, n, include_last_offset);  // raises
  if (slots.numel() > 0) {
    const int64_t lo = h[parts.size() - 2], hi = h[parts.size() - 1];
    if (lo < kZeroSlot || (limit >= 0 && hi >= limit)) {
      const at::Tensor all = slots.cpu();
      check_slot_values(op, all.data_ptr<int64_t>(), all.numel(), limit, limit_what);
    }
  }
  return B;
}

// ---- bag_layouts_bad ----------------------------------------------------------------------
//
// Up to kLayoutGroup layouts per launch, passed as a kernel parameter; their entries are
// numbered across the layouts (base: each layout's first entry). A thread per entry i of
// layout k tests the rules that involve it (the first entry, the last, the decrease from
// i - 1) and, on a break, stores true to the flag (racing writers write the same).
constexpr int kLayoutGroup = 32;

struct LayoutGroup {
  int32_t K;                        // layouts in the launch, 1 <= K <= kLayoutGroup
  int64_t base[kLayoutGroup + 1];   // layout k's entries: [base[k], base[k + 1])
  int64_t num_ids[kLayoutGroup];    // its number of ids
  const int64_t* data[kLayoutGroup];
  bool include_last[kLayoutGroup];  // include_last_offset
};

__global__ void bag_layouts_bad_kernel(const __grid_constant__ LayoutGroup g, bool* __restrict__ flag) {
  const int64_t total = g.base[g.K];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < total; u += stride) {
    const int lo = segment_of(g.base, g.K, u);  // the layout of entry u
    const int64_t i = u - g.base[lo], len = g.base[lo + 1] - g.base[lo], n = g.num_ids[lo];
    const int64_t* o = g.data[lo];
    const int64_t v = o[i];
    bool bad = i == 0 ? v != 0 : v < o[i - 1];
    if (i == len - 1) bad |= v > n || (g.include_last[lo] && v != n);
    if (bad) *flag = true;
  }
}

at::Tensor bag_layouts_bad_cuda(at::TensorList offsets, at::IntArrayRef num_ids, at::IntArrayRef include_last_offset) {
  constexpr const char* op = "veloce::bag_layouts_bad";
  const bool bad_shape = check_bag_layouts_args(op, offsets, num_ids, include_last_offset);
  const c10::cuda::CUDAGuard guard(offsets[0].device());
  at::Tensor flag = at::full({1}, bad_shape, offsets[0].options().dtype(at::kBool));
  if (bad_shape) return flag;  // known without reading an entry
  std::vector<at::Tensor> data;  // kept alive contiguous until launched
  std::vector<size_t> idx;
  for (size_t k = 0; k < offsets.size(); ++k) {
    if (offsets[k].numel() == 0) continue;
    data.push_back(offsets[k].contiguous());
    idx.push_back(k);
  }
  const int64_t max_blocks = int64_t{8} * num_sms();
  for (size_t first = 0; first < idx.size(); first += kLayoutGroup) {
    LayoutGroup g{};
    g.K = static_cast<int32_t>(std::min<size_t>(kLayoutGroup, idx.size() - first));
    for (int j = 0; j < g.K; ++j) {
      const size_t k = idx[first + j];
      g.data[j] = data[first + j].data_ptr<int64_t>();
      g.num_ids[j] = num_ids[k];
      g.include_last[j] = include_last_offset[k] != 0;
      g.base[j + 1] = g.base[j] + data[first + j].numel();
    }
    const int64_t blocks = std::min<int64_t>(max_blocks, grid_for(g.base[g.K]));
    bag_layouts_bad_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream()>>>(g, flag.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return flag;
}

// ---- pooled_lookup ----------------------------------------------------------------------

// A lane group takes up to kMaxBags consecutive bags (kBags = 1 or kMaxBags; the launcher
// passes bags_per_group <= kBags). Their positions form one contiguous range, walked
// kUnroll at a time whatever the bag boundaries: a bag of one id alone is a dependent
// chain offsets -> slot -> one 16-byte row load -> store per thread, latency bound, while
// across bags every batch keeps kUnroll rows in flight. Long bags get a group each: their
// batches are full already, and more groups keep more rows in flight when there are few
// bags. Positions are int32 where kBags > 1 (the launcher's N <= 2^31 - 1 - kUnroll):
// about 8 registers fewer, which keeps its occupancy that of the one-bag kernel.
constexpr int kMaxBags = 4;

// One table of a pooled lookup launch (pooled_lookup is the launch of one table,
// pooled_lookup_many of up to kMaxLookupGroup: table blockIdx.y).
struct LookupArgs {
  const void* weights;     // (C, D) scalar_t
  const void* extra;       // (M, D) scalar_t, or null
  const int64_t* slots;    // (N,)
  const int64_t* offsets;  // (num_offsets,)
  const void* psw;         // (N,) scalar_t, or null
  void* out;               // (B, D) scalar_t
  int64_t C, num_offsets, B, N;
  int32_t mean;
  int32_t bags_per_group;  // 1 .. kBags
};

constexpr int kMaxLookupGroup = 32;

template <int MaxK>
struct LookupGroup {
  LookupArgs t[MaxK];
};
static_assert(sizeof(LookupGroup<kMaxLookupGroup>) <= 3 * 1024, "LookupGroup is too large for a kernel parameter");

template <typename scalar_t, int V, int kBags, int MaxK>
__global__ void pooled_lookup_kernel(const __grid_constant__ LookupGroup<MaxK> g, int64_t D, int lanes) {
  using acc_t = at::opmath_type<scalar_t>;
  using pos_t = std::conditional_t<kBags == 1, int64_t, int32_t>;
  const LookupArgs& a = g.t[MaxK == 1 ? 0 : blockIdx.y];
  const scalar_t* __restrict__ weights = static_cast<const scalar_t*>(a.weights);
  const scalar_t* __restrict__ extra = static_cast<const scalar_t*>(a.extra);
  const int64_t* __restrict__ slots = a.slots;
  const int64_t* __restrict__ offsets = a.offsets;
  const scalar_t* __restrict__ psw = static_cast<const scalar_t*>(a.psw);
  scalar_t* __restrict__ out = static_cast<scalar_t*>(a.out);
  const int64_t C = a.C, num_offsets = a.num_offsets, B = a.B, N = a.N;
  const bool mean = a.mean != 0;
  const int bags_per_group = a.bags_per_group;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b0 = (t >> (__ffs(lanes) - 1)) * bags_per_group;  // lanes: a power of two
  if (b0 >= B) return;
  const int lane = static_cast<int>(t & (lanes - 1));
  const int nb = B - b0 < bags_per_group ? static_cast<int>(B - b0) : bags_per_group;
  // stop[g] = the end of bag b0 + g, for g < nb: independent loads, all in flight at once.
  const pos_t begin = static_cast<pos_t>(offsets[b0]);
  pos_t stop[kBags];
#pragma unroll
  for (int g = 0; g < kBags; ++g) {
    const int64_t e = b0 + g + 1;
    stop[g] = static_cast<pos_t>(g < nb ? (e < num_offsets ? offsets[e] : N) : 0);
  }
  // stop[g] with g in a register (constant indices keep stop[] out of local memory).
  auto stop_of = [&](int g) {
    pos_t r = 0;
#pragma unroll
    for (int k = 0; k < kBags; ++k) r = k == g ? stop[k] : r;
    return r;
  };
  const pos_t end = stop_of(nb - 1);
  auto row = [&](int64_t s) { return s < C ? weights + s * D : extra + (s - C) * D; };
  for (int64_t c = static_cast<int64_t>(lane) * V; c < D; c += static_cast<int64_t>(lanes) * V) {
    acc_t acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0;
    pos_t count = 0;
    int cur = 0;  // the bag (b0 + cur) being summed
    pos_t cur_stop = stop[0];
    // Writes bag cur (zeros when empty) and moves to the next.
    auto finish_bag = [&]() {
      Pack<scalar_t, V> o;
      const acc_t n = static_cast<acc_t>(count);
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = static_cast<scalar_t>(mean && count > 0 ? acc[j] / n : acc[j]);
      store_pack<scalar_t, V>(out + (b0 + cur) * D + c, o);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = 0;
      count = 0;
      ++cur;
      cur_stop = stop_of(cur);
    };
    for (pos_t i = begin; i < end; i += kUnroll) {
      // Slots and weights first (independent loads), then the rows; past `end` nothing is
      // read and the slots act as padding.
      int64_t s[kUnroll];
      Pack<scalar_t, V> p[kUnroll];
      acc_t w[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) s[k] = i + k < end ? slots[i + k] : kPaddingSlot;
      if (psw != nullptr) {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) w[k] = i + k < end ? static_cast<acc_t>(psw[i + k]) : acc_t(0);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (s[k] >= 0) p[k] = load_pack<scalar_t, V>(row(s[k]) + c);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (i + k >= end) break;
        // Position i + k < end = stop[nb - 1]: this stops at a bag of the group (skipping
        // empty bags), and the rows of each bag are added in position order.
        if constexpr (kBags > 1) {
          while (i + k >= cur_stop) finish_bag();
        }
        if (s[k] == kPaddingSlot) continue;
        ++count;
        if (s[k] == kZeroSlot) continue;
        if (psw != nullptr) {
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] += w[k] * static_cast<acc_t>(p[k].v[j]);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] += static_cast<acc_t>(p[k].v[j]);
        }
      }
    }
    while (cur < nb) finish_bag();  // the last bag with positions, then trailing empty ones
  }
}

// One table's lookup, checked, its output allocated: the launch arguments (and the tensors
// behind them).
struct LookupTable {
  at::Tensor w, s, o, e, p, out;
  int64_t B = 0;
};

LookupTable lookup_table(const char* op, const at::Tensor& weights, const at::Tensor& slots, const at::Tensor& offsets,
                         const std::optional<at::Tensor>& per_sample_weights, bool include_last_offset,
                         const std::optional<at::Tensor>& extra_rows, int64_t M, bool check_inputs) {
  LookupTable t;
  t.s = slots.contiguous();
  t.o = offsets.contiguous();
  const int64_t N = t.s.numel();
  // One device check and read-back (a sync) unless the caller vouches for the inputs.
  t.B = check_inputs ? check_bags_and_slots_cuda(op, t.o, t.s, N, include_last_offset, weights.size(0) + M,
                                                 M > 0 ? "weights.size(0) + extra_rows.size(0)" : "weights.size(0)")
                     : check_offsets_shape(op, t.o, N, include_last_offset);
  if (t.B > 0) check_num_bags_cuda(op, t.B);
  t.w = weights.contiguous();
  t.e = extra_rows.has_value() ? extra_rows->contiguous() : at::Tensor();
  t.p = per_sample_weights.has_value() ? per_sample_weights->contiguous() : at::Tensor();
  t.out = at::empty({t.B, weights.size(1)}, weights.options());
  return t;
}

// The lookups of tables ts (one dtype and dim D), kMaxLookupGroup per launch.
void launch_lookups(const std::vector<LookupTable*>& ts, const std::vector<int64_t>& modes, int64_t D) {
  std::vector<size_t> live;
  for (size_t k = 0; k < ts.size(); ++k) {
    if (ts[k]->B > 0 && D > 0) live.push_back(k);
  }
  if (live.empty()) return;
  // Bags per lane group: about kUnroll positions at the mean bag length (bags of one:
  // kMaxBags; of kUnroll or more: 1). Only the speed depends on it, not the result. The
  // grouped kernel counts positions in int32: a table with more takes groups of one bag.
  bool int32_positions = true;
  for (size_t k : live) int32_positions &= ts[k]->s.numel() <= std::numeric_limits<int32_t>::max() - kUnroll;
  std::vector<int> bpg(ts.size(), 1);
  bool grouped = false;
  for (size_t k : live) {
    const int64_t B = ts[k]->B, N = ts[k]->s.numel();
    bpg[k] = int32_positions ? static_cast<int>(std::clamp<int64_t>(kUnroll * B / std::max<int64_t>(N, 1), 1, kMaxBags))
                             : 1;
    grouped |= bpg[k] > 1;
  }
  const at::Tensor& w0 = ts[live[0]]->w;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w0.scalar_type(), "pooled_lookup_cuda", [&] {
    auto launch = [&](auto vec, auto max_k) {
      constexpr int V = decltype(vec)::value;
      constexpr int MaxK = decltype(max_k)::value;
      const int lanes = lanes_for(D, V);
      for (size_t first = 0; first < live.size(); first += MaxK) {
        const size_t K = std::min<size_t>(MaxK, live.size() - first);
        LookupGroup<MaxK> g{};
        int64_t most = 0;
        for (size_t j = 0; j < K; ++j) {
          const size_t k = live[first + j];
          const LookupTable& t = *ts[k];
          g.t[j] = LookupArgs{t.w.data_ptr(), t.e.defined() ? t.e.data_ptr() : nullptr, t.s.data_ptr<int64_t>(),
                              t.o.data_ptr<int64_t>(), t.p.defined() ? t.p.data_ptr() : nullptr, t.out.data_ptr(),
                              t.w.size(0), t.o.numel(), t.B, t.s.numel(), modes[k] == kMean, bpg[k]};
          most = std::max<int64_t>(most, ceil_div(t.B, bpg[k]) * lanes);  // at most 2^31 * 32: 2^28 blocks
        }
        const dim3 grid(grid_for(most), static_cast<unsigned>(K));
        auto kernel = grouped ? pooled_lookup_kernel<scalar_t, V, kMaxBags, MaxK>
                              : pooled_lookup_kernel<scalar_t, V, 1, MaxK>;
        kernel<<<grid, kThreads, 0, stream()>>>(g, D, lanes);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    bool vec = true;
    for (size_t k : live) {
      const LookupTable& t = *ts[k];
      vec &= can_vectorize<scalar_t>(D, {t.w.data_ptr(), t.e.defined() ? t.e.data_ptr() : nullptr, t.out.data_ptr()});
    }
    auto with_k = [&](auto v) {
      if (live.size() == 1) {
        launch(v, std::integral_constant<int, 1>());
      } else {
        launch(v, std::integral_constant<int, kMaxLookupGroup>());
      }
    };
    if (vec) {
      with_k(std::integral_constant<int, vec16<scalar_t>()>());
    } else {
      with_k(std::integral_constant<int, 1>());
    }
  });
}

at::Tensor pooled_lookup_cuda(const at::Tensor& weights, const at::Tensor& slots, const at::Tensor& offsets,
                              const std::optional<at::Tensor>& per_sample_weights, int64_t mode,
                              bool include_last_offset, const std::optional<at::Tensor>& extra_rows,
                              bool check_inputs) {
  constexpr const char* op = "veloce::pooled_lookup";
  const int64_t M = check_pooled_lookup_args(op, weights, slots, offsets, per_sample_weights, mode, extra_rows);
  const c10::cuda::CUDAGuard guard(weights.device());
  LookupTable t = lookup_table(op, weights, slots, offsets, per_sample_weights, include_last_offset, extra_rows, M,
                               check_inputs);
  launch_lookups({&t}, {mode}, weights.size(1));
  return t.out;
}

std::vector<at::Tensor> pooled_lookup_many_cuda(at::TensorList weights, at::TensorList slots, at::TensorList offsets,
                                                const c10::List<std::optional<at::Tensor>>& per_sample_weights,
                                                at::IntArrayRef mode, bool include_last_offset,
                                                const c10::List<std::optional<at::Tensor>>& extra_rows,
                                                bool check_inputs) {
  std::vector<int64_t> M;
  const std::vector<std::string> names = check_pooled_lookup_many_args(
      "veloce::pooled_lookup_many", weights, slots, offsets, per_sample_weights, mode, extra_rows, M);
  const size_t K = weights.size();
  if (K == 0) return {};
  const c10::cuda::CUDAGuard guard(weights[0].device());
  std::vector<LookupTable> ts;
  ts.reserve(K);
  for (size_t k = 0; k < K; ++k) {  // every table checked before any launch
    ts.push_back(lookup_table(names[k].c_str(), weights[k], slots[k], offsets[k], per_sample_weights.get(k),
                              include_last_offset, extra_rows.get(k), M[k], check_inputs));
  }
  std::vector<LookupTable*> ptrs;
  for (LookupTable& t : ts) ptrs.push_back(&t);
  launch_lookups(ptrs, std::vector<int64_t>(mode.begin(), mode.end()), weights[0].size(1));
  std::vector<at::Tensor> out;
  out.reserve(K);
  for (LookupTable& t : ts) out.push_back(t.out);
  return out;
}

// ---- table groups -----------------------------------------------------------------------
//
// The backward kernels below work on a group of tables: accumulate_and_update_many applies
// K tables' gradients with one sort, one run-length encode and one fused kernel, and the
// single-table ops (accumulate_grad, accumulate_and_update) are the group of one. A group
// puts its tables in one key space: slot s of table k is key row_base[k] + s, and the
// sentinel row_base[K] (the group's row count) marks positions without a gradient; the
// tables' positions and bags follow one another (pos_base, bag_base). Runs of equal keys
// then never span tables, each run keeps its table's position order, and every table gets
// bit for bit what the single-table op gives it.
//
// A table's keys cover its own rows and then its extra rows (accumulate_and_update's
// extra_rows: slot C + e is extra row e), whose row and state the update kernel finds
// through the table's extra pointers.
//
// The group travels as a kernel parameter (no host-to-device copy, nothing to allocate):
// per table its bases and pointers. The single-table ops use MaxK = 1, a parameter as small
// as the arguments it replaces; larger groups are cut into launches of kMaxGroup tables.

constexpr int kMaxGroup = 32;

template <int MaxK>
struct TableGroup {
  int32_t K;                     // tables in the group, 1 <= K <= MaxK
  int32_t bag_base[MaxK + 1];    // table k's bags: [bag_base[k], bag_base[k + 1]) of bag_base[K] (< 2^31)
  int64_t row_base[MaxK + 1];    // table k's keys: [row_base[k], row_base[k + 1]); row_base[K]: the sentinel
  int64_t pos_base[MaxK + 1];    // table k's positions: [pos_base[k], pos_base[k + 1]) of pos_base[K] (< 2^31)
  const int64_t* slots[MaxK];    // (N_k,)
  const int64_t* offsets[MaxK];  // (B_k,) or (B_k + 1,): the table's bag starts, from 0
  const void* psw[MaxK];         // (N_k,) scalar_t, or null
  const void* grad[MaxK];        // (B_k, D) scalar_t: grad_output
  void* weights[MaxK];           // (C_k, D) scalar_t (null for accumulate_grad)
  void* state[MaxK];             // (C_k, S) acc_t (null when S = 0)
  int32_t extra[MaxK];           // E_k: the last E_k of table k's keys are its extra rows
  void* extra_weights[MaxK];     // (E_k, D) scalar_t, or null
  void* extra_state[MaxK];       // (E_k, S) acc_t, or null
};
// Kernel parameters are limited to 4 KiB; the fused kernel's other arguments take ~200 bytes.
static_assert(sizeof(TableGroup<kMaxGroup>) <= 3584, "TableGroup<kMaxGroup> is too large for a kernel parameter");

// One table of a group, checked: contiguous inputs and sizes.
struct TableArgs {
  at::Tensor weights, opt_state;  // updated in place (undefined for accumulate_grad)
  at::Tensor g, s, o, p;          // grad_output, slots, offsets, per_sample_weights (undefined: none)
  int64_t rows = 0;               // keys of the table: weights.size(0) + E (accumulate_grad: num_rows)
  int64_t N = 0, B = 0;           // positions, bags
  at::Tensor extra_w, extra_s;    // (E, D), (E, S): the extra rows, updated in place (undefined: none)
  int64_t E = 0;                  // extra rows: keys [rows - E, rows)
};

// The kernel parameter of tables t[0..K) (1 <= K <= MaxK; positions and bags in all < 2^31).
template <int MaxK>
TableGroup<MaxK> make_group(const TableArgs* const* t, int K) {
  TableGroup<MaxK> tg{};
  tg.K = K;
  for (int k = 0; k < K; ++k) {
    const TableArgs& a = *t[k];
    tg.bag_base[k + 1] = tg.bag_base[k] + static_cast<int32_t>(a.B);
    tg.row_base[k + 1] = tg.row_base[k] + a.rows;
    tg.pos_base[k + 1] = tg.pos_base[k] + a.N;
    tg.slots[k] = a.s.data_ptr<int64_t>();
    tg.offsets[k] = a.o.data_ptr<int64_t>();
    tg.psw[k] = a.p.defined() ? a.p.data_ptr() : nullptr;
    tg.grad[k] = a.g.data_ptr();
    tg.weights[k] = a.weights.defined() ? a.weights.data_ptr() : nullptr;
    tg.state[k] = a.opt_state.defined() && a.opt_state.numel() > 0 ? a.opt_state.data_ptr() : nullptr;
    tg.extra[k] = static_cast<int32_t>(a.E);
    tg.extra_weights[k] = a.E > 0 ? a.extra_w.data_ptr() : nullptr;
    tg.extra_state[k] = a.E > 0 && a.extra_s.numel() > 0 ? a.extra_s.data_ptr() : nullptr;
  }
  return tg;
}

// ---- accumulate_grad --------------------------------------------------------------------

// Per position i of the group: its sort key (row_base[k] + slot, or the sentinel row_base[K]
// where the position gets no gradient: codes -1 / -2 and slots past its table's rows) and
// the value sorted with it: the position, with its bag in bag_of, when some table has
// per-sample weights (indexed by position); else (bag_of null) the bag itself, which
// saves the gradient gather one dependent load per row. Bags ascend with positions, so
// either value keeps a run in position order.
template <typename key_t, int MaxK>
__global__ void keys_kernel(const __grid_constant__ TableGroup<MaxK> tg, key_t* __restrict__ keys,
                            int32_t* __restrict__ vals, int32_t* __restrict__ bag_of,
                            unsigned long long* num_skipped) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tg.pos_base[tg.K]) return;
  const int k = segment_of(tg.pos_base, tg.K, i);
  const int64_t local = i - tg.pos_base[k];
  const int64_t s = tg.slots[k][local];
  const bool valid = s >= 0 && s < tg.row_base[k + 1] - tg.row_base[k];
  keys[i] = static_cast<key_t>(valid ? tg.row_base[k] + s : tg.row_base[tg.K]);
  if (!valid && num_skipped != nullptr) atomicAdd(num_skipped, 1ull);
  const int64_t num_bags = tg.bag_base[k + 1] - tg.bag_base[k];
  const int64_t num_pos = tg.pos_base[k + 1] - tg.pos_base[k];
  const int32_t bag =
      tg.bag_base[k] + static_cast<int32_t>(bag_of_position(tg.offsets[k], num_bags, num_pos, local));
  if (bag_of != nullptr) {
    vals[i] = static_cast<int32_t>(i);
    bag_of[i] = bag;
  } else {
    vals[i] = bag;
  }
}

// Mean pooling: 1 / (non-padding positions) per bag of the group, 0 for bags with none. A
// warp per bag.
template <typename acc_t, int MaxK>
__global__ void bag_scale_kernel(const __grid_constant__ TableGroup<MaxK> tg, acc_t* __restrict__ scale) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (b >= tg.bag_base[tg.K]) return;  // whole warps exit together
  const int k = segment_of(tg.bag_base, tg.K, b);
  const int64_t local = b - tg.bag_base[k];
  const int64_t* offsets = tg.offsets[k];
  const int64_t* slots = tg.slots[k];
  const int64_t start = offsets[local];
  // The last bag ends at the table's last position (= offsets[B_k] with include_last_offset).
  const int64_t stop =
      local + 1 < tg.bag_base[k + 1] - tg.bag_base[k] ? offsets[local + 1] : tg.pos_base[k + 1] - tg.pos_base[k];
  unsigned count = 0;
  for (int64_t i = start + lane; i < stop; i += 32) count += slots[i] != kPaddingSlot;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) count += __shfl_xor_sync(0xffffffffu, count, d);
  if (lane == 0) scale[b] = count > 0 ? acc_t(1) / static_cast<acc_t>(count) : acc_t(0);
}

// Runs (the positions of one slot) longer than kLongRun are reduced in two levels, so a
// hot id repeated 10^5 times in a batch is not one thread group's serial loop: fixed
// chunks of kLongRun positions are summed in parallel, then each run's chunk sums are
// added in chunk order. Both levels have a fixed order: the result is deterministic.
constexpr int32_t kLongRun = 64;

// ceil(len / kLongRun) without overflow for len up to 2^31 - 1.
__host__ __device__ __forceinline__ int32_t chunks_of(int32_t len) {
  return len / kLongRun + (len % kLongRun != 0);
}

// acc += the (scaled) gradient rows of sorted entries [k, stop), columns [c, c + V). The
// entries are positions (bag_of gives their bags) or, with bag_of null, the bags
// themselves (keys_kernel; then psw is null). They are one table's: grad_output (its
// (B_k, D) rows) and psw (its (N_k,) weights, or null) are indexed from its first bag bag0
// and first position pos0 of the group; bag_of and bag_scale by the group's.
template <typename scalar_t, int V>
__device__ __forceinline__ void add_rows(at::opmath_type<scalar_t> (&acc)[V], int64_t k, int64_t stop, int64_t c,
                                         const scalar_t* __restrict__ grad_output, int32_t bag0, int64_t D,
                                         const int32_t* __restrict__ sorted_pos, const int32_t* __restrict__ bag_of,
                                         const scalar_t* __restrict__ psw, int64_t pos0,
                                         const at::opmath_type<scalar_t>* __restrict__ bag_scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const bool scaled = psw != nullptr || bag_scale != nullptr;
  auto add = [&](int32_t pos, int32_t b, const Pack<scalar_t, V>& g) {
    if (scaled) {
      const acc_t w = psw != nullptr ? static_cast<acc_t>(psw[pos - pos0]) : bag_scale[b];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += w * static_cast<acc_t>(g.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += static_cast<acc_t>(g.v[j]);
    }
  };
  for (; k + kUnroll <= stop; k += kUnroll) {
    int32_t pos[kUnroll], b[kUnroll];
    Pack<scalar_t, V> g[kUnroll];
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) pos[q] = sorted_pos[k + q];
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) b[q] = bag_of != nullptr ? bag_of[pos[q]] : pos[q];
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) g[q] = load_pack<scalar_t, V>(grad_output + (b[q] - bag0) * D + c);
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) add(pos[q], b[q], g[q]);
  }
  for (; k < stop; ++k) {
    const int32_t pos = sorted_pos[k];
    const int32_t b = bag_of != nullptr ? bag_of[pos] : pos;
    add(pos, b, load_pack<scalar_t, V>(grad_output + (b - bag0) * D + c));
  }
}

// One thread group per run of at most kLongRun positions (longer runs: chunk kernels).
template <typename scalar_t, typename key_t, int V>
__global__ void segment_sum_kernel(const scalar_t* __restrict__ grad_output,  // (B, D)
                                   int64_t D,
                                   const key_t* __restrict__ uniq,         // (U,) sorted slots
                                   const int32_t* __restrict__ run_start,  // (U,)
                                   const int32_t* __restrict__ run_len,    // (U,)
                                   int64_t U,
                                   const int32_t* __restrict__ sorted_pos,  // (K,)
                                   const int32_t* __restrict__ bag_of,      // (N,)
                                   const scalar_t* __restrict__ psw,        // (N,) or null
                                   const at::opmath_type<scalar_t>* __restrict__ bag_scale,  // (B,) or null
                                   int lanes,
                                   int64_t* __restrict__ unique_slots,  // (U,)
                                   scalar_t* __restrict__ grad_rows) {  // (U, D)
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t u = t / lanes;
  if (u >= U) return;
  const int lane = static_cast<int>(t % lanes);
  if (lane == 0) unique_slots[u] = static_cast<int64_t>(uniq[u]);
  if (run_len[u] > kLongRun) return;
  const int64_t start = run_start[u];
  const int64_t stop = start + run_len[u];
  for (int64_t c = static_cast<int64_t>(lane) * V; c < D; c += static_cast<int64_t>(lanes) * V) {
    acc_t acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0;
    add_rows<scalar_t, V>(acc, start, stop, c, grad_output, 0, D, sorted_pos, bag_of, psw, 0, bag_scale);
    Pack<scalar_t, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = static_cast<scalar_t>(acc[j]);
    store_pack<scalar_t, V>(grad_rows + u * D + c, o);
  }
}

// Counts the long runs and their chunks into info[2], info[3] (runs = info[0], the last
// one the invalid-slot sentinel when info[1] > 0).
__global__ void long_runs_count_kernel(const int32_t* __restrict__ run_len, int64_t N, int64_t* info) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t U = info[0] - (info[1] > 0 ? 1 : 0);
  if (u >= U || u >= N || run_len[u] <= kLongRun) return;
  atomicAdd(reinterpret_cast<unsigned long long*>(info + 2), 1ull);
  atomicAdd(reinterpret_cast<unsigned long long*>(info + 3),
            static_cast<unsigned long long>(chunks_of(run_len[u])));
}

// Lists the long runs; each gets a contiguous range of chunk slots (base). The list
// order depends on scheduling, the arithmetic does not.
__global__ void long_runs_list_kernel(const int32_t* __restrict__ run_len, int64_t U, int32_t* __restrict__ runs,
                                      int32_t* __restrict__ base, int32_t* counters) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= U || run_len[u] <= kLongRun) return;
  const int32_t i = atomicAdd(counters, 1);
  runs[i] = static_cast<int32_t>(u);
  base[i] = atomicAdd(counters + 1, chunks_of(run_len[u]));
}

// chunk_run[base[i] + c] = i for every chunk c of long run i (a block per run).
__global__ void chunk_owner_kernel(const int32_t* __restrict__ runs, const int32_t* __restrict__ base,
                                   const int32_t* __restrict__ run_len, int32_t* __restrict__ chunk_run) {
  const int32_t i = blockIdx.x;
  const int32_t chunks = chunks_of(run_len[runs[i]]);
  for (int32_t c = threadIdx.x; c < chunks; c += blockDim.x) chunk_run[base[i] + c] = i;
}

// partial[m] = the sum of chunk m (kLongRun positions of one long run), in acc_t.
template <typename scalar_t, int V>
__global__ void chunk_sum_kernel(const scalar_t* __restrict__ grad_output, int64_t D, int64_t M,
                                 const int32_t* __restrict__ chunk_run, const int32_t* __restrict__ runs,
                                 const int32_t* __restrict__ base, const int32_t* __restrict__ run_start,
                                 const int32_t* __restrict__ run_len, const int32_t* __restrict__ sorted_pos,
                                 const int32_t* __restrict__ bag_of, const scalar_t* __restrict__ psw,
                                 const at::opmath_type<scalar_t>* __restrict__ bag_scale, int lanes,
                                 at::opmath_type<scalar_t>* __restrict__ partial) {  // (M, D)
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = t / lanes;
  if (m >= M) return;
  const int lane = static_cast<int>(t % lanes);
  const int32_t i = chunk_run[m];
  const int32_t u = runs[i];
  const int64_t start = run_start[u] + static_cast<int64_t>(m - base[i]) * kLongRun;
  const int64_t stop = min(start + kLongRun, static_cast<int64_t>(run_start[u]) + run_len[u]);
  for (int64_t c = static_cast<int64_t>(lane) * V; c < D; c += static_cast<int64_t>(lanes) * V) {
    acc_t acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0;
    add_rows<scalar_t, V>(acc, start, stop, c, grad_output, 0, D, sorted_pos, bag_of, psw, 0, bag_scale);
#pragma unroll
    for (int j = 0; j < V; ++j) partial[m * D + c + j] = acc[j];
  }
}

// grad_rows[u] = the chunk sums of long run u, added in chunk order.
template <typename scalar_t>
__global__ void long_run_total_kernel(const at::opmath_type<scalar_t>* __restrict__ partial, int64_t D, int64_t L,
                                      const int32_t* __restrict__ runs, const int32_t* __restrict__ base,
                                      const int32_t* __restrict__ run_len, scalar_t* __restrict__ grad_rows) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = t / D;
  if (i >= L) return;
  const int64_t j = t % D;
  const int32_t u = runs[i];
  const int32_t chunks = chunks_of(run_len[u]);
  acc_t acc = 0;
  for (int32_t c = 0; c < chunks; ++c) acc += partial[(static_cast<int64_t>(base[i]) + c) * D + j];
  grad_rows[static_cast<int64_t>(u) * D + j] = static_cast<scalar_t>(acc);
}

// f(key) with a key_t value: the narrowest radix-sort key (uint32_t, else uint64_t) that
// holds the sentinel num_rows of positions without a gradient (for a group: its total rows).
template <typename F>
decltype(auto) with_sort_key(int64_t num_rows, F&& f) {
  if (num_rows < (int64_t{1} << 32)) return f(uint32_t{0});
  return f(uint64_t{0});
}

// The positions of a backward pass grouped by key: keys (keys_kernel), stably
// radix-sorted with their positions, then run-length encoded (one run per key, the
// sentinel's last; the run count goes to *num_runs on the device). Shared by
// accumulate_grad and the fused accumulate_and_update(_many).
template <typename key_t>
struct SortedRuns {
  const int32_t* sorted_pos;  // (N,): positions or bags (keys_kernel), grouped by key, ascending within one
  const int32_t* bag_of;      // (N,): the bag of each position; null when sorted_pos holds bags
  const key_t* uniq;          // (N,): the key of each run (first *num_runs valid)
  const int32_t* run_len;     // (N,): the length of each run
};

// Its arrays live in the caller's arena: the constructor reserves them (before the arena's
// allocation) and asks CUB for its temporary storage; run() sorts (after it), in temp_bytes()
// of temporary storage that the caller may share with later CUB calls of the same stream.
template <typename key_t, int MaxK>
class RunSort {
 public:
  RunSort(const TableGroup<MaxK>& tg, Arena& a)
      : tg_(tg), N_(tg.pos_base[tg.K]), end_bit_(std::max(1, bit_width(static_cast<uint64_t>(tg.row_base[tg.K])))) {
    for (int k = 0; k < tg.K; ++k) weighted_ |= tg.psw[k] != nullptr;  // psw are indexed by position: sort positions
    keys_ = a.add<key_t>(N_);
    pos_ = a.add<int32_t>(N_);
    if (weighted_) bag_of_ = a.add<int32_t>(N_);
    sorted_keys_ = a.add<key_t>(N_);
    sorted_pos_ = a.add<int32_t>(N_);
    uniq_ = a.add<key_t>(N_);
    run_len_ = a.add<int32_t>(N_);
    size_t sort = 0, encode = 0;
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort, static_cast<const key_t*>(nullptr),
                                                   static_cast<key_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                   static_cast<int32_t*>(nullptr), n(), 0, end_bit_, stream()));
    C10_CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(nullptr, encode, static_cast<key_t*>(nullptr),
                                                      static_cast<key_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                                      static_cast<int64_t*>(nullptr), n(), stream()));
    temp_bytes_ = std::max(sort, encode);
  }
  size_t temp_bytes() const { return temp_bytes_; }

  SortedRuns<key_t> run(const Arena& a, void* temp, int64_t* num_runs, unsigned long long* num_skipped) const {
    key_t* const kp = a.ptr<key_t>(keys_);
    key_t* const skp = a.ptr<key_t>(sorted_keys_);
    int32_t* const bag_of = weighted_ ? a.ptr<int32_t>(bag_of_) : nullptr;
    keys_kernel<key_t, MaxK><<<grid_for(N_), kThreads, 0, stream()>>>(tg_, kp, a.ptr<int32_t>(pos_), bag_of,
                                                                     num_skipped);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // Stable sort on the key's significant bits: within a key, positions stay ascending.
    size_t bytes = temp_bytes_;
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, bytes, kp, skp, a.ptr<int32_t>(pos_),
                                                   a.ptr<int32_t>(sorted_pos_), n(), 0, end_bit_, stream()));
    bytes = temp_bytes_;
    C10_CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(temp, bytes, skp, a.ptr<key_t>(uniq_), a.ptr<int32_t>(run_len_),
                                                      num_runs, n(), stream()));
    return {a.ptr<int32_t>(sorted_pos_), bag_of, a.ptr<key_t>(uniq_), a.ptr<int32_t>(run_len_)};
  }

 private:
  int n() const { return static_cast<int>(N_); }
  const TableGroup<MaxK> tg_;  // a copy (a kernel parameter): the sorter never outlives what it was given
  int64_t N_;
  int end_bit_;
  bool weighted_ = false;
  int64_t keys_ = 0, pos_ = 0, bag_of_ = 0, sorted_keys_ = 0, sorted_pos_ = 0, uniq_ = 0, run_len_ = 0;
  size_t temp_bytes_ = 0;
};

// accumulate_grad of one table (t.rows = num_rows; N > 0).
template <typename key_t>
std::tuple<at::Tensor, at::Tensor> accumulate(const TableArgs& t, int64_t mode) {
  const at::Tensor& g = t.g;
  const at::Tensor& s = t.s;
  const at::Tensor& p = t.p;
  const int64_t N = t.N;
  const int64_t B = t.B;
  const int64_t D = g.size(1);
  const auto opts = s.options();
  const TableArgs* one = &t;
  const TableGroup<1> tg = make_group<1>(&one, 1);
  // info[0]: number of runs (written by CUB), info[1]: positions without a gradient,
  // info[2], info[3]: runs longer than kLongRun and their chunks.
  at::Tensor info = at::zeros({4}, opts);
  Arena scratch;
  const RunSort<key_t, 1> sort(tg, scratch);
  const int64_t temp_at = scratch.add_bytes(static_cast<int64_t>(sort.temp_bytes()));
  scratch.allocate(opts);
  const SortedRuns<key_t> runs = sort.run(scratch, scratch.ptr<uint8_t>(temp_at), info.data_ptr<int64_t>(),
                                          reinterpret_cast<unsigned long long*>(info.data_ptr<int64_t>() + 1));
  const int32_t* sorted_pos = runs.sorted_pos;
  const int32_t* bag_of = runs.bag_of;
  const int32_t* run_len = runs.run_len;
  const key_t* up = runs.uniq;
  long_runs_count_kernel<<<grid_for(N), kThreads, 0, stream()>>>(run_len, N, info.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor host = info.cpu();  // sync: sizes the outputs
  const int64_t* h = host.data_ptr<int64_t>();
  const int64_t U = h[0] - (h[1] > 0 ? 1 : 0);  // the sentinel run (invalid slots) is last
  const int64_t L = h[2], M = h[3];

  at::Tensor unique_slots = at::empty({U}, opts);
  at::Tensor grad_rows = at::empty({U, D}, g.options());
  if (U == 0) return {unique_slots, grad_rows};
  at::Tensor run_start = at::empty({U}, opts.dtype(at::kInt));
  cub_call(s, [&](void* temp, size_t& bytes) {
    return cub::DeviceScan::ExclusiveSum(temp, bytes, run_len, run_start.data_ptr<int32_t>(), static_cast<int>(U),
                                         stream());
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "accumulate_grad_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor scale;
    if (mode == kMean) {
      scale = at::empty({B}, g.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
      bag_scale_kernel<acc_t, 1><<<grid_for(B * 32), kThreads, 0, stream()>>>(tg, scale.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const int lanes = lanes_for(D, V);
      segment_sum_kernel<scalar_t, key_t, V><<<grid_for(U * lanes), kThreads, 0, stream()>>>(
          g.data_ptr<scalar_t>(), D, up, run_start.data_ptr<int32_t>(), run_len, U, sorted_pos, bag_of,
          p.defined() ? p.data_ptr<scalar_t>() : nullptr,
          scale.defined() ? scale.data_ptr<acc_t>() : nullptr, lanes, unique_slots.data_ptr<int64_t>(),
          grad_rows.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (L == 0) return;
      at::Tensor runs = at::empty({L}, opts.dtype(at::kInt));
      at::Tensor base = at::empty({L}, opts.dtype(at::kInt));
      at::Tensor counters = at::zeros({2}, opts.dtype(at::kInt));
      at::Tensor chunk_run = at::empty({M}, opts.dtype(at::kInt));
      at::Tensor partial = at::empty({M, D}, g.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
      long_runs_list_kernel<<<grid_for(U), kThreads, 0, stream()>>>(
          run_len, U, runs.data_ptr<int32_t>(), base.data_ptr<int32_t>(),
          counters.data_ptr<int32_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      chunk_owner_kernel<<<static_cast<unsigned>(L), kThreads, 0, stream()>>>(
          runs.data_ptr<int32_t>(), base.data_ptr<int32_t>(), run_len, chunk_run.data_ptr<int32_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      chunk_sum_kernel<scalar_t, V><<<grid_for(M * lanes), kThreads, 0, stream()>>>(
          g.data_ptr<scalar_t>(), D, M, chunk_run.data_ptr<int32_t>(), runs.data_ptr<int32_t>(),
          base.data_ptr<int32_t>(), run_start.data_ptr<int32_t>(), run_len, sorted_pos, bag_of,
          p.defined() ? p.data_ptr<scalar_t>() : nullptr,
          scale.defined() ? scale.data_ptr<acc_t>() : nullptr, lanes, partial.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      long_run_total_kernel<scalar_t><<<grid_for(L * D), kThreads, 0, stream()>>>(
          partial.data_ptr<acc_t>(), D, L, runs.data_ptr<int32_t>(), base.data_ptr<int32_t>(), run_len,
          grad_rows.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (can_vectorize<scalar_t>(D, {g.data_ptr(), grad_rows.data_ptr()})) {
      launch(std::integral_constant<int, vec16<scalar_t>()>());
    } else {
      launch(std::integral_constant<int, 1>());
    }
  });
  return {unique_slots, grad_rows};
}

std::tuple<at::Tensor, at::Tensor> accumulate_grad_cuda(const at::Tensor& grad_output, const at::Tensor& slots,
                                                        const at::Tensor& offsets,
                                                        const std::optional<at::Tensor>& per_sample_weights,
                                                        int64_t mode, bool include_last_offset, int64_t num_rows) {
  constexpr const char* op = "veloce::accumulate_grad";
  check_backward_inputs(op, grad_output, slots, offsets, per_sample_weights, mode);
  check_num_rows(op, num_rows);
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const int64_t N = slots.numel();
  check_num_ids_cuda(op, N);
  const at::Tensor s = slots.contiguous();
  const at::Tensor o = offsets.contiguous();
  const int64_t B = check_bags_and_slots_cuda(op, o, s, N, include_last_offset, -1, "");
  check_grad_output_rows(op, grad_output, B);
  check_num_bags_cuda(op, B);
  const at::Tensor g = grad_output.contiguous();
  const at::Tensor p = per_sample_weights.has_value() ? per_sample_weights->contiguous() : at::Tensor();
  if (N == 0) return {at::empty({0}, s.options()), at::empty({0, g.size(1)}, g.options())};
  const TableArgs t{at::Tensor(), at::Tensor(), g, s, o, p, num_rows, N, B};
  return with_sort_key(num_rows, [&](auto key) { return accumulate<decltype(key)>(t, mode); });
}

// ---- accumulate_and_update(_many) -----------------------------------------------------
//
// accumulate_grad and sparse_update fused, with no host synchronization: the sizes that
// accumulate_grad reads back (unique rows, long runs) stay on the device. After the sort
// and run-length encode of accumulate_grad (over a group of tables: one key space, see
// TableGroup), every run (one unique row of one table) is cut into
// chunks of kLongRun positions; one exclusive scan gives each run its first position,
// first chunk and first partial row. A grid-stride loop of thread groups then takes the
// runs and the chunks of long runs: a run of one chunk (almost all of them) is summed in
// registers and applied at once; a longer run's chunks write fp32 partial sums, and the
// group that finishes a run's last chunk adds the partials in chunk order and applies
// the update. The sums are
// those of accumulate_grad, in the same order: the result is deterministic and equal to
// accumulate_grad followed by sparse_update.

// Per run: its length, chunks and partial rows (chunks of runs longer than one chunk);
// as an exclusive scan, the run's first sorted position and first partial row.
struct RunPlan {
  int32_t len, chunks, partials;
};

struct RunPlanSum {
  __device__ __forceinline__ RunPlan operator()(const RunPlan& a, const RunPlan& b) const {
    return {a.len + b.len, a.chunks + b.chunks, a.partials + b.partials};
  }
};

// plan[u] for u < N: runs past num_runs (the encode wrote fewer) and the sentinel run of
// positions without a gradient have no chunks.
// It also zeroes the fused kernel's `arrived` counters (num_arrived of them): one launch
// less than a memset of their own.
template <typename key_t>
__global__ void plan_kernel(const key_t* __restrict__ uniq, const int32_t* __restrict__ run_len,
                            const int64_t* __restrict__ num_runs, int64_t N, int64_t num_rows,
                            RunPlan* __restrict__ plan, int32_t* __restrict__ arrived, int64_t num_arrived) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u < num_arrived) arrived[u] = 0;
  if (u >= N) return;
  if (u >= *num_runs) {
    plan[u] = {0, 0, 0};
    return;
  }
  const int32_t len = run_len[u];
  const int32_t chunks = static_cast<int64_t>(uniq[u]) < num_rows ? chunks_of(len) : 0;
  plan[u] = {len, chunks, chunks > 1 ? chunks : 0};
}

// The largest u < N with first[u].partials <= j: the run of partial chunk j (runs
// without partials share their successor's first partial and are never the largest such u).
__device__ __forceinline__ int64_t run_of_partial(const RunPlan* __restrict__ first, int64_t N, int64_t j) {
  int64_t lo = 0, hi = N;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (first[mid].partials <= j) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Partial rows of a long run read at once by the group that adds them up.
constexpr int kPartialBatch = 8;

// Resident blocks of kThreads per multiprocessor that the fused kernel asks the compiler
// for. The kernel waits on chains of dependent loads (run plan -> sorted position ->
// gradient row), so it needs many warps in flight. Unbounded, the instance of one 4-word
// pack per lane (every fp32 row up to 128 wide) took 90 registers: two blocks, 25%
// occupancy, 0.26 eligible warps per scheduler, 43% of DRAM bandwidth (ncu, SGD, H100).
// Bounded to three blocks (80 registers) it takes 17% less time with SGD, 13% with Adam.
// Four blocks (64 registers) spill and are no faster. Wider packs per lane (half and bfloat16 rows in packs of 8) keep the bound of
// one block: under three they spill.
template <typename scalar_t, int V, int ITER>
constexpr int update_min_blocks() {
  return ITER == 1 && V * sizeof(at::opmath_type<scalar_t>) <= 16 ? 3 : 1;
}

// ITER column packs per lane cover the row: D <= ITER * lanes * V. The group's tables
// share D and S (the optimizer's state width). R: the optimizer's rule (optim::dispatch);
// every thread makes its parameters from hparams in device memory, so a graph replay
// applies the values found there.
template <class R, typename scalar_t, typename key_t, int V, int ITER, int MaxK>
__global__ void __launch_bounds__(kThreads, update_min_blocks<scalar_t, V, ITER>()) accumulate_update_kernel(
    const __grid_constant__ TableGroup<MaxK> tg, int64_t D, int64_t S, const double* __restrict__ hparams,
    const key_t* __restrict__ uniq, const int64_t* __restrict__ num_runs, const RunPlan* __restrict__ plan,
    const RunPlan* __restrict__ first, int64_t N, const int32_t* __restrict__ sorted_pos,
    const int32_t* __restrict__ bag_of, const at::opmath_type<scalar_t>* __restrict__ bag_scale, int lanes,
    at::opmath_type<scalar_t>* partial, int32_t* __restrict__ arrived, const bool* __restrict__ skip) {
  using acc_t = at::opmath_type<scalar_t>;
  if (skip != nullptr && *skip) return;  // the op's skip flag: no table is written
  const auto rule = R::template make<acc_t>(hparams);
  // Work items: the runs (those of one chunk are done at once), then the chunks of runs
  // longer than one chunk (located by a binary search; they are few).
  const int64_t runs = *num_runs;
  const int64_t total = runs + first[N - 1].partials + plan[N - 1].partials;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = static_cast<int>(t % lanes);
  const unsigned mask = group_mask(lanes);
  const int leader = static_cast<int>(threadIdx.x & 31) - lane;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * blockDim.x / lanes;
  // A run's head (its plan, its scan and its key) is loaded one work item ahead: the chain
  // head -> sorted positions (-> bags, with per-sample weights) -> gradient rows then waits
  // one dependent load less per run.
  // Only what a run of one chunk reads is carried ahead (its first sorted position, length,
  // chunks and key): the partial counts matter to the chunks of long runs alone.
  // Configuration 3 on an H200 (ncu): Adam 8% faster than without it, SGD 2%, although
  // fp32's spill stores grow from 16 to 48-56 bytes.
  int64_t i = t / lanes;  // the lanes of a group share i
  int32_t start_ahead = 0, len_ahead = 0, chunks_ahead = 0;
  key_t key_ahead = 0;
  if (i < runs) {
    start_ahead = first[i].len;
    len_ahead = plan[i].len;
    chunks_ahead = plan[i].chunks;
    key_ahead = uniq[i];
  }
  for (; i < total; i += groups) {
    int64_t u = i, k = 0;
    RunPlan f{start_ahead, 0, 0}, p{len_ahead, chunks_ahead, 0};
    int64_t key = static_cast<int64_t>(key_ahead);
    if (i < runs) {
      const int64_t next = i + groups;
      if (next < runs) {
        start_ahead = first[next].len;
        len_ahead = plan[next].len;
        chunks_ahead = plan[next].chunks;
        key_ahead = uniq[next];
      }
    } else {
      u = run_of_partial(first, N, i - runs);
      f = first[u];
      p = plan[u];
      k = i - runs - f.partials;
      key = static_cast<int64_t>(uniq[u]);
    }
    if (i < runs && p.chunks != 1) continue;  // no gradient, or a long run (its chunks follow)
    // The run's table (runs never span tables) and its inputs.
    const int tb = segment_of(tg.row_base, tg.K, key);
    const scalar_t* __restrict__ grad_output = static_cast<const scalar_t*>(tg.grad[tb]);
    const scalar_t* __restrict__ psw = static_cast<const scalar_t*>(tg.psw[tb]);
    const int32_t bag0 = tg.bag_base[tb];
    const int64_t pos0 = tg.pos_base[tb];
    const int64_t start = static_cast<int64_t>(f.len) + k * kLongRun;
    const int64_t stop = min(start + kLongRun, static_cast<int64_t>(f.len) + p.len);
    // The run's row and its state. A run of one chunk loads them now, so that these loads
    // are in flight with the gradient gather below (they do not depend on it); a long
    // run's last chunk loads them once its sum is complete.
    // (Past the table's own rows: its extra rows.)
    const int64_t slot = key - tg.row_base[tb];
    const int64_t own = tg.row_base[tb + 1] - tg.row_base[tb] - tg.extra[tb];
    scalar_t* __restrict__ w_row = slot < own ? static_cast<scalar_t*>(tg.weights[tb]) + slot * D
                                              : static_cast<scalar_t*>(tg.extra_weights[tb]) + (slot - own) * D;
    acc_t* __restrict__ st = slot < own ? static_cast<acc_t*>(tg.state[tb]) + slot * S
                                        : static_cast<acc_t*>(tg.extra_state[tb]) + (slot - own) * S;
    Pack<scalar_t, V> w[ITER];
    StatePack<R, acc_t, V> sp[ITER];
    auto load_row = [&]() {
#pragma unroll
      for (int it = 0; it < ITER; ++it) {
        const int64_t c = (static_cast<int64_t>(it) * lanes + lane) * V;
        if (c >= D) continue;
        w[it] = load_pack<scalar_t, V>(w_row + c);
        sp[it] = load_state<R, acc_t, V>(st, c, D);
      }
    };
    if (p.chunks == 1) load_row();
    acc_t g[ITER][V];
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
      const int64_t c = (static_cast<int64_t>(it) * lanes + lane) * V;
#pragma unroll
      for (int j = 0; j < V; ++j) g[it][j] = 0;
      if (c < D) {
        add_rows<scalar_t, V>(g[it], start, stop, c, grad_output, bag0, D, sorted_pos, bag_of, psw, pos0, bag_scale);
      }
    }
    if (p.chunks > 1) {
      // One chunk of a long run: store its sum; the last of the run's chunks to finish
      // adds them all, in chunk order.
      acc_t* mine = partial + (static_cast<int64_t>(f.partials) + k) * D;
#pragma unroll
      for (int it = 0; it < ITER; ++it) {
        const int64_t c = (static_cast<int64_t>(it) * lanes + lane) * V;
        if (c < D) {
#pragma unroll
          for (int j = 0; j < V; ++j) mine[c + j] = g[it][j];
        }
      }
      __threadfence();  // release: this lane's partial columns, before the count
      __syncwarp(mask);
      int last = 0;
      if (lane == 0) {
        last = atomicAdd(arrived + f.partials, 1) == p.chunks - 1;
        __threadfence();  // acquire: the other groups' partials, after the count
      }
      if (!__shfl_sync(mask, last, leader)) continue;
      __syncwarp(mask);
#pragma unroll
      for (int it = 0; it < ITER; ++it) {
        const int64_t c = (static_cast<int64_t>(it) * lanes + lane) * V;
#pragma unroll
        for (int j = 0; j < V; ++j) g[it][j] = 0;
        if (c >= D) continue;
        // In chunk order; kPartialBatch chunks' loads in flight (a hot id has thousands).
        const acc_t* rows = partial + static_cast<int64_t>(f.partials) * D + c;
        int32_t q = 0;
        for (; q + kPartialBatch <= p.chunks; q += kPartialBatch) {
          acc_t v[kPartialBatch][V];
#pragma unroll
          for (int r = 0; r < kPartialBatch; ++r) {
#pragma unroll
            for (int j = 0; j < V; ++j) v[r][j] = __ldcg(rows + (q + r) * D + j);
          }
#pragma unroll
          for (int r = 0; r < kPartialBatch; ++r) {
#pragma unroll
            for (int j = 0; j < V; ++j) g[it][j] += v[r][j];
          }
        }
        for (; q < p.chunks; ++q) {
#pragma unroll
          for (int j = 0; j < V; ++j) g[it][j] += __ldcg(rows + q * D + j);
        }
      }
      load_row();
    }
    // The update of the run's row with gradient g, as sparse_update_kernel does it.
    acc_t sq = 0;
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
      const int64_t c = (static_cast<int64_t>(it) * lanes + lane) * V;
      if (c >= D) continue;
      add_weight_decay<R>(rule, w[it], g[it]);
      if constexpr (R::kRowPrologue) {
#pragma unroll
        for (int j = 0; j < V; ++j) sq += g[it][j] * g[it][j];
      }
    }
    acc_t row = 0;
    if constexpr (R::kRowPrologue) row = row_factor<R>(rule, sq, st, D, lane, lanes, mask);
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
      const int64_t c = (static_cast<int64_t>(it) * lanes + lane) * V;
      if (c >= D) continue;
      apply_pack<R>(rule, w[it], g[it], sp[it], row);
      store_state<R>(st, c, D, sp[it]);
      store_pack<scalar_t, V>(w_row + c, w[it]);
    }
  }
}

// Column packs per lane the fused kernel holds in registers; wider rows take the unfused path.
constexpr int kMaxIter = 4;

// Waves of resident blocks the fused kernel is launched with (see its launch); 0: one group
// per position, capped at 32768 blocks. Read once
// from VELOCE_UPDATE_WAVES (default 4), so that one build can sweep it (tools/gpu_ab_stages.sh
// waves). 4 waves make the kernel alone 8-19% faster than 0 (H200, ncu) and configuration 3's
// step 4-9% faster on an H100; on an H200 one of two runs of Adam without the check was
// slower, the next step's insert beside it waiting for SMs.
// A value that is not a whole number in [0, kMaxUpdateWaves] is refused with a warning
// (the default is used).
constexpr int64_t kMaxUpdateWaves = 1024;
int64_t update_waves() {
  static const int64_t waves = [] {
    constexpr int64_t kDefault = 4;
    const char* env = std::getenv("VELOCE_UPDATE_WAVES");
    if (env == nullptr || *env == '\0') return kDefault;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(env, &end, 10);
    if (errno != 0 || *end != '\0' || v < 0 || v > kMaxUpdateWaves) {
      TORCH_WARN("VELOCE_UPDATE_WAVES=", env, " is not a whole number from 0 to ", kMaxUpdateWaves,
                 "; the fused sparse update uses the default, ", kDefault, " waves");
      return kDefault;
    }
    return static_cast<int64_t>(v);
  }();
  return waves;
}

// The fused pass over tables t[0..K) (1 <= K <= MaxK; each with positions and rows), with
// 16-byte packs or not (vec: every table allows them).
template <typename key_t, int MaxK>
void accumulate_and_update_fused(const TableArgs* const* t, int K, int64_t mode, bool vec, int64_t optimizer,
                                 const double* hparams, const bool* skip) {
  const TableGroup<MaxK> tg = make_group<MaxK>(t, K);
  const int64_t N = tg.pos_base[K];
  const int64_t B = tg.bag_base[K];
  const int64_t R = tg.row_base[K];
  const int64_t D = t[0]->weights.size(1);
  const int64_t S = t[0]->opt_state.size(1);
  const at::Tensor& like = t[0]->s;
  const at::Tensor& g0 = t[0]->g;
  const int64_t acc_size = static_cast<int64_t>(c10::elementSize(at::toOpMathType(g0.scalar_type())));
  // Partial rows: chunks of runs longer than kLongRun, at most 2 N / kLongRun of them.
  const int64_t max_partials = 2 * ceil_div(N, kLongRun);
  // Every scratch array in one allocation (about a dozen, each a call of the caching
  // allocator on the step's critical path before), CUB's temporary storage shared by the
  // sort, the encode and the plan's scan (one stream: one after another).
  Arena scratch;
  const RunSort<key_t, MaxK> sort(tg, scratch);
  const int64_t num_runs_at = scratch.add<int64_t>(1);
  // RunPlan is three int32: the plan and its scan.
  const int64_t plan_at = scratch.add<RunPlan>(N);
  const int64_t first_at = scratch.add<RunPlan>(N);
  const int64_t arrived_at = scratch.add<int32_t>(max_partials);  // zeroed by plan_kernel
  const int64_t partial_at = scratch.add_bytes(max_partials * D * acc_size);
  const int64_t scale_at = mode == kMean ? scratch.add_bytes(B * acc_size) : -1;
  size_t scan_bytes = 0;
  // The size query with the argument types of the call below (CUB sizes by them).
  C10_CUDA_CHECK(cub::DeviceScan::ExclusiveScan(nullptr, scan_bytes, static_cast<RunPlan*>(nullptr),
                                                static_cast<RunPlan*>(nullptr), RunPlanSum(), RunPlan{0, 0, 0},
                                                static_cast<int>(N), stream()));
  const size_t temp_bytes = std::max(sort.temp_bytes(), scan_bytes);
  const int64_t temp_at = scratch.add_bytes(static_cast<int64_t>(temp_bytes));
  scratch.allocate(like.options());
  void* const temp = scratch.ptr<uint8_t>(temp_at);
  int64_t* const num_runs = scratch.ptr<int64_t>(num_runs_at);
  const SortedRuns<key_t> runs = sort.run(scratch, temp, num_runs, nullptr);
  const key_t* up = runs.uniq;
  RunPlan* const pp = scratch.ptr<RunPlan>(plan_at);
  RunPlan* const fp = scratch.ptr<RunPlan>(first_at);
  int32_t* const arrived = scratch.ptr<int32_t>(arrived_at);
  plan_kernel<key_t><<<grid_for(std::max(N, max_partials)), kThreads, 0, stream()>>>(up, runs.run_len, num_runs, N, R,
                                                                                     pp, arrived, max_partials);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  size_t bytes = temp_bytes;
  C10_CUDA_CHECK(cub::DeviceScan::ExclusiveScan(temp, bytes, pp, fp, RunPlanSum(), RunPlan{0, 0, 0},
                                                static_cast<int>(N), stream()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g0.scalar_type(), "accumulate_and_update_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* const scale = scale_at >= 0 ? scratch.ptr<acc_t>(scale_at) : nullptr;
    if (scale != nullptr) {
      bag_scale_kernel<acc_t, MaxK><<<grid_for(B * 32), kThreads, 0, stream()>>>(tg, scale);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    acc_t* const partial = scratch.ptr<acc_t>(partial_at);
    auto launch_rule = [&](auto vec, auto iter, auto rule) {
      constexpr int V = decltype(vec)::value;
      constexpr int ITER = decltype(iter)::value;
      using R = decltype(rule);
      const int lanes = lanes_for(D, V);
      // A few waves of the blocks that fit at once, each group taking many runs through
      // the grid-stride loop (never more blocks than one group per position needs). Before,
      // one group per position, capped at 32768 blocks: about 1.4 runs per group, and each
      // group first read the run count and the plan's totals (one more round trip before
      // its first run), and a block's finished warps idled until its slowest one (long
      // runs' chunks take 64 rows) was done.
      const int64_t resident =
          static_cast<int64_t>(resident_blocks_per_sm<accumulate_update_kernel<R, scalar_t, key_t, V, ITER, MaxK>>()) *
          num_sms();
      const int64_t waves = update_waves();
      const int64_t blocks = std::min<int64_t>(grid_for(N * lanes), waves > 0 ? waves * resident : 32 * 1024);
      accumulate_update_kernel<R, scalar_t, key_t, V, ITER, MaxK>
          <<<static_cast<unsigned>(blocks), kThreads, 0, stream()>>>(
              tg, D, S, hparams, up, num_runs, pp, fp, N, runs.sorted_pos, runs.bag_of, scale, lanes, partial,
              arrived, skip);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    // One kernel instance per rule: the optimizer is chosen here, once per launch.
    auto launch = [&](auto vec, auto iter) {
      optim::dispatch(optimizer, [&](auto rule) { launch_rule(vec, iter, rule); });
    };
    auto with_iter = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const int64_t iters = ceil_div(D, static_cast<int64_t>(lanes_for(D, V)) * V);
      if (iters <= 1) {
        launch(vec, std::integral_constant<int, 1>());
      } else if (iters <= 2) {
        launch(vec, std::integral_constant<int, 2>());
      } else {
        launch(vec, std::integral_constant<int, kMaxIter>());
      }
    };
    if (vec) {
      with_iter(std::integral_constant<int, vec16<scalar_t>()>());
    } else {
      with_iter(std::integral_constant<int, 1>());
    }
  });
}

// Rows too wide for the fused kernel's registers: the gradient rows are written out
// (accumulate_grad), then applied (sparse_update), the extra rows' (the last unique slots,
// from C on) to the extra rows.
void update_wide(const TableArgs& t, int64_t mode, int64_t optimizer, const at::Tensor& hparams) {
  auto [unique_slots, grad_rows] = with_sort_key(t.rows, [&](auto key) { return accumulate<decltype(key)>(t, mode); });
  static auto update = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("veloce::sparse_update", "")
                           .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       int64_t, const at::Tensor&)>();
  if (t.E == 0) {
    update.call(t.weights, t.opt_state, unique_slots, grad_rows, optimizer, hparams);
    return;
  }
  const int64_t C = t.rows - t.E;
  const int64_t own = (unique_slots < C).sum().item<int64_t>();  // ascending slots; a sync, as accumulate's
  const int64_t U = unique_slots.numel();
  update.call(t.weights, t.opt_state, unique_slots.slice(0, 0, own), grad_rows.slice(0, 0, own), optimizer, hparams);
  update.call(t.extra_w, t.extra_s, unique_slots.slice(0, own, U) - C, grad_rows.slice(0, own, U), optimizer,
              hparams);
}

// Applies the gradients of checked tables that share device, dtype and D (the weights and
// opt_state of no two overlap): rows too wide for registers table by table (update_wide),
// the others in groups of one sort and one fused kernel. The tables of a group also share
// the choice of 16-byte packs, which fixes the lanes per row and so RowWiseAdagrad's order
// of adding g^2: every table gets the arithmetic of its single-table call.
// skip (checked, or undefined): the fused kernels read it on the device and write nothing
// when it is set; the unfused path of wide rows reads it on the host first (a sync, on a
// path that syncs anyway), so that either every table is updated or none is.
// hparams (checked, contiguous): read on the device by every kernel, fused or not.
void update_tables(const std::vector<TableArgs>& tables, int64_t mode, int64_t optimizer, const at::Tensor& hparams,
                   const at::Tensor& skip) {
  if (tables.empty()) return;
  const at::Tensor& w0 = tables[0].weights;
  const int64_t D = w0.size(1);
  const int64_t S = tables[0].opt_state.size(1);
  if (D == 0) return;
  const int64_t elems16 = 16 / w0.element_size();
  std::vector<const TableArgs*> fused[2];  // by vec
  std::vector<const TableArgs*> wide;
  for (const TableArgs& t : tables) {
    if (t.N == 0 || t.rows == 0) continue;  // nothing to update
    // 16-byte packs when D and every row pointer allow them (RowWiseAdagrad's one state
    // value per row is read alone).
    const bool vec = D % elems16 == 0 && aligned16(t.weights.data_ptr()) && aligned16(t.g.data_ptr()) &&
                     (S <= 1 || aligned16(t.opt_state.data_ptr())) &&
                     (t.E == 0 || (aligned16(t.extra_w.data_ptr()) && (S <= 1 || aligned16(t.extra_s.data_ptr()))));
    const int64_t V = vec ? elems16 : 1;
    if (ceil_div(D, lanes_for(D, static_cast<int>(V)) * V) > kMaxIter) {
      wide.push_back(&t);
    } else {
      fused[vec].push_back(&t);
    }
  }
  const bool* skip_flag = skip.defined() ? skip.data_ptr<bool>() : nullptr;
  if (!wide.empty() && skip_flag != nullptr) {
    if (skip.item<bool>()) return;
    skip_flag = nullptr;
  }
  for (const TableArgs* t : wide) update_wide(*t, mode, optimizer, hparams);
  const double* h = hparams.data_ptr<double>();
  constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
  for (int vec = 0; vec < 2; ++vec) {
    const std::vector<const TableArgs*>& list = fused[vec];
    for (size_t begin = 0; begin < list.size();) {
      // One launch's tables: at most kMaxGroup, at most 2^31 - 1 positions and bags (int32
      // indices), and fewer than 2^32 rows (a 32-bit sort key) unless one table has more.
      size_t end = begin;
      int64_t n = 0, b = 0, r = 0;
      for (; end < list.size() && end - begin < static_cast<size_t>(kMaxGroup); ++end) {
        const TableArgs& t = *list[end];
        if (end > begin && (n + t.N > kMaxInt32 || b + t.B > kMaxInt32 || r + t.rows >= (int64_t{1} << 32))) break;
        n += t.N;
        b += t.B;
        r += t.rows;
      }
      const int K = static_cast<int>(end - begin);
      with_sort_key(r, [&](auto key) {
        using key_t = decltype(key);
        if (K == 1) {
          accumulate_and_update_fused<key_t, 1>(list.data() + begin, 1, mode, vec, optimizer, h, skip_flag);
        } else {
          accumulate_and_update_fused<key_t, kMaxGroup>(list.data() + begin, K, mode, vec, optimizer, h, skip_flag);
        }
      });
      begin = end;
    }
  }
}

void accumulate_and_update_cuda(const at::Tensor& weights, const at::Tensor& opt_state,
                                const at::Tensor& grad_output, const at::Tensor& slots, const at::Tensor& offsets,
                                const std::optional<at::Tensor>& per_sample_weights, int64_t mode,
                                bool include_last_offset, int64_t optimizer, const at::Tensor& hparams,
                                bool check_inputs, const std::optional<at::Tensor>& skip,
                                const std::optional<at::Tensor>& extra_rows,
                                const std::optional<at::Tensor>& extra_state) {
  constexpr const char* op = "veloce::accumulate_and_update";
  check_update_args(op, weights, opt_state, optimizer, hparams);
  check_backward_inputs(op, grad_output, slots, offsets, per_sample_weights, mode);
  check_grad_output_for_weights(op, grad_output, weights);
  check_extra_update(op, weights, opt_state, extra_rows, extra_state);
  if (skip.has_value()) check_flag(op, "skip", *skip, "weights", weights);
  const c10::cuda::CUDAGuard guard(weights.device());
  const int64_t N = slots.numel();
  check_num_ids_cuda(op, N);
  const at::Tensor s = slots.contiguous();
  const at::Tensor o = offsets.contiguous();
  // One device check and one read-back for offsets and slots; none when the caller
  // vouches for them (check_inputs=False: DynamicEmbedding passes its table's slots).
  const int64_t B = check_inputs ? check_bags_and_slots_cuda(op, o, s, N, include_last_offset, -1, "")
                                 : check_offsets_shape(op, o, N, include_last_offset);
  check_grad_output_rows(op, grad_output, B);
  check_num_bags_cuda(op, B);
  const int64_t E = extra_rows.has_value() ? extra_rows->size(0) : 0;
  if (N == 0 || weights.size(1) == 0 || weights.size(0) + E == 0) return;
  const at::Tensor g = grad_output.contiguous();
  const at::Tensor p = per_sample_weights.has_value() ? per_sample_weights->contiguous() : at::Tensor();
  // The group of one table: the same kernels as accumulate_and_update_many.
  update_tables({TableArgs{weights, opt_state, g, s, o, p, weights.size(0) + E, N, B, extra_rows.value_or(at::Tensor()),
                           extra_state.value_or(at::Tensor()), E}},
                mode, optimizer, hparams.contiguous(), skip.value_or(at::Tensor()));
}

// check_bags_and_slots_cuda (no upper slot limit: accumulate_and_update skips slots past
// the rows) for the tables of accumulate_and_update_many: one flag for every table's bag
// layout (bag_layouts_bad), each table's least slot, one read-back for all of them. The
// messages name the table: when the flag is set, the layouts are checked again one by one
// (an error path) to find it.
void check_tables_cuda(const std::vector<std::string>& names, const std::vector<TableArgs>& tables,
                       bool include_last_offset) {
  std::vector<at::Tensor> parts, layouts;
  std::vector<int64_t> num_ids;
  std::vector<int64_t> slots_at(tables.size(), -1);  // index in parts
  for (const TableArgs& t : tables) {
    if (t.o.numel() == 0) continue;
    layouts.push_back(t.o);
    num_ids.push_back(t.N);
  }
  if (!layouts.empty()) parts.push_back(layouts_bad_flag(layouts, num_ids, include_last_offset).to(at::kLong));
  for (size_t k = 0; k < tables.size(); ++k) {
    const TableArgs& t = tables[k];
    if (t.N > 0) {
      slots_at[k] = static_cast<int64_t>(parts.size());
      parts.push_back(t.s.min().reshape({1}));
    }
  }
  if (parts.empty()) return;
  const at::Tensor host = at::cat(parts).cpu();
  const int64_t* h = host.data_ptr<int64_t>();
  const bool bad_layout = !layouts.empty() && h[0] != 0;
  for (size_t k = 0; k < tables.size(); ++k) {
    const TableArgs& t = tables[k];
    const char* name = names[k].c_str();
    if (bad_layout && t.o.numel() > 0) check_offsets(name, t.o, t.N, include_last_offset);  // raises if it is this one
    if (slots_at[k] >= 0 && h[slots_at[k]] < kZeroSlot) {
      const at::Tensor all = t.s.cpu();
      check_slot_values(name, all.data_ptr<int64_t>(), all.numel(), -1, "");  // raises
    }
  }
  // The device flag and the host rules are the same rules: one of the tables has raised.
  TORCH_INTERNAL_ASSERT(!bad_layout, "bag_layouts_bad flagged a bag layout that no table's check_offsets rejects");
}

void accumulate_and_update_many_cuda(at::TensorList weights, at::TensorList opt_state, at::TensorList grad_output,
                                     at::TensorList slots, at::TensorList offsets,
                                     const c10::List<std::optional<at::Tensor>>& per_sample_weights, int64_t mode,
                                     bool include_last_offset, int64_t optimizer, const at::Tensor& hparams,
                                     bool check_inputs, const std::optional<at::Tensor>& skip,
                                     const std::optional<at::TensorList>& extra_rows,
                                     const std::optional<at::TensorList>& extra_state) {
  constexpr const char* op = "veloce::accumulate_and_update_many";
  const ManyTables checked =
      check_update_many_args(op, weights, opt_state, grad_output, slots, offsets, per_sample_weights, mode,
                             include_last_offset, optimizer, hparams, extra_rows, extra_state);
  const size_t K = weights.size();
  if (K == 0) return;
  if (skip.has_value()) check_flag(op, "skip", *skip, "weights[0]", weights[0]);
  const c10::cuda::CUDAGuard guard(weights[0].device());
  std::vector<TableArgs> tables(K);
  for (size_t k = 0; k < K; ++k) {
    const char* name = checked.names[k].c_str();
    TableArgs& t = tables[k];
    t.N = slots[k].numel();
    t.B = checked.num_bags[k];
    check_num_ids_cuda(name, t.N);
    check_num_bags_cuda(name, t.B);
    t.s = slots[k].contiguous();
    t.o = offsets[k].contiguous();
  }
  // One device check and one read-back for every table's offsets and slots; none when
  // the caller vouches for them (DynamicEmbedding's step_tables).
  if (check_inputs) check_tables_cuda(checked.names, tables, include_last_offset);
  for (size_t k = 0; k < K; ++k) {
    TableArgs& t = tables[k];
    t.weights = weights[k];
    t.opt_state = opt_state[k];
    t.E = checked.num_extra[k];
    t.rows = weights[k].size(0) + t.E;
    if (t.E > 0) {
      t.extra_w = (*extra_rows)[k];
      t.extra_s = (*extra_state)[k];
    }
    t.g = grad_output[k].contiguous();
    const std::optional<at::Tensor> psw = per_sample_weights.get(k);
    t.p = psw.has_value() ? psw->contiguous() : at::Tensor();
  }
  update_tables(tables, mode, optimizer, hparams.contiguous(), skip.value_or(at::Tensor()));
}

}  // namespace
}  // namespace cuda
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CUDA, m) {
  m.impl("bag_layouts_bad", &veloce::cuda::bag_layouts_bad_cuda);
  m.impl("pooled_lookup", &veloce::cuda::pooled_lookup_cuda);
  m.impl("pooled_lookup_many", &veloce::cuda::pooled_lookup_many_cuda);
  m.impl("accumulate_grad", &veloce::cuda::accumulate_grad_cuda);
  m.impl("accumulate_and_update", &veloce::cuda::accumulate_and_update_cuda);
  m.impl("accumulate_and_update_many", &veloce::cuda::accumulate_and_update_many_cuda);
}
