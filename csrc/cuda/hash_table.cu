// CUDA kernels of the hash_table family: ids -> slots over tensor table state.
// Semantics: docs/ops.md ("Table layout", "hash_table"); CPU reference csrc/cpu/hash_table.cpp.
//
// Lookups are one thread per id: both buckets' 32-byte digest sectors are loaded as
// 16-byte vectors, matched 4 digests per instruction (__vcmpeq4), and keys are read only
// on a digest match.
//
// Inserting ops (find_or_insert, insert_or_assign) run in phases:
//   1. find every id in parallel (no mutation); find_or_insert flags the misses;
//   2. group the (missing) positions by id through a scratch hash set (group_claim_kernel), so each
//      distinct new id is inserted by exactly one thread; classify the new ids (conflicted
//      or not, and for the others whether they will need to evict or fail);
//   3a. claim: each new id CASes the 32-bit word holding 4 digests to take the lowest
//       empty slot of its emptier bucket (bucket_a on a tie), retrying on contention;
//       ids whose two buckets are full are queued;
//   3b. evict (allow_evict only, a separate launch after 3a): a queued id takes the
//       lowest-score slot of its 64 candidates not touched by this call (a bitmap of
//       found + claimed slots), a group of 8 lanes per id; ownership is an atomicOr on that
//       bitmap;
//   4. if any id found no room: every claimed slot gets its saved key and digest back
//       (nothing else was written yet) and counts = [0, failed]; when the failure is
//       known from phase 2 already (no unsafe conflicted ids, below), nothing is claimed at all;
//   5. on success only: new rows are initialised, scores updated, slots mapped back (queued
//      before the outcome is read back when it is not known at sync b; the kernels then
//      read a failure on the device and write nothing).
// Every device allocation of the op happens before phase 3, so that none can fail after a
// table changed and leave it neither placed nor rolled back.
// Phases 1 and 2 write scratch memory only: the table changes from phase 3 on.
//
// Host syncs (device-to-host reads; each costs tens of microseconds and drains the launch
// queue). Sizes the host cannot know are replaced by upper bounds (the n positions of the
// call), with the exact count read from device memory by the kernels; what remains:
//   b. one copy of the counters after phase 2: U (sizes the per-id launches after it),
//      the new ids (inserted; 0 ends the call), the conflicted ids (choose sequential or
//      racing placement, and size the sequential order) and the classification. Without
//      conflicted ids the outcome (inserted, failed, evicted) is fully known here; so it is
//      when every conflicted id has a bucket with at least as many empty slots as new ids
//      that may take them (none "unsafe", classify_kernel), the usual case far from full.
//      find_or_insert: the caller's bad_input flag rides in the same copy: a set flag ends
//      the call with an error before phase 3 (nothing changed), so a caller that checks
//      its input on the device (DynamicEmbedding's bag layouts) pays no sync of its own.
//      When no table has ids (no sync b), the flag is read alone.
//   c. only with unsafe conflicted ids: one more copy, for failed (rollback or not) and the
//      number of evicted keys. It comes after every launch of the op: phase 5 is queued
//      before it and reads a failure on the device (placement_failed), and the evicted keys
//      are listed into a buffer of an upper bound, so the GPU works while the host waits
//      and nothing is launched after it but a rollback.
// (An earlier version also read the number of missing positions back after phase 1, to
// size a radix sort that grouped them: "sync a".) counts is computed on the host and
// returned as a CPU tensor. Per call: find_or_insert and insert_or_assign 1 sync, or 2 with
// unsafe conflicted ids; erase none.
//
// find_or_insert(_many) with defer: no sync at all (Inserter::place_deferred). Every launch
// after phase 2 covers the positions, every table takes part in every kernel and reads its
// outcome on the device (a call decided to fail claims nothing, one whose racing ids found
// no room rolls back, and a failed call writes -1 to every slot); counts stay on the device.
// No eviction (its keys are listed on the host), and conflicted ids always race. The
// caller decides growth from a bound instead of the count (veloce/table/).
//
// An op over K tables (find_or_insert_many; the single-table ops are K = 1) runs each kernel
// once for all of them: table j is blockIdx.y, its arguments a TableCall (in
// hash_table_device.cuh; one table's is the kernel parameter, several are an array copied to
// the device before the launches of each host stage that changed them), and
// its scratch arrays live in a few allocations shared by the call. About 20 launches per
// op, where one set of launches per table made about 300 for the 26 tables of a DLRM step.
//
// Same placement as the CPU kernel (which inserts in order of first occurrence): a new id
// that shares neither bucket with another new id of the call meets the same buckets in
// any order, so 3a/3b place it exactly as the CPU does. The new ids that do share a
// bucket ("conflicted") are inserted by one thread in order of first occurrence, when
// there are at most kSequentialMax of them (always the case in small batches and in
// large, sparsely filled tables); beyond that they race in 3a/3b too, and only their
// placement (not the found/missing sets, values or counts) may differ from the CPU's;
// near capacity that includes which keys they evict, and whether the call finds room for
// every new id (two-choice placement depends on the order; a failing call changes nothing).

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <cub/device/device_select.cuh>

#include "hash_table_device.cuh"
#include "veloce/cuda_utils.cuh"
#include "veloce/many.h"
#include "veloce/op_checks.h"
#include "veloce/score.h"

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
inline int64_t row_warp_threads(int64_t rows, int r) { return ceil_div(rows, r) * 32; }

// find_or_insert success: initial rows, initial state (init_state, or zeros), starting score
// of the new ids. Each warp
// takes r consecutive distinct ids (rows_per_warp): lane j < r loads id (base + j)'s state and
// slot and hashes its id, then the warp fills the r rows in turn, columns over lanes. Runs
// for the tables whose rows are scalar_t.
template <typename scalar_t, class Calls>
__global__ void init_rows_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageInitRows);
  if (c == nullptr || c->dtype != static_cast<int32_t>(c10::CppTypeToScalarType<scalar_t>::value)) return;
  if (deferred_nothing_new(c) || placement_failed(c)) return;
  const int r = c->rows_per_warp;
  const Uniques u = c->u;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t k = thread_index() / 32 * r + lane;
  int64_t slot = -1;
  uint64_t bits = 0;  // the row's init bits: each lane hashes its own id once
  if (lane < r && u.has(k)) {
    const int8_t st = u.state[k];
    if (st == kClaimed || st == kEvicted) {
      slot = u.slot[k];
      bits = init_row_bits(c->seed, u.id[k]);
    }
  }
  if (__ballot_sync(kFullWarp, slot >= 0) == 0) return;  // the whole warp
  const int64_t start = score::dispatch(c->score_policy, [&](auto p) { return decltype(p)::on_insert(call_score(c)); });
  using acc_t = at::opmath_type<scalar_t>;
  scalar_t* const weights = static_cast<scalar_t*>(c->weights);
  acc_t* const state = static_cast<acc_t*>(c->state);
  const acc_t* const init = static_cast<const acc_t*>(c->init_state);
  const int64_t D = c->D, S = c->S;
  const int64_t kind = c->init_kind;
  const double a = c->init_a, b = c->init_b;
  for (int j = 0; j < r; ++j) {
    const int64_t s = __shfl_sync(kFullWarp, slot, j);
    if (s < 0) continue;
    scalar_t* const row = weights + s * D;
    init_columns(__shfl_sync(kFullWarp, bits, j), D, kind, a, b, lane, 32,
                 [&](int64_t col, double v) { row[col] = to_weight<scalar_t>(v); });
    for (int64_t col = lane; col < S; col += 32) state[s * S + col] = init != nullptr ? init[col] : acc_t(0);
    if (lane == 0) c->t.scores[s] = start;  // the policy's on_insert
  }
}

