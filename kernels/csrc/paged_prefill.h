// Paged prefill attention for MLX on CPU: one sequence's chunk of queries over its paged context,
// K/V read straight from the pools through its block table, flash style (no score matrix).
// See prefill_kernel.h for the compute.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// queries (q_len, n_heads, hd) at positions first_position .. first_position + q_len - 1; k_pool /
// v_pool (num_blocks, n_kv_heads, block_size, hd) float32|float16|bfloat16 (or int8 q8 rows, kv_write.h); block_table (max_blocks,) int32 covering
// first_position + q_len positions. Query at position p attends to max(0, p - window + 1) .. p (window 0:
// 0 .. p). Returns (q_len, n_heads, hd) float32.
mx::array paged_prefill(const mx::array& queries, const mx::array& k_pool, const mx::array& v_pool,
                        const mx::array& block_table, int first_position, float scale, int block_size, int window);

class PagedPrefill : public mx::UnaryPrimitive {
 public:
  PagedPrefill(mx::Stream stream, int first_position, float scale, int block_size, int window)
      : mx::UnaryPrimitive(stream), first_(first_position), scale_(scale), block_size_(block_size), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "PagedPrefill"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int first_;
  float scale_;
  int block_size_;
  int window_;
};

}  // namespace metrale
