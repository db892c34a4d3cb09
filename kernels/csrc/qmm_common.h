// Pieces the QuantizedMatmul (qmm.cpp) and GatherQuantizedMatmul (moe.cpp) primitives share: how a call
// is cut into tasks, and the shape text of their error messages.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace metrale {

namespace mx = mlx::core;

// Threads pay once a call streams this many weight bytes per token tile (a pool worker wakes
// ~50 us late on the 2-core dev VM; 256 KiB of weights take about that long on one core).
constexpr int64_t kMinParallelBytes = 256 << 10;
constexpr int64_t kActivationBlockBytes = 192 << 10;  // quantized activations per task: half of a 1-2 MiB L2
constexpr int64_t kRowsPerQuantizeTask = 16;

inline std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << a.shape() << " " << a.dtype();
  return os.str();
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace metrale
