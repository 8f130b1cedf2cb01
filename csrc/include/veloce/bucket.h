// Probing the two buckets of a key: the lookup and insert-slot logic of the table
// layout in veloce/hash.h, written once for every backend to mirror.
//
// A bucket's 32 digests are read as four 64-bit words and compared eight at a time
// (SWAR); a digest match is confirmed on the key.
#pragma once

#include <cstdint>
#include <cstring>

#include "veloce/hash.h"
#include "veloce/macros.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "veloce/bucket.h assumes a little-endian target (byte i of a word is bits 8i..8i+7)"
#endif

namespace veloce {

static_assert(kBucketSize % 8 == 0, "a bucket is a whole number of 64-bit digest words");

// Raw views of a table's key columns.
struct TableRef {
  int64_t* keys;      // (C,)
  uint8_t* digests;   // (C,), 0 = empty
  int64_t num_buckets;  // C / kBucketSize
};

// Where a key may live.
struct Probe {
  int64_t bucket_a;
  int64_t bucket_b;  // may equal bucket_a
  uint8_t digest;
};

VELOCE_HD Probe probe_of(int64_t key, int64_t num_buckets) {
  const uint64_t h = table_hash(key);
  return {bucket_a(h, num_buckets), bucket_b(h, num_buckets), digest_of(h)};
}

constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7fULL;
constexpr uint64_t kByteOnes = 0x0101010101010101ULL;

// 0x80 in every byte of x that is zero and 0 in the others. Exact: no borrow crosses bytes.
VELOCE_HD uint64_t zero_bytes(uint64_t x) { return ~(((x & kLow7) + kLow7) | x | kLow7); }

VELOCE_HD uint64_t load_word(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// Index of the lowest byte flagged (0x80) in a non-zero mask.
VELOCE_HD int lowest_byte(uint64_t mask) {
#if defined(__CUDA_ARCH__)
  return (__ffsll(static_cast<long long>(mask)) - 1) >> 3;
#else
  return __builtin_ctzll(mask) >> 3;
#endif
}

// The number of bytes flagged (0x80) in a zero_bytes mask. A multiply sums the flags
// into the top byte (no popcnt instruction needed on baseline x86-64).
VELOCE_HD int count_flagged(uint64_t mask) { return static_cast<int>(((mask >> 7) * kByteOnes) >> 56); }

// The slot of key in bucket, or -1.
VELOCE_HD int64_t find_in_bucket(const TableRef& t, int64_t bucket, uint8_t digest, int64_t key) {
  const int64_t base = bucket * kBucketSize;
  const uint64_t pattern = kByteOnes * digest;
  for (int64_t w = 0; w < kBucketSize; w += 8) {
    uint64_t m = zero_bytes(load_word(t.digests + base + w) ^ pattern);
    while (m != 0) {
      const int64_t s = base + w + lowest_byte(m);
      if (t.keys[s] == key) return s;
      m &= m - 1;
    }
  }
  return -1;
}

// The slot of key, or -1. bucket_b is probed only when bucket_a misses.
VELOCE_HD int64_t find_slot(const TableRef& t, const Probe& p, int64_t key) {
  const int64_t s = find_in_bucket(t, p.bucket_a, p.digest, key);
  if (s >= 0 || p.bucket_b == p.bucket_a) return s;
  return find_in_bucket(t, p.bucket_b, p.digest, key);
}

VELOCE_HD int count_empty(const TableRef& t, int64_t bucket) {
  int n = 0;
  const uint8_t* d = t.digests + bucket * kBucketSize;
  for (int64_t w = 0; w < kBucketSize; w += 8) n += count_flagged(zero_bytes(load_word(d + w)));
  return n;
}

// The lowest empty slot of bucket, or -1 when it is full.
VELOCE_HD int64_t first_empty(const TableRef& t, int64_t bucket) {
  const int64_t base = bucket * kBucketSize;
  for (int64_t w = 0; w < kBucketSize; w += 8) {
    const uint64_t m = zero_bytes(load_word(t.digests + base + w));
    if (m != 0) return base + w + lowest_byte(m);
  }
  return -1;
}

// Where a new key goes: the lowest empty slot of the emptier bucket (bucket_a on a tie),
// or -1 when both buckets are full.
VELOCE_HD int64_t insert_slot(const TableRef& t, const Probe& p) {
  const int ea = count_empty(t, p.bucket_a);
  const int eb = p.bucket_b == p.bucket_a ? 0 : count_empty(t, p.bucket_b);
  if (ea == 0 && eb == 0) return -1;
  return first_empty(t, ea >= eb ? p.bucket_a : p.bucket_b);
}

}  // namespace veloce
