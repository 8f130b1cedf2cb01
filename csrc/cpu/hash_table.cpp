// CPU kernels of the hash_table family: ids -> slots over tensor table state.
// Semantics: docs/ops.md ("Table layout", "hash_table"); bucket probing: veloce/bucket.h.
//
// Inserting ops run in three phases:
//   1. parallel find of every id (no mutation);
//   2. sequential insertion of the missing ids in order of first occurrence, writing only
//      keys and digests and logging each change, so a failure can undo them all;
//   3. on success only, parallel writes of rows, optimizer state and scores.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "veloce/bucket.h"
#include "veloce/check.h"
#include "veloce/hash.h"
#include "veloce/init.h"
#include "veloce/many.h"
#include "veloce/op_checks.h"
#include "veloce/score.h"

namespace veloce {
namespace {

constexpr int64_t kGrain = 2048;
constexpr int64_t kMissing = -3;  // phase 1 marker: absent, to be inserted in phase 2

// A small open-addressing map from slots (>= 0) to int64, sized for at most n entries.
class SlotMap {
 public:
  explicit SlotMap(int64_t n) {
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    mask_ = cap - 1;
    keys_.assign(cap, -1);
    vals_.resize(cap);
  }
  // The value of slot, default-inserted as 0 when absent.
  int64_t& operator[](int64_t slot) {
    int64_t i = index(slot);
    if (keys_[i] < 0) {
      keys_[i] = slot;
      vals_[i] = 0;
      entries_.push_back(i);
    }
    return vals_[i];
  }
  bool contains(int64_t slot) const { return keys_[index(slot)] == slot; }
  // Entries k = 0 .. size() - 1 in insertion order.
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  int64_t key_at(int64_t k) const { return keys_[entries_[k]]; }
  int64_t value_at(int64_t k) const { return vals_[entries_[k]]; }

 private:
  int64_t index(int64_t slot) const {
    int64_t i = static_cast<int64_t>(fmix64(static_cast<uint64_t>(slot)) & static_cast<uint64_t>(mask_));
    while (keys_[i] >= 0 && keys_[i] != slot) i = (i + 1) & mask_;
    return i;
  }
  int64_t mask_;
  std::vector<int64_t> keys_;
  std::vector<int64_t> vals_;
  std::vector<int64_t> entries_;
};

// One phase-2 change: `slot` held (old_key, old_digest) and now holds new_key.
struct Change {
  int64_t slot;
  int64_t new_key;  // kept here so phase 3 need not read keys[slot] back (a cache miss)
  int64_t old_key;
  uint8_t old_digest;
};

struct InsertOutcome {
  std::vector<Change> changes;  // in insertion order; empty after a failure
  int64_t num_failed = 0;       // distinct ids that found no room
};

TableRef table_ref(const at::Tensor& keys, const at::Tensor& digests) {
  return {keys.data_ptr<int64_t>(), digests.data_ptr<uint8_t>(), keys.numel() / kBucketSize};
}

// The first slot of bucket whose digest matches, or -1: where a lookup will read a key.
int64_t first_digest_match(const TableRef& t, int64_t bucket, uint8_t digest) {
  const int64_t base = bucket * kBucketSize;
  for (int64_t w = 0; w < kBucketSize; w += 8) {
    const uint64_t m = zero_bytes(load_word(t.digests + base + w) ^ (kByteOnes * digest));
    if (m != 0) return base + w + lowest_byte(m);
  }
  return -1;
}

// Phase 1: slots[i] = the slot of ids[i], `absent` where it is not in the table, and -1
// where ids[i] == *padding_id. Lookups are memory-latency bound, so each block of ids is
// looked up in three passes: prefetch the digests of both buckets, prefetch the first
// candidate key, then the real lookup on (mostly) cached lines.
void find_all(const TableRef& t, const int64_t* ids, int64_t n, int64_t* slots, int64_t absent,
              std::optional<int64_t> padding_id) {
  constexpr int64_t kBlock = 16;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    Probe p[kBlock];
    for (int64_t i0 = begin; i0 < end; i0 += kBlock) {
      const int64_t m = std::min(kBlock, end - i0);
      for (int64_t k = 0; k < m; ++k) {
        p[k] = probe_of(ids[i0 + k], t.num_buckets);
        __builtin_prefetch(t.digests + p[k].bucket_a * kBucketSize);
        __builtin_prefetch(t.digests + p[k].bucket_b * kBucketSize);
      }
      for (int64_t k = 0; k < m; ++k) {
        int64_t c = first_digest_match(t, p[k].bucket_a, p[k].digest);
        if (c < 0) c = first_digest_match(t, p[k].bucket_b, p[k].digest);
        if (c >= 0) __builtin_prefetch(t.keys + c);
      }
      for (int64_t k = 0; k < m; ++k) {
        const int64_t i = i0 + k, id = ids[i];
        if (padding_id && id == *padding_id) {
          slots[i] = kPaddingSlot;
          continue;
        }
        const int64_t s = find_slot(t, p[k], id);
        slots[i] = s >= 0 ? s : absent;
      }
    }
  });
}

