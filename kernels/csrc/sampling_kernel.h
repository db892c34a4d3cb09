// Sampling rows of float32 logits, for the primitives of sampling.cpp.
//
// argmax_range: greedy argmax over a range of one row. Exactly mx.argmax's answer (mlx 0.32, CPU): the
// first index of the largest value; -0.0 ties +0.0; a row of -inf gives its first index; a NaN beats
// every number and the FIRST NaN wins.
// 16 lanes, as two 8-lane GCC vector extensions (lanes 0-7 and 8-15 of each 16 values): two AVX2
// registers in the avx2 build, SSE pairs in the baseline build, halves of one in the avx512 build. (One
// 16-lane vector, as this was until issue 23's stop 15, GCC compiled for AVX2 into a scalar loop, a
// `vucomiss` per value: the kernel took 7.4 ms for (32, 128256) logits where mx.argmax took 4.7.) Each
// lane keeps its own first maximum (strict >), so the lowest index among the lanes holding the maximum is
// the row's first one. NaN never passes `>`, so the loop only notes that one was seen; the rare row with a
// NaN is scanned again for it.
// Compiled per instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernel_table.h"
#include "vecmath.h"

namespace metrale::METRALE_ISA_NS::kernel {

// x[begin, end) of one row (end - begin < 2^31): its maximum, the index (from x) of its first
// occurrence, and the index of its first NaN (-1 without one).
inline ArgmaxPart argmax_range(const float* x, int64_t begin, int64_t end) {
  ArgmaxPart part{x[begin], begin, -1};
  int64_t i = begin;
  if (end - begin >= 16) {
    v8f best[2];  // [half]: lanes 0-7, 8-15
    v8i lane[2] = {{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}, index[2], unordered[2];
    for (int h = 0; h < 2; ++h) {
      std::memcpy(&best[h], x + begin + 8 * h, sizeof(v8f));
      index[h] = lane[h];  // offsets from begin
      unordered[h] = best[h] != best[h];
    }
    for (i = begin + 16; i + 16 <= end; i += 16) {
      for (int h = 0; h < 2; ++h) {
        v8f v;
        std::memcpy(&v, x + i + 8 * h, sizeof(v));
        lane[h] += 16;
        const v8i greater = v > best[h];
        best[h] = greater ? v : best[h];
        index[h] = greater ? lane[h] : index[h];
        unordered[h] |= v != v;
      }
    }
    bool any_nan = false;
    for (int l = 0; l < 16; ++l) any_nan |= unordered[l / 8][l % 8] != 0;
    if (any_nan) {
      for (int64_t j = begin; j < i; ++j)
        if (x[j] != x[j]) return ArgmaxPart{x[j], j, j};
    }
    part = ArgmaxPart{best[0][0], begin + index[0][0], -1};
    for (int l = 1; l < 16; ++l) {
      const float value = best[l / 8][l % 8];
      const int64_t at = begin + index[l / 8][l % 8];
      if (value > part.value || (value == part.value && at < part.index)) part = ArgmaxPart{value, at, -1};
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

// 8 values from p, lanes n.. as -inf logits (no mass, never a maximum): the tail of a row.
inline v8f load8_padded(const float* p, int n) {
  v8f v;
  if (n >= kW) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    for (int j = 0; j < kW; ++j) v[j] = j < n ? p[j] : -__builtin_inff();
  }
  return v;
}

// Masses of x[begin, begin + n), n <= kSampleBlock, into q (the tail padded with -inf logits: no mass).
inline void block_masses(const float* x, int64_t begin, int n, float m, float scale, float floor, float* q) {
  for (int i = 0; i < n; i += kW) {
    const v8f mass = mass8(load8_padded(x + begin + i, n - i), m, scale, floor);
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

// The O(V) scans of top_k / top_p sampling and top-n logprobs (the selection around them is baseline code,
// sampling_select.cpp, with the bucket layout of kernel_table.h's kSelectBuckets).
//
// candidate_masses: y_i = (x_i - m) * scale (bit for bit metrale.sampling.ops' log2_q), q_i = 2^y_i where
// y_i >= floor (floor >= -126), else 0 (a NaN logit: y NaN, q 0), and bucket_i = min(kSelectBuckets - 1,
// int(-y_i * inv)) for y_i >= floor, else kSelectBuckets; masses[b] (kSelectBuckets doubles) gets the sum of q
// over bucket b (4 interleaved histograms: consecutive values in one bucket do not wait on each other).
// Returns the sum of q. With y, q, bucket and masses null, only the sum (no store, no histogram).
inline double candidate_masses(const float* x, int64_t V, float m, float scale, float floor, float inv, float* y,
                               float* q, uint16_t* bucket, double* masses) {
  if (masses == nullptr) {
    double total = 0.0;  // blocks of 512 values in 8 float lanes, the blocks in double
    for (int64_t i = 0; i < V;) {
      v8f acc = {};
      for (const int64_t end = min_of(V, i + 512); i < end; i += kW) {
        const v8f yv = (load8_padded(x + i, static_cast<int>(min_of<int64_t>(kW, V - i))) - m) * scale;
        acc += yv >= floor ? exp8(yv * 0.693147180559945f) : v8f{};
      }
      total += hsum(acc);
    }
    return total;
  }
  double hist[4][kSelectBuckets] = {};
  for (int64_t i = 0; i < V; i += kW) {
    const int n = static_cast<int>(min_of<int64_t>(kW, V - i));
    const v8f yv = (load8_padded(x + i, n) - m) * scale;
    const v8i above = yv >= floor;
    const v8f qv = above ? exp8(yv * 0.693147180559945f) : v8f{};
    v8f scaled = (v8f{} - yv) * inv;
    scaled = above ? scaled : v8f{};
    v8i b = __builtin_convertvector(scaled, v8i);
    b = b < kSelectBuckets - 1 ? b : v8i{} + (kSelectBuckets - 1);
    b = above ? b : v8i{} + kSelectBuckets;
    const v8h b16 = __builtin_convertvector(b, v8h);
    std::memcpy(y + i, &yv, sizeof(float) * n);
    std::memcpy(q + i, &qv, sizeof(float) * n);
    std::memcpy(bucket + i, &b16, sizeof(uint16_t) * n);
    for (int j = 0; j < n; ++j) {
      const uint16_t k = bucket[i + j];
      if (k < kSelectBuckets) hist[j & 3][k] += q[i + j];
    }
  }
  double total = 0.0;
  for (int k = 0; k < kSelectBuckets; ++k) {
    masses[k] = (hist[0][k] + hist[1][k]) + (hist[2][k] + hist[3][k]);
    total += masses[k];
  }
  return total;
}

// block_maxima: out[b] = the largest non-NaN value of x[b * block, (b + 1) * block) (-inf: none).
inline void block_maxima(const float* x, int64_t V, int64_t block, float* out) {
  const int64_t blocks = (V + block - 1) / block;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * block, end = min_of(V, begin + block);
    int64_t i = begin;
    float best = -__builtin_inff();
    if (end - begin >= kW) {
      v8f acc[4] = {v8f{} - __builtin_inff(), v8f{} - __builtin_inff(), v8f{} - __builtin_inff(),
                    v8f{} - __builtin_inff()};  // 4 chains: the maxima do not wait on each other
      for (; i + 4 * kW <= end; i += 4 * kW) {
        for (int a = 0; a < 4; ++a) {
          v8f v;
          std::memcpy(&v, x + i + a * kW, sizeof(v));
          acc[a] = v > acc[a] ? v : acc[a];
        }
      }
      for (; i + kW <= end; i += kW) {
        v8f v;
        std::memcpy(&v, x + i, sizeof(v));
        acc[0] = v > acc[0] ? v : acc[0];
      }
      for (int a = 1; a < 4; ++a) acc[0] = acc[a] > acc[0] ? acc[a] : acc[0];
      for (int l = 0; l < kW; ++l) best = acc[0][l] > best ? acc[0][l] : best;
    }
    for (; i < end; ++i) best = x[i] > best ? x[i] : best;
    out[b] = best;
  }
}

// Whether any lane of a comparison result (32 bytes) is set, in 4 words instead of lane by lane.
inline bool any_lane(const void* mask, size_t bytes) {
  uint64_t words[4];
  std::memcpy(words, mask, bytes);
  return ((words[0] | words[1]) | (words[2] | words[3])) != 0;
}

// gather_at_least: the indices i (ascending) with x_i >= bound into out (room for V); returns their count.
inline int64_t gather_at_least(const float* x, int64_t V, float bound, int32_t* out) {
  int64_t count = 0, i = 0;
  for (; i + kW <= V; i += kW) {
    v8f v;
    std::memcpy(&v, x + i, sizeof(v));
    const v8i hit = v >= bound;
    if (!any_lane(&hit, sizeof(hit))) continue;
    for (int l = 0; l < kW; ++l)
      if (hit[l]) out[count++] = static_cast<int32_t>(i + l);
  }
  for (; i < V; ++i)
    if (x[i] >= bound) out[count++] = static_cast<int32_t>(i);
  return count;
}

// gather_bucket: the indices i (ascending) with bucket_i == b into out (room for V); returns their count.
inline int64_t gather_bucket(const uint16_t* bucket, int64_t V, int b, int32_t* out) {
  typedef uint16_t v16u16 __attribute__((vector_size(32)));
  typedef int16_t v16i16 __attribute__((vector_size(32)));
  int64_t count = 0, i = 0;
  const uint16_t want = static_cast<uint16_t>(b);
  for (; i + 16 <= V; i += 16) {
    v16u16 v;
    std::memcpy(&v, bucket + i, sizeof(v));
    const v16i16 hit = v == want;
    if (!any_lane(&hit, sizeof(hit))) continue;
    for (int l = 0; l < 16; ++l)
      if (hit[l]) out[count++] = static_cast<int32_t>(i + l);
  }
  for (; i < V; ++i)
    if (bucket[i] == want) out[count++] = static_cast<int32_t>(i);
  return count;
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
