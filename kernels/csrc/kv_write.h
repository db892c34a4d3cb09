// Writing a step's K or V rows into a paged pool as one graph node (MLX's indexed assignment is a
// scatter plus broadcast and squeeze nodes). One node per pool: an input of a multi-output node is
// held by every output, so MLX would never let it donate its buffer.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// pool (num_slots, n_kv, hd); rows (T, n_kv, hd) of the pool's dtype; slots (T,) int32. Returns the
// updated pool: the input pool's buffer when nothing else holds it (the usual case, no copy), else a
// copy. Slots outside the pool are skipped (callers check them).
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
