// Sampling rows of float32 logits, for the primitives of sampling.cpp.
//
// argmax_range: greedy argmax over a range of one row. Exactly mx.argmax's answer (mlx 0.32, CPU): the
// first index of the largest value; -0.0 ties +0.0; a row of -inf gives its first index; a NaN beats
// every number and the FIRST NaN wins.
// 16 lanes as GCC vector extensions: one AVX-512 register in the avx512 build, two AVX2 registers in
// the avx2 build, SSE pairs in the baseline build. Each lane keeps its own first maximum (strict >),
// so the lowest index among the lanes holding the maximum is the row's first one. NaN never passes
// `>`, so the loop only notes that one was seen; the rare row with a NaN is scanned again for it.
// Compiled per instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernel_table.h"
#include "vecmath.h"

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

// sample_full_row: one row sampled at a temperature over the whole vocabulary, by the inverse CDF at
// the row's uniform u, as metrale.sampling.ops.sample_full:
//   m = x[mode], mode = argmax_range's index;  y_i = (x_i - m) * scale  (scale = log2(e) / temperature)
//   q_i = 2^y_i where y_i >= max(log2_min_p, -126), else 0  (NaN logits get no mass; 2^-126 is the
//         smallest normal float: MLX's power goes on into the subnormals, ~1e-38 of mass at most)
//   token = the first i with q_i > 0 whose running mass reaches u * total; the mode when the maximum is
//           not finite or rounding leaves no such i
// The running mass is summed in blocks of kSampleBlock values (each block's mass as 8 lane sums, then
// the blocks in order): the search walks the block sums, then the one block, with the same sums as the
// total, so the token depends only on the row (batch invariant). 2^y is a Cephes polynomial (~2 ulp).
constexpr int kSampleBlock = 64;

// 8 masses q from 8 logits: y = (x - m) * scale, 2^y at or above the floor, else 0.
inline v8f mass8(v8f x, float m, float scale, float floor) {
  const v8f y = (x - m) * scale;
  const v8f q = exp8(y * 0.693147180559945f);
  return y >= floor ? q : v8f{};
}

// Masses of x[begin, begin + n), n <= kSampleBlock, into q (the tail padded with -inf logits: no mass).
inline void block_masses(const float* x, int64_t begin, int n, float m, float scale, float floor, float* q) {
  for (int i = 0; i < n; i += kW) {
    v8f v;
    if (i + kW <= n) {
      std::memcpy(&v, x + begin + i, sizeof(v));
    } else {
      for (int j = 0; j < kW; ++j) v[j] = i + j < n ? x[begin + i + j] : -__builtin_inff();
    }
    const v8f mass = mass8(v, m, scale, floor);
    std::memcpy(q + i, &mass, sizeof(mass));
  }
}

inline float block_sum(const float* q, int n) {
  v8f acc = {};
  for (int i = 0; i < n; i += kW) {
    v8f v;
    std::memcpy(&v, q + i, sizeof(v));
    acc += v;
  }
  return hsum(acc);
}

// `scratch` holds (V + kSampleBlock - 1) / kSampleBlock floats.
inline int32_t sample_full_row(const float* x, int64_t V, float scale, float log2_min_p, float u, float* scratch) {
  const ArgmaxPart best = argmax_range(x, 0, V);
  const int32_t mode = static_cast<int32_t>(best.index);
  const float m = best.value;
  if (!(m - m == 0.0f)) return mode;  // NaN or infinite maximum
  const float floor = max_of(log2_min_p, -126.0f);
  const int64_t blocks = (V + kSampleBlock - 1) / kSampleBlock;
  alignas(64) float q[kSampleBlock];
  float total = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int n = static_cast<int>(min_of<int64_t>(kSampleBlock, V - b * kSampleBlock));
    block_masses(x, b * kSampleBlock, n, m, scale, floor, q);
    scratch[b] = block_sum(q, (n + kW - 1) / kW * kW);
    total += scratch[b];
  }
  const float target = u * total;
  float running = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    if (scratch[b] <= 0.0f || running + scratch[b] < target) {
      running += scratch[b];
      continue;
    }
    const int n = static_cast<int>(min_of<int64_t>(kSampleBlock, V - b * kSampleBlock));
    block_masses(x, b * kSampleBlock, n, m, scale, floor, q);
    int32_t last = -1;
    for (int i = 0; i < n; ++i) {
      if (q[i] <= 0.0f) continue;
      last = static_cast<int32_t>(b * kSampleBlock + i);
      running += q[i];
      if (running >= target) return last;
    }
    return last;  // the block's lane sums reached the target, its running sum fell short by rounding
  }
  return mode;
}

// logsumexp_row: log(sum(exp(x))) of one row as m + log(sum(exp(x - m))), m its maximum (the raw logprobs'
// normalizer); NaN when the maximum is not finite (a NaN, +inf or a row of -inf: as MLX's expression).
// exp is the Cephes polynomial (~2 ulp), 0 below -87 (MLX: ~1e-38 at most, nothing at float32 precision).
inline float logsumexp_row(const float* x, int64_t V) {
  const float m = argmax_range(x, 0, V).value;
  if (!(m - m == 0.0f)) return __builtin_nanf("");
  double sum = 0.0;  // blocks of 512 values summed in 8 float lanes, the blocks in double: ~1e-7 relative
  int64_t i = 0;
  while (i + kW <= V) {
    v8f acc = {};
    for (const int64_t end = min_of(V, i + 512); i + kW <= end; i += kW) {
      v8f v;
      std::memcpy(&v, x + i, sizeof(v));
      const v8f y = v - m;
      acc += y < -87.0f ? v8f{} : exp8(y);
    }
    sum += hsum(acc);
  }
  for (; i < V; ++i) sum += x[i] - m < -87.0f ? 0.0f : __builtin_expf(x[i] - m);
  return m + static_cast<float>(__builtin_log(sum));
}

}  // namespace metrale::METRALE_ISA_NS::kernel
