// CUDA kernels of the hash_table family: ids -> slots over tensor table state.
// Semantics: docs/ops.md ("Table layout", "hash_table"); CPU reference csrc/cpu/hash_table.cpp.
//
// Lookups are one thread per id: both buckets' 32-byte digest sectors are loaded as
// 16-byte vectors, matched 4 digests per instruction (__vcmpeq4), and keys are read only
// on a digest match.
//
// Inserting ops (find_or_insert, insert_or_assign) run in phases:
//   1. find every id in parallel (no mutation); find_or_insert compacts the misses;
//   2. group ids with a CUB radix sort (id, position) -> runs, so each distinct new id is
//      inserted by exactly one thread; classify the new ids (conflicted or not, and for
//      the others whether they will need to evict or fail);
//   3a. claim: each new id CASes the 32-bit word holding 4 digests to take the lowest
//       empty slot of its emptier bucket (bucket_a on a tie), retrying on contention;
//       ids whose two buckets are full are queued;
//   3b. evict (allow_evict only, a separate launch after 3a): a queued id takes the
//       lowest-score slot of its 64 candidates not touched by this call (a bitmap of
//       found + claimed slots); ownership is an atomicOr on that bitmap;
//   4. if any id found no room: every claimed slot gets its saved key and digest back
//      (nothing else was written yet) and counts = [0, failed]; when the failure is
//      known from phase 2 already (no conflicted ids), nothing is claimed at all;
//   5. on success only: new rows are initialised, scores updated, slots mapped back.
//
// Host syncs (device-to-host reads; each costs tens of microseconds and drains the launch
// queue). Sizes the host cannot know are replaced by upper bounds, with the exact count
// read from device memory by the kernels; what remains:
//   a. find_or_insert only: the number m of missing positions, which sizes the grouping
//      sort (CUB's radix sort takes its length from the host). m = 0 ends the call.
//   b. one copy of the counters after phase 2: U (sizes the per-id launches after it),
//      the new ids (inserted; 0 ends the call), the conflicted ids (choose sequential or
//      racing placement, and size the sequential order) and the classification. Without
//      conflicted ids the outcome (inserted, failed, evicted) is fully known here.
//   c. only with conflicted ids: one more copy after phase 3, for failed (rollback or not)
//      and the number of evicted keys (sizes evicted_keys).
// counts is computed on the host and returned as a CPU tensor. Per call: find_or_insert
// 1 sync without new ids, 2 with new ids and no conflicted ones (evicting or not), 3 with
// conflicted ones; insert_or_assign 1, or 2 with conflicted ids; erase none.
//
// Same placement as the CPU kernel (which inserts in order of first occurrence): a new id
// that shares neither bucket with another new id of the call meets the same buckets in
// any order, so 3a/3b place it exactly as the CPU does. The new ids that do share a
// bucket ("conflicted") are inserted by one thread in order of first occurrence, when
// there are at most kSequentialMax of them (always the case in small batches and in
// large, sparsely filled tables); beyond that they race in 3a/3b too, and only their
// placement (not the found/missing sets, values or counts) may differ from the CPU's.

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <thrust/iterator/counting_iterator.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>

#include "hash_table_device.cuh"
#include "veloce/cuda_utils.cuh"
#include "veloce/op_checks.h"

