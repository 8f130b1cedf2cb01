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
//      The caller's bad_input flag rides in the same copy: a set flag ends the call with
//      an error before phase 2 (the probe changed nothing), so a caller that checks its
//      input on the device (DynamicEmbedding's bag layouts) pays no sync of its own. When
//      no table has ids (no sync a), the flag is read alone.
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

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>

#include "hash_table_device.cuh"
#include "veloce/cuda_utils.cuh"
#include "veloce/many.h"
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
    // A hot id repeats thousands of times in a batch: its later positions find the score
    // set (in L1 or L2) and skip the store instead of queueing on one address.
    if (scores[s] != score_value) scores[s] = score_value;
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
// U of them counted in counter::kUniques by group_ids, in three stages split at syncs b
// and c of the list at the top of this file, so that an op over several tables reads
// every table's counters in one copy: classify (launches only), then place (the host
// reads counters, launches the placement), then, only when place returns true (conflicted
// ids: their fate is known on the device only), settle after another read of counters.
// The distinct ids and their runs are owned by the caller and passed to each stage.
class Placement {
 public:
  Placement(const Table& t, const at::Tensor& counters, uint32_t* touched, bool allow_evict)
      : t_(t), counters_(counters), touched_(touched), allow_evict_(allow_evict) {}

  InsertOutcome out;