// insert_or_assign success: the last occurrence of each distinct id writes its row,
// state and score (last_pos, occurrences: from the grouping). Each warp takes r distinct
// ids, as init_rows_kernel: lane j < r loads id (base + j)'s bookkeeping and sets its
// score, then the warp copies the r rows in turn.
template <typename scalar_t, class Calls>
__global__ void assign_rows_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageAssignRows);
  if (c == nullptr || c->dtype != static_cast<int32_t>(c10::CppTypeToScalarType<scalar_t>::value)) return;
  if (placement_failed(c)) return;
  using acc_t = at::opmath_type<scalar_t>;
  const int r = c->rows_per_warp;
  const Uniques u = c->u;
  int64_t* const scores = c->t.scores;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t k = thread_index() / 32 * r + lane;
  int64_t slot = -1, last = 0;
  bool fresh = false;
  if (lane < r && u.has(k)) {
    slot = u.slot[k];
    const int8_t st = u.state[k];
    fresh = st == kClaimed || st == kEvicted;
    last = c->last_pos[k];
    int64_t sc;
    if (c->score_values != nullptr) {
      sc = c->score_values[last];
    } else {  // one thread per distinct id: its positions' count at once
      sc = score::dispatch(c->score_policy, [&](auto p) {
        using P = decltype(p);
        return P::on_hit(fresh ? P::on_insert(c->score_value) : scores[slot], c->score_value, c->occurrences[k]);
      });
    }
    scores[slot] = sc;
  }
  const unsigned rows = __ballot_sync(kFullWarp, slot >= 0);
  if (rows == 0) return;  // the whole warp
  const unsigned fresh_rows = __ballot_sync(kFullWarp, fresh);
  scalar_t* const weights = static_cast<scalar_t*>(c->weights);
  const scalar_t* const values = static_cast<const scalar_t*>(c->values);
  acc_t* const state = static_cast<acc_t*>(c->state);
  const acc_t* const opt_values = static_cast<const acc_t*>(c->opt_values);
  const acc_t* const init = static_cast<const acc_t*>(c->init_state);
  const int64_t D = c->D, S = c->S;
  for (int j = 0; j < r; ++j) {
    if (!((rows >> j) & 1u)) continue;
    const int64_t s = __shfl_sync(kFullWarp, slot, j);
    const int64_t src = __shfl_sync(kFullWarp, last, j);
    for (int64_t col = lane; col < D; col += 32) weights[s * D + col] = values[src * D + col];
    if (opt_values != nullptr) {
      for (int64_t col = lane; col < S; col += 32) state[s * S + col] = opt_values[src * S + col];
    } else if ((fresh_rows >> j) & 1u) {
      for (int64_t col = lane; col < S; col += 32) state[s * S + col] = init != nullptr ? init[col] : acc_t(0);
    }
  }
}

// slots[i] = slot of position i's distinct id, for every grouped position (active[i], or
// all when active is null). A deferred call that failed sets every slot to -1 (as the host
// does after a read that found a failure).
template <class Calls>
__global__ void map_slots_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageMapSlots);
  const int64_t i = thread_index();
  if (c == nullptr || i >= c->n) return;
  if (placement_failed(c)) {
    if (c->deferred) c->slots[i] = kPaddingSlot;
    return;
  }
  if (!deferred_nothing_new(c) && grouped(c, i)) c->slots[i] = c->u.slot[c->group[i]];  // none is grouped then
}

// A deferred call's counts, once its kernels ran, per table j: out[j * width ...] =
// [inserted, failed] (width 2) or [inserted, failed, evicted = 0] (width 3), from the
// table's counters (K of them, then the caller's flag). Refused for the flag: [0, -1].
// No room: [0, the ids known to find none]: the unconflicted ones with both buckets full
// (the call then claimed nothing), or else the racing conflicted ids that found both full.
__global__ void deferred_counts_kernel(const int32_t* counters, int64_t K, int width, int64_t* out) {
  const int64_t j = thread_index();
  if (j >= K) return;
  const int32_t* c = counters + j * counter::kNum;
  const bool refused = counters[K * counter::kNum] != 0;
  const int64_t no_room = c[counter::kFull] > 0 ? c[counter::kFull] : c[counter::kQueued] + c[counter::kFailed];
  int64_t* const o = out + j * width;
  o[0] = refused || no_room > 0 ? 0 : c[counter::kNew];
  o[1] = refused ? -1 : no_room;
  if (width == 3) o[2] = 0;
}

// Scores position i's slot s under policy P (veloce/score.h's kCombine): a kStamp policy
// stores its value, a kAdd policy adds its step atomically.
template <class P>
__device__ __forceinline__ void score_position(const TableCall* c, int64_t s) {
  int64_t* const scores = c->t.scores;
  const int64_t value = P::on_hit(0, call_score(c), 1);
  if constexpr (P::kCombine == score::Combine::kStamp) {
    // A hot id repeats thousands of times in a batch: its later positions find the score
    // set (in L1 or L2) and skip the store instead of queueing on one address.
    if (scores[s] != value) scores[s] = value;
  } else if constexpr (P::kCombine == score::Combine::kAdd) {
    atomicAdd(reinterpret_cast<unsigned long long*>(scores + s), static_cast<unsigned long long>(value));
  }
}

// Per non-padding position: its slot's score, by the table's policy. score_skip: positions
// to leave out (null for none): a kStamp policy skips the new ids, whose rows started at
// the value it stores.
template <class Calls>
__global__ void score_positions_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageScore);
  const int64_t i = thread_index();
  if (c == nullptr || i >= c->n || (c->score_skip != nullptr && c->score_skip[i]) || placement_failed(c)) return;
  const int64_t s = c->slots[i];
  if (s < 0) return;
  score::dispatch(c->score_policy, [&](auto p) { score_position<decltype(p)>(c, s); });
}

template <class Calls>
__global__ void erase_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageErase);
  const int64_t k = thread_index();
  if (c == nullptr || !c->u.has(k)) return;
  const int64_t s = c->u.slot[k];
  if (s < 0) return;
  c->t.digests[s] = kEmptyDigest;
  c->erased[c->first_pos[k]] = true;
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
// radix sort of 64-bit ids took 8 passes and about 20 launches; this takes 2 launches and no
// size from the host, so it runs over all n positions with an `active` flag each.
//
// Every int64 is a valid id, so the scratch set's empty marker kGroupEmpty is one too: that
// id takes the spare scratch slot past the set (claimed by a flag), never the set itself.
constexpr int64_t kGroupEmpty = std::numeric_limits<int64_t>::min();

// An inserting op's scratch, made ready in one launch: the zeroed arrays (counters, bucket
// use, the eviction's touched bits) cleared, 16 bytes a thread, and the scratch set's keys
// set to kGroupEmpty. find_or_insert's bad_input flag (when given) is copied into the int32
// at `flag_at` of the zeroed arrays, after its word is cleared (by the same thread), so that
// it rides in sync b's copy of the counters without a launch of its own.
__global__ void init_scratch_kernel(uint4* zero, int64_t zero_words, int64_t* keys, int64_t num_keys,
                                    const bool* flag, int64_t flag_at) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = thread_index(); i < zero_words || i < num_keys; i += stride) {
    if (i < zero_words) {
      zero[i] = make_uint4(0, 0, 0, 0);
      if (flag != nullptr && i == flag_at / 4) reinterpret_cast<int32_t*>(zero)[flag_at] = *flag ? 1 : 0;
    }
    if (i < num_keys) keys[i] = kGroupEmpty;
  }
}

// Claims each active position's id a scratch slot; the winner numbers the id (counter
// kUniques), writes it and starts its slot, state, first/last position and count.
// where[i] = the position's scratch slot.
template <class Calls>
__global__ void group_claim_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageGroup);
  if (c == nullptr) return;
  const int64_t i = thread_index();
  const bool on = grouped(c, i);
  const GroupScratch g = c->g;
  int64_t h = 0, id = 0;
  bool won = false;
  if (on) {
    id = c->ids[i];
    if (id == kGroupEmpty) {
      h = g.mask + 1;
      int32_t* const spare = c->ctr + counter::kGroupSpare;
      // A plain read first: a hot id's later positions find it claimed without an atomic.
      won = __ldcg(spare) == 0 && atomicExch(spare, 1) == 0;
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
    c->where[i] = h;
  }
  const int32_t k = block_reserve(won, c->ctr + counter::kUniques);
  if (!won) return;
  const Uniques u = c->u;
  g.index[h] = k;
  const_cast<int64_t*>(u.id)[k] = id;
  u.slot[k] = -1;
  u.state[k] = kPresent;
  c->first_pos[k] = std::numeric_limits<int32_t>::max();
  if (c->last_pos != nullptr) {
    c->last_pos[k] = -1;
    c->occurrences[k] = 0;
  }
}