namespace veloce {
namespace cuda {
namespace {

// find_or_insert success: initial rows, zero state, starting score of the new ids.
// Block (32, 8): one row per threadIdx.y, columns over threadIdx.x.
template <typename scalar_t>
__global__ void init_rows_kernel(Uniques u, scalar_t* __restrict__ weights, int64_t D,
                                 at::opmath_type<scalar_t>* __restrict__ state, int64_t S,
                                 int64_t* __restrict__ scores, int64_t start_score, int64_t seed, int64_t kind,
                                 double a, double b) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (!u.has(k)) return;
  const int8_t st = u.state[k];
  if (st != kClaimed && st != kEvicted) return;
  const int64_t s = u.slot[k];
  const int64_t id = u.id[k];
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    weights[s * D + c] = to_weight<scalar_t>(init_value(seed, id, c, kind, a, b));
  }
  for (int64_t c = threadIdx.x; c < S; c += blockDim.x) state[s * S + c] = 0;
  if (threadIdx.x == 0) scores[s] = start_score;
}

// insert_or_assign success: the last occurrence of each distinct id writes its row,
// state and score. begin (U + 1,) delimits each id's run of sorted positions.
template <typename scalar_t>
__global__ void assign_rows_kernel(Uniques u, const int32_t* __restrict__ sorted_pos,
                                   const int32_t* __restrict__ begin, scalar_t* __restrict__ weights,
                                   const scalar_t* __restrict__ values, int64_t D,
                                   at::opmath_type<scalar_t>* __restrict__ state,
                                   const at::opmath_type<scalar_t>* __restrict__ opt_values, int64_t S,
                                   int64_t* __restrict__ scores, const int64_t* __restrict__ score_values,
                                   int64_t policy, int64_t score_value) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (!u.has(k)) return;
  const int64_t s = u.slot[k];
  const int8_t st = u.state[k];
  const bool fresh = st == kClaimed || st == kEvicted;
  const int64_t last = sorted_pos[begin[k + 1] - 1];  // stable sort: the run ends at the last position
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) weights[s * D + c] = values[last * D + c];
  if (opt_values != nullptr) {
    for (int64_t c = threadIdx.x; c < S; c += blockDim.x) state[s * S + c] = opt_values[last * S + c];
  } else if (fresh) {
    for (int64_t c = threadIdx.x; c < S; c += blockDim.x) state[s * S + c] = 0;
  }
  if (threadIdx.x != 0) return;
  if (score_values != nullptr) {
    scores[s] = score_values[last];
    return;
  }
  int64_t sc = fresh ? (policy == kScoreLRU ? score_value : 0) : scores[s];
  if (policy == kScoreLRU) sc = score_value;
  if (policy == kScoreLFU) sc += begin[k + 1] - begin[k];
  scores[s] = sc;
}

// slots[position] = slot of its run, for every sorted entry.
__global__ void map_slots_kernel(const int32_t* __restrict__ sorted_pos, const int32_t* __restrict__ run,
                                 int64_t m, const int64_t* __restrict__ uniq_slot, int64_t* __restrict__ slots) {
  const int64_t j = thread_index();
  if (j < m) slots[sorted_pos[j]] = uniq_slot[run[j]];
}

// Per non-padding position: LRU sets score_value, LFU adds 1.
__global__ void score_positions_kernel(const int64_t* __restrict__ slots, int64_t n, int64_t* scores,
                                       int64_t policy, int64_t score_value) {
  const int64_t i = thread_index();
  if (i >= n) return;
  const int64_t s = slots[i];
  if (s < 0) return;
  if (policy == kScoreLRU) {
    scores[s] = score_value;
  } else {
    atomicAdd(reinterpret_cast<unsigned long long*>(scores + s), 1ull);
  }
}

__global__ void erase_kernel(Table t, Uniques u, const int32_t* __restrict__ sorted_pos,
                             const int32_t* __restrict__ begin, bool* __restrict__ erased) {
  const int64_t k = thread_index();
  if (!u.has(k)) return;
  const int64_t s = u.slot[k];
  if (s < 0) return;
  t.digests[s] = kEmptyDigest;
  erased[sorted_pos[begin[k]]] = true;  // stable sort: the run starts at the first position
}

template <typename scalar_t>
__global__ void initialize_kernel(const int64_t* __restrict__ ids, int64_t n, int64_t dim, int64_t seed,
                                  int64_t kind, double a, double b, scalar_t* __restrict__ out) {
  const int64_t e = thread_index();
  if (e >= n * dim) return;
  out[e] = to_weight<scalar_t>(init_value(seed, ids[e / dim], e % dim, kind, a, b));
}

// Grouping pass helpers: heads of runs of equal sorted ids, then run index per entry.
__global__ void run_heads_kernel(const int64_t* __restrict__ sorted, int64_t m, int32_t* __restrict__ heads) {
  const int64_t j = thread_index();
  if (j < m) heads[j] = (j == 0 || sorted[j] != sorted[j - 1]) ? 1 : 0;
}

