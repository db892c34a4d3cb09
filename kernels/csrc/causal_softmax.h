// Causal (optionally sliding-window) softmax over attention scores, for prefill chunks on CPU.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// scores (..., q_len, L) float32: query i keeps keys j with j <= i + offset and, when window > 0,
// j > i + offset - window; softmax over the kept keys, 0 elsewhere. Returns the same shape, float32.
mx::array causal_softmax(const mx::array& scores, int offset, int window);

class CausalSoftmax : public mx::UnaryPrimitive {
 public:
  CausalSoftmax(mx::Stream stream, int offset, int window)
      : mx::UnaryPrimitive(stream), offset_(offset), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "CausalSoftmax";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int offset_;
  int window_;
};

}  // namespace metrale
