// CPU kernels of the embedding family: pooled_lookup (forward), accumulate_grad (the
// backward w.r.t. the table rows, reduced per unique slot), the fused
// accumulate_and_update, and bag_layouts_bad (the offsets' check). Semantics: docs/ops.md.
//
// Data enters as slots (N,) + offsets (B,) or (B+1,); rows are read from weights (C, D)
// or extra_rows (M, D). pooled_lookup writes (B, D); accumulate_grad sorts the valid
// (slot, position) pairs with a stable radix sort and sums each slot's segment in
// position order, so its result does not depend on the number of threads.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <utility>
#include <vector>

#include "veloce/check.h"
#include "veloce/op_checks.h"
#include "veloce/optim/registry.h"
#include "veloce/hash.h"

namespace veloce {
namespace {

constexpr int64_t kSum = 0;
constexpr int64_t kPrefetch = 8;  // positions (rows) ahead to prefetch in random row accesses
constexpr int64_t kMean = 1;

// End (exclusive) of bag b: offsets[b + 1], or n for the last bag without include_last_offset.
inline int64_t bag_end(const int64_t* offsets, int64_t num_offsets, int64_t b, int64_t n) {
  return b + 1 < num_offsets ? offsets[b + 1] : n;
}

// ---- summing gathered rows -------------------------------------------------------------

// A bag's rows (or a backward segment's gradient rows) are summed in chunks of up to kChunk
// rows. A first pass resolves positions to row pointers (and scales) until the chunk is
// full, skipping padding and zero rows and prefetching rows ahead; the sum then runs kCols
// columns at a time, the block's sums in registers (a local array of compile-time size),
// adding each row with a few vector instructions and nothing else (sums kept in a buffer of
// D in memory would make each add of a row wait for the previous row's store). Each column's additions are those of a plain
// loop over the positions, in position order: the results are the same, bit for bit.
constexpr int kChunk = 32;
// The rows of a chunk stay in L1 while its column blocks pass over them: wide rows take
// fewer positions per chunk (32 up to 512 bytes a row, 1 from 16 KiB).
inline int chunk_rows(int64_t row_bytes) {
  constexpr int64_t kChunkBytes = 16 * 1024;
  return static_cast<int>(std::clamp<int64_t>(kChunkBytes / std::max<int64_t>(row_bytes, 1), 1, kChunk));
}
template <typename acc_t>
constexpr int kCols = static_cast<int>(64 / sizeof(acc_t));  // 4 SSE registers, 1 AVX-512 one

template <typename acc_t, int W>
struct ColBlock {
  static constexpr int kWidth = W;
  acc_t v[W];
};

// Calls f(std::integral_constant<int, W>{}, c) for blocks [c, c + W) covering [0, D): full
// blocks of W = Full, then the remainder as power-of-two widths (Full / 2, ..., 1).
template <int W, int Full, typename F>
inline void column_blocks(int64_t c, int64_t D, const F& f) {
  if constexpr (W == Full) {
    for (; c + W <= D; c += W) f(std::integral_constant<int, W>{}, c);
  } else if (c + W <= D) {
    f(std::integral_constant<int, W>{}, c);
    c += W;
  }
  if constexpr (W > 1) column_blocks<W / 2, Full>(c, D, f);
}

// Adds rows[0..n) (times scale[k] when kScaled) to the sums of the earlier chunks (acc, or
// zeros when kFirst), column block by column block. The sums go back to acc, or, for the
// last chunk (kLast), to done(c, block).
template <bool kScaled, bool kFirst, bool kLast, typename acc_t, typename scalar_t, typename Done>
inline void sum_chunk(const scalar_t* const* rows, const acc_t* scale, int n, int64_t D, acc_t* acc,
                      const Done& done) {
  column_blocks<kCols<acc_t>, kCols<acc_t>>(0, D, [&](auto width, int64_t c) {
    constexpr int W = decltype(width)::value;
    ColBlock<acc_t, W> a;
    for (int j = 0; j < W; ++j) a.v[j] = kFirst ? acc_t(0) : acc[c + j];
    for (int k = 0; k < n; ++k) {
      const scalar_t* __restrict__ r = rows[k] + c;
      if constexpr (kScaled) {
        const acc_t w = scale[k];
        for (int j = 0; j < W; ++j) a.v[j] += w * static_cast<acc_t>(r[j]);
      } else {
        for (int j = 0; j < W; ++j) a.v[j] += static_cast<acc_t>(r[j]);
      }
    }
    if constexpr (kLast) {
      done(c, a);
    } else {
      for (int j = 0; j < W; ++j) acc[c + j] = a.v[j];
    }
  });
}

// sum_chunk with its flags given at run time.
template <typename acc_t, typename scalar_t, typename Done>
inline void sum_chunk(bool scaled, bool first, bool last, const scalar_t* const* rows, const acc_t* scale, int n,
                      int64_t D, acc_t* acc, const Done& done) {
  auto run = [&](auto kScaled) {
    constexpr bool S = decltype(kScaled)::value;
    if (first && last) {
      sum_chunk<S, true, true>(rows, scale, n, D, acc, done);
    } else if (first) {
      sum_chunk<S, true, false>(rows, scale, n, D, acc, done);
    } else if (last) {
      sum_chunk<S, false, true>(rows, scale, n, D, acc, done);
    } else {
      sum_chunk<S, false, false>(rows, scale, n, D, acc, done);
    }
  };
  if (scaled) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

// Prefetches the cache lines of bytes at p, to read (kWrite = 0) or to write (1).
template <int kWrite = 0>
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, kWrite);
}

// ---- pooled_lookup -------------------------------------------------------------------

template <typename scalar_t>
void pooled_lookup_kernel(const scalar_t* weights,  // (C, D)
                          int64_t C,
                          const scalar_t* extra,  // (M, D) or null
                          int64_t D,
                          const int64_t* slots,    // (N,)
                          const int64_t* offsets,  // (num_offsets,)
                          int64_t num_offsets, int64_t B, int64_t N,
                          const scalar_t* psw,  // (N,) or null
                          bool mean,
                          scalar_t* out) {  // (B, D)
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t avg = B > 0 ? std::max<int64_t>(1, N / B) : 1;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, avg * D));
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  auto row_of = [&](int64_t s) -> const scalar_t* { return s < C ? weights + s * D : extra + (s - C) * D; };
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(D);  // the sums of a bag's earlier chunks
    const scalar_t* rows[kChunk];
    acc_t scale[kChunk];
    const int chunk = chunk_rows(row_bytes);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t stop = bag_end(offsets, num_offsets, b, N);
      scalar_t* __restrict__ o = out + b * D;
      int64_t i = offsets[b], count = 0;
      bool first = true, last = false;
      while (!last) {
        int n = 0;
        for (; i < stop && n < chunk; ++i) {
          // Prefetch a row a few positions ahead: the table is much larger than the cache.
          if (i + kPrefetch < N) {
            const int64_t sp = slots[i + kPrefetch];
            if (sp >= 0) prefetch_row(row_of(sp), row_bytes);
          }
          const int64_t s = slots[i];
          if (s == kPaddingSlot) continue;
          ++count;
          if (s == kZeroSlot) continue;
          rows[n] = row_of(s);
          if (psw != nullptr) scale[n] = static_cast<acc_t>(psw[i]);
          ++n;
        }
        last = i >= stop;  // else the chunk is full
        if (mean && last && count > 0) {
          const acc_t divisor = static_cast<acc_t>(count);
          sum_chunk(psw != nullptr, first, last, rows, scale, n, D, acc.data(), [&](int64_t c, const auto& a) {
            for (int j = 0; j < a.kWidth; ++j) o[c + j] = static_cast<scalar_t>(a.v[j] / divisor);
          });
        } else {
          sum_chunk(psw != nullptr, first, last, rows, scale, n, D, acc.data(), [&](int64_t c, const auto& a) {
            for (int j = 0; j < a.kWidth; ++j) o[c + j] = static_cast<scalar_t>(a.v[j]);
          });
        }
        first = false;
      }
    }
  });
}

