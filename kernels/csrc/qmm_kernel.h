// Quantized matmul y = x W^T straight from 4- or 8-bit affine weights (w = q * scale + bias per group),
// llama.cpp style: activations quantized to int8 per block of 32, integer dot products, floats per block.
//
//   y[t, n] = sum_g scale[n, g] sum_{b in g} d[t, b] sum_{k in b} q[n, k] xq[t, k]   (integer inner sum)
//           + sum_g bias[n, g] xsum[t, g]                                              (exact float sums of x)
//
// Layout (kernel_table.h, packed by kernels/qmm.py): panels of 16 rows, 4 consecutive k of one row in
// each 32-bit lane, so one 64-byte vector is 16 rows x 4 k (8 k for 4 bits: low nibbles k .. k+3, high
// nibbles k+4 .. k+7). An int8 dot of a vector with the 4 activation bytes broadcast to every lane
// gives 16 row sums at once: no horizontal adds, and each output lands as 16 contiguous floats.
//
// One micro-kernel call computes a tile: one panel (16 rows) x TT tokens, over all of K, in registers.
//   AVX-512 VNNI  vpdpbusd (u8 q x s8 xq -> s32), 16 rows per zmm, TT <= 8
//   AVX2          vpmaddubsw + vpmaddwd, 8 rows per ymm (two per panel), TT <= 4; 8-bit q as
//                 (q - 128) with the sign trick (u8 x s8 products must fit int16), corrected by 128 sum(xq)
//   NEON (arm64)  SDOT (vdotq_s32, +dotprod) or vmull_s8 + vpadalq_s16, 4 rows per register, TT <= 4;
//                 8-bit q as (q - 128) like AVX2 (qmm_neon.h)
//   scalar        plain loops over the same layout (the fallback, and the reference for the others)
// Compiled per instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <utility>

#include "activation_kernel.h"
#include "kernel_table.h"
#include "vecmath.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define METRALE_QMM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define METRALE_QMM_AVX2 1
#elif defined(__aarch64__) && defined(METRALE_ISA_NEON)  // kernel sets neon, neon_dotprod (qmm_neon.h)
#include <arm_neon.h>
#define METRALE_QMM_NEON 1
#endif

