// The RmsNorm and RopeQK primitives: checks, buffers and threads; the rows are the kernel table's.
#include "norm_rope.h"

#include <algorithm>
#include <sstream>
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

constexpr int64_t kMinParallelElements = 1 << 17;  // below this one thread (a pool worker wakes ~50 us late)

std::string describe(const mx::array& a) {
  std::ostringstream os;
  os << a.shape() << " " << a.dtype();
  return os.str();
}

// Output buffer: the input's own when nothing else holds it (fresh intermediate results), else new.
void reuse_or_allocate(const mx::array& in, mx::array& out) {
  if (in.is_donatable() && in.flags().row_contiguous && in.nbytes() == out.nbytes()) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

int width_for(int64_t elements, int64_t tasks) {
  return elements < kMinParallelElements ? 1 : static_cast<int>(std::min<int64_t>(num_threads(), tasks));
}

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, float weight_offset) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || weight.dtype() != mx::float32 || weight.ndim() != 1 ||
      weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm: x (..., D) and weight (D,) must be float32, got " + describe(x) + " and " +
                                describe(weight));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps, weight_offset), {x, weight});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  reuse_or_allocate(x, out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const RowMajor xin(x, encoder), win(inputs[1], encoder);
  const int D = x.shape(-1);
  const int64_t rows = D == 0 ? 0 : static_cast<int64_t>(x.size()) / D;
  encoder.dispatch([xin, win, o = out.data<float>(), D, rows, eps = eps_, offset = weight_offset_] {
    const auto& kernels = cpu_kernels();
    const float* xp = xin.data<float>();
    const float* wp = win.data<float>();
    const int64_t per_task = 16, tasks = (rows + per_task - 1) / per_task;
    parallel_for(static_cast<int>(tasks), width_for(rows * D, tasks), [&](int task, int) {
      const int64_t r0 = task * per_task;
      kernels.rms_norm_rows(xp, wp, o, r0, std::min(rows, r0 + per_task), D, eps, offset);
    });
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("rms_norm: CPU only; GPU streams use mx.fast.rms_norm");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RmsNorm&>(other);
  return eps_ == o.eps_ && weight_offset_ == o.weight_offset_;
}

std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& residual, const mx::array& weight, float eps,
                                    float weight_offset) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || residual.dtype() != mx::float32 || x.shape() != residual.shape() ||
      weight.dtype() != mx::float32 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("add_rms_norm: x and residual (..., D) of one shape and weight (D,), all float32, got " +
                                describe(x) + ", " + describe(residual) + " and " + describe(weight));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32},
                                std::make_shared<AddRmsNorm>(s, eps, weight_offset), {x, residual, weight});
}

void AddRmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto &x = inputs[0], &residual = inputs[1];
  auto &h = outputs[0], &normed = outputs[1];
  const bool x_free = x.is_donatable() && x.flags().row_contiguous;
  reuse_or_allocate(x_free ? x : residual, h);  // the sum overwrites an addend nothing else reads
  normed.set_data(mx::allocator::malloc(normed.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(h);
  encoder.set_output_array(normed);
  const RowMajor xin(x, encoder), rin(residual, encoder), win(inputs[2], encoder);
  const int D = x.shape(-1);
  const int64_t rows = D == 0 ? 0 : static_cast<int64_t>(x.size()) / D;
  encoder.dispatch([xin, rin, win, hp = h.data<float>(), o = normed.data<float>(), D, rows, eps = eps_,
                    offset = weight_offset_] {
    const auto& kernels = cpu_kernels();
    const float *xp = xin.data<float>(), *rp = rin.data<float>(), *wp = win.data<float>();
    const int64_t per_task = 16, tasks = (rows + per_task - 1) / per_task;
    parallel_for(static_cast<int>(tasks), width_for(rows * D, tasks), [&](int task, int) {
      const int64_t r0 = task * per_task;
      kernels.add_rms_norm_rows(xp, rp, wp, hp, o, r0, std::min(rows, r0 + per_task), D, eps, offset);
    });
  });
}

void AddRmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("add_rms_norm: CPU only; GPU streams add and use mx.fast.rms_norm");
}

bool AddRmsNorm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AddRmsNorm&>(other);
  return eps_ == o.eps_ && weight_offset_ == o.weight_offset_;
}

std::vector<mx::array> rope_qk(const mx::array& q, const mx::array& k, const mx::array& cos, const mx::array& sin,
                               bool traditional) {
  const bool ok = q.ndim() == 3 && k.ndim() == 3 && q.shape(0) == k.shape(0) && q.shape(2) == k.shape(2) &&
                  q.shape(2) % 2 == 0 && cos.ndim() == 2 && cos.shape() == sin.shape() &&
                  cos.shape(0) == q.shape(0) && cos.shape(1) * 2 == q.shape(2);
  const bool f32 = q.dtype() == mx::float32 && k.dtype() == mx::float32 && cos.dtype() == mx::float32 &&
                   sin.dtype() == mx::float32;
  if (!ok || !f32)
    throw std::invalid_argument("rope_qk: q (T, Hq, D), k (T, Hk, D), cos and sin (T, D / 2), all float32, got " +
                                describe(q) + ", " + describe(k) + ", " + describe(cos) + ", " + describe(sin));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({q.shape(), k.shape()}, {mx::float32, mx::float32},
                                std::make_shared<RopeQK>(s, traditional), {q, k, cos, sin});
}

void RopeQK::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (int i = 0; i < 2; ++i) {
    reuse_or_allocate(inputs[i], outputs[i]);
    encoder.set_output_array(outputs[i]);
  }
  const RowMajor qin(inputs[0], encoder), kin(inputs[1], encoder), cin(inputs[2], encoder), sin_(inputs[3], encoder);
  const int64_t T = inputs[0].shape(0);
  const int Hq = inputs[0].shape(1), Hk = inputs[1].shape(1), D = inputs[0].shape(2);
  encoder.dispatch([=, qo = outputs[0].data<float>(), ko = outputs[1].data<float>(), traditional = traditional_] {
    const auto& kernels = cpu_kernels();
    const float *qp = qin.data<float>(), *kp = kin.data<float>(), *cp = cin.data<float>(), *sp = sin_.data<float>();
    const int64_t per_task = 8, tasks = (T + per_task - 1) / per_task;
    parallel_for(static_cast<int>(tasks), width_for(T * (Hq + Hk) * D, tasks), [&](int task, int) {
      const int64_t t0 = task * per_task, t1 = std::min(T, t0 + per_task);
      kernels.rope_rows(qp, cp, sp, qo, t0, t1, Hq, D, traditional);
      kernels.rope_rows(kp, cp, sp, ko, t0, t1, Hk, D, traditional);
    });
  });
}

void RopeQK::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("rope_qk: CPU only; GPU streams use mx.fast.rope");
}

bool RopeQK::is_equivalent(const mx::Primitive& other) const {
  return traditional_ == static_cast<const RopeQK&>(other).traditional_;
}

}  // namespace metrale
