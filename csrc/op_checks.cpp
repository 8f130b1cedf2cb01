// Per-op argument validation shared by the CPU and CUDA kernels (see veloce/op_checks.h).
// Host-compiled only: every TORCH_CHECK message of the ops is formatted here or in
// common.cpp, never in a .cu file.
#include "veloce/op_checks.h"

#include <c10/util/accumulate.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "veloce/hash.h"
#include "veloce/optim/registry.h"
#include "veloce/score.h"

namespace veloce {
namespace {

constexpr int64_t kSum = 0;
constexpr int64_t kMean = 1;

bool is_row_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16;
}

}  // namespace

// ---- hash_table ------------------------------------------------------------------------

void check_find_args(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& ids) {
  check_table_keys(op, keys, digests);
  check_ids(op, ids, keys);
}

void check_insert_args(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& scores,
                       const at::Tensor& weights, const at::Tensor& opt_state, const at::Tensor& ids,
                       int64_t score_policy) {
  check_table(op, keys, digests, scores);
  check_table_rows(op, weights, opt_state, keys);
  check_ids(op, ids, keys);
  TORCH_CHECK(score_policy >= 0 && score_policy < score::kNumPolicies, op, ": score_policy must be one of ",
              score::policy_choices(), ", got ", score_policy);
}

void check_bad_input(const char* op, const std::optional<at::Tensor>& bad_input, const at::Tensor& keys) {
  if (bad_input) check_flag(op, "bad_input", *bad_input, "keys", keys);
}

void check_bad_input_unset(const char* op, bool set) {
  TORCH_CHECK_VALUE(!set, op, ": bad_input is set: the caller's check of this call's input failed; nothing was ",
                    "inserted and no table was changed");
}

void check_clock(const char* op, const std::optional<at::Tensor>& clock, int64_t K, const at::Tensor& keys) {
  if (!clock) return;
  TORCH_CHECK_VALUE(clock->scalar_type() == at::kLong && clock->dim() == 1 && clock->size(0) == K, op,
                    ": clock must be an int64 tensor of shape (", K, ",) (one value per table), got ",
                    dtype_name(clock->scalar_type()), " of shape ", shape_str(*clock));
  check_same_device(op, "clock", *clock, "keys", keys);
}

void check_init_state(const char* op, const std::optional<at::Tensor>& init_state, const at::Tensor& opt_state) {
  if (!init_state) return;
  const int64_t S = opt_state.size(1);
  TORCH_CHECK_VALUE(init_state->dim() == 1 && init_state->size(0) == S, op,
                    ": init_state must be 1-D with one value per state column of opt_state (", S, ",), got shape ",
                    shape_str(*init_state), "; pass None for zeros");
  check_dtype(op, "init_state", *init_state, opt_state.scalar_type());
  check_same_device(op, "init_state", *init_state, "opt_state", opt_state);
}

void check_admit(const char* op, const std::optional<at::Tensor>& admit, const at::Tensor& ids) {
  if (!admit) return;
  TORCH_CHECK_VALUE(admit->scalar_type() == at::kBool && admit->dim() == 1 && admit->numel() == ids.numel(), op,
                    ": admit must be a 1-D bool tensor with one value per id (", ids.numel(), ",), got ",
                    dtype_name(admit->scalar_type()), " of shape ", shape_str(*admit), "; pass None to admit every id");
  check_same_device(op, "admit", *admit, "ids", ids);
}

void check_admit_many(const char* op, const std::optional<c10::List<std::optional<at::Tensor>>>& admit,
                      at::TensorList ids) {
  if (!admit) return;
  const int64_t K = static_cast<int64_t>(ids.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(admit->size()) == K, op, ": admit must hold one entry per table (", K,
                    "; None admits every id), got ", admit->size());
  for (int64_t k = 0; k < K; ++k) check_admit(table_op_name(op, k).c_str(), admit->get(k), ids[k]);
}

void check_defer(const char* op, bool defer, bool allow_evict, int64_t table) {
  TORCH_CHECK_VALUE(!(defer && allow_evict), op, ": defer=True with allow_evict=True",
                    table >= 0 ? " (table " + std::to_string(table) + ")" : std::string(),
                    ": a deferred insert never evicts (the evicted keys are listed on the host); pass defer=False "
                    "for a table that may evict");
}

void check_room(const char* op, int64_t room, bool defer, int64_t table) {
  const std::string which = table >= 0 ? " (table " + std::to_string(table) + ")" : std::string();
  TORCH_CHECK_VALUE(room >= kNoRoomLimit, op, ": room must be >= 0 (new ids that may take an empty slot) or ",
                    kNoRoomLimit, " (no limit)", which, ", got ", room);
  TORCH_CHECK_VALUE(!(defer && room != kNoRoomLimit), op, ": defer=True with room=", room, which,
                    ": a deferred insert reads no count back, so it cannot keep to a room; pass room=",
                    kNoRoomLimit, " and bound the call's new ids by the room yourself");
}

