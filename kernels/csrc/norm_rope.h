// Fused RMSNorm and RoPE on the CPU stream: one graph node each where MLX's CPU versions build ~8
// and ~25 (norm_rope_kernel.h has the arithmetic).
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// x (..., D) float32, weight (D,) float32 -> (x / rms(x)) * (weight + weight_offset), float32.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, float weight_offset);

// x, residual (..., D) float32 (the same shape), weight (D,) float32 -> [h, out]: h = x + residual and
// out = rms_norm(h, weight): a residual add and the norm after it in one node, bit for bit the two ops.
std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& residual, const mx::array& weight, float eps,
                                    float weight_offset);

// q (T, Hq, D), k (T, Hk, D) float32, cos / sin (T, D / 2) float32 -> [q, k] rotated: half-split
// pairs (i, i + D/2), or interleaved pairs (2i, 2i + 1) when traditional.
std::vector<mx::array> rope_qk(const mx::array& q, const mx::array& k, const mx::array& cos, const mx::array& sin,
                               bool traditional);

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps, float weight_offset)
      : mx::UnaryPrimitive(stream), eps_(eps), weight_offset_(weight_offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "RmsNormCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_, weight_offset_;
};

class AddRmsNorm : public mx::Primitive {
 public:
  AddRmsNorm(mx::Stream stream, float eps, float weight_offset)
      : mx::Primitive(stream), eps_(eps), weight_offset_(weight_offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "AddRmsNormCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape()};
  }

 private:
  float eps_, weight_offset_;
};

class RopeQK : public mx::Primitive {
 public:
  RopeQK(mx::Stream stream, bool traditional) : mx::Primitive(stream), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "RopeQKCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape()};
  }

 private:
  bool traditional_;
};

}  // namespace metrale
