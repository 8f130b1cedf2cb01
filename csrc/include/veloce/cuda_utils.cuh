// Helpers shared by the CUDA kernels (csrc/cuda/*.cu): launch plumbing, CUB temporary
// storage, 16-byte vector packs, the SWAR digest match of a 32-slot bucket, and the
// argument checks that the CUDA kernels share with the CPU ones (same messages).
//
// Device-side table layout: a bucket's 32 digests are 32 bytes (one sector), loaded as
// two 16-byte vectors and compared 4 bytes at a time with __vcmpeq4; keys are confirmed
// only on a digest match (keys live in their own array).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <vector>

#include "veloce/check.h"
#include "veloce/hash.h"
#include "veloce/init.h"

namespace veloce {
namespace cuda {

constexpr int kThreads = 256;
constexpr unsigned kFullWarp = 0xffffffffu;  // every lane of a warp, for the *_sync intrinsics

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of kThreads covering n threads (n > 0).
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  return static_cast<unsigned>(ceil_div(n, threads));
}

// The current stream (what at::cuda::getCurrentCUDAStream returns; the c10 header avoids
// ATen/cuda/CUDAContext.h, which needs the cuSPARSE/cuBLAS headers).
inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

// The current device's number of SMs (asked once per device): sizes grid-stride launches.
inline int num_sms() {
  static std::vector<std::atomic<int>> cache(static_cast<size_t>(c10::cuda::device_count()));
  const auto dev = static_cast<size_t>(c10::cuda::current_device());
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, static_cast<int>(dev)));
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// How many blocks of kThreads of `Kernel` fit on one SM of the current device at once (its
// registers and shared memory allowing; asked once per device and kernel): sizes
// grid-stride launches to a few waves of resident blocks.
template <auto Kernel>
int resident_blocks_per_sm() {
  static std::vector<std::atomic<int>> cache(static_cast<size_t>(c10::cuda::device_count()));
  const auto dev = static_cast<size_t>(c10::cuda::current_device());
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0));
    n = std::max(n, 1);
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Many arrays in one allocation (one call of the caching allocator instead of one per
// array: each costs microseconds of host time on the step's critical path): add() reserves
// (16-aligned), allocate() makes the buffer (or bind() places the arena in a part of a
// shared one), ptr()/view() give each array.
class Arena {
 public:
  template <typename T>
  int64_t add(int64_t count) {
    return add_bytes(count * static_cast<int64_t>(sizeof(T)));
  }
  int64_t add_bytes(int64_t bytes) {
    const int64_t off = ceil_div(size_, 16) * 16;
    size_ = off + bytes;
    return off;
  }
  int64_t bytes() const { return ceil_div(size_, 16) * 16; }  // a 16-byte multiple: arenas can follow
  void allocate(const at::TensorOptions& o) { bind(at::empty({std::max<int64_t>(size_, 1)}, o.dtype(at::kByte)), 0); }
  // The arena's arrays live in buf from byte `base` on (16-aligned); buf is kept alive.
  void bind(at::Tensor buf, int64_t base) {
    buf_ = std::move(buf);
    base_ = base;
  }
  template <typename T>
  T* ptr(int64_t off) const {
    return reinterpret_cast<T*>(buf_.data_ptr<uint8_t>() + base_ + off);
  }
  at::Tensor view(int64_t off, int64_t count, at::ScalarType t) const {
    return buf_.narrow(0, base_ + off, count * static_cast<int64_t>(c10::elementSize(t))).view(t);
  }

 private:
  int64_t size_ = 0, base_ = 0;
  at::Tensor buf_;
};

// Runs a CUB device-wide algorithm twice (size query, then work), its temporary storage
// taken from the caching allocator. f(void* temp, size_t& bytes) -> cudaError_t.
template <typename F>
void cub_call(const at::Tensor& like, F&& f) {
  size_t bytes = 0;
  C10_CUDA_CHECK(f(nullptr, bytes));
  at::Tensor temp = at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, like.options().dtype(at::kByte));
  C10_CUDA_CHECK(f(temp.data_ptr(), bytes));
}

// Bits needed to hold x (0 for 0): the end_bit of a radix sort of keys <= x.
inline int bit_width(uint64_t x) { return x == 0 ? 0 : 64 - __builtin_clzll(x); }