__global__ void runs_kernel(const int64_t* __restrict__ sorted, const int32_t* __restrict__ sorted_pos, int64_t m,
                            int32_t* __restrict__ run, int64_t* __restrict__ uniq_id,
                            int32_t* __restrict__ first_pos, int32_t* __restrict__ begin, int32_t* num) {
  const int64_t j = thread_index();
  if (j >= m) return;
  const int32_t r = run[j] - 1;  // inclusive sum of heads -> 0-based run
  run[j] = r;
  if (j == 0 || sorted[j] != sorted[j - 1]) {
    uniq_id[r] = sorted[j];
    first_pos[r] = sorted_pos[j];  // stable sort: positions ascend within a run
    begin[r] = static_cast<int32_t>(j);
  }
  if (j == m - 1) {  // the last run: U = r + 1 runs
    begin[r + 1] = static_cast<int32_t>(m);
    *num = r + 1;
  }
}

// ---- host-side building blocks ---------------------------------------------------------

// ids grouped by value: positions sorted by (id, position), their run, and per run the id,
// its first position and its first sorted entry (begin[U] = m). The number of runs U is
// written to *num on the device, so the per-run arrays have the upper bound m entries,
// of which the first U are used (no sync here).
struct Runs {
  at::Tensor sorted_pos;  // (m,) int32
  at::Tensor run;         // (m,) int32
  at::Tensor uniq_id;     // (m,) int64
  at::Tensor first_pos;   // (m,) int32
  at::Tensor begin;       // (m + 1,) int32
};