// One table's lookup, its arguments checked except offsets and slot values (`op`: the
// name its errors give).
at::Tensor pooled_lookup_one(const char* op, const at::Tensor& weights, const at::Tensor& slots,
                             const at::Tensor& offsets, const c10::optional<at::Tensor>& per_sample_weights,
                             int64_t mode, bool include_last_offset, const c10::optional<at::Tensor>& extra_rows,
                             int64_t M) {
  const int64_t C = weights.size(0);
  const int64_t D = weights.size(1);
  const int64_t N = slots.numel();
  const int64_t B = check_offsets(op, offsets, N, include_last_offset);

  const at::Tensor s = slots.contiguous();
  const at::Tensor o = offsets.contiguous();
  check_slot_values(op, s.data_ptr<int64_t>(), N, C + M,
                    M > 0 ? "weights.size(0) + extra_rows.size(0)" : "weights.size(0)");
  const at::Tensor w = weights.contiguous();
  const at::Tensor e = extra_rows.has_value() ? extra_rows->contiguous() : at::Tensor();
  const at::Tensor p = per_sample_weights.has_value() ? per_sample_weights->contiguous() : at::Tensor();
  at::Tensor out = at::empty({B, D}, weights.options());
  if (B == 0 || D == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "pooled_lookup_cpu", [&] {
    pooled_lookup_kernel<scalar_t>(w.data_ptr<scalar_t>(), C, e.defined() ? e.data_ptr<scalar_t>() : nullptr, D,
                                   s.data_ptr<int64_t>(), o.data_ptr<int64_t>(), o.numel(), B, N,
                                   p.defined() ? p.data_ptr<scalar_t>() : nullptr, mode == kMean,
                                   out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor pooled_lookup_cpu(const at::Tensor& weights, const at::Tensor& slots, const at::Tensor& offsets,
                             const c10::optional<at::Tensor>& per_sample_weights, int64_t mode,
                             bool include_last_offset, const c10::optional<at::Tensor>& extra_rows,
                             bool /*check_inputs: the checks read host memory, no sync to save*/) {
  constexpr const char* op = "veloce::pooled_lookup";
  const int64_t M = check_pooled_lookup_args(op, weights, slots, offsets, per_sample_weights, mode, extra_rows);
  return pooled_lookup_one(op, weights, slots, offsets, per_sample_weights, mode, include_last_offset, extra_rows, M);
}

// pooled_lookup over K tables: the specification of the grouped op (the CUDA one serves
// every table in one launch), here table after table.
std::vector<at::Tensor> pooled_lookup_many_cpu(at::TensorList weights, at::TensorList slots, at::TensorList offsets,
                                               const c10::List<std::optional<at::Tensor>>& per_sample_weights,
                                               at::IntArrayRef mode, bool include_last_offset,
                                               const c10::List<std::optional<at::Tensor>>& extra_rows,
                                               bool /*check_inputs: as pooled_lookup_cpu*/) {
  std::vector<int64_t> M;
  const std::vector<std::string> names = check_pooled_lookup_many_args(
      "veloce::pooled_lookup_many", weights, slots, offsets, per_sample_weights, mode, extra_rows, M);
  std::vector<at::Tensor> out;
  out.reserve(weights.size());
  for (size_t k = 0; k < weights.size(); ++k) {
    out.push_back(pooled_lookup_one(names[k].c_str(), weights[k], slots[k], offsets[k], per_sample_weights.get(k),
                                    mode[k], include_last_offset, extra_rows.get(k), M[k]));
  }
  return out;
}

// ---- accumulate_grad -----------------------------------------------------------------

int bit_width(uint64_t x) { return x == 0 ? 0 : 64 - __builtin_clzll(x); }

// Stable LSD radix sort of `a` on bits [lo, lo + bits). `tmp` is scratch of the same size.
// Parallel over contiguous chunks: per-chunk histograms, then each chunk scatters into
// its precomputed ranges, so the output is the same for any number of threads.
void radix_sort(std::vector<uint64_t>& a, std::vector<uint64_t>& tmp, int lo, int bits) {
  const int64_t n = static_cast<int64_t>(a.size());
  if (bits <= 0 || n <= 1) return;
  const int passes = (bits + 10) / 11;
  const int digit = (bits + passes - 1) / passes;
  const int64_t radix = int64_t{1} << digit;
  const int64_t chunk_min = 1 << 16;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / chunk_min));
  const int64_t chunk = (n + chunks - 1) / chunks;
  std::vector<int64_t> hist(chunks * radix);
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = lo + pass * digit;
    const uint64_t mask = static_cast<uint64_t>(radix - 1);
    const uint64_t* src = a.data();
    uint64_t* dst = tmp.data();
    std::fill(hist.begin(), hist.end(), 0);
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        int64_t* h = hist.data() + c * radix;
        const int64_t e = std::min(n, (c + 1) * chunk);
        for (int64_t i = c * chunk; i < e; ++i) ++h[(src[i] >> shift) & mask];
      }
    });
    // Exclusive scan in (digit, chunk) order: stable across chunks.
    int64_t sum = 0;
    for (int64_t d = 0; d < radix; ++d) {
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t v = hist[c * radix + d];
        hist[c * radix + d] = sum;
        sum += v;
      }
    }
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        int64_t* h = hist.data() + c * radix;
        const int64_t e = std::min(n, (c + 1) * chunk);
        for (int64_t i = c * chunk; i < e; ++i) dst[h[(src[i] >> shift) & mask]++] = src[i];
      }
    });
    a.swap(tmp);
  }
}

