// One tensor of a GGUF file read with ordinary reads into its final MLX arrays (metrale/loading/gguf_file.py
// parses the header and calls this per tensor): the file is never mapped whole, so a load holds the tensors
// read so far and one read buffer, not the file's pages beside every copy (what mx.load does).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace metrale {

namespace mx = mlx::core;

// The tensor of ggml type `ggml_type` at byte `position` of `path`, its MLX shape `shape` (GGUF's dims
// reversed), as mx.load returns it:
//   F32 (0), F16 (1), I8 (24), I16 (25), I32 (26): [the array];
//   Q4_0 (2), Q4_1 (3), Q8_0 (8): [packed (..., last * bits / 32) uint32, scales, biases
//   (..., last / 32) float16], MLX's affine format with group size 32, built as MLX's mlx/io/gguf_quants.cpp
//   builds it (bit for bit: the same float16 arithmetic).
// std::invalid_argument (Python ValueError) for another type, a shape that does not fit, or a file that ends
// inside the tensor (checked against the file's size before anything is allocated).
std::vector<mx::array> read_gguf_tensor(const std::string& path, int64_t position, int ggml_type,
                                        const std::vector<int64_t>& shape);

// The ggml types read_gguf_tensor reads -> values per block (1 for the plain types): the one list of them.
std::map<int, int> gguf_block_values();

}  // namespace metrale
