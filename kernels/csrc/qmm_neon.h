// The arm64 (NEON) tile of the quantized matmul: one panel (16 rows) x TT <= 4 tokens over all of K,
// on the packed layout of kernel_table.h, computing what the AVX-512 and AVX2 tiles compute.
//
// Included by qmm_kernel.h inside namespace metrale::METRALE_ISA_NS::qmm (it uses R, panel_bytes,
// prefetch, kPrefetchBytes/Groups from there; <arm_neon.h> is included at its top), only in the kernel
// sets neon and neon_dotprod (CMakeLists.txt: METRALE_ISA_NEON, and METRALE_ISA_DOTPROD for the latter):
//   neon_dotprod  -march=armv8.2-a+dotprod: SDOT by element (vdotq_laneq_s32), the 4 int8 weights of
//                 each 32-bit lane times one 4-byte word of the activations (an immediate lane of the
//                 register holding them), summed into that lane: vpdpbusd on 128 bits (s8 x s8)
//   neon          armv8-a baseline: the word broadcast (vdupq_laneq_s32), vmull_s8 (s8 x s8 -> s16), a
//                 pairwise add (s16) and vpadalq_s16 (pairs -> s32): the same 4-product lane sums;
//                 every pair sum fits int16 (below)
// One 16-byte vector is 4 rows x 4 k of a 64-byte chunk (vector i: rows 4i .. 4i + 3, one row per
// lane), so the 16 row sums of a chunk are 4 int32x4 accumulators, as on x86 one zmm or two ymm.
//
// SDOT multiplies signed by signed, so 8-bit weights (0..255) enter as q - 128 (an XOR of the top bit),
// and the block sum gets 128 * sum(X) back (xisum), as the AVX2 tile does; 4-bit nibbles (0..15) are
// already non-negative int8. int16 activations X = 255 hi + lo take two dot products (hi, lo), combined
// as 255 * sum(q hi) + sum(q lo) before the 128 * xisum correction: every integer is the exact sum_k q X.
// The float epilogue is the AVX-512 one, in the same order: per block acc = fma(float(ia), s * d, acc),
// per group acc = fma(bias, xsum, acc), each a fused multiply-add (vfmaq_f32) with round-to-nearest
// conversions, so for the same quantized activations the outputs are the x86 sets' bit for bit
// (tests/kernels/test_arm_qmm.py compares them).
//
// Int16 headroom of the plain NEON pair sums: |q - 128| <= 128 and |x| <= 127 give |product| <= 16256,
// a pair <= 32512 < 32767; 4-bit: 15 * 127 * 2 = 3810.
#pragma once

// The set decides, not the compiler's default target (Apple's clang targets the M1, which has SDOT):
// neon stays the plain-NEON fallback wherever it is built.
#if defined(METRALE_ISA_DOTPROD) && !defined(__ARM_FEATURE_DOTPROD)
#error "the neon_dotprod set needs -march=armv8.2-a+dotprod (CMakeLists.txt)"
#endif

// GCC's pre-register-allocation scheduler (on by default for arm64, off for x86-64) hoists a whole
// block's weight loads and spills the sums to make room: without it the 1-token tiles of neon_dotprod
// have no stack access in their block loop (13-14 per block with it, int16 activations) and the 4-token
// ones 28-39% fewer (aarch64-linux-gnu-g++ 12, counted in the disassembly; not timed: no ARM hardware).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-schedule-insns")
#endif

// 16 int32 row sums of a panel: rows 4i .. 4i + 3 in v[i].
struct Rows16 {
  int32x4_t v[4];
};

// Inlined whatever GCC's size heuristics say: the chunks are unrolled at compile time, and a block_dot
// left out of line returns its sums through memory.
#define METRALE_NEON_INLINE inline __attribute__((always_inline))

// acc[lane] += sum_{j < 4} w[4 lane + j] * x[4 WORD + j], x the 32 activation bytes of a block in two
// registers: int32 word WORD of them against each row's 4 bytes (int8 x int8 -> int32).
template <int WORD>
METRALE_NEON_INLINE int32x4_t dot_word(int32x4_t acc, int8x16_t w, const int8x16_t x[2]) {
#if defined(METRALE_ISA_DOTPROD)
  return vdotq_laneq_s32(acc, w, x[WORD / 4], WORD % 4);  // SDOT by element: no broadcast needed
#else
  const int8x16_t xw = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x[WORD / 4]), WORD % 4));
  const int16x8_t rows01 = vmull_s8(vget_low_s8(w), vget_low_s8(xw));  // rows 4i, 4i + 1: 4 products each
  const int16x8_t rows23 = vmull_high_s8(w, xw);                       // rows 4i + 2, 4i + 3
  return vpadalq_s16(acc, vpaddq_s16(rows01, rows23));                 // pairs, then pairs of pairs
#endif
}

// The activation words WORD of both halves (WIDE: hi into hi, lo into lo) against weight vector w of rows
// 4i .. 4i + 3: each weight vector serves both dots at once.
template <bool WIDE, int WORD>
METRALE_NEON_INLINE void dot_both(int i, int8x16_t w, const int8x16_t h[2], const int8x16_t l[2], Rows16& hi,
                                  Rows16& lo) {
  hi.v[i] = dot_word<WORD>(hi.v[i], w, h);
  if constexpr (WIDE) lo.v[i] = dot_word<WORD>(lo.v[i], w, l);
}