void check_room_many(const char* op, at::OptionalIntArrayRef room, int64_t K, bool defer) {
  if (!room) return;
  TORCH_CHECK_VALUE(static_cast<int64_t>(room->size()) == K, op, ": room must hold one value per table (", K,
                    "), got ", room->size());
  for (int64_t k = 0; k < K; ++k) check_room(op, (*room)[k], defer, k);
}

int64_t check_find_or_insert_many_args(const char* op, at::TensorList keys, at::TensorList digests, at::TensorList scores, at::TensorList weights,
    at::TensorList opt_state, at::TensorList ids, at::IntArrayRef score_policy, at::IntArrayRef score_value,
    const c10::List<bool>& allow_evict, at::IntArrayRef seed, at::IntArrayRef init_kind, at::ArrayRef<double> init_a,
    at::ArrayRef<double> init_b, const c10::List<std::optional<int64_t>>& padding_id,
    const std::optional<at::Tensor>& bad_input,
    const std::optional<c10::List<std::optional<at::Tensor>>>& init_state) {
  const int64_t K = check_list_lengths(
      op, "keys", keys.size(),
      {{"digests", digests.size()}, {"scores", scores.size()}, {"weights", weights.size()},
       {"opt_state", opt_state.size()}, {"ids", ids.size()}, {"score_policy", score_policy.size()},
       {"score_value", score_value.size()}, {"allow_evict", allow_evict.size()}, {"seed", seed.size()},
       {"init_kind", init_kind.size()}, {"init_a", init_a.size()}, {"init_b", init_b.size()},
       {"padding_id", padding_id.size()}});
  check_distinct_tables(op, keys);
  for (int64_t k = 0; k < K; ++k) {
    const std::string name = table_op_name(op, k);
    check_insert_args(name.c_str(), keys[k], digests[k], scores[k], weights[k], opt_state[k], ids[k],
                      score_policy[k]);
    check_init(name.c_str(), init_kind[k], init_a[k], init_b[k]);
  }
  if (init_state) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(init_state->size()) == K, op,
                      ": init_state must hold one entry per table (", K, "; None for zeros), got ",
                      init_state->size());
    for (int64_t k = 0; k < K; ++k) {
      check_init_state(table_op_name(op, k).c_str(), init_state->get(k), opt_state[k]);
    }
  }
  if (bad_input) {
    TORCH_CHECK_VALUE(K > 0, op, ": bad_input was given but there are no tables; it must be on the tables' device");
    check_bad_input(op, bad_input, keys[0]);
  }
  return K;
}

void check_assign_values(const char* op, const at::Tensor& keys, const at::Tensor& weights,
                         const at::Tensor& opt_state, int64_t n, const at::Tensor& values,
                         const std::optional<at::Tensor>& opt_values,
                         const std::optional<at::Tensor>& score_values) {
  check_dim(op, "values", values, 2);
  check_same_device(op, "values", values, "keys", keys);
  check_size(op, "values", values, 0, n, "the number of ids");
  check_size(op, "values", values, 1, weights.size(1), "the embedding dim of weights");
  check_dtype(op, "values", values, weights.scalar_type());
  if (opt_values) {
    check_dim(op, "opt_values", *opt_values, 2);
    check_same_device(op, "opt_values", *opt_values, "keys", keys);
    check_size(op, "opt_values", *opt_values, 0, n, "the number of ids");
    check_size(op, "opt_values", *opt_values, 1, opt_state.size(1), "the state width of opt_state");
    check_dtype(op, "opt_values", *opt_values, opt_state.scalar_type());
  }
  if (score_values) {
    check_dtype(op, "score_values", *score_values, at::kLong);
    check_dim(op, "score_values", *score_values, 1);
    check_same_device(op, "score_values", *score_values, "keys", keys);
    check_size(op, "score_values", *score_values, 0, n, "the number of ids");
  }
}

void check_export_args(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& scores,
                       const at::Tensor& weights, const at::Tensor& opt_state, int64_t start, int64_t end) {
  check_table(op, keys, digests, scores);
  check_table_rows(op, weights, opt_state, keys);
  const int64_t capacity = keys.numel();
  TORCH_CHECK(0 <= start && start <= end && end <= capacity, op,
              ": need 0 <= start <= end <= capacity, got start = ", start, ", end = ", end, ", capacity = ",
              capacity);
}

void check_initialize_args(const char* op, const at::Tensor& ids, int64_t dim, at::ScalarType dtype,
                           int64_t init_kind, double init_a, double init_b) {
  check_dtype(op, "ids", ids, at::kLong);
  check_dim(op, "ids", ids, 1);
  TORCH_CHECK(dim >= 0, op, ": dim must be >= 0, got ", dim);
  TORCH_CHECK(is_row_dtype(dtype), op, ": dtype must be float32, float64, float16 or bfloat16, got ",
              dtype_name(dtype));
  check_init(op, init_kind, init_a, init_b);
}

// ---- embedding -------------------------------------------------------------------------

void check_mode(const char* op, int64_t mode) {
  TORCH_CHECK(mode == kSum || mode == kMean, op, ": mode must be 0 (sum) or 1 (mean), got ", mode);
}

