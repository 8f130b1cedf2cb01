// The whole op surface of veloce on one screen: every schema of torch.ops.veloce.
//
// Kernels live in csrc/cpu/<family>.cpp and csrc/cuda/<family>.cu, each ending with its
// TORCH_LIBRARY_IMPL block; fake (meta) kernels and autograd are registered in Python
// (veloce/ops/<family>.py). docs/ops.md documents shapes and semantics.
//
// Conventions:
//   * Table state is a set of tensors of C = num_buckets * 32 slots, any num_buckets in
//     [1, 2^32] (see veloce/hash.h):
//       keys (C,) int64, digests (C,) uint8 (0 = empty), scores (C,) int64,
//       weights (C, D) float, opt_state (C, S) float (S = 0 for SGD: the optimizer's width).
//   * A "slot" indexes those tensors; ops that take slots also accept the codes
//     -1 (padding: skipped, not counted by mean) and -2 (a zero row, counted by mean).
//   * Mutated arguments are marked (a!) and never returned.
//   * Ops that insert return counts = [num_inserted, num_failed]. num_failed > 0 means the
//     table had no room (eviction off) and the op changed nothing; the caller grows the
//     table and calls again.

#include <Python.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

extern "C" {
// An empty module: importing veloce._C loads the shared library, whose static
// initializers register the ops. No pybind, so the op surface stays ABI-stable.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(veloce, m) {
  // ---- hash_table: ids -> slots over tensor state -------------------------------------
  // slots (N,) int64: the slot of each id, -1 where the id is absent. Never inserts.
  m.def("find(Tensor keys, Tensor digests, Tensor ids) -> Tensor");
  // Looks every id up, inserting the missing ones (rows initialised from (seed, id),
  // optimizer state set to init_state, or zeroed when it is None) and updating scores (policy: a score functor of
  // veloce/score.h: 0 none, 1 LRU = set to score_value, 2 LFU = add 1 per occurrence). Positions whose id equals padding_id get slot -1 and
  // are neither inserted nor scored. With allow_evict, a key whose two buckets are full
  // replaces the lowest-scored key there that this call did not touch (evicted_keys).
  // counts = [inserted, failed] is a CPU tensor on every backend (no device sync to read).
  // bad_input: a one-element bool tensor on the table's device, the result of the caller's
  // own device-side check of this call's input (e.g. a bag layout). The op reads it with its
  // first host read-back (on CUDA in the same copy as the miss counts, so the caller's
  // check costs no sync of its own) and, when it is true, raises a ValueError before
  // changing the table: nothing is inserted and no score changes.
  // defer: the op does not read the device back (on CUDA no host sync at all). counts is
  // then a tensor on the table's device, valid once the op's work has run; nothing is
  // refused on the host: a set bad_input makes the call change nothing and report
  // failed = -1, and a call that finds no room changes nothing and reports failed > 0, with
  // every slot -1 in both cases. It needs allow_evict false (an eviction's keys are listed
  // on the host) and, on CUDA, torch's deterministic mode off (conflicting new ids then
  // race instead of being placed in order, which needs their count on the host).
  m.def(
      "find_or_insert(Tensor(a!) keys, Tensor(b!) digests, Tensor(c!) scores, Tensor(d!) weights, "
      "Tensor(e!) opt_state, Tensor ids, int score_policy, int score_value, bool allow_evict, "
      "int seed, int init_kind, float init_a, float init_b, int? padding_id=None, Tensor? bad_input=None, "
      "bool defer=False, Tensor? clock=None, int room=-1, Tensor? init_state=None, Tensor? admit=None) -> (Tensor slots, "
      "Tensor counts, Tensor evicted_keys)");
  // admit: (N,) bool on ids' device, or None (every id admitted). An id absent from the
  // table at a position whose admit is false is not inserted (nor scored) and gets slot C
  // (the capacity: the pooling kernels' extra row 0, where the caller passes its default
  // row); present ids are found as always. The repeats of an id should agree (an admission
  // decision is a function of the id): a refused position of an id that another position
  // inserts still gets C.
  // init_state: (S,) of opt_state's dtype on its device, the state every new row starts
  // from (the optimizer's initial_state), or None for zeros. A new optimizer's initial state needs no schema of its own.
  // room: how many new ids may take an empty slot (the rows a table bounded by max_capacity
  // has left), or -1 for no limit. New ids in order of first occurrence: the first `room`
  // take an empty slot of their buckets (with allow_evict, one whose buckets are both full
  // evicts), the later ones evict the lowest-scored occupied key of their buckets that this
  // call did not touch (allow_evict) or the call fails, changing nothing, with failed =
  // new ids - room. -1 with defer.
  // clock: a (1,) int64 tensor on the table's device, or None. When given, it replaces
  // score_value and is read on the device (on CUDA by the kernels, no host read): a call
  // captured in a CUDA graph then stamps the value the clock holds when the graph is
  // replayed. Its value is not checked on CUDA.
  // find_or_insert on K tables at once (list arguments: entry k is table k's), with the
  // results of K separate calls: slots of all tables concatenated (table k's N_k after the
  // N of the tables before it), counts (K, 3) = [inserted, failed, evicted] per table (a
  // CPU tensor), evicted_keys of all tables concatenated. On CUDA the calls share their
  // host syncs: 1 to 3 per op instead of per table. No table may appear twice. One
  // bad_input flag (on the tables' device; it needs K >= 1) covers the whole call: when
  // set, no table changes. defer: as for find_or_insert, per table (counts (K, 3) on the
  // tables' device, evicted 0; a set bad_input reports failed = -1 for every table).
  m.def(
      "find_or_insert_many(Tensor(a!)[] keys, Tensor(b!)[] digests, Tensor(c!)[] scores, Tensor(d!)[] weights, "
      "Tensor(e!)[] opt_state, Tensor[] ids, int[] score_policy, int[] score_value, bool[] allow_evict, "
      "int[] seed, int[] init_kind, float[] init_a, float[] init_b, int?[] padding_id, Tensor? bad_input=None, "
      "bool defer=False, Tensor? clock=None, int[]? room=None, Tensor?[]? init_state=None, Tensor?[]? admit=None) "
      "-> (Tensor slots, Tensor counts, Tensor evicted_keys)");
  // clock: as for find_or_insert, (K,) int64: clock[k] replaces score_value[k]. room: as for
  // find_or_insert, one value per table (None: no limit for any). init_state: None (zeros
  // for every table) or one entry per table, each as find_or_insert's. admit: None (every id
  // of every table admitted) or one entry per table, each as find_or_insert's.
  // Writes values (N, D) to the rows of ids, inserting missing ids. opt_values (N, S)
  // and score_values (N,) are written when given; otherwise new rows get init_state (as
  // find_or_insert's: None is zeros) and scores follow score_policy. With duplicate ids the
  // last occurrence wins.
  m.def(
      "insert_or_assign(Tensor(a!) keys, Tensor(b!) digests, Tensor(c!) scores, Tensor(d!) weights, "
      "Tensor(e!) opt_state, Tensor ids, Tensor values, Tensor? opt_values, Tensor? score_values, "
      "int score_policy, int score_value, bool allow_evict, int room=-1, Tensor? init_state=None) "
      "-> (Tensor slots, Tensor counts, Tensor evicted_keys)");
  // room: as for find_or_insert.
  // Removes ids; returns a (N,) bool mask, true at the first position of each erased id.
  m.def("erase(Tensor keys, Tensor(a!) digests, Tensor ids) -> Tensor");
  // Removes every occupied slot whose score is < before (a time-to-live's expiry: with LRU
  // scores, the keys last seen before the clock `before`); returns their number, a 0-dim
  // int64 tensor on keys' device. One pass over the slots, no host sync.
  m.def("expire(Tensor keys, Tensor(a!) digests, Tensor scores, int before) -> Tensor");
  // ---- sketch: feature admission's count-min sketch -------------------------------------
  // Adds each position's sightings of ids (one, or sightings[i] >= 0; none where counted is
  // false) to the (depth, width) int32 counters, in place: in row d, the counter of id is
  // (splitmix64(id ^ salt_d) & (2^63 - 1)) % width, salt_d = splitmix64(seed * 1000003 + d)
  // (veloce/admission.py, sketch_slots). Returns each position's estimate after every add of
  // the call, the minimum of its id's counters, (N,) int64; counters saturate at 2^30 - 1.
  // Fewer than 2^30 ids (and sightings) per call. No host sync.
  m.def(
      "sketch_count(Tensor(a!) counters, Tensor ids, int seed, Tensor? counted=None, Tensor? sightings=None) "
      "-> Tensor");
  // sketch_count's adds (none at all when skip, a (1,) bool, holds true: read on the device),
  // then each position's admission as a (N,) bool instead of its estimate e: e >= min_count
  // and, for p < 1, a draw below p, deterministic per (draw_seed, id, e) (veloce.admission's
  // Frequency: min_count = k, p = 1; Probability: min_count = 0). One pass less than
  // sketch_count and the test, and no (N,) int64 estimate written. No host sync.
  m.def(
      "sketch_admit(Tensor(a!) counters, Tensor ids, int seed, int min_count, float p, int draw_seed, "
      "Tensor? counted=None, Tensor? sightings=None, Tensor? skip=None) -> Tensor");
  // Feature admission's telemetry of one training insert's slots, in place: stats (4,) int64
  // gets += the positions with a row of their own (0 <= slot < capacity) in stats[0] and
  // those its default row serves (slot == capacity) in stats[1], each counted sightings[i]
  // times when given; stats[2:4] = this call's two counts. One pass, no host sync.
  m.def("admission_tally(Tensor(a!) stats, Tensor slots, int capacity, Tensor? sightings=None) -> ()");
  // The entries of the occupied slots in [start, end), in slot order:
  // keys (M,), weights (M, D), opt_state (M, S), scores (M,).
  m.def(
      "export(Tensor keys, Tensor digests, Tensor scores, Tensor weights, Tensor opt_state, int start, "
      "int end) -> (Tensor keys, Tensor weights, Tensor opt_state, Tensor scores)");
  // The initializer's rows for ids: (N, dim) of dtype on ids' device. kind: 0 zeros,
  // 1 constant(a), 2 uniform(a, b), 3 normal(mean=a, std=b).
  m.def(
      "initialize(Tensor ids, int dim, int seed, int init_kind, float init_a, float init_b, "
      "ScalarType dtype) -> Tensor");

  // ---- embedding: pooled lookup and the sparse gradient accumulate ----------------------
  // flag (1,) bool on the offsets' device: true when a bag layout k breaks a rule of
  // nn.EmbeddingBag's offsets for num_ids[k] ids: offsets[k][0] != 0, a decrease, the last
  // entry past num_ids[k], or (include_last_offset[k] != 0) not equal to it; an empty
  // offsets[k] breaks one when num_ids[k] > 0 or include_last_offset[k] != 0. One read of
  // every entry and no host sync (on CUDA the flag's fill, then one launch per 32 layouts,
  // and a copy of each strided offsets): the check behind every op's check_inputs, and
  // DynamicEmbedding's check of its input, whose flag rides on the insert's read-back
  // (find_or_insert's bad_input). offsets must hold at least one tensor.
  m.def("bag_layouts_bad(Tensor[] offsets, int[] num_ids, int[] include_last_offset) -> Tensor");
  // out (B, D): per bag b, the sum (mode 0) or mean (mode 1) of rows slots[i] for i in
  // the bag, scaled by per_sample_weights[i] (sum only). Slots >= weights.size(0) index
  // extra_rows (M, D). Empty bags give zeros.
  // check_inputs=False skips the checks that read offsets and slots (on CUDA a host sync),
  // for callers whose inputs are valid by construction (DynamicEmbedding's own slots).
  m.def(
      "pooled_lookup(Tensor weights, Tensor slots, Tensor offsets, Tensor? per_sample_weights, int mode, "
      "bool include_last_offset, Tensor? extra_rows=None, bool check_inputs=True) -> Tensor");
  // pooled_lookup of K tables in one call: out[k] = pooled_lookup(weights[k], slots[k],
  // offsets[k], per_sample_weights[k], mode[k], include_last_offset, extra_rows[k],
  // check_inputs), each its own tensor. The tables share device, dtype and embedding dim
  // (a table may appear more than once); on CUDA one launch serves up to 32 tables.
  m.def(
      "pooled_lookup_many(Tensor[] weights, Tensor[] slots, Tensor[] offsets, Tensor?[] per_sample_weights, "
      "int[] mode, bool include_last_offset, Tensor?[] extra_rows, bool check_inputs=True) -> Tensor[]");
  // The backward of pooled_lookup w.r.t. weights, reduced per unique row: unique_slots
  // (U,) sorted ascending over slots in [0, num_rows), grad_rows (U, D). Deterministic.
  m.def(
      "accumulate_grad(Tensor grad_output, Tensor slots, Tensor offsets, Tensor? per_sample_weights, "
      "int mode, bool include_last_offset, int num_rows) -> (Tensor unique_slots, Tensor grad_rows)");

  // ---- exchange: sharding a batch of bags across ranks ------------------------------------
  // owner (N,) int64: the rank owning each id, owner_hash(id) % world_size (a hash
  // independent of the table's, so each shard still fills all of its buckets).
  m.def("owner_of(Tensor ids, int world_size) -> Tensor");
  // Groups the positions of a batch of bags by owner for an all-to-all. Positions equal to
  // padding_id are dropped. perm (M,): the other positions, stably sorted by owner;
  // id_splits (W,): how many go to each owner. Each bag is cut into parts, one per owner
  // it has ids on, ordered by (owner, bag): bag_of_part (P,), part_lengths (P,) (the ids of
  // part p are consecutive in perm) and part_splits (W,): parts per owner.
  // exact_sizes=False: the same values without a host sync on CUDA, in outputs of upper-bound
  // sizes: perm (N,) ends with the padding positions (ascending), bag_of_part and
  // part_lengths (N,) hold the P parts first and zeros after (P = part_splits.sum()); the
  // CUDA kernel then skips the check of the offsets' values (its read-back) and stays in
  // bounds on any offsets, for callers that check the layout themselves.
  m.def(
      "bucketize_bags(Tensor ids, Tensor offsets, bool include_last_offset, int world_size, "
      "int? padding_id=None, bool exact_sizes=True) -> (Tensor perm, Tensor id_splits, Tensor bag_of_part, "
      "Tensor part_lengths, Tensor part_splits)");
  // out (num_bags, D): out[b] = the sum of parts[p] over p with bag_of_part[p] == b, added in
  // part order (deterministic); bags without parts are zero.
  m.def("combine_parts(Tensor parts, Tensor bag_of_part, int num_bags, bool check_bags=True) -> Tensor");
  // The rows an all-to-all moves, regrouped between the order it delivers (peer-major: from
  // each peer in turn, its block of every group) and the order an owner serves (group-major:
  // each group's blocks in peer order). counts (G * W,): counts[g * W + p] rows of group g go
  // with peer p. to_group_major: sources = [rows in peer-major order] and out is group-major;
  // else sources = the G groups' rows (each in peer order) and out is peer-major. One copy,
  // one launch on CUDA (per 128 blocks), whatever G * W.
  m.def("regroup_blocks(Tensor[] sources, int[] counts, int num_groups, bool to_group_major) -> Tensor");
  // regroup_blocks with the rows converted to dtype in the same copy, and combine_parts with
  // the sums (accumulated in float64 if the parts or dtype are float64, else float32) written
  // as dtype: the exchanges that send rows in 16 bits (HybridParallel(exchange_dtype=...))
  // narrow and widen them without a pass of their own. float32, float64, float16 and bfloat16
  // convert to one another; any dtype to itself. Separate ops rather than an optional
  // argument: torch.library's autograd cannot take an optional argument passed as None.
  m.def(
      "regroup_blocks_as(Tensor[] sources, int[] counts, int num_groups, bool to_group_major, "
      "ScalarType dtype) -> Tensor");
  m.def(
      "combine_parts_as(Tensor parts, Tensor bag_of_part, int num_bags, bool check_bags, ScalarType dtype) "
      "-> Tensor");

  // ---- optimizer: fused sparse update ---------------------------------------------------
  // In place on rows slots (U,) (unique) of weights (C, D) and opt_state (C, S), with
  // gradients grads (U, D). optimizer: an id of csrc/include/veloce/optim/registry.h
  // (veloce.ops.optimizer.OPTIMIZERS), S its state width.
  // hparams: the hyperparameters, a float64 tensor on weights' device laid out
  // [lr, step, weight_decay, <the optimizer's own values>] (veloce/optim/rule.h; step is the
  // 1-based step count). It is read on the device (on CUDA by the kernels: no host read),
  // so that a call captured in a CUDA graph applies the values the tensor holds when the
  // graph is replayed. The CPU reads and checks the values (lr finite and >= 0, step a
  // whole number, the optimizer's own ranges); CUDA checks the tensor's shape, dtype and
  // device only.
  m.def("sparse_update(Tensor(a!) weights, Tensor(b!) opt_state, Tensor slots, Tensor grads, int optimizer, "
        "Tensor hparams) -> ()");
  // accumulate_grad then sparse_update on its output, fused: the gradient of each unique
  // row is summed and applied in one pass (what DynamicEmbedding.step() runs). Same
  // arguments as the two ops, same result as calling them in turn. (`pooling` is `mode`
  // renamed: torch's functionalization of mutable ops reserves an argument named `mode`.)
  // check_inputs as for pooled_lookup. skip: a (1,) bool tensor on weights' device; when
  // it holds true the op changes nothing. It is read on the device (on CUDA by the fused
  // kernel: no host sync), so a caller can queue the update behind a device-side check of
  // the gradient (DynamicEmbedding's NaN/Inf check) and read that check's result later.
  // extra_rows (E, D) and extra_state (E, S), both or neither: rows past the table's own,
  // updated as rows of it: slot C + e (C = weights.size(0)) is extra row e, as pooled_lookup
  // reads it (a table's default row under admission, trained in the table's own pass).
  m.def(
      "accumulate_and_update(Tensor(a!) weights, Tensor(b!) opt_state, Tensor grad_output, Tensor slots, "
      "Tensor offsets, Tensor? per_sample_weights, int pooling, bool include_last_offset, int optimizer, "
      "Tensor hparams, bool check_inputs=True, Tensor? skip=None, Tensor(c!)? extra_rows=None, "
      "Tensor(d!)? extra_state=None) -> ()");
  // accumulate_and_update of K tables in one call: the same as calling it for each k on
  // (weights[k], opt_state[k], grad_output[k], slots[k], offsets[k], per_sample_weights[k])
  // with the other arguments shared. The tables share device, dtype and embedding dim (and
  // may differ in rows and batch sizes); no table may appear twice. On CUDA one sort and one
  // fused kernel serve every table (what DynamicEmbedding's step_tables runs); K = 0 is a
  // no-op. check_inputs as for pooled_lookup (one read-back for all tables on CUDA).
  // extra_rows, extra_state: None, or one entry per table ((0, D) and (0, S) for a table
  // without extra rows).
  m.def(
      "accumulate_and_update_many(Tensor(a!)[] weights, Tensor(b!)[] opt_state, Tensor[] grad_output, "
      "Tensor[] slots, Tensor[] offsets, Tensor?[] per_sample_weights, int pooling, bool include_last_offset, "
      "int optimizer, Tensor hparams, bool check_inputs=True, Tensor? skip=None, Tensor(c!)[]? extra_rows=None, "
      "Tensor(d!)[]? extra_state=None) -> ()");
  // flags (num_owners + 1,) bool on the tensors' device: flags[k] is true when a tensor i
  // with owner[i] == k holds a NaN or an infinity (an exponent of all ones: the test
  // std::isfinite makes, on the bits), flags[num_owners] when any tensor does. One read of
  // every element and no host sync; flags[num_owners:] is a ready `skip` argument of the
  // updating ops (DynamicEmbedding's NaN/Inf check of its pending gradients).
  m.def("nonfinite_flags(Tensor[] tensors, int[] owner, int num_owners) -> Tensor");
}