namespace metrale::METRALE_ISA_NS::qmm {

using kernel::v8f;
using kernel::kW;

constexpr int R = kPanelRows;

#if defined(METRALE_QMM_AVX512)
constexpr int kMaxTile = 8;  // tokens per tile: TT int + TT float accumulators (x2 int with int16) of 32 zmm
#else
constexpr int kMaxTile = 4;
#endif

inline int64_t panel_bytes(const QmmWeights& w) {
  return static_cast<int64_t>(R) * w.K * w.bits / 8;
}

// The 16 scales (or biases) of panel p, group g, as floats.
template <bool F16S>
inline void load16(const void* base, int64_t index, float out[R]) {
  if constexpr (F16S) {
    const auto* h = static_cast<const kernel::f16_t*>(base) + index * R;
    kernel::store8(out, kernel::load8(h));
    kernel::store8(out + 8, kernel::load8(h + 8));
  } else {
    std::memcpy(out, static_cast<const float*>(base) + index * R, sizeof(float) * R);
  }
}

// ---- quantizing activations ----

typedef int8_t v8b __attribute__((vector_size(8)));

// round(v) to the nearest integer, ties to even (the default rounding mode), as int32.
inline kernel::v8i round8(v8f v) {
  kernel::v8i out;
#if defined(__AVX__)
  __m256 f;
  std::memcpy(&f, &v, sizeof(f));
  const __m256i i = _mm256_cvtps_epi32(f);
  std::memcpy(&out, &i, sizeof(out));
#elif defined(__SSE2__)
  __m128 f[2];
  std::memcpy(f, &v, sizeof(f));
  const __m128i i[2] = {_mm_cvtps_epi32(f[0]), _mm_cvtps_epi32(f[1])};
  std::memcpy(&out, i, sizeof(out));
#elif defined(METRALE_QMM_NEON)
  float32x4_t f[2];
  std::memcpy(f, &v, sizeof(f));
  const int32x4_t i[2] = {vcvtnq_s32_f32(f[0]), vcvtnq_s32_f32(f[1])};  // ties to even, as cvtps2dq
  std::memcpy(&out, i, sizeof(out));
#else
  for (int j = 0; j < kW; ++j) out[j] = static_cast<int32_t>(__builtin_rintf(v[j]));
#endif
  return out;
}

// q's 8 values (each within int8's range) as 8 bytes at p. On x86 without AVX-512 two saturating packs
// (exact here): GCC compiled __builtin_convertvector for AVX2 into a vpextrd, shift and or per value (~30
// scalar instructions per 8 values; quantize was 1.5-1.7% of a prompt chunk's or a 32-stream step's
// samples, 3x what it takes now).
inline void store_int8(int8_t* p, kernel::v8i q) {
#if defined(__SSE2__) && !defined(__AVX512VL__)  // (with AVX-512 VL the conversion is one vpmovdb)
  __m128i half[2];
  std::memcpy(half, &q, sizeof(half));
  const __m128i words = _mm_packs_epi32(half[0], half[1]);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
#else
  const v8b q8 = __builtin_convertvector(q, v8b);
  std::memcpy(p, &q8, sizeof(q8));
#endif
}

// Rows [t_begin, t_end) of x (T, K), per block of 32 with m = max|x| (QmmActs, kernel_table.h):
//   int8:  X = round(x * (127 / m)), d = m / 127;  xq = X
//   int12: X = round(x * (kMidMax / m)), d = m / kMidMax, split X = 16 hi + lo (hi = X >> 4, lo = X & 15)
//   int16: X = round(x * (kWideMax / m)), d = m / kWideMax, split X = 255 hi + lo (|hi|, |lo| <= 127)
//   two planes (int12, int16) go interleaved per block, [hi 32 | lo 32] (act_at): sum_k q_k X_k =
//   act_hi_weight * sum q hi + sum q lo, two int8 dot products (one AMX tile product for int12, 4 bits)
// The product is rounded to float32 before the integer rounding, so every instruction set computes
// the same X. xisum = sum(X); per weight group xsum = sum_b d_b xisum_b, the sum of the quantized x:
// the bias term then sees the same x as the scale term, so the error is sum_k w_k (x^_k - x_k)
// rather than sum_k q_k scale (x^_k - x_k), ~3x smaller for 4 bits (llama.cpp's Q8_1 keeps this sum).
// This is the one place that computes the split.
inline void quantize(const float* x, const QmmActs& a, int64_t t_begin, int64_t t_end) {
  const int K = a.K, blocks = K / kActBlock, per_group = a.group_size / kActBlock;
  const float top = a.bits == 16 ? static_cast<float>(kWideMax) : a.bits == 12 ? static_cast<float>(kMidMax) : 127.0f;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const float* xr = x + t * K;
    float gsum = 0.0f;
    for (int b = 0; b < blocks; ++b) {
      v8f v[4], amax = {};
      for (int i = 0; i < 4; ++i) {
        v[i] = kernel::load8(xr + b * kActBlock + i * kW);
        amax = kernel::abs8(v[i]) > amax ? kernel::abs8(v[i]) : amax;
      }
      const float m = kernel::hmax(amax);
      const float d = m / top, id = m > 0.0f ? top / m : 0.0f;
      kernel::v8i isum = {};
      int8_t* block = a.xq + act_at(t, b, K, a.bits);
      for (int i = 0; i < 4; ++i) {
        const kernel::v8i q = round8(v[i] * id);
        isum += q;
        if (a.bits == 16) {
          const kernel::v8i hi = round8(__builtin_convertvector(q, v8f) * (1.0f / 255.0f));  // exact: never a tie
          store_int8(block + i * kW, hi);
          store_int8(block + kActBlock + i * kW, q - hi * 255);
        } else if (a.bits == 12) {
          store_int8(block + i * kW, q >> 4);              // floor(X / 16): -127 .. 127
          store_int8(block + kActBlock + i * kW, q & 15);  // 0 .. 15
        } else {
          store_int8(block + i * kW, q);
        }
      }
      const int32_t block_sum = isum[0] + isum[1] + isum[2] + isum[3] + isum[4] + isum[5] + isum[6] + isum[7];
      a.xd[t * blocks + b] = d;
      a.xisum[t * blocks + b] = block_sum;
      gsum += d * static_cast<float>(block_sum);
      if ((b + 1) % per_group == 0) {
        a.xsum[t * (K / a.group_size) + b / per_group] = gsum;
        gsum = 0.0f;
      }
    }
  }
}

// ---- micro-kernels: acc[t][r] = y[t0 + t, 16p + r] for one panel ----

// Software prefetch of the weight stream (panels are contiguous, so past a panel's end is the next
// one's start; a prefetch never faults past the array's end). Measured from memory on one thread
// (1-token and 8-token tiles over 400 MB of panels, alternating builds, load average ~10): without
// it 7.4-8.4 GB/s at 1 token and 81-88 GFLOP/s at 8 (the tile waits on each line, worst when the
// compute per line is long); 1 KiB ahead plus 8 groups of scales and biases: 10.0-10.6 GB/s and
// 127-138 GFLOP/s. 512 B was short, 4 KiB and the L2 hint no better. AVX2: 8.1-8.3 -> 10.3-10.8 GB/s
// at 1 token, 52-58 -> 62.5 GFLOP/s at 4.
constexpr int kPrefetchBytes = 1024;
constexpr int kPrefetchGroups = 8;

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// Requests the scales and biases of panel p's group g + kPrefetchGroups (they stream beside the weights).
template <bool F16S>
inline void prefetch_group(const QmmWeights& w, int64_t p, int g, int groups) {
  prefetch(static_cast<const char*>(w.scales) + (p * groups + g + kPrefetchGroups) * R * (F16S ? 2 : 4));
  if (w.bias_per_scale == 0.0f)
    prefetch(static_cast<const char*>(w.biases) + (p * groups + g + kPrefetchGroups) * R * (F16S ? 2 : 4));
}