void check_row_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto st = t.scalar_type();
  TORCH_CHECK(is_row_dtype(st), op, ": ", name, " must be float32, float64, float16 or bfloat16, got ",
              dtype_name(st));
}

void check_psw(const char* op, const std::optional<at::Tensor>& psw, const at::Tensor& slots, int64_t mode,
               at::ScalarType want) {
  if (!psw.has_value()) return;
  TORCH_CHECK(mode == kSum, op, ": per_sample_weights is only supported with mode 0 (sum), got mode ", mode,
              " (mean)");
  check_dim(op, "per_sample_weights", *psw, 1);
  check_same_device(op, "per_sample_weights", *psw, "slots", slots);
  TORCH_CHECK(psw->scalar_type() == want, op, ": per_sample_weights must have the dtype of the rows (",
              dtype_name(want), "), got ", dtype_name(psw->scalar_type()));
  TORCH_CHECK(psw->numel() == slots.numel(), op, ": per_sample_weights must have one entry per slot (",
              slots.numel(), "), got ", psw->numel());
}

namespace {

// The bag inputs of pooled_lookup and the backward ops: rows (named `rows_name`, (R, D)
// float rows), slots (N,) int64 and offsets on rows' device, mode and per_sample_weights.
void check_bag_inputs(const char* op, const char* rows_name, const at::Tensor& rows, const at::Tensor& slots,
                      const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
                      int64_t mode) {
  check_row_dtype(op, rows_name, rows);
  check_dim(op, rows_name, rows, 2);
  check_dtype(op, "slots", slots, at::kLong);
  check_dim(op, "slots", slots, 1);
  check_same_device(op, "slots", slots, rows_name, rows);
  check_same_device(op, "offsets", offsets, rows_name, rows);
  check_mode(op, mode);
  check_psw(op, per_sample_weights, slots, mode, rows.scalar_type());
}

}  // namespace

int64_t check_pooled_lookup_args(const char* op, const at::Tensor& weights, const at::Tensor& slots,
                                 const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
                                 int64_t mode, const std::optional<at::Tensor>& extra_rows) {
  check_bag_inputs(op, "weights", weights, slots, offsets, per_sample_weights, mode);
  if (!extra_rows.has_value()) return 0;
  check_dim(op, "extra_rows", *extra_rows, 2);
  check_same_device(op, "extra_rows", *extra_rows, "weights", weights);
  TORCH_CHECK(extra_rows->scalar_type() == weights.scalar_type(), op,
              ": extra_rows must have the dtype of weights (", dtype_name(weights.scalar_type()), "), got ",
              dtype_name(extra_rows->scalar_type()));
  check_size(op, "extra_rows", *extra_rows, 1, weights.size(1), "weights.size(1)");
  return extra_rows->size(0);
}

std::vector<std::string> check_pooled_lookup_many_args(const char* op, at::TensorList weights, at::TensorList slots,
                                                       at::TensorList offsets,
                                                       const c10::List<std::optional<at::Tensor>>& per_sample_weights,
                                                       at::IntArrayRef mode,
                                                       const c10::List<std::optional<at::Tensor>>& extra_rows,
                                                       std::vector<int64_t>& extra) {
  const int64_t K = check_list_lengths(op, "weights", weights.size(),
                                       {{"slots", slots.size()}, {"offsets", offsets.size()},
                                        {"per_sample_weights (None for a table without them)",
                                         per_sample_weights.size()},
                                        {"mode", mode.size()},
                                        {"extra_rows (None for a table without them)", extra_rows.size()}});
  std::vector<std::string> names;
  names.reserve(K);
  extra.assign(K, 0);
  for (int64_t k = 0; k < K; ++k) {
    names.push_back(table_op_name(op, k));
    extra[k] = check_pooled_lookup_args(names.back().c_str(), weights[k], slots[k], offsets[k],
                                        per_sample_weights.get(k), mode[k], extra_rows.get(k));
    if (k == 0) continue;
    TORCH_CHECK_VALUE(weights[k].device() == weights[0].device(), op, ": weights[", k, "] is on ", weights[k].device(),
                      " but weights[0] is on ", weights[0].device(),
                      "; the tables of one call share a device (call once per device)");
    TORCH_CHECK_VALUE(weights[k].scalar_type() == weights[0].scalar_type(), op, ": weights[", k, "] is ",
                      dtype_name(weights[k].scalar_type()), " but weights[0] is ",
                      dtype_name(weights[0].scalar_type()), "; the tables of one call share a dtype");
    TORCH_CHECK_VALUE(weights[k].size(1) == weights[0].size(1), op, ": weights[", k, "] has dim ", weights[k].size(1),
                      " but weights[0] has dim ", weights[0].size(1),
                      "; the tables of one call share an embedding dim");
  }
  return names;
}

void check_backward_inputs(const char* op, const at::Tensor& grad_output, const at::Tensor& slots,
                           const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
                           int64_t mode) {
  check_bag_inputs(op, "grad_output", grad_output, slots, offsets, per_sample_weights, mode);
}

void check_grad_output_rows(const char* op, const at::Tensor& grad_output, int64_t num_bags) {
  TORCH_CHECK(grad_output.size(0) == num_bags, op, ": grad_output must have one row per bag (", num_bags,
              " bags), got ", grad_output.size(0), " rows");
}

