// Eviction scores: how a lookup changes the int64 score of each slot it touches, one
// struct per policy (HierarchicalKV's ScoreFunctor is the model), shared by the CPU and
// CUDA kernels. An inserting op evicts the lowest score of a full bucket pair.
//
// A policy P is a struct of static members:
//   kName                         its name in messages;
//   on_insert(clock)              the score of a key a call at `clock` inserts;
//   on_hit(old, clock, count)     the score of a key with score `old` that a call at `clock`
//                                 touches `count` (>= 1) times (a new key: from on_insert);
//   kCombine                      how the positions of one key, scored one at a time by
//                                 concurrent threads, combine to on_hit(old, clock, count):
//     kKeep   on_hit(old, ...) == old: nothing is written;
//     kStamp  on_hit(old, clock, count) == on_insert(clock) whatever old and count: each
//             position stores it (a store of the same value: no atomic read-modify-write);
//     kAdd    on_hit(old, clock, count) == old + count * on_hit(0, clock, 1): each
//             position adds on_hit(0, clock, 1) atomically.
// `clock` is the op's score_value (or its clock tensor): veloce.table.HashTable passes its
// clock, which ticks once per training lookup.
//
// Adding a policy: a struct here, a line in VELOCE_SCORE_POLICIES, and a Python class in
// veloce/eviction.py whose score_policy is the new id. The kernels are instantiated per
// policy from score::dispatch, once per call (on CUDA once per table of a launch, at each
// kernel's top: a table is uniform over its blocks), never switched per element.
#pragma once

#include <cstdint>
#include <string>

#include "veloce/macros.h"

// id (the ops' score_policy argument) and policy, one line each, ids from 0 without gaps.
#define VELOCE_SCORE_POLICIES(X) \
  X(0, KeepScore)                \
  X(1, LRU)                      \
  X(2, LFU)

namespace veloce {
namespace score {

enum class Combine { kKeep, kStamp, kAdd };

// Scores never change (a table whose scores come from elsewhere, e.g. insert_or_assign's
// score_values when it rehashes).
struct KeepScore {
  static constexpr const char* kName = "none";
  static constexpr Combine kCombine = Combine::kKeep;
  VELOCE_HD static int64_t on_insert(int64_t) { return 0; }
  VELOCE_HD static int64_t on_hit(int64_t old, int64_t, int64_t) { return old; }
};

// Least recently used: the score is the clock of the last touch (the row's last-seen
// step, which veloce's TTL policy expires by, and HashTable.last_seen reads).
struct LRU {
  static constexpr const char* kName = "LRU";
  static constexpr Combine kCombine = Combine::kStamp;
  VELOCE_HD static int64_t on_insert(int64_t clock) { return clock; }
  VELOCE_HD static int64_t on_hit(int64_t, int64_t clock, int64_t) { return clock; }
};

// Least frequently used: the score counts the touches (positions) since insertion.
struct LFU {
  static constexpr const char* kName = "LFU";
  static constexpr Combine kCombine = Combine::kAdd;
  VELOCE_HD static int64_t on_insert(int64_t) { return 0; }
  VELOCE_HD static int64_t on_hit(int64_t old, int64_t, int64_t count) { return old + count; }
};

#define VELOCE_COUNT_ONE(id, P) +1
constexpr int64_t kNumPolicies = 0 VELOCE_SCORE_POLICIES(VELOCE_COUNT_ONE);
#undef VELOCE_COUNT_ONE

#define VELOCE_CHECK_POLICY(id, P) \
  static_assert(id >= 0 && id < kNumPolicies, #P ": score policy ids run from 0 without gaps");
VELOCE_SCORE_POLICIES(VELOCE_CHECK_POLICY)
#undef VELOCE_CHECK_POLICY

// Raises for an id no line of VELOCE_SCORE_POLICIES has (defined in csrc/op_checks.cpp).
[[noreturn]] void fail_unknown_policy(int64_t policy);

// f(P{}) for the policy of id `policy`, checked by the op (check_insert_args). The one
// place that turns the runtime id into a policy type. On the device an unknown id (never
// passed: the host checked it) takes the first policy.
template <typename F>
VELOCE_HD decltype(auto) dispatch(int64_t policy, F&& f) {
  switch (policy) {
#define VELOCE_CASE(id, P) \
  case id:                 \
    return f(P{});
    VELOCE_SCORE_POLICIES(VELOCE_CASE)
#undef VELOCE_CASE
    default:
#if defined(__CUDA_ARCH__)
      return f(KeepScore{});
#else
      fail_unknown_policy(policy);
#endif
  }
}

// "0 (none), 1 (LRU) or 2 (LFU)".
inline std::string policy_choices() {
  std::string out;
  int64_t i = 0;
#define VELOCE_NAME(id, P)                                                                        \
  out += (i == 0 ? "" : i + 1 == kNumPolicies ? " or " : ", ") + std::to_string(id) + " (" + P::kName + \
         ")";                                                                                     \
  ++i;
  VELOCE_SCORE_POLICIES(VELOCE_NAME)
#undef VELOCE_NAME
  return out;
}

}  // namespace score
}  // namespace veloce