#if defined(METRALE_QMM_AVX512)

// The 16 scales (or biases) of panel p, group g, in one register. Not through load16's stack copy:
// two 32-byte stores read back by one 64-byte load miss the store forwarding, a stall per group
// (a 1-token tile with the weights in L2 took 14.1 ns per panel and group of 32 with it, 9.4 without).
template <bool F16S>
inline __m512 load16v(const void* base, int64_t index) {
  if constexpr (F16S) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(base) + index));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(base) + index * R);
  }
}

// The 16 biases of panel p, group g: bias_per_scale x the scales where the weights are symmetric (exactly
// the stored biases, which are then not read), else loaded.
template <bool F16S>
inline __m512 bias16v(const QmmWeights& w, int64_t index) {
  if (w.bias_per_scale != 0.0f) return _mm512_mul_ps(load16v<F16S>(w.scales, index), _mm512_set1_ps(w.bias_per_scale));
  return load16v<F16S>(w.biases, index);
}

// act_hi_weight(ACT) * hi + lo, the integer dot of int12 / int16 activations from their two int8 planes.
template <int ACT>
inline __m512i combine(__m512i hi, __m512i lo) {
  if constexpr (ACT == 12) return _mm512_add_epi32(_mm512_slli_epi32(hi, 4), lo);
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), hi), lo);
}

template <int TT, int BITS, bool F16S, int ACT>
void tile(const QmmWeights& w, const QmmActs& a, int64_t p, int64_t t0, float acc_out[][R]) {
  const int K = w.K, groups = K / w.group_size, per_group = w.group_size / kActBlock, blocks = K / kActBlock;
  const uint8_t* wq = w.q + p * panel_bytes(w);
  constexpr bool WIDE = act_two_planes(ACT);
  constexpr int words = WIDE ? 16 : 8;  // int32 words of xq per block
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int32_t* xh[TT];  // 4 activation bytes per int32: int8 values, or the hi plane of two-plane ones
  const int32_t* xl[TT];  // the lo plane (WIDE): 32 bytes after the hi one of each block
  const float* xd[TT];
  const float* xs[TT];
  for (int t = 0; t < TT; ++t) {
    xh[t] = reinterpret_cast<const int32_t*>(a.xq + act_at(t0 + t, 0, K, ACT));
    xl[t] = WIDE ? xh[t] + kActBlock / 4 : nullptr;
    xd[t] = a.xd + (t0 + t) * blocks;
    xs[t] = a.xsum + (t0 + t) * groups;
  }
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    prefetch_group<F16S>(w, p, g, groups);
    const __m512 s = load16v<F16S>(w.scales, p * groups + g), m = bias16v<F16S>(w, p * groups + g);
    for (int bb = 0; bb < per_group; ++bb) {
      const int blk = g * per_group + bb;
      __m512i ih[TT], il[TT];
      for (int t = 0; t < TT; ++t) ih[t] = il[t] = _mm512_setzero_si512();
      // chunk c of the block: 16 rows x 4 k, times 4 activation bytes of each token
      auto dot = [&](__m512i v, int c) {
        for (int t = 0; t < TT; ++t) {
          ih[t] = _mm512_dpbusd_epi32(ih[t], v, _mm512_set1_epi32(xh[t][blk * words + c]));
          if constexpr (WIDE) il[t] = _mm512_dpbusd_epi32(il[t], v, _mm512_set1_epi32(xl[t][blk * words + c]));
        }
      };
      if constexpr (BITS == 4) {
        for (int o = 0; o < 4; ++o, wq += 64) {
          prefetch(wq + kPrefetchBytes);
          const __m512i v = _mm512_loadu_si512(wq);
          dot(_mm512_and_si512(v, m4), 2 * o);
          dot(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), 2 * o + 1);
        }
      } else {
        for (int o = 0; o < 8; ++o, wq += 64) {
          prefetch(wq + kPrefetchBytes);
          dot(_mm512_loadu_si512(wq), o);
        }
      }
      for (int t = 0; t < TT; ++t) {
        const __m512i ia = WIDE ? combine<ACT>(ih[t], il[t]) : ih[t];
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(s, _mm512_set1_ps(xd[t][blk])), acc[t]);
      }
    }
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t][g]), acc[t]);
  }
  for (int t = 0; t < TT; ++t) _mm512_storeu_ps(acc_out[t], acc[t]);
}

#elif defined(METRALE_QMM_AVX2)

// 8 of a panel's 16 scales (or biases), half h, of panel p's group g, straight into a register.
template <bool F16S>
inline __m256 load8v(const void* base, int64_t index, int h) {
  if constexpr (F16S) {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(base) + 2 * index + h));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(base) + index * R + 8 * h);
  }
}

// Half h of panel p's group g biases: computed from the scales where the weights are symmetric (bias16v).
template <bool F16S>
inline __m256 bias8v(const QmmWeights& w, int64_t index, int h) {
  if (w.bias_per_scale != 0.0f)
    return _mm256_mul_ps(load8v<F16S>(w.scales, index, h), _mm256_set1_ps(w.bias_per_scale));
  return load8v<F16S>(w.biases, index, h);
}

