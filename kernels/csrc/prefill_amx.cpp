// Paged prefill attention on AMX-BF16 tiles (Sapphire Rapids and later): the avx512_amx kernel set's
// PrefillStaged (kernel_table.h), compiled once with AVX-512 + AVX512-BF16 + AMX-BF16 flags in its own
// namespace (METRALE_ISA_NS = avx512_amx_bf16, CMakeLists.txt), so the inline helpers of the headers get a
// private copy. Same contract as prefill_kernel.h (causal, window, GQA, NaN rows for bad block ids); only
// the arithmetic differs. docs/attention.md has the design, the precision and the measurements.
//
// Two phases per chunk (paged_prefill.cpp): stage (prefill_amx_stage.h: K and V^T as bf16 hi / lo tiles,
// once per chunk), then attend: a task is (kv head g, query tile); its rows (query, head of g) in row tiles
// of 16 rows; per key block (outer) and row tile (inner, so the block's tiles stay in L1):
//   S^T (64 keys x 16 rows) = K Q^T     TDPBF16PS, A = K tiles, B = Q^T hi / lo in VNNI pairs:
//                                       Khi Qhi + Khi Qlo + Klo Qhi + Klo Qlo
//   online softmax down the keys (the rows are vector lanes: no horizontal op), causal / window mask
//   P^T -> VNNI B tiles, hi + lo both rounded to bf16 (~2^-18 relative)
//   O^T (d x 16 rows) = O^T alpha + Vhi^T Phi + Vhi^T Plo + Vlo^T Phi
//   out = O / l. Every product accumulates in float32 inside the tile unit.
// No allocation and no exception here: the staged tiles and each task's scratch come from run_prefill.
// Tile state is per thread: each task loads the configuration and releases the tiles before it returns.
#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernel_table.h"
#include "prefill_amx_stage.h"

#ifndef METRALE_ISA_NS
#error "compile with -DMETRALE_ISA_NS=avx512_amx_bf16"
#endif

namespace metrale::METRALE_ISA_NS::amx_prefill {

namespace {

constexpr int kRowsPerTask = 128;  // rows (queries x rep) a task aims at: its K/V tile loads feed 8 row tiles

int query_tile(const PrefillDims& dm) {
  const int rep = dm.n_heads / dm.n_kv;
  return kernel::max_of(1, kRowsPerTask / rep);
}

struct Scratch {  // one task's scratch, carved from 64-byte aligned floats
  uint16_t* qt;   // (row tiles, dk / 32, 2 copies) Q^T B tiles
  float* o;       // (row tiles, dv, 16) O^T
  float* m;       // (row tiles, 16) running max
  float* l;       // (row tiles, 16) running sum
  float* st;      // (64, 16) S^T of one row tile and block
  uint16_t* pt;   // (2 halves, 2 copies) P^T B tiles
};

int64_t scratch_floats_for(const PrefillDims& dm, int row_tiles) {
  const Layout L = layout(dm, Dtype::float32);
  return row_tiles * (int64_t{L.dk / 32} * kTile + L.dv * kRows + 2 * kRows) + kKeys * kRows + 2 * kTile + 16;
}

Scratch carve(float* base, int row_tiles, const Layout& L) {
  float* p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(base) + 63) & ~uintptr_t{63});
  Scratch s;
  s.qt = reinterpret_cast<uint16_t*>(p);
  p += int64_t{row_tiles} * (L.dk / 32) * kTile;  // 2 copies of 512 bf16 = 512 floats per chunk
  s.o = p;
  p += int64_t{row_tiles} * L.dv * kRows;
  s.m = p;
  p += row_tiles * kRows;
  s.l = p;
  p += row_tiles * kRows;
  s.st = p;
  p += kKeys * kRows;
  s.pt = reinterpret_cast<uint16_t*>(p);
  return s;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {  // every tile 16 rows x 64 bytes
  TileConfig c;
  for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  return c;
}

// S^T (64 keys x 16 rows) of one block and row tile, left in tiles 0-3 (the key groups' C; store_scores
// writes them out); 4 / 5 K hi / lo (A), 6 / 7 Q^T hi / lo (B). With float16 / float32 pools all four
// products (Klo Qlo too: without it the tolerance tests failed by 1.5x). GCC's tile intrinsics take literal
// tile numbers, hence the macro.
template <bool LO>
inline void scores(const uint16_t* blk, const Layout& L, const uint16_t* qt) noexcept {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int c = 0; c < L.dk / 32; ++c) {
    _tile_loadd(6, qt + (2 * c) * kTile, 64);
    _tile_loadd(7, qt + (2 * c + 1) * kTile, 64);
#define METRALE_KEY_GROUP(n)                                          \
  _tile_loadd(4, blk + L.k_tile(0, n, c), 64);                        \
  if constexpr (LO) _tile_loadd(5, blk + L.k_tile(1, n, c), 64);      \
  _tile_dpbf16ps(n, 4, 6);                                            \
  _tile_dpbf16ps(n, 4, 7);                                            \
  if constexpr (LO) _tile_dpbf16ps(n, 5, 6);                          \
  if constexpr (LO) _tile_dpbf16ps(n, 5, 7);
    METRALE_KEY_GROUP(0)
    METRALE_KEY_GROUP(1)
    METRALE_KEY_GROUP(2)
    METRALE_KEY_GROUP(3)
#undef METRALE_KEY_GROUP
  }
}

