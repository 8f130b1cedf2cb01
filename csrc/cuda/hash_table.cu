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
//      inserted by exactly one thread;
//   3a. claim: each new id CASes the 32-bit word holding 4 digests to take the lowest
//       empty slot of its emptier bucket (bucket_a on a tie), retrying on contention;
//       ids whose two buckets are full are queued;
//   3b. evict (allow_evict only, a separate launch after 3a): a queued id takes the
//       lowest-score slot of its 64 candidates not touched by this call (a bitmap of
//       found + claimed slots); ownership is an atomicOr on that bitmap;
//   4. if any id found no room: every claimed slot gets its saved key and digest back
//      (nothing else was written yet) and counts = [0, failed];
//   5. on success only: new rows are initialised, scores updated, slots mapped back.
// Slot placement can differ from the CPU kernel's sequential order when ids race for a
// bucket; found/missing sets, values and counts agree.

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cooperative_groups.h>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "veloce/cuda_utils.cuh"

namespace veloce {
namespace cuda {
namespace {

// The mutable columns of a table.
struct Table {
  int64_t* keys;     // (C,)
  uint8_t* digests;  // (C,)
  int64_t* scores;   // (C,) (null where unused)
  int64_t num_buckets;
};

// Per distinct id of a call (U entries).
enum UniqueState : int8_t { kPresent = 0, kClaimed = 1, kEvicted = 2, kFailed = 3 };

struct Uniques {
  const int64_t* id;    // (U,)
  int64_t* slot;        // (U,) -1 until placed
  int8_t* state;        // (U,) UniqueState
  int64_t* old_key;     // (U,) what the claimed slot held (for rollback / evicted_keys)
  uint8_t* old_digest;  // (U,)
  int64_t n;
};

Table table_of(const at::Tensor& keys, const at::Tensor& digests, int64_t* scores) {
  return {keys.data_ptr<int64_t>(), digests.data_ptr<uint8_t>(), scores, keys.numel() / kBucketSize};
}

__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// Reserves one index per calling thread from *counter with one atomic per coalesced
// group of threads (same-address atomics from every thread would serialise in L2).
__device__ __forceinline__ int32_t aggregated_inc(int32_t* counter) {
  namespace cg = cooperative_groups;
  const cg::coalesced_group g = cg::coalesced_threads();
  int32_t base = 0;
  if (g.thread_rank() == 0) base = atomicAdd(counter, static_cast<int32_t>(g.size()));
  return g.shfl(base, 0) + static_cast<int32_t>(g.thread_rank());
}

__device__ __forceinline__ void mark_touched(uint32_t* touched, int64_t slot) {
  atomicOr(touched + slot / kBucketSize, 1u << (slot % kBucketSize));
}

// ---- kernels ---------------------------------------------------------------------------

__global__ void find_kernel(Table t, const int64_t* __restrict__ ids, int64_t n, int64_t* __restrict__ slots) {
  const int64_t i = thread_index();
  if (i < n) slots[i] = find_slot_device(t.keys, t.digests, t.num_buckets, ids[i]);
}

// Phase 1 of find_or_insert: slots of present ids (-1 for padding and misses), touched
// marks (when evicting), and the misses compacted into (miss_ids, miss_pos).
__global__ void probe_kernel(Table t, const int64_t* __restrict__ ids, int64_t n, bool has_pad, int64_t pad,
                             int64_t* __restrict__ slots, uint32_t* touched, int64_t* __restrict__ miss_ids,
                             int32_t* __restrict__ miss_pos, int32_t* miss_count) {
  const int64_t i = thread_index();
  bool missing = false;
  int64_t id = 0;
  if (i < n) {
    id = ids[i];
    int64_t s = kPaddingSlot;
    if (!(has_pad && id == pad)) {
      s = find_slot_device(t.keys, t.digests, t.num_buckets, id);
      missing = s < 0;
      if (s >= 0 && touched != nullptr) mark_touched(touched, s);
    }
    slots[i] = s;
  }
  // Warp-aggregated append (every lane of the warp reaches the ballot).
  const unsigned mask = __ballot_sync(0xffffffffu, missing);
  if (mask == 0) return;
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(mask) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(miss_count, __popc(mask));
  base = __shfl_sync(0xffffffffu, base, leader);
  if (missing) {
    const int at = base + __popc(mask & ((1u << lane) - 1));
    miss_ids[at] = id;
    miss_pos[at] = static_cast<int32_t>(i);
  }
}

// Slots of distinct ids (insert_or_assign, erase), touched marks when evicting.
__global__ void find_uniques_kernel(Table t, Uniques u, uint32_t* touched) {
  const int64_t k = thread_index();
  if (k >= u.n) return;
  const int64_t s = find_slot_device(t.keys, t.digests, t.num_buckets, u.id[k]);
  u.slot[k] = s;
  if (s >= 0 && touched != nullptr) mark_touched(touched, s);
}

// Word w of a bucket's digests, w uniform across unrolled compares (no local memory).
__device__ __forceinline__ uint32_t digest_word(const BucketDigests& d, int w) {
  uint32_t x = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) x = (k == w) ? d.w[k] : x;
  return x;
}

// Phase 3a: each distinct id not in the table claims an empty slot by CAS on the digest
// word; both buckets full -> queued in `overflow`. counters: [0] queued, [1] attempted.
__global__ void claim_kernel(Table t, Uniques u, uint32_t* touched, int32_t* __restrict__ overflow,
                             int32_t* counters) {
  const int64_t k = thread_index();
  if (k >= u.n || u.slot[k] >= 0) return;
  aggregated_inc(counters + 1);
  const int64_t key = u.id[k];
  const DeviceProbe p = device_probe(key, t.num_buckets);
  for (;;) {
    const BucketDigests da = load_bucket<true>(t.digests, p.a);
    const BucketDigests db = p.b != p.a ? load_bucket<true>(t.digests, p.b) : da;
    const uint32_t ea = empty_mask(da);
    const uint32_t eb = p.b != p.a ? empty_mask(db) : 0u;
    if ((ea | eb) == 0) {
      overflow[aggregated_inc(counters)] = static_cast<int32_t>(k);
      return;
    }
    const bool use_a = __popc(ea) >= __popc(eb);
    const int64_t bucket = use_a ? p.a : p.b;
    const int i = __ffs(use_a ? ea : eb) - 1;
    const uint32_t wa = digest_word(da, i >> 2), wb = digest_word(db, i >> 2);
    const uint32_t expected = use_a ? wa : wb;
    const uint32_t desired = expected | (p.digest << (8 * (i & 3)));
    uint32_t* word = reinterpret_cast<uint32_t*>(t.digests + bucket * kBucketSize) + (i >> 2);
    if (atomicCAS(word, expected, desired) == expected) {
      const int64_t s = bucket * kBucketSize + i;
      u.old_key[k] = t.keys[s];
      u.old_digest[k] = kEmptyDigest;
      t.keys[s] = key;
      u.slot[k] = s;
      u.state[k] = kClaimed;
      if (touched != nullptr) mark_touched(touched, s);
      return;
    }
    // Another id changed this word first: reload and choose again.
  }
}

// Phase 3b: queued ids (both buckets full) evict the lowest-score untouched candidate,
// ties to the lowest slot of bucket_a, then bucket_b. Only touched bits change
// concurrently here; scores are not written until the call succeeds.
__global__ void evict_kernel(Table t, Uniques u, uint32_t* touched, const int32_t* __restrict__ overflow,
                             int32_t n_overflow, int32_t* n_failed) {
  const int64_t j = thread_index();
  if (j >= n_overflow) return;
  const int64_t k = overflow[j];
  const int64_t key = u.id[k];
  const DeviceProbe p = device_probe(key, t.num_buckets);
  for (;;) {
    int64_t best = -1;
    int64_t best_score = 0;
    for (int side = 0; side < (p.b != p.a ? 2 : 1); ++side) {
      const int64_t bucket = side == 0 ? p.a : p.b;
      uint32_t free = ~*reinterpret_cast<volatile uint32_t*>(touched + bucket);
      while (free != 0) {
        const int64_t s = bucket * kBucketSize + (__ffs(free) - 1);
        const int64_t sc = t.scores[s];
        if (best < 0 || sc < best_score) {
          best = s;
          best_score = sc;
        }
        free &= free - 1;
      }
    }
    if (best < 0) {  // every candidate was touched by this call
      u.state[k] = kFailed;
      aggregated_inc(n_failed);
      return;
    }
    const uint32_t bit = 1u << (best % kBucketSize);
    if (atomicOr(touched + best / kBucketSize, bit) & bit) continue;  // lost it to another id
    u.old_key[k] = t.keys[best];
    u.old_digest[k] = t.digests[best];
    t.keys[best] = key;
    t.digests[best] = static_cast<uint8_t>(p.digest);
    u.slot[k] = best;
    u.state[k] = kEvicted;
    return;
  }
}

// Phase 4 (failure): restore every slot this call claimed. Slots are distinct.
__global__ void rollback_kernel(Table t, Uniques u) {
  const int64_t k = thread_index();
  if (k >= u.n) return;
  const int8_t st = u.state[k];
  if (st != kClaimed && st != kEvicted) return;
  const int64_t s = u.slot[k];
  t.keys[s] = u.old_key[k];
  t.digests[s] = u.old_digest[k];
}

// find_or_insert success: initial rows, zero state, starting score of the new ids.
// Block (32, 8): one row per threadIdx.y, columns over threadIdx.x.
template <typename scalar_t>
__global__ void init_rows_kernel(Uniques u, scalar_t* __restrict__ weights, int64_t D,
                                 at::opmath_type<scalar_t>* __restrict__ state, int64_t S,
                                 int64_t* __restrict__ scores, int64_t start_score, int64_t seed, int64_t kind,
                                 double a, double b) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (k >= u.n) return;
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
  if (k >= u.n) return;
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
  if (k >= u.n) return;
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

__global__ void runs_kernel(const int64_t* __restrict__ sorted, int64_t m, int32_t* __restrict__ run,
                            int64_t* __restrict__ uniq_id, int32_t* __restrict__ begin) {
  const int64_t j = thread_index();
  if (j >= m) return;
  const int32_t r = run[j] - 1;  // inclusive sum of heads -> 0-based run
  run[j] = r;
  if (j == 0 || sorted[j] != sorted[j - 1]) {
    uniq_id[r] = sorted[j];
    begin[r] = static_cast<int32_t>(j);
  }
}

// ---- host-side building blocks ---------------------------------------------------------

// ids grouped by value: positions sorted by (id, position), their run, and per run the id
// and the first sorted entry (begin[U] = m).
struct Runs {
  at::Tensor sorted_pos;  // (m,) int32
  at::Tensor run;         // (m,) int32
  at::Tensor uniq_id;     // (U,) int64
  at::Tensor begin;       // (U + 1,) int32
  int64_t num = 0;        // U
};

Runs group_ids(const at::Tensor& ids, const at::Tensor& pos) {  // (m,) int64, (m,) int32; m > 0
  const int64_t m = ids.numel();
  const int num = static_cast<int>(m);
  at::Tensor sorted_ids = at::empty_like(ids);
  Runs r;
  r.sorted_pos = at::empty_like(pos);
  cub_call(ids, [&](void* temp, size_t& bytes) {
    return cub::DeviceRadixSort::SortPairs(temp, bytes, ids.data_ptr<int64_t>(), sorted_ids.data_ptr<int64_t>(),
                                           pos.data_ptr<int32_t>(), r.sorted_pos.data_ptr<int32_t>(), num, 0, 64,
                                           stream());
  });
  at::Tensor heads = at::empty({m}, pos.options());
  run_heads_kernel<<<grid_for(m), kThreads, 0, stream()>>>(sorted_ids.data_ptr<int64_t>(), m,
                                                           heads.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  r.run = at::empty({m}, pos.options());
  cub_call(ids, [&](void* temp, size_t& bytes) {
    return cub::DeviceScan::InclusiveSum(temp, bytes, heads.data_ptr<int32_t>(), r.run.data_ptr<int32_t>(), num,
                                         stream());
  });
  at::Tensor uniq_id = at::empty({m}, ids.options());
  at::Tensor begin = at::empty({m + 1}, pos.options());
  runs_kernel<<<grid_for(m), kThreads, 0, stream()>>>(sorted_ids.data_ptr<int64_t>(), m,
                                                      r.run.data_ptr<int32_t>(), uniq_id.data_ptr<int64_t>(),
                                                      begin.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  r.num = r.run[m - 1].item<int32_t>() + 1;  // sync: sizes the per-id arrays
  begin.narrow(0, r.num, 1).fill_(num);
  r.uniq_id = uniq_id.narrow(0, 0, r.num);
  r.begin = begin.narrow(0, 0, r.num + 1);
  return r;
}

// Owns the per-distinct-id state of one call.
struct UniqueTensors {
  at::Tensor id, slot, state, old_key, old_digest;
  explicit UniqueTensors(const at::Tensor& ids) : id(ids) {
    const int64_t n = ids.numel();
    slot = at::full({n}, -1, ids.options());
    state = at::zeros({n}, ids.options().dtype(at::kChar));
    old_key = at::empty({n}, ids.options());
    old_digest = at::empty({n}, ids.options().dtype(at::kByte));
  }
  Uniques view() {
    return {id.data_ptr<int64_t>(),    slot.data_ptr<int64_t>(),     state.data_ptr<int8_t>(),
            old_key.data_ptr<int64_t>(), old_digest.data_ptr<uint8_t>(), id.numel()};
  }
};

struct InsertOutcome {
  int64_t inserted = 0;
  int64_t failed = 0;
  at::Tensor evicted;  // (E,) int64
};

// Phases 3a, 3b and 4 over the distinct ids whose slot is still -1.
InsertOutcome insert_uniques(const Table& t, UniqueTensors& ut, uint32_t* touched, bool allow_evict) {
  Uniques u = ut.view();
  InsertOutcome out;
  out.evicted = at::empty({0}, ut.id.options());
  at::Tensor counters = at::zeros({3}, ut.id.options().dtype(at::kInt));
  at::Tensor overflow = at::empty({u.n}, ut.id.options().dtype(at::kInt));
  int32_t* ctr = counters.data_ptr<int32_t>();
  claim_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, touched, overflow.data_ptr<int32_t>(), ctr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor host = counters.cpu();  // sync: queued and attempted counts
  const int32_t n_overflow = host.data_ptr<int32_t>()[0];
  out.inserted = host.data_ptr<int32_t>()[1];
  if (n_overflow > 0) {
    if (!allow_evict) {
      out.failed = n_overflow;
    } else {
      evict_kernel<<<grid_for(n_overflow), kThreads, 0, stream()>>>(t, u, touched, overflow.data_ptr<int32_t>(),
                                                                    n_overflow, ctr + 2);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      out.failed = counters[2].item<int32_t>();  // sync
    }
  }
  if (out.failed > 0) {
    rollback_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    out.inserted = 0;
    return out;
  }
  if (allow_evict && n_overflow > 0) out.evicted = ut.old_key.masked_select(ut.state == kEvicted);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> result(at::Tensor slots, const InsertOutcome& r,
                                                      const at::Tensor& keys) {
  at::Tensor counts = at::tensor(std::vector<int64_t>{r.inserted, r.failed}, at::kLong).to(keys.device());
  return {slots, counts, r.evicted.defined() ? r.evicted : at::empty({0}, keys.options())};
}

at::Tensor check_insert_args(const char* op, const at::Tensor& keys, const at::Tensor& digests,
                             const at::Tensor& scores, const at::Tensor& weights, const at::Tensor& opt_state,
                             const at::Tensor& ids, int64_t score_policy) {
  check_table(op, keys, digests, scores);
  check_table_rows(op, weights, opt_state, keys);
  check_ids(op, ids, keys);
  check_int_arg(op, "score_policy", score_policy, 0, 2, "0 none, 1 LRU, 2 LFU");
  check_cuda_table(op, keys, digests);
  check_num_ids(op, ids.numel());
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
  check_table_keys(op, keys, digests);
  check_ids(op, ids_in, keys);
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
  const at::Tensor ids = check_insert_args(op, keys, digests, scores, weights, opt_state, ids_in, score_policy);
  check_init(op, init_kind, init_a, init_b);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t n = ids.numel();
  at::Tensor slots = at::empty_like(ids);
  InsertOutcome r;
  if (n == 0) return result(slots, r, keys);
  const Table t = table_of(keys, digests, scores.data_ptr<int64_t>());
  const at::Tensor touched = touched_bitmap(allow_evict, keys);

  // Phase 1: find all, compact the misses.
  at::Tensor miss_ids = at::empty({n}, ids.options());
  at::Tensor miss_pos = at::empty({n}, ids.options().dtype(at::kInt));
  at::Tensor miss_count = at::zeros({1}, ids.options().dtype(at::kInt));
  probe_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
      t, ids.data_ptr<int64_t>(), n, padding_id.has_value(), padding_id.value_or(0), slots.data_ptr<int64_t>(),
      words(touched), miss_ids.data_ptr<int64_t>(), miss_pos.data_ptr<int32_t>(), miss_count.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t m = miss_count.item<int32_t>();  // sync: sizes the grouping sort

  if (m > 0) {
    // Phases 2-4: one thread per distinct new id.
    const Runs runs = group_ids(miss_ids.narrow(0, 0, m), miss_pos.narrow(0, 0, m));
    UniqueTensors ut(runs.uniq_id);
    r = insert_uniques(t, ut, words(touched), allow_evict);
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
  const at::Tensor ids = check_insert_args(op, keys, digests, scores, weights, opt_state, ids_in, score_policy);
  const int64_t n = ids.numel();
  check_dim(op, "values", values_in, 2);
  check_same_device(op, "values", values_in, "keys", keys);
  check_size(op, "values", values_in, 0, n, "the number of ids");
  check_size(op, "values", values_in, 1, weights.size(1), "the embedding dim of weights");
  check_dtype(op, "values", values_in, weights.scalar_type());
  const at::Tensor values = values_in.contiguous();
  at::Tensor opt_values, score_values;
  if (opt_values_in) {
    check_dim(op, "opt_values", *opt_values_in, 2);
    check_same_device(op, "opt_values", *opt_values_in, "keys", keys);
    check_size(op, "opt_values", *opt_values_in, 0, n, "the number of ids");
    check_size(op, "opt_values", *opt_values_in, 1, opt_state.size(1), "the state width of opt_state");
    check_dtype(op, "opt_values", *opt_values_in, opt_state.scalar_type());
    opt_values = opt_values_in->contiguous();
  }
  if (score_values_in) {
    check_dtype(op, "score_values", *score_values_in, at::kLong);
    check_dim(op, "score_values", *score_values_in, 1);
    check_same_device(op, "score_values", *score_values_in, "keys", keys);
    check_size(op, "score_values", *score_values_in, 0, n, "the number of ids");
    score_values = score_values_in->contiguous();
  }
  const c10::cuda::CUDAGuard guard(keys.device());
  at::Tensor slots = at::empty_like(ids);
  InsertOutcome r;
  if (n == 0) return result(slots, r, keys);
  const Table t = table_of(keys, digests, scores.data_ptr<int64_t>());
  const at::Tensor touched = touched_bitmap(allow_evict, keys);

  const Runs runs = group_ids(ids, at::arange(n, ids.options().dtype(at::kInt)));
  UniqueTensors ut(runs.uniq_id);
  Uniques u = ut.view();
  find_uniques_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, words(touched));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  r = insert_uniques(t, ut, words(touched), allow_evict);
  if (r.failed > 0) {
    slots.fill_(kPaddingSlot);
    return result(slots, r, keys);
  }
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
  check_table_keys(op, keys, digests);
  check_ids(op, ids_in, keys);
  check_cuda_table(op, keys, digests);
  check_num_ids(op, ids_in.numel());
  const c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  at::Tensor erased = at::zeros({n}, ids.options().dtype(at::kBool));
  if (n == 0) return erased;
  const Table t = table_of(keys, digests, nullptr);
  const Runs runs = group_ids(ids, at::arange(n, ids.options().dtype(at::kInt)));
  UniqueTensors ut(runs.uniq_id);
  const Uniques u = ut.view();
  // Find first (read-only), then clear: a launch boundary between reads and writes.
  find_uniques_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  erase_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, runs.sorted_pos.data_ptr<int32_t>(),
                                                         runs.begin.data_ptr<int32_t>(), erased.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return erased;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> export_cuda(const at::Tensor& keys,
                                                                        const at::Tensor& digests,
                                                                        const at::Tensor& scores,
                                                                        const at::Tensor& weights,
                                                                        const at::Tensor& opt_state, int64_t start,
                                                                        int64_t end) {
  constexpr const char* op = "veloce::export";
  check_table(op, keys, digests, scores);
  check_table_rows(op, weights, opt_state, keys);
  const int64_t capacity = keys.numel();
  TORCH_CHECK(0 <= start && start <= end && end <= capacity, op,
              ": need 0 <= start <= end <= capacity, got start = ", start, ", end = ", end, ", capacity = ",
              capacity);
  const c10::cuda::CUDAGuard guard(keys.device());
  // nonzero syncs to size its output; slot order is preserved.
  const at::Tensor occupied = digests.slice(0, start, end).nonzero().squeeze(1).add_(start);
  return {keys.index_select(0, occupied), weights.index_select(0, occupied), opt_state.index_select(0, occupied),
          scores.index_select(0, occupied)};
}

at::Tensor initialize_cuda(const at::Tensor& ids_in, int64_t dim, int64_t seed, int64_t init_kind, double init_a,
                           double init_b, at::ScalarType dtype) {
  constexpr const char* op = "veloce::initialize";
  check_dtype(op, "ids", ids_in, at::kLong);
  check_dim(op, "ids", ids_in, 1);
  TORCH_CHECK(dim >= 0, op, ": dim must be >= 0, got ", dim);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be Float, Double, Half or BFloat16, got ", c10::toString(dtype));
  check_init(op, init_kind, init_a, init_b);
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
  m.impl("export", &veloce::cuda::export_cuda);
  m.impl("initialize", &veloce::cuda::initialize_cuda);
}
