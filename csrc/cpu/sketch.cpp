// CPU kernels of feature admission (semantics: csrc/ops.cpp, docs/ops.md): sketch_count and
// sketch_admit over the count-min sketch, two parallel passes (every counted position adds
// its sightings to its id's counter in each sketch row, a thread per row; then every
// position reads the minimum of its counters after the whole lookup's adds, saturating them
// at kSketchCountLimit, and sketch_admit decides from it), and admission_tally.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "veloce/check.h"
#include "veloce/sketch.h"

namespace veloce {

namespace {

constexpr int64_t kPrefetch = 16;  // positions ahead whose counters are prefetched

// The adds of sketch_count and sketch_admit: one thread per sketch row, each writing only
// its own row, so they are plain adds rather than atomics (a locked add waits for its cache
// miss before the next starts; plain ones overlap), with the counter kPrefetch positions
// ahead prefetched.
void add_sightings(int32_t* c, const int64_t* id, int64_t n, const bool* take, const int64_t* times,
                   const std::vector<uint64_t>& salts, int64_t depth, int64_t width) {
  at::parallel_for(0, depth, 1, [&](int64_t d_begin, int64_t d_end) {
    for (int64_t d = d_begin; d < d_end; ++d) {
      for (int64_t i = 0; i < n; ++i) {
        if (i + kPrefetch < n) __builtin_prefetch(c + sketch_slot(id[i + kPrefetch], salts[d], d, width), 1);
        if (take != nullptr && !take[i]) continue;
        c[sketch_slot(id[i], salts[d], d, width)] += sketch_add(times, i);
      }
    }
  });
}

// Per position i: out(i, the minimum of its counters after the adds), saturating them at
// kSketchCountLimit.
template <typename Out>
void read_estimates(int32_t* c, const int64_t* id, int64_t n, const std::vector<uint64_t>& salts, int64_t depth,
                    int64_t width, const Out& out) {
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, depth));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int32_t low = kSketchCountLimit;
      for (int64_t d = 0; d < depth; ++d) {
        int32_t* const slot = c + sketch_slot(id[i], salts[d], d, width);
        const int32_t v = __atomic_load_n(slot, __ATOMIC_RELAXED);
        if (v > kSketchCountLimit) __atomic_store_n(slot, kSketchCountLimit, __ATOMIC_RELAXED);
        low = std::min(low, v);
      }
      out(i, low);
    }
  });
}

std::vector<uint64_t> salts_of(int64_t seed, int64_t depth) {
  std::vector<uint64_t> salts(depth);
  for (int64_t d = 0; d < depth; ++d) salts[d] = sketch_salt(seed, d);
  return salts;
}

const bool* bool_ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<bool>() : nullptr; }
const int64_t* long_ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<int64_t>() : nullptr; }
at::Tensor contiguous_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

at::Tensor sketch_count_cpu(at::Tensor& counters, const at::Tensor& ids, int64_t seed,
                            const c10::optional<at::Tensor>& counted, const c10::optional<at::Tensor>& sightings) {
  constexpr const char* op = "veloce::sketch_count";
  check_sketch_count(op, counters, ids, counted, sightings);
  const int64_t n = ids.numel(), depth = counters.size(0), width = counters.size(1);
  at::Tensor estimate = at::empty({n}, ids.options());
  if (n == 0) return estimate;
  const std::vector<uint64_t> salts = salts_of(seed, depth);
  const at::Tensor ids_c = ids.contiguous();
  const at::Tensor counted_c = contiguous_or_undefined(counted);
  const at::Tensor sightings_c = contiguous_or_undefined(sightings);
  int32_t* const c = counters.data_ptr<int32_t>();
  const int64_t* const id = ids_c.data_ptr<int64_t>();
  add_sightings(c, id, n, bool_ptr(counted_c), long_ptr(sightings_c), salts, depth, width);
  int64_t* const est = estimate.data_ptr<int64_t>();
  read_estimates(c, id, n, salts, depth, width, [&](int64_t i, int32_t low) { est[i] = low; });
  return estimate;
}

at::Tensor sketch_admit_cpu(at::Tensor& counters, const at::Tensor& ids, int64_t seed, int64_t min_count, double p,
                            int64_t draw_seed, const c10::optional<at::Tensor>& counted,
                            const c10::optional<at::Tensor>& sightings, const c10::optional<at::Tensor>& skip) {
  constexpr const char* op = "veloce::sketch_admit";
  check_sketch_admit(op, counters, ids, counted, sightings, min_count, p, skip);
  const int64_t n = ids.numel(), depth = counters.size(0), width = counters.size(1);
  at::Tensor admit = at::empty({n}, ids.options().dtype(at::kBool));
  if (n == 0) return admit;
  const std::vector<uint64_t> salts = salts_of(seed, depth);
  const at::Tensor ids_c = ids.contiguous();
  int32_t* const c = counters.data_ptr<int32_t>();
  const int64_t* const id = ids_c.data_ptr<int64_t>();
  if (!(skip.has_value() && skip->item<bool>())) {
    const at::Tensor counted_c = contiguous_or_undefined(counted);
    const at::Tensor sightings_c = contiguous_or_undefined(sightings);
    add_sightings(c, id, n, bool_ptr(counted_c), long_ptr(sightings_c), salts, depth, width);
  }
  bool* const out = admit.data_ptr<bool>();
  const uint64_t draw_salt = splitmix64(static_cast<uint64_t>(draw_seed));
  read_estimates(c, id, n, salts, depth, width,
                 [&](int64_t i, int32_t low) { out[i] = sketch_decide(id[i], low, min_count, p, draw_salt); });
  return admit;
}

void admission_tally_cpu(at::Tensor& stats, const at::Tensor& slots, int64_t capacity,
                         const c10::optional<at::Tensor>& sightings) {
  constexpr const char* op = "veloce::admission_tally";
  check_admission_tally(op, stats, slots, capacity, sightings);
  const at::Tensor s_c = slots.contiguous();
  const at::Tensor w_c = contiguous_or_undefined(sightings);
  const int64_t* const s = s_c.data_ptr<int64_t>();
  const int64_t* const w = long_ptr(w_c);
  const int64_t n = s_c.numel();
  // Integer sums: any split over threads gives the same counts.
  using Counts = std::array<int64_t, 2>;  // own, refused
  const Counts total = at::parallel_reduce(
      0, n, at::internal::GRAIN_SIZE, Counts{0, 0},
      [&](int64_t begin, int64_t end, Counts acc) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t times = w != nullptr ? w[i] : 1;
          acc[0] += (s[i] >= 0 && s[i] < capacity) ? times : 0;
          acc[1] += s[i] == capacity ? times : 0;
        }
        return acc;
      },
      [](Counts a, const Counts& b) { return Counts{a[0] + b[0], a[1] + b[1]}; });
  const int64_t own = total[0], refused = total[1];
  int64_t* const out = stats.data_ptr<int64_t>();
  out[0] += own;
  out[1] += refused;
  out[2] = own;
  out[3] = refused;
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CPU, m) {
  m.impl("sketch_count", &veloce::sketch_count_cpu);
  m.impl("sketch_admit", &veloce::sketch_admit_cpu);
  m.impl("admission_tally", &veloce::admission_tally_cpu);
}