inline void store_scores(float* st) noexcept {
  _tile_stored(0, st, 64);
  _tile_stored(1, st + 16 * kRows, 64);
  _tile_stored(2, st + 32 * kRows, 64);
  _tile_stored(3, st + 48 * kRows, 64);
}

// O^T (dv x 16 rows) += V^T P^T for one block: tiles 4-7 P^T hi / lo of key halves 0 and 1 (B), 0 the C of
// one 16-d chunk of O^T (loaded and stored per chunk), 1 / 2 V^T hi / lo of half 0, 3 / 2 of half 1 (A).
template <bool LO>
inline void values(const uint16_t* blk, const Layout& L, const uint16_t* pt, float* o) noexcept {
  _tile_loadd(4, pt, 64);
  _tile_loadd(5, pt + kTile, 64);
  _tile_loadd(6, pt + 2 * kTile, 64);
  _tile_loadd(7, pt + 3 * kTile, 64);
  for (int dc = 0; dc < L.dv / 16; ++dc) {
    float* od = o + dc * 16 * kRows;
    _tile_loadd(0, od, 64);
    _tile_loadd(1, blk + L.v_tile(0, dc, 0), 64);
    _tile_loadd(3, blk + L.v_tile(0, dc, 1), 64);
    if constexpr (LO) _tile_loadd(2, blk + L.v_tile(1, dc, 0), 64);
    _tile_dpbf16ps(0, 1, 4);
    _tile_dpbf16ps(0, 1, 5);
    if constexpr (LO) _tile_dpbf16ps(0, 2, 4);
    if constexpr (LO) _tile_loadd(2, blk + L.v_tile(1, dc, 1), 64);
    _tile_dpbf16ps(0, 3, 6);
    _tile_dpbf16ps(0, 3, 7);
    if constexpr (LO) _tile_dpbf16ps(0, 2, 6);
    _tile_stored(0, od, 64);
  }
}