// Chunk O (64 bytes: 16 rows x 4 k, or 8 k in nibbles) of a block.
template <int BITS, bool WIDE, int O>
METRALE_NEON_INLINE void chunk_dot(const uint8_t* wq, const int8x16_t h[2], const int8x16_t l[2], Rows16& hi,
                                   Rows16& lo) {
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t v = vld1q_u8(wq + 64 * O + 16 * i);
    if constexpr (BITS == 4) {
      dot_both<WIDE, 2 * O>(i, vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), h, l, hi, lo);  // k 8O .. 8O + 3
      dot_both<WIDE, 2 * O + 1>(i, vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), h, l, hi, lo);           // k 8O + 4 .. + 7
    } else {
      dot_both<WIDE, O>(i, vreinterpretq_s8_u8(veorq_u8(v, vdupq_n_u8(0x80))), h, l, hi, lo);  // q - 128
    }
  }
}

template <int BITS, bool WIDE, int... O>
METRALE_NEON_INLINE void chunks_dot(std::integer_sequence<int, O...>, const uint8_t* wq, const int8x16_t h[2],
                                    const int8x16_t l[2], Rows16& hi, Rows16& lo) {
  (chunk_dot<BITS, WIDE, O>(wq, h, l, hi, lo), ...);
}

// The int32 row sums of one block of 32 k (BITS 4: 4 chunks of 64 bytes, 8: 8 chunks) against the 32
// activations of the block: int8 ones in xh, or (WIDE) int16 ones as xh = hi, xl = lo. The activations
// stay in 2 (or 4) registers. For 8 bits the sums are of (q - 128) x: the caller adds 128 sum(X).
template <int BITS, int ACT>
METRALE_NEON_INLINE Rows16 block_dot(const uint8_t* wq, const int8_t* xh, const int8_t* xl) {
  constexpr bool WIDE = act_two_planes(ACT);
  int8x16_t h[2] = {vld1q_s8(xh), vld1q_s8(xh + 16)}, l[2] = {};
  if constexpr (WIDE) l[0] = vld1q_s8(xl), l[1] = vld1q_s8(xl + 16);
  Rows16 hi, lo;
  for (int i = 0; i < 4; ++i) hi.v[i] = lo.v[i] = vdupq_n_s32(0);
  chunks_dot<BITS, WIDE>(std::make_integer_sequence<int, BITS == 4 ? 4 : 8>{}, wq, h, l, hi, lo);
  if constexpr (ACT == 16)  // 255 hi + lo: the dot with X
    for (int i = 0; i < 4; ++i) hi.v[i] = vaddq_s32(vsubq_s32(vshlq_n_s32(hi.v[i], 8), hi.v[i]), lo.v[i]);
  if constexpr (ACT == 12)  // 16 hi + lo
    for (int i = 0; i < 4; ++i) hi.v[i] = vaddq_s32(vshlq_n_s32(hi.v[i], 4), lo.v[i]);
  return hi;
}

// The 16 scales (or biases) of panel p, group g (index p * groups + g), as 4 float32x4.
template <bool F16S>
inline void load16q(const void* base, int64_t index, float32x4_t out[4]) {
  for (int i = 0; i < 4; ++i) {
    if constexpr (F16S) {
      const uint16_t* h = static_cast<const uint16_t*>(base) + index * R + 4 * i;
      out[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));  // exact
    } else {
      out[i] = vld1q_f32(static_cast<const float*>(base) + index * R + 4 * i);
    }
  }
}

template <int TT, int BITS, bool F16S, int ACT>
void tile(const QmmWeights& w, const QmmActs& a, int64_t p, int64_t t0, float acc_out[][R]) {
  const int K = w.K, groups = K / w.group_size, per_group = w.group_size / kActBlock, blocks = K / kActBlock;
  constexpr int block_bytes = kActBlock * R * BITS / 8;
  const uint8_t* wq = w.q + p * panel_bytes(w);
  float32x4_t acc[TT][4];
  for (int t = 0; t < TT; ++t)
    for (int i = 0; i < 4; ++i) acc[t][i] = vdupq_n_f32(0.0f);
  for (int g = 0; g < groups; ++g) {
    prefetch(static_cast<const char*>(w.scales) + (p * groups + g + kPrefetchGroups) * R * (F16S ? 2 : 4));
    prefetch(static_cast<const char*>(w.biases) + (p * groups + g + kPrefetchGroups) * R * (F16S ? 2 : 4));
    float32x4_t s[4], m[4];
    load16q<F16S>(w.scales, p * groups + g, s);
    load16q<F16S>(w.biases, p * groups + g, m);
    for (int bb = 0; bb < per_group; ++bb, wq += block_bytes) {
      const int blk = g * per_group + bb;
      for (int line = 0; line < block_bytes; line += 64) prefetch(wq + kPrefetchBytes + line);
      for (int t = 0; t < TT; ++t) {
        const int64_t row = t0 + t, at = act_at(row, blk, K, ACT);
        Rows16 ia = block_dot<BITS, ACT>(wq, a.xq + at, act_two_planes(ACT) ? a.xq + at + kActBlock : nullptr);
        if constexpr (BITS == 8) {
          const int32x4_t shift = vdupq_n_s32(128 * a.xisum[row * blocks + blk]);
          for (int i = 0; i < 4; ++i) ia.v[i] = vaddq_s32(ia.v[i], shift);
        }
        const float d = a.xd[row * blocks + blk];
        for (int i = 0; i < 4; ++i)
          acc[t][i] = vfmaq_f32(acc[t][i], vcvtq_f32_s32(ia.v[i]), vmulq_n_f32(s[i], d));
      }
    }
    for (int t = 0; t < TT; ++t) {
      const float32x4_t xs = vdupq_n_f32(a.xsum[(t0 + t) * groups + g]);
      for (int i = 0; i < 4; ++i) acc[t][i] = vfmaq_f32(acc[t][i], m[i], xs);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int i = 0; i < 4; ++i) vst1q_f32(acc_out[t] + 4 * i, acc[t][i]);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
