// CPU kernels of the exchange family: what a sharded lookup needs around its all-to-all.
// Semantics: docs/ops.md ("exchange").
//
//   owner_of        the rank that owns each id: owner_hash(id) % world_size.
//   bucketize_bags  groups the non-padding positions of a batch of bags by owner (a stable
//                   counting sort) and cuts each bag into parts, one per owner it touches.
//   combine_parts   sums each bag's parts in part order (deterministic), the inverse of the
//                   cut: the requester's pooled rows from the owners' partial sums.
//   regroup_blocks  the rows of an all-to-all between peer-major and group-major order: one
//                   memcpy per (group, peer) block, blocks in parallel (regroup_blocks_as:
//                   each element converted instead).
//
// bucketize_bags works on fixed chunks of bags: each chunk counts its ids and parts per
// owner, an exclusive scan over (owner, chunk) gives every chunk its output positions, and
// each chunk writes its own. The result is the same for any number of threads.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "veloce/check.h"
#include "veloce/hash.h"
#include "veloce/op_checks.h"

namespace veloce {
namespace {

at::Tensor owner_of_cpu(const at::Tensor& ids, int64_t world_size) {
  constexpr const char* op = "veloce::owner_of";
  check_exchange_ids(op, ids, world_size);
  const at::Tensor in = ids.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t* id = in.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const uint64_t w = static_cast<uint64_t>(world_size);
  at::parallel_for(0, in.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = static_cast<int64_t>(owner_hash(id[i]) % w);
  });
  return out;
}

// The chunks of bags that bucketize_bags counts and writes independently.
struct Chunks {
  int64_t count, size;  // number of chunks, bags per chunk
  int64_t begin(int64_t c) const { return c * size; }
};

Chunks chunks_for(int64_t num_bags, int64_t num_ids, int64_t world_size) {
  // Enough chunks to keep every thread busy, few enough that the (chunk, owner) tables
  // stay small next to the ids.
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(4 * at::get_num_threads(),
                                                              num_ids / std::max<int64_t>(1, 8 * world_size)));
  const int64_t size = std::max<int64_t>(1, (num_bags + want - 1) / want);
  return {num_bags == 0 ? 0 : (num_bags + size - 1) / size, size};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bucketize_bags_cpu(
    const at::Tensor& ids, const at::Tensor& offsets, bool include_last_offset, int64_t world_size,
    std::optional<int64_t> padding_id, bool exact_sizes) {
  const int64_t B = check_bucketize_args("veloce::bucketize_bags", ids, offsets, include_last_offset, world_size);
  const int64_t N = ids.numel();
  const int64_t W = world_size;
  const at::Tensor id_c = ids.contiguous(), off_c = offsets.contiguous();
  const int64_t* id = id_c.data_ptr<int64_t>();
  const int64_t* off = off_c.data_ptr<int64_t>();
  const int64_t num_offsets = off_c.numel();
  auto bag_end = [&](int64_t b) { return b + 1 < num_offsets ? off[b + 1] : N; };
  const bool has_pad = padding_id.has_value();
  const int64_t pad = has_pad ? *padding_id : 0;
  auto owner = [&](int64_t i) -> int64_t {  // -1 for padding
    if (has_pad && id[i] == pad) return -1;
    return static_cast<int64_t>(owner_hash(id[i]) % static_cast<uint64_t>(W));
  };

  const Chunks ch = chunks_for(B, N, W);
  // Visits the non-padding positions of chunk c in order: visit(position, owner, bag,
  // first position of a new part). last_bag: per owner, the last bag seen in the chunk.
  auto walk = [&](int64_t c, std::vector<int64_t>& last_bag, auto&& visit) {
    std::fill(last_bag.begin(), last_bag.end(), -1);
    for (int64_t b = ch.begin(c); b < std::min(B, ch.begin(c + 1)); ++b) {
      for (int64_t i = off[b]; i < bag_end(b); ++i) {
        const int64_t w = owner(i);
        if (w < 0) continue;
        const bool new_part = last_bag[w] != b;
        last_bag[w] = b;
        visit(i, w, b, new_part);
      }
    }
  };
  // Pass 1: per chunk and owner, the number of ids and of parts (distinct (bag, owner)).
  std::vector<int64_t> ids_at(ch.count * W, 0), parts_at(ch.count * W, 0);
  at::parallel_for(0, ch.count, 1, [&](int64_t c0, int64_t c1) {
    std::vector<int64_t> last_bag(W);
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* ni = ids_at.data() + c * W;
      int64_t* np = parts_at.data() + c * W;
      walk(c, last_bag, [&](int64_t, int64_t w, int64_t, bool new_part) {
        ++ni[w];
        np[w] += new_part;
      });
    }
  });
  // Exclusive scan in (owner, chunk) order: where each chunk's ids and parts of owner w go.
  at::Tensor id_splits = at::zeros({W}, ids.options());
  at::Tensor part_splits = at::zeros({W}, ids.options());
  int64_t* id_split = id_splits.data_ptr<int64_t>();
  int64_t* part_split = part_splits.data_ptr<int64_t>();
  int64_t M = 0, P = 0;
  for (int64_t w = 0; w < W; ++w) {
    for (int64_t c = 0; c < ch.count; ++c) {
      const int64_t ni = ids_at[c * W + w], np = parts_at[c * W + w];
      ids_at[c * W + w] = M;
      parts_at[c * W + w] = P;
      M += ni;
      P += np;
      id_split[w] += ni;
      part_split[w] += np;
    }
  }
  // exact_sizes=False: N rows each (the CUDA kernel's sizes without its sync), the parts'
  // tails zero and perm's tail the padding positions, ascending. The offsets are checked
  // either way: here that costs no sync.
  at::Tensor perm = at::empty({exact_sizes ? M : N}, ids.options());
  at::Tensor bag_of_part = exact_sizes ? at::empty({P}, ids.options()) : at::zeros({N}, ids.options());
  at::Tensor part_lengths = at::zeros({exact_sizes ? P : N}, ids.options());
  int64_t* pm = perm.data_ptr<int64_t>();
  int64_t* bp = bag_of_part.data_ptr<int64_t>();
  int64_t* pl = part_lengths.data_ptr<int64_t>();
  // Pass 2: every chunk writes its positions and parts, in bag order.
  at::parallel_for(0, ch.count, 1, [&](int64_t c0, int64_t c1) {
    std::vector<int64_t> last_bag(W), cur_part(W);
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* next_id = ids_at.data() + c * W;
      int64_t* next_part = parts_at.data() + c * W;
      walk(c, last_bag, [&](int64_t i, int64_t w, int64_t b, bool new_part) {
        pm[next_id[w]++] = i;
        if (new_part) {
          cur_part[w] = next_part[w]++;
          bp[cur_part[w]] = b;
        }
        ++pl[cur_part[w]];
      });
    }
  });
  if (!exact_sizes && M < N) {
    int64_t next = M;
    for (int64_t i = 0; i < N; ++i) {
      if (id[i] == pad) pm[next++] = i;  // M < N only with a padding id
    }
  }
  return {perm, id_splits, bag_of_part, part_lengths, part_splits};
}

