// The CPU compute of paged prefill attention, free of MLX graph code (paged_prefill.cpp wraps it).
//
// One task per (kv head g, tile of up to kPrefillQueries queries of the chunk); its R = tile * rep rows
// (query i, head g * rep + r) share every key they read (GQA), padded to RP rows (a multiple of
// the set's vector width kVW, at most kPrefillRowPad's multiple the scratch is sized for; pad rows are zero
// queries, never written out). The keys the tile can see,
//   lo = window ? max(0, first + q_begin - window + 1) : 0  ..  hi = first + q_end - 1,
// are walked in tiles of KT = kPrefillKeys, read through the block table straight from the pools and
// widened to float32 rows once per tile (vector converts, no transposition: the queries are the
// transposed operand, once per task). Scores are kept transposed, keys x rows, so the online softmax
// runs across rows in vectors:
//   S^T (KT, RP) = K Q^T (Q pre-scaled by scale x log2(e)); keys outside [p - window + 1, p] of a row are -inf
//   (p = position)
//   m' = max(m, max_j S^T), O = O 2^(m - m') + P V with P^T = 2^(S^T - m'), l = l 2^(m - m') + sum_j P^T
//   out = O / l    (a row that sees no key is NaN, as a fully masked softmax)
// (powers of 2 of log2(e)-scaled scores are the powers of e of the scores: one multiply less per score, and
// 2^x needs no log2(e) in its range reduction). A task may take a part of its keys only (few tasks, long
// context: paged_prefill.cpp splits the range and merges the parts).
// No (q_len, context) score matrix exists: memory stays O(RP * KT) per task, whatever the context.
// Per key tile: widen K/V (and prefetch the next tile's rows), S^T in register blocks of 4 keys x 4 row
// vectors, the mask only on tiles that cross a row's position or window, the softmax on whole vectors of
// rows, and P V with O's rescale folded into its accumulator loads. Measured (benchmarks/prefill_attention_bench.py,
// 1B shape, hd 64, f16 pool, one core of the Sapphire Rapids machine): ~100-115 GFLOP/s at contexts 1k-8k,
// against a 512-bit FMA peak of ~230; the products run at ~70% of it, the softmax and the widening of
// the K/V rows (strided reads from L3: every query tile walks the whole context) take the rest.
// Compiled per instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp), like attention_kernel.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernel_table.h"
#include "attention_kernel.h"
#include "vecmath.h"

