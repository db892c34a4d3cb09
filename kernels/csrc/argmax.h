// Greedy argmax of logits on the CPU, threaded: MLX's CPU argmax runs on one thread, ~10 ms for the
// 32 x 128256 logits of a 1B-shaped model's decode step. Same answer as mx.argmax(x, axis=-1)
// (argmax_kernel.h states the ties and NaN rules).
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// x (..., V) float32, V >= 1 -> (...) uint32: the index of each row's maximum (mx.argmax's dtype).
mx::array argmax_rows(const mx::array& x);

class ArgmaxRows : public mx::UnaryPrimitive {
 public:
  explicit ArgmaxRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "ArgmaxRowsCPU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

}  // namespace metrale
