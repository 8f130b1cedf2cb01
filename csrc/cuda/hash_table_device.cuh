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

// ---- kernels ---------------------------------------------------------------------------

__global__ void find_kernel(Table t, const int64_t* __restrict__ ids, int64_t n, int64_t* __restrict__ slots) {
  const int64_t i = thread_index();
  if (i < n) slots[i] = find_slot_device(t.keys, t.digests, t.num_buckets, ids[i]);
}

// Phase 1 of find_or_insert: slots of present ids (-1 for padding and misses), touched
// marks (when evicting), and a flag per missing position (what group_ids groups).
__global__ void probe_kernel(Table t, const int64_t* __restrict__ ids, int64_t n, bool has_pad, int64_t pad,
                             int64_t* __restrict__ slots, uint32_t* touched, uint8_t* __restrict__ missing) {
  const int64_t i = thread_index();
  if (i >= n) return;
  const int64_t id = ids[i];
  const bool is_pad = has_pad && id == pad;
  int64_t s = kPaddingSlot;
  if (!is_pad) {
    s = find_slot_device(t.keys, t.digests, t.num_buckets, id);
    if (s >= 0 && touched != nullptr) mark_touched(touched, s);
  }
  slots[i] = s;
  missing[i] = !is_pad && s < 0;
}