// x[t][plane]: block blk's activation words (4 int8 each) of token t0 + t, the hi (or int8) plane then lo.
template <int TT, int ACT>
inline void block_words(const QmmActs& a, int64_t t0, int blk, int K, const int32_t* x[TT][act_two_planes(ACT) ? 2 : 1]) {
  for (int t = 0; t < TT; ++t) {
    x[t][0] = reinterpret_cast<const int32_t*>(a.xq + act_at(t0 + t, blk, K, ACT));
    if constexpr (act_two_planes(ACT)) x[t][1] = x[t][0] + kActBlock / 4;
  }
}

// act_hi_weight(ACT) * hi + lo, the integer block sum of int12 / int16 activations from their two planes.
template <int ACT>
inline __m256i combine_planes(__m256i hi, __m256i lo) {
  if constexpr (ACT == 12) return _mm256_add_epi32(_mm256_slli_epi32(hi, 4), lo);
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo);
}

// v, opaque to the optimizer: keeps a running integer sum a chain in one register. Without it GCC
// reassociates the unrolled adds into a tree whose leaves (every maddubs product of a block) spill.
inline __m256i in_order(__m256i v) {
  __asm__("" : "+x"(v));
  return v;
}

// A panel's 4-bit weights unpacked to one byte each, for the token pairs of a run_panels call of
// several tokens: each pair then loads two byte vectors per weight vector where it unpacked them
// (load, shift, two ands): a tile harness on a Zen 3 core, 54.5 -> 51 cycles per block and token pair.
// Per block, chunk o: lo nibbles of halves 0, 1 then hi nibbles of halves 0, 1, 32 bytes each.
constexpr int kUnpackedBlockBytes = kActBlock * R;  // 512, twice the packed block
constexpr int64_t kUnpackMinTokens = 16;  // (unpacking costs ~16 cycles a block: 8 pairs pay it back)

inline void unpack_panel(const QmmWeights& w, int64_t p, uint8_t* out) {
  const uint8_t* panel = w.q + p * panel_bytes(w);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t c = 0; c < w.K / 8; ++c) {  // 64-byte chunks: 4 per block
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + c * 64 + h * 32));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + c * 128 + h * 32), _mm256_and_si256(v, m4));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + c * 128 + 64 + h * 32),
                         _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    }
  }
}

// A kernel thread's room for unpacked panels, 32-byte aligned, grown as needed (plain memory: a std::
// container would be a template instantiation shared between the ISA objects). at_least returns null when
// the memory cannot be had: the tiles then read the packed weights (no exception on a pool thread).
struct UnpackBuffer {
  uint8_t* data = nullptr;
  int64_t bytes = 0;
  UnpackBuffer() = default;
  UnpackBuffer(const UnpackBuffer&) = delete;
  UnpackBuffer& operator=(const UnpackBuffer&) = delete;
  ~UnpackBuffer() { std::free(data); }
  uint8_t* at_least(int64_t n) {
    if (n > bytes) {
      std::free(data);
      data = nullptr, bytes = 0;
      const int64_t rounded = (n + 31) / 32 * 32;
      data = static_cast<uint8_t*>(std::aligned_alloc(32, static_cast<size_t>(rounded)));
      if (data != nullptr) bytes = rounded;
    }
    return data;
  }
};

// Panel p of w as a one-panel weight whose q is unpack_panel's bytes.
inline QmmWeights unpacked_view(const QmmWeights& w, int64_t p, const uint8_t* unpacked) {
  const int64_t scale_bytes = static_cast<int64_t>(w.K / w.group_size) * R * (w.f16_scales ? 2 : 4);
  QmmWeights v = w;
  v.q = unpacked;
  v.scales = static_cast<const char*>(w.scales) + p * scale_bytes;
  v.biases = static_cast<const char*>(w.biases) + p * scale_bytes;
  v.panels = 1;
  v.unpacked = true;
  return v;
}

// acc += bias * xsum: group g's bias term, the last step of each group in every set's epilogue.
template <int TT, bool F16S>
inline void add_group_bias(const QmmWeights& w, const QmmActs& a, int64_t p, int64_t t0, int g, __m256 acc[][2]) {
  const int groups = w.K / w.group_size;
  const __m256 m[2] = {bias8v<F16S>(w, p * groups + g, 0), bias8v<F16S>(w, p * groups + g, 1)};
  for (int t = 0; t < TT; ++t) {
    const __m256 xs = _mm256_set1_ps(a.xsum[(t0 + t) * groups + g]);
    for (int h = 0; h < 2; ++h) acc[t][h] = _mm256_fmadd_ps(m[h], xs, acc[t][h]);
  }
}