// e^x for finite x <= 0 as 2^n 2^f, n = round(x log2 e), f = x log2 e - n in [-1/2, 1/2]: a degree-5 fit of
// 2^f (relative error 1.1e-7, a least-squares fit on Chebyshev nodes) and vscalefps for 2^n (0 far below).
// Lanes off `keep` are 0 (masked keys). ~10 instructions against vecmath's ~18.
inline __m512 exp16(__mmask16 keep, __m512 x) noexcept {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504088896341f), n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0013218676904216409f), f, _mm512_set1_ps(0.009671707637608051f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550893023610115f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022237956523895f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931468844413757f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// Online softmax of one block's S^T (64 keys x 16 row lanes, keys t0 ..): with MASK, keys a row cannot see
// (past its position pos, at or before pos - window) are dropped; st becomes the P^T B tiles in pt (key
// pairs i, i + 16 of each half in VNNI dwords; x = hi + lo, both rounded to bf16, ties away from 0: ~2^-18 relative), m and l are updated; returns
// alpha = e^(m - m') (0 for rows that saw no key before).
template <bool MASK>
inline __m512 softmax_block(const float* st, uint16_t* pt, float* m, float* l, __m512i pos, int t0, int window) noexcept {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const __m512i lower = _mm512_sub_epi32(pos, _mm512_set1_epi32(window));
  auto seen = [&](int j) -> __mmask16 {  // the lanes whose row sees key t0 + j
    if constexpr (!MASK) return 0xFFFF;
    const __m512i t = _mm512_set1_epi32(t0 + j);
    __mmask16 out = _mm512_cmpgt_epi32_mask(t, pos);
    if (window > 0) out |= _mm512_cmple_epi32_mask(t, lower);
    return static_cast<__mmask16>(~out);
  };
  __m512 mt[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
  for (int j = 0; j < kKeys; ++j) mt[j & 3] = _mm512_mask_max_ps(mt[j & 3], seen(j), mt[j & 3], _mm512_load_ps(st + j * kRows));
  const __m512 m_old = _mm512_load_ps(m);
  const __m512 m_new = _mm512_max_ps(_mm512_max_ps(_mm512_max_ps(mt[0], mt[1]), _mm512_max_ps(mt[2], mt[3])), m_old);
  const __mmask16 some = _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_UQ);  // rows that have seen a key
  const __m512 m_sub = _mm512_maskz_mov_ps(some, m_new);
  const __mmask16 before = _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_UQ);
  const __m512 alpha = exp16(before, _mm512_sub_ps(_mm512_maskz_mov_ps(before, m_old), m_sub));
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), half = _mm512_set1_epi32(0x8000);
  // dword (upper half of a's bits, upper half of b's): vpternlog picks b's upper and (a >> 16)'s lower half
  auto pair = [&](__m512i a, __m512i b) { return _mm512_ternarylogic_epi32(hi_mask, b, _mm512_srli_epi32(a, 16), 0xCA); };
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 16; ++i) {  // B row i of half h: keys 32h + i and 32h + i + 16
      __m512i hi[2], lo[2];
      for (int u = 0; u < 2; ++u) {
        const int j = 32 * h + i + 16 * u;
        const __m512 e = exp16(seen(j), _mm512_sub_ps(_mm512_load_ps(st + j * kRows), m_sub));
        sum[u] = _mm512_add_ps(sum[u], e);
        hi[u] = _mm512_add_epi32(_mm512_castps_si512(e), half);  // rounded to nearest (ties away) in the upper half
        lo[u] = _mm512_add_epi32(_mm512_castps_si512(_mm512_sub_ps(e, _mm512_castsi512_ps(_mm512_and_si512(hi[u], hi_mask)))), half);
      }
      uint16_t* row = pt + h * 2 * kTile + i * 32;
      _mm512_store_si512(row, pair(hi[0], hi[1]));
      _mm512_store_si512(row + kTile, pair(lo[0], lo[1]));
    }
  _mm512_store_ps(m, m_new);
  _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), alpha, _mm512_add_ps(sum[0], sum[1])));
  return alpha;
}

