// The count-min sketch of feature admission (veloce/admission.py): where an id's counters
// are, shared by the CPU and CUDA kernels of sketch_count and by the torch reference
// veloce.admission.sketch_slots (the layout a checkpoint keeps: it must not change).
#pragma once

#include <cstdint>

#include "veloce/init.h"

namespace veloce {

// Where a counter saturates: a lookup adds fewer than 2^31 - kSketchCountLimit sightings to
// one counter (it holds fewer than 2^30 ids), so an int32 counter never overflows.
constexpr int32_t kSketchCountLimit = (int32_t{1} << 30) - 1;
constexpr int64_t kSketchMaxIds = int64_t{1} << 30;

// The salt of sketch row d for a sketch seeded by `seed`.
VELOCE_HD uint64_t sketch_salt(int64_t seed, int64_t d) {
  return splitmix64(static_cast<uint64_t>(seed) * 1000003ULL + static_cast<uint64_t>(d));
}

// The flat index of id's counter in sketch row d (salt: sketch_salt(seed, d)) of a
// (depth, width) sketch.
VELOCE_HD int64_t sketch_slot(int64_t id, uint64_t salt, int64_t d, int64_t width) {
  const uint64_t h = splitmix64(static_cast<uint64_t>(id) ^ salt) & 0x7fffffffffffffffULL;
  return static_cast<int64_t>(h % static_cast<uint64_t>(width)) + d * width;
}

}  // namespace veloce
