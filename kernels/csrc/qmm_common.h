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

// Two bytes of 4-bit values merged nibble-wise: a's and b's low nibbles (a's low, b's high), and their high
// nibbles likewise. Both repackings of 4-bit weights are made of these: ggml blocks to MLX's order
// (gguf_read.cpp) and MLX's order to the kernels' panels (weight_layout.cpp).
inline uint8_t low_nibbles(uint8_t a, uint8_t b) { return static_cast<uint8_t>((a & 0x0F) | (b << 4)); }
inline uint8_t high_nibbles(uint8_t a, uint8_t b) { return static_cast<uint8_t>((a >> 4) | (b & 0xF0)); }

}  // namespace metrale
