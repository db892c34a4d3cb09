// Writing a step's K or V rows into a paged pool as one graph node (MLX's indexed assignment is a
// scatter plus broadcast and squeeze nodes). One node per pool: an input of a multi-output node is
// held by every output, so MLX would never let it donate its buffer.
//
// A pool is (num_blocks, n_kv, block_size, row) (kv_row_offset, kernel_table.h): token slot s of the pool is
// row s % block_size of block s / block_size, one row per kv head.
// An int8 pool is q8 (kernel_table.h): each (kv head, slot) row is head_dim int8 values then one
// float16 scale per group of `group` values; kv_write quantizes float32 rows as it writes them:
//   d = float16(max|x| / 127) per group,  q = round_half_even(clamp(x * (1 / d), -127, 127))  (q = 0 when d = 0)
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// The q8 group size of an int8 pool row of `row_bytes` bytes holding `head_dim` values: row_bytes =
// head_dim + 2 * head_dim / group with group a multiple of 8 dividing head_dim; 0 if no group fits.
int q8_group(int head_dim, int row_bytes);

// pool (num_blocks, n_kv, block_size, hd) float32|float16|bfloat16 with rows (T, n_kv, hd) of the pool's dtype (or
// float32 rows into a float16 / bfloat16 pool, rounded to nearest even as mlx's astype), or pool (num_blocks, n_kv,
// block_size, hd + 2 * hd / group) int8 (q8) with rows (T, n_kv, hd) float32; slots (T,) int32. Returns the updated pool: the input pool's buffer when nothing else holds it (the usual case,
// no copy), else a copy. Slots outside the pool are skipped (callers check them).
mx::array kv_write(const mx::array& pool, const mx::array& rows, const mx::array& slots);

class KvWrite : public mx::UnaryPrimitive {
 public:
  explicit KvWrite(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "KvWriteCPU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

}  // namespace metrale
