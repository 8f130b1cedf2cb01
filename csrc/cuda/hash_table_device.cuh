// Device side of the CUDA hash table (included by hash_table.cu only): the per-call
// types, the lookup kernels and the insert protocol (claim, evict, sequential insert,
// rollback). The phases and their ordering are described at the top of hash_table.cu.
#pragma once

#include <cooperative_groups.h>

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

// Above this many conflicted new ids, they are inserted concurrently (hash_table.cu, top):
// one thread inserts about one id per microsecond (two dependent bucket reads).
constexpr int64_t kSequentialMax = 256;

// Per distinct id of a call (U entries).
enum UniqueState : int8_t { kPresent = 0, kClaimed = 1, kEvicted = 2, kFailed = 3 };

// The arrays have n entries, of which the first U hold the distinct ids. U is counted on
// the device by the grouping pass; until the host reads it, n is an upper bound (the
// number of grouped positions), so every kernel also checks k against *num.
struct Uniques {
  const int64_t* id;    // (n,)
  int64_t* slot;        // (n,) -1 until placed
  int8_t* state;        // (n,) UniqueState
  int64_t* old_key;     // (n,) what the claimed slot held (for rollback / evicted_keys)
  uint8_t* old_digest;  // (n,)
  const int32_t* num;   // U, in device memory
  int64_t n;

