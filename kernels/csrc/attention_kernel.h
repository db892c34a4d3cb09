// The CPU compute of paged decode attention, free of MLX graph code (paged_decode.cpp wraps it).
//
// One task per (sequence b, kv head g); the rep = n_heads / n_kv_heads query heads of the group
// share every K/V row they read (GQA). Per task, two passes over the context, no gather copies:
//   pass 1  s[r, t] = scale * q[b, g*rep + r] . K[slot(t), g]      t in [start, ctx)
//           p = exp(s - max_t s)                                    (float32, vectorized exp)
//   pass 2  out[b, g*rep + r] = sum_t p[r, t] * V[slot(t), g] / sum_t p[r, t]
//   slot(t) = table[t / block_size] * block_size + t % block_size, walked block by block
//   start   = window > 0 ? max(0, ctx - window) : 0
// Also causal_softmax_row, the masked softmax of prefill chunks (causal_softmax.cpp).
// Vectors, loads and exp8 come from vecmath.h (shared with the activation kernels). Compiled per
// instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp): no std algorithm templates here.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernel_table.h"
#include "vecmath.h"

namespace metrale::METRALE_ISA_NS::kernel {

using metrale::DecodeDims;

constexpr int kMaxHeadDim = metrale::kMaxHeadDim;

inline void fill(float* begin, float* end, float value) {
  for (; begin < end; ++begin) *begin = value;
}

#ifndef METRALE_PREFETCH_BLOCKS
#define METRALE_PREFETCH_BLOCKS 2
#endif

// Calls f(t, row) for t in [start, ctx) with `row` the pool offset of slot(t) (in elements). Blocks
// sit at random places in the pool, which the hardware prefetcher cannot guess: the rows of the
// block METRALE_PREFETCH_BLOCKS ahead are prefetched (`row_bytes` from base + row each).
template <typename T, typename F>
inline void for_each_slot(const DecodeDims& dm, const int32_t* table, int start, int ctx, int64_t row_stride,
                          const T* base, int row_bytes, F&& f) {
  const int bs = dm.block_size;
  const int last = (ctx - 1) / bs;
  auto prefetch = [&](int j) {
    const char* p = reinterpret_cast<const char*>(base + static_cast<int64_t>(table[j]) * bs * row_stride);
    for (int i = 0; i < bs; ++i, p += row_stride * sizeof(T))
      for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off);
  };
  for (int j = start / bs; j < min_of(last + 1, start / bs + METRALE_PREFETCH_BLOCKS); ++j) prefetch(j);
  for (int j = start / bs, t = start; t < ctx; ++j) {
    if (j + METRALE_PREFETCH_BLOCKS <= last) prefetch(j + METRALE_PREFETCH_BLOCKS);
    const int end = min_of(ctx, (j + 1) * bs);
    int64_t row = (static_cast<int64_t>(table[j]) * bs + t % bs) * row_stride;
    for (; t < end; ++t, row += row_stride) f(t, row);
  }
}


// Reads one pool row (one slot, one kv head) as floats, 8 values at a time: f(c, v) for each chunk c
// (columns 8c .. 8c + 7). float, f16_t and bf16_t rows hold the values; int8_t rows are q8
// (kernel_table.h): head_dim int8 values, then one float16 scale per `group` values, dequantized here in
// registers (no widened copy of the pool), each scale converted once per group.
template <typename T>
struct RowReader {
  RowReader(int head_dim, int /*group*/) noexcept : chunks(head_dim / kW) {}
  template <typename F>
  void operator()(const T* row, F&& f) const noexcept {
    for (int c = 0; c < chunks; ++c) f(c, load8(row + c * kW));
  }
  int chunks;
};

typedef int8_t v8b __attribute__((vector_size(8)));

// 8 int8 values as floats (sign-extend, convert: two instructions with AVX2)
inline v8f load8_i8(const int8_t* p) noexcept {
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  v8f v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
#else
  v8b b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(__builtin_convertvector(b, v8i), v8f);
#endif
}

inline float f16_scale(uint16_t bits) noexcept {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return f16_to_float(bits);
#endif
}

template <>
struct RowReader<int8_t> {
  RowReader(int head_dim, int group) noexcept : head_dim(head_dim), groups(head_dim / group), per_group(group / kW) {}
  template <typename F>
  void operator()(const int8_t* row, F&& f) const noexcept {
    for (int k = 0, c = 0; k < groups; ++k) {
      uint16_t bits;
      std::memcpy(&bits, row + head_dim + 2 * k, sizeof(bits));
      const float d = f16_scale(bits);
      for (const int end = c + per_group; c < end; ++c) f(c, load8_i8(row + c * kW) * d);
    }
  }
  int head_dim, groups, per_group;
};

