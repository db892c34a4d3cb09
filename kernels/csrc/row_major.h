// Inputs of the CPU primitives as row-major buffers, without a Contiguous node in the graph.
//
// A graph node costs a few microseconds of MLX dispatch on the CPU stream whatever it does, and the
// inputs of a decode step are all row-major already; so the primitives take arrays as they come and
// copy the rare strided one (a transposed or sliced view, a broadcast) at the start of their task.
// Usage: in eval_cpu, `RowMajor in(array, encoder)` (the strides are known there); in the
// dispatched task, `in.data<T>()` (the producer's data is ready there), called once.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace metrale {

namespace mx = mlx::core;

class RowMajor {
 public:
  RowMajor(const mx::array& a, mx::cpu::CommandEncoder& encoder) : src_(a), copy_(a) {
    if (!a.flags().row_contiguous) {
      if (a.ndim() > 16) throw std::invalid_argument("metrale kernels: inputs of more than 16 dimensions");
      copy_ = mx::array(mx::allocator::malloc(a.nbytes()), a.shape(), a.dtype());
      encoder.add_temporary(copy_);
      strided_ = true;
    }
  }

  // Row-major data of the input; copies it first when it is strided. Call from the task, once.
  template <typename T>
  const T* data() const {
    if (strided_) gather();
    return copy_.data<T>();
  }

 private:
  void gather() const {
    const int ndim = static_cast<int>(src_.ndim());
    const int64_t item = src_.itemsize(), total = static_cast<int64_t>(src_.size());
    const auto* in = static_cast<const char*>(src_.data<void>());
    auto* out = static_cast<char*>(const_cast<mx::array&>(copy_).data<void>());
    int64_t index[16] = {};  // MLX arrays have few dims; the op checks rank <= 16 before using this
    int64_t offset = 0;
    for (int64_t i = 0; i < total; ++i) {
      std::memcpy(out + i * item, in + offset * item, item);
      for (int d = ndim - 1; d >= 0; --d) {  // next index, odometer style
        offset += src_.strides(d);
        if (++index[d] < src_.shape(d)) break;
        offset -= src_.strides(d) * src_.shape(d);
        index[d] = 0;
      }
    }
  }

  mx::array src_;
  mx::array copy_;
  bool strided_ = false;
};

}  // namespace metrale