// The eviction victim for a key that must evict (its buckets are both full, or the call's
// room is used up): the lowest score among the occupied candidates not touched by this
// call, ties to the lowest slot of bucket_a, then bucket_b; -1 when there is none.
int64_t eviction_victim(const TableRef& t, const Probe& p, const int64_t* scores, const SlotMap& touched) {
  int64_t best = -1;
  const int64_t buckets[2] = {p.bucket_a, p.bucket_b};
  for (int k = 0; k < (p.bucket_b == p.bucket_a ? 1 : 2); ++k) {
    for (int64_t s = buckets[k] * kBucketSize; s < (buckets[k] + 1) * kBucketSize; ++s) {
      if (t.digests[s] != kEmptyDigest && !touched.contains(s) && (best < 0 || scores[s] < scores[best])) best = s;
    }
  }
  return best;
}

// Phase 2: inserts the ids at positions marked kMissing, in order of first occurrence,
// and fills in their slots. Writes only keys and digests; if any id finds no room, every
// change is undone and the slots are all set to -1.
//
// room (>= 0, or kNoRoomLimit): how many new ids may take an empty slot (the rows a table
// bounded by max_capacity has left). The first `room` new ids take an empty slot of their
// buckets (or, with allow_evict, evict when both are full); the later ones must evict
// (allow_evict) or fail. A call without allow_evict whose new ids pass the room fails with
// num_failed = new ids - room (the count the CUDA kernels know before placing any).
InsertOutcome insert_missing(const TableRef& t, const int64_t* scores, const int64_t* ids, int64_t n,
                             int64_t* slots, bool allow_evict, int64_t room) {
  InsertOutcome out;
  std::unique_ptr<SlotMap> touched;  // slots found or inserted by this call; built on the first eviction
  std::vector<int64_t> failed;
  std::vector<int64_t> todo;
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] == kMissing) todo.push_back(i);
  }
  std::vector<Probe> probes(todo.size());
  at::parallel_for(0, static_cast<int64_t>(todo.size()), kGrain, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) probes[j] = probe_of(ids[todo[j]], t.num_buckets);
  });
  const int64_t num_todo = static_cast<int64_t>(todo.size());
  out.changes.reserve(todo.size());
  int64_t claimed = 0;  // new ids placed in an empty slot: the room they used
  for (int64_t j = 0; j < num_todo; ++j) {
    // Prefetch ahead: the digests 16 ids on, and the likely key slot 8 ids on.
    if (j + 16 < num_todo) {
      __builtin_prefetch(t.digests + probes[j + 16].bucket_a * kBucketSize);
      __builtin_prefetch(t.digests + probes[j + 16].bucket_b * kBucketSize);
    }
    if (j + 8 < num_todo) {
      const int64_t guess = insert_slot(t, probes[j + 8]);
      if (guess >= 0) __builtin_prefetch(t.keys + guess, 1);
    }
    const int64_t i = todo[j], id = ids[i];
    const Probe& p = probes[j];
    int64_t s = find_slot(t, p, id);  // an earlier position may have inserted it
    if (s < 0) {
      const bool may_claim = room == kNoRoomLimit || claimed < room;
      s = may_claim ? insert_slot(t, p) : -1;
      if (s < 0 && allow_evict) {
        if (!touched) {
          touched = std::make_unique<SlotMap>(n);
          for (int64_t j = 0; j < n; ++j) {
            if (slots[j] >= 0) (*touched)[slots[j]];
          }
        }
        s = eviction_victim(t, p, scores, *touched);
      }
      if (s < 0) {
        failed.push_back(id);
        slots[i] = kPaddingSlot;
        continue;
      }
      if (t.digests[s] == kEmptyDigest) ++claimed;
      out.changes.push_back({s, id, t.keys[s], t.digests[s]});
      t.keys[s] = id;
      t.digests[s] = p.digest;
      if (touched) (*touched)[s];
    }
    slots[i] = s;
  }
  if (!failed.empty()) {
    std::sort(failed.begin(), failed.end());
    out.num_failed = std::unique(failed.begin(), failed.end()) - failed.begin();
    // Every distinct new id was placed once or failed: their number is the call's new ids.
    const int64_t fresh = static_cast<int64_t>(out.changes.size()) + out.num_failed;
    if (!allow_evict && room != kNoRoomLimit && fresh > room) out.num_failed = fresh - room;
    for (auto c = out.changes.rbegin(); c != out.changes.rend(); ++c) {
      t.keys[c->slot] = c->old_key;
      t.digests[c->slot] = c->old_digest;
    }
    out.changes.clear();
    std::fill(slots, slots + n, kPaddingSlot);
  }
  return out;
}