// The positions of a backward pass grouped by slot: entries (slot << pos_bits | low)
// where low is the position, or, when no per-sample weight needs the position
// (by_bag), directly the position's bag, which saves a dependent random read per entry.
// Either way bags grow with positions, so a slot's entries are summed in position order
// sorted stably by slot, so each slot's positions are in position order.
struct Segments {
  std::vector<uint64_t> entries;   // (K,) valid positions only
  std::vector<int64_t> starts;     // (U + 1,) segment bounds in entries
  std::vector<int64_t> bag_of;     // (N,) bag of each position
  int pos_bits = 0;
  uint64_t pos_mask = 0;
  bool by_bag = false;
  int64_t U = 0;
  int64_t slot(int64_t u) const { return static_cast<int64_t>(entries[starts[u]] >> pos_bits); }
};

Segments build_segments(const char* op, const int64_t* s, int64_t N, const int64_t* o, int64_t num_offsets,
                        int64_t B, int64_t num_rows, bool by_bag) {
  Segments seg;
  seg.by_bag = by_bag;
  seg.bag_of.resize(N);
  at::parallel_for(0, B, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t stop = bag_end(o, num_offsets, b, N);
      for (int64_t i = o[b]; i < stop; ++i) seg.bag_of[i] = b;
    }
  });
  seg.pos_bits = std::max(1, bit_width(static_cast<uint64_t>(by_bag ? B : N)));
  const int slot_bits = bit_width(static_cast<uint64_t>(std::max<int64_t>(num_rows - 1, 0)));
  TORCH_CHECK(seg.pos_bits + slot_bits <= 64, op, ": too many ids (", N, ") for a table of ", num_rows,
              " rows; split the batch");
  seg.pos_mask = (uint64_t{1} << seg.pos_bits) - 1;
  // Pack valid positions in position order: per-chunk counts, then parallel writes.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N >> 16));
  const int64_t chunk = (N + chunks - 1) / std::max<int64_t>(chunks, 1);
  std::vector<int64_t> base(chunks + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t k = 0;
      for (int64_t i = c * chunk, e = std::min(N, (c + 1) * chunk); i < e; ++i) k += (s[i] >= 0 && s[i] < num_rows);
      base[c + 1] = k;
    }
  });
  for (int64_t c = 0; c < chunks; ++c) base[c + 1] += base[c];
  const int64_t K = base[chunks];
  seg.entries.resize(K);
  std::vector<uint64_t> scratch(K);
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      uint64_t* out = seg.entries.data() + base[c];
      for (int64_t i = c * chunk, e = std::min(N, (c + 1) * chunk); i < e; ++i) {
        const int64_t v = s[i];
        const uint64_t low = static_cast<uint64_t>(by_bag ? seg.bag_of[i] : i);
        if (v >= 0 && v < num_rows) *out++ = (static_cast<uint64_t>(v) << seg.pos_bits) | low;
      }
    }
  });
  radix_sort(seg.entries, scratch, seg.pos_bits, slot_bits);
  // Segment starts: where the slot changes.
  const uint64_t* e = seg.entries.data();
  const int pb = seg.pos_bits;
  seg.starts.resize(K + 1);
  int64_t U = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (k == 0 || (e[k] >> pb) != (e[k - 1] >> pb)) seg.starts[U++] = k;
  }
  seg.starts.resize(U + 1);
  seg.U = U;
  seg.starts[U] = K;
  return seg;
}

