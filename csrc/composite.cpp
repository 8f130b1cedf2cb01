// Implementations composed of other ops, shared by backends where no dedicated kernel
// would do better.
//
// export: occupied slots in [start, end) by nonzero + index_select, on any device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "veloce/op_checks.h"

#include <c10/core/DeviceGuard.h>

#include <optional>
#include <tuple>

namespace veloce {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> export_entries(const at::Tensor& keys,
                                                                          const at::Tensor& digests,
                                                                          const at::Tensor& scores,
                                                                          const at::Tensor& weights,
                                                                          const at::Tensor& opt_state, int64_t start,
                                                                          int64_t end) {
  constexpr const char* op = "veloce::export";
  check_export_args(op, keys, digests, scores, weights, opt_state, start, end);
  const c10::OptionalDeviceGuard guard(keys.device());
  // nonzero sizes its output (a sync on CUDA); slot order is preserved.
  const at::Tensor occupied = digests.slice(0, start, end).nonzero().squeeze(1).add_(start);
  return {keys.index_select(0, occupied), weights.index_select(0, occupied), opt_state.index_select(0, occupied),
          scores.index_select(0, occupied)};
}

}  // namespace
}  // namespace veloce

// Registered for CPU and CUDA (not CompositeExplicitAutograd, which FakeTensor's Python
// dispatch trips over for an op with an argument named `mode`).
TORCH_LIBRARY_IMPL(veloce, CPU, m) { m.impl("export", &veloce::export_entries); }

TORCH_LIBRARY_IMPL(veloce, CUDA, m) {
  m.impl("export", &veloce::export_entries);
}
