// Where and how the packed weights sit in memory: the kernels' panel layout written once at load
// (pack_panels), on 2 MiB pages where the OS allows (a decode step streams the weights whole).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace metrale {

namespace mx = mlx::core;

// One or more MLX affine weights in the kernels' layout (kernel_table.h), written straight into their
// final buffers: no intermediate copy of the weight, so packing a weight of B bytes needs B more bytes
// (the MLX-layout source is freed by the caller once it lets go of it).
//   packed[l]: (N_l, K * bits / 32) uint32; scales[l], biases[l]: (N_l, K / group_size) float16 or
//   float32, one dtype for all. Returns [q (P, 16 * K * bits / 8) uint8, scales (P, K / group_size, 16),
//   biases (same)], P = sum of ceil(N_l / 16): layer l's panels after layer l - 1's, or with interleave
//   (exactly two layers of one shape, a GLU's gate and up) gate panel p at 2p and up panel p at 2p + 1.
//   Rows past N_l in a layer's last panel are zero (weights, scales and biases).
// huge_pages: each buffer of 2 MiB or more starts at a 2 MiB boundary and its whole 2 MiB pages are
//   madvise(MADV_HUGEPAGE)d before the first write (as huge_page_copy). std::invalid_argument (Python
//   ValueError) for shapes, dtypes or formats that do not fit.
std::vector<mx::array> pack_panels(const std::vector<mx::array>& packed, const std::vector<mx::array>& scales,
                                   const std::vector<mx::array>& biases, int bits, int group_size, bool interleave,
                                   bool huge_pages);

// `a` (any dtype and shape) copied into memory that the OS may back with 2 MiB pages: a fresh buffer
// whose 2 MiB-aligned whole pages are madvise(MADV_HUGEPAGE)d before the copy first touches them, the
// result a row-contiguous view of it at a 2 MiB boundary. Where transparent huge pages are off (or on a
// non-Linux OS) or `a` is under 2 MiB, returns `a` itself (evaluated). A decode step streams its weights
// once: on 4 KiB pages each page costs a TLB miss (docs/quantized-kernels.md, "Huge pages").
mx::array huge_page_copy(const mx::array& a);

// Bytes of the calling process's memory on transparent huge pages (AnonHugePages of
// /proc/self/smaps_rollup), -1 where that is not known.
int64_t anon_huge_page_bytes();

}  // namespace metrale
