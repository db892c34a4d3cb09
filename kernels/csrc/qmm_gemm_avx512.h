// The AVX-512 VNNI quantized matmul for many tokens (run_panels' path from kGemmMinTokens tokens with int12
// or int16 activations): the same int32 block sums and the same float epilogue, in the same order, as
// tile() (bit-identical), arranged so that the vector ports spend more of their slots on vpdpbusd:
//
//   - int12 activations with 4-bit weights take ONE int32 accumulator per token: the weights are unpacked
//     twice, q (0..15) and 16 q (0..240, still a u8), so that vpdpbusd(16 q, hi) + vpdpbusd(q, lo) sums
//     q (16 hi + lo) = q X directly (the same int32 as tile()'s (sum q hi) << 4 + sum q lo, without the
//     combine per token and block), which leaves room for tiles of 16 tokens (two sums: 8);
//   - each pass packs its tokens' activations (all of K) token-interleaved, block-major, so that a tile
//     reads every broadcast from one pointer at constant offsets (16 row pointers spill);
//   - the float accumulators live in an L1 buffer (load, fma, store: the load and store ports are idle),
//     so the registers hold the integer sums; a group's bias term joins its last block's epilogue (one
//     load and store per token and block, not two: 1B prompt chunk 8% faster on a Zen 4).
// docs/quantized-kernels.md ("AVX-512 VNNI for many tokens") has the measurements. Included inside
// namespace metrale::avx512::qmm by qmm_kernel.h (uses load16v, prefetch, combine, glu_row, panel_bytes).
#pragma once