  __device__ __forceinline__ bool has(int64_t k) const { return k < n && k < *num; }
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

// Reserves one index per thread of the block whose `take` is set, from *counter, and
// returns it (-1 for the others): one shared-memory atomic per warp and one global atomic
// per block. Many warps adding to one global counter serialize in L2 (the grouping of
// 420k new ids spent about 80 us in one atomic per warp); per block it is a few thousand.
// Every thread of the (1-D, whole-warp) block must call it, none may have returned.
__device__ __forceinline__ int32_t block_reserve(bool take, int32_t* counter) {
  __shared__ int32_t count, base;
  __syncthreads();  // a previous call's readers of base are done
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  const unsigned mask = __ballot_sync(kFullWarp, take);
  const unsigned lane = threadIdx.x % 32;
  int32_t warp_base = 0;
  if (lane == 0 && mask != 0) warp_base = atomicAdd(&count, __popc(mask));
  warp_base = __shfl_sync(kFullWarp, warp_base, 0);
  __syncthreads();
  if (threadIdx.x == 0 && count > 0) base = atomicAdd(counter, count);
  __syncthreads();
  return take ? base + warp_base + __popc(mask & ((1u << lane) - 1u)) : -1;
}

__device__ __forceinline__ void mark_touched(uint32_t* touched, int64_t slot) {
  atomicOr(touched + slot / kBucketSize, 1u << (slot % kBucketSize));
}

// ---- the calls --------------------------------------------------------------------------
//
// An inserting op (find_or_insert, find_or_insert_many, insert_or_assign, erase) runs each
// of its kernels once for all the tables it changes: table j of the call is blockIdx.y of
// every launch, its arguments the TableCall j of an array that the host copies to the device
// before each host stage (hash_table.cu, TableCalls). A table that does not take part in a
// kernel (its `stages` bit unset) returns from it at once. One launch per kernel instead of
// one per table: the 26 tables of a DLRM step made about 300 launches and 400 allocations
// per insert, milliseconds of host time on a path that the GPU waits for.

// Device counters of one table of an inserting call (int32: at most 2^31 - 1 ids per call),
// copied to the host together; indices into the table's counters.
namespace counter {
enum : int {
  kUniques,     // U, written by group_claim_kernel
  kNew,         // distinct ids not in the table
  kConflicted,  // new ids sharing a bucket with another new id
  kFull,        // unconflicted new ids whose two buckets are full
  kDoomed,      // kFull ids with every eviction candidate touched (when evicting)
  kUnsafe,      // conflicted new ids whose two buckets may both fill up (classify_kernel)
  kQueued,      // ids queued by claim_kernel
  kFailed,      // ids that found no room in evict_kernel or sequential_insert_kernel
  kEvicted,     // ids placed by evicting a key
  kGroupSpare,  // group_claim_kernel's claim of its spare scratch slot
  kNum
};
}  // namespace counter

// The grouping's scratch open-addressing set of one table (group_claim_kernel in hash_table.cu).
struct GroupScratch {
  int64_t* keys;   // (C,) ids, kGroupEmpty where free
  int32_t* index;  // (C + 1,) the distinct id's number, written by the slot's winner
  int64_t mask;    // C - 1
};

// Stages (bits of TableCall::stages): which kernels a table takes part in.
enum Stage : uint32_t {
  kStageProbe = 1u << 0,        // probe_kernel (find_or_insert)
  kStageGroup = 1u << 1,        // group_claim_kernel, group_assign_kernel
  kStageFindUniques = 1u << 2,  // find_uniques_kernel (insert_or_assign, erase)
  kStageClassify = 1u << 3,     // bucket_use_kernel, classify_kernel
  kStageClaim = 1u << 4,        // claim_kernel
  kStageEvict = 1u << 5,        // evict_kernel
  kStageSequential = 1u << 6,   // sequential_insert_kernel
  kStageRollback = 1u << 7,     // rollback_kernel
  kStageInitRows = 1u << 8,     // init_rows_kernel
  kStageAssignRows = 1u << 9,   // assign_rows_kernel
  kStageMapSlots = 1u << 10,    // map_slots_kernel
  kStageScore = 1u << 11,       // score_positions_kernel
  kStageErase = 1u << 12,       // erase_kernel
  kStageOrder = 1u << 13,       // order_flags_kernel
};

// One table of an inserting call, as its kernels read it (device memory).
struct TableCall {
  Table t;
  Uniques u;                 // the distinct ids; u.n: positions grouped (an upper bound of U)
  uint32_t stages;           // Stage bits
  int32_t has_pad;           // find_or_insert: positions equal to pad get slot -1
  int64_t pad;
  const bool* admit;         // find_or_insert: (n,) false = a miss there is refused (kRefusedSlot), or null: all admitted
  const int64_t* ids;        // (n,) the call's ids
  int64_t n;                 // positions
  uint8_t* active;           // (n,) the positions grouped (find_or_insert: the misses, which
                             // probe_kernel flags), or null: all
  int64_t* slots;            // (n,) the slot of each position (the op's output)
  uint32_t* touched;         // one word per bucket when evicting, else null
  int32_t* ctr;              // (counter::kNum,) the call's counters for this table
  GroupScratch g;
  int64_t* where;            // (n,) each grouped position's scratch slot
  int32_t* first_pos;        // (n,) per distinct id: its first position
  int32_t* last_pos;         // (n,) its last position (insert_or_assign), or null
  int32_t* occurrences;      // (n,) its count of positions (insert_or_assign), or null
  int32_t* group;            // (n,) per grouped position: its distinct id
  int32_t* use;              // (buckets,) new ids per bucket
  uint8_t* conflicted;       // (n,) per distinct id
  int32_t* overflow;         // (n,) ids whose buckets were full, queued by claim_kernel
  int64_t* overflow_key;     // (n,) and their keys
  const uint8_t* claim_skip; // conflicted when placed sequentially (claim_kernel leaves them), else null
  const int64_t* order;      // sequential placement order (distinct ids), order_count of them
  int64_t order_count;
  int32_t allow_evict;
  int64_t room;              // new ids that may take an empty slot (the op's room), or kNoRoomLimit
  int32_t gate;              // phase 5 of a settling table: write nothing if it failed (placement_failed)
  int32_t deferred;          // a deferred call (no host read): its outcome is decided on the device alone
  const int32_t* refused;    // deferred: the caller's bad_input flag (as int32, 0 when none was given)
  int32_t select;            // order_flags_kernel: 0 conflicted ids, 1 evicted ids
  uint8_t* order_flags;      // order_flags_kernel's output, per position of the call: set at the
  int64_t* order_values;     // first position of each selected id, with its number (select 0) or
                             // the key it evicted (select 1)
  // rows (init_rows_kernel, assign_rows_kernel)
  void* weights;             // (C, D) scalar_t
  void* state;               // (C, S) opmath of scalar_t
  const void* values;        // (n, D) insert_or_assign's values
  const void* opt_values;    // (n, S), or null
  const void* init_state;    // (S,) the state of new rows, or null for zeros
  const int64_t* score_values;  // (n,), or null
  int64_t D, S;
  int32_t dtype;             // the weights' at::ScalarType: a row kernel runs for one dtype
  int32_t rows_per_warp;
  int64_t score_policy, score_value;  // an id of veloce/score.h, and the clock its functor reads
  const int64_t* clock;      // find_or_insert's clock: score_value read on the device, or null
  int64_t seed, init_kind;
  double init_a, init_b;
  const uint8_t* score_skip; // positions score_positions_kernel leaves out, or null
  bool* erased;              // erase's output
};

// Where a launch finds its TableCalls: in device memory (an op over several tables, copied
// there once per host stage), or the one table's as the kernel parameter itself (a
// single-table op: no copy to wait for, and the arguments in the constant bank as plain
// kernel arguments would be). Kernels take either as a __grid_constant__ parameter.
struct DeviceCalls {
  const TableCall* calls;
  __device__ __forceinline__ const TableCall* at(unsigned j) const { return calls + j; }
};
struct OneCall {
  TableCall call;
  __device__ __forceinline__ const TableCall* at(unsigned) const { return &call; }
};
static_assert(sizeof(OneCall) <= 1024, "a TableCall must stay a small kernel parameter (4 KiB at most)");

// Whether a settling table's placement failed: its phase-5 kernels (new rows, slots,
// scores) are queued before the host reads the outcome (sync c) and write nothing then;
// the host rolls the table back after the read. Final once evict_kernel and
// sequential_insert_kernel ran: ids that found no room, or without eviction any queued
// id (Inserter::settle reads the same counters).
//
// A deferred call (no eviction, no host read at all) also fails as a whole when the caller's
// flag refused it or some unconflicted new id has both buckets full (kFull): then it claims
// nothing (deferred_claim_barred), and only racing conflicted ids can fail after claiming.
__device__ __forceinline__ bool deferred_claim_barred(const TableCall* c) {
  return c->deferred && (*c->refused != 0 || c->ctr[counter::kFull] > 0);
}

// A deferred call's launches cover every position whether or not any id is new; with none
// (kNew, counted by bucket_use_kernel) there is nothing to claim, roll back, initialise or
// map, and each block returns after one load (a warm table's usual step).
__device__ __forceinline__ bool deferred_nothing_new(const TableCall* c) {
  return c->deferred && c->ctr[counter::kNew] == 0;
}

// The clock a call's score policy reads: its clock tensor's value when it has one, else score_value.
__device__ __forceinline__ int64_t call_score(const TableCall* c) {
  return c->clock != nullptr ? *c->clock : c->score_value;
}

__device__ __forceinline__ bool placement_failed(const TableCall* c) {
  return c->gate && (deferred_claim_barred(c) ||
                     c->ctr[counter::kFailed] + (c->allow_evict ? 0 : c->ctr[counter::kQueued]) > 0);
}

// Whether position i of the call is grouped (find_or_insert: a miss; otherwise every position).
__device__ __forceinline__ bool grouped(const TableCall* c, int64_t i) {
  return i < c->n && (c->active == nullptr || c->active[i]);
}

// The TableCall of this block's table when it takes part in `stage`, else null (the whole
// block returns: the tests are uniform over the block).
template <class Calls>
__device__ __forceinline__ const TableCall* call_in(const Calls& calls, uint32_t stage) {
  const TableCall* c = calls.at(blockIdx.y);
  return (c->stages & stage) ? c : nullptr;
}

// ---- kernels ---------------------------------------------------------------------------

__global__ void find_kernel(Table t, const int64_t* __restrict__ ids, int64_t n, int64_t* __restrict__ slots) {
  const int64_t i = thread_index();
  if (i < n) slots[i] = find_slot_device(t.keys, t.digests, t.num_buckets, ids[i]);
}

// Phase 1 of find_or_insert: slots of present ids (-1 for padding and misses, kRefusedSlot
// for the misses that admit refuses), touched marks (when evicting), and a flag per missing
// position that is not refused (the positions the grouping groups).
template <class Calls>
__global__ void probe_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageProbe);
  const int64_t i = thread_index();
  if (c == nullptr || i >= c->n) return;
  const Table t = c->t;
  const int64_t id = c->ids[i];
  const bool is_pad = c->has_pad && id == c->pad;
  int64_t s = kPaddingSlot;
  if (!is_pad) {
    s = find_slot_device(t.keys, t.digests, t.num_buckets, id);
    if (s >= 0 && c->touched != nullptr) mark_touched(c->touched, s);
  }
  const bool refused = !is_pad && s < 0 && c->admit != nullptr && !c->admit[i];
  c->slots[i] = refused ? kRefusedSlot : s;
  c->active[i] = !is_pad && s < 0 && !refused;
}