int64_t check_backward_bags(const char* op, const at::Tensor& grad_output, const at::Tensor& offsets, int64_t n,
                            bool include_last_offset) {
  const int64_t B = check_offsets(op, offsets, n, include_last_offset);
  check_grad_output_rows(op, grad_output, B);
  return B;
}

int64_t check_backward_args(const char* op, const at::Tensor& grad_output, const at::Tensor& slots,
                            const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
                            int64_t mode, bool include_last_offset) {
  check_backward_inputs(op, grad_output, slots, offsets, per_sample_weights, mode);
  return check_backward_bags(op, grad_output, offsets, slots.numel(), include_last_offset);
}

void check_num_rows(const char* op, int64_t num_rows) {
  TORCH_CHECK(num_rows >= 0, op, ": num_rows must be >= 0, got ", num_rows);
}

void check_num_bags_cuda(const char* op, int64_t num_bags) {
  TORCH_CHECK(num_bags <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 bags on CUDA, got ",
              num_bags);
}

void check_grad_output_for_weights(const char* op, const at::Tensor& grad_output, const at::Tensor& weights) {
  check_same_device(op, "grad_output", grad_output, "weights", weights);
  TORCH_CHECK(grad_output.scalar_type() == weights.scalar_type(), op, ": grad_output must have the dtype of weights (",
              dtype_name(weights.scalar_type()), "), got ", dtype_name(grad_output.scalar_type()));
  check_size(op, "grad_output", grad_output, 1, weights.size(1), "weights.size(1)");
}

std::string table_op_name(const char* op, int64_t k) { return std::string(op) + " (table " + std::to_string(k) + ")"; }

int64_t check_extra_update_rows(const char* op, const char* rows_name, const char* state_name,
                                const at::Tensor* extra_rows, const at::Tensor* extra_state,
                                const at::Tensor& weights, const at::Tensor& opt_state) {
  TORCH_CHECK_VALUE((extra_rows == nullptr) == (extra_state == nullptr), op, ": ", rows_name, " and ", state_name,
                    " go together (the extra rows and their optimizer state); got only ",
                    extra_rows != nullptr ? rows_name : state_name);
  if (extra_rows == nullptr) return 0;
  const at::Tensor& e = *extra_rows;
  const at::Tensor& es = *extra_state;
  check_dim(op, rows_name, e, 2);
  check_same_device(op, rows_name, e, "weights", weights);
  TORCH_CHECK_VALUE(e.scalar_type() == weights.scalar_type(), op, ": ", rows_name, " must have the dtype of weights (",
                    dtype_name(weights.scalar_type()), "), got ", dtype_name(e.scalar_type()));
  check_size(op, rows_name, e, 1, weights.size(1), "weights.size(1)");
  TORCH_CHECK_VALUE(e.is_contiguous(), op, ": ", rows_name, " must be contiguous (it is updated in place)");
  TORCH_CHECK_VALUE(e.size(0) <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 ", rows_name,
                    ", got ", e.size(0));
  check_dim(op, state_name, es, 2);
  check_same_device(op, state_name, es, "weights", weights);
  check_dtype(op, state_name, es, opt_state.scalar_type());
  check_size(op, state_name, es, 0, e.size(0), (std::string(rows_name) + ".size(0)").c_str());
  check_size(op, state_name, es, 1, opt_state.size(1), "opt_state.size(1)");
  TORCH_CHECK_VALUE(es.is_contiguous(), op, ": ", state_name, " must be contiguous (it is updated in place)");
  return e.size(0);
}