// 1 / (non-padding count) of each bag, for mean pooling.
template <typename acc_t>
std::vector<acc_t> mean_scales(const int64_t* s, const int64_t* o, int64_t num_offsets, int64_t B, int64_t N) {
  std::vector<acc_t> scale(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t stop = bag_end(o, num_offsets, b, N);
    int64_t count = 0;
    for (int64_t i = o[b]; i < stop; ++i) count += (s[i] != kPaddingSlot);
    scale[b] = count > 0 ? acc_t(1) / static_cast<acc_t>(count) : acc_t(0);
  }
  return scale;
}

// For each segment u (in parallel): a = the summed gradient of its slot, in position
// order; then sink(u, a). Deterministic for any number of threads. ahead(v) is called
// kPrefetch segments before segment v is reduced (to prefetch what sink(v) touches).
template <typename scalar_t, typename Sink, typename Ahead>
void reduce_segments(const Segments& seg, const scalar_t* grad_output,  // (B, D)
                     int64_t D, const scalar_t* psw,                     // (N,) or null
                     const at::opmath_type<scalar_t>* bag_scale,         // (B,) or null (mean)
                     const Sink& sink, const Ahead& ahead) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t U = seg.U;
  const int64_t num_entries = seg.starts[U];
  const uint64_t* entries = seg.entries.data();
  const int64_t* starts = seg.starts.data();
  const int64_t* bag_of = seg.bag_of.data();
  const int64_t avg = U > 0 ? std::max<int64_t>(1, num_entries / U) : 1;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, avg * D));
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  const bool scaled = psw != nullptr || bag_scale != nullptr;
  at::parallel_for(0, U, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(D);
    acc_t* a = acc.data();
    const scalar_t* rows[kChunk];
    acc_t scale[kChunk];
    const int chunk = chunk_rows(row_bytes);
    for (int64_t u = begin; u < end; ++u) {
      if (u + kPrefetch < end) ahead(u + kPrefetch);
      const int64_t stop = starts[u + 1];
      int64_t k = starts[u];
      bool first = true, last = false;
      while (!last) {
        int n = 0;
        for (; k < stop && n < chunk; ++k, ++n) {
          if (k + kPrefetch < num_entries) {  // gradient rows are read in slot order: random
            const int64_t lp = static_cast<int64_t>(entries[k + kPrefetch] & seg.pos_mask);
            prefetch_row(grad_output + (seg.by_bag ? lp : bag_of[lp]) * D, row_bytes);
          }
          const int64_t pos = static_cast<int64_t>(entries[k] & seg.pos_mask);  // a bag if by_bag
          const int64_t b = seg.by_bag ? pos : bag_of[pos];
          rows[n] = grad_output + b * D;
          if (scaled) scale[n] = psw != nullptr ? static_cast<acc_t>(psw[pos]) : bag_scale[b];
        }
        last = k >= stop;
        // Every chunk's sums go back to a, the last one's too: sink reads the whole row there.
        sum_chunk(scaled, first, /*last=*/false, rows, scale, n, D, a, [](int64_t, const auto&) {});
        first = false;
      }
      sink(u, a);
    }
  });
}