// Per active position: its distinct id's number (group), and that id's first position (and
// last position and count, when asked for). Lanes of a warp that share an id combine first,
// so a hot id costs one atomic per warp, not per position.
template <class Calls>
__global__ void group_assign_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageGroup);
  if (c == nullptr) return;
  const int64_t i = thread_index();
  const bool on = grouped(c, i);
  const unsigned lanes = __ballot_sync(kFullWarp, on);
  if (!on) return;
  const int32_t k = c->g.index[c->where[i]];
  c->group[i] = k;
  const unsigned same = __match_any_sync(lanes, k);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int lowest = __ffs(same) - 1, highest = 31 - __clz(same);
  // Positions grow with the lane: the lowest lane of the group holds its first position.
  if (lane == lowest) {
    atomicMin(c->first_pos + k, static_cast<int32_t>(i));
    if (c->occurrences != nullptr) atomicAdd(c->occurrences + k, __popc(same));
  }
  if (c->last_pos != nullptr && lane == highest) atomicMax(c->last_pos + k, static_cast<int32_t>(i));
}

// ---- host side ---------------------------------------------------------------------------

// A TableCalls::launch callable for `kernel` (a kernel template over its Calls parameter).
#define VELOCE_OVER_TABLES(kernel) \
  [](auto calls, dim3 grid, int block) { kernel<<<grid, block, 0, stream()>>>(calls); }

// Bytes of a TableCall array carried by one put_bytes_kernel launch: its parameter, within
// the 4 KB that every CUDA version takes.
constexpr int64_t kPutBytes = 3840;
struct PutBytes {
  uint8_t bytes[kPutBytes];
};

// dst[0, n) = the launch's own bytes (a kernel parameter, kept by a CUDA graph's node).
__global__ void put_bytes_kernel(const __grid_constant__ PutBytes src, int64_t n, uint8_t* __restrict__ dst) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src.bytes[i];
}

// The TableCalls of one op call, on the host and (copied before each launch that follows a
// change) on the device.
class TableCalls {
 public:
  // An op's host stages change the calls at most this often (Inserter: prepare, the
  // conflicted ids' ordering, placement, finish, the evicted keys' ordering, a rollback).
  static constexpr int64_t kMaxUploads = 8;

  // Several tables: the memory of every copy to the device is taken now, before any table
  // is written, so that a later stage (a rollback, the new rows) cannot fail to allocate
  // after the tables have changed.
  TableCalls(int64_t K, const at::Tensor& like) : calls_(static_cast<size_t>(K)) {
    TORCH_CHECK_VALUE(K <= 65535, "an inserting op takes at most 65535 tables at once, got ", K);
    if (K > 1) {
      const int64_t bytes = kMaxUploads * K * static_cast<int64_t>(sizeof(TableCall));
      if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {  // see device()
        host_ = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      }
      dev_ = at::empty({bytes}, like.options().dtype(at::kByte));
    }
  }
  int64_t size() const { return static_cast<int64_t>(calls_.size()); }
  const TableCall& operator[](int64_t j) const { return calls_[static_cast<size_t>(j)]; }
  TableCall& edit(int64_t j) {  // the device copy is refreshed before the next launch
    dirty_ = true;
    return calls_[static_cast<size_t>(j)];
  }

