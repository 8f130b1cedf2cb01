// Argument checks for the op boundary. Every message names the op, the argument and
// what was found, e.g. "veloce::find: ids must be torch.int64, got torch.float32".
//
// All are defined out of line in csrc/common.cpp, compiled by the host compiler only:
// the CUDA files call them but never compile c10::str message formatting themselves
// (an nvcc-compiled copy of it crashed while formatting IntArrayRef with torch 2.11).
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <string>
#include <utility>

namespace veloce {

// The Python name of a dtype ("torch.int64", "torch.float32", ...), as users write it.
std::string dtype_name(at::ScalarType t);
// A tensor's shape as "[2, 5]".
std::string shape_str(const at::Tensor& t);

void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType want);
void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim);
void check_floating(const char* op, const char* name, const at::Tensor& t);
void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref);
void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t want,
                const char* what);
// A device-side flag argument: a bool tensor of one element on ref's device.
void check_flag(const char* op, const char* name, const at::Tensor& flag, const char* ref_name,
                const at::Tensor& ref);

// The per-table lists of an op over several tables: each as long as the first one
// (`first_name`, `first` entries); returns that length.
int64_t check_list_lengths(const char* op, const char* first_name, size_t first,
                           std::initializer_list<std::pair<const char*, size_t>> others);
// The tables of an op over several tables (their keys tensors): all on one device, and no
// table twice (the op's stages would see a table before its own earlier inserts).
void check_distinct_tables(const char* op, at::TensorList keys);

// An integer argument in [lo, hi]; `meaning` lists the accepted values, e.g. "0 none, 1 LRU, 2 LFU".
void check_int_arg(const char* op, const char* name, int64_t value, int64_t lo, int64_t hi, const char* meaning);

// The table tensors: keys (C,) int64, digests (C,) uint8, scores (C,) int64, with C a
// positive multiple of kBucketSize of at most kMaxBuckets buckets.
void check_table(const char* op, const at::Tensor& keys, const at::Tensor& digests, const at::Tensor& scores);
void check_table_keys(const char* op, const at::Tensor& keys, const at::Tensor& digests);

// Rows tensor (C, D) whose first dimension matches the table.
void check_rows(const char* op, const char* name, const at::Tensor& rows, const at::Tensor& keys);

// The row tensors of a table: weights (C, D) float32, float64, float16 or bfloat16, and
// opt_state (C, S) float32 (float64 when weights are float64); S may be 0.
void check_table_rows(const char* op, const at::Tensor& weights, const at::Tensor& opt_state, const at::Tensor& keys);

// ids (N,) int64 on keys' device.
void check_ids(const char* op, const at::Tensor& ids, const at::Tensor& keys);

// sketch_count's arguments: counters (depth, width) int32 contiguous, ids (N,) int64 with
// N < 2^30, counted (N,) bool and sightings (N,) int64, all on counters' device.
void check_sketch_count(const char* op, const at::Tensor& counters, const at::Tensor& ids,
                        const c10::optional<at::Tensor>& counted, const c10::optional<at::Tensor>& sightings);
// sketch_admit's: check_sketch_count's, min_count >= 0, p in (0, 1], skip a (1,) bool on
// counters' device.
void check_sketch_admit(const char* op, const at::Tensor& counters, const at::Tensor& ids,
                        const c10::optional<at::Tensor>& counted, const c10::optional<at::Tensor>& sightings,
                        int64_t min_count, double p, const c10::optional<at::Tensor>& skip);
// admission_tally's: stats a contiguous (4,) int64, slots (N,) int64 and sightings (N,) int64
// on its device, capacity >= 0.
void check_admission_tally(const char* op, const at::Tensor& stats, const at::Tensor& slots, int64_t capacity,
                           const c10::optional<at::Tensor>& sightings);

// Initializer arguments: kind in 0..3, finite a and b, a <= b for uniform, std >= 0 for normal.
void check_init(const char* op, int64_t kind, double a, double b);

// CUDA kernels index ids with int32 positions (CUB sorts, compaction).
void check_num_ids_cuda(const char* op, int64_t n);
// CUDA tables: keys on a CUDA device, digests 16-byte aligned (read 16 bytes at a time).
void check_cuda_table(const char* op, const at::Tensor& keys, const at::Tensor& digests);

// A bag layout: offsets (B,) or (B+1,) int64, starting at 0, non-decreasing, ending at
// most at n. Returns the number of bags B. Reads offsets on the host.
int64_t check_offsets(const char* op, const at::Tensor& offsets, int64_t n, bool include_last_offset);
// The parts of check_offsets that read no offset values (dtype, dim, length): returns B.
int64_t check_offsets_shape(const char* op, const at::Tensor& offsets, int64_t n, bool include_last_offset);
// (1,) bool on offsets' device: whether non-empty offsets break the layout rules (no sync;
// the op veloce::bag_layouts_bad, one launch on CUDA).
at::Tensor offsets_bad_flag(const at::Tensor& offsets, int64_t n, bool include_last_offset);
// The same for several non-empty layouts at once (offsets[k] over n[k] ids): whether any breaks
// the rules (one launch per 32 layouts on CUDA).
at::Tensor layouts_bad_flag(at::TensorList offsets, at::IntArrayRef n, bool include_last_offset);

}  // namespace veloce