// Runs fn.template operator()<scalar_t>(seg, g, psw, scale) over the backward inputs.
template <typename Fn>
void with_backward(const char* op, const at::Tensor& grad_output, const at::Tensor& slots, const at::Tensor& offsets,
                   const c10::optional<at::Tensor>& per_sample_weights, int64_t mode, int64_t B, int64_t num_rows,
                   const Fn& fn) {
  const at::Tensor s_t = slots.contiguous();
  const at::Tensor o_t = offsets.contiguous();
  const int64_t* s = s_t.data_ptr<int64_t>();
  const int64_t* o = o_t.data_ptr<int64_t>();
  const int64_t N = s_t.numel();
  check_slot_values(op, s, N, -1, "");
  const Segments seg = build_segments(op, s, N, o, o_t.numel(), B, num_rows, !per_sample_weights.has_value());
  const at::Tensor g = grad_output.contiguous();
  const at::Tensor p = per_sample_weights.has_value() ? per_sample_weights->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_output.scalar_type(), "veloce_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> scale;
    if (mode == kMean) scale = mean_scales<acc_t>(s, o, o_t.numel(), B, N);
    fn(seg, g.data_ptr<scalar_t>(), p.defined() ? p.data_ptr<scalar_t>() : nullptr,
       mode == kMean ? scale.data() : nullptr);
  });
}

