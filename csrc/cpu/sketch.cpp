// CPU kernel of sketch_count: feature admission's count-min sketch (semantics: csrc/ops.cpp,
// docs/ops.md). Two parallel passes: every counted position adds its sightings to its id's
// counter in each sketch row (a thread per row), then every position reads the minimum of
// its counters after the whole lookup's adds, saturating them at kSketchCountLimit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "veloce/check.h"
#include "veloce/sketch.h"

namespace veloce {

namespace {

constexpr int64_t kPrefetch = 16;  // positions ahead whose counters are prefetched

at::Tensor sketch_count_cpu(at::Tensor& counters, const at::Tensor& ids, int64_t seed,
                            const c10::optional<at::Tensor>& counted, const c10::optional<at::Tensor>& sightings) {
  constexpr const char* op = "veloce::sketch_count";
  check_sketch_count(op, counters, ids, counted, sightings);
  const int64_t n = ids.numel(), depth = counters.size(0), width = counters.size(1);
  at::Tensor estimate = at::empty({n}, ids.options());
  if (n == 0) return estimate;
  std::vector<uint64_t> salts(depth);
  for (int64_t d = 0; d < depth; ++d) salts[d] = sketch_salt(seed, d);
  const at::Tensor ids_c = ids.contiguous();
  const int64_t* const id = ids_c.data_ptr<int64_t>();
  const at::Tensor counted_c = counted.has_value() ? counted->contiguous() : at::Tensor();
  const bool* const take = counted_c.defined() ? counted_c.data_ptr<bool>() : nullptr;
  const at::Tensor sightings_c = sightings.has_value() ? sightings->contiguous() : at::Tensor();
  const int64_t* const times = sightings_c.defined() ? sightings_c.data_ptr<int64_t>() : nullptr;
  int32_t* const c = counters.data_ptr<int32_t>();
  // The adds: one thread per sketch row, each writing only its own row, so they are plain
  // adds rather than atomics (a locked add waits for its cache miss before the next starts;
  // plain ones overlap), with the counter kPrefetch positions ahead prefetched.
  at::parallel_for(0, depth, 1, [&](int64_t d_begin, int64_t d_end) {
    for (int64_t d = d_begin; d < d_end; ++d) {
      for (int64_t i = 0; i < n; ++i) {
        if (i + kPrefetch < n) __builtin_prefetch(c + sketch_slot(id[i + kPrefetch], salts[d], d, width), 1);
        if (take != nullptr && !take[i]) continue;
        c[sketch_slot(id[i], salts[d], d, width)] += times != nullptr ? static_cast<int32_t>(times[i]) : 1;
      }
    }
  });
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, depth));
  int64_t* const est = estimate.data_ptr<int64_t>();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int32_t low = kSketchCountLimit;
      for (int64_t d = 0; d < depth; ++d) {
        int32_t* const slot = c + sketch_slot(id[i], salts[d], d, width);
        const int32_t v = __atomic_load_n(slot, __ATOMIC_RELAXED);
        if (v > kSketchCountLimit) __atomic_store_n(slot, kSketchCountLimit, __ATOMIC_RELAXED);
        low = std::min(low, v);
      }
      est[i] = low;
    }
  });
  return estimate;
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CPU, m) { m.impl("sketch_count", &veloce::sketch_count_cpu); }