// Slots of distinct ids (insert_or_assign, erase), touched marks when evicting.
template <class Calls>
__global__ void find_uniques_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageFindUniques);
  const int64_t k = thread_index();
  if (c == nullptr || !c->u.has(k)) return;
  const Table t = c->t;
  const int64_t s = find_slot_device(t.keys, t.digests, t.num_buckets, c->u.id[k]);
  c->u.slot[k] = s;
  if (s >= 0 && c->touched != nullptr) mark_touched(c->touched, s);
}

// Word w of a bucket's digests, w uniform across unrolled compares (no local memory).
__device__ __forceinline__ uint32_t digest_word(const BucketDigests& d, int w) {
  uint32_t x = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) x = (k == w) ? d.w[k] : x;
  return x;
}

// Phase 3a: each distinct id not in the table claims an empty slot by CAS on the digest
// word; both buckets full, or a room of 0 (every new id evicts) -> queued in `overflow`
// (counted in counter kQueued). Ids flagged in `claim_skip` are left to
// sequential_insert_kernel. (A room between 0 and the new ids places them all there, in
// order: Inserter::place.)
template <class Calls>
__global__ void claim_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageClaim);
  const int64_t k = thread_index();
  if (c == nullptr || deferred_claim_barred(c) || deferred_nothing_new(c)) return;
  const Uniques u = c->u;
  if (!u.has(k) || u.slot[k] >= 0 || (c->claim_skip != nullptr && c->claim_skip[k])) return;
  const Table t = c->t;
  const int64_t key = u.id[k];
  const DeviceProbe p = device_probe(key, t.num_buckets);
  for (;;) {
    const BucketDigests da = load_bucket<true>(t.digests, p.a);
    const BucketDigests db = p.b != p.a ? load_bucket<true>(t.digests, p.b) : da;
    const uint32_t ea = empty_mask(da);
    const uint32_t eb = p.b != p.a ? empty_mask(db) : 0u;
    if ((ea | eb) == 0 || c->room == 0) {
      const int32_t q = aggregated_inc(c->ctr + counter::kQueued);
      c->overflow[q] = static_cast<int32_t>(k);
      c->overflow_key[q] = key;  // evict_kernel loads it beside k instead of after it
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
      if (c->touched != nullptr) mark_touched(c->touched, s);
      return;
    }
    // Another id changed this word first: reload and choose again.
  }
}