std::tuple<at::Tensor, at::Tensor> accumulate_grad_cpu(const at::Tensor& grad_output, const at::Tensor& slots,
                                                       const at::Tensor& offsets,
                                                       const c10::optional<at::Tensor>& per_sample_weights,
                                                       int64_t mode, bool include_last_offset, int64_t num_rows) {
  constexpr const char* op = "veloce::accumulate_grad";
  const int64_t B = check_backward_args(op, grad_output, slots, offsets, per_sample_weights, mode, include_last_offset);
  check_num_rows(op, num_rows);
  const int64_t D = grad_output.size(1);
  at::Tensor unique_slots, grad_rows;
  with_backward(op, grad_output, slots, offsets, per_sample_weights, mode, B, num_rows,
                [&](const Segments& seg, const auto* g, const auto* psw, const auto* scale) {
                  using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
                  unique_slots = at::empty({seg.U}, slots.options());
                  int64_t* us = unique_slots.data_ptr<int64_t>();
                  for (int64_t u = 0; u < seg.U; ++u) us[u] = seg.slot(u);
                  grad_rows = at::empty({seg.U, D}, grad_output.options());
                  if (seg.U == 0 || D == 0) return;
                  scalar_t* out = grad_rows.data_ptr<scalar_t>();
                  reduce_segments<scalar_t>(
                      seg, g, D, psw, scale,
                      [&](int64_t u, const auto* a) {
                        scalar_t* __restrict__ row = out + u * D;
                        for (int64_t j = 0; j < D; ++j) row[j] = static_cast<scalar_t>(a[j]);
                      },
                      [](int64_t) {});
                });
  return {unique_slots, grad_rows};
}

