// Python bindings of the CPU attention kernels. NB_DOMAIN mlx (set in CMakeLists.txt) shares mlx's
// nanobind type registry, so mx.array arguments convert to mx::array without copies.
#include <nanobind/nanobind.h>

#include "activations.h"
#include "causal_softmax.h"
#include "mlx/version.h"
#include "paged_decode.h"

namespace nb = nanobind;
using namespace nb::literals;

#define METRALE_STR2(x) #x
#define METRALE_STR(x) METRALE_STR2(x)

NB_MODULE(_kernels, m) {
  m.doc() = "CPU attention and activation kernels for MLX (metrale kvcache extension)";
  // The mlx version these headers declare; the loader refuses to use a build for another version.
  m.attr("mlx_version") =
      METRALE_STR(MLX_VERSION_MAJOR) "." METRALE_STR(MLX_VERSION_MINOR) "." METRALE_STR(MLX_VERSION_PATCH);
  m.def("paged_decode", &metrale::paged_decode, "queries"_a, "k_pool"_a, "v_pool"_a, "block_tables"_a,
        "context_lens"_a, nb::kw_only(), "scale"_a, "block_size"_a, "window"_a = 0,
        "Decode attention over paged pools on the CPU stream.\n\n"
        "queries (B, n_heads, hd); k_pool, v_pool (num_slots, n_kv_heads, hd) float32|float16|bfloat16;\n"
        "block_tables (B, max_blocks) int32; context_lens (B,) int32. Row b attends to positions\n"
        "max(0, ctx - window) .. ctx - 1 (window 0: all). Returns (B, n_heads, hd) float32.");
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
}
