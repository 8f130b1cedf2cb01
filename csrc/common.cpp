// Argument checks shared by the CPU and CUDA kernels (see veloce/check.h).
#include "veloce/check.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include "veloce/hash.h"
#include "veloce/init.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_set>

namespace veloce {

std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", dtype_name(want), ", got ",
              dtype_name(t.scalar_type()));
}

// "[2, 5]". Formatted by hand: streaming IntArrayRef into TORCH_CHECK crashed inside
// c10::str with torch 2.11 on the GPU machine.
std::string shape_str(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got a ", t.dim(), "-D tensor of shape ",
              shape_str(t));
}

void check_floating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name, " must be a floating-point tensor, got ",
              dtype_name(t.scalar_type()));
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; move them to the same device");
}

void check_flag(const char* op, const char* name, const at::Tensor& flag, const char* ref_name,
                const at::Tensor& ref) {
  TORCH_CHECK(flag.scalar_type() == at::kBool && flag.numel() == 1, op, ": ", name,
              " must be a bool tensor of one element, got ", dtype_name(flag.scalar_type()), " of shape ",
              shape_str(flag));
  check_same_device(op, name, flag, ref_name, ref);
}

int64_t check_list_lengths(const char* op, const char* first_name, size_t first,
                           std::initializer_list<std::pair<const char*, size_t>> others) {
  for (const auto& [name, n] : others) {
    TORCH_CHECK_VALUE(n == first, op, ": one entry per table: ", first_name, " has ", first, " but ", name, " has ",
                      n);
  }
  return static_cast<int64_t>(first);
}

void check_distinct_tables(const char* op, at::TensorList keys) {
  std::unordered_set<const void*> seen;
  for (size_t k = 0; k < keys.size(); ++k) {
    TORCH_CHECK_VALUE(keys[k].device() == keys[0].device(), op, ": table ", k, " is on ", keys[k].device(),
                      " but table 0 is on ", keys[0].device(), "; one call serves the tables of one device");
    TORCH_CHECK_VALUE(seen.insert(keys[k].data_ptr()).second, op, ": table ", k,
                      " appears twice (its keys tensor repeats); pass each table once, with all its ids");
  }
}

void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t want,
                const char* what) {
  TORCH_CHECK(t.size(dim) == want, op, ": ", name, ".size(", dim, ") must equal ", what, " (", want, "), got ",
              t.size(dim));
}

void check_int_arg(const char* op, const char* name, int64_t value, int64_t lo, int64_t hi, const char* meaning) {
  TORCH_CHECK(value >= lo && value <= hi, op, ": ", name, " must be one of ", meaning, ", got ", value);
}


void check_table_keys(const char* op, const at::Tensor& keys, const at::Tensor& digests) {
  check_dtype(op, "keys", keys, at::kLong);
  check_dtype(op, "digests", digests, at::kByte);
  check_dim(op, "keys", keys, 1);
  check_dim(op, "digests", digests, 1);
  check_same_device(op, "digests", digests, "keys", keys);
  const int64_t capacity = keys.numel();
  TORCH_CHECK(digests.numel() == capacity, op, ": digests must have as many slots as keys (", capacity,
              "), got ", digests.numel());
  TORCH_CHECK(capacity >= kBucketSize && capacity % kBucketSize == 0, op,
              ": the table capacity must be a positive multiple of ", kBucketSize, ", got ", capacity);
  TORCH_CHECK(capacity / kBucketSize <= kMaxBuckets, op, ": the table capacity must be at most ", kMaxBuckets,
              " buckets of ", kBucketSize, " slots, got capacity ", capacity);
  TORCH_CHECK(keys.is_contiguous() && digests.is_contiguous(), op, ": keys and digests must be contiguous");
}

void check_table(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& scores) {
  check_table_keys(op, keys, digests);
  check_dtype(op, "scores", scores, at::kLong);
  check_dim(op, "scores", scores, 1);
  check_same_device(op, "scores", scores, "keys", keys);
  TORCH_CHECK(scores.numel() == keys.numel(), op, ": scores must have as many slots as keys (", keys.numel(),
              "), got ", scores.numel());
  TORCH_CHECK(scores.is_contiguous(), op, ": scores must be contiguous");
}

