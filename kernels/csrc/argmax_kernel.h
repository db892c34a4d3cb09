// Greedy argmax over a range of one row of float32 logits, for the ArgmaxRows primitive (argmax.cpp).
// Exactly mx.argmax's answer (mlx 0.32, CPU): the first index of the largest value; -0.0 ties +0.0; a
// row of -inf gives its first index; a NaN beats every number and the FIRST NaN wins.
// 16 lanes as GCC vector extensions: one AVX-512 register in the avx512 build, two AVX2 registers in
// the avx2 build, SSE pairs in the baseline build. Each lane keeps its own first maximum (strict >),
// so the lowest index among the lanes holding the maximum is the row's first one. NaN never passes
// `>`, so the loop only notes that one was seen; the rare row with a NaN is scanned again for it.
// Compiled per instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernel_table.h"

namespace metrale::METRALE_ISA_NS::kernel {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// x[begin, end) of one row (end - begin < 2^31): its maximum, the index (from x) of its first
// occurrence, and the index of its first NaN (-1 without one).
inline ArgmaxPart argmax_range(const float* x, int64_t begin, int64_t end) {
  ArgmaxPart part{x[begin], begin, -1};
  int64_t i = begin;
  if (end - begin >= 16) {
    v16f best;
    std::memcpy(&best, x + begin, sizeof(best));
    v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16i index = lane;  // offsets from begin
    v16i unordered = best != best;
    for (i = begin + 16; i + 16 <= end; i += 16) {
      v16f v;
      std::memcpy(&v, x + i, sizeof(v));
      lane += 16;
      const v16i greater = v > best;
      best = greater ? v : best;
      index = greater ? lane : index;
      unordered |= v != v;
    }
    bool any_nan = false;
    for (int l = 0; l < 16; ++l) any_nan |= unordered[l] != 0;
    if (any_nan) {
      for (int64_t j = begin; j < i; ++j)
        if (x[j] != x[j]) return ArgmaxPart{x[j], j, j};
    }
    part = ArgmaxPart{best[0], begin + index[0], -1};
    for (int l = 1; l < 16; ++l) {
      const int64_t at = begin + index[l];
      if (best[l] > part.value || (best[l] == part.value && at < part.index)) part = ArgmaxPart{best[l], at, -1};
    }
  }
  for (; i < end; ++i) {
    if (x[i] != x[i]) return ArgmaxPart{x[i], i, i};
    if (x[i] > part.value) part = ArgmaxPart{x[i], i, -1};
  }
  return part;
}

}  // namespace metrale::METRALE_ISA_NS::kernel