// Scores of policy P for the non-padding positions (phase 3): each new key starts at
// P::on_insert(clock), then every position is scored as veloce/score.h's kCombine says.
template <class P>
void update_scores(int64_t* scores, const int64_t* slots, int64_t n, const std::vector<Change>& changes,
                   int64_t clock) {
  const int64_t start = P::on_insert(clock);
  at::parallel_for(0, static_cast<int64_t>(changes.size()), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) scores[changes[k].slot] = start;
  });
  if constexpr (P::kCombine != score::Combine::kKeep) {
    const int64_t value = P::on_hit(0, clock, 1);  // kStamp: the value stored; kAdd: the step added
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      constexpr int64_t kAhead = 16;  // score stores are random: prefetch their lines
      for (int64_t i = begin; i < end; ++i) {
        if (i + kAhead < end && slots[i + kAhead] >= 0) __builtin_prefetch(scores + slots[i + kAhead], 1);
        const int64_t s = slots[i];
        if (s < 0) continue;
        if constexpr (P::kCombine == score::Combine::kStamp) {
          __atomic_store_n(scores + s, value, __ATOMIC_RELAXED);
        } else {
          __atomic_fetch_add(scores + s, value, __ATOMIC_RELAXED);
        }
      }
    });
  }
}

// update_scores for the op's score_policy (checked), dispatched once per call.
void update_scores(int64_t* scores, const int64_t* slots, int64_t n, const std::vector<Change>& changes,
                   int64_t policy, int64_t clock) {
  score::dispatch(policy, [&](auto p) { update_scores<decltype(p)>(scores, slots, n, changes, clock); });
}

// Initial values are computed in double and rounded to float, then to the weight dtype
// (one rounding for float32/float64), the same on every backend.
template <typename scalar_t>
scalar_t to_weight(double v) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return v;
  } else {
    return static_cast<scalar_t>(static_cast<float>(v));
  }
}