namespace gemm {

constexpr int kGemmTokens = 64;  // tokens per pass: their packed activations (L2), their accumulators (stack, L1)
constexpr int kGemmMaxTile = 16;
constexpr int kPassRows = kGemmTokens + kGemmMaxTile;  // a pass's token rows, padded to whole tiles

template <int BITS, int ACT>
constexpr bool one_accumulator() {  // int8, or int12 with 4-bit weights (16 q fits a u8)
  return !act_two_planes(ACT) || (ACT == 12 && BITS == 4);
}
template <int BITS, int ACT>
constexpr int max_tile() {  // two int32 accumulators per token: 12 tokens spill, 8 do not (measured)
  return one_accumulator<BITS, ACT>() ? 16 : 8;
}

// One tile's activations for all of K, token-interleaved so that the tile reads them all from one
// pointer: block b of token t at x[(b * tt + t) * words] (its 4-byte words, as in xq), its d at
// d[b * tt + t], and the tile's xsum of group g at s[g * tt + t] (b, g counted from the start of K).
struct PackedActs {
  const int32_t* x;
  const float* d;
  const float* s;
};

// Packs tokens min(t0 + i, t_last), i < tt, all blocks and groups of a into x, d, s (64 or 32 bytes per
// token and block: one vector load and store, WORDS known at compile time).
template <int WORDS>
inline void pack_acts(const QmmActs& a, int64_t t0, int64_t t_last, int tt, int32_t* x, float* d, float* s) {
  const int K = a.K, blocks = K / kActBlock, groups = K / a.group_size;
  int64_t rows[kGemmMaxTile];
  for (int t = 0; t < tt; ++t) rows[t] = t0 + t < t_last ? t0 + t : t_last;
  // token-major: each token's row is read in order (block-major reads jumped a whole row, 4 KiB at K = 2048,
  // from one block to the next: every load another page, no hardware prefetch, ~7% of a 1B prompt chunk's
  // matmul time), the writes land in the pass's buffer (L2) at a stride of tt blocks
  for (int t = 0; t < tt; ++t) {
    const float* src_d = a.xd + rows[t] * blocks;
    for (int b = 0; b < blocks; ++b) {
      const int8_t* src = a.xq + act_at(rows[t], b, K, a.bits);
      int32_t* dst = x + (static_cast<int64_t>(b) * tt + t) * WORDS;
      if constexpr (WORDS == 16) {
        _mm512_storeu_si512(dst, _mm512_loadu_si512(src));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
      }
      d[b * tt + t] = src_d[b];
    }
  }
  for (int g = 0; g < groups; ++g)
    for (int t = 0; t < tt; ++t) *s++ = a.xsum[rows[t] * groups + g];
}

// acc[t][r] += the products of groups [g_begin, g_end) of panel p for the TT tokens packed in x.
template <int TT, int BITS, bool F16S, int ACT>
void gemm_tile(const QmmWeights& w, int64_t p, int g_begin, int g_end, PackedActs x, float (*acc)[R]) {
  const int groups = w.K / w.group_size, per_group = w.group_size / kActBlock;
  constexpr bool WIDE = act_two_planes(ACT);
  constexpr bool ONE = one_accumulator<BITS, ACT>();
  constexpr bool FUSED = WIDE && ONE;  // int12 x 4 bits: 16 q against hi, q against lo, one sum
  constexpr int words = WIDE ? 16 : 8;  // int32 words of xq per block
  constexpr int block_bytes = kActBlock * R * BITS / 8;
  const uint8_t* wq = w.q + p * panel_bytes(w) + static_cast<int64_t>(g_begin) * per_group * block_bytes;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m4h = _mm512_set1_epi8(static_cast<char>(0xF0));
  const int32_t* xw = x.x;
  const float* xd = x.d;
  const float* xs = x.s;
  for (int g = g_begin; g < g_end; ++g, xs += TT) {
    const __m512 s = load16v<F16S>(w.scales, p * groups + g);
    const __m512 m = bias16v<F16S>(w, p * groups + g);
    for (int bb = 0; bb < per_group; ++bb, xw += TT * words, xd += TT) {
      __m512i ih[TT], il[TT];
      for (int t = 0; t < TT; ++t) ih[t] = il[t] = _mm512_setzero_si512();
      // vector v (16 rows x 4 k) against word c of the hi plane (or int8 values), v16 = 16 v against the lo one
      auto dot = [&](__m512i v, __m512i v16, int c) {
        for (int t = 0; t < TT; ++t) {
          if constexpr (FUSED) {
            ih[t] = _mm512_dpbusd_epi32(ih[t], v16, _mm512_set1_epi32(xw[t * words + c]));
            ih[t] = _mm512_dpbusd_epi32(ih[t], v, _mm512_set1_epi32(xw[t * words + 8 + c]));
          } else {
            ih[t] = _mm512_dpbusd_epi32(ih[t], v, _mm512_set1_epi32(xw[t * words + c]));
            if constexpr (WIDE) il[t] = _mm512_dpbusd_epi32(il[t], v, _mm512_set1_epi32(xw[t * words + 8 + c]));
          }
        }
      };
      if constexpr (BITS == 4) {
        for (int o = 0; o < 4; ++o, wq += 64) {
          prefetch(wq + kPrefetchBytes);
          const __m512i v = _mm512_loadu_si512(wq);
          const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          if constexpr (FUSED) {
            dot(lo, _mm512_and_si512(_mm512_slli_epi16(v, 4), m4h), 2 * o);
            dot(hi, _mm512_and_si512(v, m4h), 2 * o + 1);
          } else {
            dot(lo, lo, 2 * o);
            dot(hi, hi, 2 * o + 1);
          }
        }
      } else {
        for (int o = 0; o < 8; ++o, wq += 64) {
          prefetch(wq + kPrefetchBytes);
          const __m512i v = _mm512_loadu_si512(wq);
          dot(v, v, o);
        }
      }
      // the accumulators stay in memory: keep the compiler from holding (and spilling) them in registers
      __asm__("" : "+r"(acc));
      // the group's last block adds the group's bias term too (same order as tile(): the block, then the bias)
      const bool last = bb == per_group - 1;
      for (int t = 0; t < TT; ++t) {
        const __m512i ia = WIDE && !ONE ? combine<ACT>(ih[t], il[t]) : ih[t];
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(xd[t]));
        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), sd, _mm512_load_ps(acc[t]));
        if (last) v = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t]), v);
        _mm512_store_ps(acc[t], v);
      }
    }
  }
}

using GemmTileFn = void (*)(const QmmWeights&, int64_t, int, int, PackedActs, float (*)[R]);

// The tile width for `rest` remaining tokens: the widest tile, or the smallest of 4, 8, 12 that covers them.
template <int BITS, int ACT>
int tile_width(int64_t rest) {
  constexpr int widest = max_tile<BITS, ACT>();
  return rest >= widest ? widest : rest > 8 ? 12 : rest > 4 ? 8 : 4;
}

template <int BITS, bool F16S, int ACT>
GemmTileFn tile_fn(int width) {
  if constexpr (max_tile<BITS, ACT>() == 16) {
    if (width == 16) return gemm_tile<16, BITS, F16S, ACT>;
    if (width == 12) return gemm_tile<12, BITS, F16S, ACT>;
  }
  return width == 8 ? gemm_tile<8, BITS, F16S, ACT> : gemm_tile<4, BITS, F16S, ACT>;
}