Runs group_ids(const at::Tensor& ids, const at::Tensor& pos, int32_t* num) {  // (m,) int64, (m,) int32; m > 0
  const int64_t m = ids.numel();
  const int num_items = static_cast<int>(m);
  at::Tensor sorted_ids = at::empty_like(ids);
  Runs r;
  r.sorted_pos = at::empty_like(pos);
  cub_call(ids, [&](void* temp, size_t& bytes) {
    return cub::DeviceRadixSort::SortPairs(temp, bytes, ids.data_ptr<int64_t>(), sorted_ids.data_ptr<int64_t>(),
                                           pos.data_ptr<int32_t>(), r.sorted_pos.data_ptr<int32_t>(), num_items, 0,
                                           64, stream());
  });
  at::Tensor heads = at::empty({m}, pos.options());
  run_heads_kernel<<<grid_for(m), kThreads, 0, stream()>>>(sorted_ids.data_ptr<int64_t>(), m,
                                                           heads.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  r.run = at::empty({m}, pos.options());
  cub_call(ids, [&](void* temp, size_t& bytes) {
    return cub::DeviceScan::InclusiveSum(temp, bytes, heads.data_ptr<int32_t>(), r.run.data_ptr<int32_t>(),
                                         num_items, stream());
  });
  r.uniq_id = at::empty({m}, ids.options());
  r.first_pos = at::empty({m}, pos.options());
  r.begin = at::empty({m + 1}, pos.options());
  runs_kernel<<<grid_for(m), kThreads, 0, stream()>>>(
      sorted_ids.data_ptr<int64_t>(), r.sorted_pos.data_ptr<int32_t>(), m, r.run.data_ptr<int32_t>(),
      r.uniq_id.data_ptr<int64_t>(), r.first_pos.data_ptr<int32_t>(), r.begin.data_ptr<int32_t>(), num);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return r;
}

// Owns the per-distinct-id state of one call. ids is group_ids' uniq_id: m entries, the
// first U (*num, in device memory) used. n is m until the host reads U and sets n = U,
// so that later launches cover U ids only.
struct UniqueTensors {
  at::Tensor id, slot, state, old_key, old_digest;
  const int32_t* num;
  int64_t n;
  UniqueTensors(const at::Tensor& ids, const int32_t* num) : id(ids), num(num), n(ids.numel()) {
    slot = at::full({n}, -1, ids.options());
    state = at::zeros({n}, ids.options().dtype(at::kChar));
    old_key = at::empty({n}, ids.options());
    old_digest = at::empty({n}, ids.options().dtype(at::kByte));
  }
  Uniques view() const {
    return {id.data_ptr<int64_t>(),      slot.data_ptr<int64_t>(),       state.data_ptr<int8_t>(),
            old_key.data_ptr<int64_t>(), old_digest.data_ptr<uint8_t>(), num, n};
  }
};

// Device counters of one inserting call (int32: at most 2^31 - 1 ids per call), copied to
// the host together; indices into the counters tensor.
namespace counter {
enum : int {
  kUniques,     // U, written by group_ids
  kNew,         // distinct ids not in the table
  kConflicted,  // new ids sharing a bucket with another new id
  kFull,        // unconflicted new ids whose two buckets are full
  kDoomed,      // kFull ids with every eviction candidate touched (when evicting)
  kQueued,      // ids queued by claim_kernel
  kFailed,      // ids that found no room in evict_kernel or sequential_insert_kernel
  kEvicted,     // ids placed by evicting a key
  kNum
};
}  // namespace counter

at::Tensor new_counters(const at::Tensor& ids) { return at::zeros({counter::kNum}, ids.options().dtype(at::kInt)); }

// Predicates over the distinct ids for select_in_first_occurrence_order.
struct IsConflicted {
  const uint8_t* conflicted;
  __device__ bool operator()(int64_t k) const { return conflicted[k] != 0; }
};

struct IsEvicted {
  const int8_t* state;
  __device__ bool operator()(int64_t k) const { return state[k] == kEvicted; }
};

// The distinct ids k (ut.n = U) with pred(k), as (count,) int64 indices in order of first
// occurrence (the CPU kernel's insertion order). count, the number of such ids, is already
// on the host, so nothing waits for the device to size the result.
template <typename Pred>
at::Tensor select_in_first_occurrence_order(const UniqueTensors& ut, const at::Tensor& first_pos, int64_t count,
                                            Pred pred) {
  at::Tensor idx = at::empty({count}, ut.id.options());
  at::Tensor num_selected = at::empty({1}, ut.id.options().dtype(at::kInt));  // = count, unread
  cub_call(idx, [&](void* temp, size_t& bytes) {
    return cub::DeviceSelect::If(temp, bytes, thrust::counting_iterator<int64_t>(0), idx.data_ptr<int64_t>(),
                                 num_selected.data_ptr<int32_t>(), static_cast<int>(ut.n), pred, stream());
  });
  return idx.index_select(0, first_pos.index_select(0, idx).argsort());
}

struct InsertOutcome {
  int64_t inserted = 0;
  int64_t failed = 0;
  at::Tensor evicted;  // (E,) int64
};

// Phases 2 (classification), 3a, 3b and 4 over the distinct ids whose slot is still -1,
// U of them counted in counter::kUniques by group_ids; sets ut.n = U. Syncs b and c of
// the list at the top of this file.
InsertOutcome insert_uniques(const Table& t, UniqueTensors& ut, const Runs& runs, const at::Tensor& counters,
                             uint32_t* touched, bool allow_evict) {
  InsertOutcome out;
  int32_t* ctr = counters.data_ptr<int32_t>();
  const auto int_opts = ut.id.options().dtype(at::kInt);
  Uniques u = ut.view();  // n: the upper bound
  at::Tensor use = at::zeros({t.num_buckets}, int_opts);
  at::Tensor conflicted = at::empty({u.n}, ut.id.options().dtype(at::kByte));
  bucket_use_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, use.data_ptr<int32_t>(),
                                                              ctr + counter::kNew);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  classify_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(
      t, u, use.data_ptr<int32_t>(), touched, conflicted.data_ptr<uint8_t>(), ctr + counter::kConflicted,
      ctr + counter::kFull, ctr + counter::kDoomed);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor counted = counters.cpu();  // sync b
  const int32_t* c = counted.data_ptr<int32_t>();
  ut.n = c[counter::kUniques];
  u = ut.view();
  out.inserted = c[counter::kNew];
  if (out.inserted == 0) return out;
  const int64_t n_conflicted = c[counter::kConflicted], n_full = c[counter::kFull];
  if (n_conflicted == 0) {  // each new id alone in its buckets: classify_kernel decided its fate
    out.failed = allow_evict ? c[counter::kDoomed] : n_full;
    if (out.failed > 0) {  // nothing written yet: no rollback
      out.inserted = 0;
      return out;
    }
  }
  // Deterministic mode (torch.use_deterministic_algorithms) always places conflicting ids
  // in order, whatever their number, so placement (and hence eviction) repeats exactly.
  const bool sequential = n_conflicted > 0 && (n_conflicted <= kSequentialMax ||
                                               at::globalContext().deterministicAlgorithms());

  at::Tensor overflow = at::empty({u.n}, int_opts);
  claim_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, sequential ? conflicted.data_ptr<uint8_t>() : nullptr,
                                                         touched, overflow.data_ptr<int32_t>(),
                                                         ctr + counter::kQueued);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // claim_kernel queues exactly the full unconflicted ids, plus conflicted ones that race
  // and find both buckets full: at most max_queued, the exact number is on the device.
  const int64_t max_queued = n_full + (sequential ? 0 : n_conflicted);
  if (allow_evict && max_queued > 0) {
    evict_kernel<<<grid_for(max_queued), kThreads, 0, stream()>>>(
        t, u, touched, overflow.data_ptr<int32_t>(), ctr + counter::kQueued, ctr + counter::kFailed,
        ctr + counter::kEvicted);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (sequential) {
    const at::Tensor order = select_in_first_occurrence_order(ut, runs.first_pos, n_conflicted,
                                                              IsConflicted{conflicted.data_ptr<uint8_t>()});
    sequential_insert_kernel<<<1, 1, 0, stream()>>>(t, u, order.data_ptr<int64_t>(), n_conflicted, allow_evict,
                                                   touched, ctr + counter::kFailed,
                                                   ctr + counter::kEvicted);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  int64_t n_evicted = 0;
  if (n_conflicted == 0) {
    n_evicted = allow_evict ? n_full : 0;  // none doomed (else failed above): every full id evicted
  } else {  // how the conflicted ids fared is known on the device only
    const at::Tensor placed = counters.cpu();  // sync c
    const int32_t* p = placed.data_ptr<int32_t>();
    // Without eviction every queued id failed; sequential failures are in kFailed either way.
    out.failed = p[counter::kFailed] + (allow_evict ? 0 : p[counter::kQueued]);
    if (out.failed > 0) {
      rollback_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      out.inserted = 0;
      return out;
    }
    n_evicted = p[counter::kEvicted];
  }
  if (n_evicted > 0) {  // in insertion order, as the CPU kernel reports them
    out.evicted = ut.old_key.index_select(
        0, select_in_first_occurrence_order(ut, runs.first_pos, n_evicted, IsEvicted{u.state}));
  }
  return out;
}

// counts is built on the host from host values and stays there (a CPU tensor), so reading
// it costs no sync.
std::tuple<at::Tensor, at::Tensor, at::Tensor> result(at::Tensor slots, const InsertOutcome& r,
                                                      const at::Tensor& keys) {
  at::Tensor counts = at::tensor(std::vector<int64_t>{r.inserted, r.failed}, at::kLong);
  return {slots, counts, r.evicted.defined() ? r.evicted : at::empty({0}, keys.options())};
}

// The shared checks of the inserting ops plus the CUDA-only ones; returns the contiguous ids.
at::Tensor check_insert_args_cuda(const char* op, const at::Tensor& keys, const at::Tensor& digests,
                                  const at::Tensor& scores, const at::Tensor& weights, const at::Tensor& opt_state,
                                  const at::Tensor& ids, int64_t score_policy) {
  check_insert_args(op, keys, digests, scores, weights, opt_state, ids, score_policy);
  check_cuda_table(op, keys, digests);
  check_num_ids_cuda(op, ids.numel());
  return ids.contiguous();
}

at::Tensor touched_bitmap(bool allow_evict, const at::Tensor& keys) {  // one word per bucket
  return allow_evict ? at::zeros({keys.numel() / kBucketSize}, keys.options().dtype(at::kInt)) : at::Tensor();
}

uint32_t* words(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>()) : nullptr;
}