// 4-bit weights: the whole panel (both 8-row halves, 4 k per 32-bit lane of a ymm) for one or two tokens
// at a time: each unpacked weight vector meets the tokens' activation words (both planes; each word
// broadcast once per block, straight from memory) and is dropped, the running sums kept chains (in_order):
// per token 2 x planes sums, no spills (with two planes, three tokens would need more than the 16 ymm
// registers; one int8 plane fits four: 8 sums, 4 weight vectors, 2 broadcasts). The int16
// pair sums of all 8 chunks of a block accumulate before one widening (8 x 2 x 15 x 127 < 2^15). Two-plane
// activations (int12, int16) keep a sum per plane and combine them per block (int12's x16 inside the
// widening vpmaddwd). The float epilogue: acc = fma(cvt(block sum), scale * d, acc) per block, then
// fma(bias, xsum, acc) per group, in K order: the same operations, in the same order, as every set.
// With two tokens it runs once per kRunBlocks (16) blocks over their integer block sums, parked in L1
// (isum): run after each block, its chain (widen, convert, fma into sums GCC keeps on the stack) held the
// vector pipes' queues and cost 12% of the tile (a tile harness on a Zen 3 core, 62 -> 55 cycles per
// block and token pair). One token keeps it per block: its two float sums live in registers, and the
// detour through L1 cost the 1-token tile 4-8%.
// tile() runs 3 and 4 tokens of two-plane activations as pairs: broadcasting a word once per half, as the
// 8-bit tile below does, cost 7-15% at 8-32 tokens (docs/quantized-kernels.md, "AVX2 on an AVX2-only CPU").
template <int TT, bool F16S, int ACT, bool UNPACKED>
void tile_both_halves(const QmmWeights& w, const QmmActs& a, int64_t p, int64_t t0, float acc_out[][R]) {
  const int K = w.K, groups = K / w.group_size, per_group = w.group_size / kActBlock, blocks = K / kActBlock;
  constexpr bool WIDE = act_two_planes(ACT);
  constexpr int planes = WIDE ? 2 : 1;
  constexpr int block_bytes = UNPACKED ? kUnpackedBlockBytes : kActBlock * R * 4 / 8;
  constexpr bool kDeferred = TT > 1;  // the float epilogue after a run of blocks (else after each block)
  constexpr int kRunBlocks = 16;      // blocks per run (one group where a group has more)
  const uint8_t* panel = w.q + p * panel_bytes(w);
  const __m256i ones16 = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
  alignas(32) int32_t isum[kDeferred ? kRunBlocks : 1][TT][2][8];  // [block of the run][token][half]
  const int groups_per_run = kDeferred && per_group < kRunBlocks ? kRunBlocks / per_group : 1;
  __m256 acc[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int g_run = 0; g_run < groups; g_run += groups_per_run) {
    // (spelled out for one token: a run known to be one group lets GCC drop this loop, 8% of its probe)
    const int g_end = !kDeferred ? g_run + 1 : g_run + groups_per_run < groups ? g_run + groups_per_run : groups;
    // The integer block sums of the run's groups (into isum; one token: each block's straight into acc).
    for (int g = g_run; g < g_end; ++g) {
      prefetch_group<F16S>(w, p, g, groups);
      for (int bb = 0; bb < per_group; ++bb) {
        const int blk = g * per_group + bb;
        const uint8_t* wq = panel + static_cast<int64_t>(blk) * block_bytes;
        if constexpr (!UNPACKED)  // (the unpacked panel sits in L1 or L2)
          for (int line = 0; line < block_bytes; line += 64) prefetch(wq + kPrefetchBytes + line);
        const int32_t* x[TT][planes];
        block_words<TT, ACT>(a, t0, blk, K, x);
        __m256i sum[TT][planes][2];  // [token][plane][half]: int16 pair sums
        for (int t = 0; t < TT; ++t)
          for (int l = 0; l < planes; ++l) sum[t][l][0] = sum[t][l][1] = _mm256_setzero_si256();
        for (int o = 0; o < 4; ++o) {
          __m256i lo[2], hi[2];
          for (int h = 0; h < 2; ++h) {
            if constexpr (UNPACKED) {
              lo[h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + o * 128 + h * 32));
              hi[h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + o * 128 + 64 + h * 32));
            } else {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + o * 64 + h * 32));
              lo[h] = _mm256_and_si256(v, m4), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
          }
          for (int t = 0; t < TT; ++t)
            for (int l = 0; l < planes; ++l) {
              const __m256i xlo = _mm256_set1_epi32(x[t][l][2 * o]), xhi = _mm256_set1_epi32(x[t][l][2 * o + 1]);
              for (int h = 0; h < 2; ++h) {
                sum[t][l][h] = in_order(_mm256_add_epi16(sum[t][l][h], _mm256_maddubs_epi16(lo[h], xlo)));
                sum[t][l][h] = in_order(_mm256_add_epi16(sum[t][l][h], _mm256_maddubs_epi16(hi[h], xhi)));
              }
            }
        }
        __m256 s[2];
        if constexpr (!kDeferred) s[0] = load8v<F16S>(w.scales, p * groups + g, 0), s[1] = load8v<F16S>(w.scales, p * groups + g, 1);
        for (int t = 0; t < TT; ++t)
          for (int h = 0; h < 2; ++h) {
            __m256i ia;
            if constexpr (ACT == 12) {  // X = 16 hi + lo: the x16 inside the widening
              ia = _mm256_add_epi32(_mm256_madd_epi16(sum[t][0][h], _mm256_set1_epi16(16)),
                                    _mm256_madd_epi16(sum[t][1][h], ones16));
            } else {
              ia = _mm256_madd_epi16(sum[t][0][h], ones16);
              if constexpr (WIDE) ia = combine_planes<ACT>(ia, _mm256_madd_epi16(sum[t][1][h], ones16));
            }
            if constexpr (kDeferred) {
              _mm256_store_si256(reinterpret_cast<__m256i*>(isum[blk - g_run * per_group][t][h]), ia);
            } else {
              const __m256 d = _mm256_set1_ps(a.xd[(t0 + t) * blocks + blk]);
              acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(s[h], d), acc[t][h]);
            }
          }
      }
      if constexpr (!kDeferred) add_group_bias<TT, F16S>(w, a, p, t0, g, acc);
    }
    if constexpr (kDeferred) {  // the run's float epilogue, from isum
      for (int g = g_run; g < g_end; ++g) {
        const __m256 s[2] = {load8v<F16S>(w.scales, p * groups + g, 0), load8v<F16S>(w.scales, p * groups + g, 1)};
        for (int bb = 0; bb < per_group; ++bb) {
          const int blk = g * per_group + bb;
          for (int t = 0; t < TT; ++t) {
            const __m256 d = _mm256_set1_ps(a.xd[(t0 + t) * blocks + blk]);
            for (int h = 0; h < 2; ++h) {
              const __m256i ia = _mm256_load_si256(reinterpret_cast<const __m256i*>(isum[blk - g_run * per_group][t][h]));
              acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(s[h], d), acc[t][h]);
            }
          }
        }
        add_group_bias<TT, F16S>(w, a, p, t0, g, acc);
      }
    }
  }
  for (int t = 0; t < TT; ++t) {
    _mm256_storeu_ps(acc_out[t], acc[t][0]);
    _mm256_storeu_ps(acc_out[t] + 8, acc[t][1]);
  }
}

