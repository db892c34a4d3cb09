// The GatedActivation primitive: elementwise over the flat (row-major) inputs, in chunks spread
// over the kernel thread pool once the array is large enough for threads to pay.
#include "activations.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "isa.h"
#include "parallel.h"
#include "row_major.h"

namespace metrale {

namespace {

constexpr int64_t kChunk = 1 << 13;  // elements per task (a multiple of 8)
// Below this many elements (~170 rows of 1536) the work stays on the calling thread: on the 2-core
// dev VM a pool worker wakes 50-100 us late, longer than a whole decode-size call (32 x 1536: ~35 us
// on one thread), so threads only paid from ~256 rows on (512 x 1536: ~420 us -> ~250 us).
constexpr int64_t kMinParallelElements = 1 << 18;

void run(GatedKind kind, Dtype dtype, const void* gate, const void* up, void* out, int64_t size) {
  const auto& kernels = cpu_kernels();
  const int n_tasks = static_cast<int>((size + kChunk - 1) / kChunk);
  const int width = size < kMinParallelElements ? 1 : std::min(num_threads(), n_tasks);
  parallel_for(n_tasks, width, [&](int task, int) {
    const int64_t begin = task * kChunk;
    kernels.gated(kind, dtype, gate, up, out, begin, std::min(size, begin + kChunk));
  });
}

std::string describe(const mx::array& a) {
  std::ostringstream os;
  os << a.shape() << " " << a.dtype();
  return os.str();
}

mx::array gated(const char* fn, GatedKind kind, const mx::array& gate, const mx::array& up) {
  if (gate.shape() != up.shape() || gate.dtype() != up.dtype())
    throw std::invalid_argument(std::string(fn) + ": gate and up must have the same shape and dtype, got " +
                                describe(gate) + " and " + describe(up));
  const auto dtype = gate.dtype();
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16)
    throw std::invalid_argument(std::string(fn) + ": float32, float16 or bfloat16 inputs only, got " +
                                describe(gate));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(gate.shape(), dtype, std::make_shared<GatedActivation>(s, kind),
                   {gate, up});
}

bool donatable(const mx::array& in, const mx::array& out) {
  return in.is_donatable() && in.flags().row_contiguous && in.nbytes() == out.nbytes();
}

}  // namespace

mx::array silu_mul(const mx::array& gate, const mx::array& up) {
  return gated("silu_mul", GatedKind::silu, gate, up);
}

mx::array gelu_tanh_mul(const mx::array& gate, const mx::array& up) {
  return gated("gelu_tanh_mul", GatedKind::gelu_tanh, gate, up);
}

void GatedActivation::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& gate = inputs[0];
  const auto& up = inputs[1];
  // Write over an input nobody else holds (the usual case: fresh matmul outputs), else allocate.
  if (donatable(gate, out)) {
    out.copy_shared_buffer(gate);
  } else if (donatable(up, out)) {
    out.copy_shared_buffer(up);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(gate);
  encoder.set_input_array(up);
  encoder.set_output_array(out);
  const auto dtype = out.dtype() == mx::float32 ? Dtype::float32
                     : out.dtype() == mx::float16 ? Dtype::float16 : Dtype::bfloat16;
  const RowMajor gin(gate, encoder), uin(up, encoder);
  encoder.dispatch([gin, uin, o = out.data<void>(), dtype, size = static_cast<int64_t>(out.size()), kind = kind_] {
    run(kind, dtype, gin.data<void>(), uin.data<void>(), o, size);
  });
}

void GatedActivation::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(std::string(name()) + ": CPU only; use the MLX expression on GPU streams");
}

bool GatedActivation::is_equivalent(const mx::Primitive& other) const {
  return kind_ == static_cast<const GatedActivation&>(other).kind_;
}

}  // namespace metrale
