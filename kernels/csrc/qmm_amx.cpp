// The quantized matmul's panels on AMX int8 tiles (Sapphire Rapids and later): the avx512 kernel set
// with qmm_panels replaced, compiled once with AVX-512 + AMX flags (CMakeLists.txt: the avx512_amx set,
// METRALE_ISA_NS = avx512_amx, so every inline function of qmm_kernel.h gets its own copy here).
//
// One TDPBSUD multiplies a tile A (16 tokens x 32 int8 activations, read in place from xq (T, K),
// row stride K) by a tile B (8 rows x 64 bytes: 32 k of 16 weight rows, 4 consecutive k per row in a
// 32-bit lane) into C (16 tokens x 16 rows, int32). B is exactly the packed panel layout
// (kernel_table.h): 8-bit panels are loaded as they are, 4-bit panels are unpacked once per task into
// a thread-local int8 panel (low nibbles -> chunk 2c, high -> 2c + 1) and reused by every token tile.
// Per block of 32 k the int32 tile is stored and folded into 16 float accumulators exactly as the
// avx512 tile does it (same block sums, same fma order): the results are bit-identical to the avx512
// set's. int16 activations run two products per block (hi and lo halves, combined as 255 hi + lo).
// Tokens past the last full tile of 16 run the avx512 tile.
//
// Tile state is per thread: every qmm_panels call loads the configuration and releases the tiles
// before it returns. The process must have been granted the AMX state (isa.cpp asks the kernel once).
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <new>

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

// Tiles: 0-3 int32 results, 4-5 activations, 6-7 weights (products() rotates them).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {
  TileConfig c;
  for (int i = 0; i < 4; ++i) c.colsb[i] = 64, c.rows[i] = 16;       // C: 16 tokens x 16 int32
  for (int i = 4; i < 6; ++i) c.colsb[i] = kActBlock, c.rows[i] = 16;  // A: 16 tokens x 32 int8
  for (int i = 6; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = kActBlock / 4;  // B: 8 x (16 rows x 4 k)
  return c;
}

// A thread's 64-byte-aligned scratch panel. Not a std::vector: its out-of-line members would be weak
// symbols compiled with AVX-512 flags outside this namespace (test_isa_objects_share_no_symbols...).
class PanelBuffer {
 public:
  PanelBuffer() = default;
  PanelBuffer(const PanelBuffer&) = delete;
  PanelBuffer& operator=(const PanelBuffer&) = delete;
  ~PanelBuffer() { std::free(data_); }

  // at least `bytes` bytes (the contents are not kept when it grows)
  int8_t* get(size_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      size_ = (bytes + 63) / 64 * 64;
      data_ = static_cast<int8_t*>(std::aligned_alloc(64, size_));
      if (data_ == nullptr) throw std::bad_alloc();
    }
    return data_;
  }

 private:
  int8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The int8 panel p (16 * K bytes, chunk c = k 4c .. 4c + 3 of 16 rows): the packed one, or 4 bits unpacked.
const int8_t* int8_panel(const QmmWeights& w, int64_t p, PanelBuffer& scratch) {
  const uint8_t* src = w.q + p * qmm::panel_bytes(w);
  if (w.bits == 8) return reinterpret_cast<const int8_t*>(src);
  int8_t* __restrict out = scratch.get(static_cast<size_t>(R) * w.K);
  const int64_t chunks = w.K / 8;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i v = _mm512_loadu_si512(src + c * 64);
    _mm512_storeu_si512(out + (2 * c) * 64, _mm512_and_si512(v, m4));
    _mm512_storeu_si512(out + (2 * c + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
  }
  return out;
}

constexpr int kBatch = 4;  // blocks whose products run before their float epilogue

// The 16 scales (or biases) of panel p, group g (index p * groups + g) as floats, straight into a register
// (qmm::load16 goes through memory: two 32-byte stores read back as one 64-byte load do not forward).
template <bool F16S>
inline __m512 scales16(const void* base, int64_t index) {
  if constexpr (F16S) {
    const auto* halves = static_cast<const uint16_t*>(base) + index * R;
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(base) + index * R);
  }
}

// C tile C (0-3) = A tile TA x B tile TB, stored to dst (16 x 16 int32). GCC's tile intrinsics are
// macros that paste the tile number into the instruction: literals only, hence a macro here too.
#define METRALE_AMX_PRODUCT(C, TA, TB, a, b, dst) \
  do {                                           \
    _tile_loadd(TB, (b), 64);                    \
    _tile_loadd(TA, (a), astride);               \
    _tile_zero(C);                               \
    _tile_dpbsud(C, TA, TB);                     \
    _tile_stored(C, (dst), 64);                  \
  } while (0)

// The int32 sums of `n` (<= kBatch) consecutive blocks from `blk` into sums[i] (and lo[i] for WIDE):
// A: 16 rows of x at a stride of K (astride), blocks 32 bytes apart; B: the panel's blocks, 512 bytes
// apart. Tiles rotate so that consecutive products do not wait on each other.
template <bool WIDE>
inline void products(const int8_t* xh, const int8_t* xl, int64_t astride, const int8_t* b, int blk, int n,
                     int32_t (*hi)[kTileTokens][R], int32_t (*lo)[kTileTokens][R]) {
  for (int i = 0; i < n; ++i) {
    const int64_t at = static_cast<int64_t>(blk + i) * kBlockBytes, xat = static_cast<int64_t>(blk + i) * kActBlock;
    if constexpr (WIDE) {
      if (i % 2 == 0) {
        METRALE_AMX_PRODUCT(0, 4, 6, xh + xat, b + at, &hi[i][0][0]);
        METRALE_AMX_PRODUCT(1, 5, 6, xl + xat, b + at, &lo[i][0][0]);
      } else {
        METRALE_AMX_PRODUCT(2, 4, 7, xh + xat, b + at, &hi[i][0][0]);
        METRALE_AMX_PRODUCT(3, 5, 7, xl + xat, b + at, &lo[i][0][0]);
      }
    } else {
      switch (i) {
        case 0: METRALE_AMX_PRODUCT(0, 4, 6, xh + xat, b + at, &hi[i][0][0]); break;
        case 1: METRALE_AMX_PRODUCT(1, 5, 7, xh + xat, b + at, &hi[i][0][0]); break;
        case 2: METRALE_AMX_PRODUCT(2, 4, 6, xh + xat, b + at, &hi[i][0][0]); break;
        default: METRALE_AMX_PRODUCT(3, 5, 7, xh + xat, b + at, &hi[i][0][0]); break;
      }
    }
  }
}