// The sums of combine_parts(_as), accumulated in combine_acc_t (float64 when the parts or
// the output are float64, else float32) and written as out_dtype.
at::Tensor combine_cpu(const char* op, const at::Tensor& parts, const at::Tensor& bag_of_part, int64_t num_bags,
                       at::ScalarType out_dtype) {
  check_combine_parts_args(op, parts, bag_of_part, num_bags);
  check_row_conversion(op, "parts", parts.scalar_type(), out_dtype);
  const at::Tensor p_c = parts.contiguous(), b_c = bag_of_part.contiguous();
  const int64_t P = p_c.size(0), D = p_c.size(1);
  const int64_t* bag = b_c.data_ptr<int64_t>();
  check_bag_indices(op, bag, P, num_bags);
  at::Tensor out = at::zeros({num_bags, D}, parts.options().dtype(out_dtype));
  if (P == 0 || D == 0) return out;
  // Parts come as runs of strictly increasing bags (one run per owner): within a run every
  // bag is distinct, so a run is added in parallel and runs in order, which keeps each
  // bag's sum in part order.
  std::vector<int64_t> run_starts{0};
  for (int64_t p = 1; p < P; ++p) {
    if (bag[p] <= bag[p - 1]) run_starts.push_back(p);
  }
  run_starts.push_back(P);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, parts.scalar_type(), "combine_parts_cpu", [&] {
    using in_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "combine_parts_cpu", [&] {
      using out_t = scalar_t;
      using acc_t = combine_acc_t<in_t, out_t>;
      const in_t* src = p_c.data_ptr<in_t>();
      std::vector<acc_t> acc(static_cast<size_t>(num_bags * D), acc_t(0));
      const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / D);
      for (size_t r = 0; r + 1 < run_starts.size(); ++r) {
        at::parallel_for(run_starts[r], run_starts[r + 1], grain, [&](int64_t p0, int64_t p1) {
          for (int64_t p = p0; p < p1; ++p) {
            acc_t* a = acc.data() + bag[p] * D;
            const in_t* s = src + p * D;
            for (int64_t d = 0; d < D; ++d) a[d] += static_cast<acc_t>(s[d]);
          }
        });
      }
      out_t* dst = out.data_ptr<out_t>();
      at::parallel_for(0, num_bags * D, at::internal::GRAIN_SIZE, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) dst[i] = static_cast<out_t>(acc[static_cast<size_t>(i)]);
      });
    });
  });
  return out;
}

