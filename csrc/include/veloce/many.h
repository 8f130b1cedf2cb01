// Shared by the CPU and CUDA kernels of ops over several tables (find_or_insert_many).
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace veloce {

// The result of find_or_insert_many from its K tables' find_or_insert results: the slots
// of all tables concatenated (`slots`, already filled), counts (K, 3) int64 on the CPU =
// [inserted, failed, evicted] per table, and the evicted keys of all tables concatenated
// (`all_evicted` when the kernel has them so already; undefined: concatenated here, or
// none). Returning three tensors (not lists) keeps the op functionalizable (torch.compile).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> many_result(
    const at::Tensor& slots, const std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>>& per_table,
    const at::Tensor& all_evicted = at::Tensor()) {
  const int64_t K = static_cast<int64_t>(per_table.size());
  at::Tensor counts = at::empty({K, 3}, at::kLong);
  int64_t* c = counts.data_ptr<int64_t>();
  std::vector<at::Tensor> evicted;
  for (int64_t k = 0; k < K; ++k) {
    const auto& [s, table_counts, e] = per_table[k];
    c[3 * k] = table_counts.data_ptr<int64_t>()[0];  // CPU tensors on every backend
    c[3 * k + 1] = table_counts.data_ptr<int64_t>()[1];
    c[3 * k + 2] = e.numel();
    evicted.push_back(e);
  }
  if (all_evicted.defined()) return {slots, counts, all_evicted};
  return {slots, counts, evicted.empty() ? at::empty({0}, slots.options()) : at::cat(evicted)};
}

}  // namespace veloce