// Slots of distinct ids (insert_or_assign, erase), touched marks when evicting.
__global__ void find_uniques_kernel(Table t, Uniques u, uint32_t* touched) {
  const int64_t k = thread_index();
  if (!u.has(k)) return;
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
// word; both buckets full -> queued in `overflow` (counted in *n_overflow). Ids flagged
// in `skip` are left to sequential_insert_kernel.
__global__ void claim_kernel(Table t, Uniques u, const uint8_t* __restrict__ skip, uint32_t* touched,
                             int32_t* __restrict__ overflow, int32_t* n_overflow) {
  const int64_t k = thread_index();
  if (!u.has(k) || u.slot[k] >= 0 || (skip != nullptr && skip[k])) return;
  const int64_t key = u.id[k];
  const DeviceProbe p = device_probe(key, t.num_buckets);
  for (;;) {
    const BucketDigests da = load_bucket<true>(t.digests, p.a);
    const BucketDigests db = p.b != p.a ? load_bucket<true>(t.digests, p.b) : da;
    const uint32_t ea = empty_mask(da);
    const uint32_t eb = p.b != p.a ? empty_mask(db) : 0u;
    if ((ea | eb) == 0) {
      overflow[aggregated_inc(n_overflow)] = static_cast<int32_t>(k);
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

// The eviction victim of a key whose buckets are full: the lowest score among the
// candidates not touched by this call, ties to the lowest slot of bucket_a, then
// bucket_b; -1 when every candidate was touched.
__device__ __forceinline__ int64_t eviction_victim(const Table& t, const DeviceProbe& p, const uint32_t* touched) {
  int64_t best = -1;
  int64_t best_score = 0;
  for (int side = 0; side < (p.b != p.a ? 2 : 1); ++side) {
    const int64_t bucket = side == 0 ? p.a : p.b;
    uint32_t free = ~*reinterpret_cast<const volatile uint32_t*>(touched + bucket);
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

// Phase 3b: queued ids (both buckets full) evict the lowest-score untouched candidate,
// ties to the lowest slot of bucket_a, then bucket_b. Only touched bits change
// concurrently here; scores are not written until the call succeeds. The grid covers an
// upper bound; the number queued is read where claim_kernel counted it.
__global__ void evict_kernel(Table t, Uniques u, uint32_t* touched, const int32_t* __restrict__ overflow,
                             const int32_t* n_overflow, int32_t* n_failed, int32_t* n_evicted) {
  const int64_t j = thread_index();
  if (j >= *n_overflow) return;
  const int64_t k = overflow[j];
  const int64_t key = u.id[k];
  const DeviceProbe p = device_probe(key, t.num_buckets);
  for (;;) {
    const int64_t best = eviction_victim(t, p, touched);
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
    aggregated_inc(n_evicted);
    return;
  }
}

// New ids per bucket (a key whose two buckets coincide counts once), and the new ids.
__global__ void bucket_use_kernel(Table t, Uniques u, int32_t* __restrict__ use, int32_t* n_new) {
  const int64_t k = thread_index();
  const bool fresh = u.has(k) && u.slot[k] < 0;
  block_reserve(fresh, n_new);
  if (!fresh) return;
  const DeviceProbe p = device_probe(u.id[k], t.num_buckets);
  atomicAdd(use + p.a, 1);
  if (p.b != p.a) atomicAdd(use + p.b, 1);
}

// conflicted[k]: new id k shares a bucket with another new id. An unconflicted new id is
// alone in its buckets for the whole call (claims, evictions and sequential inserts write
// digests, keys and touched bits only in the writer's own buckets), so its fate is decided
// now: both buckets full -> claim_kernel queues it (*n_full), and with eviction (touched
// given) every candidate already touched -> evict_kernel fails it (*n_doomed); else it
// is placed.
__global__ void classify_kernel(Table t, Uniques u, const int32_t* __restrict__ use, const uint32_t* touched,
                                uint8_t* __restrict__ conflicted, int32_t* n_conflicted, int32_t* n_full,
                                int32_t* n_doomed) {
  const int64_t k = thread_index();
  if (!u.has(k)) return;
  bool c = false;
  if (u.slot[k] < 0) {
    const DeviceProbe p = device_probe(u.id[k], t.num_buckets);
    c = use[p.a] > 1 || use[p.b] > 1;
    // No digest changes during this kernel, so the read-only path is safe.
    if (!c && empty_mask(load_bucket<false>(t.digests, p.a)) == 0 &&
        (p.b == p.a || empty_mask(load_bucket<false>(t.digests, p.b)) == 0)) {
      aggregated_inc(n_full);
      if (touched != nullptr && touched[p.a] == ~0u && touched[p.b] == ~0u) aggregated_inc(n_doomed);
    }
  }
  conflicted[k] = c;
  if (c) aggregated_inc(n_conflicted);
}

// The conflicted new ids, one thread, in order of first occurrence: the CPU kernel's
// sequential logic step for step (they share buckets only among themselves).
__global__ void sequential_insert_kernel(Table t, Uniques u, const int64_t* __restrict__ order, int64_t count,
                                         bool allow_evict, uint32_t* touched, int32_t* n_failed,
                                         int32_t* n_evicted) {
  for (int64_t j = 0; j < count; ++j) {
    const int64_t k = order[j];
    const int64_t key = u.id[k];
    const DeviceProbe p = device_probe(key, t.num_buckets);
    const BucketDigests da = load_bucket<true>(t.digests, p.a);
    const BucketDigests db = p.b != p.a ? load_bucket<true>(t.digests, p.b) : da;
    const uint32_t ea = empty_mask(da);
    const uint32_t eb = p.b != p.a ? empty_mask(db) : 0u;
    int64_t s = -1;
    if ((ea | eb) != 0) {
      const bool use_a = __popc(ea) >= __popc(eb);
      s = (use_a ? p.a : p.b) * kBucketSize + (__ffs(use_a ? ea : eb) - 1);
    } else if (allow_evict) {
      s = eviction_victim(t, p, touched);
    }
    if (s < 0) {
      u.state[k] = kFailed;
      *n_failed += 1;
      continue;
    }
    const uint8_t old_digest = t.digests[s];
    u.old_key[k] = t.keys[s];
    u.old_digest[k] = old_digest;
    t.keys[s] = key;
    t.digests[s] = static_cast<uint8_t>(p.digest);
    u.slot[k] = s;
    u.state[k] = old_digest == kEmptyDigest ? kClaimed : kEvicted;
    if (old_digest != kEmptyDigest) *n_evicted += 1;
    if (touched != nullptr) touched[s / kBucketSize] |= 1u << (s % kBucketSize);
  }
}

// Phase 4 (failure): restore every slot this call claimed. Slots are distinct.
__global__ void rollback_kernel(Table t, Uniques u) {
  const int64_t k = thread_index();
  if (!u.has(k)) return;
  const int8_t st = u.state[k];
  if (st != kClaimed && st != kEvicted) return;
  const int64_t s = u.slot[k];
  t.keys[s] = u.old_key[k];
  t.digests[s] = u.old_digest[k];
}

}  // namespace
}  // namespace cuda
}  // namespace veloce
