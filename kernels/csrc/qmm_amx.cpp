// The quantized matmul's panels on AMX int8 tiles (Sapphire Rapids and later): the avx512 kernel set
// with qmm_panels replaced, compiled once with AVX-512 + AMX flags (CMakeLists.txt: the avx512_amx set,
// METRALE_ISA_NS = avx512_amx, so every inline function of qmm_kernel.h gets its own copy here).
//
// One TDPBSUD multiplies a tile A (16 tokens x 32 int8 activations, read in place from xq, at its row
// stride: act_row_bytes) by a tile B (8 rows x 64 bytes: 32 k of 16 weight rows, 4 consecutive k per row
// in a 32-bit lane) into C (16 tokens x 16 rows, int32). B is exactly the packed panel layout
// (kernel_table.h): 8-bit panels are loaded in place, 4-bit panels are unpacked per chunk of 8 blocks
// (low nibbles -> chunk 2c, high -> 2c + 1) into a stack buffer that every token tile of the pass reuses.
// Panels go in groups of up to 4 (two gate/up pairs with glu) so that each A tile load feeds 4 products;
// int16 activations (and int12 with 8-bit weights) add the lo plane as a second product.
// int12 with 4-bit weights is ONE full-width product per block: A = 16 tokens x 64 bytes, the block's
// [hi 32 | lo 32] as stored (act_at), B = 16 rows x 64 bytes, [16 q (k 0..31) ; q (k 0..31)], unpacked so:
// sum_k 16 q hi + q lo = sum_k q X exactly (16 q <= 240 fits the unsigned B bytes), so one product, one
// tile store and one convert per block instead of two, two and a combine; its chunks are 4 blocks (B is
// 1 KiB per block: 16 KiB per group of 4 panels, as the others' 8). Per block of 32 k the int32 tiles are
// stored and folded into float accumulators exactly as the avx512 tile does it (same block sums, same fma
// order): the results are bit-identical to the avx512 set's. Tokens past the last full tile of 16 run the avx512 tile.
//
// Measured on the dev VM's core: the tile work and the AVX-512 fold do not overlap (the kernel takes the
// sum of the two times), so both are cut here: A shared by a group, 4-bit B unpacked once per pass and
// chunk, the int16 sum 255 hi + lo converted as one exact fma (docs/quantized-kernels.md, the AMX section).
//
// No allocation: every buffer is on the stack (~70 KiB), so nothing can throw inside a pool task.
// Tile state is per thread: every qmm_panels call loads the configuration and releases the tiles
// before it returns. The process must have been granted the AMX state (isa.cpp asks the kernel once).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernel_table.h"
#include "qmm_kernel.h"

#ifndef METRALE_ISA_NS
#error "compile with -DMETRALE_ISA_NS=avx512_amx"
#endif

