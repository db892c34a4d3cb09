// Python bindings of the CPU kernels. NB_DOMAIN mlx (set in CMakeLists.txt) shares mlx's
// nanobind type registry, so mx.array arguments convert to mx::array without copies.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "activations.h"
#include "sampling.h"
#include "causal_softmax.h"
#include "gguf_read.h"
#include "isa.h"
#include "kv_write.h"
#include "moe.h"
#include "mlx/version.h"
#include "norm_rope.h"
#include "paged_decode.h"
#include "paged_prefill.h"
#include "parallel.h"
#include "qmm.h"
#include "weight_layout.h"

namespace nb = nanobind;
using namespace nb::literals;

#define METRALE_STR2(x) #x
#define METRALE_STR(x) METRALE_STR2(x)

NB_MODULE(_kernels, m) {
  m.doc() = "CPU kernels for MLX: paged attention, gated activations, quantized matmul (metrale)";
  // The mlx version these headers declare; the loader refuses to use a build for another version.
  m.attr("mlx_version") =
      METRALE_STR(MLX_VERSION_MAJOR) "." METRALE_STR(MLX_VERSION_MINOR) "." METRALE_STR(MLX_VERSION_PATCH);
  m.def("paged_decode", &metrale::paged_decode, "queries"_a, "k_pool"_a, "v_pool"_a, "block_tables"_a,
        "context_lens"_a, nb::kw_only(), "scale"_a, "block_size"_a, "window"_a = 0,
        "Decode attention over paged pools on the CPU stream.\n\n"
        "queries (B, n_heads, hd); k_pool, v_pool (num_blocks, n_kv_heads, block_size, hd)\n"
        "float32|float16|bfloat16;\n"
        "block_tables (B, max_blocks) int32; context_lens (B,) int32. Row b attends to positions\n"
        "max(0, ctx - window) .. ctx - 1 (window 0: all). Returns (B, n_heads, hd) float32.");
  m.def("paged_prefill", &metrale::paged_prefill, "queries"_a, "k_pool"_a, "v_pool"_a, "block_table"_a,
        nb::kw_only(), "first_position"_a, "scale"_a, "block_size"_a, "window"_a = 0,
        "Prefill attention of one sequence's chunk over its paged pools on the CPU stream, flash style.\n\n"
        "queries (q_len, n_heads, hd) at positions first_position..; k_pool, v_pool (num_blocks, n_kv_heads,\n"
        "block_size, hd) float32|float16|bfloat16; block_table (max_blocks,) int32. Position p attends to\n"
        "max(0, p - window + 1) .. p (window 0: 0 .. p). Returns (q_len, n_heads, hd) float32.");
  m.def("causal_softmax", &metrale::causal_softmax, "scores"_a, nb::kw_only(), "offset"_a, "window"_a = 0,
        "Softmax of scores (..., q_len, L) float32 where query i keeps keys j <= i + offset and, with\n"
        "window > 0, j > i + offset - window; 0 elsewhere. Returns float32 of the same shape.");
  m.def("silu_mul", &metrale::silu_mul, "gate"_a, "up"_a,
        "gate * sigmoid(gate) * up on the CPU stream (SwiGLU), fused and vectorized.\n\n"
        "gate, up: the same shape and dtype, float32|float16|bfloat16 (half types computed in float32).\n"
        "Returns that shape and dtype; ValueError for other shapes or dtypes.");
  m.def("gelu_tanh_mul", &metrale::gelu_tanh_mul, "gate"_a, "up"_a,
        "gelu_pytorch_tanh(gate) * up on the CPU stream (GeGLU), fused and vectorized:\n"
        "0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))) * up. Same contract as silu_mul.");
  m.def("cpu_isa", [] { return std::string(metrale::cpu_kernels().isa); },
        "The instruction set of the kernels in use: scalar, avx2 or avx512.");
  m.def("supported_isas", &metrale::supported_isas,
        "The kernel sets this build has and this CPU runs, best last.");
  m.def("qmm_task_shape",
        [](int activation_bits, int64_t tokens) {
          const metrale::QmmTaskShape s = metrale::cpu_kernels().qmm_task_shape(activation_bits, tokens);
          return std::make_pair(s.min_tokens, s.panels_per_task);
        },
        "activation_bits"_a, "tokens"_a,
        "(min_tokens, panels_per_task): how quantized_matmul cuts a compute-bound call of `tokens` rows into\n"
        "tasks for the kernel set in use (token blocks of at least min_tokens rows).");
  m.def("set_cpu_isa", &metrale::set_cpu_isa, "name"_a,
        "Use the kernel set `name` (one of supported_isas(), or 'auto'); ValueError otherwise.\n"
        "For tests and benchmarks: call it while no kernel runs.");
  m.def("set_num_threads", &metrale::set_num_threads, "n"_a,
        "Use n kernel threads (0: one per CPU this process may run on). Only before the first kernel runs:\n"
        "afterwards the count is fixed and this returns False unless it already is n.");
  m.def("num_threads", &metrale::num_threads, "The kernel threads in use (fixes the count).");
  m.def("set_spin_us", &metrale::set_spin_us, "us"_a,
        "How long an idle kernel thread spins before it sleeps, in microseconds (0: never).");
  m.def("quantized_matmul", &metrale::quantized_matmul, "x"_a, "q"_a, "scales"_a, "biases"_a, nb::kw_only(),
        "bits"_a, "group_size"_a, "columns"_a, "glu"_a = -1, "activation_bits"_a = 16, "bias_per_scale"_a = 0.0f,
        "x (..., K) float32 times packed affine weights (kernels/qmm.py), on the CPU stream.\n\n"
        "Returns one float32 (..., columns[j]) array per output j; with glu 0 (silu) or 1 (gelu_tanh)\n"
        "one output act(x Wg^T) * (x Wu^T) from (gate, up) panel pairs. activation_bits: 8 (int8\n"
        "activations per 32 values, as llama.cpp), 12 (int12, as two int8 planes) or 16 (int16, as two int8\n"
        "halves). bias_per_scale: nonzero when every bias is exactly that times its scale (Q4_0: -8,\n"
        "Q8_0: -128): the AVX2 / AVX-512 kernels then compute the biases instead of reading them.");
  m.def("quantized_rows", &metrale::quantized_rows, "q"_a, "scales"_a, "biases"_a, "ids"_a, nb::kw_only(),
        "bits"_a, "group_size"_a, "rows"_a,
        "Rows `ids` of a packed weight with `rows` rows, dequantized: (*ids.shape, K) float32.");
  m.def("pack_panels", &metrale::pack_panels, "packed"_a, "scales"_a, "biases"_a, nb::kw_only(), "bits"_a,
        "group_size"_a, "interleave"_a = false, "huge_pages"_a = true,
        "MLX affine weights (lists: packed (N_l, K * bits / 32) uint32, scales and biases (N_l, K / group_size)\n"
        "float16 or float32) in the kernels' panel layout, written once into their final buffers (on 2 MiB\n"
        "pages where allowed): [q (P, 16 * K * bits / 8) uint8, scales (P, K / group_size, 16), biases].\n"
        "Layers' panels in order, or with interleave (two layers of one shape) gate p at 2p, up p at 2p + 1.");
  m.def("read_gguf_tensor", &metrale::read_gguf_tensor, "path"_a, "position"_a, "ggml_type"_a, "shape"_a,
        "The GGUF tensor of ggml type `ggml_type` at byte `position` of `path` (MLX shape `shape`), read with\n"
        "ordinary reads into its final arrays, as mx.load returns it: [array] for F32/F16/I8/I16/I32, [packed\n"
        "uint32, scales, biases float16] (group 32) for Q4_0/Q4_1/Q8_0.");
  m.def("gguf_block_values", &metrale::gguf_block_values,
        "The ggml tensor types read_gguf_tensor reads -> values per block (1 for F32/F16/I8/I16/I32).");
  m.def("huge_page_copy", &metrale::huge_page_copy, "a"_a,
        "`a` copied into memory advised for 2 MiB transparent huge pages (MADV_HUGEPAGE), starting at a\n"
        "2 MiB boundary; `a` itself where THP is off, on other OSes, or under 2 MiB.");
  m.def("anon_huge_page_bytes", &metrale::anon_huge_page_bytes,
        "This process's bytes on transparent huge pages (AnonHugePages, /proc/self/smaps_rollup); -1 unknown.");
  m.def("gather_quantized_matmul", &metrale::gather_quantized_matmul, "x"_a, "q"_a, "scales"_a, "biases"_a,
        "indices"_a, nb::kw_only(), "bits"_a, "group_size"_a, "columns"_a, "glu"_a = -1, "activation_bits"_a = 16,
        "bias_per_scale"_a = 0.0f,
        "Mixture-of-experts matmul (kernels/moe.py): row r of indices (R = T * top_k rows) multiplies\n"
        "x[r / top_k] (x (T, K) float32) by expert indices[r]'s packed weight (q (E, P, bytes), scales and\n"
        "biases (E, P, K / group_size, 16)). Returns (*indices.shape, columns) float32; glu and bias_per_scale\n"
        "as quantized_matmul.");
  m.def("rms_norm", &metrale::rms_norm, "x"_a, "weight"_a, nb::kw_only(), "eps"_a, "weight_offset"_a = 0.0f,
        "RMSNorm of x (..., D) float32 with weight (D,) float32 (+ weight_offset: 1 for gemma's 1 + w),\n"
        "one node on the CPU stream: (x / sqrt(mean(x^2) + eps)) * (weight + weight_offset).");
  m.def("add_rms_norm", &metrale::add_rms_norm, "x"_a, "residual"_a, "weight"_a, nb::kw_only(), "eps"_a,
        "weight_offset"_a = 0.0f,
        "[h, out] for x, residual (..., D) float32 of one shape and weight (D,) float32: h = x + residual and\n"
        "out = rms_norm(h, weight, eps, weight_offset), one node on the CPU stream (bit for bit the two ops).");
  m.def("rope_qk", &metrale::rope_qk, "q"_a, "k"_a, "cos"_a, "sin"_a, nb::kw_only(), "traditional"_a = false,
        "RoPE of q (T, Hq, D) and k (T, Hk, D) float32 by per-token cos / sin (T, D / 2), one node on the\n"
        "CPU stream: [q, k] rotated (half-split pairs, or interleaved ones when traditional).");
  m.def("kv_write", &metrale::kv_write, "pool"_a, "rows"_a, "slots"_a,
        "The pool (N, H, B, D) (blocks, kv heads, block size, row) with rows (T, H, D) written at slots (T,)\n"
        "int32 (slot s: row s % B of block s / B), one node on the CPU stream; in place when nothing else holds\n"
        "the old pool.");
  m.def("argmax_rows", &metrale::argmax_rows, "x"_a,
        "mx.argmax(x, axis=-1) for x (..., V) float32 on the CPU stream, threaded: (...) uint32, the first\n"
        "index of each row's maximum; a NaN counts as the largest value (the first NaN wins).");
  m.def("sample_full_rows", &metrale::sample_full_rows, "logits"_a, "scale"_a, "log2_min_p"_a, "uniforms"_a,
        "One token per row of logits (R, V) float32 by the inverse CDF of 2^((x - max) * scale) (0 below\n"
        "log2_min_p) at the row's uniform; scale, log2_min_p, uniforms (R,) float32. Returns (R,) int32.");
  m.def("sample_candidates_rows", &metrale::sample_candidates_rows, "logits"_a, "scale"_a, "log2_min_p"_a, "top_k"_a,
        "top_p"_a, "uniforms"_a,
        "top_k / top_p (+ min_p) sampling of logits (R, V) float32 by selection (kernels/csrc/sampling_select.h);\n"
        "top_k (R,) int32 (0: off), scale, log2_min_p, top_p (>= 1: off), uniforms (R,) float32. Returns (R,) int32.");
  m.def("top_ids_rows", &metrale::top_ids_rows, "x"_a, "n"_a,
        "The indices of the n largest values of each row of x (R, V) float32, descending (ties: lower index\n"
        "first; NaN last): (R, n) int32.");
  m.def("logsumexp_rows", &metrale::logsumexp_rows, "x"_a,
        "log(sum(exp(x))) of each row of x (R, V) float32, vectorized: (R,) float32; NaN where a row's\n"
        "maximum is not finite.");
}