namespace metrale::METRALE_ISA_NS::kernel {

using metrale::PrefillDims;
constexpr int KT = metrale::kPrefillKeys;

// The tile products run on the widest float vectors the set has (16 lanes with AVX-512, else the 8 of
// v8f): their operands are float32 tiles in L1/L2, so no dtype conversion happens in these loops.
#if defined(__AVX512F__)
constexpr int kVW = 16;
constexpr int kAccs = 16;  // accumulator vectors a register block keeps (32 zmm registers)
#else
constexpr int kVW = 8;
constexpr int kAccs = 8;   // 16 ymm registers (or pairs of xmm)
#endif
static_assert(metrale::kPrefillRowPad % kVW == 0, "the scratch's padded rows hold whole vectors of this set");
typedef float vwf __attribute__((vector_size(kVW * 4)));

template <typename V>
inline V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
inline void storev(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

// Keys [t0, t1) of kv head g widened to float32 rows: kf (KT, hd), vf (KT, hd); rows past t1 are 0.
// q8 rows are dequantized here (RowReader, attention_kernel.h): the tile is the only float copy.
// The rows of the next tile, keys [t1, t_end), are prefetched meanwhile (they come from L3 or memory:
// every query tile of the chunk walks the whole context).
template <typename T>
inline void widen_tile(const PrefillDims& dm, const T* kp, const T* vp, const int32_t* table, int g, int t0,
                       int t1, int t_end, float* kf, float* vf) noexcept {
  const int hd = dm.head_dim, bs = dm.block_size;
  const int row_bytes = dm.kv_row * static_cast<int>(sizeof(T));
  const RowReader<T> read(hd, dm.q8_group);
  auto row_of = [&](int t) { return kv_row_offset(table[t / bs], g, t % bs, dm.n_kv, bs, dm.kv_row); };
  for (int t = t0; t < t1; ++t) {
    const int j = t - t0;
    if (t + KT < t_end) {
      const int64_t next = row_of(t + KT);
      for (int b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(kp + next) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(vp + next) + b);
      }
    }
    const int64_t row = row_of(t);
    read(kp + row, [&](int c, v8f k) { store8(kf + j * hd + c * kW, k); });
    read(vp + row, [&](int c, v8f v) { store8(vf + j * hd + c * kW, v); });
  }
  fill(kf + (t1 - t0) * hd, kf + KT * hd, 0.0f);
  fill(vf + (t1 - t0) * hd, vf + KT * hd, 0.0f);
}

// st[j, r0 ..] = kf[j, :] . qt[:, r0 ..] for keys [j0, j0 + KB): KB keys x RV row vectors in registers.
template <int KB, int RV>
inline void score_block(const float* qt, const float* kf, float* st, int j0, int r0, int hd, int rp) noexcept {
  vwf a[KB][RV] = {};
  for (int d = 0; d < hd; ++d) {
    vwf q[RV];
    for (int rv = 0; rv < RV; ++rv) q[rv] = loadv<vwf>(qt + d * rp + r0 + rv * kVW);
    for (int kb = 0; kb < KB; ++kb) {
      const float x = kf[(j0 + kb) * hd + d];
      for (int rv = 0; rv < RV; ++rv) a[kb][rv] += x * q[rv];
    }
  }
  for (int kb = 0; kb < KB; ++kb)
    for (int rv = 0; rv < RV; ++rv) storev(st + (j0 + kb) * rp + r0 + rv * kVW, a[kb][rv]);
}

template <int RV>
inline void score_rows(const float* qt, const float* kf, float* st, int r0, int hd, int rp) noexcept {
  constexpr int KB = kAccs / RV;
  static_assert(KT % KB == 0, "key blocks tile the key tile");
  for (int j0 = 0; j0 < KT; j0 += KB) score_block<KB, RV>(qt, kf, st, j0, r0, hd, rp);
}

// S^T (KT, rp) = K Q^T over every row vector: 4 (AVX-512) or 2 row vectors at a time, then 2, then 1.
inline void tile_scores(const float* qt, const float* kf, float* st, int hd, int rp) noexcept {
  constexpr int RV = kAccs / 4;
  int r0 = 0;
  for (; r0 + RV * kVW <= rp; r0 += RV * kVW) score_rows<RV>(qt, kf, st, r0, hd, rp);
  if constexpr (RV > 2)
    for (; r0 + 2 * kVW <= rp; r0 += 2 * kVW) score_rows<2>(qt, kf, st, r0, hd, rp);
  for (; r0 < rp; r0 += kVW) score_rows<1>(qt, kf, st, r0, hd, rp);
}

// Keys of [t0, t0 + KT) a row cannot see become -inf in st: past its position, before its window, past t1.
// Rows are (query, rep) pairs, query i at position base + i; pad rows (r >= rows) mask as the last row.
inline void mask_tile(float* st, int base, int rows, int rep, int t0, int t1, int window, int rp) noexcept {
  const float neg_inf = -__builtin_inff();
  for (int j = 0; j < KT; ++j) {
    const int t = t0 + j;
    float* row = st + j * rp;
    if (t >= t1) {
      fill(row, row + rp, neg_inf);
      continue;
    }
    int p = base;
    for (int r = 0, k = 0; r < rp; ++r) {
      if (t > p || (window > 0 && t <= p - window)) row[r] = neg_inf;
      if (++k == rep && r + 1 < rows) {  // the next row is the next query's
        k = 0;
        ++p;
      }
    }
  }
}

typedef int32_t vwi __attribute__((vector_size(kVW * 4)));

// 2^x on kVW lanes for x <= 0 (scores minus their max, in log2 units: the queries carry log2(e)). x + 1.5 x 2^23
// rounds x to the integer n in the low mantissa bits (|x| < 2^22), so n costs two adds and its exponent bits one
// integer add; 2^f on f = x - n in [-1/2, 1/2] is Cephes' exp2f polynomial (~1 ulp). x < -126 gives 2^-126 (the
// caller maps -inf to 0 itself).
inline vwf exp2_wide(vwf x) noexcept {
  const vwf lo = vwf{} - 126.0f;
  x = x < lo ? lo : x;
  const vwf magic = vwf{} + 12582912.0f;
  const vwf t = x + magic;
  const vwf f = x - (t - magic);
  vwf y = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  y = y * f + 9.618437357674640e-3f;
  y = y * f + 5.550332471162809e-2f;
  y = y * f + 2.402264791363012e-1f;
  y = y * f + 6.931472028550421e-1f;
  y = y * f + 1.0f;
  vwi bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;  // 2^n
  vwf two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

// Online softmax over the tile, kVW rows at a time, in log2 units: st becomes P^T = 2^(S^T - m') (0 where masked),
// m and l are updated and alpha[r] = 2^(m - m') is left for rescaling O (tile_values applies it). Only a MASKED
// tile (mask_tile ran) holds -inf scores, so only there a score is compared with it.
template <bool MASKED>
inline void online_softmax_tile(float* st, float* m, float* l, float* alpha, int rp) noexcept {
  static_assert(KT % 4 == 0, "four running maxima");
  const vwf neg_inf = vwf{} - __builtin_inff();
  for (int r = 0; r < rp; r += kVW) {
    vwf mt[4] = {neg_inf, neg_inf, neg_inf, neg_inf};  // independent chains: vmaxps has 4 cycles latency
    for (int j = 0; j < KT; j += 4)
      for (int u = 0; u < 4; ++u) {
        const vwf x = loadv<vwf>(st + (j + u) * rp + r);
        mt[u] = x > mt[u] ? x : mt[u];
      }
    mt[0] = mt[0] > mt[1] ? mt[0] : mt[1];
    mt[2] = mt[2] > mt[3] ? mt[2] : mt[3];
    const vwf m_old = loadv<vwf>(m + r);
    const vwf m_tile = mt[0] > mt[2] ? mt[0] : mt[2];
    const vwf m_new = m_tile > m_old ? m_tile : m_old;
    const vwf m_sub = m_new == neg_inf ? vwf{} : m_new;  // a row with no key yet: 2^(-inf - 0) = 0
    const vwf a = m_old == neg_inf ? vwf{} : exp2_wide(m_old - m_sub);
    vwf sum[2] = {};
    for (int j = 0; j < KT; ++j) {
      const vwf x = loadv<vwf>(st + j * rp + r);
      vwf e = exp2_wide(x - m_sub);
      if constexpr (MASKED) e = x == neg_inf ? vwf{} : e;
      storev(st + j * rp + r, e);
      sum[j & 1] += e;
    }
    storev(m + r, m_new);
    storev(l + r, loadv<vwf>(l + r) * a + (sum[0] + sum[1]));
    storev(alpha + r, a);
  }
}

// o[r, c .. c + CB lanes of V) += sum_j pt[j, r] V[j, c ..] for rows [r0, r0 + RB), V a float vector type.
// O is rescaled by alpha (the softmax's 2^(m - m')) as it is loaded.
template <typename V, int RB, int CB>
inline void tile_values(const float* pt, const float* vf, const float* alpha, float* o, int r0, int c, int hd,
                        int rp) noexcept {
  constexpr int L = sizeof(V) / sizeof(float);
  V a[RB][CB];
  for (int rr = 0; rr < RB; ++rr)
    for (int cb = 0; cb < CB; ++cb) a[rr][cb] = loadv<V>(o + (r0 + rr) * hd + c + cb * L) * alpha[r0 + rr];
  for (int j = 0; j < KT; ++j) {
    V v[CB];
    for (int cb = 0; cb < CB; ++cb) v[cb] = loadv<V>(vf + j * hd + c + cb * L);
    for (int rr = 0; rr < RB; ++rr) {
      const float x = pt[j * rp + r0 + rr];
      for (int cb = 0; cb < CB; ++cb) a[rr][cb] += x * v[cb];
    }
  }
  for (int rr = 0; rr < RB; ++rr)
    for (int cb = 0; cb < CB; ++cb) storev(o + (r0 + rr) * hd + c + cb * L, a[rr][cb]);
}

// All of o's columns for rows [r0, r0 + RB): 4 (AVX-512) or 2 wide vectors at a time, then 8 lanes.
template <int RB>
inline void tile_values_rows(const float* pt, const float* vf, const float* alpha, float* o, int r0, int hd,
                             int rp) noexcept {
  constexpr int CB = kVW == 16 ? 4 : 2;
  int c = 0;
  for (; c + CB * kVW <= hd; c += CB * kVW) tile_values<vwf, RB, CB>(pt, vf, alpha, o, r0, c, hd, rp);
  for (; c + kVW <= hd; c += kVW) tile_values<vwf, RB, 1>(pt, vf, alpha, o, r0, c, hd, rp);
  for (; c < hd; c += kW) tile_values<v8f, RB, 1>(pt, vf, alpha, o, r0, c, hd, rp);
}

// Queries [q_begin, q_end) of the chunk against kv head g's keys in [key_begin, key_end) (0, INT_MAX: all it
// sees). part nullptr: the rows' attention outputs, normalized, into out. Otherwise one part of a key range split
// over several tasks (paged_prefill.cpp merges them): the rows' unnormalized O (rows, hd), then their running max
// m (rows,) in log2 units and sum l (rows,) at part. Rows past the range's keys get m = -inf, l = 0, O = 0; a block
// id out of range makes the rows NaN (a part: O NaN, m = 0, l = 1, so the merge is NaN too).
template <typename T>
void prefill_task(const PrefillDims& dm, const float* q, const T* kp, const T* vp, const int32_t* table, float* out,
                  float* scratch, int g, int q_begin, int q_end, int key_begin, int key_end, float* part) noexcept {
  const int hd = dm.head_dim, rep = dm.n_heads / dm.n_kv, rows = (q_end - q_begin) * rep;
  const int rp = (rows + kVW - 1) / kVW * kVW;  // whole vectors of this set (scratch is sized for kPrefillRowPad)
  const int first = dm.first_position, last = first + q_end - 1;  // the last row's position
  const int seen = dm.window > 0 ? max_of(0, first + q_begin - dm.window + 1) : 0;  // the first row's first key
  const int lo = max_of(seen, key_begin), hi = min_of(last, key_end - 1);
  auto out_row = [&](int r) { return out + (static_cast<int64_t>(q_begin + r / rep) * dm.n_heads + g * rep + r % rep) * hd; };
  bool valid = static_cast<int64_t>(last) < static_cast<int64_t>(dm.max_blocks) * dm.block_size;
  for (int b = lo / dm.block_size; valid && b <= hi / dm.block_size; ++b)
    valid = table[b] >= 0 && table[b] < dm.num_blocks;
  if (!valid) {
    if (part != nullptr) {
      fill(part, part + rows * hd, __builtin_nanf(""));
      fill(part + rows * hd, part + rows * (hd + 1), 0.0f);
      fill(part + rows * (hd + 1), part + rows * (hd + 2), 1.0f);
    } else {
      for (int r = 0; r < rows; ++r) fill(out_row(r), out_row(r) + hd, __builtin_nanf(""));
    }
    return;
  }
  float* qt = scratch;                 // (hd, rp) scaled queries, transposed; pad rows 0
  float* o = qt + hd * rp;             // (rp, hd) unnormalized outputs
  float* kf = o + rp * hd;             // (KT, hd) keys
  float* vf = kf + KT * hd;            // (KT, hd) values
  float* st = vf + KT * hd;            // (KT, rp) scores, then probabilities, transposed
  float* m = st + KT * rp;             // (rp,) running max
  float* l = m + rp;                   // (rp,) running sum
  float* alpha = l + rp;               // (rp,) this tile's rescale of O
  fill(qt, qt + hd * rp, 0.0f);
  fill(o, o + rp * hd, 0.0f);
  for (int r = 0; r < rp; ++r) {
    m[r] = -__builtin_inff();
    l[r] = 0.0f;
  }
  const float scale = dm.scale * 1.44269504088896341f;  // log2(e): the softmax runs in powers of 2
  for (int r = 0; r < rows; ++r) {
    const float* src = q + (static_cast<int64_t>(q_begin + r / rep) * dm.n_heads + g * rep + r % rep) * hd;
    for (int d = 0; d < hd; ++d) qt[d * rp + r] = src[d] * scale;
  }
  const int lowest = first + q_begin;  // the first row's position: tiles up to it are seen by every row
  const int last_window_start = dm.window > 0 ? last - dm.window + 1 : 0;
  for (int t0 = lo; t0 <= hi; t0 += KT) {
    const int t1 = min_of(hi + 1, t0 + KT);
    widen_tile(dm, kp, vp, table, g, t0, t1, hi + 1, kf, vf);
    tile_scores(qt, kf, st, hd, rp);
    if (t1 - t0 < KT || t1 - 1 > lowest || t0 < last_window_start) {
      mask_tile(st, lowest, rows, rep, t0, t1, dm.window, rp);
      online_softmax_tile<true>(st, m, l, alpha, rp);
    } else {
      online_softmax_tile<false>(st, m, l, alpha, rp);
    }
    int r = 0;
    for (; r + 4 <= rows; r += 4) tile_values_rows<4>(st, vf, alpha, o, r, hd, rp);
    for (; r + 2 <= rows; r += 2) tile_values_rows<2>(st, vf, alpha, o, r, hd, rp);
    for (; r < rows; ++r) tile_values_rows<1>(st, vf, alpha, o, r, hd, rp);
  }
  if (part != nullptr) {
    std::memcpy(part, o, sizeof(float) * rows * hd);
    std::memcpy(part + rows * hd, m, sizeof(float) * rows);
    std::memcpy(part + rows * (hd + 1), l, sizeof(float) * rows);
    return;
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : __builtin_nanf("");
    for (int c = 0; c < hd; c += kW) store8(out_row(r) + c, load8(o + r * hd + c) * inv);
  }
}

}  // namespace metrale::METRALE_ISA_NS::kernel