void check_disjoint_writes(const char* op, const std::vector<std::pair<std::string, const at::Tensor*>>& written) {
  // Sort the byte ranges (exact: every written tensor is contiguous, checked before) and
  // compare neighbours.
  std::vector<std::tuple<uintptr_t, uintptr_t, size_t>> spans;  // [begin, end), index in written
  spans.reserve(written.size());
  for (size_t i = 0; i < written.size(); ++i) {
    const at::Tensor& t = *written[i].second;
    if (t.nbytes() == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.emplace_back(begin, begin + t.nbytes(), i);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    const auto& [b0, e0, i0] = spans[i - 1];
    const auto& [b1, e1, i1] = spans[i];
    TORCH_CHECK(b1 >= e0, op, ": ", written[i0].first, " and ", written[i1].first, " share memory; each table may ",
                "appear once in a call (its gradients are applied together), so merge a table's batches into one ",
                "entry, and give its extra rows tensors of their own");
  }
}

// accumulate_and_update's extra rows, checked (check_extra_update_rows) with the written
// tensors' memory (check_disjoint_writes).
void check_extra_update(const char* op, const at::Tensor& weights, const at::Tensor& opt_state,
                        const std::optional<at::Tensor>& extra_rows, const std::optional<at::Tensor>& extra_state) {
  if (!extra_rows.has_value() && !extra_state.has_value()) return;
  check_extra_update_rows(op, "extra_rows", "extra_state", extra_rows ? &*extra_rows : nullptr,
                          extra_state ? &*extra_state : nullptr, weights, opt_state);
  check_disjoint_writes(op, {{"weights", &weights}, {"opt_state", &opt_state}, {"extra_rows", &*extra_rows},
                             {"extra_state", &*extra_state}});
}

ManyTables check_update_many_args(const char* op, at::TensorList weights, at::TensorList opt_state,
                                  at::TensorList grad_output, at::TensorList slots, at::TensorList offsets,
                                  const c10::List<std::optional<at::Tensor>>& per_sample_weights, int64_t mode,
                                  bool include_last_offset, int64_t optimizer, const at::Tensor& hparams,
                                  const std::optional<at::TensorList>& extra_rows,
                                  const std::optional<at::TensorList>& extra_state) {
  const int64_t K = check_list_lengths(op, "weights", weights.size(),
                                       {{"opt_state", opt_state.size()}, {"grad_output", grad_output.size()},
                                        {"slots", slots.size()}, {"offsets", offsets.size()},
                                        {"per_sample_weights (None for a table without them)",
                                         per_sample_weights.size()}});
  TORCH_CHECK_VALUE(extra_rows.has_value() == extra_state.has_value(), op,
                    ": extra_rows and extra_state go together (None, or one entry per table each)");
  if (extra_rows.has_value()) {
    check_list_lengths(op, "weights", K,
                       {{"extra_rows ((0, D) for a table without extra rows)", extra_rows->size()},
                        {"extra_state ((0, S) for a table without extra rows)", extra_state->size()}});
  }
  optim::check_optimizer_id(op, optimizer);
  if (K > 0) check_hparams(op, hparams, optimizer, "weights[0]", weights[0]);
  ManyTables out;
  out.names.reserve(K);
  out.num_bags.reserve(K);
  out.num_extra.assign(K, 0);
  for (int64_t k = 0; k < K; ++k) {
    out.names.push_back(table_op_name(op, k));
    const char* name = out.names.back().c_str();
    const std::optional<at::Tensor> psw = per_sample_weights.get(k);
    check_update_rows(name, weights[k], opt_state[k], optimizer);
    check_backward_inputs(name, grad_output[k], slots[k], offsets[k], psw, mode);
    check_grad_output_for_weights(name, grad_output[k], weights[k]);
    const int64_t B = check_offsets_shape(name, offsets[k], slots[k].numel(), include_last_offset);
    check_grad_output_rows(name, grad_output[k], B);
    out.num_bags.push_back(B);
    if (extra_rows.has_value()) {
      out.num_extra[k] = check_extra_update_rows(name, "extra_rows", "extra_state", &(*extra_rows)[k],
                                                 &(*extra_state)[k], weights[k], opt_state[k]);
    }
    if (k == 0) continue;
    TORCH_CHECK(weights[k].device() == weights[0].device(), op, ": weights[", k, "] is on ", weights[k].device(),
                " but weights[0] is on ", weights[0].device(),
                "; the tables of one call share a device (call once per device)");
    TORCH_CHECK(weights[k].scalar_type() == weights[0].scalar_type(), op, ": weights[", k, "] is ",
                dtype_name(weights[k].scalar_type()), " but weights[0] is ", dtype_name(weights[0].scalar_type()),
                "; the tables of one call share a dtype (call once per dtype)");
    TORCH_CHECK(weights[k].size(1) == weights[0].size(1), op, ": weights[", k, "] has embedding dim ",
                weights[k].size(1), " but weights[0] has ", weights[0].size(1),
                "; the tables of one call share the embedding dim (call once per dim)");
  }
  // The mutated tensors must not share memory.
  std::vector<std::pair<std::string, const at::Tensor*>> written;
  written.reserve(4 * K);
  for (int64_t k = 0; k < K; ++k) {
    const std::string at = "[" + std::to_string(k) + "]";
    written.emplace_back("weights" + at, &weights[k]);
    written.emplace_back("opt_state" + at, &opt_state[k]);
    if (extra_rows.has_value()) {
      written.emplace_back("extra_rows" + at, &(*extra_rows)[k]);
      written.emplace_back("extra_state" + at, &(*extra_state)[k]);
    }
  }
  check_disjoint_writes(op, written);
  return out;
}

void check_slot_values(const char* op, const int64_t* s, int64_t n, int64_t limit, const char* limit_what) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = s[i];
    if (C10_UNLIKELY(v < kZeroSlot || (limit >= 0 && v >= limit))) {
      if (limit >= 0) {
        TORCH_CHECK(false, op, ": slots[", i, "] = ", v, " is not a valid slot; expected -1 (padding), -2 (zero ",
                    "row) or 0 <= slot < ", limit, " (", limit_what, ")");
      }
      TORCH_CHECK(false, op, ": slots[", i, "] = ", v, " is not a valid slot; expected -1 (padding), -2 (zero ",
                  "row) or a slot >= 0");
    }
  }
}

// ---- exchange --------------------------------------------------------------------------

void check_exchange_ids(const char* op, const at::Tensor& ids, int64_t world_size) {
  check_dtype(op, "ids", ids, at::kLong);
  check_dim(op, "ids", ids, 1);
  TORCH_CHECK(world_size >= 1, op, ": world_size must be >= 1, got ", world_size);
}