// acc[t] = y[t0 + t, 16p + r] for 16 tokens of one panel, as qmm::tile computes it. b: the int8 panel;
// xh / xl: the tile's first activation row (row stride K). Software-pipelined: the products of the next
// kBatch blocks are issued before the float epilogue of the current ones (double-buffered sums), so that
// the tile unit and the vector ports work at the same time.
template <bool F16S, bool WIDE>
void tile16(const QmmWeights& w, const QmmActs& a, int64_t p, const int8_t* b, const int8_t* xh, const int8_t* xl,
            int64_t t0, float acc_out[][R]) {
  const int K = w.K, groups = K / w.group_size, per_group = w.group_size / kActBlock, blocks = K / kActBlock;
  alignas(64) int32_t hi[2][kBatch][kTileTokens][R], lo[WIDE ? 2 : 1][WIDE ? kBatch : 1][kTileTokens][R];
  __m512 acc[kTileTokens];
  for (int t = 0; t < kTileTokens; ++t) acc[t] = _mm512_setzero_ps();
  const float* xd = a.xd + t0 * blocks;
  const float* xs = a.xsum + t0 * groups;
  products<WIDE>(xh, xl, K, b, 0, kernel::min_of(kBatch, blocks), hi[0], lo[0]);
  int g = 0, bb = 0;  // the weight group of the next block, and the block's place in it
  for (int b0 = 0, buf = 0; b0 < blocks; b0 += kBatch, buf ^= 1) {
    const int n = kernel::min_of(kBatch, blocks - b0);
    if (b0 + kBatch < blocks)
      products<WIDE>(xh, xl, K, b, b0 + kBatch, kernel::min_of(kBatch, blocks - b0 - kBatch), hi[buf ^ 1],
                     lo[WIDE ? buf ^ 1 : 0]);
    for (int i = 0; i < n; ++i) {
      const int blk = b0 + i;
      const __m512 s = scales16<F16S>(w.scales, p * groups + g);
      for (int t = 0; t < kTileTokens; ++t) {
        __m512i ia = _mm512_load_si512(hi[buf][i][t]);
        if constexpr (WIDE) ia = qmm::combine(ia, _mm512_load_si512(lo[buf][i][t]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(s, _mm512_set1_ps(xd[t * blocks + blk])),
                                 acc[t]);
      }
      if (++bb == per_group) {  // the group's bias term, after its last block
        const __m512 m = scales16<F16S>(w.biases, p * groups + g);
        for (int t = 0; t < kTileTokens; ++t) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t * groups + g]), acc[t]);
        bb = 0, ++g;
      }
    }
  }
  for (int t = 0; t < kTileTokens; ++t) _mm512_storeu_ps(acc_out[t], acc[t]);
}

template <bool F16S, bool WIDE>
void run_panels(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end,
                int64_t t_begin, int64_t t_end) {
  thread_local PanelBuffer gate_panel, up_panel;
  alignas(64) float acc[kTileTokens][R], up[kTileTokens][R];
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int64_t col0 = (p - o.first_panel) * R;
    const size_t cols = static_cast<size_t>(kernel::min_of<int64_t>(R, o.columns - col0));
    const int64_t wp = o.glu < 0 ? p : 2 * p;  // pair p: gate panel 2p, up panel 2p + 1
    const int8_t* gb = int8_panel(w, wp, gate_panel);
    const int8_t* ub = o.glu < 0 ? nullptr : int8_panel(w, wp + 1, up_panel);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kTileTokens) {
      const int8_t* xh = a.xq + t0 * w.K;
      const int8_t* xl = WIDE ? a.xlo + t0 * w.K : nullptr;
      tile16<F16S, WIDE>(w, a, wp, gb, xh, xl, t0, acc);
      if (o.glu >= 0) {
        tile16<F16S, WIDE>(w, a, wp + 1, ub, xh, xl, t0, up);
        for (int t = 0; t < kTileTokens; ++t) qmm::glu_row(o.glu, acc[t], up[t], acc[t]);
      }
      for (int t = 0; t < kTileTokens; ++t) std::memcpy(o.out + (t0 + t) * o.ld + col0, acc[t], sizeof(float) * cols);
    }
  }
}

void panels(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end, int64_t t_begin,
            int64_t t_end) {
  const int64_t t_tiles = t_begin + (t_end - t_begin) / kTileTokens * kTileTokens;
  if (t_tiles > t_begin) {
    static const TileConfig config = make_config();
    _tile_loadconfig(&config);
    const bool wide = a.xlo != nullptr;
    if (w.f16_scales)
      (wide ? run_panels<true, true> : run_panels<true, false>)(w, a, o, p_begin, p_end, t_begin, t_tiles);
    else
      (wide ? run_panels<false, true> : run_panels<false, false>)(w, a, o, p_begin, p_end, t_begin, t_tiles);
    _tile_release();
  }
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
    return t;
  }();
  return &table;
}

}  // namespace metrale