  void classify(const UniqueTensors& ut) {  // phase 2
    int32_t* ctr = counters_.data_ptr<int32_t>();
    const Uniques u = ut.view();  // n: the upper bound
    const at::Tensor use = at::zeros({t_.num_buckets}, ut.id.options().dtype(at::kInt));
    conflicted_ = at::empty({u.n}, ut.id.options().dtype(at::kByte));
    // Allocated here, before any table of a many-op call is written: an allocation failure
    // in a later stage would leave an earlier table's claimed slots without their rows.
    overflow_ = at::empty({u.n}, ut.id.options().dtype(at::kInt));
    bucket_use_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t_, u, use.data_ptr<int32_t>(), ctr + counter::kNew);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    classify_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(
        t_, u, use.data_ptr<int32_t>(), touched_, conflicted_.data_ptr<uint8_t>(), ctr + counter::kConflicted,
        ctr + counter::kFull, ctr + counter::kDoomed);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // Phases 3a and 3b from the counters read after classify (sync b); sets ut.n = U.
  // Returns whether settle() must follow, after another read of the counters (sync c).
  bool place(const int32_t* c, UniqueTensors& ut, const Runs& runs) {
    ut.n = c[counter::kUniques];
    const Uniques u = ut.view();
    out.inserted = c[counter::kNew];
    if (out.inserted == 0) return false;
    n_conflicted_ = c[counter::kConflicted];
    const int64_t n_full = c[counter::kFull];
    if (n_conflicted_ == 0) {  // each new id alone in its buckets: classify_kernel decided its fate
      out.failed = allow_evict_ ? c[counter::kDoomed] : n_full;
      if (out.failed > 0) {  // nothing written yet: no rollback
        out.inserted = 0;
        return false;
      }
    }
    // Deterministic mode (torch.use_deterministic_algorithms) always places conflicting ids
    // in order, whatever their number, so placement (and hence eviction) repeats exactly.
    const bool sequential = n_conflicted_ > 0 && (n_conflicted_ <= kSequentialMax ||
                                                  at::globalContext().deterministicAlgorithms());
    int32_t* ctr = counters_.data_ptr<int32_t>();
    claim_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t_, u,
                                                           sequential ? conflicted_.data_ptr<uint8_t>() : nullptr,
                                                           touched_, overflow_.data_ptr<int32_t>(),
                                                           ctr + counter::kQueued);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // claim_kernel queues exactly the full unconflicted ids, plus conflicted ones that race
    // and find both buckets full: at most max_queued, the exact number is on the device.
    const int64_t max_queued = n_full + (sequential ? 0 : n_conflicted_);
    if (allow_evict_ && max_queued > 0) {
      evict_kernel<<<grid_for(max_queued), kThreads, 0, stream()>>>(
          t_, u, touched_, overflow_.data_ptr<int32_t>(), ctr + counter::kQueued, ctr + counter::kFailed,
          ctr + counter::kEvicted);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (sequential) {
      const at::Tensor order = select_in_first_occurrence_order(ut, runs.first_pos, n_conflicted_,
                                                                IsConflicted{conflicted_.data_ptr<uint8_t>()});
      sequential_insert_kernel<<<1, 1, 0, stream()>>>(t_, u, order.data_ptr<int64_t>(), n_conflicted_,
                                                     allow_evict_, touched_, ctr + counter::kFailed,
                                                     ctr + counter::kEvicted);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (n_conflicted_ > 0) return true;  // how the conflicted ids fared is known on the device only
    note_evicted(allow_evict_ ? n_full : 0, ut, runs);  // none doomed (else failed above): every full id evicted
    return false;
  }

  // Phase 4 (rollback on failure) from the counters read after place (sync c).
  void settle(const int32_t* p, const UniqueTensors& ut, const Runs& runs) {
    // Without eviction every queued id failed; sequential failures are in kFailed either way.
    out.failed = p[counter::kFailed] + (allow_evict_ ? 0 : p[counter::kQueued]);
    if (out.failed > 0) {
      rollback_kernel<<<grid_for(ut.n), kThreads, 0, stream()>>>(t_, ut.view());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      out.inserted = 0;
      return;
    }
    note_evicted(p[counter::kEvicted], ut, runs);
  }

 private:
  void note_evicted(int64_t n_evicted, const UniqueTensors& ut, const Runs& runs) {
    if (n_evicted == 0) return;  // in insertion order, as the CPU kernel reports them
    out.evicted = ut.old_key.index_select(
        0, select_in_first_occurrence_order(ut, runs.first_pos, n_evicted, IsEvicted{ut.view().state}));
  }

  Table t_;
  at::Tensor counters_;
  uint32_t* touched_;
  bool allow_evict_;
  at::Tensor conflicted_, overflow_;
  int64_t n_conflicted_ = 0;
};

// The three stages in a row, for an op over one table (insert_or_assign).
InsertOutcome insert_uniques(const Table& t, UniqueTensors& ut, const Runs& runs, const at::Tensor& counters,
                             uint32_t* touched, bool allow_evict) {
  Placement p(t, counters, touched, allow_evict);
  p.classify(ut);
  const at::Tensor counted = counters.cpu();  // sync b
  if (p.place(counted.data_ptr<int32_t>(), ut, runs)) {
    const at::Tensor placed = counters.cpu();  // sync c
    p.settle(placed.data_ptr<int32_t>(), ut, runs);
  }
  return p.out;
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

// One table's find_or_insert as stages, so that an op over K tables runs each stage for
// every table before the next and pays syncs a, b and c once for all of them:
//   probe()  phase 1 (launches); miss_count() is then the device count of missing positions
//   group(m) with m read back (sync a): phases 2 up to classification (launches)
//   place(counters read back, sync b) -> whether settle() must follow (sync c)
//   finish() phase 5 and the op's result.
struct FindOrInsertArgs {
  at::Tensor keys, digests, scores, weights, opt_state, ids;
  int64_t score_policy, score_value;
  bool allow_evict;
  int64_t seed, init_kind;
  double init_a, init_b;
  std::optional<int64_t> padding_id;
  at::Tensor slots;  // (N,) int64 to write the slots to (a view into the op's output), or undefined
};

class FindOrInsert {
 public:
  // table: the table's index in an op over several tables (named in error messages), or -1.
  explicit FindOrInsert(FindOrInsertArgs a, int64_t table = -1) : a_(std::move(a)) {
    const std::string name =
        table < 0 ? "veloce::find_or_insert" : table_op_name("veloce::find_or_insert_many", table);
    const char* op = name.c_str();
    a_.ids = check_insert_args_cuda(op, a_.keys, a_.digests, a_.scores, a_.weights, a_.opt_state, a_.ids,
                                    a_.score_policy);
    check_init(op, a_.init_kind, a_.init_a, a_.init_b);
    n_ = a_.ids.numel();
  }

  bool empty() const { return n_ == 0; }
  const at::Tensor& miss_count() const { return miss_count_; }
  const at::Tensor& counters() const { return counters_; }

  void probe() {  // phase 1: find all, then compact the missing positions in order (CUB select is stable)
    slots_ = a_.slots.defined() ? a_.slots : at::empty_like(a_.ids);
    if (n_ == 0) return;
    t_ = table_of(a_.keys, a_.digests, a_.scores.data_ptr<int64_t>());
    touched_ = touched_bitmap(a_.allow_evict, a_.keys);
    const at::Tensor missing = at::empty({n_}, a_.ids.options().dtype(at::kByte));
    probe_kernel<<<grid_for(n_), kThreads, 0, stream()>>>(t_, a_.ids.data_ptr<int64_t>(), n_,
                                                          a_.padding_id.has_value(), a_.padding_id.value_or(0),
                                                          slots_.data_ptr<int64_t>(), words(touched_),
                                                          missing.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    miss_pos_ = at::empty({n_}, a_.ids.options().dtype(at::kInt));
    miss_count_ = at::empty({1}, a_.ids.options().dtype(at::kInt));
    cub_call(a_.ids, [&](void* temp, size_t& bytes) {
      return cub::DeviceSelect::Flagged(temp, bytes, thrust::counting_iterator<int32_t>(0),
                                        missing.data_ptr<uint8_t>(), miss_pos_.data_ptr<int32_t>(),
                                        miss_count_.data_ptr<int32_t>(), static_cast<int>(n_), stream());
    });
  }

  // Phases 2-4 run over the m missing positions, one thread per distinct new id.
  void group(int64_t m) {
    m_ = m;
    if (m_ == 0) return;
    const at::Tensor pos = miss_pos_.narrow(0, 0, m_);
    counters_ = new_counters(a_.ids);
    int32_t* const num = counters_.data_ptr<int32_t>() + counter::kUniques;
    runs_.emplace(group_ids(a_.ids.index_select(0, pos), pos, num));
    ut_.emplace(runs_->uniq_id, num);
    placement_.emplace(t_, counters_, words(touched_), a_.allow_evict);
    placement_->classify(*ut_);
  }

  bool place(const int32_t* counted) { return placement_->place(counted, *ut_, *runs_); }
  void settle(const int32_t* placed) { placement_->settle(placed, *ut_, *runs_); }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> finish() {
    const InsertOutcome r = placement_ ? placement_->out : InsertOutcome{};
    if (n_ == 0) return result(slots_, r, a_.keys);
    if (r.failed > 0) {
      slots_.fill_(kPaddingSlot);
      return result(slots_, r, a_.keys);
    }
    if (m_ > 0) {  // phase 5: new rows, then every missing position's slot
      const Uniques u = ut_->view();
      const int64_t D = a_.weights.size(1), S = a_.opt_state.size(1);
      const int64_t start = a_.score_policy == kScoreLRU ? a_.score_value : 0;
      const unsigned grid = static_cast<unsigned>(ceil_div(u.n, kRowBlock.y));
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a_.weights.scalar_type(), "find_or_insert_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        init_rows_kernel<scalar_t><<<grid, kRowBlock, 0, stream()>>>(
            u, a_.weights.data_ptr<scalar_t>(), D, a_.opt_state.data_ptr<acc_t>(), S, t_.scores, start, a_.seed,
            a_.init_kind, a_.init_a, a_.init_b);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      map_slots_kernel<<<grid_for(m_), kThreads, 0, stream()>>>(runs_->sorted_pos.data_ptr<int32_t>(),
                                                                 runs_->run.data_ptr<int32_t>(), m_, u.slot,
                                                                 slots_.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (a_.score_policy != kScoreNone) {
      score_positions_kernel<<<grid_for(n_), kThreads, 0, stream()>>>(slots_.data_ptr<int64_t>(), n_, t_.scores,
                                                                      a_.score_policy, a_.score_value);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return result(slots_, r, a_.keys);
  }

 private:
  FindOrInsertArgs a_;
  int64_t n_ = 0, m_ = 0;
  Table t_{};
  at::Tensor touched_, slots_, miss_pos_, miss_count_, counters_;
  std::optional<Runs> runs_;
  std::optional<UniqueTensors> ut_;
  std::optional<Placement> placement_;
};

// The int32 device tensors `parts`, concatenated and read back in one copy (one sync).
at::Tensor read_back(const std::vector<at::Tensor>& parts) {
  return parts.size() == 1 ? parts[0].cpu() : at::cat(parts).cpu();
}

// Runs the stages of every call, each stage for all tables before the next: syncs a, b
// and c happen once per op however many tables it inserts into (b and c only when some
// table has new ids, c only when some has conflicted ones). bad_input (checked by the op)
// is read with sync a, or alone when no table has ids; when set, `op` raises before any
// table changes.
std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>> run_find_or_insert(
    const char* op, std::vector<FindOrInsert>& calls, const std::optional<at::Tensor>& bad_input) {
  std::vector<FindOrInsert*> live;
  for (auto& c : calls) {
    c.probe();
    if (!c.empty()) live.push_back(&c);
  }
  // `extra` (int32 (1,)) is appended after the calls' parts, in the same copy.
  auto read = [&](const std::vector<FindOrInsert*>& cs, auto what, const at::Tensor& extra = at::Tensor()) {
    std::vector<at::Tensor> parts;
    for (FindOrInsert* c : cs) parts.push_back((c->*what)());
    if (extra.defined()) parts.push_back(extra);
    return read_back(parts);
  };
  if (live.empty() && bad_input) {
    check_bad_input_unset(op, bad_input->item<bool>());  // no sync a to ride on: read alone
  } else if (!live.empty()) {
    const at::Tensor flag = bad_input ? bad_input->reshape({1}).to(at::kInt) : at::Tensor();
    const at::Tensor m = read(live, &FindOrInsert::miss_count, flag);  // sync a: sizes the grouping sorts
    if (bad_input) check_bad_input_unset(op, m.data_ptr<int32_t>()[live.size()] != 0);  // before any change
    std::vector<FindOrInsert*> missing;
    for (size_t k = 0; k < live.size(); ++k) {
      live[k]->group(m.data_ptr<int32_t>()[k]);
      if (m.data_ptr<int32_t>()[k] > 0) missing.push_back(live[k]);
    }
    if (!missing.empty()) {
      const at::Tensor counted = read(missing, &FindOrInsert::counters);  // sync b
      std::vector<FindOrInsert*> unsettled;
      for (size_t k = 0; k < missing.size(); ++k) {
        if (missing[k]->place(counted.data_ptr<int32_t>() + k * counter::kNum)) unsettled.push_back(missing[k]);
      }
      if (!unsettled.empty()) {
        const at::Tensor placed = read(unsettled, &FindOrInsert::counters);  // sync c
        for (size_t k = 0; k < unsettled.size(); ++k) unsettled[k]->settle(placed.data_ptr<int32_t>() + k * counter::kNum);
      }
    }
  }
  std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>> out;
  out.reserve(calls.size());
  for (auto& c : calls) out.push_back(c.finish());
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> find_or_insert_cuda(
    at::Tensor& keys, at::Tensor& digests, at::Tensor& scores, at::Tensor& weights, at::Tensor& opt_state,
    const at::Tensor& ids, int64_t score_policy, int64_t score_value, bool allow_evict, int64_t seed,
    int64_t init_kind, double init_a, double init_b, std::optional<int64_t> padding_id,
    const std::optional<at::Tensor>& bad_input) {
  constexpr const char* op = "veloce::find_or_insert";
  // First: a CUDA flag beside a CPU table lands here, and its error should name bad_input.
  check_bad_input(op, bad_input, keys);
  std::vector<FindOrInsert> calls;
  calls.emplace_back(FindOrInsertArgs{keys, digests, scores, weights, opt_state, ids, score_policy, score_value,
                                      allow_evict, seed, init_kind, init_a, init_b, padding_id});
  const c10::cuda::CUDAGuard guard(keys.device());
  return run_find_or_insert(op, calls, bad_input)[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> find_or_insert_many_cuda(
    at::TensorList keys, at::TensorList digests, at::TensorList scores, at::TensorList weights,
    at::TensorList opt_state, at::TensorList ids, at::IntArrayRef score_policy, at::IntArrayRef score_value,
    const c10::List<bool>& allow_evict, at::IntArrayRef seed, at::IntArrayRef init_kind, at::ArrayRef<double> init_a,
    at::ArrayRef<double> init_b, const c10::List<std::optional<int64_t>>& padding_id,
    const std::optional<at::Tensor>& bad_input) {
  constexpr const char* op = "veloce::find_or_insert_many";
  const int64_t K = check_find_or_insert_many_args(op, keys, digests, scores, weights, opt_state, ids, score_policy,
                                                   score_value, allow_evict, seed, init_kind, init_a, init_b,
                                                   padding_id, bad_input);
  int64_t total = 0;
  for (const at::Tensor& i : ids) total += i.numel();
  at::Tensor slots = at::empty({total}, keys[0].options());
  std::vector<FindOrInsert> calls;
  calls.reserve(K);
  for (int64_t k = 0, start = 0; k < K; start += ids[k].numel(), ++k) {  // all checked before anything runs
    calls.emplace_back(FindOrInsertArgs{keys[k], digests[k], scores[k], weights[k], opt_state[k], ids[k],
                                        score_policy[k], score_value[k], allow_evict.get(k), seed[k], init_kind[k],
                                        init_a[k], init_b[k], padding_id.get(k),
                                        slots.narrow(0, start, ids[k].numel())},
                       k);
  }
  const c10::cuda::CUDAGuard guard(keys[0].device());
  return many_result(slots, run_find_or_insert(op, calls, bad_input));
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
  m.impl("find_or_insert_many", &veloce::cuda::find_or_insert_many_cuda);
  m.impl("insert_or_assign", &veloce::cuda::insert_or_assign_cuda);
  m.impl("erase", &veloce::cuda::erase_cuda);
  m.impl("initialize", &veloce::cuda::initialize_cuda);
}