// The eviction victim of a key that must evict (its buckets are full, or the room is used
// up): the lowest score among the occupied candidates (bits of occupied_a, occupied_b) not
// touched by this call, ties to the lowest slot of bucket_a, then bucket_b; -1 when there
// is none.
__device__ __forceinline__ int64_t eviction_victim(const Table& t, const DeviceProbe& p, const uint32_t* touched,
                                                   uint32_t occupied_a, uint32_t occupied_b) {
  int64_t best = -1;
  int64_t best_score = 0;
  for (int side = 0; side < (p.b != p.a ? 2 : 1); ++side) {
    const int64_t bucket = side == 0 ? p.a : p.b;
    const uint32_t occupied = side == 0 ? occupied_a : occupied_b;
    uint32_t free = ~*reinterpret_cast<const volatile uint32_t*>(touched + bucket) & occupied;
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
  return best;
}

// The eviction candidates of a queued id as its group of Lanes lanes holds them: lane l
// has slots Span * l ... Span * l + Span - 1 of bucket_a and of bucket_b (Span = 32 /
// Lanes), their scores and digests, loaded together in vector reads before any is judged.
// The victim's digest (saved for a rollback) is then in its lane; it cannot be stale for
// a slot the group wins: during evict_kernel a slot's key and digest are written only by
// the id that set its touched bit first, and then no other id wins it.
template <int Span>
struct EvictCandidates {
  int64_t score[2][Span];  // [bucket_a, bucket_b][slot]
  uint32_t digests[2];     // the Span digest bytes of each bucket
};

// Scores in 16-byte loads where they allow it (a table's own tensor always does; an op given
// a view at an odd offset reads them one by one); digests start on 16 bytes on CUDA (checked).
template <int Span>
__device__ __forceinline__ EvictCandidates<Span> load_candidates(const Table& t, const DeviceProbe& p, int lane) {
  static_assert(Span == 2 || Span == 4, "a lane's scores of one bucket are one or two 16-byte loads");
  EvictCandidates<Span> w;
  const int64_t bucket[2] = {p.a, p.b};
  const bool vec = (reinterpret_cast<uintptr_t>(t.scores) & 15) == 0;
#pragma unroll
  for (int side = 0; side < 2; ++side) {
    const int64_t first = bucket[side] * kBucketSize + static_cast<int64_t>(lane) * Span;
    if (vec) {
#pragma unroll
      for (int h = 0; h < Span; h += 2) {
        const longlong2 v = *reinterpret_cast<const longlong2*>(t.scores + first + h);
        w.score[side][h] = v.x;
        w.score[side][h + 1] = v.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < Span; ++i) w.score[side][i] = t.scores[first + i];
    }
    w.digests[side] = Span == 4 ? *reinterpret_cast<const uint32_t*>(t.digests + first)
                                : *reinterpret_cast<const uint16_t*>(t.digests + first);
  }
  return w;
}

// Candidate order of no candidate: after every one of bucket_a's (0-31) and bucket_b's (32-63).
constexpr int32_t kNoCandidate = 64;

// eviction_victim by a group of Lanes lanes (`mask`; each gets the same result): the
// candidate order (0-63) of the least (score, candidate order) occupied untouched candidate
// (a queued id's buckets may hold empty slots when the room is used up; no slot turns
// empty or occupied during evict_kernel, so the loaded digests tell), each
// lane's least first, then a butterfly over the group; kNoCandidate when every candidate
// was touched. Each lane judges its own candidates by its own reading of the touched
// words: a bit set since another lane's reading only makes the claim fail and the group
// look again.
template <int Lanes, int Span>
__device__ __forceinline__ int32_t group_eviction_victim(const EvictCandidates<Span>& w, const DeviceProbe& p,
                                                         const uint32_t* touched, int lane, unsigned mask) {
  const uint32_t ta = *reinterpret_cast<const volatile uint32_t*>(touched + p.a);
  const uint32_t tb = p.b != p.a ? *reinterpret_cast<const volatile uint32_t*>(touched + p.b) : ~0u;
  const uint32_t word[2] = {ta, tb};
  int64_t score = 0;
  int32_t order = kNoCandidate;
#pragma unroll
  for (int side = 0; side < 2; ++side) {
#pragma unroll
    for (int i = 0; i < Span; ++i) {
      const int slot = lane * Span + i;
      const bool occupied = ((w.digests[side] >> (8 * i)) & 0xffu) != kEmptyDigest;
      // In increasing candidate order, so a tie keeps the earlier (bucket_a's, lower) slot.
      if (occupied && !((word[side] >> slot) & 1u) && (order == kNoCandidate || w.score[side][i] < score)) {
        score = w.score[side][i];
        order = side * kBucketSize + slot;
      }
    }
  }
#pragma unroll
  for (int off = Lanes / 2; off > 0; off >>= 1) {
    const int64_t other_score = __shfl_xor_sync(mask, score, off);
    const int32_t other_order = __shfl_xor_sync(mask, order, off);
    if (other_order != kNoCandidate &&
        (order == kNoCandidate || other_score < score || (other_score == score && other_order < order))) {
      score = other_score;
      order = other_order;
    }
  }
  return order;
}

// evict_kernel's lanes per queued id and its resident blocks per SM (registers capped at
// 64). On an H200 (ncu, 48k queued ids, 8M slots): 8 lanes 22.8-23.0 us (72 registers
// unbounded, 35% occupancy; 62 bounded, 45%), 16 lanes 24.8 us bounded and 31.8 us unbounded.
constexpr int kEvictLanes = 8;
constexpr int kEvictMinBlocks = 4;

// Phase 3b: queued ids (both buckets full) evict the lowest-score untouched candidate,
// ties to the lowest slot of bucket_a, then bucket_b. A group of Lanes lanes per queued id
// (group_eviction_victim), 32 / Lanes ids per warp: a thread per id waited on 64 dependent
// score loads (450 us for 420k ids at load 1.0 on an H100); a warp per id took 285 us for
// them on an H200, however few its rounds of dependent loads. Only touched bits, and the
// keys and digests of slots whose bit an id set, change concurrently here; scores are not
// written until the call succeeds. The grid covers an upper bound; the number queued is
// read where claim_kernel counted it. A group's loads come in rounds: the count with its
// queue entry (id number and key), the candidates with the touched words, then the claim
// by the victim's lane (a lost claim reloads only the touched words) and the evicted key.
// The counters take one atomic per block.
template <class Calls>
__global__ void __launch_bounds__(kThreads, kEvictMinBlocks) evict_kernel(const __grid_constant__ Calls calls) {
  constexpr int Lanes = kEvictLanes;
  constexpr int Span = kBucketSize / Lanes;
  const TableCall* c = call_in(calls, kStageEvict);
  if (c == nullptr) return;  // uniform over the block (its table)
  __shared__ int32_t evicted, failed;
  if (threadIdx.x == 0) evicted = failed = 0;
  __syncthreads();
  const int64_t j = thread_index() / Lanes;  // the group's queued id
  const int lane = static_cast<int>(threadIdx.x % Lanes);
  const unsigned mask = group_mask(Lanes);
  const int leader = static_cast<int>(threadIdx.x & 31) - lane;
  // The queue entry is read beside the count, not after it: entries below n are in
  // bounds (queued ids are distinct ids of the call), only those below the count are used.
  const bool in_bounds = j < c->n;
  const int64_t k = in_bounds ? c->overflow[j] : 0;
  const int64_t key = in_bounds ? c->overflow_key[j] : 0;
  if (in_bounds && j < c->ctr[counter::kQueued]) {  // uniform over the group
    const DeviceProbe p = device_probe(key, c->t.num_buckets);
    const EvictCandidates<Span> w = load_candidates<Span>(c->t, p, lane);
    for (;;) {
      const int32_t order = group_eviction_victim<Lanes, Span>(w, p, c->touched, lane, mask);
      if (order == kNoCandidate) {  // every candidate was touched by this call
        if (lane == 0) {
          c->u.state[k] = kFailed;
          atomicAdd(&failed, 1);
        }
        break;
      }
      const int side = order / kBucketSize, slot = order % kBucketSize;
      const int64_t best = (side == 0 ? p.a : p.b) * kBucketSize + slot;
      const int owner = slot / Span;  // the lane holding the victim
      uint32_t won = 0;
      if (lane == owner) {
        const uint32_t bit = 1u << slot;
        won = (atomicOr(c->touched + best / kBucketSize, bit) & bit) == 0;
      }
      if (!__shfl_sync(mask, won, leader + owner)) continue;  // lost it to another id: look again
      if (lane == owner) {
        const Uniques& u = c->u;
        u.old_key[k] = c->t.keys[best];
        u.old_digest[k] = static_cast<uint8_t>(w.digests[side] >> (8 * (slot % Span)));
        c->t.keys[best] = key;
        c->t.digests[best] = static_cast<uint8_t>(p.digest);
        u.slot[k] = best;
        u.state[k] = kEvicted;
        atomicAdd(&evicted, 1);
      }
      break;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (evicted > 0) atomicAdd(c->ctr + counter::kEvicted, evicted);
    if (failed > 0) atomicAdd(c->ctr + counter::kFailed, failed);
  }
}

// New ids per bucket (a key whose two buckets coincide counts once), and the new ids.
template <class Calls>
__global__ void bucket_use_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageClassify);
  if (c == nullptr) return;
  const int64_t k = thread_index();
  const bool fresh = c->u.has(k) && c->u.slot[k] < 0;
  block_reserve(fresh, c->ctr + counter::kNew);
  if (!fresh) return;
  const DeviceProbe p = device_probe(c->u.id[k], c->t.num_buckets);
  atomicAdd(c->use + p.a, 1);
  if (p.b != p.a) atomicAdd(c->use + p.b, 1);
}

