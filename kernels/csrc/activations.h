// Fused gated activations of MLP blocks (SwiGLU, GeGLU) on the CPU, one pass over gate and up:
//   silu_mul(gate, up)      = gate * sigmoid(gate) * up
//   gelu_tanh_mul(gate, up) = 0.5 * gate * (1 + tanh(sqrt(2/pi) * (gate + 0.044715 gate^3))) * up
// MLX's CPU exp/tanh are scalar on x86 Linux (~10-20 ns per element); these are vectorized.
#pragma once

#include "kernel_table.h"
#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// gate, up: the same shape and dtype (float32, float16 or bfloat16; half types are computed in
// float32 and rounded once). Any shape; non-contiguous inputs are copied first. Returns that shape
// and dtype. std::invalid_argument (Python ValueError) otherwise.
mx::array silu_mul(const mx::array& gate, const mx::array& up);
mx::array gelu_tanh_mul(const mx::array& gate, const mx::array& up);

class GatedActivation : public mx::UnaryPrimitive {
 public:
  GatedActivation(mx::Stream stream, GatedKind kind) : mx::UnaryPrimitive(stream), kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return kind_ == GatedKind::silu ? "SiluMul" : "GeluTanhMul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  GatedKind kind_;
};

}  // namespace metrale