// Packs tokens [tb, te) in tiles (widths tile_width), all of K, into the thread's buffer; returns the
// packed activations of each tile, in order.
// A thread's packing buffer, grown on demand (not std::vector: every inline symbol of this object must
// live in this instruction set's namespace, tests/kernels/test_quantized_matmul.py).
class PackBuffer {
 public:
  PackBuffer() = default;
  PackBuffer(const PackBuffer&) = delete;
  PackBuffer& operator=(const PackBuffer&) = delete;
  ~PackBuffer() { delete[] raw_; }
  // 64-byte aligned room for `bytes` bytes (the previous contents are not kept)
  uint8_t* room(size_t bytes) {
    if (bytes > size_) {
      delete[] raw_;
      raw_ = new uint8_t[bytes + 64];
      size_ = bytes;
    }
    return raw_ + (64 - reinterpret_cast<uintptr_t>(raw_) % 64) % 64;
  }

 private:
  uint8_t* raw_ = nullptr;
  size_t size_ = 0;
};

template <int BITS, int ACT>
int pack_pass(const QmmActs& a, int64_t tb, int64_t te, PackedActs* tiles) {
  const int blocks = a.K / kActBlock, groups = a.K / a.group_size;
  constexpr int words = act_two_planes(ACT) ? 16 : 8;
  thread_local PackBuffer buffer;
  const size_t rows = kPassRows, x_bytes = rows * blocks * words * 4, d_bytes = rows * blocks * 4;
  uint8_t* base = buffer.room(x_bytes + d_bytes + rows * groups * 4);
  auto* xbuf = reinterpret_cast<int32_t*>(base);
  auto* dbuf = reinterpret_cast<float*>(base + x_bytes);
  auto* sbuf = reinterpret_cast<float*>(base + x_bytes + d_bytes);
  int n = 0, used = 0;  // tiles, token rows packed
  for (int64_t t0 = tb; t0 < te; t0 += tile_width<BITS, ACT>(te - t0), ++n) {
    const int tt = tile_width<BITS, ACT>(te - t0);
    int32_t* x = xbuf + static_cast<size_t>(used) * blocks * words;
    float* d = dbuf + static_cast<size_t>(used) * blocks;
    float* s = sbuf + static_cast<size_t>(used) * groups;
    pack_acts<words>(a, t0, te - 1, tt, x, d, s);
    tiles[n] = {x, d, s};
    used += tt;
  }
  return n;
}

// panels [p_begin, p_end) (pairs with glu) x tokens [t_begin, t_end), as run_panels: passes of up to
// kGemmTokens tokens whose packed activations (L2) serve every panel; per panel (pair) the tiles run
// over all of K into accumulators in L1, then go out.
template <int BITS, bool F16S, int ACT>
void run_gemm(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end,
              int64_t t_begin, int64_t t_end) {
  const int groups = w.K / w.group_size, per_pair = o.glu < 0 ? 1 : 2;
  alignas(64) float acc[2][kPassRows][R];
  alignas(64) float gated[R];
  PackedActs tiles[kPassRows / 4];
  for (int64_t tb = t_begin; tb < t_end; tb += kGemmTokens) {
    const int64_t te = kernel::min_of<int64_t>(t_end, tb + kGemmTokens);
    pack_pass<BITS, ACT>(a, tb, te, tiles);
    for (int64_t pp = p_begin; pp < p_end; ++pp) {
      for (int h = 0; h < per_pair; ++h) {
        std::memset(acc[h], 0, sizeof(acc[h]));
        int i = 0;
        for (int64_t t0 = tb; t0 < te; t0 += tile_width<BITS, ACT>(te - t0), ++i)
          tile_fn<BITS, F16S, ACT>(tile_width<BITS, ACT>(te - t0))(w, pp * per_pair + h, 0, groups, tiles[i],
                                                                 acc[h] + (t0 - tb));
      }
      const int64_t col0 = (pp - o.first_panel) * R;
      const int cols = static_cast<int>(kernel::min_of<int64_t>(R, o.columns - col0));
      for (int64_t t = tb; t < te; ++t) {
        const float* row = acc[0][t - tb];
        if (o.glu >= 0) {
          glu_row(o.glu, row, acc[1][t - tb], gated);
          row = gated;
        }
        if (cols == R) _mm512_storeu_ps(o.out + t * o.ld + col0, _mm512_load_ps(row));  // not a memcpy call per row
        else std::memcpy(o.out + t * o.ld + col0, row, sizeof(float) * cols);
      }
    }
  }
}

}  // namespace gemm
