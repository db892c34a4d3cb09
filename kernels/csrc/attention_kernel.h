// The CPU compute of paged decode attention, free of MLX graph code (paged_decode.cpp wraps it).
//
// One task per (sequence b, range of its keys), all query heads: the pool holds a block's rows of each kv
// head contiguously (kv_row_offset, kernel_table.h), so a task reads whole blocks, in table order, prefetching
// the next. Per block and kv head g, the rep = n_heads / n_kv_heads query heads of the group share every
// K/V row (GQA, one read for all of them), online softmax over the blocks (flash decoding):
//   s[h, t] = scale * q[b, h] . K[slot(t), g]      t in the task's keys, h in g's heads
//   m = max_t s,  l = sum_t e^(s - m),  acc = sum_t e^(s - m) V[slot(t), g],  out = acc / l
//   slot(t) = table[t / block_size] * block_size + t % block_size
// A sequence split over several tasks (long contexts, few sequences) gets its partial (acc, m, l) merged
// by paged_decode.cpp.
// Also causal_softmax_row, the masked softmax of prefill chunks (causal_softmax.cpp).
// Vectors, loads and exp8 come from vecmath.h (shared with the activation kernels). Compiled per
// instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp): no std algorithm templates here.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel_table.h"
#include "vecmath.h"

