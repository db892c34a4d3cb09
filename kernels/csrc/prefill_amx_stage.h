// The staging half of the AMX-BF16 prefill attention (prefill_amx.cpp, which alone includes this, inside
// namespace METRALE_ISA_NS = avx512_amx_bf16): the geometry of a chunk's staged K/V tiles and the conversion
// of pool rows into them, once per chunk. Every key block of 64 keys of every kv head, keys lo_all ..
// first + q_len - 1 (lo_all: the window's start for the chunk's first query), becomes bf16 tiles: K as A
// tiles (16 keys x 32 d) and V^T as A tiles (16 d x 32 keys, keys i and i + 16 paired in a VNNI dword),
// each value split x = hi + lo (exact for float16 and bfloat16 pools, ~2^-17 relative for float32; bfloat16
// pools have no lo; q8 pools are not staged: staged_bytes). Keys past the chunk or behind a bad block id
// are zeros.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel_table.h"
#include "prefill_kernel.h"

namespace metrale::METRALE_ISA_NS::amx_prefill {

using kernel::bf16_t;
using kernel::f16_t;
constexpr int kKeys = 64;     // keys per staged block (4 S^T tiles, 2 P^T tiles)
constexpr int kRows = 16;     // rows per row tile (one C tile's columns)
constexpr int kTile = 512;    // bf16 values per tile (16 rows x 64 bytes)
constexpr int kMinQueries = 16;   // shorter chunks: the avx512 kernel (staged_bytes)
constexpr int64_t kMaxStagedBytes = int64_t{1} << 30;  // beyond: the avx512 kernel (no staging)

// The geometry of one chunk's staged tiles.
struct Layout {
  int dk, dv;      // head_dim rounded up to 32 (K tiles' width) and to 16 (V^T tiles' height)
  int copies;      // 2: hi and lo; 1: hi only (bfloat16 pools)
  int lo_all;      // the first staged key
  int blocks;      // key blocks per kv head
  int64_t block_elems;  // bf16 values per (kv head, block)
  int k_tile(int copy, int kg, int c) const { return ((copy * 4 + kg) * (dk / 32) + c) * kTile; }
  int v_tile(int copy, int dc, int h) const { return copies * 4 * (dk / 32) * kTile + ((copy * (dv / 16) + dc) * 2 + h) * kTile; }
};

inline Layout layout(const PrefillDims& dm, Dtype dtype) {
  Layout L;
  L.dk = (dm.head_dim + 31) / 32 * 32;
  L.dv = (dm.head_dim + 15) / 16 * 16;
  L.copies = dtype == Dtype::bfloat16 ? 1 : 2;
  L.lo_all = dm.window > 0 ? kernel::max_of(0, dm.first_position - dm.window + 1) : 0;
  L.blocks = (dm.first_position + dm.q_len - L.lo_all + kKeys - 1) / kKeys;
  L.block_elems = static_cast<int64_t>(L.copies) * (4 * (L.dk / 32) + 2 * (L.dv / 16)) * kTile;
  return L;
}

// x = hi + lo, both bf16 rounded to nearest even (hi's error is lo, exactly; lo's is ~2^-9 of lo).
inline void split16(__m512 x, __m256i& hi, __m256i& lo) noexcept {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  hi = reinterpret_cast<const __m256i&>(h);
  const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
  const __m256bh r = _mm512_cvtneps_pbh(_mm512_sub_ps(x, hf));
  lo = reinterpret_cast<const __m256i&>(r);
}

// A row of n floats (n a multiple of 16) as hi / lo bf16.
inline void split_row(const float* x, int n, uint16_t* hi, uint16_t* lo) noexcept {
  for (int i = 0; i < n; i += 16) {
    __m256i h, l;
    split16(_mm512_loadu_ps(x + i), h, l);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), l);
  }
}