  // launch(calls, grid, block) of a kernel (VELOCE_OVER_TABLES) over the tables in
  // `stage`: grid (x, K), x covering the largest threads(j) of them; no launch when none
  // takes part. One table: its TableCall is the kernel parameter; several: an array on the
  // device, copied there when it changed since the last launch.
  template <typename Launch, typename Threads>
  void launch(Launch go, uint32_t stage, Threads threads, int block = kThreads) {
    int64_t most = 0;
    for (int64_t j = 0; j < size(); ++j) {
      if (calls_[static_cast<size_t>(j)].stages & stage) most = std::max<int64_t>(most, threads(j));
    }
    if (most == 0) return;
    const dim3 grid(grid_for(most, block), static_cast<unsigned>(size()));
    if (size() == 1) {
      go(OneCall{calls_[0]}, grid, block);
    } else {
      go(DeviceCalls{device()}, grid, block);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

 private:
  // One copy of the array from pinned memory, queued on the current stream (no host wait),
  // into the next of the kMaxUploads regions taken at construction: the launches queued on
  // earlier copies still read theirs. The caching host allocator keeps the pinned block
  // until the copies have run. While the stream is captured into a CUDA graph, a replay
  // would copy from that pinned block long after it went back to the allocator: the array
  // then travels in the parameters of put_bytes_kernel launches instead, which the graph
  // keeps.
  const TableCall* device() {
    const int64_t bytes = size() * static_cast<int64_t>(sizeof(TableCall));
    if (dirty_) {
      TORCH_INTERNAL_ASSERT(uploads_ < kMaxUploads, "an inserting op changed its TableCalls too often");
      const int64_t off = uploads_++ * bytes;
      const auto* src = reinterpret_cast<const uint8_t*>(calls_.data());
      if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
        uint8_t* const dst = dev_.data_ptr<uint8_t>() + off;
        for (int64_t at = 0; at < bytes; at += kPutBytes) {
          PutBytes chunk;
          const int64_t n = std::min(kPutBytes, bytes - at);
          std::memcpy(chunk.bytes, src + at, static_cast<size_t>(n));
          put_bytes_kernel<<<1, kThreads, 0, stream()>>>(chunk, n, dst + at);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        current_ = reinterpret_cast<const TableCall*>(dst);
        dirty_ = false;
        return current_;
      }
      std::memcpy(host_.data_ptr<uint8_t>() + off, src, static_cast<size_t>(bytes));
      dev_.narrow(0, off, bytes).copy_(host_.narrow(0, off, bytes), /*non_blocking=*/true);
      current_ = reinterpret_cast<const TableCall*>(dev_.data_ptr<uint8_t>() + off);
      dirty_ = false;
    }
    return current_;
  }

  std::vector<TableCall> calls_;
  at::Tensor host_, dev_;  // pinned and device memory for kMaxUploads copies (several tables)
  const TableCall* current_ = nullptr;
  int64_t uploads_ = 0;
  bool dirty_ = true;
};

// Scratch-set slots for n grouped positions: a power of two >= 2n (load <= 1/2).
int64_t group_capacity(int64_t n) {
  int64_t cap = 64;
  while (cap < 2 * n) cap *= 2;
  return cap;
}

// What an inserting op asks of each table.
enum class Mode { kFindOrInsert, kAssign, kErase };

// One table's arguments and outcome; `slots` (N,) int64 is written (a view into the op's
// output for find_or_insert_many).
struct InsertTable {
  InsertTable(at::Tensor keys, at::Tensor digests, at::Tensor scores, at::Tensor weights, at::Tensor opt_state,
              at::Tensor ids)
      : keys(std::move(keys)),
        digests(std::move(digests)),
        scores(std::move(scores)),
        weights(std::move(weights)),
        opt_state(std::move(opt_state)),
        ids(std::move(ids)) {}

  at::Tensor keys, digests, scores, weights, opt_state, ids;  // ids contiguous; erase: no scores, rows or state
  int64_t score_policy = 0, score_value = 0;  // score_policy: an id of veloce/score.h
  const int64_t* clock = nullptr;  // find_or_insert's clock (device memory): replaces score_value
  bool allow_evict = false;
  int64_t room = kNoRoomLimit;      // new ids that may take an empty slot
  int64_t seed = 0, init_kind = 0;  // find_or_insert's initializer
  double init_a = 0, init_b = 0;
  std::optional<int64_t> padding_id;
  at::Tensor values, opt_values, score_values;  // insert_or_assign
  at::Tensor init_state;  // (S,) contiguous, the state of new rows; undefined: zeros
  at::Tensor admit;       // find_or_insert's (n,) admit, contiguous; undefined: every id admitted
  at::Tensor slots, erased;
  // outcome
  int64_t inserted = 0, failed = 0;
  at::Tensor evicted;
  // host bookkeeping between stages
  int64_t uniques = 0, conflicted = 0, full = 0;
  int64_t max_queued = 0;  // ids claim_kernel may queue for evict_kernel
  bool settle = false;
};

// Runs an inserting op over tables (stages at the top of this file), each kernel once for
// all of them. Syncs b and c happen once per op however many tables it inserts into (c
// only when some table has unsafe conflicted ids). find_or_insert: bad_input is read with sync b,
// or alone when no table has ids; when set, `op` raises before any table changes (phases
// 1-2 write scratch memory only).
class Inserter {
 public:
  Inserter(const char* op, Mode mode, std::vector<InsertTable>& tables)
      : op_(op), mode_(mode), tabs_(tables), calls_(static_cast<int64_t>(tables.size()), tables[0].keys) {}

  // find_or_insert(_many) with defer: run() reads nothing back and writes each table's
  // counts into `counts` ((K, width) int64 on the device; place_deferred). No table may evict.
  void defer_into(const at::Tensor& counts) { deferred_counts_ = counts; }

  // Every table's evicted keys, table after table (a view of the list; undefined when none
  // was evicted).
  const at::Tensor& all_evicted() const { return all_evicted_; }

  void run(const std::optional<at::Tensor>& bad_input) {
    prepare(bad_input ? bad_input->data_ptr<bool>() : nullptr);
    if (mode_ == Mode::kFindOrInsert) calls_.launch(VELOCE_OVER_TABLES(probe_kernel), kStageProbe, positions());
    calls_.launch(VELOCE_OVER_TABLES(group_claim_kernel), kStageGroup, positions());
    calls_.launch(VELOCE_OVER_TABLES(group_assign_kernel), kStageGroup, positions());
    // The scratch sets and `where` are done with: their memory goes back now (reused in
    // stream order), not at the op's end, to keep the placement's peak memory down.
    grouping_ = Arena();
    if (mode_ != Mode::kFindOrInsert) {
      calls_.launch(VELOCE_OVER_TABLES(find_uniques_kernel), kStageFindUniques, positions());
    }
    if (mode_ == Mode::kErase) {  // U stays on the device: every launch covers the n grouped positions
      calls_.launch(VELOCE_OVER_TABLES(erase_kernel), kStageErase, positions());
      return;
    }
    calls_.launch(VELOCE_OVER_TABLES(bucket_use_kernel), kStageClassify, positions());
    calls_.launch(VELOCE_OVER_TABLES(classify_kernel), kStageClassify, positions());
    if (deferred_counts_.defined()) {
      place_deferred();
      return;
    }
    const bool live = std::any_of(tabs_.begin(), tabs_.end(), [](const InsertTable& t) { return t.ids.numel() > 0; });
    if (!live) {
      if (bad_input) check_bad_input_unset(op_, bad_input->item<bool>());  // no sync b to ride on: read alone
      return;
    }
    // The evicted keys' list takes its memory now, while the GPU classifies: after sync b
    // the GPU waits for the host until claim_kernel is launched.
    reserve_evicted();
    const int64_t K = calls_.size();
    const int32_t* counted = read_counters(0);  // sync b (bad_input's flag too: init_scratch_kernel)
    if (bad_input) check_bad_input_unset(op_, counted[K * counter::kNum] != 0);
    place(counted);
    // Phase 5 and the evicted keys are queued before sync c, not after it: the GPU runs them
    // while the host waits, and the op ends at sync c (the host's launches after it left the
    // GPU idle for about 100 us of a 0.9 ms call at load 1.0). A settling table's phase-5
    // kernels read its failure on the device and write nothing then (placement_failed).
    finish();
    const at::Tensor evicted_keys = list_evicted();
    const bool settling = std::any_of(tabs_.begin(), tabs_.end(), [](const InsertTable& t) { return t.settle; });
    const int32_t* placed = nullptr;
    if (settling) {
      placed = read_counters(1);  // sync c
      settle(placed);
    }
    take_evicted(evicted_keys, placed);
  }

 private:
  // Threads per table: its positions, or its distinct ids (known after sync b).
  struct Positions {
    const TableCalls* calls;
    int64_t operator()(int64_t j) const { return (*calls)[j].n; }
  };
  struct Distinct {
    const std::vector<InsertTable>* tabs;
    int64_t operator()(int64_t j) const { return (*tabs)[static_cast<size_t>(j)].uniques; }
  };
  Positions positions() const { return {&calls_}; }
  Distinct uniques() const { return {&tabs_}; }

  // Every table's counters (and bad_input's flag), copied into half `half` of counted_ once
  // the GPU is done with the op's work so far: a sync. A copy into pinned memory, not a
  // dispatched one (Tensor::cpu() costs several ops and a copy through pageable memory).
  const int32_t* read_counters(int64_t half) {
    const int64_t n = calls_.size() * counter::kNum + 1;
    if (!counted_.defined()) counted_ = at::empty({2 * n}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
    int32_t* const host = counted_.data_ptr<int32_t>() + half * n;
    // c10's copy-and-wait, as Tensor::cpu() ends in: CUDA's sync debug mode reports it.
    c10::cuda::memcpy_and_sync(host, counters_, n * static_cast<int64_t>(sizeof(int32_t)), cudaMemcpyDeviceToHost,
                               stream());
    return host;
  }

  // Scratch for every table in two allocations (one for the whole op, one for grouping
  // alone), and each table's TableCall. bad_input: find_or_insert's flag on the device, or null.
  void prepare(const bool* bad_input) {
    const int64_t K = calls_.size();
    const bool with_last = mode_ == Mode::kAssign;
    Arena plain, zeroed, grouping;
    struct Offsets {
      int64_t active, where, group, id, slot, old_key, state, old_digest, first, last, occ, conflicted, overflow,
          overflow_key, index, use, touched, keys;
    };
    std::vector<Offsets> off(static_cast<size_t>(K));
    const int64_t counters_off = zeroed.add<int32_t>(K * counter::kNum + 1);  // + bad_input's flag
    int64_t key_slots = 0;
    for (int64_t j = 0; j < K; ++j) {
      const InsertTable& t = tabs_[static_cast<size_t>(j)];
      const int64_t n = t.ids.numel();
      Offsets& o = off[static_cast<size_t>(j)];
      o = {};
      if (n == 0) continue;
      const int64_t cap = group_capacity(n);
      const int64_t buckets = t.keys.numel() / kBucketSize;
      if (mode_ == Mode::kFindOrInsert) o.active = plain.add<uint8_t>(n);
      o.where = grouping.add<int64_t>(n);  // a scratch slot may pass 2^31
      o.group = plain.add<int32_t>(n);
      o.id = plain.add<int64_t>(n);
      o.slot = plain.add<int64_t>(n);
      o.old_key = plain.add<int64_t>(n);
      o.state = plain.add<int8_t>(n);
      o.old_digest = plain.add<uint8_t>(n);
      o.first = plain.add<int32_t>(n);
      if (with_last) {
        o.last = plain.add<int32_t>(n);
        o.occ = plain.add<int32_t>(n);
      }
      o.index = grouping.add<int32_t>(cap + 1);
      if (mode_ != Mode::kErase) {
        o.conflicted = plain.add<uint8_t>(n);
        o.overflow = plain.add<int32_t>(n);
        o.overflow_key = plain.add<int64_t>(n);
        o.use = zeroed.add<int32_t>(buckets);
        if (t.allow_evict) o.touched = zeroed.add<int32_t>(buckets);  // one word per bucket
      }
      o.keys = key_slots;
      key_slots += cap;
    }
    // The evicted keys' list's scratch (list_evicted, for every table that may evict): its
    // flags among the zeroed arrays, the flagged values and CUB's storage among the plain
    // ones. Only the list itself, which the op returns, is allocated apart (reserve_evicted).
    int64_t evict_positions = 0;
    if (mode_ != Mode::kErase) {
      for (int64_t j = 0; j < K; ++j) {
        const InsertTable& t = tabs_[static_cast<size_t>(j)];
        if (t.allow_evict) evict_positions += t.ids.numel();
      }
    }
    if (evict_positions > 0) {
      size_t select_bytes = 0;
      C10_CUDA_CHECK(cub::DeviceSelect::Flagged(nullptr, select_bytes, static_cast<int64_t*>(nullptr),
                                                static_cast<uint8_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                                static_cast<int64_t*>(nullptr), evict_positions, stream()));
      evict_scratch_ = {evict_positions, zeroed.add<uint8_t>(evict_positions), plain.add<int64_t>(evict_positions + 1),
                        plain.add_bytes(static_cast<int64_t>(std::max<size_t>(select_bytes, 1))),
                        static_cast<int64_t>(std::max<size_t>(select_bytes, 1))};
    }
    // Two allocations: what the whole op uses (the zeroed arrays, then the plain ones), and
    // what grouping alone uses (freed after it), the scratch set's keys at its end; one launch
    // clears the zeroed part and fills the keys. Each dispatched op and launch costs the
    // host microseconds before the first kernel that does the op's work.
    const int64_t keys_off = grouping.add<int64_t>(std::max<int64_t>(key_slots, 1));
    const at::TensorOptions bytes = tabs_[0].keys.options().dtype(at::kByte);
    const at::Tensor kept = at::empty({zeroed.bytes() + plain.bytes()}, bytes);
    zeroed.bind(kept, 0);
    plain.bind(kept, zeroed.bytes());
    grouping.allocate(bytes);
    const int64_t zero_words = zeroed.bytes() / 16, most = std::max(zero_words, key_slots);
    init_scratch_kernel<<<grid_for(std::max<int64_t>(most, 1)), kThreads, 0, stream()>>>(
        zeroed.ptr<uint4>(0), zero_words, grouping.ptr<int64_t>(keys_off), key_slots, bad_input,
        counters_off / static_cast<int64_t>(sizeof(int32_t)) + K * counter::kNum);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    zeroed_ = zeroed;
    plain_ = plain;
    grouping_ = grouping;
    counters_ = zeroed.ptr<int32_t>(counters_off);
    for (int64_t j = 0; j < K; ++j) {
      InsertTable& t = tabs_[static_cast<size_t>(j)];
      const Offsets& o = off[static_cast<size_t>(j)];
      TableCall& c = calls_.edit(j);
      c = TableCall{};
      c.n = t.ids.numel();
      c.ctr = zeroed.ptr<int32_t>(counters_off) + j * counter::kNum;
      if (c.n == 0) continue;
      c.t = table_of(t.keys, t.digests, t.scores.defined() ? t.scores.data_ptr<int64_t>() : nullptr);
      c.u = Uniques{plain.ptr<int64_t>(o.id),    plain.ptr<int64_t>(o.slot),      plain.ptr<int8_t>(o.state),
                    plain.ptr<int64_t>(o.old_key), plain.ptr<uint8_t>(o.old_digest), c.ctr + counter::kUniques,
                    c.n};
      c.ids = t.ids.data_ptr<int64_t>();
      c.active = mode_ == Mode::kFindOrInsert ? plain.ptr<uint8_t>(o.active) : nullptr;
      c.slots = t.slots.defined() ? t.slots.data_ptr<int64_t>() : nullptr;
      c.has_pad = t.padding_id.has_value();
      c.pad = t.padding_id.value_or(0);
      c.admit = t.admit.defined() ? t.admit.data_ptr<bool>() : nullptr;
      c.touched = t.allow_evict && mode_ != Mode::kErase ? reinterpret_cast<uint32_t*>(zeroed.ptr<int32_t>(o.touched))
                                                         : nullptr;
      c.g = GroupScratch{grouping.ptr<int64_t>(keys_off) + o.keys, grouping.ptr<int32_t>(o.index),
                         group_capacity(c.n) - 1};
      c.where = grouping.ptr<int64_t>(o.where);
      c.group = plain.ptr<int32_t>(o.group);
      c.first_pos = plain.ptr<int32_t>(o.first);
      c.last_pos = with_last ? plain.ptr<int32_t>(o.last) : nullptr;
      c.occurrences = with_last ? plain.ptr<int32_t>(o.occ) : nullptr;
      c.allow_evict = t.allow_evict;
      c.room = t.room;
      c.score_policy = t.score_policy;
      c.score_value = t.score_value;
      c.clock = t.clock;
      c.erased = t.erased.defined() ? t.erased.data_ptr<bool>() : nullptr;
      if (mode_ == Mode::kFindOrInsert) {
        c.stages = kStageProbe | kStageGroup | kStageClassify;
      } else if (mode_ == Mode::kAssign) {
        c.stages = kStageGroup | kStageFindUniques | kStageClassify;
      } else {
        c.stages = kStageGroup | kStageFindUniques | kStageErase;
      }
      if (mode_ == Mode::kErase) continue;
      c.use = zeroed.ptr<int32_t>(o.use);
      c.conflicted = plain.ptr<uint8_t>(o.conflicted);
      c.overflow = plain.ptr<int32_t>(o.overflow);
      c.overflow_key = plain.ptr<int64_t>(o.overflow_key);
      c.weights = t.weights.data_ptr();
      c.state = t.opt_state.data_ptr();
      c.D = t.weights.size(1);
      c.S = t.opt_state.size(1);
      c.dtype = static_cast<int32_t>(t.weights.scalar_type());
      c.seed = t.seed;
      c.init_kind = t.init_kind;
      c.init_a = t.init_a;
      c.init_b = t.init_b;
      c.init_state = t.init_state.defined() ? t.init_state.data_ptr() : nullptr;
      if (mode_ == Mode::kAssign) {
        c.values = t.values.data_ptr();
        c.opt_values = t.opt_values.defined() ? t.opt_values.data_ptr() : nullptr;
        c.score_values = t.score_values.defined() ? t.score_values.data_ptr<int64_t>() : nullptr;
      }
    }
  }

  // Phases 3a and 3b from the counters read after classify (sync b). A table's outcome is
  // known here when none of its new ids is conflicted; else settle() follows sync c.
  void place(const int32_t* counted) {
    std::vector<int64_t> sequential;
    for (int64_t j = 0; j < calls_.size(); ++j) {
      InsertTable& t = tabs_[static_cast<size_t>(j)];
      if (t.ids.numel() == 0) continue;
      const int32_t* c = counted + j * counter::kNum;
      t.uniques = c[counter::kUniques];
      TableCall& call = calls_.edit(j);
      call.u.n = t.uniques;
      call.stages = 0;
      t.inserted = c[counter::kNew];
      if (t.inserted == 0) continue;
      // More new ids than the room: without eviction the call fails at this sync (nothing written
      // yet), with the CPU kernel's count; with it, a room of 0 makes every new id evict
      // (claim_kernel queues them all), and a larger one places every new id in order
      // (classify_kernel made them all conflicted): the first `room` take empty slots.
      const bool over = t.room != kNoRoomLimit && t.inserted > t.room;
      if (over && !t.allow_evict) {
        t.failed = t.inserted - t.room;
        t.inserted = 0;
        continue;
      }
      const bool in_order = over && t.room > 0;
      t.conflicted = c[counter::kConflicted];
      t.full = c[counter::kFull];
      // Each new id alone in its buckets, or every conflicted one sure of an empty slot:
      // classify_kernel decided every id's fate, and only unconflicted ids can fail or evict.
      const bool decided = !in_order && (t.conflicted == 0 || c[counter::kUnsafe] == 0);
      if (decided) {
        t.failed = t.allow_evict ? c[counter::kDoomed] : t.full;
        if (t.failed > 0) {  // nothing written yet: no rollback
          t.inserted = 0;
          continue;
        }
      }
      // Deterministic mode (torch.use_deterministic_algorithms) always places conflicting ids
      // in order, whatever their number, so placement (and hence eviction) repeats exactly.
      const bool seq = t.conflicted > 0 && (in_order || t.conflicted <= kSequentialMax ||
                                            at::globalContext().deterministicAlgorithms());
      call.stages = kStageClaim;
      call.claim_skip = seq ? call.conflicted : nullptr;
      // claim_kernel queues exactly the full unconflicted ids, plus conflicted ones that race
      // and find both buckets full (none when decided): at most that many, the exact number
      // is on the device.
      t.max_queued = t.full + (seq || decided ? 0 : t.conflicted);
      if (t.allow_evict && t.max_queued > 0) call.stages |= kStageEvict;
      if (seq) {
        call.stages |= kStageSequential;
        sequential.push_back(j);
      }
      t.settle = !decided;  // how the conflicted ids fared is known on the device only
      // Ids that may evict: with the outcome decided, exactly the full ones; else at most
      // every new id (each evicts once at most), the exact number known after sync c.
      if (t.allow_evict && (t.settle || t.full > 0)) evicting_.push_back(j);
    }
    if (!sequential.empty()) {
      auto conflicted = [&](int64_t j) { return tabs_[static_cast<size_t>(j)].conflicted; };
      launch_order(reserve_order(sequential, conflicted), sequential, /*select=*/0, conflicted);
    }
    calls_.launch(VELOCE_OVER_TABLES(claim_kernel), kStageClaim, uniques());
    calls_.launch(VELOCE_OVER_TABLES(evict_kernel), kStageEvict,  // kEvictLanes lanes per queued id
                  [this](int64_t j) { return tabs_[static_cast<size_t>(j)].max_queued * kEvictLanes; });
    calls_.launch(VELOCE_OVER_TABLES(sequential_insert_kernel), kStageSequential,
                  [](int64_t) { return int64_t{1}; }, 32);
  }

  // The memory of the evicted keys' list (list_evicted), for every table that may evict:
  // at most one key per position. Taken before sync b, while the GPU still groups and
  // classifies (taken after it, it kept the GPU idle for tens of microseconds at load 1.0),
  // and before any table changes. Of these tables, those that do evict are known at sync b:
  // launch_order then lists them, in the same order, so their flags come first and the rest
  // stay zero (the positions are an upper bound).
  void reserve_evicted() {
    const EvictScratch& e = evict_scratch_;
    if (e.positions == 0) return;
    // The flags, values and CUB's storage were laid out by prepare (the flags zeroed by
    // init_scratch_kernel); the list, which the op returns, is its own allocation, at most
    // one key per position (the first table's at offset 0, as the op's fake kernel makes them).
    const at::TensorOptions opts = tabs_[0].keys.options();
    evicted_list_.flags = zeroed_.view(e.flags, e.positions, at::kByte);
    evicted_list_.buf = plain_.view(e.buf, e.positions + 1, at::kLong);
    evicted_list_.temp = plain_.view(e.temp, e.temp_bytes, at::kByte);
    evicted_list_.list = at::empty({e.positions}, opts);
  }

  // Phases 3 to 5 of a deferred call, with no host read: what sync b would tell is on the
  // device only, so every launch covers the positions (an upper bound of the distinct ids,
  // whose kernels read U where it was counted) and every table takes part in every kernel,
  // each reading its outcome on the device. Conflicted new ids race (claim_skip null; an
  // order of first occurrence needs their count on the host). A call decided to fail
  // (refused, or an unconflicted id with both buckets full) claims nothing; one whose racing
  // ids found no room rolls its claims back (rollback_kernel, gated); either way its
  // phase-5 kernels write nothing and every slot becomes -1 (map_slots_kernel). Then
  // deferred_counts_kernel writes the counts.
  void place_deferred() {
    const int64_t K = calls_.size();
    std::vector<at::ScalarType> dtypes;
    for (int64_t j = 0; j < K; ++j) {
      InsertTable& t = tabs_[static_cast<size_t>(j)];
      TableCall& call = calls_.edit(j);
      call.stages = 0;
      if (t.ids.numel() == 0) continue;
      TORCH_INTERNAL_ASSERT(!t.allow_evict, "a deferred insert may not evict");
      t.uniques = t.ids.numel();  // the bound every per-id launch covers (call.u.n stays n)
      call.deferred = 1;
      call.gate = 1;
      call.refused = counters_ + K * counter::kNum;
      call.claim_skip = nullptr;
      call.stages = kStageClaim | kStageRollback | kStageInitRows | kStageMapSlots;
      score_positions(t, call);
      take_rows(t, call, dtypes);
    }
    calls_.launch(VELOCE_OVER_TABLES(claim_kernel), kStageClaim, uniques());
    calls_.launch(VELOCE_OVER_TABLES(rollback_kernel), kStageRollback, uniques());
    launch_rows_and_slots(dtypes);
    deferred_counts_kernel<<<grid_for(K), kThreads, 0, stream()>>>(
        counters_, K, static_cast<int>(deferred_counts_.size(-1)), deferred_counts_.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // Phase 4 (rollback on failure) from the counters read after every launch (sync c):
  // a settling table that failed gets its claimed slots back (its phase-5 kernels wrote
  // nothing) and slots of -1.
  void settle(const int32_t* placed) {
    std::vector<int64_t> failed;
    for (int64_t j = 0; j < calls_.size(); ++j) {
      InsertTable& t = tabs_[static_cast<size_t>(j)];
      TableCall& call = calls_.edit(j);
      call.stages = 0;
      if (!t.settle) continue;
      const int32_t* p = placed + j * counter::kNum;
      // Without eviction every queued id failed; sequential failures are in kFailed either
      // way (placement_failed reads the same on the device).
      t.failed = p[counter::kFailed] + (t.allow_evict ? 0 : p[counter::kQueued]);
      if (t.failed > 0) {
        call.stages = kStageRollback;
        t.inserted = 0;
        failed.push_back(j);
      }
    }
    calls_.launch(VELOCE_OVER_TABLES(rollback_kernel), kStageRollback, uniques());
    for (int64_t j : failed) tabs_[static_cast<size_t>(j)].slots.fill_(kPaddingSlot);
  }

  // Phase 5: new (or assigned) rows, then every grouped position's slot, then the scores
  // of the positions (find_or_insert). Queued before sync c: a settling table's kernels
  // read its failure on the device (gate) and write nothing then.
  void finish() {
    std::vector<at::ScalarType> dtypes;
    for (int64_t j = 0; j < calls_.size(); ++j) {
      InsertTable& t = tabs_[static_cast<size_t>(j)];
      TableCall& call = calls_.edit(j);
      call.stages = 0;
      if (t.ids.numel() == 0) continue;
      if (t.failed > 0) {  // decided at sync b: nothing was placed
        t.slots.fill_(kPaddingSlot);
        continue;
      }
      call.gate = t.settle;
      if (mode_ == Mode::kAssign) {
        call.stages = kStageAssignRows | kStageMapSlots;
      } else {
        if (t.inserted > 0) call.stages = kStageInitRows | kStageMapSlots;
        score_positions(t, call);
      }
      take_rows(t, call, dtypes);
    }
    launch_rows_and_slots(dtypes);
  }

  // find_or_insert's phase 5: the positions' scores (every missing position is a new row,
  // or, with none inserted, none is missing; new rows start at the policy's on_insert,
  // which under a kStamp policy is the positions' score too).
  static void score_positions(const InsertTable& t, TableCall& call) {
    const score::Combine combine = score::dispatch(t.score_policy, [](auto p) { return decltype(p)::kCombine; });
    if (combine != score::Combine::kKeep) call.stages |= kStageScore;
    call.score_skip = combine == score::Combine::kStamp ? call.active : nullptr;
  }

  // Phase 5's row kernels for table t: its rows per warp, and its dtype among `dtypes`.
  static void take_rows(const InsertTable& t, TableCall& call, std::vector<at::ScalarType>& dtypes) {
    call.rows_per_warp = rows_per_warp(t.uniques);
    if (std::find(dtypes.begin(), dtypes.end(), t.weights.scalar_type()) == dtypes.end()) {
      dtypes.push_back(t.weights.scalar_type());
    }
  }

  // Phase 5's launches over the tables whose stages ask for them (rows of each of `dtypes`,
  // then the positions' slots and scores), each sized by the table's distinct ids (`uniques`).
  void launch_rows_and_slots(const std::vector<at::ScalarType>& dtypes) {
    auto rows = [this](int64_t j) {
      return row_warp_threads(tabs_[static_cast<size_t>(j)].uniques, calls_[j].rows_per_warp);
    };
    for (const at::ScalarType dt : dtypes) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "insert_rows_cuda", [&] {
        if (mode_ == Mode::kAssign) {
          calls_.launch(VELOCE_OVER_TABLES(assign_rows_kernel<scalar_t>), kStageAssignRows, rows);
        } else {
          calls_.launch(VELOCE_OVER_TABLES(init_rows_kernel<scalar_t>), kStageInitRows, rows);
        }
      });
    }
    calls_.launch(VELOCE_OVER_TABLES(map_slots_kernel), kStageMapSlots, positions());
    calls_.launch(VELOCE_OVER_TABLES(score_positions_kernel), kStageScore, positions());
  }

  // For each table j of `which`, its count(j) distinct ids that are conflicted (select 0)
  // or evicted (select 1), in order of first occurrence (the CPU kernel's insertion order):
  // each flagged at its first position, in one flag array over the positions of every
  // table of `which`, one table after another; then one select of the flagged values (CUB
  // DeviceSelect::Flagged) lists them all, table after table. The values are the ids'
  // numbers (select 0: sets each table's TableCall order and order_count) or the keys they
  // evicted (select 1). Four launches, where a radix sort of (table, position) keys took
  // about ten and a gather. The memory is taken before any table changes: for select 0 by
  // reserve_order, after sync b; for select 1 by reserve_evicted, from prepare's arenas
  // before sync b. launch_order queues the work and returns the list (sum of count(j) entries).
  struct Ordering {
    at::Tensor flags;  // (positions,) zeroed
    at::Tensor buf;    // (positions + 1,) the flagged values, then the number selected
    at::Tensor list;   // (sum of count(j),)
    at::Tensor temp;   // CUB's temporary storage
  };

  template <typename Count>
  Ordering reserve_order(const std::vector<int64_t>& which, Count count) {
    int64_t total = 0, positions = 0;
    for (int64_t j : which) {
      total += count(j);
      positions += calls_[j].n;
    }
    const at::TensorOptions opts = tabs_[0].keys.options();
    Ordering o;
    o.flags = at::zeros({positions}, opts.dtype(at::kByte));
    o.buf = at::empty({positions + 1}, opts);
    // count(j) is exact here: kConflicted, read back at sync b (the only caller, select 0).
    o.list = at::empty({total}, opts);
    size_t bytes = 0;
    C10_CUDA_CHECK(select_flagged(o, nullptr, bytes));
    o.temp = at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, opts.dtype(at::kByte));
    return o;
  }

  static cudaError_t select_flagged(const Ordering& o, void* temp, size_t& bytes) {
    const int64_t positions = o.flags.numel();
    int64_t* const values = o.buf.data_ptr<int64_t>();
    return cub::DeviceSelect::Flagged(temp, bytes, values, o.flags.data_ptr<uint8_t>(), o.list.data_ptr<int64_t>(),
                                      values + positions, positions, stream());
  }

  template <typename Count>
  at::Tensor launch_order(const Ordering& o, const std::vector<int64_t>& which, int32_t select, Count count) {
    int64_t* const values = o.buf.data_ptr<int64_t>();
    std::vector<uint32_t> saved(static_cast<size_t>(calls_.size()));
    for (int64_t j = 0; j < calls_.size(); ++j) {
      TableCall& c = calls_.edit(j);
      saved[static_cast<size_t>(j)] = c.stages;
      c.stages = 0;
    }
    int64_t base = 0;
    for (int64_t j : which) {
      TableCall& c = calls_.edit(j);
      c.stages = kStageOrder;
      c.select = select;
      c.order_flags = o.flags.data_ptr<uint8_t>() + base;
      c.order_values = values + base;
      base += c.n;
    }
    calls_.launch(VELOCE_OVER_TABLES(order_flags_kernel), kStageOrder, uniques());
    size_t bytes = static_cast<size_t>(o.temp.numel());
    C10_CUDA_CHECK(select_flagged(o, o.temp.data_ptr(), bytes));
    for (int64_t j = 0; j < calls_.size(); ++j) calls_.edit(j).stages = saved[static_cast<size_t>(j)];
    if (select == 0) {
      int64_t start = 0;
      for (int64_t j : which) {
        TableCall& c = calls_.edit(j);
        c.order = o.list.data_ptr<int64_t>() + start;
        c.order_count = count(j);
        start += c.order_count;
      }
    }
    keep_.push_back(o.list);  // the sequential placement reads it
    keep_.push_back(o.temp);
    return o.list;
  }

  // The keys evicted from the tables of evicting_, in insertion order (as the CPU kernel
  // reports them), table after table, in one list of their upper bounds (exact for tables
  // decided at sync b), queued before sync c. Undefined when no table evicts.
  at::Tensor list_evicted() {
    if (evicting_.empty()) return at::Tensor();
    TORCH_INTERNAL_ASSERT(evicted_list_.list.defined(), "an evicting table without the evicted keys' memory");
    return launch_order(evicted_list_, evicting_, /*select=*/1, [&](int64_t j) { return evicted_bound(j); });
  }

  // Each evicting table's part of the list (`placed`: the counters of sync c, or null when
  // no table settled): its count is exact for a decided table, the kEvicted counter for a
  // settling one. A failed table's evictions were rolled back and not listed
  // (order_flags_kernel). The successful tables' keys lie one after another from the list's
  // start: every table's, as find_or_insert_many returns them, are a view of it (no
  // allocation after the tables changed).
  void take_evicted(const at::Tensor& keys, const int32_t* placed) {
    int64_t start = 0;
    for (int64_t j : evicting_) {
      InsertTable& t = tabs_[static_cast<size_t>(j)];
      if (t.failed > 0) continue;
      const int64_t m = t.settle ? placed[j * counter::kNum + counter::kEvicted] : evicted_bound(j);
      if (m > 0) t.evicted = keys.narrow(0, start, m);
      start += m;
    }
    if (start > 0) all_evicted_ = keys.narrow(0, 0, start);
  }

  int64_t evicted_bound(int64_t j) const {
    const InsertTable& t = tabs_[static_cast<size_t>(j)];
    // None doomed (else failed at sync b): every full id evicts.
    return t.settle ? t.inserted : t.full;
  }

  const char* op_;
  Mode mode_;
  std::vector<InsertTable>& tabs_;
  TableCalls calls_;
  Arena zeroed_, plain_, grouping_;  // zeroed_'s buffer holds the plain arrays too (plain_ is a part of it)
  // Where prepare laid out the evicted keys' list's scratch (offsets in zeroed_ and plain_),
  // over the positions of every table that may evict; positions 0: none may.
  struct EvictScratch {
    int64_t positions = 0, flags = 0, buf = 0, temp = 0, temp_bytes = 0;
  };
  EvictScratch evict_scratch_;
  int32_t* counters_ = nullptr;  // (K * kNum + 1,) on the device: every table's counters and bad_input's flag
  at::Tensor counted_;           // (2 * (K * kNum + 1),) pinned: the counters read at syncs b and c (halves)
  std::vector<at::Tensor> keep_;
  std::vector<int64_t> evicting_;  // tables that may evict, in order (list_evicted)
  Ordering evicted_list_;          // its memory (reserve_evicted: before sync b and any change)
  at::Tensor all_evicted_;         // every table's evicted keys (take_evicted)
  at::Tensor deferred_counts_;     // a deferred call's counts (defer_into), else undefined
};

// counts is built on the host from host values and stays there (a CPU tensor), so reading
// it costs no sync.
// After a find_or_insert ran: its refused positions (kRefusedSlot) get the slot C, the
// table's capacity (queued on the stream, no host read).
void refused_to_capacity(const std::vector<InsertTable>& tables) {
  for (const InsertTable& t : tables) {
    if (t.admit.defined()) t.slots.masked_fill_(t.slots == kRefusedSlot, t.keys.numel());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> result(const InsertTable& t) {
  at::Tensor counts = at::tensor(std::vector<int64_t>{t.inserted, t.failed}, at::kLong);
  return {t.slots, counts, t.evicted.defined() ? t.evicted : at::empty({0}, t.keys.options())};
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

// One table of find_or_insert(_many), checked (`op`: the name its errors give).
InsertTable find_or_insert_table(const std::string& op, const at::Tensor& keys, const at::Tensor& digests,
                                 const at::Tensor& scores, const at::Tensor& weights, const at::Tensor& opt_state,
                                 const at::Tensor& ids, int64_t score_policy, int64_t score_value, bool allow_evict,
                                 int64_t seed, int64_t init_kind, double init_a, double init_b,
                                 std::optional<int64_t> padding_id, int64_t room, at::Tensor slots,
                                 const std::optional<at::Tensor>& init_state,
                                 const std::optional<at::Tensor>& admit) {
  InsertTable t(keys, digests, scores, weights, opt_state,
                check_insert_args_cuda(op.c_str(), keys, digests, scores, weights, opt_state, ids, score_policy));
  check_init(op.c_str(), init_kind, init_a, init_b);
  check_init_state(op.c_str(), init_state, opt_state);
  if (init_state) t.init_state = init_state->contiguous();
  check_admit(op.c_str(), admit, ids);
  if (admit) t.admit = admit->contiguous();
  t.score_policy = score_policy;
  t.score_value = score_value;
  t.allow_evict = allow_evict;
  t.room = room;
  t.seed = seed;
  t.init_kind = init_kind;
  t.init_a = init_a;
  t.init_b = init_b;
  t.padding_id = padding_id;
  t.slots = slots.defined() ? slots : at::empty_like(t.ids);
  return t;
}

// defer on CUDA: also not under torch.use_deterministic_algorithms, whose ordered placement
// of conflicting new ids needs their count on the host.
void check_defer_cuda(const char* op, bool defer) {
  TORCH_CHECK_VALUE(!(defer && at::globalContext().deterministicAlgorithms()), op,
                    ": defer=True under torch.use_deterministic_algorithms(True): deterministic placement orders "
                    "the conflicting new ids on the host, which a deferred call never reads back; pass defer=False");
}

// The counts of a deferred call over K tables ((K, width) int64 on keys' device), taken
// before any table changes.
at::Tensor deferred_counts(const at::Tensor& keys, int64_t K, int64_t width) {
  return at::empty({K, width}, keys.options().dtype(at::kLong));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> find_or_insert_cuda(
    at::Tensor& keys, at::Tensor& digests, at::Tensor& scores, at::Tensor& weights, at::Tensor& opt_state,
    const at::Tensor& ids, int64_t score_policy, int64_t score_value, bool allow_evict, int64_t seed,
    int64_t init_kind, double init_a, double init_b, std::optional<int64_t> padding_id,
    const std::optional<at::Tensor>& bad_input, bool defer, const std::optional<at::Tensor>& clock, int64_t room,
    const std::optional<at::Tensor>& init_state, const std::optional<at::Tensor>& admit) {
  constexpr const char* op = "veloce::find_or_insert";
  // First: a CUDA flag beside a CPU table lands here, and its error should name bad_input.
  check_bad_input(op, bad_input, keys);
  std::vector<InsertTable> tables;
  tables.push_back(find_or_insert_table(op, keys, digests, scores, weights, opt_state, ids, score_policy, score_value,
                                        allow_evict, seed, init_kind, init_a, init_b, padding_id, room,
                                        at::Tensor(), init_state, admit));
  check_defer(op, defer, allow_evict);
  check_room(op, room, defer);
  check_clock(op, clock, 1, keys);
  check_defer_cuda(op, defer);
  const at::Tensor clock_values = clock ? clock->contiguous() : at::Tensor();
  if (clock_values.defined()) tables[0].clock = clock_values.data_ptr<int64_t>();
  const c10::cuda::CUDAGuard guard(keys.device());
  Inserter inserter(op, Mode::kFindOrInsert, tables);
  if (defer) {
    const at::Tensor counts = deferred_counts(keys, 1, 2);
    inserter.defer_into(counts);
    inserter.run(bad_input);
    refused_to_capacity(tables);
    return {tables[0].slots, counts.view({2}), at::empty({0}, keys.options())};
  }
  inserter.run(bad_input);
  refused_to_capacity(tables);
  return result(tables[0]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> find_or_insert_many_cuda(
    at::TensorList keys, at::TensorList digests, at::TensorList scores, at::TensorList weights,
    at::TensorList opt_state, at::TensorList ids, at::IntArrayRef score_policy, at::IntArrayRef score_value,
    const c10::List<bool>& allow_evict, at::IntArrayRef seed, at::IntArrayRef init_kind, at::ArrayRef<double> init_a,
    at::ArrayRef<double> init_b, const c10::List<std::optional<int64_t>>& padding_id,
    const std::optional<at::Tensor>& bad_input, bool defer, const std::optional<at::Tensor>& clock,
    at::OptionalIntArrayRef room, const std::optional<c10::List<std::optional<at::Tensor>>>& init_state,
    const std::optional<c10::List<std::optional<at::Tensor>>>& admit) {
  constexpr const char* op = "veloce::find_or_insert_many";
  const int64_t K = check_find_or_insert_many_args(op, keys, digests, scores, weights, opt_state, ids, score_policy,
                                                   score_value, allow_evict, seed, init_kind, init_a, init_b,
                                                   padding_id, bad_input, init_state);
  for (int64_t k = 0; k < K; ++k) check_defer(op, defer, allow_evict.get(k), k);
  check_room_many(op, room, K, defer);
  check_admit_many(op, admit, ids);
  check_defer_cuda(op, defer);
  int64_t total = 0;
  for (const at::Tensor& i : ids) total += i.numel();
  if (K == 0) return many_result(at::empty({0}, at::kLong), {});
  check_clock(op, clock, K, keys[0]);
  const at::Tensor clock_values = clock ? clock->contiguous() : at::Tensor();
  at::Tensor slots = at::empty({total}, keys[0].options());
  std::vector<InsertTable> tables;
  tables.reserve(K);
  for (int64_t k = 0, start = 0; k < K; start += ids[k].numel(), ++k) {  // all checked before anything runs
    tables.push_back(find_or_insert_table(table_op_name(op, k), keys[k], digests[k], scores[k], weights[k],
                                          opt_state[k], ids[k], score_policy[k], score_value[k], allow_evict.get(k),
                                          seed[k], init_kind[k], init_a[k], init_b[k], padding_id.get(k),
                                          room ? (*room)[k] : kNoRoomLimit, slots.narrow(0, start, ids[k].numel()),
                                          init_state ? init_state->get(k) : std::nullopt,
                                          admit ? admit->get(k) : std::nullopt));
    if (clock_values.defined()) tables.back().clock = clock_values.data_ptr<int64_t>() + k;
  }
  const c10::cuda::CUDAGuard guard(keys[0].device());
  Inserter inserter(op, Mode::kFindOrInsert, tables);
  if (defer) {
    const at::Tensor counts = deferred_counts(keys[0], K, 3);
    inserter.defer_into(counts);
    inserter.run(bad_input);
    refused_to_capacity(tables);
    return {slots, counts, at::empty({0}, keys[0].options())};
  }
  inserter.run(bad_input);
  refused_to_capacity(tables);
  std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>> per_table;
  per_table.reserve(K);
  for (const InsertTable& t : tables) per_table.push_back(result(t));
  // The evicted keys are the list's start as they are: a concatenation would allocate after
  // the tables changed (and an allocation failure then would leave them changed unbooked).
  const at::Tensor& evicted = inserter.all_evicted();
  return many_result(slots, per_table, evicted.defined() ? evicted : at::empty({0}, keys[0].options()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> insert_or_assign_cuda(
    at::Tensor& keys, at::Tensor& digests, at::Tensor& scores, at::Tensor& weights, at::Tensor& opt_state,
    const at::Tensor& ids_in, const at::Tensor& values_in, const std::optional<at::Tensor>& opt_values_in,
    const std::optional<at::Tensor>& score_values_in, int64_t score_policy, int64_t score_value, bool allow_evict,
    int64_t room, const std::optional<at::Tensor>& init_state) {
  constexpr const char* op = "veloce::insert_or_assign";
  check_room(op, room, false);
  std::vector<InsertTable> tables;
  InsertTable& t = tables.emplace_back(
      keys, digests, scores, weights, opt_state,
      check_insert_args_cuda(op, keys, digests, scores, weights, opt_state, ids_in, score_policy));
  check_assign_values(op, keys, weights, opt_state, t.ids.numel(), values_in, opt_values_in, score_values_in);
  check_init_state(op, init_state, opt_state);
  if (init_state) t.init_state = init_state->contiguous();
  t.values = values_in.contiguous();
  t.opt_values = opt_values_in ? opt_values_in->contiguous() : at::Tensor();
  t.score_values = score_values_in ? score_values_in->contiguous() : at::Tensor();
  t.score_policy = score_policy;
  t.score_value = score_value;
  t.allow_evict = allow_evict;
  t.room = room;
  const c10::cuda::CUDAGuard guard(keys.device());
  t.slots = at::empty_like(t.ids);
  Inserter(op, Mode::kAssign, tables).run(std::nullopt);
  return result(t);
}

at::Tensor erase_cuda(const at::Tensor& keys, at::Tensor& digests, const at::Tensor& ids_in) {
  constexpr const char* op = "veloce::erase";
  check_find_args(op, keys, digests, ids_in);
  check_cuda_table(op, keys, digests);
  check_num_ids_cuda(op, ids_in.numel());
  const c10::cuda::CUDAGuard guard(keys.device());
  std::vector<InsertTable> tables;
  InsertTable& t = tables.emplace_back(keys, digests, at::Tensor(), at::Tensor(), at::Tensor(), ids_in.contiguous());
  t.erased = at::zeros({t.ids.numel()}, t.ids.options().dtype(at::kBool));
  // Find first (read-only), then clear: a launch boundary between reads and writes.
  Inserter(op, Mode::kErase, tables).run(std::nullopt);
  return t.erased;
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