// Q^T of the task's rows, scaled, as B tiles: per row tile and 32-d chunk c, hi then lo; row i of a tile
// holds d = 32c + 2i, 32c + 2i + 1 of the 16 rows, one dword per row. Pad rows are zeros.
template <typename RowOf>
void stage_queries(const PrefillDims& dm, const Layout& L, int rows, int row_tiles, RowOf row_of, uint16_t* qt) noexcept {
  std::memset(qt, 0, sizeof(uint16_t) * row_tiles * (L.dk / 32) * 2 * kTile);
  alignas(64) float qs[kernel::kMaxHeadDim];
  alignas(64) uint16_t qh[kernel::kMaxHeadDim], ql[kernel::kMaxHeadDim];
  for (int r = 0; r < rows; ++r) {
    const float* src = row_of(r);
    for (int d = 0; d < L.dk; ++d) qs[d] = d < dm.head_dim ? src[d] * dm.scale : 0.0f;
    split_row(qs, L.dk, qh, ql);
    uint16_t* tiles = qt + static_cast<int64_t>(r / kRows) * (L.dk / 32) * 2 * kTile;
    const int n = r % kRows;
    for (int c = 0; c < L.dk / 32; ++c)
      for (int i = 0; i < 16; ++i) {
        std::memcpy(tiles + 2 * c * kTile + i * 32 + 2 * n, qh + 32 * c + 2 * i, 4);
        std::memcpy(tiles + (2 * c + 1) * kTile + i * 32 + 2 * n, ql + 32 * c + 2 * i, 4);
      }
  }
}

template <bool LO>
void attend(const PrefillDims& dm, const Layout& L, const float* q, const int32_t* table, const uint16_t* staged,
            float* out, float* scratch, int g, int q_begin, int q_end) noexcept {
  const int hd = dm.head_dim, rep = dm.n_heads / dm.n_kv, rows = (q_end - q_begin) * rep;
  const int row_tiles = (rows + kRows - 1) / kRows;
  const int first = dm.first_position, hi = first + q_end - 1;
  const int lo = dm.window > 0 ? kernel::max_of(0, first + q_begin - dm.window + 1) : 0;
  auto out_row = [&](int r) { return out + (static_cast<int64_t>(q_begin + r / rep) * dm.n_heads + g * rep + r % rep) * hd; };
  if (static_cast<int64_t>(hi) >= static_cast<int64_t>(dm.max_blocks) * dm.block_size) {
    for (int r = 0; r < rows; ++r) kernel::fill(out_row(r), out_row(r) + hd, __builtin_nanf(""));
    return;
  }
  auto bad_block = [&](int b) { return table[b] < 0 || table[b] >= dm.num_blocks; };
  int first_bad = -1;  // the first block id outside the pool among the task's keys
  for (int b = lo / dm.block_size; first_bad < 0 && b <= hi / dm.block_size; ++b)
    if (bad_block(b)) first_bad = b;
  const Scratch s = carve(scratch, row_tiles, L);
  stage_queries(dm, L, rows, row_tiles, [&](int r) {
    return q + (static_cast<int64_t>(q_begin + r / rep) * dm.n_heads + g * rep + r % rep) * hd;
  }, s.qt);
  std::memset(s.o, 0, sizeof(float) * row_tiles * L.dv * kRows);
  for (int i = 0; i < row_tiles * kRows; ++i) s.m[i] = -__builtin_inff(), s.l[i] = 0.0f;
  auto position = [&](int r) { return first + q_begin + kernel::min_of(r, rows - 1) / rep; };  // pad rows: the last
  static const TileConfig config = make_config();
  _tile_loadconfig(&config);
  for (int b = (lo - L.lo_all) / kKeys; b <= (hi - L.lo_all) / kKeys; ++b) {
    const uint16_t* blk = staged + (static_cast<int64_t>(g) * L.blocks + b) * L.block_elems;
    const int t0 = L.lo_all + b * kKeys;
    auto sees = [&](int rt) {  // some row of row tile rt sees a key of the block
      const int p_min = position(rt * kRows), p_max = position(rt * kRows + kRows - 1);
      return t0 <= p_max && !(dm.window > 0 && t0 + kKeys - 1 <= p_min - dm.window);
    };
    for (int rt = 0; rt < row_tiles; ++rt) {
      if (!sees(rt)) continue;
      alignas(64) int32_t pos[kRows];
      for (int n = 0; n < kRows; ++n) pos[n] = position(rt * kRows + n);
      const int p_min = pos[0], p_max = pos[kRows - 1];
      const bool mask = t0 + kKeys - 1 > p_min || (dm.window > 0 && t0 <= p_max - dm.window);
      scores<LO>(blk, L, s.qt + static_cast<int64_t>(rt) * (L.dk / 32) * 2 * kTile);
      store_scores(s.st);
      const __m512 alpha = (mask ? softmax_block<true> : softmax_block<false>)(
          s.st, s.pt, s.m + rt * kRows, s.l + rt * kRows, _mm512_load_si512(pos), t0, dm.window);
      float* o = s.o + static_cast<int64_t>(rt) * L.dv * kRows;
      if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
        for (int d = 0; d < L.dv; ++d) _mm512_store_ps(o + d * kRows, _mm512_mul_ps(_mm512_load_ps(o + d * kRows), alpha));
      values<LO>(blk, L, s.pt, o);
    }
  }
  _tile_release();
  // A row that sees a key of a bad block id is NaN (its staged keys are zeros); the others are exact.
  auto row_sees_bad = [&](int r) {
    const int p = position(r), from = dm.window > 0 ? kernel::max_of(0, p - dm.window + 1) : 0;
    if (p < first_bad * dm.block_size) return false;
    for (int b = kernel::max_of(first_bad, from / dm.block_size); b <= p / dm.block_size; ++b)
      if (bad_block(b)) return true;
    return false;
  };
  for (int r = 0; r < rows; ++r) {
    const float lr = s.l[r];
    const float inv = lr > 0.0f && (first_bad < 0 || !row_sees_bad(r)) ? 1.0f / lr : __builtin_nanf("");
    const float* o = s.o + static_cast<int64_t>(r / kRows) * L.dv * kRows + r % kRows;
    float* dst = out_row(r);
    for (int d = 0; d < hd; ++d) dst[d] = o[d * kRows] * inv;
  }
}