void check_rows(const char* op, const char* name, const at::Tensor& rows, const at::Tensor& keys) {
  check_dim(op, name, rows, 2);
  check_same_device(op, name, rows, "keys", keys);
  check_size(op, name, rows, 0, keys.numel(), "the table capacity");
  TORCH_CHECK(rows.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_table_rows(const char* op, const at::Tensor& weights, const at::Tensor& opt_state, const at::Tensor& keys) {
  check_rows(op, "weights", weights, keys);
  check_rows(op, "opt_state", opt_state, keys);
  const at::ScalarType wt = weights.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kDouble || wt == at::kHalf || wt == at::kBFloat16, op,
              ": weights must be float32, float64, float16 or bfloat16, got ", dtype_name(wt));
  const at::ScalarType st = opt_state.scalar_type();
  const at::ScalarType want = wt == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(st == want, op, ": opt_state must be ", dtype_name(want), " for ", dtype_name(wt),
              " weights, got ", dtype_name(st));
}

void check_ids(const char* op, const at::Tensor& ids, const at::Tensor& keys) {
  check_dtype(op, "ids", ids, at::kLong);
  check_dim(op, "ids", ids, 1);
  check_same_device(op, "ids", ids, "keys", keys);
}

int64_t check_offsets_shape(const char* op, const at::Tensor& offsets, int64_t n, bool include_last_offset) {
  check_dtype(op, "offsets", offsets, at::kLong);
  check_dim(op, "offsets", offsets, 1);
  const int64_t len = offsets.numel();
  if (include_last_offset) {
    TORCH_CHECK(len >= 1, op, ": offsets must hold at least one entry with include_last_offset=True, got 0");
  }
  TORCH_CHECK(len > 0 || n == 0, op, ": offsets is empty (0 bags) but there are ", n, " ids");
  return include_last_offset ? len - 1 : len;
}

at::Tensor layouts_bad_flag(at::TensorList offsets, at::IntArrayRef n, bool include_last_offset) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("veloce::bag_layouts_bad", "")
                       .typed<at::Tensor(at::TensorList, at::IntArrayRef, at::IntArrayRef)>();
  const std::vector<int64_t> last(offsets.size(), include_last_offset ? 1 : 0);
  return op.call(offsets, n, last);
}

at::Tensor offsets_bad_flag(const at::Tensor& offsets, int64_t n, bool include_last_offset) {
  return layouts_bad_flag({offsets}, {n}, include_last_offset);
}

int64_t check_offsets(const char* op, const at::Tensor& offsets, int64_t n, bool include_last_offset) {
  const int64_t num_bags = check_offsets_shape(op, offsets, n, include_last_offset);
  const int64_t len = offsets.numel();
  if (len == 0) return 0;
  // On an accelerator, one fused device check and a single flag read; the full host
  // copy (for the message) happens only when something is wrong.
  if (!offsets.device().is_cpu() && !offsets_bad_flag(offsets, n, include_last_offset).item<bool>()) return num_bags;
  const at::Tensor host = offsets.device().is_cpu() ? offsets.contiguous() : offsets.to(at::kCPU).contiguous();
  const int64_t* o = host.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0, op, ": offsets must start at 0, got offsets[0] = ", o[0]);
  for (int64_t i = 1; i < len; ++i) {
    TORCH_CHECK(o[i] >= o[i - 1], op, ": offsets must be non-decreasing, got offsets[", i - 1, "] = ", o[i - 1],
                " > offsets[", i, "] = ", o[i]);
  }
  TORCH_CHECK(o[len - 1] <= n, op, ": offsets[", len - 1, "] = ", o[len - 1], " is past the end of the ", n,
              " ids");
  if (include_last_offset) {
    TORCH_CHECK(o[len - 1] == n, op, ": with include_last_offset=True the last offset must equal the number of ids (",
                n, "), got ", o[len - 1]);
  }
  return num_bags;
}

void check_init(const char* op, int64_t kind, double a, double b) {
  check_int_arg(op, "init_kind", kind, 0, 3, "0 zeros, 1 constant, 2 uniform, 3 normal");
  TORCH_CHECK(std::isfinite(a) && std::isfinite(b), op, ": init_a and init_b must be finite, got ", a, " and ",
              b);
  if (kind == kInitUniform) {
    TORCH_CHECK(a <= b, op, ": uniform init needs init_a <= init_b, got init_a = ", a, ", init_b = ", b);
  }
  if (kind == kInitNormal) TORCH_CHECK(b >= 0, op, ": normal init needs init_b (std) >= 0, got ", b);
}