namespace metrale::METRALE_ISA_NS::amx {

namespace {

using qmm::R;
constexpr int kTileTokens = 16;
constexpr int kBlockBytes = kActBlock * R;  // one block of 32 k of a panel, int8: 512 bytes

// How a block's products run: kOne (int8; int12 with 4-bit weights) one product per panel and block,
// else (int16; int12 with 8-bit weights) a hi and a lo product, combined in the fold.
template <int BITS, int ACT>
constexpr bool kOne = ACT == 8 || (ACT == 12 && BITS == 4);
// int12 with 4-bit weights: A and B tiles of K = 64 (the [hi | lo] block against [16 q ; q])
template <int BITS, int ACT>
constexpr bool kFull = ACT == 12 && BITS == 4;
constexpr int kChunkBlocks = 8;  // blocks of 32 k per weight chunk (4-bit: unpacked to 4 x 4 KiB on the stack)
constexpr int kBatch = 1;         // blocks whose products run before their fold (double-buffered; 2: 0.85x, 4: 0.65x)
constexpr int kPassTiles = 8;     // token tiles whose float accumulators a pass keeps (32 KiB on the stack)

// Tiles: 0-3 int32 results, 4-5 activations, 6-7 weights
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// k: the K of one product, 32 (one plane of a block) or 64 (kFull: both planes of a block)
TileConfig make_config(int k) {
  TileConfig c;
  for (int i = 0; i < 4; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  for (int i = 4; i < 6; ++i) c.colsb[i] = static_cast<uint16_t>(k), c.rows[i] = 16;
  for (int i = 6; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = static_cast<uint8_t>(k / 4);
  return c;
}

template <bool F16S>
inline __m512 scales16(const void* base, int64_t index) {
  if constexpr (F16S) {
    const auto* halves = static_cast<const uint16_t*>(base) + index * R;
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(base) + index * R);
  }
}

// blocks [c0, c0 + nb) of 4-bit panel `src` unpacked to int8 (low nibbles -> chunk 2c, high -> 2c + 1):
// 512 bytes per block; FULL: 1024 bytes per block, 16 q (the 512 bytes times 16) then q.
template <bool FULL>
inline void unpack_chunk(const uint8_t* src, int nb, int8_t* __restrict out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m4hi = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int c = 0; c < nb * 4; ++c) {
    const __m512i v = _mm512_loadu_si512(src + c * 64);
    int8_t* o = FULL ? out + (c / 4) * 2 * kBlockBytes + (c % 4) * 128 : out + c * 128;
    _mm512_store_si512(o + (FULL ? kBlockBytes : 0), _mm512_and_si512(v, m4));
    _mm512_store_si512(o + (FULL ? kBlockBytes : 0) + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    if constexpr (FULL) {
      _mm512_store_si512(o, _mm512_and_si512(_mm512_slli_epi16(v, 4), m4hi));  // 16 x low nibble
      _mm512_store_si512(o + 64, _mm512_and_si512(v, m4hi));                   // 16 x high nibble
    }
  }
}

constexpr int kGroup = 4;  // panels whose products share each activation tile (two gate/up pairs with glu)
using Sums = int32_t[kGroup][kTileTokens][R];  // one block's int32 tile per panel of the group

// C tile C = A tile TA x B tile TB (GCC's tile intrinsics paste the tile number into the instruction:
// literals only, hence a macro).
#define METRALE_AMX_DOT(C, TA, TB) \
  do {                             \
    _tile_zero(C);                 \
    _tile_dpbsud(C, TA, TB);       \
  } while (0)

// One block's products for np (1-4) panels: B tiles from b[j] + at, A (tile 4, and 5 for the lo plane)
// loaded once from xh / xl at `astride`. Weights go two at a time through tiles 6 and 7. One product
// (!WIDE: int8, or int12 as K = 64 tiles): results in tiles 0-3, one per panel; two (WIDE): 0-1 hi and
// 2-3 lo of the two panels, stored before the next two.
template <bool WIDE>
inline void block_products(const int8_t* xh, const int8_t* xl, int64_t astride, const int8_t* const* b, int64_t at,
                           int np, Sums& hi, Sums& lo) {
  _tile_loadd(4, xh, astride);
  if constexpr (WIDE) _tile_loadd(5, xl, astride);
  for (int j = 0; j < np; j += 2) {
    const bool two = j + 1 < np;
    _tile_loadd(6, b[j] + at, 64);
    if (two) _tile_loadd(7, b[j + 1] + at, 64);
    if constexpr (WIDE) {
      METRALE_AMX_DOT(0, 4, 6);
      METRALE_AMX_DOT(2, 5, 6);
      if (two) {
        METRALE_AMX_DOT(1, 4, 7);
        METRALE_AMX_DOT(3, 5, 7);
      }
      _tile_stored(0, &hi[j][0][0], 64);
      _tile_stored(2, &lo[j][0][0], 64);
      if (two) {
        _tile_stored(1, &hi[j + 1][0][0], 64);
        _tile_stored(3, &lo[j + 1][0][0], 64);
      }
    } else if (j == 0) {
      METRALE_AMX_DOT(0, 4, 6);
      if (two) METRALE_AMX_DOT(1, 4, 7);
    } else {
      METRALE_AMX_DOT(2, 4, 6);
      if (two) METRALE_AMX_DOT(3, 4, 7);
    }
  }
  if constexpr (!WIDE) {
    _tile_stored(0, &hi[0][0][0], 64);
    if (np > 1) _tile_stored(1, &hi[1][0][0], 64);
    if (np > 2) _tile_stored(2, &hi[2][0][0], 64);
    if (np > 3) _tile_stored(3, &hi[3][0][0], 64);
  }
}

// The float of one block's int32 sums of 16 rows: the sum (kOne), or 255 hi + lo with int16 activations,
// 16 hi + lo with int12 ones (8-bit weights). int16, 4 bits: |255 hi + lo| <= 32 x 15 x 32512 < 2^24, so the
// fma of the exact floats rounds nothing and equals float(qmm::combine(hi, lo)); measured 1.25x faster
// than the integer combine (shift, sub, add), or with vpshufb for the shift, on this core. The others
// combine as integers.
template <int BITS, int ACT>
inline __m512 block_sum(const int32_t* hi, const int32_t* lo) {
  const __m512i h = _mm512_load_si512(hi);
  if constexpr (kOne<BITS, ACT>) {
    return _mm512_cvtepi32_ps(h);
  } else if constexpr (BITS == 4 && ACT == 16) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(255.0f), _mm512_cvtepi32_ps(_mm512_load_si512(lo)));
  } else {
    return _mm512_cvtepi32_ps(qmm::combine<ACT>(h, _mm512_load_si512(lo)));
  }
}

// The panels of a pass: up to kGroup consecutive ones of one output (gate/up pairs with glu).
struct Group {
  int64_t panel[kGroup];
  int np;
};

// acc (16 tokens x 16 rows) of panel `panel` += blocks [blk0, blk0 + n) of the int32 sums, as qmm::tile folds
// them: per block acc = fma(float(sum), scale * d, acc), after a group's last block acc = fma(bias, xsum, acc).
template <int BITS, bool F16S, int ACT>
inline void fold(const QmmWeights& w, const QmmActs& a, int64_t panel, int64_t t, int blk0, int n, int j,
                 const Sums* hi, const Sums* lo, float (*acc)[R]) {
  const int groups = w.K / w.group_size, per_group = w.group_size / kActBlock, blocks = w.K / kActBlock;
  const float* xd = a.xd + t * blocks;
  const float* xs = a.xsum + t * groups;
  __m512 v[kTileTokens];
  for (int r = 0; r < kTileTokens; ++r) v[r] = _mm512_load_ps(acc[r]);
  for (int i = 0; i < n; ++i) {
    const int blk = blk0 + i, g = blk / per_group;
    const __m512 s = scales16<F16S>(w.scales, panel * groups + g);
    for (int r = 0; r < kTileTokens; ++r)
      v[r] = _mm512_fmadd_ps(block_sum<BITS, ACT>(hi[i][j][r], kOne<BITS, ACT> ? nullptr : lo[i][j][r]),
                             _mm512_mul_ps(s, _mm512_set1_ps(xd[r * blocks + blk])), v[r]);
    if ((blk + 1) % per_group == 0) {
      const __m512 m = scales16<F16S>(w.biases, panel * groups + g);
      for (int r = 0; r < kTileTokens; ++r) v[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * groups + g]), v[r]);
    }
  }
  for (int r = 0; r < kTileTokens; ++r) _mm512_store_ps(acc[r], v[r]);
}