// 8-bit weights: one half of a panel (8 rows, 4 k per 32-bit lane) at a time, each weight vector meeting
// every token's activation words; (q - 128) x x with the sign trick, widened every chunk (|q - 128| x |x| x 2
// <= 32512 fits, two would not); the block sum then gets 128 sum(x) back (xisum). Float sums in acc_out (L1),
// the same epilogue as the 4-bit tile. (Why this order, and what the earlier per-token block_dot cost:
// docs/quantized-kernels.md, "AVX2 on an AVX2-only CPU".)
template <int TT, bool F16S, int ACT>
void tile_8bit(const QmmWeights& w, const QmmActs& a, int64_t p, int64_t t0, float acc_out[][R]) {
  const int K = w.K, groups = K / w.group_size, per_group = w.group_size / kActBlock, blocks = K / kActBlock;
  constexpr bool WIDE = act_two_planes(ACT);
  constexpr int planes = WIDE ? 2 : 1;
  constexpr int block_bytes = kActBlock * R;
  const uint8_t* panel = w.q + p * panel_bytes(w);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int t = 0; t < TT; ++t) {
    _mm256_storeu_ps(acc_out[t], _mm256_setzero_ps());
    _mm256_storeu_ps(acc_out[t] + 8, _mm256_setzero_ps());
  }
  for (int g = 0; g < groups; ++g) {
    prefetch_group<F16S>(w, p, g, groups);
    for (int bb = 0; bb < per_group; ++bb) {
      const int blk = g * per_group + bb;
      const uint8_t* wq = panel + static_cast<int64_t>(blk) * block_bytes;
      for (int line = 0; line < block_bytes; line += 64) prefetch(wq + kPrefetchBytes + line);
      const int32_t* x[TT][planes];
      block_words<TT, ACT>(a, t0, blk, K, x);
      for (int h = 0; h < 2; ++h) {
        __m256i sum[TT][planes];  // int32 row sums
        for (int t = 0; t < TT; ++t)
          for (int l = 0; l < planes; ++l) sum[t][l] = _mm256_setzero_si256();
        for (int o = 0; o < 8; ++o) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + o * 64 + h * 32));
          const __m256i ws = _mm256_xor_si256(v, flip);  // q - 128 as int8
          const __m256i wa = _mm256_abs_epi8(ws);
          for (int t = 0; t < TT; ++t) {
            for (int l = 0; l < planes; ++l) {
              const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x[t][l][o]), ws);
              const __m256i products = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, sx), ones16);
              sum[t][l] = in_order(_mm256_add_epi32(sum[t][l], products));
            }
          }
        }
        const __m256 s = load8v<F16S>(w.scales, p * groups + g, h);
        for (int t = 0; t < TT; ++t) {
          __m256i ia = sum[t][0];
          if constexpr (WIDE) ia = combine_planes<ACT>(ia, sum[t][planes - 1]);
          const int64_t row = t0 + t;
          ia = _mm256_add_epi32(ia, _mm256_set1_epi32(128 * a.xisum[row * blocks + blk]));
          const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(a.xd[row * blocks + blk]));
          float* acc = acc_out[t] + 8 * h;
          _mm256_storeu_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), sd, _mm256_loadu_ps(acc)));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 m = bias8v<F16S>(w, p * groups + g, h);
      for (int t = 0; t < TT; ++t) {
        float* acc = acc_out[t] + 8 * h;
        _mm256_storeu_ps(acc, _mm256_fmadd_ps(m, _mm256_set1_ps(a.xsum[(t0 + t) * groups + g]), _mm256_loadu_ps(acc)));
      }
    }
  }
}