void check_num_ids_cuda(const char* op, int64_t n) {
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 ids per call on CUDA, got ", n,
              "; split the batch");
}

void check_cuda_table(const char* op, const at::Tensor& keys, const at::Tensor& digests) {
  TORCH_CHECK(keys.is_cuda(), op, ": keys must be a CUDA tensor here, got one on ", keys.device());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(digests.data_ptr()) % 16 == 0, op,
              ": digests must start on a 16-byte boundary on CUDA (pass the whole table tensor, not a view "
              "at an offset)");
}

void check_sketch_count(const char* op, const at::Tensor& counters, const at::Tensor& ids,
                        const c10::optional<at::Tensor>& counted, const c10::optional<at::Tensor>& sightings) {
  check_dtype(op, "counters", counters, at::kInt);
  check_dim(op, "counters", counters, 2);
  TORCH_CHECK(counters.size(0) >= 1 && counters.size(1) >= 1, op,
              ": counters must be a (depth, width) sketch with depth and width >= 1, got ", shape_str(counters));
  TORCH_CHECK(counters.is_contiguous(), op, ": counters must be contiguous (it is updated in place)");
  check_dtype(op, "ids", ids, at::kLong);
  check_dim(op, "ids", ids, 1);
  check_same_device(op, "ids", ids, "counters", counters);
  TORCH_CHECK(ids.numel() < (int64_t{1} << 30), op, ": a lookup of ", ids.numel(),
              " ids; the sketch counts fewer than 2^30 per call (split the lookup)");
  if (counted.has_value()) {
    check_dtype(op, "counted", *counted, at::kBool);
    check_dim(op, "counted", *counted, 1);
    check_same_device(op, "counted", *counted, "counters", counters);
    check_size(op, "counted", *counted, 0, ids.numel(), "the number of ids");
  }
  if (sightings.has_value()) {
    check_dtype(op, "sightings", *sightings, at::kLong);
    check_dim(op, "sightings", *sightings, 1);
    check_same_device(op, "sightings", *sightings, "counters", counters);
    check_size(op, "sightings", *sightings, 0, ids.numel(), "the number of ids");
  }
}

void check_sketch_admit(const char* op, const at::Tensor& counters, const at::Tensor& ids,
                        const c10::optional<at::Tensor>& counted, const c10::optional<at::Tensor>& sightings,
                        int64_t min_count, double p, const c10::optional<at::Tensor>& skip) {
  check_sketch_count(op, counters, ids, counted, sightings);
  TORCH_CHECK_VALUE(min_count >= 0, op, ": min_count must be >= 0, got ", min_count);
  TORCH_CHECK_VALUE(p > 0.0 && p <= 1.0, op, ": p must be a probability in (0, 1], got ", p);
  if (skip.has_value()) check_flag(op, "skip", *skip, "counters", counters);
}

void check_admission_tally(const char* op, const at::Tensor& stats, const at::Tensor& slots, int64_t capacity,
                           const c10::optional<at::Tensor>& sightings) {
  check_dtype(op, "stats", stats, at::kLong);
  TORCH_CHECK_VALUE(stats.dim() == 1 && stats.size(0) == 4 && stats.is_contiguous(), op,
                    ": stats must be a contiguous (4,) int64 tensor (admitted, refused, admitted_last, "
                    "refused_last), got shape ", shape_str(stats));
  check_dtype(op, "slots", slots, at::kLong);
  check_dim(op, "slots", slots, 1);
  check_same_device(op, "slots", slots, "stats", stats);
  TORCH_CHECK_VALUE(capacity >= 0, op, ": capacity must be >= 0, got ", capacity);
  if (sightings.has_value()) {
    check_dtype(op, "sightings", *sightings, at::kLong);
    check_dim(op, "sightings", *sightings, 1);
    check_same_device(op, "sightings", *sightings, "stats", stats);
    check_size(op, "sightings", *sightings, 0, slots.numel(), "the number of slots");
  }
}

}  // namespace veloce