// conflicted[k]: new id k shares a bucket with another new id. An unconflicted new id is
// alone in its buckets for the whole call (claims, evictions and sequential inserts write
// digests, keys and touched bits only in the writer's own buckets), so its fate is decided
// now: both buckets full, or a room of 0 -> claim_kernel queues it (kFull), and with
// eviction (touched given) no occupied candidate left untouched -> evict_kernel fails it
// (kDoomed); else it is placed.
//
// A conflicted id is counted kUnsafe when each of its buckets has fewer empty slots than
// new ids that may write there (use). Where none is, every conflicted id finds an empty
// slot, racing or in order: only new ids of that bucket take its empty slots (an eviction
// replaces a key), so when this id looks, at most use - 1 of them took one, and its safe
// bucket keeps an empty slot. Then no conflicted id is queued, evicts or fails, and the
// call's outcome is known from these counters alone (no sync c).
//
// A room (TableCall::room) smaller than the new ids (kNew, counted by the launch before):
// with a room of 0 every new id evicts, and a conflicted one is unsafe (which candidates
// the others leave it is known after placement only); with a room in between, every new
// id is made conflicted and unsafe, and one thread places them in order of first
// occurrence (Inserter::place), the first `room` in empty slots, the later ones evicting.
template <class Calls>
__global__ void classify_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageClassify);
  const int64_t k = thread_index();
  if (c == nullptr || !c->u.has(k)) return;
  const Table t = c->t;
  bool conflict = false, unsafe = false;
  if (c->u.slot[k] < 0) {
    const int64_t room = c->room;
    const bool over = room != kNoRoomLimit && c->ctr[counter::kNew] > room;
    const DeviceProbe p = device_probe(c->u.id[k], t.num_buckets);
    const int32_t use_a = c->use[p.a], use_b = c->use[p.b];
    conflict = use_a > 1 || use_b > 1 || (over && room > 0);
    // No digest changes during this kernel, so the read-only path is safe.
    // Bucket b is loaded only when bucket a does not settle the question.
    const uint32_t empty_a = empty_mask(load_bucket<false>(t.digests, p.a));
    const int free_a = __popc(empty_a);
    auto empty_b = [&] { return empty_mask(load_bucket<false>(t.digests, p.b)); };
    if (conflict) {
      unsafe = over || (free_a < use_a && (p.b == p.a || __popc(empty_b()) < use_b));
    } else if (room == 0 || (free_a == 0 && (p.b == p.a || empty_b() == 0))) {
      aggregated_inc(c->ctr + counter::kFull);
      const uint32_t* touched = c->touched;
      if (touched != nullptr) {
        // Its candidates: the occupied slots of its buckets that this call did not touch.
        const uint32_t open_a = ~touched[p.a] & ~empty_a;
        const uint32_t open_b = p.b != p.a ? ~touched[p.b] & ~empty_b() : 0u;
        if ((open_a | open_b) == 0) aggregated_inc(c->ctr + counter::kDoomed);
      }
    }
  }
  c->conflicted[k] = conflict;
  if (conflict) aggregated_inc(c->ctr + counter::kConflicted);
  if (unsafe) aggregated_inc(c->ctr + counter::kUnsafe);
}

