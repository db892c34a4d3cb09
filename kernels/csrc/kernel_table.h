// The contract between the MLX primitives (compiled once, for the baseline CPU) and the compute
// kernels (compiled once per instruction set in isa_kernels.cpp): plain structs and one table of
// function pointers per instruction set. No MLX header and no inline code here, so nothing compiled
// with AVX-512 flags can be linked into code that runs on a CPU without AVX-512.
#pragma once

#include <cstdint>

namespace metrale {

// q8: an int8 KV pool whose rows (one per slot and kv head) hold head_dim int8 values, then one float16
// scale per group of q8_group values (kv_row = head_dim + 2 * head_dim / q8_group bytes): value = int8 * scale.
enum class Dtype : int { float32 = 0, float16 = 1, bfloat16 = 2, q8 = 3 };
enum class GatedKind : int { silu = 0, gelu_tanh = 1 };

// The KV pool layout, the one place it is decided in C++ (kvcache/storage.py in Python): a pool is
// (num_blocks, n_kv, block_size, kv_row) elements, so each kv head's rows of one block are one contiguous run.
// The row of key slot `o` of `block` for kv head g starts this many elements into the pool. (A layout of
// (slot, kv head) rows put one head's rows a slot apart, a power of two that shared few L1 sets and left
// the hardware prefetchers little to follow: decode attention from memory took 1.3-1.55x the cycles.)
constexpr int64_t kv_row_offset(int64_t block, int g, int o, int n_kv, int block_size, int kv_row) {
  return ((block * n_kv + g) * block_size + o) * kv_row;
}

constexpr int kMaxHeadDim = 256;    // paged decode rejects larger head_dim (stack buffers)
constexpr int kDecodeScratchRows = 8;  // query heads a decode tile pass handles at once (per kv head)
constexpr int kDecodeTileKeys = 64;    // keys per online-softmax update of a decode task (across blocks)

// floats of scratch one decode task needs: pre-scaled queries, one tile's probabilities, q8 scales
constexpr int64_t decode_scratch_floats(int n_heads, int head_dim) {
  return static_cast<int64_t>(n_heads) * head_dim + static_cast<int64_t>(kDecodeScratchRows) * kDecodeTileKeys +
         static_cast<int64_t>(kDecodeTileKeys) * (head_dim / 8);
}

struct DecodeDims {
  int batch, n_heads, n_kv, head_dim, max_blocks, block_size, window;
  int64_t num_blocks;
  float scale;
  int kv_row;    // pool elements per (kv head, slot) row: head_dim, or head_dim + 2 * groups bytes for q8
  int q8_group;  // q8 pools: values per float16 scale (a multiple of 8 dividing head_dim); else 0
};

// Paged prefill attention (attention_kernel.h): one sequence's chunk of q_len queries at positions
// first_position .. first_position + q_len - 1 over its paged context, flash style (key tiles of
// kPrefillKeys, online softmax), one task per (kv head, tile of up to kPrefillQueries queries: all of
// them at head_dim <= 64, half above, paged_prefill.cpp).
constexpr int kPrefillKeys = 32;
constexpr int kPrefillQueries = 32;
constexpr int kPrefillRowPad = 16;  // a task's rows (queries x rep) are padded to whole 16-float vectors

constexpr int prefill_padded_rows(int rows) { return (rows + kPrefillRowPad - 1) / kPrefillRowPad * kPrefillRowPad; }

struct PrefillDims {
  int q_len, n_heads, n_kv, head_dim, max_blocks, block_size, window, first_position;
  int64_t num_blocks;
  float scale;
  int kv_row;    // as DecodeDims
  int q8_group;
};

// floats of scratch one prefill task of `rows` rows needs: queries^T, outputs, widened K and V tiles,
// scores^T, max, sum, rescale (rows padded: prefill_padded_rows)
constexpr int64_t prefill_scratch_floats(int rows, int head_dim) {
  const int64_t rp = prefill_padded_rows(rows);
  return rp * head_dim * 2 + 2LL * head_dim * kPrefillKeys + rp * kPrefillKeys + 3 * rp;
}

// floats one part of a split prefill task writes for its `rows` rows: O (rows, hd), m (rows,), l (rows,)
constexpr int64_t prefill_part_floats(int rows, int head_dim) { return static_cast<int64_t>(rows) * (head_dim + 2); }

// Quantized matmul (qmm_kernel.h). A weight W (N, K) in MLX's affine form, w = q * scale + bias per
// group of `group_size` along K, repacked at load (kernels/qmm.py) into panels of 16 rows:
//   q       uint8 (P, 16 * K * bits / 8), panel p holds rows 16p .. 16p + 15:
//           bits 8: K / 4 chunks of 64 bytes, byte 4r + j = q[16p + r][4c + j]
//           bits 4: K / 8 chunks of 64 bytes, byte 4r + j = q[16p + r][8c + j] | q[16p + r][8c + 4 + j] << 4
//   scales  (P, K / group_size, 16) float16 bits or float32, biases the same
constexpr int kPanelRows = 16;
constexpr int kActBlock = 32;  // activations are quantized to int8 per 32 values

struct QmmWeights {
  const uint8_t* q;
  const void* scales;
  const void* biases;
  int64_t panels;  // P
  int K, bits, group_size;
  bool f16_scales;  // scales / biases are float16 bits (else float32)
  bool unpacked = false;  // bits 4 with one byte per weight (AVX2 run_panels' unpack_panel), else as above
  // nonzero: every bias is exactly bias_per_scale x its scale (symmetric formats: Q4_0 -8, Q8_0 -128), so the
  // AVX2 / AVX-512 tiles and the VNNI GEMM compute the biases instead of reading them (the stream a decode step
  // waits on loses 2 of its 20 bytes per 32 weights); 0: read them. The biases stay valid either way (the
  // scalar, NEON and AMX tiles read them).
  float bias_per_scale = 0.0f;
};

// Activations x (T, K) float32 quantized per row and block of 32 values, m = max|x| per block, to
// `bits` 8, 12 or 16:
//   8   X = round(x / d), d = m / 127:        one int8 plane, xq (T, K) = X
//   12  X = round(x / d), d = m / kMidMax:    X = 16 hi + lo, hi = X >> 4 (-127..127), lo = X & 15 (0..15)
//   16  X = round(x / d), d = m / kWideMax:   X = 255 hi + lo, |hi|, |lo| <= 127
//   12 and 16 (two planes) are stored interleaved per block: xq (T, 2K), block b of token t is 64 bytes,
//   [hi 32 | lo 32] (one 64-byte AMX tile row per token and block: with 4-bit weights the int12 block is
//   one K = 64 tile product against [16 q ; q]); act_at says where a block starts.
//   xd (T, K / 32) float32 the d;  xisum (T, K / 32) int32 sums of X per block;
//   xsum (T, K / group_size) float32 sums of the quantized x (d X) per weight group (the bias term).
constexpr int kWideMax = 127 * 256;  // |X| <= 32512: |hi| = |round(X / 255)| <= 127, |lo| <= 127
constexpr int kMidMax = 127 * 16;    // |X| <= 2032: hi = floor(X / 16) >= -127 (AVX2's sign trick needs > -128)

struct QmmActs {
  int8_t* xq;
  float* xd;
  float* xsum;
  int32_t* xisum;
  int64_t tokens;
  int K, group_size;
  int bits;  // 8, 12 or 16
};

constexpr bool act_two_planes(int bits) { return bits != 8; }
// X = act_hi_weight * hi + lo for two planes
constexpr int act_hi_weight(int bits) { return bits == 12 ? 16 : 255; }
// bytes of one token's row of xq
constexpr int64_t act_row_bytes(int K, int bits) { return act_two_planes(bits) ? 2 * int64_t{K} : K; }
// byte offset in xq of block `blk` of token t (its hi plane; the lo plane is kActBlock bytes further)
constexpr int64_t act_at(int64_t t, int blk, int K, int bits) {
  return (t * K + int64_t{blk} * kActBlock) * (act_two_planes(bits) ? 2 : 1);
}

// Where panel outputs go: out (T, ld) float32, panel p's row r lands in column 16 (p - first) + r
// when that is below `columns`. glu: panels come in (gate, up) pairs and one column holds
// act(gate) * up (kind as GatedKind).
struct QmmOut {
  float* out;
  int64_t ld;
  int64_t first_panel;
  int64_t columns;
  int glu;  // -1: plain; else a GatedKind
};

// How qmm.cpp should cut a compute-bound call (more than its few decode rows) into tasks for a set's
// qmm_panels: token blocks of at least min_tokens rows (and a multiple of 16), panels_per_task panels each.
struct QmmTaskShape {
  int64_t min_tokens;
  int64_t panels_per_task;
};
constexpr int64_t kPanelsPerTask = 4;  // the usual panels_per_task (and MoE's tasks, moe.cpp)

// Greedy argmax (sampling_kernel.h): a range of one row's maximum, the index of its first occurrence and the
// index of the range's first NaN (-1: none), all indices counted from the row's start.
struct ArgmaxPart {
  float value;
  int64_t index;
  int64_t first_nan;
};

// top_p sampling's first histogram (sampling_kernel.h candidate_masses): buckets of y over [floor, 0].
constexpr int kSelectBuckets = 2048;

// Paged prefill attention that converts the chunk's K/V once, then attends (prefill_amx.cpp: AMX-BF16 tiles).
// run_prefill allocates staged_bytes (64-byte aligned; 0: not for these dims, the set's prefill_task runs),
// runs stage over (kv head g, key blocks [b_begin, b_end) of key_blocks), then task over (kv head g, queries
// [q_begin, q_end): tiles of query_tile queries) with scratch_floats floats of scratch per thread.
struct PrefillStaged {
  int64_t (*staged_bytes)(const PrefillDims& dm, Dtype dtype);
  int (*query_tile)(const PrefillDims& dm);
  int64_t (*scratch_floats)(const PrefillDims& dm);
  int (*key_blocks)(const PrefillDims& dm);
  void (*stage)(const PrefillDims& dm, Dtype dtype, const void* k_pool, const void* v_pool, const int32_t* table,
                void* staged, int g, int b_begin, int b_end);
  void (*task)(const PrefillDims& dm, Dtype dtype, const float* q, const int32_t* table, const void* staged,
               float* out, float* scratch, int g, int q_begin, int q_end);
};

struct KernelTable {
  const char* isa;
  // paged decode attention: keys [key_begin, key_end) of one sequence, all its heads (attention_kernel.h);
  // acc (n_heads, hd) and ml (2, n_heads) get the partial (unnormalized output, max, sum), or with
  // normalize the attention output in acc
  void (*decode_task)(const DecodeDims& dm, Dtype dtype, const float* q, const void* k_pool, const void* v_pool,
                      const int32_t* table, int key_begin, int key_end, float* acc, float* ml, float* scratch,
                      bool normalize);
  // paged prefill attention: queries [q_begin, q_end) of the chunk, kv head g, its keys in [key_begin, key_end)
  // (prefill_kernel.h); part nullptr: normalized into out, else the part's (O, m, l) there (prefill_part_floats)
  void (*prefill_task)(const PrefillDims& dm, Dtype dtype, const float* q, const void* k_pool, const void* v_pool,
                       const int32_t* table, float* out, float* scratch, int g, int q_begin, int q_end,
                       int key_begin, int key_end, float* part);
  // rows [row_begin, row_end) of a (..., q_len, length) score tensor, masked softmax into dst
  void (*causal_softmax_rows)(const float* src, float* dst, int64_t row_begin, int64_t row_end, int length,
                              int q_len, int offset, int window);
  // out[i] = act(gate[i]) * up[i] for i in [begin, end)
  void (*gated)(GatedKind kind, Dtype dtype, const void* gate, const void* up, void* out, int64_t begin,
                int64_t end);
  // rows [r0, r1) of x (rows, D) float32: RMSNorm with weight w + w_offset (norm_rope_kernel.h)
  void (*rms_norm_rows)(const float* x, const float* w, float* out, int64_t r0, int64_t r1, int D, float eps,
                        float w_offset);
  // tokens [t0, t1) of x (T, H, D) float32 rotated by cos / sin (T, D / 2)
  void (*rope_rows)(const float* x, const float* cos, const float* sin, float* out, int64_t t0, int64_t t1, int H,
                    int D, bool traditional);
  // quantized matmul: quantize rows [t_begin, t_end) of x (T, K) into acts
  void (*qmm_quantize)(const float* x, const QmmActs& acts, int64_t t_begin, int64_t t_end);
  // quantized matmul: panels [p_begin, p_end) (pairs with glu) for tokens [t_begin, t_end) of acts
  void (*qmm_panels)(const QmmWeights& w, const QmmActs& acts, const QmmOut& out, int64_t p_begin, int64_t p_end,
                     int64_t t_begin, int64_t t_end);
  // quantized matmul: the task shape qmm_panels wants for a call of `tokens` rows of act_bits activations
  QmmTaskShape (*qmm_task_shape)(int act_bits, int64_t tokens);
  // greedy argmax over x[begin, end) of one float32 row
  ArgmaxPart (*argmax_range)(const float* x, int64_t begin, int64_t end);
  // one row x (V,) float32 sampled at a temperature by the inverse CDF at u (sampling_kernel.h); scratch holds
  // (V + 63) / 64 floats
  int32_t (*sample_full_row)(const float* x, int64_t V, float scale, float log2_min_p, float u, float* scratch);
  // log(sum(exp(x))) of one row x (V,) float32 (sampling_kernel.h)
  float (*logsumexp_row)(const float* x, int64_t V);
  // rows [r0, r1): h = x + residual, then out = RMSNorm(h) as rms_norm_rows (norm_rope_kernel.h)
  void (*add_rms_norm_rows)(const float* x, const float* residual, const float* w, float* h, float* out, int64_t r0,
                            int64_t r1, int D, float eps, float w_offset);
  // the scans of top_k / top_p sampling and top-n logprobs over one row (sampling_kernel.h)
  double (*candidate_masses)(const float* x, int64_t V, float m, float scale, float floor, float inv, float* y,
                             float* q, uint16_t* bucket, double* masses);
  void (*block_maxima)(const float* x, int64_t V, int64_t block, float* out);
  int64_t (*gather_at_least)(const float* x, int64_t V, float bound, int32_t* out);
  int64_t (*gather_bucket)(const uint16_t* bucket, int64_t V, int b, int32_t* out);
  // n float32 values written as dtype (not q8), rounded to nearest even as mlx's astype (activation_kernel.h)
  void (*store_floats)(const float* src, Dtype dtype, void* dst, int64_t n);
  // the staged prefill attention, nullptr where the set has none (then prefill_task runs)
  const PrefillStaged* prefill_staged = nullptr;
};

const KernelTable* kernel_table_scalar();
#if defined(__x86_64__) || defined(_M_X64)
const KernelTable* kernel_table_avx2();
const KernelTable* kernel_table_avx512();
const KernelTable* kernel_table_avx512_amx();  // avx512 with AMX int8 tiles for qmm_panels (qmm_amx.cpp)
const KernelTable* kernel_table_avx512_amx_attention();  // and AMX-BF16 prefill attention (prefill_amx.cpp)
#endif
#if defined(__aarch64__)
const KernelTable* kernel_table_neon();          // armv8-a: the quantized matmul on vmull_s8 (qmm_neon.h)
const KernelTable* kernel_table_neon_dotprod();  // armv8.2-a+dotprod: on SDOT
#endif

}  // namespace metrale