template <typename scalar_t>
void init_row(scalar_t* row, int64_t dim, int64_t seed, int64_t id, int64_t kind, double a, double b) {
  init_columns(init_row_bits(seed, id), dim, kind, a, b, 0, 1,
               [&](int64_t j, double v) { row[j] = to_weight<scalar_t>(v); });
}

// (slots, counts, evicted_keys) of an inserting op.
std::tuple<at::Tensor, at::Tensor, at::Tensor> insert_result(at::Tensor slots, const InsertOutcome& r,
                                                             const at::Tensor& keys) {
  std::vector<int64_t> evicted;
  for (const Change& c : r.changes) {
    if (c.old_digest != kEmptyDigest) evicted.push_back(c.old_key);
  }
  const int64_t inserted = static_cast<int64_t>(r.changes.size());
  at::Tensor counts = at::tensor(std::vector<int64_t>{inserted, r.num_failed}, keys.options());
  at::Tensor evicted_keys = at::empty({static_cast<int64_t>(evicted.size())}, keys.options());
  std::copy(evicted.begin(), evicted.end(), evicted_keys.data_ptr<int64_t>());
  return {slots, counts, evicted_keys};
}

at::Tensor find_cpu(const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& ids_in) {
  constexpr const char* op = "veloce::find";
  check_find_args(op, keys, digests, ids_in);
  const at::Tensor ids = ids_in.contiguous();
  at::Tensor slots = at::empty_like(ids);
  find_all(table_ref(keys, digests), ids.data_ptr<int64_t>(), ids.numel(), slots.data_ptr<int64_t>(), -1,
           std::nullopt);
  return slots;
}

// A new row's optimizer state: the op's init_state (contiguous), or zeros when it has none.
inline void init_state_row(char* row, const char* init, int64_t bytes) {
  if (bytes == 0) return;
  if (init != nullptr) {
    std::memcpy(row, init, bytes);
  } else {
    std::memset(row, 0, bytes);
  }
}

// The contiguous init_state of an inserting op, or an undefined tensor (zeros).
at::Tensor init_state_of(const std::optional<at::Tensor>& init_state) {
  return init_state ? init_state->contiguous() : at::Tensor();
}

// The contiguous admit of find_or_insert, or an undefined tensor (every id admitted).
at::Tensor admit_of(const std::optional<at::Tensor>& admit) {
  return admit ? admit->contiguous() : at::Tensor();
}

// find_or_insert of checked arguments (the op checks, then reads bad_input, then calls this).
std::tuple<at::Tensor, at::Tensor, at::Tensor> find_or_insert_checked(
    at::Tensor& keys, at::Tensor& digests, at::Tensor& scores, at::Tensor& weights, at::Tensor& opt_state,
    const at::Tensor& ids_in, int64_t score_policy, int64_t score_value, bool allow_evict, int64_t seed,
    int64_t init_kind, double init_a, double init_b, std::optional<int64_t> padding_id, int64_t room,
    const at::Tensor& init_state, const at::Tensor& admit) {
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  const TableRef t = table_ref(keys, digests);
  const int64_t* id = ids.data_ptr<int64_t>();
  at::Tensor slots = at::empty_like(ids);
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* score = scores.data_ptr<int64_t>();

  find_all(t, id, n, slot, kMissing, padding_id);
  if (admit.defined()) {  // refused misses sit out the insert and the scores (any code < 0 does)
    const bool* ok = admit.data_ptr<bool>();
    for (int64_t i = 0; i < n; ++i) {
      if (slot[i] == kMissing && !ok[i]) slot[i] = kRefusedSlot;
    }
  }
  const InsertOutcome r = insert_missing(t, score, id, n, slot, allow_evict, room);
  if (r.num_failed > 0) return insert_result(slots, r, keys);

  const int64_t dim = weights.size(1);
  const int64_t state_bytes = opt_state.size(1) * static_cast<int64_t>(opt_state.element_size());
  auto* state = static_cast<char*>(opt_state.data_ptr());
  const char* init = init_state.defined() ? static_cast<const char*>(init_state.data_ptr()) : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "find_or_insert", [&] {
    scalar_t* w = weights.data_ptr<scalar_t>();
    const int64_t m = static_cast<int64_t>(r.changes.size());
    at::parallel_for(0, m, std::max<int64_t>(1, kGrain / std::max<int64_t>(dim, 1)), [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        if (k + 4 < e) __builtin_prefetch(w + r.changes[k + 4].slot * dim, 1);
        const int64_t s = r.changes[k].slot;
        init_row(w + s * dim, dim, seed, r.changes[k].new_key, init_kind, init_a, init_b);
        init_state_row(state + s * state_bytes, init, state_bytes);
      }
    });
  });
  update_scores(score, slot, n, r.changes, score_policy, score_value);
  if (admit.defined()) {
    const int64_t capacity = keys.numel();
    for (int64_t i = 0; i < n; ++i) {
      if (slot[i] == kRefusedSlot) slot[i] = capacity;
    }
  }
  return insert_result(slots, r, keys);
}

