// Per-op argument validation shared by the CPU and CUDA kernels: one function per op (or
// per group of ops) checks dtypes, dims, sizes, devices, enum ranges and hyperparameters,
// with the same messages on every backend. Defined in csrc/op_checks.cpp, compiled by the
// host compiler only (see veloce/check.h for why no .cu file formats TORCH_CHECK messages).
// The CUDA kernels add their own CUDA-only checks (check_cuda_table, check_num_ids_cuda).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/core/List.h>

#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "veloce/check.h"

namespace veloce {

// ---- hash_table ------------------------------------------------------------------------

// find, erase: the table keys/digests and ids (N,) int64 on keys' device.
void check_find_args(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& ids);

// find_or_insert, insert_or_assign: the whole table, its rows, ids and score_policy.
void check_insert_args(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& scores,
                       const at::Tensor& weights, const at::Tensor& opt_state, const at::Tensor& ids,
                       int64_t score_policy);

// find_or_insert's bad_input, when given: a bool tensor of one element on keys' device.
void check_bad_input(const char* op, const std::optional<at::Tensor>& bad_input, const at::Tensor& keys);
// The value of a given bad_input, once the backend has read it back (`set`): raises the
// ValueError that says the caller's input check failed and nothing was inserted. Called
// before the op changes any table.
void check_bad_input_unset(const char* op, bool set);

// find_or_insert(_many) with defer: no table may evict (`table`: the table's number in a
// _many op's message, or -1).
void check_defer(const char* op, bool defer, bool allow_evict, int64_t table = -1);
// room of an inserting op: kNoRoomLimit or >= 0, and kNoRoomLimit with defer (a deferred
// call reads no count back, so the caller bounds its rows itself).
void check_room(const char* op, int64_t room, bool defer, int64_t table = -1);
// room of find_or_insert_many: none, or one value per table (each as check_room).
void check_room_many(const char* op, at::OptionalIntArrayRef room, int64_t K, bool defer);
// clock of find_or_insert(_many): (K,) int64 on keys' device, when given.
void check_clock(const char* op, const std::optional<at::Tensor>& clock, int64_t K, const at::Tensor& keys);
// init_state of an inserting op, when given: (S,) of opt_state's dtype and device (the
// state new rows start from; None: zeros).
void check_init_state(const char* op, const std::optional<at::Tensor>& init_state, const at::Tensor& opt_state);
// admit of find_or_insert, when given: (N,) bool, one per id, on ids' device.
void check_admit(const char* op, const std::optional<at::Tensor>& admit, const at::Tensor& ids);
// admit of find_or_insert_many: none, or one entry per table (each as check_admit).
void check_admit_many(const char* op, const std::optional<c10::List<std::optional<at::Tensor>>>& admit,
                      at::TensorList ids);


// find_or_insert_many: every per-table list as long as keys, distinct tables on one
// device, each table's find_or_insert arguments (messages name the table), and bad_input
// (at least one table, then as check_bad_input on keys[0]) and init_state (none, or one
// entry per table, each as check_init_state). Returns K.
int64_t check_find_or_insert_many_args(const char* op, at::TensorList keys, at::TensorList digests, at::TensorList scores, at::TensorList weights,
    at::TensorList opt_state, at::TensorList ids, at::IntArrayRef score_policy, at::IntArrayRef score_value,
    const c10::List<bool>& allow_evict, at::IntArrayRef seed, at::IntArrayRef init_kind, at::ArrayRef<double> init_a,
    at::ArrayRef<double> init_b, const c10::List<std::optional<int64_t>>& padding_id,
    const std::optional<at::Tensor>& bad_input,
    const std::optional<c10::List<std::optional<at::Tensor>>>& init_state);

// insert_or_assign: values (n, D) of weights' dtype, optional opt_values (n, S) and
// score_values (n,) int64, all on keys' device.
void check_assign_values(const char* op, const at::Tensor& keys, const at::Tensor& weights,
                         const at::Tensor& opt_state, int64_t n, const at::Tensor& values,
                         const std::optional<at::Tensor>& opt_values,
                         const std::optional<at::Tensor>& score_values);

// export: the table, its rows and 0 <= start <= end <= capacity.
void check_export_args(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& scores,
                       const at::Tensor& weights, const at::Tensor& opt_state, int64_t start, int64_t end);

// initialize: ids (N,) int64, dim >= 0, a floating dtype and the initializer.
void check_initialize_args(const char* op, const at::Tensor& ids, int64_t dim, at::ScalarType dtype,
                           int64_t init_kind, double init_a, double init_b);

// ---- embedding -------------------------------------------------------------------------

// mode 0 (sum) or 1 (mean).
void check_mode(const char* op, int64_t mode);
// t is float32, float64, float16 or bfloat16.
void check_row_dtype(const char* op, const char* name, const at::Tensor& t);
// per_sample_weights (N,) of dtype `want`, only with sum pooling.
void check_psw(const char* op, const std::optional<at::Tensor>& psw, const at::Tensor& slots, int64_t mode,
               at::ScalarType want);

// pooled_lookup, everything but offsets and slot values; returns M = extra_rows.size(0)
// (0 without extra_rows).
int64_t check_pooled_lookup_args(const char* op, const at::Tensor& weights, const at::Tensor& slots,
                                 const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
                                 int64_t mode, const std::optional<at::Tensor>& extra_rows);

// pooled_lookup_many: one entry per table in every list, each table as
// check_pooled_lookup_args (named table_op_name(op, k)), all on one device with one dtype
// and embedding dim. Returns the tables' names; extra[k] = M of table k.
std::vector<std::string> check_pooled_lookup_many_args(const char* op, at::TensorList weights, at::TensorList slots,
                                                       at::TensorList offsets,
                                                       const c10::List<std::optional<at::Tensor>>& per_sample_weights,
                                                       at::IntArrayRef mode,
                                                       const c10::List<std::optional<at::Tensor>>& extra_rows,
                                                       std::vector<int64_t>& extra);

// The backward inputs (accumulate_grad, accumulate_and_update) before the bag layout:
// grad_output (B, D) rows, slots (N,) int64, devices, mode and per_sample_weights.
void check_backward_inputs(const char* op, const at::Tensor& grad_output, const at::Tensor& slots,
                           const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
                           int64_t mode);
// The bag layout of a backward pass (check_offsets) and one grad_output row per bag;
// returns the number of bags B. Reads offsets on the host.
int64_t check_backward_bags(const char* op, const at::Tensor& grad_output, const at::Tensor& offsets, int64_t n,
                            bool include_last_offset);
// One grad_output row per bag.
void check_grad_output_rows(const char* op, const at::Tensor& grad_output, int64_t num_bags);
// check_backward_inputs, then check_backward_bags.
int64_t check_backward_args(const char* op, const at::Tensor& grad_output, const at::Tensor& slots,
                            const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
                            int64_t mode, bool include_last_offset);

// accumulate_grad: num_rows >= 0.
void check_num_rows(const char* op, int64_t num_rows);
// CUDA kernels index bags with int32.
void check_num_bags_cuda(const char* op, int64_t num_bags);

// accumulate_and_update: grad_output on weights' device, of its dtype and width.
void check_grad_output_for_weights(const char* op, const at::Tensor& grad_output, const at::Tensor& weights);

// Ops over several tables: the name their checks give table k, "<op> (table k)", so that
// a message says which table is wrong.
std::string table_op_name(const char* op, int64_t k);

// accumulate_and_update_many, everything but the values of offsets and slots (the backends
// read those: the CPU on the host, CUDA with one read-back for all tables): every list
// holds one entry per table; the hyperparameters; each table as accumulate_and_update
// checks it (check_update_rows, check_backward_inputs, check_grad_output_for_weights, the
// offsets' shape and one grad_output row per bag), its messages naming the table; every
// table on weights[0]'s device, of its dtype and embedding dim; and no two tables' weights
// or opt_state in the same memory (the tables are updated at once, so one table given
// twice would not be updated twice). Returns per table its name and number of bags.
// extra_rows, extra_state: None, or one entry per table each (check_extra_update_rows; the
// extra rows of table k are num_extra[k], 0 for a table without them).
struct ManyTables {
  std::vector<std::string> names;  // table_op_name(op, k)
  std::vector<int64_t> num_bags;   // B_k
  std::vector<int64_t> num_extra;  // E_k
};
ManyTables check_update_many_args(const char* op, at::TensorList weights, at::TensorList opt_state,
                                  at::TensorList grad_output, at::TensorList slots, at::TensorList offsets,
                                  const c10::List<std::optional<at::Tensor>>& per_sample_weights, int64_t mode,
                                  bool include_last_offset, int64_t optimizer, const at::Tensor& hparams,
                                  const std::optional<at::TensorList>& extra_rows,
                                  const std::optional<at::TensorList>& extra_state);

// Every slot s[0..n) must be -1, -2 or in [0, limit) (limit < 0: no upper bound). Host
// pointer; the CUDA kernels call it on a host copy once a device reduction found a bad slot.
void check_slot_values(const char* op, const int64_t* s, int64_t n, int64_t limit, const char* limit_what);

// ---- exchange --------------------------------------------------------------------------

// owner_of, bucketize_bags: ids (N,) int64 and world_size >= 1.
void check_exchange_ids(const char* op, const at::Tensor& ids, int64_t world_size);
// bucketize_bags: check_exchange_ids, offsets on ids' device and the bag layout
// (check_offsets); returns the number of bags B.
int64_t check_bucketize_shapes(const char* op, const at::Tensor& ids, const at::Tensor& offsets,
                               bool include_last_offset, int64_t world_size);  // all but the layout's values
int64_t check_bucketize_args(const char* op, const at::Tensor& ids, const at::Tensor& offsets,
                             bool include_last_offset, int64_t world_size);
// CUDA kernels sort owners as int32 keys.
void check_world_size_cuda(const char* op, int64_t world_size);
// combine_parts(_as): the type each bag's sum is accumulated in: float64 when the parts or
// the output are float64, else the parts' opmath type (float32 for 16-bit parts).
template <typename In, typename Out>
using combine_acc_t =
    std::conditional_t<std::is_same_v<In, double> || std::is_same_v<Out, double>, double, at::opmath_type<In>>;
// combine_parts: parts (P, D) floating, bag_of_part (P,) int64 on parts' device, num_bags >= 0.
void check_combine_parts_args(const char* op, const at::Tensor& parts, const at::Tensor& bag_of_part,
                              int64_t num_bags);
// regroup_blocks: one contiguous run of rows copied from a source into the output.
struct RegroupBlock {
  int64_t source;  // index into sources
  int64_t row;     // first row in it
  int64_t rows;    // rows copied
};
// regroup_blocks' arguments checked (same dtype, device and row shape for every source, the
// counts non-negative and the sources' rows what they add up to), and its copies in output
// order: one per (group, peer), the empty ones left out.
std::vector<RegroupBlock> regroup_plan(const char* op, at::TensorList sources, at::IntArrayRef counts,
                                       int64_t num_groups, bool to_group_major);
// What the kernels copy from and into, for a plan (both backends; on CUDA under the
// device guard: the contiguous copies run on the current stream). The output has
// out_dtype (regroup_blocks_as; the sources' own for regroup_blocks).
struct RegroupCopy {
  std::vector<at::Tensor> sources;  // contiguous
  int64_t row_elems;                // from the row shape, not numel / rows: a source may have no rows
  int64_t row_bytes;                // of a source row
  at::Tensor out;                   // (rows of every block, the sources' row shape), uninitialised
};
RegroupCopy regroup_copy(at::TensorList sources, const std::vector<RegroupBlock>& plan,
                         at::ScalarType out_dtype);
// regroup_blocks_as and combine_parts_as: rows of `from` converted to `to` in the op's own
// pass. Any dtype to itself; between dtypes, float32, float64, float16 and bfloat16.
void check_row_conversion(const char* op, const char* name, at::ScalarType from, at::ScalarType to);
// Every bag index bag[0..P) is in [0, num_bags). Host pointer (CUDA: on a host copy, once a
// device reduction found a bad index).
void check_bag_indices(const char* op, const int64_t* bag, int64_t P, int64_t num_bags);

// ---- optimizer -------------------------------------------------------------------------

// The table rows of an update (optimizer, weights, opt_state); returns S.
int64_t check_update_rows(const char* op, const at::Tensor& weights, const at::Tensor& opt_state,
                          int64_t optimizer);
// hparams of an update: a float64 1-D tensor of the optimizer's length ([lr, step,
// weight_decay] and its own values, veloce/optim/rule.h) on ref's device. Its values are
// not read (on CUDA they stay on the device).
void check_hparams(const char* op, const at::Tensor& hparams, int64_t optimizer, const char* ref_name,
                   const at::Tensor& ref);
// The values of a checked hparams, read on the host (the CPU kernels): lr finite and >= 0,
// step a whole number, weight_decay finite, then the optimizer's own checks.
void check_hparam_values(const char* op, const at::Tensor& hparams, int64_t optimizer);
// check_update_rows, then check_hparams on weights; returns S. Shared by every op that
// updates rows (messages name `op`).
int64_t check_update_args(const char* op, const at::Tensor& weights, const at::Tensor& opt_state, int64_t optimizer,
                          const at::Tensor& hparams);

// accumulate_and_update(_many)'s extra rows of one table: extra_rows (E, D) of weights' dtype
// and extra_state (E, S) of opt_state's, contiguous, on weights' device, both given or neither;
// returns E (0 for neither). rows_name and state_name name them in messages.
int64_t check_extra_update_rows(const char* op, const char* rows_name, const char* state_name,
                                const at::Tensor* extra_rows, const at::Tensor* extra_state,
                                const at::Tensor& weights, const at::Tensor& opt_state);
// accumulate_and_update's extra rows (None, or both): check_extra_update_rows, then
// check_disjoint_writes over the four written tensors.
void check_extra_update(const char* op, const at::Tensor& weights, const at::Tensor& opt_state,
                        const std::optional<at::Tensor>& extra_rows, const std::optional<at::Tensor>& extra_state);
// The tensors an update writes share no memory (a table given twice, or extra rows inside
// its own rows, would not be updated as the op promises); names[i] names tensors[i].
void check_disjoint_writes(const char* op, const std::vector<std::pair<std::string, const at::Tensor*>>& written);

// sparse_update: slots (U,) int64 and grads (U, D) of weights' dtype, on weights' device.
void check_update_grads(const char* op, const at::Tensor& weights, const at::Tensor& slots,
                        const at::Tensor& grads);

// Every slot s[0..U) is in [0, C); returns whether they are strictly increasing (hence unique).
bool check_update_slot_range(const char* op, const int64_t* s, int64_t U, int64_t C);
// Fails with "slots must be unique" naming dup_slot unless `unique`.
void check_update_slots_unique(const char* op, bool unique, int64_t dup_slot);

// nonfinite_flags: at least one tensor, all float32, float64, float16 or bfloat16 (the
// types whose NaN/Inf are an exponent of all ones) and on one device; one owner per tensor,
// each in [0, num_owners).
void check_nonfinite_args(const char* op, at::TensorList tensors, at::IntArrayRef owner, int64_t num_owners);

// bag_layouts_bad's arguments: one num_ids (>= 0) and one include_last_offset (0 or 1) per
// offsets tensor, each int64 and 1-D on the device of offsets[0]. Returns whether a layout
// breaks a rule that its shape alone shows (an empty offsets with ids, or with
// include_last_offset): those need no read of the entries.
bool check_bag_layouts_args(const char* op, at::TensorList offsets, at::IntArrayRef num_ids,
                            at::IntArrayRef include_last_offset);

}  // namespace veloce
