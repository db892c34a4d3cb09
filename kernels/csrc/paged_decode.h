// Paged decode attention for MLX on CPU: one query token per sequence, K/V read straight from the
// paged pools through the block tables (no gather copies). See paged_decode.cpp.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// queries (B, n_heads, hd), k_pool / v_pool (num_blocks, n_kv_heads, block_size, hd) float32|float16|bfloat16 (or int8
// q8 pools, (num_blocks, n_kv_heads, block_size, hd + 2 * hd / group), kv_write.h),
// block_tables (B, max_blocks) int32, context_lens (B,) int32. Row b attends to positions
// max(0, ctx - window) .. ctx - 1 of its context (window 0: all). Returns (B, n_heads, hd) float32.
mx::array paged_decode(
    const mx::array& queries,
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& block_tables,
    const mx::array& context_lens,
    float scale,
    int block_size,
    int window);

class PagedDecode : public mx::UnaryPrimitive {
 public:
  PagedDecode(mx::Stream stream, float scale, int block_size, int window)
      : mx::UnaryPrimitive(stream), scale_(scale), block_size_(block_size), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "PagedDecode";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  int block_size_;
  int window_;
};

}  // namespace metrale
