// Argument checks shared by the CPU and CUDA kernels (see veloce/check.h).
#include "veloce/check.h"

#include "veloce/hash.h"

namespace veloce {

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
  const int64_t num_buckets = capacity / kBucketSize;
  TORCH_CHECK((num_buckets & (num_buckets - 1)) == 0, op,
              ": the table capacity must be a power-of-two number of buckets of ", kBucketSize,
              " slots, got capacity ", capacity);
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

int64_t check_offsets(const char* op, const at::Tensor& offsets, int64_t n, bool include_last_offset) {
  check_dtype(op, "offsets", offsets, at::kLong);
  check_dim(op, "offsets", offsets, 1);
  const int64_t len = offsets.numel();
  if (include_last_offset) {
    TORCH_CHECK(len >= 1, op, ": offsets must hold at least one entry with include_last_offset=True, got 0");
  }
  const int64_t num_bags = include_last_offset ? len - 1 : len;
  if (len == 0) {
    TORCH_CHECK(n == 0, op, ": offsets is empty (0 bags) but there are ", n, " ids");
    return 0;
  }
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

}  // namespace veloce
