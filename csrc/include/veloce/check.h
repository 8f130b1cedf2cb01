// Argument checks for the op boundary. Every message names the op, the argument and
// what was found, e.g. "veloce::find: ids must be int64, got Float".
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

namespace veloce {

// The Python name of a dtype ("int64", "float32", ...), as users write it.
inline std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", dtype_name(want), ", got ",
              dtype_name(t.scalar_type()));
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got a ", t.dim(), "-D tensor of shape ",
              t.sizes());
}

inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must be a floating-point tensor, got ", dtype_name(t.scalar_type()));
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; move them to the same device");
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t want,
                       const char* what) {
  TORCH_CHECK(t.size(dim) == want, op, ": ", name, ".size(", dim, ") must equal ", what, " (", want,
              "), got ", t.size(dim));
}

// The table tensors: keys (C,) int64, digests (C,) uint8, scores (C,) int64, with C a
// positive multiple of kBucketSize whose bucket count is a power of two.
void check_table(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& scores);
void check_table_keys(const char* op, const at::Tensor& keys, const at::Tensor& digests);

// Rows tensor (C, D) whose first dimension matches the table.
void check_rows(const char* op, const char* name, const at::Tensor& rows, const at::Tensor& keys);

// The row tensors of a table: weights (C, D) float32, float64, float16 or bfloat16, and
// opt_state (C, S) float32 (float64 when weights are float64); S may be 0.
void check_table_rows(const char* op, const at::Tensor& weights, const at::Tensor& opt_state, const at::Tensor& keys);

// ids (N,) int64 on keys' device.
void check_ids(const char* op, const at::Tensor& ids, const at::Tensor& keys);

// An integer argument in [lo, hi]; `meaning` lists the accepted values, e.g. "0 none, 1 LRU, 2 LFU".
inline void check_int_arg(const char* op, const char* name, int64_t value, int64_t lo, int64_t hi,
                          const char* meaning) {
  TORCH_CHECK(value >= lo && value <= hi, op, ": ", name, " must be one of ", meaning, ", got ", value);
}

// A bag layout: offsets (B,) or (B+1,) int64, starting at 0, non-decreasing, ending at
// most at n. Returns the number of bags B. Reads offsets on the host.
int64_t check_offsets(const char* op, const at::Tensor& offsets, int64_t n, bool include_last_offset);

}  // namespace veloce