int64_t check_bucketize_shapes(const char* op, const at::Tensor& ids, const at::Tensor& offsets,
                               bool include_last_offset, int64_t world_size) {
  check_exchange_ids(op, ids, world_size);
  check_same_device(op, "offsets", offsets, "ids", ids);
  return check_offsets_shape(op, offsets, ids.numel(), include_last_offset);
}

int64_t check_bucketize_args(const char* op, const at::Tensor& ids, const at::Tensor& offsets,
                             bool include_last_offset, int64_t world_size) {
  check_bucketize_shapes(op, ids, offsets, include_last_offset, world_size);
  return check_offsets(op, offsets, ids.numel(), include_last_offset);
}

void check_world_size_cuda(const char* op, int64_t world_size) {
  TORCH_CHECK(world_size < std::numeric_limits<int32_t>::max(), op, ": world_size must be < 2^31 - 1 on CUDA, got ",
              world_size);
}

void check_combine_parts_args(const char* op, const at::Tensor& parts, const at::Tensor& bag_of_part,
                              int64_t num_bags) {
  check_dim(op, "parts", parts, 2);
  check_row_dtype(op, "parts", parts);
  check_dtype(op, "bag_of_part", bag_of_part, at::kLong);
  check_dim(op, "bag_of_part", bag_of_part, 1);
  check_same_device(op, "bag_of_part", bag_of_part, "parts", parts);
  check_size(op, "bag_of_part", bag_of_part, 0, parts.size(0), "the number of parts (parts.size(0))");
  TORCH_CHECK(num_bags >= 0, op, ": num_bags must be >= 0, got ", num_bags);
}

std::vector<RegroupBlock> regroup_plan(const char* op, at::TensorList sources, at::IntArrayRef counts,
                                       int64_t num_groups, bool to_group_major) {
  const int64_t G = num_groups, n = static_cast<int64_t>(counts.size());
  TORCH_CHECK_VALUE(G >= 1, op, ": num_groups must be >= 1, got ", G);
  TORCH_CHECK_VALUE(n >= G && n % G == 0, op, ": counts must hold num_groups * world_size entries (num_groups = ",
                    G, ", world_size >= 1), got ", n);
  const int64_t W = n / G;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(counts[i] >= 0, op, ": counts[", i, "] = ", counts[i], " is negative; counts are row counts");
  }
  const int64_t want_sources = to_group_major ? 1 : G;
  TORCH_CHECK_VALUE(static_cast<int64_t>(sources.size()) == want_sources, op, ": sources must hold ",
                    to_group_major ? "one tensor (the rows in peer-major order) with to_group_major=True"
                                   : "one tensor per group (num_groups) with to_group_major=False",
                    ", got ", sources.size());
  const at::Tensor& first = sources[0];
  TORCH_CHECK_VALUE(first.dim() >= 1, op, ": sources[0] must have a row dimension, got a 0-d tensor");
  for (int64_t s = 0; s < want_sources; ++s) {
    const at::Tensor& t = sources[s];
    const std::string name = "sources[" + std::to_string(s) + "]";
    TORCH_CHECK_VALUE(t.scalar_type() == first.scalar_type(), op, ": ", name, " is ", dtype_name(t.scalar_type()),
                      " but sources[0] is ", dtype_name(first.scalar_type()));
    check_same_device(op, name.c_str(), t, "sources[0]", first);
    TORCH_CHECK_VALUE(t.dim() == first.dim() && t.sizes().slice(1) == first.sizes().slice(1), op, ": ", name,
                      " has shape ", shape_str(t), " but sources[0] has ", shape_str(first),
                      "; the sources' rows must have one shape");
    // The counts this source holds: all of them (to_group_major), or group s's. Each is
    // compared with the rows left, so that no sum can pass int64.
    const int64_t first_count = to_group_major ? 0 : s * W, end_count = to_group_major ? n : (s + 1) * W;
    int64_t rows = 0;
    for (int64_t i = first_count; i < end_count; ++i) {
      TORCH_CHECK_VALUE(counts[i] <= t.size(0) - rows, op, ": counts give ", name, " more rows than its ", t.size(0),
                        " (counts[", i, "] = ", counts[i], " after ", rows, ")");
      rows += counts[i];
    }
    TORCH_CHECK_VALUE(t.size(0) == rows, op, ": ", name, " has ", t.size(0), " rows but counts give it ", rows);
  }
  std::vector<RegroupBlock> plan;
  plan.reserve(static_cast<size_t>(n));
  if (to_group_major) {
    // Block (g, p) starts in the source after every block of the peers before p and the
    // groups before g of peer p.
    std::vector<int64_t> start(static_cast<size_t>(n));
    int64_t at = 0;
    for (int64_t p = 0; p < W; ++p) {
      for (int64_t g = 0; g < G; ++g) {
        start[static_cast<size_t>(g * W + p)] = at;
        at += counts[g * W + p];
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (counts[i] > 0) plan.push_back({0, start[static_cast<size_t>(i)], counts[i]});
    }
  } else {
    std::vector<int64_t> next(static_cast<size_t>(G), 0);  // each group's next row
    for (int64_t p = 0; p < W; ++p) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t c = counts[g * W + p];
        if (c > 0) plan.push_back({g, next[static_cast<size_t>(g)], c});
        next[static_cast<size_t>(g)] += c;
      }
    }
  }
  return plan;
}