// accumulate_grad and sparse_update in one pass: each unique row's gradient is summed in
// registers and applied at once, never written out (no (U, D) buffer). Arguments checked
// by the caller but for the slot values (with_backward checks those); `op` names the
// table in messages. extra_rows / extra_state (checked, or undefined): the rows of slots
// C, C + 1, ... past the table's C rows.
void fused_update(const char* op, const at::Tensor& weights, const at::Tensor& opt_state,
                  const at::Tensor& grad_output, const at::Tensor& slots, const at::Tensor& offsets,
                  const c10::optional<at::Tensor>& per_sample_weights, int64_t mode, int64_t B, int64_t optimizer,
                  const double* hparams, const at::Tensor& extra_rows, const at::Tensor& extra_state) {
  const int64_t D = weights.size(1);
  const int64_t S = opt_state.size(1);
  const int64_t C = weights.size(0);
  const int64_t E = extra_rows.defined() ? extra_rows.size(0) : 0;
  with_backward(op, grad_output, slots, offsets, per_sample_weights, mode, B, C + E,
                [&](const Segments& seg, const auto* g, const auto* psw, const auto* scale) {
                  using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
                  using acc_t = at::opmath_type<scalar_t>;
                  if (seg.U == 0 || D == 0) return;
                  scalar_t* const w = weights.data_ptr<scalar_t>();
                  acc_t* const st = opt_state.data_ptr<acc_t>();
                  scalar_t* const ew = E > 0 ? extra_rows.data_ptr<scalar_t>() : nullptr;
                  acc_t* const est = E > 0 ? extra_state.data_ptr<acc_t>() : nullptr;
                  // The row and state of a slot: the table's, or past its C rows an extra row.
                  auto row = [&](int64_t slot) { return slot < C ? w + slot * D : ew + (slot - C) * D; };
                  auto state = [&](int64_t slot) { return slot < C ? st + slot * S : est + (slot - C) * S; };
                  optim::dispatch(optimizer, [&](auto rule) {
                    using R = decltype(rule);
                    const auto p = R::template make<acc_t>(hparams);
                    reduce_segments<scalar_t>(
                        seg, g, D, psw, scale,
                        [&](int64_t u, acc_t* a) {
                          const int64_t slot = seg.slot(u);
                          optim::apply_row<R>(p, row(slot), state(slot), a, D);
                        },
                        [&](int64_t v) {  // the rows the update of segment v reads and writes
                          const int64_t slot = seg.slot(v);
                          prefetch_row<1>(row(slot), D * sizeof(scalar_t));
                          prefetch_row<1>(state(slot), S * sizeof(acc_t));
                        });
                  });
                });
}

// The skip argument of accumulate_and_update(_many), checked and read (a host read on the CPU).
// ref_name names `weights` in the message as the CUDA kernel does ("weights" or "weights[0]").
bool skipped(const char* op, const std::optional<at::Tensor>& skip, const char* ref_name, const at::Tensor& weights) {
  if (!skip.has_value()) return false;
  check_flag(op, "skip", *skip, ref_name, weights);
  return skip->item<bool>();
}

void accumulate_and_update_cpu(const at::Tensor& weights, const at::Tensor& opt_state,
                               const at::Tensor& grad_output, const at::Tensor& slots, const at::Tensor& offsets,
                               const c10::optional<at::Tensor>& per_sample_weights, int64_t mode,
                               bool include_last_offset, int64_t optimizer, const at::Tensor& hparams,
                               bool /*check_inputs: the checks read host memory, no sync to save*/,
                               const std::optional<at::Tensor>& skip, const std::optional<at::Tensor>& extra_rows,
                               const std::optional<at::Tensor>& extra_state) {
  constexpr const char* op = "veloce::accumulate_and_update";
  check_update_args(op, weights, opt_state, optimizer, hparams);
  check_hparam_values(op, hparams, optimizer);
  const int64_t B = check_backward_args(op, grad_output, slots, offsets, per_sample_weights, mode, include_last_offset);
  check_grad_output_for_weights(op, grad_output, weights);
  check_extra_update(op, weights, opt_state, extra_rows, extra_state);
  if (skipped(op, skip, "weights", weights)) return;
  const at::Tensor h = hparams.contiguous();
  fused_update(op, weights, opt_state, grad_output, slots, offsets, per_sample_weights, mode, B, optimizer,
               h.data_ptr<double>(), extra_rows.value_or(at::Tensor()), extra_state.value_or(at::Tensor()));
}