at::Tensor combine_parts_cpu(const at::Tensor& parts, const at::Tensor& bag_of_part, int64_t num_bags,
                             bool /*check_bags*/) {
  return combine_cpu("veloce::combine_parts", parts, bag_of_part, num_bags, parts.scalar_type());
}

at::Tensor combine_parts_as_cpu(const at::Tensor& parts, const at::Tensor& bag_of_part, int64_t num_bags,
                                bool /*check_bags*/, at::ScalarType dtype) {
  return combine_cpu("veloce::combine_parts_as", parts, bag_of_part, num_bags, dtype);
}

// regroup_blocks(_as): one copy per block, blocks in parallel; a memcpy when the output
// keeps the sources' dtype, else each element converted as Tensor.to converts it.
at::Tensor regroup_cpu(const char* op, at::TensorList sources, at::IntArrayRef counts, int64_t num_groups,
                       bool to_group_major, at::ScalarType out_dtype) {
  const std::vector<RegroupBlock> plan = regroup_plan(op, sources, counts, num_groups, to_group_major);
  check_row_conversion(op, "sources", sources[0].scalar_type(), out_dtype);
  const RegroupCopy c = regroup_copy(sources, plan, out_dtype);
  const int64_t row_elems = c.row_elems;
  // Where each block lands in the output (rows before it).
  std::vector<int64_t> out_row(plan.size() + 1, 0);
  for (size_t b = 0; b < plan.size(); ++b) out_row[b + 1] = out_row[b] + plan[b].rows;
  const at::Tensor& out = c.out;
  const int64_t total_elems = out_row.back() * row_elems;
  if (total_elems == 0) return out;
  // Blocks in parallel, about 64 KB of copying per task at least.
  const int64_t nb = static_cast<int64_t>(plan.size());
  const int64_t grain = std::max<int64_t>(1, nb * (int64_t{1} << 16) / (total_elems * out.element_size()));
  auto for_each_block = [&](auto&& copy) {
    at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const RegroupBlock& k = plan[static_cast<size_t>(b)];
        copy(c.sources[static_cast<size_t>(k.source)], k.row * row_elems, out_row[static_cast<size_t>(b)] * row_elems,
             k.rows * row_elems);
      }
    });
  };
  if (out_dtype == sources[0].scalar_type()) {
    const int64_t esize = static_cast<int64_t>(out.element_size());
    auto* dst = static_cast<uint8_t*>(out.data_ptr());
    for_each_block([&](const at::Tensor& src, int64_t from, int64_t to, int64_t n) {
      std::memcpy(dst + to * esize, static_cast<const uint8_t*>(src.data_ptr()) + from * esize,
                  static_cast<size_t>(n * esize));
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, sources[0].scalar_type(), "regroup_blocks_as_cpu", [&] {
    using in_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "regroup_blocks_as_cpu", [&] {
      using out_t = scalar_t;
      if constexpr (!std::is_same_v<in_t, out_t>) {  // one dtype took the memcpy above
        out_t* dst = out.data_ptr<out_t>();
        for_each_block([&](const at::Tensor& src, int64_t from, int64_t to, int64_t n) {
          const in_t* s = src.data_ptr<in_t>() + from;
          for (int64_t i = 0; i < n; ++i) dst[to + i] = c10::convert<out_t>(s[i]);
        });
      }
    });
  });
  return out;
}

at::Tensor regroup_blocks_cpu(at::TensorList sources, at::IntArrayRef counts, int64_t num_groups,
                              bool to_group_major) {
  return regroup_cpu("veloce::regroup_blocks", sources, counts, num_groups, to_group_major,
                     sources.empty() ? at::kFloat : sources[0].scalar_type());
}

at::Tensor regroup_blocks_as_cpu(at::TensorList sources, at::IntArrayRef counts, int64_t num_groups,
                                 bool to_group_major, at::ScalarType dtype) {
  return regroup_cpu("veloce::regroup_blocks_as", sources, counts, num_groups, to_group_major, dtype);
}

}  // namespace
}  // namespace veloce

TORCH_LIBRARY_IMPL(veloce, CPU, m) {
  m.impl("regroup_blocks", &veloce::regroup_blocks_cpu);
  m.impl("owner_of", &veloce::owner_of_cpu);
  m.impl("bucketize_bags", &veloce::bucketize_bags_cpu);
  m.impl("combine_parts", &veloce::combine_parts_cpu);
  m.impl("regroup_blocks_as", &veloce::regroup_blocks_as_cpu);
  m.impl("combine_parts_as", &veloce::combine_parts_as_cpu);
}