// The distinct ids some tables must take in order of first occurrence (the CPU kernel's
// insertion order), `select`ed (conflicted ones, or evicted ones), flagged at their first
// positions: the tables' position ranges lie one after another, so one select of the
// flagged values lists every table's in order, table after table, without a sort. A
// settling table that failed lists no evicted key (they are rolled back): the list is then
// the successful tables' keys alone, one after another, which the op returns as it is.
template <class Calls>
__global__ void order_flags_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageOrder);
  const int64_t k = thread_index();
  if (c == nullptr || k >= c->u.n) return;  // u.n = U here (after the counters' read)
  if (c->select == 1 && placement_failed(c)) return;
  const bool take = c->select == 0 ? c->conflicted[k] != 0 : c->u.state[k] == kEvicted;
  if (!take) return;
  const int64_t at = c->first_pos[k];
  c->order_flags[at] = 1;
  c->order_values[at] = c->select == 0 ? k : c->u.old_key[k];
}

// The conflicted new ids of each table, one thread per table, in order of first occurrence:
// the CPU kernel's sequential logic step for step (they share buckets only among themselves),
// its room too: `claimed` counts the ids placed in an empty slot, which with a room smaller
// than the new ids are all of them (every new id is conflicted then: classify_kernel), and
// with a larger one never reaches it.
template <class Calls>
__global__ void sequential_insert_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageSequential);
  if (c == nullptr || threadIdx.x != 0) return;
  const Table t = c->t;
  const Uniques u = c->u;
  int32_t* const ctr = c->ctr;
  uint32_t* const touched = c->touched;
  int64_t claimed = 0;
  for (int64_t j = 0; j < c->order_count; ++j) {
    const int64_t k = c->order[j];
    const int64_t key = u.id[k];
    const DeviceProbe p = device_probe(key, t.num_buckets);
    const BucketDigests da = load_bucket<true>(t.digests, p.a);
    const BucketDigests db = p.b != p.a ? load_bucket<true>(t.digests, p.b) : da;
    const uint32_t ea = empty_mask(da);
    const uint32_t eb = p.b != p.a ? empty_mask(db) : 0u;
    int64_t s = -1;
    const bool may_claim = c->room == kNoRoomLimit || claimed < c->room;
    if (may_claim && (ea | eb) != 0) {
      const bool use_a = __popc(ea) >= __popc(eb);
      s = (use_a ? p.a : p.b) * kBucketSize + (__ffs(use_a ? ea : eb) - 1);
      ++claimed;
    } else if (c->allow_evict) {
      s = eviction_victim(t, p, touched, ~ea, p.b != p.a ? ~empty_mask(db) : 0u);
    }
    if (s < 0) {
      u.state[k] = kFailed;
      ctr[counter::kFailed] += 1;
      continue;
    }
    const uint8_t old_digest = t.digests[s];
    u.old_key[k] = t.keys[s];
    u.old_digest[k] = old_digest;
    t.keys[s] = key;
    t.digests[s] = static_cast<uint8_t>(p.digest);
    u.slot[k] = s;
    u.state[k] = old_digest == kEmptyDigest ? kClaimed : kEvicted;
    if (old_digest != kEmptyDigest) ctr[counter::kEvicted] += 1;
    if (touched != nullptr) touched[s / kBucketSize] |= 1u << (s % kBucketSize);
  }
}

// Phase 4 (failure): restore every slot this call claimed. Slots are distinct. The host
// launches it for the tables that failed; a deferred call's runs always and reads the
// failure on the device.
template <class Calls>
__global__ void rollback_kernel(const __grid_constant__ Calls calls) {
  const TableCall* c = call_in(calls, kStageRollback);
  const int64_t k = thread_index();
  if (c == nullptr || (c->deferred && (deferred_nothing_new(c) || !placement_failed(c))) || !c->u.has(k)) return;
  const Uniques u = c->u;
  const int8_t st = u.state[k];
  if (st != kClaimed && st != kEvicted) return;
  const int64_t s = u.slot[k];
  c->t.keys[s] = u.old_key[k];
  c->t.digests[s] = u.old_digest[k];
}

}  // namespace
}  // namespace cuda
}  // namespace veloce
