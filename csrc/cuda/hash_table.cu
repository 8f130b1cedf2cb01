// CUDA kernels of the hash_table family: ids -> slots over tensor table state.
// Semantics: docs/ops.md ("Table layout", "hash_table"); CPU reference csrc/cpu/hash_table.cpp.
//
// Lookups are one thread per id: both buckets' 32-byte digest sectors are loaded as
// 16-byte vectors, matched 4 digests per instruction (__vcmpeq4), and keys are read only
// on a digest match.
//
// Inserting ops (find_or_insert, insert_or_assign) run in phases:
//   1. find every id in parallel (no mutation); find_or_insert flags the misses;
//   2. group the (missing) positions by id through a scratch hash set (group_ids), so each
//      distinct new id is inserted by exactly one thread; classify the new ids (conflicted
//      or not, and for the others whether they will need to evict or fail);
//   3a. claim: each new id CASes the 32-bit word holding 4 digests to take the lowest
//       empty slot of its emptier bucket (bucket_a on a tie), retrying on contention;
//       ids whose two buckets are full are queued;
//   3b. evict (allow_evict only, a separate launch after 3a): a queued id takes the
//       lowest-score slot of its 64 candidates not touched by this call (a bitmap of
//       found + claimed slots); ownership is an atomicOr on that bitmap;
//   4. if any id found no room: every claimed slot gets its saved key and digest back
//       (nothing else was written yet) and counts = [0, failed]; when the failure is
//       known from phase 2 already (no conflicted ids), nothing is claimed at all;
//   5. on success only: new rows are initialised, scores updated, slots mapped back.
// Phases 1 and 2 write scratch memory only: the table changes from phase 3 on.
//
// Host syncs (device-to-host reads; each costs tens of microseconds and drains the launch
// queue). Sizes the host cannot know are replaced by upper bounds (the n positions of the
// call), with the exact count read from device memory by the kernels; what remains:
//   b. one copy of the counters after phase 2: U (sizes the per-id launches after it),
//      the new ids (inserted; 0 ends the call), the conflicted ids (choose sequential or
//      racing placement, and size the sequential order) and the classification. Without
//      conflicted ids the outcome (inserted, failed, evicted) is fully known here.
//      find_or_insert: the caller's bad_input flag rides in the same copy: a set flag ends
//      the call with an error before phase 3 (nothing changed), so a caller that checks
//      its input on the device (DynamicEmbedding's bag layouts) pays no sync of its own.
//      When no table has ids (no sync b), the flag is read alone.
//   c. only with conflicted ids: one more copy after phase 3, for failed (rollback or not)
//      and the number of evicted keys (sizes evicted_keys).
// (An earlier version also read the number of missing positions back after phase 1, to
// size a radix sort that grouped them: "sync a".) counts is computed on the host and
// returned as a CPU tensor. Per call: find_or_insert and insert_or_assign 1 sync, or 2 with
// conflicted ids; erase none.
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

#include <cub/device/device_select.cuh>

#include "hash_table_device.cuh"
#include "veloce/cuda_utils.cuh"
#include "veloce/many.h"
#include "veloce/op_checks.h"

