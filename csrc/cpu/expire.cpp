// CPU kernel of expire: a time-to-live's bulk erase (semantics: csrc/ops.cpp, docs/ops.md).
// One parallel pass over the slots; each slot is read and cleared by one thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <functional>

#include "veloce/check.h"
#include "veloce/hash.h"

namespace veloce {
namespace {

at::Tensor expire_cpu(const at::Tensor& keys, at::Tensor& digests, const at::Tensor& scores, int64_t before) {
  constexpr const char* op = "veloce::expire";
  check_table(op, keys, digests, scores);
  uint8_t* const d = digests.data_ptr<uint8_t>();
  const int64_t* const s = scores.data_ptr<int64_t>();
  const int64_t erased = at::parallel_reduce(
      0, keys.numel(), int64_t{1} << 16, int64_t{0},
      [&](int64_t begin, int64_t end, int64_t n) {
        for (int64_t i = begin; i < end; ++i) {
          if (d[i] != kEmptyDigest && s[i] < before) {
            d[i] = kEmptyDigest;
            ++n;
          }
        }
        return n;
      },
      std::plus<int64_t>());
  return at::scalar_tensor(erased, keys.options());
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CPU, m) { m.impl("expire", &veloce::expire_cpu); }