// One (sequence, kv head) task over REP of its query heads. q: (REP, hd) unscaled rows; out: (REP, hd).
// head_dim a multiple of 8, <= kMaxHeadDim (checked by the op); no allocation, nothing thrown.
template <typename T, int REP>
void decode_task(const DecodeDims& dm, const float* q, const T* kp, const T* vp, const int32_t* table, int ctx,
                 float* out, float* scratch, int g) noexcept {
  constexpr int rep = REP;
  const int hd = dm.head_dim, chunks = hd / kW;
  const int64_t row_stride = static_cast<int64_t>(dm.n_kv) * dm.kv_row;  // elements of T per slot
  const RowReader<T> read(hd, dm.q8_group);
  const int start = dm.window > 0 ? max_of(0, ctx - dm.window) : 0;
  const int n = ctx - start;
  bool valid = ctx >= 1 && static_cast<int64_t>(ctx) <= static_cast<int64_t>(dm.max_blocks) * dm.block_size;
  for (int j = start / dm.block_size; valid && j <= (ctx - 1) / dm.block_size; ++j)
    valid = table[j] >= 0 && table[j] < dm.num_blocks;
  if (!valid) {
    fill(out, out + rep * hd, __builtin_nanf(""));
    return;
  }
  float* s = scratch;  // (rep, n): scores, then unnormalized probabilities
  v8f qv[rep * (kMaxHeadDim / kW)];  // (rep, chunks) queries, pre-scaled
  for (int r = 0; r < rep; ++r)
    for (int c = 0; c < chunks; ++c) qv[r * chunks + c] = load8(q + r * hd + c * kW) * dm.scale;

  const T* kg = kp + static_cast<int64_t>(g) * dm.kv_row;
  for_each_slot(dm, table, start, ctx, row_stride, kg, dm.kv_row * int(sizeof(T)), [&](int t, int64_t row) {
    v8f acc[rep] = {};
    read(kg + row, [&](int c, v8f k) {
      for (int r = 0; r < rep; ++r) acc[r] += qv[r * chunks + c] * k;
    });
    for (int r = 0; r < rep; ++r) s[static_cast<int64_t>(r) * n + (t - start)] = hsum(acc[r]);
  });

  float inv_sum[rep];
  for (int r = 0; r < rep; ++r) {
    float* sr = s + static_cast<int64_t>(r) * n;
    float m = sr[0];
    for (int i = 1; i < n; ++i) m = max_of(m, sr[i]);
    v8f sum8 = {};
    int i = 0;
    for (; i + kW <= n; i += kW) {
      v8f e = exp8(load8(sr + i) - m);
      store8(sr + i, e);
      sum8 += e;
    }
    float sum = hsum(sum8);
    for (; i < n; ++i) sum += (sr[i] = __builtin_expf(sr[i] - m));
    inv_sum[r] = 1.0f / sum;
  }

  v8f acc[rep * (kMaxHeadDim / kW)];  // (rep, chunks) output accumulators
  for (int i = 0; i < rep * chunks; ++i) acc[i] = v8f{};
  const T* vg = vp + static_cast<int64_t>(g) * dm.kv_row;
  for_each_slot(dm, table, start, ctx, row_stride, vg, dm.kv_row * int(sizeof(T)), [&](int t, int64_t row) {
    float p[rep];
    for (int r = 0; r < rep; ++r) p[r] = s[static_cast<int64_t>(r) * n + (t - start)];
    read(vg + row, [&](int c, v8f v) {
      for (int r = 0; r < rep; ++r) acc[r * chunks + c] += p[r] * v;
    });
  });
  for (int r = 0; r < rep; ++r)
    for (int c = 0; c < chunks; ++c) store8(out + r * hd + c * kW, acc[r * chunks + c] * inv_sum[r]);
}


// In-place masked softmax of one score row (length L) of query i:
// keys j with lo <= j <= hi are kept (hi = i + offset, lo = window ? hi - window + 1 : 0), the
// rest become 0. With no key kept the row is NaN (as a fully masked softmax would be).
inline void causal_softmax_row(float* row, int length, int i, int offset, int window) noexcept {
  const int hi = min_of(length - 1, i + offset);
  const int lo = window > 0 ? max_of(0, i + offset - window + 1) : 0;
  if (hi < lo) {
    fill(row, row + length, __builtin_nanf(""));
    return;
  }
  float m = -__builtin_inff();
  for (int j = lo; j <= hi; ++j) m = max_of(m, row[j]);
  v8f sum8 = {};
  int j = lo;
  for (; j + kW <= hi + 1; j += kW) {
    const v8f e = exp8(load8(row + j) - m);
    store8(row + j, e);
    sum8 += e;
  }
  float sum = hsum(sum8);
  for (; j <= hi; ++j) sum += (row[j] = __builtin_expf(row[j] - m));
  const float inv = 1.0f / sum;
  fill(row, row + lo, 0.0f);
  for (j = lo; j + kW <= hi + 1; j += kW) store8(row + j, load8(row + j) * inv);
  for (; j <= hi; ++j) row[j] *= inv;
  fill(row + hi + 1, row + length, 0.0f);
}

}  // namespace metrale::METRALE_ISA_NS::kernel
