// The CPU compute of paged prefill attention, free of MLX graph code (paged_prefill.cpp wraps it).
//
// One task per (kv head g, tile of up to kPrefillQueries queries of the chunk); its R = tile * rep rows
// (query i, head g * rep + r) share every key they read (GQA). The keys the tile can see,
//   lo = window ? max(0, first + q_begin - window + 1) : 0  ..  hi = first + q_end - 1,
// are walked in tiles of KT = kPrefillKeys, read through the block table straight from the pools and
// widened to float32 once per tile (K transposed, so scores vectorize over keys):
//   S (R, KT) = Q K^T (Q pre-scaled); per row, keys outside [p - window + 1, p] masked (p = position)
//   online softmax: m' = max(m, max S), O = O e^(m - m') + e^(S - m') V, l = l e^(m - m') + sum e^(S - m')
//   out = O / l    (a row that sees no key is NaN, as a fully masked softmax)
// No (q_len, context) score matrix exists: memory stays O(R * KT) per task, whatever the context.
// Compiled per instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp), like attention_kernel.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernel_table.h"
#include "vecmath.h"

namespace metrale::METRALE_ISA_NS::kernel {

using metrale::PrefillDims;
constexpr int KT = metrale::kPrefillKeys;

// The tile products run on the widest float vectors the set has (16 lanes with AVX-512, else the 8 of
// v8f): their operands are float32 tiles in L1, so no dtype conversion happens in these loops.
#if defined(__AVX512F__)
constexpr int kVW = 16;
#else
constexpr int kVW = 8;
#endif
typedef float vwf __attribute__((vector_size(kVW * 4)));
constexpr int kScoreVecs = kVW == 16 ? 4 : 2;  // key vectors per row in the score block: 64 or 16 keys

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

// Keys [t0, t1) of kv head g widened: kt (hd, KT) transposed, vf (KT, hd); columns / rows past t1 are 0.
template <typename T>
inline void widen_tile(const PrefillDims& dm, const T* kp, const T* vp, const int32_t* table, int g, int t0,
                       int t1, float* kt, float* vf) noexcept {
  const int hd = dm.head_dim, bs = dm.block_size;
  const int64_t stride = static_cast<int64_t>(dm.n_kv) * hd;
  for (int t = t0; t < t1; ++t) {
    const int j = t - t0;
    const int64_t row = (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * stride + static_cast<int64_t>(g) * hd;
    for (int c = 0; c < hd; c += kW) {
      const v8f k = load8(kp + row + c);
      for (int e = 0; e < kW; ++e) kt[(c + e) * KT + j] = k[e];
      store8(vf + j * hd + c, load8(vp + row + c));
    }
  }
  for (int j = t1 - t0; j < KT; ++j) {
    for (int d = 0; d < hd; ++d) kt[d * KT + j] = 0.0f;
    for (int d = 0; d < hd; ++d) vf[j * hd + d] = 0.0f;
  }
}

// s[r, :] = qs[r, :] . kt for rows [r0, r0 + RB): RB rows x kScoreVecs vectors of keys in registers.
template <int RB>
inline void tile_scores(const float* qs, const float* kt, float* s, int r0, int hd) noexcept {
  constexpr int NV = kScoreVecs;
  for (int jb = 0; jb < KT; jb += NV * kVW) {
    vwf a[RB][NV] = {};
    for (int d = 0; d < hd; ++d) {
      vwf k[NV];
      for (int nv = 0; nv < NV; ++nv) k[nv] = loadv<vwf>(kt + d * KT + jb + nv * kVW);
      for (int rr = 0; rr < RB; ++rr) {
        const float x = qs[(r0 + rr) * hd + d];
        for (int nv = 0; nv < NV; ++nv) a[rr][nv] += x * k[nv];
      }
    }
    for (int rr = 0; rr < RB; ++rr)
      for (int nv = 0; nv < NV; ++nv) storev(s + (r0 + rr) * KT + jb + nv * kVW, a[rr][nv]);
  }
}

// o[r, c .. c + CB lanes of V) += p[r, :] V[:, c ..] for rows [r0, r0 + RB), V a float vector type.
template <typename V, int RB, int CB>
inline void tile_values(const float* p, const float* vf, float* o, int r0, int c, int hd) noexcept {
  constexpr int L = sizeof(V) / sizeof(float);
  V a[RB][CB];
  for (int rr = 0; rr < RB; ++rr)
    for (int cb = 0; cb < CB; ++cb) a[rr][cb] = loadv<V>(o + (r0 + rr) * hd + c + cb * L);
  for (int j = 0; j < KT; ++j) {
    V v[CB];
    for (int cb = 0; cb < CB; ++cb) v[cb] = loadv<V>(vf + j * hd + c + cb * L);
    for (int rr = 0; rr < RB; ++rr) {
      const float x = p[(r0 + rr) * KT + j];
      for (int cb = 0; cb < CB; ++cb) a[rr][cb] += x * v[cb];
    }
  }
  for (int rr = 0; rr < RB; ++rr)
    for (int cb = 0; cb < CB; ++cb) storev(o + (r0 + rr) * hd + c + cb * L, a[rr][cb]);
}

// All of o's columns for rows [r0, r0 + RB): 4 (AVX-512) or 2 wide vectors at a time, then 8 lanes.
template <int RB>
inline void tile_values_rows(const float* p, const float* vf, float* o, int r0, int hd) noexcept {
  constexpr int CB = kVW == 16 ? 4 : 2;
  int c = 0;
  for (; c + CB * kVW <= hd; c += CB * kVW) tile_values<vwf, RB, CB>(p, vf, o, r0, c, hd);
  for (; c + kVW <= hd; c += kVW) tile_values<vwf, RB, 1>(p, vf, o, r0, c, hd);
  for (; c < hd; c += kW) tile_values<v8f, RB, 1>(p, vf, o, r0, c, hd);
}

// Row r's scores of keys [t0, t0 + KT) become e^(s - m') (0 where masked), and m, l, o are rescaled.
inline void online_softmax_row(float* sr, float* o_row, float& m, float& l, int jlo, int jhi, int hd) noexcept {
  if (jhi < jlo) {  // no visible key in this tile
    fill(sr, sr + KT, 0.0f);
    return;
  }
  float mt = sr[jlo];
  for (int j = jlo + 1; j <= jhi; ++j) mt = max_of(mt, sr[j]);
  const float m_new = max_of(m, mt);
  const float alpha = __builtin_expf(m - m_new);  // m = -inf at first: alpha 0, o and l are 0
  v8f sum8 = {};
  int j = jlo;
  for (; j + kW <= jhi + 1; j += kW) {
    const v8f e = exp8(load8(sr + j) - m_new);
    store8(sr + j, e);
    sum8 += e;
  }
  float sum = hsum(sum8);
  for (; j <= jhi; ++j) sum += (sr[j] = __builtin_expf(sr[j] - m_new));
  fill(sr, sr + jlo, 0.0f);
  fill(sr + jhi + 1, sr + KT, 0.0f);
  if (alpha != 1.0f)
    for (int c = 0; c < hd; c += kW) store8(o_row + c, load8(o_row + c) * alpha);
  l = l * alpha + sum;
  m = m_new;
}

template <typename T>
void prefill_task(const PrefillDims& dm, const float* q, const T* kp, const T* vp, const int32_t* table, float* out,
                  float* scratch, int g, int q_begin, int q_end) noexcept {
  const int hd = dm.head_dim, rep = dm.n_heads / dm.n_kv, rows = (q_end - q_begin) * rep;
  const int first = dm.first_position, hi = first + q_end - 1;
  const int lo = dm.window > 0 ? max_of(0, first + q_begin - dm.window + 1) : 0;
  auto out_row = [&](int r) { return out + (static_cast<int64_t>(q_begin + r / rep) * dm.n_heads + g * rep + r % rep) * hd; };
  bool valid = static_cast<int64_t>(hi) < static_cast<int64_t>(dm.max_blocks) * dm.block_size;
  for (int b = lo / dm.block_size; valid && b <= hi / dm.block_size; ++b)
    valid = table[b] >= 0 && table[b] < dm.num_blocks;
  if (!valid) {
    for (int r = 0; r < rows; ++r) fill(out_row(r), out_row(r) + hd, __builtin_nanf(""));
    return;
  }
  float* qs = scratch;                 // (rows, hd) scaled queries
  float* o = qs + rows * hd;           // (rows, hd) unnormalized outputs
  float* kt = o + rows * hd;           // (hd, KT) keys, transposed
  float* vf = kt + hd * KT;            // (KT, hd) values
  float* s = vf + KT * hd;             // (rows, KT) scores, then probabilities
  float* m = s + rows * KT;            // (rows,) running max
  float* l = m + rows;                 // (rows,) running sum
  for (int r = 0; r < rows; ++r) {
    const float* src = q + (static_cast<int64_t>(q_begin + r / rep) * dm.n_heads + g * rep + r % rep) * hd;
    for (int c = 0; c < hd; c += kW) store8(qs + r * hd + c, load8(src + c) * dm.scale);
    fill(o + r * hd, o + (r + 1) * hd, 0.0f);
    m[r] = -__builtin_inff();
    l[r] = 0.0f;
  }
  for (int t0 = lo; t0 <= hi; t0 += KT) {
    const int t1 = min_of(hi + 1, t0 + KT);
    widen_tile(dm, kp, vp, table, g, t0, t1, kt, vf);
    int r = 0;
    for (; r + 4 <= rows; r += 4) tile_scores<4>(qs, kt, s, r, hd);
    for (; r < rows; ++r) tile_scores<1>(qs, kt, s, r, hd);
    for (r = 0; r < rows; ++r) {
      const int p = first + q_begin + r / rep;  // the row's position: it sees keys (p - window, p]
      const int key_lo = dm.window > 0 ? max_of(t0, p - dm.window + 1) : t0;
      online_softmax_row(s + r * KT, o + r * hd, m[r], l[r], key_lo - t0, min_of(t1 - 1, p) - t0, hd);
    }
    for (r = 0; r + 4 <= rows; r += 4) tile_values_rows<4>(s, vf, o, r, hd);
    for (; r < rows; ++r) tile_values_rows<1>(s, vf, o, r, hd);
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : __builtin_nanf("");
    for (int c = 0; c < hd; c += kW) store8(out_row(r) + c, load8(o + r * hd + c) * inv);
  }
}

}  // namespace metrale::METRALE_ISA_NS::kernel