RegroupCopy regroup_copy(at::TensorList sources, const std::vector<RegroupBlock>& plan,
                         at::ScalarType out_dtype) {
  RegroupCopy c;
  for (const at::Tensor& t : sources) c.sources.push_back(t.contiguous());
  const at::Tensor& first = c.sources[0];
  c.row_elems = c10::multiply_integers(first.sizes().slice(1));
  c.row_bytes = c.row_elems * static_cast<int64_t>(first.element_size());
  std::vector<int64_t> shape = first.sizes().vec();
  shape[0] = 0;
  for (const RegroupBlock& b : plan) shape[0] += b.rows;
  c.out = at::empty(shape, first.options().dtype(out_dtype));
  return c;
}

void check_row_conversion(const char* op, const char* name, at::ScalarType from, at::ScalarType to) {
  TORCH_CHECK_VALUE(from == to || (is_row_dtype(from) && is_row_dtype(to)), op, ": cannot convert ", name, " from ",
                    dtype_name(from), " to dtype ", dtype_name(to),
                    "; the op converts between float32, float64, float16 and bfloat16 (or keeps a dtype as it is)");
}

void check_bag_indices(const char* op, const int64_t* bag, int64_t P, int64_t num_bags) {
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(bag[p] >= 0 && bag[p] < num_bags, op, ": bag_of_part[", p, "] = ", bag[p],
                " is not a bag index in [0, num_bags = ", num_bags, ")");
  }
}

// ---- optimizer -------------------------------------------------------------------------

int64_t check_update_rows(const char* op, const at::Tensor& weights, const at::Tensor& opt_state,
                          int64_t optimizer) {
  optim::check_optimizer_id(op, optimizer);
  const auto st = weights.scalar_type();
  TORCH_CHECK(is_row_dtype(st), op, ": weights must be float32, float64, float16 or bfloat16, got ",
              dtype_name(st));
  check_dim(op, "weights", weights, 2);
  TORCH_CHECK(weights.is_contiguous(), op, ": weights must be contiguous (it is updated in place)");
  const int64_t C = weights.size(0);
  const int64_t D = weights.size(1);
  const at::ScalarType state_dtype = st == at::kDouble ? at::kDouble : at::kFloat;
  check_dtype(op, "opt_state", opt_state, state_dtype);
  check_dim(op, "opt_state", opt_state, 2);
  check_same_device(op, "opt_state", opt_state, "weights", weights);
  TORCH_CHECK(opt_state.is_contiguous(), op, ": opt_state must be contiguous (it is updated in place)");
  check_size(op, "opt_state", opt_state, 0, C, "weights.size(0)");
  const int64_t S = optim::state_width(optimizer, D);
  TORCH_CHECK(opt_state.size(1) == S, op, ": opt_state.size(1) must be the state width of ",
              optim::optimizer_name(optimizer), " (S = ", optim::state_formula(optimizer), " = ", S, " for D = ", D,
              "), got ", opt_state.size(1));
  return S;
}

namespace optim {

void check_hparam(const char* op, bool ok, const char* name, int index, const char* want, double got) {
  TORCH_CHECK(ok, op, ": ", name, " must be ", want, ", got ", got, " (hparams[", index, "])");
}

void fail_unknown_optimizer(int64_t opt) {
  TORCH_CHECK(false, "veloce: optimizer ", opt, " is not one of ", optimizer_choices());
}

void check_optimizer_id(const char* op, int64_t opt) {
  TORCH_CHECK(opt >= 0 && opt < kNumOptimizers, op, ": optimizer must be ", optimizer_choices(), ", got ", opt);
}

}  // namespace optim

namespace score {

void fail_unknown_policy(int64_t policy) {
  TORCH_CHECK(false, "veloce: score_policy ", policy, " is not one of ", policy_choices());
}

}  // namespace score

void check_hparams(const char* op, const at::Tensor& hparams, int64_t optimizer, const char* ref_name,
                   const at::Tensor& ref) {
  const int64_t n = optim::num_hparams(optimizer);
  TORCH_CHECK_VALUE(hparams.scalar_type() == at::kDouble && hparams.dim() == 1 && hparams.size(0) == n, op,
                    ": hparams must be a float64 tensor of shape (", n, ",) for ", optim::optimizer_name(optimizer),
                    " ([lr, step, weight_decay] and its own values: veloce.ops.optimizer.hparams builds it), got ",
                    dtype_name(hparams.scalar_type()), " of shape ", shape_str(hparams));
  check_same_device(op, "hparams", hparams, ref_name, ref);
}