constexpr dim3 kRowBlock(32, 8);

// ---- ops -------------------------------------------------------------------------------

at::Tensor find_cuda(const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& ids_in) {
  constexpr const char* op = "veloce::find";
  check_find_args(op, keys, digests, ids_in);
  check_cuda_table(op, keys, digests);
  const c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  at::Tensor slots = at::empty_like(ids);
  if (n == 0) return slots;
  find_kernel<<<grid_for(n), kThreads, 0, stream()>>>(table_of(keys, digests, nullptr), ids.data_ptr<int64_t>(), n,
                                                      slots.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return slots;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> find_or_insert_cuda(
    at::Tensor& keys, at::Tensor& digests, at::Tensor& scores, at::Tensor& weights, at::Tensor& opt_state,
    const at::Tensor& ids_in, int64_t score_policy, int64_t score_value, bool allow_evict, int64_t seed,
    int64_t init_kind, double init_a, double init_b, std::optional<int64_t> padding_id) {
  constexpr const char* op = "veloce::find_or_insert";
  const at::Tensor ids = check_insert_args_cuda(op, keys, digests, scores, weights, opt_state, ids_in, score_policy);
  check_init(op, init_kind, init_a, init_b);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t n = ids.numel();
  at::Tensor slots = at::empty_like(ids);
  InsertOutcome r;
  if (n == 0) return result(slots, r, keys);
  const Table t = table_of(keys, digests, scores.data_ptr<int64_t>());
  const at::Tensor touched = touched_bitmap(allow_evict, keys);

  // Phase 1: find all, then compact the missing positions in order (CUB select is stable).
  at::Tensor missing = at::empty({n}, ids.options().dtype(at::kByte));
  probe_kernel<<<grid_for(n), kThreads, 0, stream()>>>(t, ids.data_ptr<int64_t>(), n, padding_id.has_value(),
                                                       padding_id.value_or(0), slots.data_ptr<int64_t>(),
                                                       words(touched), missing.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor miss_pos = at::empty({n}, ids.options().dtype(at::kInt));
  at::Tensor miss_count = at::empty({1}, ids.options().dtype(at::kInt));
  cub_call(ids, [&](void* temp, size_t& bytes) {
    return cub::DeviceSelect::Flagged(temp, bytes, thrust::counting_iterator<int32_t>(0), missing.data_ptr<uint8_t>(),
                                      miss_pos.data_ptr<int32_t>(), miss_count.data_ptr<int32_t>(),
                                      static_cast<int>(n), stream());
  });
  const int64_t m = miss_count.item<int32_t>();  // sync a: sizes the grouping sort

  if (m > 0) {
    // Phases 2-4: one thread per distinct new id.
    const at::Tensor pos = miss_pos.narrow(0, 0, m);
    const at::Tensor counters = new_counters(ids);
    int32_t* const num = counters.data_ptr<int32_t>() + counter::kUniques;
    const Runs runs = group_ids(ids.index_select(0, pos), pos, num);
    UniqueTensors ut(runs.uniq_id, num);
    r = insert_uniques(t, ut, runs, counters, words(touched), allow_evict);
    if (r.failed > 0) {
      slots.fill_(kPaddingSlot);
      return result(slots, r, keys);
    }
    // Phase 5: new rows, then every missing position's slot.
    const Uniques u = ut.view();
    const int64_t D = weights.size(1), S = opt_state.size(1);
    const int64_t start = score_policy == kScoreLRU ? score_value : 0;
    const unsigned grid = static_cast<unsigned>(ceil_div(u.n, kRowBlock.y));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "find_or_insert_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      init_rows_kernel<scalar_t><<<grid, kRowBlock, 0, stream()>>>(
          u, weights.data_ptr<scalar_t>(), D, opt_state.data_ptr<acc_t>(), S, t.scores, start, seed, init_kind,
          init_a, init_b);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    map_slots_kernel<<<grid_for(m), kThreads, 0, stream()>>>(
        runs.sorted_pos.data_ptr<int32_t>(), runs.run.data_ptr<int32_t>(), m, u.slot, slots.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (score_policy != kScoreNone) {
    score_positions_kernel<<<grid_for(n), kThreads, 0, stream()>>>(slots.data_ptr<int64_t>(), n, t.scores,
                                                                   score_policy, score_value);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return result(slots, r, keys);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> insert_or_assign_cuda(
    at::Tensor& keys, at::Tensor& digests, at::Tensor& scores, at::Tensor& weights, at::Tensor& opt_state,
    const at::Tensor& ids_in, const at::Tensor& values_in, const std::optional<at::Tensor>& opt_values_in,
    const std::optional<at::Tensor>& score_values_in, int64_t score_policy, int64_t score_value, bool allow_evict) {
  constexpr const char* op = "veloce::insert_or_assign";
  const at::Tensor ids = check_insert_args_cuda(op, keys, digests, scores, weights, opt_state, ids_in, score_policy);
  const int64_t n = ids.numel();
  check_assign_values(op, keys, weights, opt_state, n, values_in, opt_values_in, score_values_in);
  const at::Tensor values = values_in.contiguous();
  const at::Tensor opt_values = opt_values_in ? opt_values_in->contiguous() : at::Tensor();
  const at::Tensor score_values = score_values_in ? score_values_in->contiguous() : at::Tensor();
  const c10::cuda::CUDAGuard guard(keys.device());
  at::Tensor slots = at::empty_like(ids);
  InsertOutcome r;
  if (n == 0) return result(slots, r, keys);
  const Table t = table_of(keys, digests, scores.data_ptr<int64_t>());
  const at::Tensor touched = touched_bitmap(allow_evict, keys);

  const at::Tensor counters = new_counters(ids);
  int32_t* const num = counters.data_ptr<int32_t>() + counter::kUniques;
  const Runs runs = group_ids(ids, at::arange(n, ids.options().dtype(at::kInt)), num);
  UniqueTensors ut(runs.uniq_id, num);
  find_uniques_kernel<<<grid_for(ut.n), kThreads, 0, stream()>>>(t, ut.view(), words(touched));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  r = insert_uniques(t, ut, runs, counters, words(touched), allow_evict);
  if (r.failed > 0) {
    slots.fill_(kPaddingSlot);
    return result(slots, r, keys);
  }
  const Uniques u = ut.view();
  const int64_t D = weights.size(1), S = opt_state.size(1);
  const unsigned grid = static_cast<unsigned>(ceil_div(u.n, kRowBlock.y));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "insert_or_assign_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    assign_rows_kernel<scalar_t><<<grid, kRowBlock, 0, stream()>>>(
        u, runs.sorted_pos.data_ptr<int32_t>(), runs.begin.data_ptr<int32_t>(), weights.data_ptr<scalar_t>(),
        values.data_ptr<scalar_t>(), D, opt_state.data_ptr<acc_t>(),
        opt_values.defined() ? opt_values.data_ptr<acc_t>() : nullptr, S, t.scores,
        score_values.defined() ? score_values.data_ptr<int64_t>() : nullptr, score_policy, score_value);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  map_slots_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
      runs.sorted_pos.data_ptr<int32_t>(), runs.run.data_ptr<int32_t>(), n, u.slot, slots.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return result(slots, r, keys);
}

at::Tensor erase_cuda(const at::Tensor& keys, at::Tensor& digests, const at::Tensor& ids_in) {
  constexpr const char* op = "veloce::erase";
  check_find_args(op, keys, digests, ids_in);
  check_cuda_table(op, keys, digests);
  check_num_ids_cuda(op, ids_in.numel());
  const c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  at::Tensor erased = at::zeros({n}, ids.options().dtype(at::kBool));
  if (n == 0) return erased;
  const Table t = table_of(keys, digests, nullptr);
  // U stays on the device: every launch covers the n grouped positions.
  const at::Tensor num = at::empty({1}, ids.options().dtype(at::kInt));
  const Runs runs = group_ids(ids, at::arange(n, ids.options().dtype(at::kInt)), num.data_ptr<int32_t>());
  const UniqueTensors ut(runs.uniq_id, num.data_ptr<int32_t>());
  const Uniques u = ut.view();
  // Find first (read-only), then clear: a launch boundary between reads and writes.
  find_uniques_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  erase_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, runs.sorted_pos.data_ptr<int32_t>(),
                                                         runs.begin.data_ptr<int32_t>(), erased.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return erased;
}

at::Tensor initialize_cuda(const at::Tensor& ids_in, int64_t dim, int64_t seed, int64_t init_kind, double init_a,
                           double init_b, at::ScalarType dtype) {
  constexpr const char* op = "veloce::initialize";
  check_initialize_args(op, ids_in, dim, dtype, init_kind, init_a, init_b);
  const c10::cuda::CUDAGuard guard(ids_in.device());
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  at::Tensor out = at::empty({n, dim}, ids.options().dtype(dtype));
  if (n * dim == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "initialize_cuda", [&] {
    initialize_kernel<scalar_t><<<grid_for(n * dim), kThreads, 0, stream()>>>(
        ids.data_ptr<int64_t>(), n, dim, seed, init_kind, init_a, init_b, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CUDA, m) {
  m.impl("find", &veloce::cuda::find_cuda);
  m.impl("find_or_insert", &veloce::cuda::find_or_insert_cuda);
  m.impl("insert_or_assign", &veloce::cuda::insert_or_assign_cuda);
  m.impl("erase", &veloce::cuda::erase_cuda);
  m.impl("initialize", &veloce::cuda::initialize_cuda);
}