namespace metrale::METRALE_ISA_NS::kernel {

using metrale::DecodeDims;

constexpr int kMaxHeadDim = metrale::kMaxHeadDim;

inline void fill(float* begin, float* end, float value) {
  for (; begin < end; ++begin) *begin = value;
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

// Decode reads K/V rows W values at a time: 16 with AVX-512 (head_dim a multiple of 16), else 8.
#if defined(__AVX512F__)
constexpr int kDecodeWide = 16;
#else
constexpr int kDecodeWide = 8;
#endif
typedef float v16f __attribute__((vector_size(64)));
template <int W> struct VecOf { typedef v8f type; };
template <> struct VecOf<16> { typedef v16f type; };

// W elements of T (float, f16_t, bf16_t, int8_t) from p, as floats.
template <int W, typename T>
inline typename VecOf<W>::type loadw(const T* p) noexcept {
  if constexpr (W == 8) {
    if constexpr (std::is_same_v<T, int8_t>) return load8_i8(p);
    else return load8(p);
  } else {
#if defined(__AVX512F__)
    __m512 f;
    if constexpr (std::is_same_v<T, float>) {
      f = _mm512_loadu_ps(p);
    } else if constexpr (std::is_same_v<T, f16_t>) {
      f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      f = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    } else {
      f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    v16f v;
    std::memcpy(&v, &f, sizeof(v));
    return v;
#else
    static_assert(W == 8, "16-wide decode loads need AVX-512");
#endif
  }
}

inline v8f to8(v8f v) noexcept { return v; }
inline v8f to8(v16f v) noexcept {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}

// Lane i of the result = the sum of a[i]'s lanes: 8 dot products' horizontal sums in 7 adds.
inline v8f reduce8(const v8f* a) noexcept {
  v8f b[4], c[2];
  for (int k = 0; k < 4; ++k)  // lanes: a[2k] at 0, 2 (and 4, 6 for the upper half), a[2k+1] at 1, 3
    b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  for (int k = 0; k < 2; ++k)  // lanes: a[4k .. 4k + 3]'s lower halves at 0..3, upper halves at 4..7
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// The rows of the n keys of one tile for one kv head, read W values at a time: chunk<W>(t, c) is columns
// W c .. W c + W - 1 of key t's row (at base + rows[t]; base = the pool + the head's offset, rows the slots'
// offsets, across blocks) as floats. q8 rows (int8_t) need prepare<W>() first: it converts the tile's
// float16 group scales once, one float per chunk (scales; W must divide the group).
template <typename T>
struct TileRows {
  const T* base;
  const int64_t* rows;
  float* scales;  // q8 only
  template <int W>
  void prepare(int, int, int) noexcept {}
  template <int W>
  typename VecOf<W>::type chunk(int t, int c) const noexcept { return loadw<W>(base + rows[t] + c * W); }
};

template <>
struct TileRows<int8_t> {
  const int8_t* base;
  const int64_t* rows;
  float* scales;  // (n, chunks): the scale of chunk c of key t
  int chunks = 0;
  template <int W>
  void prepare(int n, int head_dim, int group) noexcept {
    chunks = head_dim / W;
    const int per_group = group / W;
    for (int t = 0; t < n; ++t)
      for (int k = 0; k < head_dim / group; ++k) {
        uint16_t bits;
        std::memcpy(&bits, base + rows[t] + head_dim + 2 * k, sizeof(bits));
        const float d = f16_scale(bits);
        for (int i = 0; i < per_group; ++i) scales[t * chunks + k * per_group + i] = d;
      }
  }
  template <int W>
  typename VecOf<W>::type chunk(int t, int c) const noexcept {
    return loadw<W>(base + rows[t] + c * W) * scales[t * chunks + c];
  }
};

// Requests the rows of one kv head (base = the pool + the head's offset) of n keys (rows: their offsets)
// into L2: the first tile's before any work, later tiles' a key at a time (NextRows).
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* rows, int n, int64_t row_bytes) noexcept {
  for (int t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(base + rows[t]);
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
  }
}

// Rows to request into L2 while a tile is computed: keys [0, n) of the next tile of the same kv head, K and V,
// `row_bytes` each at k + rows[i] and v + rows[i] (pool element offsets of T). attend_block requests one key's
// rows per key it scores, so the requests spread over the work.
template <typename T>
struct NextRows {
  const T* k;
  const T* v;
  const int64_t* rows;
  int n;
  int64_t row_bytes;
};

// One tile's n keys against REP query heads of one kv head, online softmax (flash style):
//   s[r, t] = qs[r] . K[t]                 qs pre-scaled (REP, hd)
//   m' = max(m, max_t s), p = e^(s - m'), l = l e^(m - m') + sum_t p, acc = acc e^(m - m') + p V
// acc (REP, hd) unnormalized; m, l (REP,). Each K and V row is read once for all REP heads, W values at
// a time. Scores come in groups of KPG keys: the KPG x REP dot products of a group are reduced together
// (reduce8) into one vector of 8 lanes, lane i = (key i / REP, head i % REP), stored at s + 8 x group
// (scratch (groups, 8)); the value accumulators of one W-column chunk stay in registers over the block.
// Scoring key t also requests next's row t (NextRows).
template <typename T, int REP, int W>
void attend_block(int hd, const float* qs, TileRows<T> k, TileRows<T> v, int n, float* acc, float* m, float* l,
                  float* s, int group, NextRows<T> next) noexcept {
  using V = typename VecOf<W>::type;
  constexpr int KPG = REP >= 8 ? 1 : 8 / REP, LANES = KPG * REP;
  const int chunks = hd / W;
  k.template prepare<W>(n, hd, group);
  v8i lane_key, lane_used;  // lane i: its key within the group; all ones where i < LANES
  for (int i = 0; i < 8; ++i) lane_key[i] = i / REP, lane_used[i] = i < LANES ? -1 : 0;
  const v8f neg_inf = v8f{} - __builtin_inff();
  v8f top = neg_inf;  // lane-wise max of the scores
  for (int t0 = 0; t0 < n; t0 += KPG) {
    const int keys = min_of(KPG, n - t0);
    const int ahead = min_of(KPG, next.n - t0);  // none once past the next tile's keys
    prefetch_rows(next.k, next.rows + t0, ahead, next.row_bytes);
    prefetch_rows(next.v, next.rows + t0, ahead, next.row_bytes);
    V a[LANES] = {};
    for (int c = 0; c < chunks; ++c)
      for (int i = 0; i < KPG; ++i) {
        if (i >= keys) break;
        const V kc = k.template chunk<W>(t0 + i, c);
        for (int r = 0; r < REP; ++r) a[i * REP + r] += loadw<W>(qs + r * hd + c * W) * kc;
      }
    v8f red[8];
    for (int i = 0; i < 8; ++i) red[i] = i < LANES ? to8(a[i < LANES ? i : 0]) : v8f{};
    v8f sc = reduce8(red);
    const v8i valid = (lane_key < keys) & lane_used;
    sc = valid ? sc : neg_inf;
    store8(s + (t0 / KPG) * 8, sc);
    top = sc > top ? sc : top;
  }
  float mx[REP], alpha[REP];
  v8f mlane = v8f{};  // lane i: the new max of head i % REP
  for (int r = 0; r < REP; ++r) {
    mx[r] = m[r];
    for (int i = r; i < LANES; i += REP) mx[r] = max_of(mx[r], top[i]);
    alpha[r] = __builtin_expf(m[r] - mx[r]);  // 0 on the first block (m = -inf)
    for (int i = r; i < LANES; i += REP) mlane[i] = mx[r];
  }
  v8f sum8 = {};
  for (int t0 = 0; t0 < n; t0 += KPG) {
    float* sg = s + (t0 / KPG) * 8;
    const v8f sc = load8(sg);
    const v8f e = sc == neg_inf ? v8f{} : exp8(sc - mlane);
    store8(sg, e);
    sum8 += e;
  }
  for (int r = 0; r < REP; ++r) {
    float sum = 0.0f;
    for (int i = r; i < LANES; i += REP) sum += sum8[i];
    l[r] = l[r] * alpha[r] + sum;
    m[r] = mx[r];
    if (alpha[r] != 1.0f)
      for (int c = 0; c < hd; c += kW) store8(acc + r * hd + c, load8(acc + r * hd + c) * alpha[r]);
  }
  v.template prepare<W>(n, hd, group);
  // CB chunks at a time: CB x REP >= 8 independent accumulator chains hide the FMA latency
  constexpr int CB = REP >= 8 ? 1 : 8 / REP;
  for (int c0 = 0; c0 < chunks; c0 += CB) {
    const int cn = min_of(CB, chunks - c0);
    V o[CB][REP];
    for (int cb = 0; cb < CB; ++cb)
      for (int r = 0; r < REP; ++r) o[cb][r] = cb < cn ? loadw<W>(acc + r * hd + (c0 + cb) * W) : V{};
    for (int t0 = 0; t0 < n; t0 += KPG) {
      const float* p = s + (t0 / KPG) * 8;
      const int keys = min_of(KPG, n - t0);
      for (int i = 0; i < keys; ++i, p += REP)
        for (int cb = 0; cb < CB; ++cb) {
          if (cb >= cn) break;
          const V vc = v.template chunk<W>(t0 + i, c0 + cb);
          for (int r = 0; r < REP; ++r) o[cb][r] += p[r] * vc;
        }
    }
    for (int cb = 0; cb < cn; ++cb)
      for (int r = 0; r < REP; ++r) std::memcpy(acc + r * hd + (c0 + cb) * W, &o[cb][r], sizeof(V));
  }
}

// The pool offsets (elements) of keys [t, t + n)'s rows of kv head 0, walking the block table (kv head g's
// rows are kv_row_offset(0, g, 0, ...) further).
inline void slot_offsets(const DecodeDims& dm, const int32_t* table, int t, int n, int64_t* rows) noexcept {
  const int bs = dm.block_size;
  int j = t / bs, o = t % bs;
  for (int i = 0; i < n; ++i) {
    rows[i] = kv_row_offset(table[j], 0, o, dm.n_kv, bs, dm.kv_row);
    if (++o == bs) o = 0, ++j;
  }
}

// Keys [key_begin, key_end) of one sequence for all its query heads (kernel_table.h decode_task): walks
// the block table block by block (the next block prefetched while this one is computed), each block's
// rows for every kv head while they are in cache. q (n_heads, hd) unscaled. Writes acc (n_heads, hd)
// unnormalized with ml = (max m (n_heads,), sum l (n_heads,)); with `normalize`, acc / l instead.
// The caller checked the range and the block ids. No allocation, nothing thrown.
template <typename T>
void decode_range(const DecodeDims& dm, const float* q, const T* kp, const T* vp, const int32_t* table,
                  int key_begin, int key_end, float* acc, float* ml, float* scratch, bool normalize) noexcept {
  using Fn = void (*)(int, const float*, TileRows<T>, TileRows<T>, int, float*, float*, float*, float*, int,
                     NextRows<T>);
  static constexpr Fn narrow[] = {attend_block<T, 1, 8>, attend_block<T, 2, 8>, attend_block<T, 3, 8>,
                                  attend_block<T, 4, 8>, attend_block<T, 5, 8>, attend_block<T, 6, 8>,
                                  attend_block<T, 7, 8>, attend_block<T, 8, 8>};
  static constexpr int W = kDecodeWide;
  static constexpr Fn wide[] = {attend_block<T, 1, W>, attend_block<T, 2, W>, attend_block<T, 3, W>,
                                attend_block<T, 4, W>, attend_block<T, 5, W>, attend_block<T, 6, W>,
                                attend_block<T, 7, W>, attend_block<T, 8, W>};
  const Fn* by_width = dm.head_dim % W == 0 && dm.q8_group % W == 0 ? wide : narrow;
  const int hd = dm.head_dim, heads = dm.n_heads, rep = dm.n_heads / dm.n_kv;
  const int64_t row_bytes = static_cast<int64_t>(dm.kv_row) * sizeof(T);
  float* qs = scratch;                                   // (heads, hd) pre-scaled queries
  float* s = qs + heads * hd;                            // (tile keys, 8) probabilities (attend_block)
  float* scales = s + kDecodeScratchRows * kDecodeTileKeys;  // (tile keys, hd / 8) q8 scales
  for (int i = 0; i < heads * hd; i += kW) store8(qs + i, load8(q + i) * dm.scale);
  float *m = ml, *l = ml + heads;
  fill(m, m + heads, -__builtin_inff());
  fill(l, l + heads, 0.0f);
  fill(acc, acc + heads * hd, 0.0f);
  int64_t offsets[2][kDecodeTileKeys];  // this tile's and the next one's row offsets
  int t = key_begin, n = min_of(kDecodeTileKeys, key_end - t), cur = 0;
  slot_offsets(dm, table, t, n, offsets[cur]);
  prefetch_rows(kp, offsets[cur], n, row_bytes);
  prefetch_rows(vp, offsets[cur], n, row_bytes);
  while (n > 0) {
    const int next_t = t + n, next_n = min_of(kDecodeTileKeys, key_end - next_t);
    if (next_n > 0) slot_offsets(dm, table, next_t, next_n, offsets[cur ^ 1]);
    for (int g = 0; g < dm.n_kv; ++g) {
      const int64_t g_off = kv_row_offset(0, g, 0, dm.n_kv, dm.block_size, dm.kv_row);
      const TileRows<T> k{kp + g_off, offsets[cur], scales};
      const TileRows<T> v{vp + g_off, offsets[cur], scales};
      // The next tile's rows of this kv head go to L2 while this one is computed, one key's per key scored.
      for (int r0 = 0; r0 < rep; r0 += kDecodeScratchRows) {
        const int h = g * rep + r0, width = min_of(kDecodeScratchRows, rep - r0);
        const NextRows<T> next{kp + g_off, vp + g_off, offsets[cur ^ 1], r0 == 0 ? next_n : 0, row_bytes};
        by_width[width - 1](hd, qs + h * hd, k, v, n, acc + h * hd, m + h, l + h, s, dm.q8_group, next);
      }
    }
    t = next_t, n = next_n, cur ^= 1;
  }
  if (normalize)
    for (int h = 0; h < heads; ++h) {
      const float inv = 1.0f / l[h];
      for (int c = 0; c < hd; c += kW) store8(acc + h * hd + c, load8(acc + h * hd + c) * inv);
    }
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