// The bag of position i of N: the largest b < B with offsets[b] <= i (offsets[0] = 0 <= i < N,
// B > 0). The search starts at the bag i would be in if all bags had the same length
// (exact for bags of one id, or of any fixed length: two loads) and gallops from there,
// so it costs O(log distance) loads instead of log2(B) dependent ones.
__device__ __forceinline__ int64_t bag_of_position(const int64_t* __restrict__ offsets, int64_t B, int64_t N,
                                                   int64_t i) {
  if (B <= 1) return 0;  // no search (and no load: B = 0 has no offsets)
  int64_t lo, hi;  // invariant: offsets[lo] <= i and (hi == B or offsets[hi] > i)
  const int64_t guess = min(B - 1, static_cast<int64_t>(static_cast<double>(i) * B / N));
  if (offsets[guess] <= i) {
    lo = guess;
    int64_t step = 1;
    for (hi = lo + 1; hi < B && offsets[hi] <= i; hi = lo + step) {
      lo = hi;
      step *= 2;
    }
    hi = min(hi, B);
  } else {
    hi = guess;
    int64_t step = 1;
    for (lo = hi - 1; lo > 0 && offsets[lo] > i; lo = hi - step) {
      hi = lo;
      step *= 2;
    }
    lo = max(lo, int64_t{0});
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid] <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The largest k < K with base[k] <= x: the table (or tensor, or layout) of K laid end to
// end that holds key, position, bag or element x (base is non-decreasing with base[0] = 0
// <= x; one that holds nothing shares its successor's base and never holds x). No loop for
// K = 1.
template <typename T>
__device__ __forceinline__ int segment_of(const T* base, int K, int64_t x) {
  int lo = 0, hi = K;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (static_cast<int64_t>(base[mid]) <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Lanes given to one row of D elements read V at a time: a power of two <= 32.
inline int lanes_for(int64_t D, int V) {
  const int64_t need = ceil_div(std::max<int64_t>(D, 1), V);
  int g = 1;
  while (g < 32 && g < need) g <<= 1;
  return g;
}

// The shuffle mask of this thread's group of `lanes` consecutive lanes (a power of two <= 32)
// within its warp: groups of one warp may then diverge (blockDim.x a multiple of 32).
__device__ __forceinline__ unsigned group_mask(int lanes) {
  const int first = static_cast<int>(threadIdx.x & 31) & ~(lanes - 1);
  return lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u) << first;
}

// ---- vector packs --------------------------------------------------------------------

// V elements of T read or written as one (or, above 16 bytes, several) wide access.
template <typename T, int V>
struct alignas(sizeof(T) * V <= 16 ? sizeof(T) * V : 16) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& x) {
  *reinterpret_cast<Pack<T, V>*>(p) = x;
}

// Elements per 16-byte access.
template <typename T>
constexpr int vec16() {
  return static_cast<int>(16 / sizeof(T));
}

// Rows of D elements can be read V = vec16<T>() at a time: D allows it and every row
// pointer (null ones skipped) is 16-byte aligned.
template <typename T>
bool can_vectorize(int64_t D, std::initializer_list<const void*> ptrs) {
  if (D % vec16<T>() != 0) return false;
  for (const void* p : ptrs) {
    if (p != nullptr && !aligned16(p)) return false;
  }
  return true;
}

// ---- bucket probing (device) ---------------------------------------------------------

// The 32 digests of one bucket as 8 little-endian words (byte i of word k = slot 4k + i).
struct BucketDigests {
  uint32_t w[8];
};

// kFresh: read from L2 every time (the insert path, where other threads CAS digests).
template <bool kFresh>
__device__ __forceinline__ BucketDigests load_bucket(const uint8_t* digests, int64_t bucket) {
  const uint4* p = reinterpret_cast<const uint4*>(digests + bucket * kBucketSize);
  const uint4 a = kFresh ? __ldcv(p) : __ldg(p);
  const uint4 b = kFresh ? __ldcv(p + 1) : __ldg(p + 1);
  return {{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}};
}

// One bit per byte: bit i set where byte i of eq is 0xff (eq from __vcmpeq4).
__device__ __forceinline__ uint32_t byte_bits(uint32_t eq) {
  // Bits 7, 15, 23, 31 land on 28..31 without carries: 2^21 + 2^14 + 2^7 + 1.
  return ((eq & 0x80808080u) * 0x00204081u) >> 28;
}

// Bit s of the result is set where slot s of the bucket holds `digest`.
__device__ __forceinline__ uint32_t match_mask(const BucketDigests& d, uint32_t digest) {
  const uint32_t pattern = 0x01010101u * digest;
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) m |= byte_bits(__vcmpeq4(d.w[k], pattern)) << (4 * k);
  return m;
}

__device__ __forceinline__ uint32_t empty_mask(const BucketDigests& d) { return match_mask(d, kEmptyDigest); }

struct DeviceProbe {
  int64_t a, b;  // buckets (b may equal a)
  uint32_t digest;
};

__device__ __forceinline__ DeviceProbe device_probe(int64_t key, int64_t num_buckets) {
  const uint64_t h = table_hash(key);
  return {bucket_a(h, num_buckets), bucket_b(h, num_buckets), digest_of(h)};
}

// The slot of key among the digest matches `m` of bucket, or -1.
__device__ __forceinline__ int64_t confirm(const int64_t* __restrict__ keys, int64_t bucket, uint32_t m,
                                          int64_t key) {
  const int64_t base = bucket * kBucketSize;
  while (m != 0) {
    const int i = __ffs(m) - 1;
    if (__ldg(keys + base + i) == key) return base + i;
    m &= m - 1;
  }
  return -1;
}

// The slot of key, or -1. Both buckets' digests are requested before either is used, so
// the two 32-byte reads overlap; keys are read only on a digest match.
__device__ __forceinline__ int64_t find_slot_device(const int64_t* __restrict__ keys,
                                                    const uint8_t* __restrict__ digests, int64_t num_buckets,
                                                    int64_t key) {
  const DeviceProbe p = device_probe(key, num_buckets);
  const BucketDigests da = load_bucket<false>(digests, p.a);
  const BucketDigests db = load_bucket<false>(digests, p.b);
  const int64_t s = confirm(keys, p.a, match_mask(da, p.digest), key);
  if (s >= 0 || p.b == p.a) return s;
  return confirm(keys, p.b, match_mask(db, p.digest), key);
}

// ---- initial values ------------------------------------------------------------------

// Computed in double, rounded to float, then to the weight dtype (as on CPU).
template <typename scalar_t>
__device__ __forceinline__ scalar_t to_weight(double v) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return v;
  } else {
    return static_cast<scalar_t>(static_cast<float>(v));
  }
}

}  // namespace cuda
}  // namespace veloce
