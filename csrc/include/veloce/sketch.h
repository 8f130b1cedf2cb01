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
  const uint64_t w = static_cast<uint64_t>(width);
  // A power-of-two width (the default) takes a mask, the same index as the remainder without
  // a 64-bit division (tens of cycles on a CPU, a long emulated sequence on a GPU).
  const uint64_t r = (w & (w - 1)) == 0 ? (h & (w - 1)) : h % w;
  return static_cast<int64_t>(r) + d * width;
}

// The sightings one position adds: 1, or its sightings count clamped to [0, kSketchCountLimit]
// (a negative or huge count of one position adds nothing or at most the limit; the call's
// counts together stay under 2^30, the op's contract, so no counter passes 2^31 - 1).
VELOCE_HD int32_t sketch_add(const int64_t* sightings, int64_t i) {
  if (sightings == nullptr) return 1;
  const int64_t v = sightings[i];
  return static_cast<int32_t>(v < 0 ? 0 : v > kSketchCountLimit ? kSketchCountLimit : v);
}

// sketch_admit's decision for an absent id with sketch estimate `estimate`: at least
// min_count, and (p < 1) a draw below p, the draw a hash of (draw_salt, id, estimate)
// (veloce.admission.Probability.admit: u = (h >> 11) / 2^53 with
// h = splitmix64(splitmix64(id ^ draw_salt) + estimate * golden), draw_salt = splitmix64(seed)).
VELOCE_HD bool sketch_decide(int64_t id, int64_t estimate, int64_t min_count, double p, uint64_t draw_salt) {
  if (estimate < min_count) return false;
  if (p >= 1.0) return true;
  const uint64_t h = splitmix64(splitmix64(static_cast<uint64_t>(id) ^ draw_salt) +
                                static_cast<uint64_t>(estimate) * 0x9e3779b97f4a7c15ULL);
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0) < p;
}

}  // namespace veloce