// 4-bit weights: int8 activations in one pass, two planes in pairs of tokens.
template <int TT, bool F16S, int ACT, bool UNPACKED>
void tile_4bit(const QmmWeights& w, const QmmActs& a, int64_t p, int64_t t0, float acc_out[][R]) {
  if constexpr (TT <= 2 || !act_two_planes(ACT)) {
    tile_both_halves<TT, F16S, ACT, UNPACKED>(w, a, p, t0, acc_out);
  } else {
    tile_both_halves<2, F16S, ACT, UNPACKED>(w, a, p, t0, acc_out);
    tile_both_halves<TT - 2, F16S, ACT, UNPACKED>(w, a, p, t0 + 2, acc_out + 2);
  }
}

// One panel x TT tokens (run_panels' tile): 4-bit weights packed or unpacked (unpack_panel), 8-bit
// weights in one pass.
template <int TT, int BITS, bool F16S, int ACT>
void tile(const QmmWeights& w, const QmmActs& a, int64_t p, int64_t t0, float acc_out[][R]) {
  if constexpr (BITS == 4) {
    (w.unpacked ? tile_4bit<TT, F16S, ACT, true> : tile_4bit<TT, F16S, ACT, false>)(w, a, p, t0, acc_out);
  } else {
    tile_8bit<TT, F16S, ACT>(w, a, p, t0, acc_out);
  }
}

#elif defined(METRALE_QMM_NEON)

#include "qmm_neon.h"

#else  // scalar

template <int TT, int BITS, bool F16S, int ACT>
void tile(const QmmWeights& w, const QmmActs& a, int64_t p, int64_t t0, float acc_out[][R]) {
  const int K = w.K, groups = K / w.group_size, per_group = w.group_size / kActBlock, blocks = K / kActBlock;
  const uint8_t* wq = w.q + p * panel_bytes(w);
  constexpr int chunks = BITS == 4 ? 4 : 8;  // 64-byte chunks per block of 32 k
  constexpr bool WIDE = act_two_planes(ACT);
  constexpr int hw = act_hi_weight(ACT);
  float acc[TT][R] = {};
  for (int g = 0; g < groups; ++g) {
    float s[R], m[R];
    load16<F16S>(w.scales, p * groups + g, s);
    load16<F16S>(w.biases, p * groups + g, m);
    for (int bb = 0; bb < per_group; ++bb) {
      const int blk = g * per_group + bb;
      int32_t ia[TT][R] = {};
      for (int o = 0; o < chunks; ++o, wq += 64) {
        for (int t = 0; t < TT; ++t) {
          const int64_t at = act_at(t0 + t, blk, K, ACT) + o * (BITS == 4 ? 8 : 4);
          for (int r = 0; r < R; ++r) {
            int32_t sum = 0;
            for (int j = 0; j < 4; ++j) {
              const int32_t byte = wq[4 * r + j];
              // the two-plane activation hw hi + lo, or the int8 one
              const int32_t x0 = WIDE ? hw * a.xq[at + j] + a.xq[at + kActBlock + j] : a.xq[at + j];
              if constexpr (BITS == 4) {
                const int32_t x1 = WIDE ? hw * a.xq[at + 4 + j] + a.xq[at + kActBlock + 4 + j] : a.xq[at + 4 + j];
                sum += (byte & 15) * x0 + (byte >> 4) * x1;
              } else {
                sum += byte * x0;
              }
            }
            ia[t][r] += sum;
          }
        }
      }
      for (int t = 0; t < TT; ++t) {
        const float d = a.xd[(t0 + t) * blocks + blk];
        for (int r = 0; r < R; ++r) acc[t][r] += static_cast<float>(ia[t][r]) * (s[r] * d);
      }
    }
    for (int t = 0; t < TT; ++t)
      for (int r = 0; r < R; ++r) acc[t][r] += m[r] * a.xsum[(t0 + t) * groups + g];
  }
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) acc_out[t][r] = acc[t][r];
}

#endif

// ---- the panel loop ----

using TileFn = void (*)(const QmmWeights&, const QmmActs&, int64_t, int64_t, float[][R]);

template <int BITS, bool F16S, int ACT, int... TT>
constexpr auto make_tiles(std::integer_sequence<int, TT...>) {
  struct Tiles { TileFn fn[sizeof...(TT)]; };
  return Tiles{{tile<TT + 1, BITS, F16S, ACT>...}};
}