namespace veloce {
namespace cuda {
namespace {

// Rows per warp for a kernel over `rows` rows (row_warp_grid): as many as keep every SM busy
// with 32 warps, at most 32. One warp per row leaves each row's dependent loads exposed
// (0.6 TB/s on 420k rows of 256 bytes); 32 rows per warp over few rows leaves SMs idle
// (a normal initializer's rows cost microseconds each).
inline int rows_per_warp(int64_t rows) {
  const int64_t warps = static_cast<int64_t>(num_sms()) * 32;
  return static_cast<int>(std::min<int64_t>(32, std::max<int64_t>(1, ceil_div(rows, warps))));
}

// Blocks of kThreads for `rows` rows at r rows per warp.
inline unsigned row_warp_grid(int64_t rows, int r) { return grid_for(ceil_div(rows, r) * 32); }

// find_or_insert success: initial rows, zero state, starting score of the new ids. Each warp
// takes r consecutive distinct ids (rows_per_warp): lane j < r loads id (base + j)'s state and
// slot and hashes its id, then the warp fills the r rows in turn, columns over lanes.
template <typename scalar_t>
__global__ void init_rows_kernel(Uniques u, int r, scalar_t* __restrict__ weights, int64_t D,
                                 at::opmath_type<scalar_t>* __restrict__ state, int64_t S,
                                 int64_t* __restrict__ scores, int64_t start_score, int64_t seed, int64_t kind,
                                 double a, double b) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t k = thread_index() / 32 * r + lane;
  int64_t slot = -1;
  uint64_t bits = 0;  // the row's init bits: each lane hashes its own id once
  if (lane < r && u.has(k)) {
    const int8_t st = u.state[k];
    if (st == kClaimed || st == kEvicted) {
      slot = u.slot[k];
      bits = init_row_bits(seed, u.id[k]);
    }
  }
  if (__ballot_sync(kFullWarp, slot >= 0) == 0) return;  // the whole warp
  for (int j = 0; j < r; ++j) {
    const int64_t s = __shfl_sync(kFullWarp, slot, j);
    if (s < 0) continue;
    scalar_t* const row = weights + s * D;
    init_columns(__shfl_sync(kFullWarp, bits, j), D, kind, a, b, lane, 32,
                 [&](int64_t c, double v) { row[c] = to_weight<scalar_t>(v); });
    for (int64_t c = lane; c < S; c += 32) state[s * S + c] = 0;
    if (lane == 0) scores[s] = start_score;
  }
}

// insert_or_assign success: the last occurrence of each distinct id writes its row,
// state and score (last_pos, occurrences: from group_ids). Each warp takes r distinct ids,
// as init_rows_kernel: lane j < r loads id (base + j)'s bookkeeping and sets its score, then
// the warp copies the r rows in turn.
template <typename scalar_t>
__global__ void assign_rows_kernel(Uniques u, int r, const int32_t* __restrict__ last_pos,
                                   const int32_t* __restrict__ occurrences, scalar_t* __restrict__ weights,
                                   const scalar_t* __restrict__ values, int64_t D,
                                   at::opmath_type<scalar_t>* __restrict__ state,
                                   const at::opmath_type<scalar_t>* __restrict__ opt_values, int64_t S,
                                   int64_t* __restrict__ scores, const int64_t* __restrict__ score_values,
                                   int64_t policy, int64_t score_value) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t k = thread_index() / 32 * r + lane;
  int64_t slot = -1, last = 0;
  bool fresh = false;
  if (lane < r && u.has(k)) {
    slot = u.slot[k];
    const int8_t st = u.state[k];
    fresh = st == kClaimed || st == kEvicted;
    last = last_pos[k];
    int64_t sc;
    if (score_values != nullptr) {
      sc = score_values[last];
    } else {
      sc = fresh ? (policy == kScoreLRU ? score_value : 0) : scores[slot];
      if (policy == kScoreLRU) sc = score_value;
      if (policy == kScoreLFU) sc += occurrences[k];
    }
    scores[slot] = sc;
  }
  const unsigned rows = __ballot_sync(kFullWarp, slot >= 0);
  if (rows == 0) return;  // the whole warp
  const unsigned fresh_rows = __ballot_sync(kFullWarp, fresh);
  for (int j = 0; j < r; ++j) {
    if (!((rows >> j) & 1u)) continue;
    const int64_t s = __shfl_sync(kFullWarp, slot, j);
    const int64_t src = __shfl_sync(kFullWarp, last, j);
    for (int64_t c = lane; c < D; c += 32) weights[s * D + c] = values[src * D + c];
    if (opt_values != nullptr) {
      for (int64_t c = lane; c < S; c += 32) state[s * S + c] = opt_values[src * S + c];
    } else if ((fresh_rows >> j) & 1u) {
      for (int64_t c = lane; c < S; c += 32) state[s * S + c] = 0;
    }
  }
}

// slots[i] = slot of position i's distinct id, for every grouped position (active[i], or
// all when active is null).
__global__ void map_slots_kernel(const uint8_t* __restrict__ active, const int32_t* __restrict__ group, int64_t n,
                                 const int64_t* __restrict__ uniq_slot, int64_t* __restrict__ slots) {
  const int64_t i = thread_index();
  if (i < n && (active == nullptr || active[i])) slots[i] = uniq_slot[group[i]];
}

// Per non-padding position: LRU sets score_value, LFU adds 1. skip: positions to leave
// out (null for none): LRU skips the new ids, whose rows started at score_value.
__global__ void score_positions_kernel(const int64_t* __restrict__ slots, const uint8_t* __restrict__ skip, int64_t n,
                                       int64_t* scores, int64_t policy, int64_t score_value) {
  const int64_t i = thread_index();
  if (i >= n || (skip != nullptr && skip[i])) return;
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

__global__ void erase_kernel(Table t, Uniques u, const int32_t* __restrict__ first_pos, bool* __restrict__ erased) {
  const int64_t k = thread_index();
  if (!u.has(k)) return;
  const int64_t s = u.slot[k];
  if (s < 0) return;
  t.digests[s] = kEmptyDigest;
  erased[first_pos[k]] = true;
}

// Block (lanes, rows): one row per threadIdx.y, its columns over threadIdx.x.
template <typename scalar_t>
__global__ void initialize_kernel(const int64_t* __restrict__ ids, int64_t n, int64_t dim, int64_t seed,
                                  int64_t kind, double a, double b, scalar_t* __restrict__ out) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (k >= n) return;
  scalar_t* const row = out + k * dim;
  init_columns(init_row_bits(seed, ids[k]), dim, kind, a, b, threadIdx.x, blockDim.x,
               [&](int64_t c, double v) { row[c] = to_weight<scalar_t>(v); });
}

// ---- grouping: the distinct ids of a call ------------------------------------------------
// Positions are grouped by id through a scratch open-addressing set (linear probing, load
// <= 1/2) instead of a sort: one CAS per position to claim an id's scratch slot, whose winner
// numbers the id; then, after a launch boundary, every position reads its id's number. A
// radix sort of 64-bit ids took 8 passes and about 20 launches; this takes 4 launches and no
// size from the host, so it runs over all n positions with an `active` flag each.
//
// Every int64 is a valid id, so the scratch set's empty marker kGroupEmpty is one too: that
// id takes the spare scratch slot past the set (claimed by a flag), never the set itself.
constexpr int64_t kGroupEmpty = std::numeric_limits<int64_t>::min();

struct GroupScratch {
  int64_t* keys;      // (C,) ids, kGroupEmpty where free
  int32_t* index;     // (C + 1,) the distinct id's number, written by the slot's winner
  int32_t* spare;     // claim flag of slot C (the id kGroupEmpty)
  int64_t mask;       // C - 1
};

// Claims each active position's id a scratch slot; the winner numbers the id (*num), writes
// it and starts its slot, state, first/last position and count. where[i] = the position's
// scratch slot.
__global__ void group_claim_kernel(const int64_t* __restrict__ ids, const uint8_t* __restrict__ active, int64_t n,
                                   GroupScratch g, int64_t* __restrict__ where, int64_t* __restrict__ uniq_id,
                                   int64_t* __restrict__ uniq_slot, int8_t* __restrict__ uniq_state,
                                   int32_t* __restrict__ first_pos, int32_t* __restrict__ last_pos,
                                   int32_t* __restrict__ occurrences, int32_t* num) {
  const int64_t i = thread_index();
  const bool on = i < n && (active == nullptr || active[i]);
  int64_t h = 0, id = 0;
  bool won = false;
  if (on) {
    id = ids[i];
    if (id == kGroupEmpty) {
      h = g.mask + 1;
      // A plain read first: a hot id's later positions find it claimed without an atomic.
      won = __ldcg(g.spare) == 0 && atomicExch(g.spare, 1) == 0;
    } else {
      h = static_cast<int64_t>(fmix64(static_cast<uint64_t>(id)) & static_cast<uint64_t>(g.mask));
      while (true) {
        int64_t seen = __ldcg(g.keys + h);
        if (seen == kGroupEmpty) {
          seen = static_cast<int64_t>(atomicCAS(reinterpret_cast<unsigned long long*>(g.keys + h),
                                                static_cast<unsigned long long>(kGroupEmpty),
                                                static_cast<unsigned long long>(id)));
          if (seen == kGroupEmpty) {
            won = true;
            break;
          }
        }
        if (seen == id) break;
        h = (h + 1) & g.mask;
      }
    }
    where[i] = h;
  }
  const int32_t k = block_reserve(won, num);
  if (!won) return;
  g.index[h] = k;
  uniq_id[k] = id;
  uniq_slot[k] = -1;
  uniq_state[k] = kPresent;
  first_pos[k] = std::numeric_limits<int32_t>::max();
  if (last_pos != nullptr) {
    last_pos[k] = -1;
    occurrences[k] = 0;
  }
}

// Per active position: its distinct id's number (group), and that id's first position (and
// last position and count, when asked for). Lanes of a warp that share an id combine first,
// so a hot id costs one atomic per warp, not per position.
__global__ void group_assign_kernel(const uint8_t* __restrict__ active, int64_t n, const int64_t* __restrict__ where,
                                    const int32_t* __restrict__ index, int32_t* __restrict__ group,
                                    int32_t* __restrict__ first_pos, int32_t* __restrict__ last_pos,
                                    int32_t* __restrict__ occurrences) {
  const int64_t i = thread_index();
  const bool on = i < n && (active == nullptr || active[i]);
  const unsigned lanes = __ballot_sync(kFullWarp, on);
  if (!on) return;
  const int32_t k = index[where[i]];
  group[i] = k;
  const unsigned same = __match_any_sync(lanes, k);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int lowest = __ffs(same) - 1, highest = 31 - __clz(same);
  // Positions grow with the lane: the lowest lane of the group holds its first position.
  if (lane == lowest) {
    atomicMin(first_pos + k, static_cast<int32_t>(i));
    if (occurrences != nullptr) atomicAdd(occurrences + k, __popc(same));
  }
  if (last_pos != nullptr && lane == highest) atomicMax(last_pos + k, static_cast<int32_t>(i));
}

// ---- host-side building blocks ---------------------------------------------------------

// Owns the per-distinct-id state of one call: arrays of n entries (n positions grouped),
// of which group_ids fills the first U (U in *num, in device memory): the id, slot -1 and
// state kPresent. n is the upper bound until the host reads U and sets n = U, so that later
// launches cover U ids only.
struct UniqueTensors {
  at::Tensor id, slot, state, old_key, old_digest;
  const int32_t* num;
  int64_t n;
  UniqueTensors(const at::Tensor& like, int64_t n, const int32_t* num) : num(num), n(n) {
    id = at::empty({n}, like.options());
    slot = at::empty({n}, like.options());
    state = at::empty({n}, like.options().dtype(at::kChar));
    old_key = at::empty({n}, like.options());
    old_digest = at::empty({n}, like.options().dtype(at::kByte));
  }
  Uniques view() const {
    return {id.data_ptr<int64_t>(),      slot.data_ptr<int64_t>(),       state.data_ptr<int8_t>(),
            old_key.data_ptr<int64_t>(), old_digest.data_ptr<uint8_t>(), num, n};
  }
};

// The grouping of a call's active positions by id (the distinct ids themselves go to
// UniqueTensors). Arrays of n entries (the upper bound), the first U used. Scratch memory
// scales with the n positions, found ones included (the grouping runs before the host
// knows how many are missing): about 16 bytes per position for the hash set (2n to 4n
// slots of 8 + 4 bytes), 8 for `where`, and 8-16 for these arrays.
struct Groups {
  at::Tensor first_pos;    // (n,) int32: distinct id k's first position
  at::Tensor last_pos;     // (n,) int32: its last position (with_last only)
  at::Tensor occurrences;  // (n,) int32: its number of positions (with_last only)
  at::Tensor group;        // (n,) int32: per active position, its distinct id k
};

// Groups the n positions of ids (active: (n,) flags, or null for all) into ut (n entries;
// *ut.num and *spare, a device int32 for the scratch set, must be 0 on entry). Nothing is
// read back.
Groups group_ids(const at::Tensor& ids, const uint8_t* active, UniqueTensors& ut, int32_t* spare, bool with_last) {
  const int64_t n = ids.numel();
  int64_t cap = 64;
  while (cap < 2 * n) cap *= 2;
  const at::TensorOptions i32 = ids.options().dtype(at::kInt);
  const at::Tensor keys = at::full({cap}, kGroupEmpty, ids.options());
  const at::Tensor index = at::empty({cap + 1}, i32);
  const at::Tensor where = at::empty({n}, ids.options());  // a scratch slot may pass 2^31
  Groups r;
  r.first_pos = at::empty({n}, i32);
  r.group = at::empty({n}, i32);
  if (with_last) {
    r.last_pos = at::empty({n}, i32);
    r.occurrences = at::empty({n}, i32);
  }
  int32_t* const last = with_last ? r.last_pos.data_ptr<int32_t>() : nullptr;
  int32_t* const occ = with_last ? r.occurrences.data_ptr<int32_t>() : nullptr;
  const GroupScratch g{keys.data_ptr<int64_t>(), index.data_ptr<int32_t>(), spare, cap - 1};
  group_claim_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
      ids.data_ptr<int64_t>(), active, n, g, where.data_ptr<int64_t>(), ut.id.data_ptr<int64_t>(),
      ut.slot.data_ptr<int64_t>(), ut.state.data_ptr<int8_t>(), r.first_pos.data_ptr<int32_t>(), last, occ,
      const_cast<int32_t*>(ut.num));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  group_assign_kernel<<<grid_for(n), kThreads, 0, stream()>>>(active, n, where.data_ptr<int64_t>(),
                                                               index.data_ptr<int32_t>(), r.group.data_ptr<int32_t>(),
                                                               r.first_pos.data_ptr<int32_t>(), last, occ);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return r;
}

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
  kGroupSpare,  // group_ids' claim of its spare scratch slot
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
// The distinct ids and their grouping are owned by the caller and passed to each stage.
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
  bool place(const int32_t* c, UniqueTensors& ut, const Groups& groups) {
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
      const at::Tensor order = select_in_first_occurrence_order(ut, groups.first_pos, n_conflicted_,
                                                                IsConflicted{conflicted_.data_ptr<uint8_t>()});
      sequential_insert_kernel<<<1, 1, 0, stream()>>>(t_, u, order.data_ptr<int64_t>(), n_conflicted_,
                                                     allow_evict_, touched_, ctr + counter::kFailed,
                                                     ctr + counter::kEvicted);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (n_conflicted_ > 0) return true;  // how the conflicted ids fared is known on the device only
    note_evicted(allow_evict_ ? n_full : 0, ut, groups);  // none doomed (else failed above): every full id evicted
    return false;
  }

  // Phase 4 (rollback on failure) from the counters read after place (sync c).
  void settle(const int32_t* p, const UniqueTensors& ut, const Groups& groups) {
    // Without eviction every queued id failed; sequential failures are in kFailed either way.
    out.failed = p[counter::kFailed] + (allow_evict_ ? 0 : p[counter::kQueued]);
    if (out.failed > 0) {
      rollback_kernel<<<grid_for(ut.n), kThreads, 0, stream()>>>(t_, ut.view());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      out.inserted = 0;
      return;
    }
    note_evicted(p[counter::kEvicted], ut, groups);
  }

 private:
  void note_evicted(int64_t n_evicted, const UniqueTensors& ut, const Groups& groups) {
    if (n_evicted == 0) return;  // in insertion order, as the CPU kernel reports them
    out.evicted = ut.old_key.index_select(
        0, select_in_first_occurrence_order(ut, groups.first_pos, n_evicted, IsEvicted{ut.view().state}));
  }

  Table t_;
  at::Tensor counters_;
  uint32_t* touched_;
  bool allow_evict_;
  at::Tensor conflicted_, overflow_;
  int64_t n_conflicted_ = 0;
};