// accumulate_and_update over K tables: the specification of the grouped op (the CUDA one
// applies every table in one sort and one kernel), here table after table, since the CPU
// has no launches to save. Every table is checked before any is written: a rejected call
// changes nothing.
void accumulate_and_update_many_cpu(at::TensorList weights, at::TensorList opt_state, at::TensorList grad_output,
                                    at::TensorList slots, at::TensorList offsets,
                                    const c10::List<std::optional<at::Tensor>>& per_sample_weights, int64_t mode,
                                    bool include_last_offset, int64_t optimizer, const at::Tensor& hparams,
                                    bool /*check_inputs: as accumulate_and_update_cpu*/,
                                    const std::optional<at::Tensor>& skip,
                                    const std::optional<at::TensorList>& extra_rows,
                                    const std::optional<at::TensorList>& extra_state) {
  constexpr const char* op = "veloce::accumulate_and_update_many";
  const ManyTables tables = check_update_many_args(op, weights, opt_state, grad_output, slots, offsets,
                                                   per_sample_weights, mode, include_last_offset, optimizer, hparams,
                                                   extra_rows, extra_state);
  if (!weights.empty()) check_hparam_values(op, hparams, optimizer);
  const size_t K = weights.size();
  for (size_t k = 0; k < K; ++k) {
    const char* name = tables.names[k].c_str();
    check_offsets(name, offsets[k], slots[k].numel(), include_last_offset);
    const at::Tensor s = slots[k].contiguous();
    check_slot_values(name, s.data_ptr<int64_t>(), s.numel(), -1, "");
  }
  if (K > 0 && skipped(op, skip, "weights[0]", weights[0])) return;
  const at::Tensor h = K > 0 ? hparams.contiguous() : at::Tensor();
  for (size_t k = 0; k < K; ++k) {
    fused_update(tables.names[k].c_str(), weights[k], opt_state[k], grad_output[k], slots[k], offsets[k],
                 per_sample_weights.get(k), mode, tables.num_bags[k], optimizer, h.data_ptr<double>(),
                 extra_rows ? (*extra_rows)[k] : at::Tensor(), extra_state ? (*extra_state)[k] : at::Tensor());
  }
}

// ---- bag_layouts_bad ---------------------------------------------------------------------

// Whether offsets o (len >= 1 entries) breaks a rule for n ids (see the schema in ops.cpp).
bool layout_bad(const int64_t* o, int64_t len, int64_t n, bool include_last_offset) {
  if (o[0] != 0 || o[len - 1] > n || (include_last_offset && o[len - 1] != n)) return true;
  return at::parallel_reduce(
      1, len, at::internal::GRAIN_SIZE, false,
      [&](int64_t begin, int64_t end, bool bad) {
        for (int64_t i = begin; i < end; ++i) bad |= o[i] < o[i - 1];  // vectorizes: no early exit
        return bad;
      },
      [](bool a, bool b) { return a || b; });
}

at::Tensor bag_layouts_bad_cpu(at::TensorList offsets, at::IntArrayRef num_ids, at::IntArrayRef include_last_offset) {
  constexpr const char* op = "veloce::bag_layouts_bad";
  bool bad = check_bag_layouts_args(op, offsets, num_ids, include_last_offset);
  for (size_t k = 0; k < offsets.size() && !bad; ++k) {
    const at::Tensor o = offsets[k].contiguous();
    if (o.numel() > 0) bad = layout_bad(o.data_ptr<int64_t>(), o.numel(), num_ids[k], include_last_offset[k] != 0);
  }
  return at::full({1}, bad, offsets[0].options().dtype(at::kBool));
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CPU, m) {
  m.impl("bag_layouts_bad", &veloce::bag_layouts_bad_cpu);
  m.impl("pooled_lookup", &veloce::pooled_lookup_cpu);
  m.impl("pooled_lookup_many", &veloce::pooled_lookup_many_cpu);
  m.impl("accumulate_grad", &veloce::accumulate_grad_cpu);
  m.impl("accumulate_and_update", &veloce::accumulate_and_update_cpu);
  m.impl("accumulate_and_update_many", &veloce::accumulate_and_update_many_cpu);
}
