// The CausalSoftmax primitive: rows of a score tensor, split over the kernel thread pool.
// MLX's own CPU softmax costs ~12 ns per element here (scalar exp); this one is vectorized.
#include "causal_softmax.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "isa.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "parallel.h"
#include "row_major.h"

namespace metrale {

namespace {
constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kMinParallelElements = 1 << 15;
}  // namespace

mx::array causal_softmax(const mx::array& scores, int offset, int window) {
  if (scores.ndim() < 2) throw std::invalid_argument("causal_softmax: scores must be (..., q_len, L)");
  if (scores.dtype() != mx::float32) throw std::invalid_argument("causal_softmax: scores must be float32");
  if (window < 0) throw std::invalid_argument("causal_softmax: window must be >= 0 (0: none), got " + std::to_string(window));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(scores.shape(), mx::float32, std::make_shared<CausalSoftmax>(s, offset, window),
                   {scores});
}

void CausalSoftmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& in = inputs[0];
  // Reuse the scores' buffer when nothing else holds it (the usual case: a fresh matmul output).
  if (in.is_donatable() && in.flags().row_contiguous) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(in);
  encoder.set_output_array(out);
  const int length = in.shape(-1), q_len = in.shape(-2);
  const int64_t rows = in.size() / length;
  const int offset = offset_, window = window_;
  const RowMajor scores(in, encoder);
  encoder.dispatch([scores, dst = out.data<float>(), length, q_len, rows, offset, window] {
    const float* src = scores.data<float>();
    const int n_tasks = static_cast<int>((rows + kRowsPerTask - 1) / kRowsPerTask);
    const int width = rows * length < kMinParallelElements ? 1 : std::min(num_threads(), n_tasks);
    const auto& kernels = cpu_kernels();
    parallel_for(n_tasks, width, [&](int task, int) {
      kernels.causal_softmax_rows(src, dst, task * kRowsPerTask, std::min(rows, (task + 1) * kRowsPerTask), length,
                                  q_len, offset, window);
    });
  });
}

void CausalSoftmax::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("causal_softmax: CPU only; use the reference attention on GPU streams");
}

bool CausalSoftmax::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CausalSoftmax&>(other);
  return offset_ == o.offset_ && window_ == o.window_;
}

}  // namespace metrale