// acc[tile][j] = y (16 tokens from t0 + 16 tile, 16 rows of gr.panel[j]) for `tiles` token tiles. Weight
// chunks outermost: each chunk of the group's B is unpacked once and reused by every token tile; the float
// accumulators wait in acc between chunks. Per tile the products of the next kBatch blocks are issued
// before the fold of the current ones (hi / lo double-buffered).
template <int BITS, bool F16S, int ACT>
void pass(const QmmWeights& w, const QmmActs& a, const Group& gr, int64_t t0, int tiles,
          float (*acc)[kGroup][kTileTokens][R]) {
  constexpr bool WIDE = !kOne<BITS, ACT>, FULL = kFull<BITS, ACT>;
  constexpr int b_block = FULL ? 2 * kBlockBytes : kBlockBytes;        // B bytes per block
  constexpr int a_block = act_two_planes(ACT) ? 2 * kActBlock : kActBlock;  // xq bytes per token and block
  const int K = w.K, blocks = K / kActBlock;
  const int64_t astride = act_row_bytes(K, ACT);
  // FULL: 1 KiB of B per block, so half the blocks per chunk: 16 KiB per group, measured 1.13-1.2x over 8 blocks
  constexpr int chunk_blocks = FULL ? kChunkBlocks / 2 : kChunkBlocks;
  alignas(64) int8_t unpacked[BITS == 4 ? kGroup : 1][BITS == 4 ? chunk_blocks * b_block : 64];
  alignas(64) Sums hi[2][kBatch], lo[WIDE ? 2 : 1][WIDE ? kBatch : 1];
  std::memset(acc, 0, sizeof(float) * tiles * kGroup * kTileTokens * R);
  for (int c0 = 0; c0 < blocks; c0 += chunk_blocks) {
    const int nb = kernel::min_of(chunk_blocks, blocks - c0);
    const int8_t* b[kGroup] = {};  // the chunk's int8 B of each panel
    for (int j = 0; j < gr.np; ++j) {
      const uint8_t* src = w.q + gr.panel[j] * qmm::panel_bytes(w);
      if constexpr (BITS == 4) {
        unpack_chunk<FULL>(src + static_cast<int64_t>(c0) * kBlockBytes / 2, nb, unpacked[j]);
        b[j] = unpacked[j];
      } else {
        b[j] = reinterpret_cast<const int8_t*>(src) + static_cast<int64_t>(c0) * kBlockBytes;
      }
    }
    for (int tile = 0; tile < tiles; ++tile) {
      const int64_t t = t0 + tile * kTileTokens;
      const int8_t* xh = a.xq + act_at(t, c0, K, ACT);
      const int8_t* xl = WIDE ? xh + kActBlock : nullptr;
      auto issue = [&](int i, int buf) {  // products of chunk block i into hi/lo[buf][i % kBatch]
        block_products<WIDE>(xh + i * a_block, WIDE ? xl + i * a_block : nullptr, astride, b,
                             static_cast<int64_t>(i) * b_block, gr.np, hi[buf][i % kBatch],
                             lo[WIDE ? buf : 0][WIDE ? i % kBatch : 0]);
      };
      for (int i = 0; i < kernel::min_of(kBatch, nb); ++i) issue(i, 0);
      for (int i0 = 0, buf = 0; i0 < nb; i0 += kBatch, buf ^= 1) {
        for (int i = i0 + kBatch; i < kernel::min_of(i0 + 2 * kBatch, nb); ++i) issue(i, buf ^ 1);
        for (int j = 0; j < gr.np; ++j)
          fold<BITS, F16S, ACT>(w, a, gr.panel[j], t, c0 + i0, kernel::min_of(kBatch, nb - i0), j, hi[buf],
                                 lo[WIDE ? buf : 0], acc[tile][j]);
      }
    }
  }
}