void check_hparam_values(const char* op, const at::Tensor& hparams, int64_t optimizer) {
  const at::Tensor c = hparams.contiguous();
  const double* h = c.data_ptr<double>();
  const double lr = h[optim::kLr], step = h[optim::kStep], wd = h[optim::kWeightDecay];
  optim::check_hparam(op, std::isfinite(lr) && lr >= 0.0, "lr", optim::kLr, "a finite number >= 0", lr);
  optim::check_hparam(op, std::isfinite(step) && step == std::floor(step) && std::abs(step) < 9.0e15,
                      "step (the step count)", optim::kStep, "a whole number", step);
  optim::check_hparam(op, std::isfinite(wd), "weight_decay", optim::kWeightDecay, "a finite number", wd);
  optim::dispatch(optimizer, [&](auto r) { decltype(r)::check(op, h); });
}

int64_t check_update_args(const char* op, const at::Tensor& weights, const at::Tensor& opt_state, int64_t optimizer,
                          const at::Tensor& hparams) {
  const int64_t S = check_update_rows(op, weights, opt_state, optimizer);
  check_hparams(op, hparams, optimizer, "weights", weights);
  return S;
}

void check_update_grads(const char* op, const at::Tensor& weights, const at::Tensor& slots,
                        const at::Tensor& grads) {
  const auto st = weights.scalar_type();
  check_dtype(op, "slots", slots, at::kLong);
  check_dim(op, "slots", slots, 1);
  check_same_device(op, "slots", slots, "weights", weights);
  const int64_t U = slots.numel();
  TORCH_CHECK(grads.scalar_type() == st, op, ": grads must have the dtype of weights (", dtype_name(st),
              "), got ", dtype_name(grads.scalar_type()));
  check_dim(op, "grads", grads, 2);
  check_same_device(op, "grads", grads, "weights", weights);
  check_size(op, "grads", grads, 0, U, "slots.numel()");
  check_size(op, "grads", grads, 1, weights.size(1), "weights.size(1)");
}

bool check_update_slot_range(const char* op, const int64_t* s, int64_t U, int64_t C) {
  bool increasing = true;
  for (int64_t u = 0; u < U; ++u) {
    TORCH_CHECK(s[u] >= 0 && s[u] < C, op, ": slots[", u, "] = ", s[u], " is out of range for weights with ", C,
                " rows");
    if (u > 0 && s[u] <= s[u - 1]) increasing = false;
  }
  return increasing;
}

void check_update_slots_unique(const char* op, bool unique, int64_t dup_slot) {
  TORCH_CHECK(unique, op, ": slots must be unique, got slot ", dup_slot, " more than once");
}

void check_nonfinite_args(const char* op, at::TensorList tensors, at::IntArrayRef owner, int64_t num_owners) {
  TORCH_CHECK_VALUE(!tensors.empty(), op,
                    ": tensors must hold at least one tensor (the flags are made on its device)");
  TORCH_CHECK_VALUE(owner.size() == tensors.size(), op, ": one owner per tensor: tensors has ", tensors.size(),
                    " entries but owner has ", owner.size());
  TORCH_CHECK_VALUE(num_owners >= 1, op, ": num_owners must be >= 1, got ", num_owners);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "tensors[" + std::to_string(i) + "]";
    check_row_dtype(op, name.c_str(), tensors[i]);
    check_same_device(op, name.c_str(), tensors[i], "tensors[0]", tensors[0]);
    TORCH_CHECK_VALUE(owner[i] >= 0 && owner[i] < num_owners, op, ": owner[", i, "] = ", owner[i],
                      " is out of range for num_owners ", num_owners);
  }
}

bool check_bag_layouts_args(const char* op, at::TensorList offsets, at::IntArrayRef num_ids,
                            at::IntArrayRef include_last_offset) {
  TORCH_CHECK_VALUE(!offsets.empty(), op, ": offsets must hold at least one tensor (the flag is made on its device)");
  TORCH_CHECK_VALUE(num_ids.size() == offsets.size(), op, ": one num_ids per offsets tensor: offsets has ",
                    offsets.size(), " entries but num_ids has ", num_ids.size());
  TORCH_CHECK_VALUE(include_last_offset.size() == offsets.size(), op,
                    ": one include_last_offset per offsets tensor: offsets has ", offsets.size(),
                    " entries but include_last_offset has ", include_last_offset.size());
  bool bad_shape = false;
  for (size_t k = 0; k < offsets.size(); ++k) {
    const std::string name = "offsets[" + std::to_string(k) + "]";
    check_dtype(op, name.c_str(), offsets[k], at::kLong);
    check_dim(op, name.c_str(), offsets[k], 1);
    check_same_device(op, name.c_str(), offsets[k], "offsets[0]", offsets[0]);
    TORCH_CHECK_VALUE(num_ids[k] >= 0, op, ": num_ids[", k, "] must be >= 0, got ", num_ids[k]);
    TORCH_CHECK_VALUE(include_last_offset[k] == 0 || include_last_offset[k] == 1, op, ": include_last_offset[", k,
                      "] must be 0 or 1, got ", include_last_offset[k]);
    if (offsets[k].numel() == 0 && (num_ids[k] > 0 || include_last_offset[k] != 0)) bad_shape = true;
  }
  return bad_shape;
}

}  // namespace veloce