// act(gate) * up of one 16-column tile row (GatedKind kind).
inline void glu_row(int kind, const float* gate, const float* up, float* out) {
  for (int c = 0; c < R; c += kW) {
    const v8f g = kernel::load8(gate + c), u = kernel::load8(up + c);
    kernel::store8(out + c, kind == static_cast<int>(GatedKind::silu) ? kernel::SiluMul{}(g, u)
                                                                      : kernel::GeluTanhMul{}(g, u));
  }
}

#if defined(METRALE_QMM_AVX512)
#include "qmm_gemm_avx512.h"
// from here run_panels takes gemm::run_gemm (qmm_gemm_avx512.h): at 8 tokens (a decode step of 8 streams)
// its 8-token tile beats tile()'s by 8-15% on the 1B shape, at 4 the packing costs more than it gains
constexpr int64_t kGemmMinTokens = 8;
#endif

template <int BITS, bool F16S, int ACT>
void run_panels(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end,
                int64_t t_begin, int64_t t_end) {
  static constexpr auto tiles = make_tiles<BITS, F16S, ACT>(std::make_integer_sequence<int, kMaxTile>{});
#if defined(METRALE_QMM_AVX512)
  // (int8 activations stay on tile(): 8 vpdpbusd per token and block, the GEMM's packing does not pay)
  if (ACT != 8 && t_end - t_begin >= kGemmMinTokens)
    return gemm::run_gemm<BITS, F16S, ACT>(w, a, o, p_begin, p_end, t_begin, t_end);
#endif
  alignas(64) float acc[kMaxTile][R], up[kMaxTile][R];
#if defined(METRALE_QMM_AVX2)
  const int64_t unpacked_bytes = int64_t{R} * w.K;
  thread_local UnpackBuffer unpack_buffer;
  uint8_t* const unpacked = BITS == 4 && t_end - t_begin >= kUnpackMinTokens
                                ? unpack_buffer.at_least(2 * unpacked_bytes)  // gate and up; null: read packed
                                : nullptr;
#endif
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int64_t col0 = (p - o.first_panel) * R;
    const int cols = static_cast<int>(kernel::min_of<int64_t>(R, o.columns - col0));
    // the panel the tiles read (and the GLU's up panel), and its index there: w's, or an unpacked copy
    QmmWeights first = w, second = w;
    int64_t first_p = o.glu < 0 ? p : 2 * p, second_p = 2 * p + 1;
#if defined(METRALE_QMM_AVX2)
    if (unpacked != nullptr) {
      unpack_panel(w, first_p, unpacked);
      first = unpacked_view(w, first_p, unpacked), first_p = 0;
      if (o.glu >= 0) {
        unpack_panel(w, second_p, unpacked + unpacked_bytes);
        second = unpacked_view(w, second_p, unpacked + unpacked_bytes), second_p = 0;
      }
    }
#endif
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kMaxTile) {
      const int tt = static_cast<int>(kernel::min_of<int64_t>(kMaxTile, t_end - t0));
      if (o.glu < 0) {
        tiles.fn[tt - 1](first, a, first_p, t0, acc);
      } else {  // pair p: gate panel 2p, up panel 2p + 1
        tiles.fn[tt - 1](first, a, first_p, t0, acc);
        tiles.fn[tt - 1](second, a, second_p, t0, up);
        for (int t = 0; t < tt; ++t) glu_row(o.glu, acc[t], up[t], acc[t]);
      }
      for (int t = 0; t < tt; ++t) std::memcpy(o.out + (t0 + t) * o.ld + col0, acc[t], sizeof(float) * cols);
    }
  }
}

// The tasks run_panels wants (qmm.cpp cuts a call into them): 4 panels over a token block, or 8 where
// the avx512 GEMM runs, which packs a task's token block once for all its panels (8 panels amortize the
// packing, 4 do not; 16 starve a thread of the 2048-row q/o at 16-32 tokens).
inline QmmTaskShape task_shape(int act_bits, int64_t tokens) {
#if defined(METRALE_QMM_AVX512)
  if (act_bits != 8 && tokens >= kGemmMinTokens) return {16, 2 * kPanelsPerTask};
#else
  (void)act_bits, (void)tokens;
#endif
  return {16, kPanelsPerTask};
}

template <int ACT>
void panels_of(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end,
               int64_t t_begin, int64_t t_end) {
  if (w.bits == 4) {
    (w.f16_scales ? run_panels<4, true, ACT> : run_panels<4, false, ACT>)(w, a, o, p_begin, p_end, t_begin, t_end);
  } else {
    (w.f16_scales ? run_panels<8, true, ACT> : run_panels<8, false, ACT>)(w, a, o, p_begin, p_end, t_begin, t_end);
  }
}

inline void panels(const QmmWeights& w, const QmmActs& a, const QmmOut& o, int64_t p_begin, int64_t p_end,
                   int64_t t_begin, int64_t t_end) {
  (a.bits == 16 ? panels_of<16> : a.bits == 12 ? panels_of<12> : panels_of<8>)(w, a, o, p_begin, p_end, t_begin,
                                                                                t_end);
}

}  // namespace metrale::METRALE_ISA_NS::qmm
