// Quantized linear layers on the CPU, straight from packed 4- or 8-bit affine weights
// (layout: kernel_table.h; packing: kernels/qmm.py; compute: qmm_kernel.h).
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// y_j = x W_j^T for the outputs j stacked in one packed weight:
//   x (..., K) float32; q uint8 (P, 16 * K * bits / 8); scales, biases (P, K / group_size, 16)
//   float16 or float32 (the same); columns[j] the out-features of output j, which owns the next
//   ceil(columns[j] / 16) panels. Returns one float32 array (..., columns[j]) per output.
// glu >= 0 (a GatedKind: 0 silu, 1 gelu_tanh): one output; its panels come in (gate, up) pairs
//   (2 ceil(columns / 16) panels) and it holds act(x Wg^T) * (x Wu^T).
// activation_bits 8: x quantized to int8 per 32 values (llama.cpp's Q8); 12: to int12 (16x finer), as
//   two int8 planes (one AMX product per block with 4-bit weights); 16: to int16, as two int8 halves
//   (twice the integer work, ~250x less activation error than int8).
// std::invalid_argument (Python ValueError) for shapes or dtypes that do not fit.
std::vector<mx::array> quantized_matmul(const mx::array& x, const mx::array& q, const mx::array& scales,
                                        const mx::array& biases, int bits, int group_size,
                                        const std::vector<int>& columns, int glu, int activation_bits,
                                        float bias_per_scale = 0.0f);

// Rows `ids` (any shape, integer) of the packed weight's single output, dequantized:
// returns (*ids.shape, K) float32 (an embedding lookup from the weight the tied lm_head uses).
mx::array quantized_rows(const mx::array& q, const mx::array& scales, const mx::array& biases, const mx::array& ids,
                         int bits, int group_size, int rows);

class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(mx::Stream stream, int bits, int group_size, std::vector<int> columns, int glu,
                  int activation_bits, float bias_per_scale)
      : mx::Primitive(stream),
        bits_(bits),
        group_size_(group_size),
        columns_(std::move(columns)),
        glu_(glu),
        activation_bits_(activation_bits),
        bias_per_scale_(bias_per_scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "QuantizedMatmulCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int bits_, group_size_;
  std::vector<int> columns_;
  int glu_;
  int activation_bits_;
  float bias_per_scale_;  // QmmWeights::bias_per_scale
};

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int bits, int group_size, int rows)
      : mx::UnaryPrimitive(stream), bits_(bits), group_size_(group_size), rows_(rows) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "QuantizedRowsCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int bits_, group_size_, rows_;
};

}  // namespace metrale