void task(const PrefillDims& dm, Dtype dtype, const float* q, const int32_t* table, const void* staged, float* out,
          float* scratch, int g, int q_begin, int q_end) {
  const Layout L = layout(dm, dtype);
  (L.copies == 2 ? attend<true> : attend<false>)(dm, L, q, table, static_cast<const uint16_t*>(staged), out, scratch,
                                                  g, q_begin, q_end);
}

int64_t scratch_floats(const PrefillDims& dm) {
  const int rows = kernel::min_of(query_tile(dm), dm.q_len) * (dm.n_heads / dm.n_kv);
  return scratch_floats_for(dm, (rows + kRows - 1) / kRows);
}

// AMX-BF16 (CPUID 7.0 EDX bit 22) and AVX512-BF16 (CPUID 7.1 EAX bit 5), besides what avx512_amx needs.
bool runs_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22))) return false;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}

const PrefillStaged kStaged{staged_bytes, query_tile, scratch_floats, key_blocks, stage, task};

}  // namespace

}  // namespace metrale::METRALE_ISA_NS::amx_prefill

namespace metrale {

// avx512_amx with the prefill attention above where the CPU has AMX-BF16 and AVX512-BF16 (every AMX CPU so
// far); else avx512_amx as qmm_amx.cpp builds it.
const KernelTable* kernel_table_avx512_amx_attention() {
  static const KernelTable table = [] {
    KernelTable t = *kernel_table_avx512_amx();
    if (metrale::METRALE_ISA_NS::amx_prefill::runs_bf16()) t.prefill_staged = &metrale::METRALE_ISA_NS::amx_prefill::kStaged;
    return t;
  }();
  return &table;
}

}  // namespace metrale