// r (16 x 16 dwords) transposed in place: unpacks within 128-bit lanes, then lane shuffles (64 instructions).
inline void transpose16(__m512i* r) noexcept {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + e], lane L: rows 4k .. 4k + 3 of column 4L + e
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[4 + e] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// Columns 16 i .. 16 i + 15 of a pool row of hd values as floats (0 past hd, or everywhere when !valid).
template <typename T>
inline __m512 load16(const T* row, int i, int hd, bool valid) noexcept {
  const int n = valid ? kernel::min_of(16, kernel::max_of(0, hd - 16 * i)) : 0;
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(k, row + 16 * i);
  } else {
    const __m256i bits = _mm256_maskz_loadu_epi16(k, row + 16 * i);
    if constexpr (std::is_same_v<T, f16_t>) return _mm512_cvtph_ps(bits);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// Key blocks [b_begin, b_end) of kv head g into their staged tiles.
template <typename T>
void stage_blocks(const PrefillDims& dm, const T* kp, const T* vp, const int32_t* table, uint16_t* staged, int g,
                  int b_begin, int b_end) noexcept {
  const Layout L = layout(dm, std::is_same_v<T, bf16_t> ? Dtype::bfloat16 : Dtype::float32);
  const int hd = dm.head_dim, bs = dm.block_size, end = dm.first_position + dm.q_len;
  alignas(64) uint16_t vh[32][kernel::kMaxHeadDim], vl[32][kernel::kMaxHeadDim];  // one half's V rows
  for (int b = b_begin; b < b_end; ++b) {
    uint16_t* blk = staged + (static_cast<int64_t>(g) * L.blocks + b) * L.block_elems;
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 32; ++j) {
        const int key = h * 32 + j, t = L.lo_all + b * kKeys + key;
        const int32_t id = t < end ? table[t / bs] : -1;
        const bool valid = id >= 0 && id < dm.num_blocks;
        const int64_t row = valid ? kv_row_offset(id, g, t % bs, dm.n_kv, bs, dm.kv_row) : 0;
        for (int i = 0; i < L.dk / 16; ++i) {  // K: A tile row key % 16 of tile (key / 16, chunk i / 2)
          __m256i h, l;
          split16(load16(kp + row, i, hd, valid), h, l);
          uint16_t* dst = blk + L.k_tile(0, key / 16, i / 2) + (key % 16) * 32 + (i % 2) * 16;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
          if (L.copies == 2) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + L.k_tile(1, 0, 0)), l);
        }
        for (int i = 0; i < L.dv / 16; ++i) {  // V: rows of the half, transposed below
          __m256i h, l;
          split16(load16(vp + row, i, hd, valid), h, l);
          _mm256_store_si256(reinterpret_cast<__m256i*>(vh[j] + 16 * i), h);
          _mm256_store_si256(reinterpret_cast<__m256i*>(vl[j] + 16 * i), l);
        }
      }
      for (int copy = 0; copy < L.copies; ++copy)
        for (int dc = 0; dc < L.dv / 16; ++dc) {  // V^T A tile: 16 d rows x 32 keys, keys i and i + 16 paired
          const uint16_t(*v)[kernel::kMaxHeadDim] = copy ? vl : vh;
          __m512i col[16];  // col[i] dword dd: (v[i][d], v[i + 16][d]), d = 16 dc + dd
          for (int i = 0; i < 16; ++i) {
            const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[i] + dc * 16)));
            const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[i + 16] + dc * 16)));
            col[i] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
          }
          transpose16(col);
          uint16_t* tile = blk + L.v_tile(copy, dc, h);
          for (int dd = 0; dd < 16; ++dd) _mm512_store_si512(tile + dd * 32, col[dd]);
        }
    }
  }
}

inline void stage(const PrefillDims& dm, Dtype dtype, const void* kp, const void* vp, const int32_t* table, void* staged,
           int g, int b_begin, int b_end) {
  auto* s = static_cast<uint16_t*>(staged);
  if (dtype == Dtype::float32)
    stage_blocks(dm, static_cast<const float*>(kp), static_cast<const float*>(vp), table, s, g, b_begin, b_end);
  else if (dtype == Dtype::float16)
    stage_blocks(dm, static_cast<const f16_t*>(kp), static_cast<const f16_t*>(vp), table, s, g, b_begin, b_end);
  else  // bfloat16 (q8 pools are not staged: staged_bytes)
    stage_blocks(dm, static_cast<const bf16_t*>(kp), static_cast<const bf16_t*>(vp), table, s, g, b_begin, b_end);
}

inline int64_t staged_bytes(const PrefillDims& dm, Dtype dtype) {
  // Staging writes 4 bf16 per K/V value whatever the chunk: below kMinQueries the avx512 kernel is faster
  // (1B shape, context 4k, one core: 1 query 2.9 ms against 1.8; 16 queries 4.2 against 5.0)
  if (dm.q_len < kMinQueries) return 0;
  // q8 pools: int8 x float16 scale needs 19 bits, two bf16 keep ~17: with an outlier channel (as real keys
  // have) the scores' error broke test_kv_int8's bound (rtol 2e-5) by up to 17x; the avx512 kernel stays
  if (dtype == Dtype::q8) return 0;
  // float32 pools: the caller asked for 32-bit keys and values; hi + lo keeps 16 of their 24 bits and the
  // logits moved 10-20x further from float64 than with the avx512 kernel (tests/metrale/models/
  // test_architectures.py, gemma3: 4e-4 against 3e-5 at logits of ~18). The 16-bit pools (float16, the CPU
  // default, and bfloat16) split into hi + lo exactly, so only the queries' and probabilities' 16 bits remain,
  // ~16x under the pool's own float16 rounding.
  if (dtype == Dtype::float32) return 0;
  const Layout L = layout(dm, dtype);
  const int64_t bytes = 2 * L.block_elems * L.blocks * dm.n_kv;
  return bytes <= kMaxStagedBytes ? bytes : 0;
}

inline int key_blocks(const PrefillDims& dm) { return layout(dm, Dtype::float32).blocks; }

}  // namespace metrale::METRALE_ISA_NS::amx_prefill
