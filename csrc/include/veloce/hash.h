// Hashing and the table layout shared by every backend.
//
// A table is `num_buckets * kBucketSize` slots (any num_buckets in [1, 2^32]). Slot s
// stores keys[s] (int64), digests[s] (uint8) and scores[s] (int64); its embedding row
// is weights[s] and its optimizer state opt_state[s]. digests[s] == 0 marks an empty
// slot, so *every* int64 value is a valid key: occupancy lives out of band.
//
// Each key may live in one of two buckets (two-choice hashing): bucket_a(h) and
// bucket_b(h). A lookup reads at most 2 * kBucketSize digests; a digest match is
// confirmed on the key. Inserts go to the emptier of the two buckets; when both are
// full, the table either grows (driven from Python) or evicts the lowest score among
// the 2 * kBucketSize candidates.
#pragma once

#include <cstdint>

#include "veloce/macros.h"

namespace veloce {

constexpr int64_t kBucketSize = 32;
// bucket_of multiplies a 32-bit hash by the bucket count: at most 2^32 buckets.
constexpr int64_t kMaxBuckets = int64_t{1} << 32;
constexpr uint8_t kEmptyDigest = 0;

// Slot codes used by the embedding ops (see docs/ops.md).
constexpr int64_t kPaddingSlot = -1;  // skipped; not counted by mean pooling
constexpr int64_t kZeroSlot = -2;     // a zero vector; counted by mean pooling
// find_or_insert's mark for an absent id whose `admit` is false, while the op runs: no
// phase inserts or scores it; the op returns it as the slot C (the table's capacity), the
// pooling kernels' first extra row (the caller's default row).
constexpr int64_t kRefusedSlot = -4;

// The `room` of an inserting op that bounds nothing (see insert_missing in csrc/cpu/hash_table.cpp).
constexpr int64_t kNoRoomLimit = -1;

// murmur3's 64-bit finalizer: a bijection with full avalanche.
VELOCE_HD uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

// The table's hash of a key.
VELOCE_HD uint64_t table_hash(int64_t key) { return fmix64(static_cast<uint64_t>(key)); }

// The owner hash used to shard keys across ranks; independent of table_hash so a
// shard's table still spreads its keys over all buckets.
VELOCE_HD uint64_t owner_hash(int64_t key) {
  return fmix64(static_cast<uint64_t>(key) ^ 0x9e3779b97f4a7c15ULL) * 0xd6e8feb86659fd93ULL;
}

// The bucket of a 32-bit hash: floor(x * num_buckets / 2^32), a multiply-high instead of a
// mask, so that any bucket count works (a table sized for max_capacity rows is not a power
// of two). It reads the low 32 bits of the hash; the digest takes the top 8 (digest_of), so
// the keys of one bucket still spread over every digest.
VELOCE_HD int64_t bucket_of(uint64_t h, int64_t num_buckets) {
  return static_cast<int64_t>(((h & 0xffffffffULL) * static_cast<uint64_t>(num_buckets)) >> 32);
}

VELOCE_HD int64_t bucket_a(uint64_t h, int64_t num_buckets) { return bucket_of(h, num_buckets); }

VELOCE_HD int64_t bucket_b(uint64_t h, int64_t num_buckets) {
  // Use the high half, re-mixed, so the two choices are independent.
  return bucket_of(fmix64(h >> 32 | (h << 32)), num_buckets);
}

// A non-zero 8-bit fingerprint of the key (0 is reserved for empty slots).
VELOCE_HD uint8_t digest_of(uint64_t h) {
  const uint8_t d = static_cast<uint8_t>(h >> 56);
  return d == kEmptyDigest ? static_cast<uint8_t>(1) : d;
}

}  // namespace veloce