// A given bad_input is read once the arguments are checked, before anything changes (on
// the CPU the read is free). Returns whether a deferred call is refused: a set flag raises
// unless `defer`, which reports it in counts instead (refused_result).
bool refused_cpu(const char* op, const std::optional<at::Tensor>& bad_input, bool defer) {
  const bool set = bad_input && bad_input->item<bool>();
  if (!defer) check_bad_input_unset(op, set);
  return set;
}

// A deferred call refused for bad_input: every slot -1, counts [0, -1], nothing evicted.
std::tuple<at::Tensor, at::Tensor, at::Tensor> refused_result(const at::Tensor& ids, const at::Tensor& keys) {
  return {at::full(ids.sizes(), kPaddingSlot, ids.options()), at::tensor(std::vector<int64_t>{0, -1}, keys.options()),
          at::empty({0}, keys.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> find_or_insert_cpu(
    at::Tensor& keys, at::Tensor& digests, at::Tensor& scores, at::Tensor& weights, at::Tensor& opt_state,
    const at::Tensor& ids, int64_t score_policy, int64_t score_value, bool allow_evict, int64_t seed,
    int64_t init_kind, double init_a, double init_b, std::optional<int64_t> padding_id,
    const std::optional<at::Tensor>& bad_input, bool defer, const std::optional<at::Tensor>& clock, int64_t room,
    const std::optional<at::Tensor>& init_state, const std::optional<at::Tensor>& admit) {
  constexpr const char* op = "veloce::find_or_insert";
  check_insert_args(op, keys, digests, scores, weights, opt_state, ids, score_policy);
  check_init_state(op, init_state, opt_state);
  check_admit(op, admit, ids);
  check_init(op, init_kind, init_a, init_b);
  check_bad_input(op, bad_input, keys);
  check_defer(op, defer, allow_evict);
  check_room(op, room, defer);
  check_clock(op, clock, 1, keys);
  // The CPU computes counts where it runs: defer changes only how a refusal is reported.
  if (refused_cpu(op, bad_input, defer)) return refused_result(ids, keys);
  return find_or_insert_checked(keys, digests, scores, weights, opt_state, ids, score_policy,
                                clock ? clock->data_ptr<int64_t>()[0] : score_value, allow_evict, seed, init_kind,
                                init_a, init_b, padding_id, room, init_state_of(init_state), admit_of(admit));
}

// Each table in turn (the CPU has no syncs to share), every table's arguments (and
// bad_input) checked before any table changes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> find_or_insert_many_cpu(
    at::TensorList keys, at::TensorList digests, at::TensorList scores, at::TensorList weights,
    at::TensorList opt_state, at::TensorList ids, at::IntArrayRef score_policy, at::IntArrayRef score_value,
    const c10::List<bool>& allow_evict, at::IntArrayRef seed, at::IntArrayRef init_kind, at::ArrayRef<double> init_a,
    at::ArrayRef<double> init_b, const c10::List<std::optional<int64_t>>& padding_id,
    const std::optional<at::Tensor>& bad_input, bool defer, const std::optional<at::Tensor>& clock,
    at::OptionalIntArrayRef room, const std::optional<c10::List<std::optional<at::Tensor>>>& init_state,
    const std::optional<c10::List<std::optional<at::Tensor>>>& admit) {
  constexpr const char* op = "veloce::find_or_insert_many";
  const int64_t K = check_find_or_insert_many_args(op, keys, digests, scores, weights, opt_state, ids, score_policy,
                                                   score_value, allow_evict, seed, init_kind, init_a, init_b,
                                                   padding_id, bad_input, init_state);
  check_admit_many(op, admit, ids);
  for (int64_t k = 0; k < K; ++k) check_defer(op, defer, allow_evict.get(k), k);
  check_room_many(op, room, K, defer);
  if (K > 0) check_clock(op, clock, K, keys[0]);
  const at::Tensor clock_values = clock && K > 0 ? clock->contiguous() : at::Tensor();
  const int64_t* clocks = clock_values.defined() ? clock_values.data_ptr<int64_t>() : nullptr;
  const bool refused = refused_cpu(op, bad_input, defer);
  std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>> per_table;
  std::vector<at::Tensor> slots;
  for (int64_t k = 0; k < K; ++k) {
    at::Tensor ks = keys[k], ds = digests[k], ss = scores[k], ws = weights[k], os = opt_state[k];
    per_table.push_back(refused ? refused_result(ids[k], ks)
                                : find_or_insert_checked(ks, ds, ss, ws, os, ids[k], score_policy[k],
                                                         clocks != nullptr ? clocks[k] : score_value[k],
                                                         allow_evict.get(k), seed[k], init_kind[k], init_a[k],
                                                         init_b[k], padding_id.get(k),
                                                         room ? (*room)[k] : kNoRoomLimit,
                                                         init_state ? init_state_of(init_state->get(k)) : at::Tensor(),
                                                         admit ? admit_of(admit->get(k)) : at::Tensor()));
    slots.push_back(std::get<0>(per_table.back()));
  }
  return many_result(at::cat(slots), per_table);
}

// Copies row `from` of src (rows of `bytes` bytes) to row `to` of dst.
inline void copy_row(char* dst, int64_t to, const char* src, int64_t from, int64_t bytes) {
  if (bytes > 0) std::memcpy(dst + to * bytes, src + from * bytes, bytes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> insert_or_assign_cpu(
    at::Tensor& keys, at::Tensor& digests, at::Tensor& scores, at::Tensor& weights, at::Tensor& opt_state,
    const at::Tensor& ids_in, const at::Tensor& values_in, const std::optional<at::Tensor>& opt_values_in,
    const std::optional<at::Tensor>& score_values_in, int64_t score_policy, int64_t score_value, bool allow_evict,
    int64_t room, const std::optional<at::Tensor>& init_state_in) {
  constexpr const char* op = "veloce::insert_or_assign";
  check_insert_args(op, keys, digests, scores, weights, opt_state, ids_in, score_policy);
  check_init_state(op, init_state_in, opt_state);
  check_room(op, room, false);
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  check_assign_values(op, keys, weights, opt_state, n, values_in, opt_values_in, score_values_in);
  const at::Tensor values = values_in.contiguous();
  const at::Tensor opt_values = opt_values_in ? opt_values_in->contiguous() : at::Tensor();
  const at::Tensor score_values = score_values_in ? score_values_in->contiguous() : at::Tensor();

  const TableRef t = table_ref(keys, digests);
  const int64_t* id = ids.data_ptr<int64_t>();
  at::Tensor slots = at::empty_like(ids);
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* score = scores.data_ptr<int64_t>();
  find_all(t, id, n, slot, kMissing, std::nullopt);
  const InsertOutcome r = insert_missing(t, score, id, n, slot, allow_evict, room);
  if (r.num_failed > 0) return insert_result(slots, r, keys);

  // The last position of each slot wins.
  SlotMap last(n);
  for (int64_t i = 0; i < n; ++i) last[slot[i]] = i;
  const int64_t row_bytes = weights.size(1) * static_cast<int64_t>(weights.element_size());
  const int64_t state_bytes = opt_state.size(1) * static_cast<int64_t>(opt_state.element_size());
  auto* w = static_cast<char*>(weights.data_ptr());
  auto* state = static_cast<char*>(opt_state.data_ptr());
  if (!opt_values.defined() && state_bytes > 0) {
    const at::Tensor init_state = init_state_of(init_state_in);
    const char* init = init_state.defined() ? static_cast<const char*>(init_state.data_ptr()) : nullptr;
    for (const Change& c : r.changes) init_state_row(state + c.slot * state_bytes, init, state_bytes);
  }
  const auto* v = static_cast<const char*>(values.data_ptr());
  const auto* ov = opt_values.defined() ? static_cast<const char*>(opt_values.data_ptr()) : nullptr;
  const int64_t* sv = score_values.defined() ? score_values.data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, last.size(), std::max<int64_t>(1, kGrain * 16 / std::max<int64_t>(row_bytes, 1)),
                   [&](int64_t b, int64_t e) {
                     for (int64_t k = b; k < e; ++k) {
                       const int64_t s = last.key_at(k), i = last.value_at(k);
                       copy_row(w, s, v, i, row_bytes);
                       if (ov) copy_row(state, s, ov, i, state_bytes);
                       if (sv) score[s] = sv[i];
                     }
                   });
  if (!sv) update_scores(score, slot, n, r.changes, score_policy, score_value);
  return insert_result(slots, r, keys);
}

at::Tensor erase_cpu(const at::Tensor& keys, at::Tensor& digests, const at::Tensor& ids_in) {
  constexpr const char* op = "veloce::erase";
  check_find_args(op, keys, digests, ids_in);
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  const TableRef t = table_ref(keys, digests);
  std::vector<int64_t> slots(n);
  find_all(t, ids.data_ptr<int64_t>(), n, slots.data(), -1, std::nullopt);
  at::Tensor erased = at::zeros({n}, ids.options().dtype(at::kBool));
  bool* out = erased.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {  // a later duplicate sees the slot already empty
    const int64_t s = slots[i];
    if (s >= 0 && t.digests[s] != kEmptyDigest) {
      t.digests[s] = kEmptyDigest;
      out[i] = true;
    }
  }
  return erased;
}

at::Tensor initialize_cpu(const at::Tensor& ids_in, int64_t dim, int64_t seed, int64_t init_kind, double init_a,
                          double init_b, at::ScalarType dtype) {
  constexpr const char* op = "veloce::initialize";
  check_initialize_args(op, ids_in, dim, dtype, init_kind, init_a, init_b);
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  at::Tensor out = at::empty({n, dim}, ids.options().dtype(dtype));
  const int64_t* id = ids.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "initialize", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, std::max<int64_t>(1, kGrain / std::max<int64_t>(dim, 1)), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) init_row(o + i * dim, dim, seed, id[i], init_kind, init_a, init_b);
    });
  });
  return out;
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CPU, m) {
  m.impl("find", &veloce::find_cpu);
  m.impl("find_or_insert", &veloce::find_or_insert_cpu);
  m.impl("find_or_insert_many", &veloce::find_or_insert_many_cpu);
  m.impl("insert_or_assign", &veloce::insert_or_assign_cpu);
  m.impl("erase", &veloce::erase_cpu);
  m.impl("initialize", &veloce::initialize_cpu);
}