// Panels [p_begin, p_end) (pairs with glu) x whole token tiles [t_begin, t_end), by groups and passes.
template <int BITS, bool F16S, int ACT>
void run_panels(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end,
                int64_t t_begin, int64_t t_end) {
  alignas(64) float acc[kPassTiles][kGroup][kTileTokens][R];
  const int step = o.glu >= 0 ? 2 : 1;  // weight panels per output panel
  for (int64_t p = p_begin; p < p_end;) {
    const int nout = static_cast<int>(kernel::min_of<int64_t>(kGroup / step, p_end - p));
    Group gr{{}, nout * step};
    for (int j = 0; j < gr.np; ++j) gr.panel[j] = step * p + j;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kPassTiles * kTileTokens) {
      const int tiles = static_cast<int>(kernel::min_of<int64_t>(kPassTiles, (t_end - t0) / kTileTokens));
      pass<BITS, F16S, ACT>(w, a, gr, t0, tiles, acc);
      for (int tile = 0; tile < tiles; ++tile) {
        for (int j = 0; j < nout; ++j) {
          float (*y)[R] = acc[tile][step * j];  // with glu: act(gate) * up into the gate's accumulators
          for (int t = 0; t < kTileTokens && o.glu >= 0; ++t) qmm::glu_row(o.glu, y[t], acc[tile][2 * j + 1][t], y[t]);
          const int64_t col0 = (p + j - o.first_panel) * R;
          const size_t cols = static_cast<size_t>(kernel::min_of<int64_t>(R, o.columns - col0));
          for (int t = 0; t < kTileTokens; ++t)
            std::memcpy(o.out + (t0 + tile * kTileTokens + t) * o.ld + col0, y[t], sizeof(float) * cols);
        }
      }
    }
    p += nout;
  }
}

template <int BITS, int ACT>
void run_bits(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end, int64_t t_begin,
              int64_t t_end) {
  static const TileConfig config = make_config(kFull<BITS, ACT> ? 2 * kActBlock : kActBlock);
  _tile_loadconfig(&config);
  const auto run = w.f16_scales ? run_panels<BITS, true, ACT> : run_panels<BITS, false, ACT>;
  run(w, a, o, p_begin, p_end, t_begin, t_end);
  _tile_release();
}

template <int ACT>
void run_acts(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end, int64_t t_begin,
              int64_t t_end) {
  (w.bits == 4 ? run_bits<4, ACT> : run_bits<8, ACT>)(w, a, o, p_begin, p_end, t_begin, t_end);
}

// Token blocks of at least 64 rows (a multiple of the 16-token tile): the panels reuse each unpacked weight
// chunk across the block's token tiles, 1.5x at K = 8192 against 16; the usual panels per task.
QmmTaskShape task_shape(int, int64_t) { return {64, kPanelsPerTask}; }

void panels(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end, int64_t t_begin,
            int64_t t_end) {
  const int64_t t_tiles = t_begin + (t_end - t_begin) / kTileTokens * kTileTokens;
  if (t_tiles > t_begin)
    (a.bits == 16 ? run_acts<16> : a.bits == 12 ? run_acts<12> : run_acts<8>)(w, a, o, p_begin, p_end, t_begin,
                                                                              t_tiles);
  if (t_tiles < t_end) qmm::panels(w, a, o, p_begin, p_end, t_tiles, t_end);
}

}  // namespace

}  // namespace metrale::METRALE_ISA_NS::amx

namespace metrale {

// The avx512 set with AMX panels (isa.cpp lists it only where the CPU has AMX-INT8 and Linux grants it).
const KernelTable* kernel_table_avx512_amx() {
  static const KernelTable table = [] {
    KernelTable t = *kernel_table_avx512();
    t.isa = "avx512_amx";
    t.qmm_panels = metrale::METRALE_ISA_NS::amx::panels;
    t.qmm_task_shape = metrale::METRALE_ISA_NS::amx::task_shape;
    return t;
  }();
  return &table;
}

}  // namespace metrale