// The three stages in a row, for an op over one table (insert_or_assign).
InsertOutcome insert_uniques(const Table& t, UniqueTensors& ut, const Groups& groups, const at::Tensor& counters,
                             uint32_t* touched, bool allow_evict) {
  Placement p(t, counters, touched, allow_evict);
  p.classify(ut);
  const at::Tensor counted = counters.cpu();  // sync b
  if (p.place(counted.data_ptr<int32_t>(), ut, groups)) {
    const at::Tensor placed = counters.cpu();  // sync c
    p.settle(placed.data_ptr<int32_t>(), ut, groups);
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
// every table before the next and pays syncs b and c once for all of them:
//   probe_and_group()  phase 1, then the missing positions grouped by id and classified
//            (launches only; nothing read back)
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
  const at::Tensor& counters() const { return counters_; }

  // Phase 1: find all (missing_ flags the positions to insert), then phases 2 up to the
  // classification over the missing positions, one thread per distinct new id.
  void probe_and_group() {
    slots_ = a_.slots.defined() ? a_.slots : at::empty_like(a_.ids);
    if (n_ == 0) return;
    t_ = table_of(a_.keys, a_.digests, a_.scores.data_ptr<int64_t>());
    touched_ = touched_bitmap(a_.allow_evict, a_.keys);
    missing_ = at::empty({n_}, a_.ids.options().dtype(at::kByte));
    probe_kernel<<<grid_for(n_), kThreads, 0, stream()>>>(t_, a_.ids.data_ptr<int64_t>(), n_,
                                                          a_.padding_id.has_value(), a_.padding_id.value_or(0),
                                                          slots_.data_ptr<int64_t>(), words(touched_),
                                                          missing_.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    counters_ = new_counters(a_.ids);
    ut_.emplace(a_.ids, n_, counters_.data_ptr<int32_t>() + counter::kUniques);
    groups_.emplace(group_ids(a_.ids, missing_.data_ptr<uint8_t>(), *ut_,
                              counters_.data_ptr<int32_t>() + counter::kGroupSpare, false));
    placement_.emplace(t_, counters_, words(touched_), a_.allow_evict);
    placement_->classify(*ut_);
  }

  bool place(const int32_t* counted) { return placement_->place(counted, *ut_, *groups_); }
  void settle(const int32_t* placed) { placement_->settle(placed, *ut_, *groups_); }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> finish() {
    const InsertOutcome r = placement_ ? placement_->out : InsertOutcome{};
    if (n_ == 0) return result(slots_, r, a_.keys);
    if (r.failed > 0) {
      slots_.fill_(kPaddingSlot);
      return result(slots_, r, a_.keys);
    }
    if (r.inserted > 0) {  // phase 5: new rows, then every missing position's slot
      const Uniques u = ut_->view();  // n = U since place()
      const int64_t D = a_.weights.size(1), S = a_.opt_state.size(1);
      const int64_t start = a_.score_policy == kScoreLRU ? a_.score_value : 0;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a_.weights.scalar_type(), "find_or_insert_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const int rows = rows_per_warp(u.n);
        init_rows_kernel<scalar_t><<<row_warp_grid(u.n, rows), kThreads, 0, stream()>>>(
            u, rows, a_.weights.data_ptr<scalar_t>(), D, a_.opt_state.data_ptr<acc_t>(), S, t_.scores, start, a_.seed,
            a_.init_kind, a_.init_a, a_.init_b);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      map_slots_kernel<<<grid_for(n_), kThreads, 0, stream()>>>(missing_.data_ptr<uint8_t>(),
                                                                 groups_->group.data_ptr<int32_t>(), n_, u.slot,
                                                                 slots_.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (a_.score_policy != kScoreNone) {
      // Every missing position is a new row (r.inserted = 0: none is missing).
      const uint8_t* skip = a_.score_policy == kScoreLRU ? missing_.data_ptr<uint8_t>() : nullptr;
      score_positions_kernel<<<grid_for(n_), kThreads, 0, stream()>>>(slots_.data_ptr<int64_t>(), skip, n_,
                                                                      t_.scores, a_.score_policy, a_.score_value);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return result(slots_, r, a_.keys);
  }

 private:
  FindOrInsertArgs a_;
  int64_t n_ = 0;
  Table t_{};
  at::Tensor touched_, slots_, missing_, counters_;
  std::optional<UniqueTensors> ut_;
  std::optional<Groups> groups_;
  std::optional<Placement> placement_;
};

// The int32 device tensors `parts`, concatenated and read back in one copy (one sync).
at::Tensor read_back(const std::vector<at::Tensor>& parts) {
  return parts.size() == 1 ? parts[0].cpu() : at::cat(parts).cpu();
}

// Runs the stages of every call, each stage for all tables before the next: syncs b and c
// happen once per op however many tables it inserts into (c only when some table has
// conflicted ids). bad_input (checked by the op) is read with sync b, or alone when no
// table has ids; when set, `op` raises before any table changes (the probe and the
// grouping write scratch memory only).
std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>> run_find_or_insert(
    const char* op, std::vector<FindOrInsert>& calls, const std::optional<at::Tensor>& bad_input) {
  std::vector<FindOrInsert*> live;
  for (auto& c : calls) {
    c.probe_and_group();
    if (!c.empty()) live.push_back(&c);
  }
  // `extra` (int32 (1,)) is appended after the calls' parts, in the same copy.
  auto read = [&](const std::vector<FindOrInsert*>& cs, const at::Tensor& extra = at::Tensor()) {
    std::vector<at::Tensor> parts;
    for (FindOrInsert* c : cs) parts.push_back(c->counters());
    if (extra.defined()) parts.push_back(extra);
    return read_back(parts);
  };
  if (live.empty() && bad_input) {
    check_bad_input_unset(op, bad_input->item<bool>());  // no sync b to ride on: read alone
  } else if (!live.empty()) {
    const at::Tensor flag = bad_input ? bad_input->reshape({1}).to(at::kInt) : at::Tensor();
    const at::Tensor counted = read(live, flag);  // sync b
    const int32_t* c = counted.data_ptr<int32_t>();
    if (bad_input) check_bad_input_unset(op, c[live.size() * counter::kNum] != 0);  // before any change
    std::vector<FindOrInsert*> unsettled;
    for (size_t k = 0; k < live.size(); ++k) {
      if (live[k]->place(c + k * counter::kNum)) unsettled.push_back(live[k]);
    }
    if (!unsettled.empty()) {
      const at::Tensor placed = read(unsettled);  // sync c
      for (size_t k = 0; k < unsettled.size(); ++k) unsettled[k]->settle(placed.data_ptr<int32_t>() + k * counter::kNum);
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
  UniqueTensors ut(ids, n, counters.data_ptr<int32_t>() + counter::kUniques);
  const Groups groups = group_ids(ids, nullptr, ut, counters.data_ptr<int32_t>() + counter::kGroupSpare, true);
  find_uniques_kernel<<<grid_for(ut.n), kThreads, 0, stream()>>>(t, ut.view(), words(touched));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  r = insert_uniques(t, ut, groups, counters, words(touched), allow_evict);
  if (r.failed > 0) {
    slots.fill_(kPaddingSlot);
    return result(slots, r, keys);
  }
  const Uniques u = ut.view();
  const int64_t D = weights.size(1), S = opt_state.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "insert_or_assign_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int rows = rows_per_warp(u.n);
    assign_rows_kernel<scalar_t><<<row_warp_grid(u.n, rows), kThreads, 0, stream()>>>(
        u, rows, groups.last_pos.data_ptr<int32_t>(), groups.occurrences.data_ptr<int32_t>(), weights.data_ptr<scalar_t>(),
        values.data_ptr<scalar_t>(), D, opt_state.data_ptr<acc_t>(),
        opt_values.defined() ? opt_values.data_ptr<acc_t>() : nullptr, S, t.scores,
        score_values.defined() ? score_values.data_ptr<int64_t>() : nullptr, score_policy, score_value);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  map_slots_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
      nullptr, groups.group.data_ptr<int32_t>(), n, u.slot, slots.data_ptr<int64_t>());
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
  const at::Tensor num = at::zeros({2}, ids.options().dtype(at::kInt));  // U, and group_ids' spare claim
  UniqueTensors ut(ids, n, num.data_ptr<int32_t>());
  const Groups groups = group_ids(ids, nullptr, ut, num.data_ptr<int32_t>() + 1, false);
  const Uniques u = ut.view();
  // Find first (read-only), then clear: a launch boundary between reads and writes.
  find_uniques_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  erase_kernel<<<grid_for(u.n), kThreads, 0, stream()>>>(t, u, groups.first_pos.data_ptr<int32_t>(),
                                                         erased.data_ptr<bool>());
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
  const dim3 block(32, kThreads / 32);  // one warp per row (a review suggested fewer lanes for small dims)
  const unsigned grid = static_cast<unsigned>(ceil_div(n, block.y));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "initialize_cuda", [&] {
    initialize_kernel<scalar_t><<<grid, block, 0, stream()>>>(
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
