// Mixture-of-experts matmul on the CPU: each row of a step multiplied by its own expert's quantized
// weight, all experts in one primitive (layout of one expert: kernel_table.h; packing: kernels/moe.py).
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// y[r] = x[r / (R / T)] W_{indices[r]}^T for the R = indices.size() rows:
//   x (T, K) float32 (R a multiple of T: with indices (T, top_k) row r reads token r / top_k; with
//   R = T row r reads x[r]); q uint8 (E, P, 16 * K * bits / 8), scales and biases (E, P, K / group_size, 16)
//   float16 or float32: E experts packed as kernels/qmm.py packs one weight; indices int32 in [0, E).
//   columns: the out-features N. glu >= 0 (a GatedKind): each expert's panels are (gate, up) pairs and
//   y holds act(x Wg^T) * (x Wu^T). Returns (*indices.shape, N) float32.
// Rows are grouped by expert inside the call (a counting sort), each group's activations quantized once
// (int8, int12 or int16, activation_bits as quantized_matmul) and run by the qmm micro-kernels over that expert's
// panels; tasks are (expert, panel block, token block), spread over the kernel thread pool.
// std::invalid_argument (Python ValueError) for shapes or dtypes that do not fit.
mx::array gather_quantized_matmul(const mx::array& x, const mx::array& q, const mx::array& scales,
                                  const mx::array& biases, const mx::array& indices, int bits, int group_size,
                                  int columns, int glu, int activation_bits, float bias_per_scale = 0.0f);

class GatherQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  GatherQuantizedMatmul(mx::Stream stream, int bits, int group_size, int columns, int glu, int activation_bits,
                        float bias_per_scale)
      : mx::UnaryPrimitive(stream),
        bits_(bits),
        group_size_(group_size),
        columns_(columns),
        glu_(glu),
        activation_bits_(activation_bits),
        bias_per_scale_(bias_per_scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "GatherQuantizedMatmulCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int bits_, group_size_, columns_, glu_, activation_bits_;
  float bias_per_scale_;  // QmmWeights::bias_per_scale
};

}  // namespace metrale
