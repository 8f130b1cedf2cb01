// Implementations composed of other ops, shared by backends where no dedicated kernel
// would do better.
//
// export: occupied slots in [start, end) by nonzero + index_select, on any device.
// accumulate_and_update = accumulate_grad, then sparse_update on its output. The CPU
// backend registers a fused kernel (csrc/cpu/embedding.cpp); CUDA uses this composition
// of its own two kernels until it has a fused one.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
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

void accumulate_and_update_composite(const at::Tensor& weights, const at::Tensor& opt_state,
                                     const at::Tensor& grad_output, const at::Tensor& slots, const at::Tensor& offsets,
                                     const std::optional<at::Tensor>& per_sample_weights, int64_t mode,
                                     bool include_last_offset, int64_t optimizer, double lr, double eps,
                                     double beta1, double beta2, double weight_decay, int64_t step) {
  static auto accumulate =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("veloce::accumulate_grad", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, int64_t, bool, int64_t)>();
  static auto update = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("veloce::sparse_update", "")
                           .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       int64_t, double, double, double, double, double, int64_t)>();
  auto [unique_slots, grad_rows] =
      accumulate.call(grad_output, slots, offsets, per_sample_weights, mode, include_last_offset, weights.size(0));
  update.call(weights, opt_state, unique_slots, grad_rows, optimizer, lr, eps, beta1, beta2, weight_decay, step);
}

}  // namespace
}  // namespace veloce

// Registered for CUDA only (not CompositeExplicitAutograd, which FakeTensor's Python
// dispatch trips over for an op with an argument named `mode`).
TORCH_LIBRARY_IMPL(veloce, CPU, m) { m.impl("export", &veloce::export_entries); }

TORCH_LIBRARY_IMPL(veloce, CUDA, m) {
  m.impl("export", &veloce::export_entries);
  m.impl("accumulate_and_update", &veloce::accumulate_and_update_composite);
}