namespace veloce {
namespace {

// Whether an argument is one the op writes: Tensor(a!), or Tensor(a!)[] (whose element
// type carries the annotation).
bool is_written(const c10::Argument& arg) {
  const c10::AliasInfo* alias = arg.alias_info();
  if (alias == nullptr) return false;
  if (alias->isWrite()) return true;
  for (const c10::AliasInfo& inner : alias->containedTypes()) {
    if (inner.isWrite()) return true;
  }
  return false;
}

// The ADInplaceOrView kernel of the ops that write their arguments: it runs the op, then
// bumps the version counter of every tensor the schema marks written, as torch's own
// in-place ops do. Autograd then refuses a backward that saved one of those tensors before
// the op changed it ("modified by an inplace operation"), where it would silently use the
// new rows: pooled_lookup saves the weights for the gradient of per_sample_weights, and a
// find_or_insert that evicts, or an update, rewrites them. Inference tensors have no
// version counter (and no ADInplaceOrView key: in inference mode this kernel is skipped).
void bump_written_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const std::vector<c10::Argument>& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!is_written(args[i])) continue;
    const c10::IValue& value = (*stack)[first + i];
    if (value.isTensor()) {
      written.push_back(value.toTensor());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorVector()) written.push_back(t);
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) {
    if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, ADInplaceOrView, m) {
  for (const char* name : {"find_or_insert", "find_or_insert_many", "insert_or_assign", "erase", "expire",
                           "sketch_count", "sketch_admit", "admission_tally", "sparse_update", "accumulate_and_update",
                           "accumulate_and_update_many"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&veloce::bump_written_versions>());
  }
}
