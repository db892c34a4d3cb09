// The sampling primitives (sampling_kernel.h has the row arithmetic). ArgmaxRows: rows x vocabulary split
// into tasks over the kernel pool, each task one range of one row; the ranges of a row are combined in
// order on the calling thread. SampleFullRows, SampleCandidateRows, TopIdsRows and LogsumexpRows: one task per
// row (a row's result never depends on the others).
#include "sampling.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "isa.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "parallel.h"
#include "row_major.h"
#include "sampling_select.h"

namespace metrale {

namespace {

// Below this many elements one thread: a pool worker wakes ~50 us late on a busy 2-core machine, and one
// thread reads 128k logits in ~20 us.
constexpr int64_t kMinParallelElements = 1 << 18;
constexpr int64_t kMinRangeElements = 1 << 14;  // a row is cut into ranges of at least this many

std::string describe(const mx::array& a) {
  std::ostringstream os;
  os << a.shape() << " " << a.dtype();
  return os.str();
}

mx::Shape rows_shape(const mx::array& x) { return mx::Shape(x.shape().begin(), x.shape().end() - 1); }

// Ranges of one row after another, in index order: the first NaN, else the largest value, first range on ties.
ArgmaxPart combine(const ArgmaxPart* parts, int n) {
  ArgmaxPart best = parts[0];
  for (int i = 0; i < n && best.first_nan < 0; ++i) {
    const ArgmaxPart& p = parts[i];
    if (p.first_nan >= 0 || p.value > best.value) best = p;
  }
  return best;
}

}  // namespace

mx::array argmax_rows(const mx::array& x) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) < 1)
    throw std::invalid_argument("argmax_rows: x (..., V) float32 with V >= 1, got " + describe(x));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(rows_shape(x), mx::uint32, std::make_shared<ArgmaxRows>(s), {x});
}

std::vector<mx::Shape> ArgmaxRows::output_shapes(const std::vector<mx::array>& inputs) {
  return {rows_shape(inputs[0])};
}

void ArgmaxRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  const RowMajor xin(x, encoder);
  const int64_t V = x.shape(-1), rows = static_cast<int64_t>(x.size()) / V;
  encoder.dispatch([xin, o = out.data<uint32_t>(), V, rows] {
    const auto& kernels = cpu_kernels();
    const float* xp = xin.data<float>();
    const int64_t total = rows * V;
    const int width = total < kMinParallelElements ? 1 : num_threads();
    // a row in several ranges only when there are fewer rows than threads (one long row: batch 1)
    const int64_t per_row = rows >= width ? 1 : std::clamp<int64_t>(V / kMinRangeElements, 1, (width + rows - 1) / rows);
    const int64_t range = (V + per_row - 1) / per_row;
    std::vector<ArgmaxPart> parts(rows * per_row);
    const int64_t tasks = rows * per_row;
    parallel_for(static_cast<int>(tasks), static_cast<int>(std::min<int64_t>(width, tasks)), [&](int task, int) {
      const int64_t row = task / per_row, begin = (task % per_row) * range, end = std::min(V, begin + range);
      parts[task] = kernels.argmax_range(xp + row * V, begin, end);
    });
    for (int64_t r = 0; r < rows; ++r)
      o[r] = static_cast<uint32_t>(combine(parts.data() + r * per_row, static_cast<int>(per_row)).index);
  });
}

mx::array sample_full_rows(const mx::array& logits, const mx::array& scale, const mx::array& log2_min_p,
                           const mx::array& uniforms) {
  const bool ok = logits.ndim() == 2 && logits.shape(1) >= 1 && logits.dtype() == mx::float32;
  bool rows_ok = true;
  for (const auto* a : {&scale, &log2_min_p, &uniforms})
    rows_ok = rows_ok && a->ndim() == 1 && ok && a->shape(0) == logits.shape(0) && a->dtype() == mx::float32;
  if (!ok || !rows_ok)
    throw std::invalid_argument("sample_full_rows: logits (R, V) with V >= 1 and scale, log2_min_p, uniforms (R,), all "
                                "float32, got " + describe(logits) + ", " + describe(scale) + ", " +
                                describe(log2_min_p) + ", " + describe(uniforms));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({logits.shape(0)}, mx::int32, std::make_shared<SampleFullRows>(s),
                   {logits, scale, log2_min_p, uniforms});
}

void SampleFullRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const RowMajor xin(inputs[0], encoder), sin_(inputs[1], encoder), pin(inputs[2], encoder), uin(inputs[3], encoder);
  const int64_t rows = inputs[0].shape(0), V = inputs[0].shape(1);
  encoder.dispatch([xin, sin_, pin, uin, o = out.data<int32_t>(), rows, V] {
    const auto& kernels = cpu_kernels();
    const float *xp = xin.data<float>(), *sp = sin_.data<float>(), *pp = pin.data<float>(), *up = uin.data<float>();
    const int width = rows * V < kMinParallelElements ? 1 : static_cast<int>(std::min<int64_t>(num_threads(), rows));
    std::vector<std::vector<float>> scratch(width, std::vector<float>((V + 63) / 64));
    parallel_for(static_cast<int>(rows), width, [&](int row, int me) {
      o[row] = kernels.sample_full_row(xp + row * V, V, sp[row], pp[row], up[row], scratch[me].data());
    });
  });
}

mx::array logsumexp_rows(const mx::array& x) {
  if (x.ndim() != 2 || x.shape(1) < 1 || x.dtype() != mx::float32)
    throw std::invalid_argument("logsumexp_rows: x (R, V) float32 with V >= 1, got " + describe(x));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({x.shape(0)}, mx::float32, std::make_shared<LogsumexpRows>(s), {x});
}

void LogsumexpRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  const RowMajor xin(inputs[0], encoder);
  const int64_t rows = inputs[0].shape(0), V = inputs[0].shape(1);
  encoder.dispatch([xin, o = out.data<float>(), rows, V] {
    const auto& kernels = cpu_kernels();
    const float* xp = xin.data<float>();
    const int width = rows * V < kMinParallelElements ? 1 : static_cast<int>(std::min<int64_t>(num_threads(), rows));
    parallel_for(static_cast<int>(rows), width, [&](int row, int) { o[row] = kernels.logsumexp_row(xp + row * V, V); });
  });
}

mx::array sample_candidates_rows(const mx::array& logits, const mx::array& scale, const mx::array& log2_min_p,
                                 const mx::array& top_k, const mx::array& top_p, const mx::array& uniforms) {
  const bool ok = logits.ndim() == 2 && logits.shape(1) >= 1 && logits.dtype() == mx::float32;
  bool rows_ok = ok && top_k.ndim() == 1 && top_k.shape(0) == logits.shape(0) && top_k.dtype() == mx::int32;
  for (const auto* a : {&scale, &log2_min_p, &top_p, &uniforms})
    rows_ok = rows_ok && a->ndim() == 1 && a->shape(0) == logits.shape(0) && a->dtype() == mx::float32;
  if (!rows_ok)
    throw std::invalid_argument("sample_candidates_rows: logits (R, V) float32 with V >= 1, top_k (R,) int32 and "
                                "scale, log2_min_p, top_p, uniforms (R,) float32, got " + describe(logits) + ", " +
                                describe(scale) + ", " + describe(log2_min_p) + ", " + describe(top_k) + ", " +
                                describe(top_p) + ", " + describe(uniforms));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({logits.shape(0)}, mx::int32, std::make_shared<SampleCandidateRows>(s),
                   {logits, scale, log2_min_p, top_k, top_p, uniforms});
}

void SampleCandidateRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  std::vector<RowMajor> in;
  for (const auto& a : inputs) in.emplace_back(a, encoder);
  const int64_t rows = inputs[0].shape(0), V = inputs[0].shape(1);
  encoder.dispatch([in, o = out.data<int32_t>(), rows, V] {
    const auto& kernels = cpu_kernels();
    const float *xp = in[0].data<float>(), *scale = in[1].data<float>(), *log2_min_p = in[2].data<float>();
    const int32_t* top_k = in[3].data<int32_t>();
    const float *top_p = in[4].data<float>(), *u = in[5].data<float>();
    const int width = rows * V < kMinParallelElements ? 1 : static_cast<int>(std::min<int64_t>(num_threads(), rows));
    parallel_for(static_cast<int>(rows), width, [&](int row, int) {
      const CandidateParams p{scale[row], log2_min_p[row], top_k[row], top_p[row], u[row]};
      o[row] = sample_candidate_row(kernels, xp + row * V, V, p, thread_scratch(V));
    });
  });
}

mx::array top_ids_rows(const mx::array& x, int n) {
  if (x.ndim() != 2 || x.dtype() != mx::float32 || n < 1 || n > x.shape(1))
    throw std::invalid_argument("top_ids_rows: x (R, V) float32 and 1 <= n <= V, got " + describe(x) + ", n = " +
                                std::to_string(n));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({x.shape(0), n}, mx::int32, std::make_shared<TopIdsRows>(s, n), {x});
}

void TopIdsRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  const RowMajor xin(inputs[0], encoder);
  const int64_t rows = inputs[0].shape(0), V = inputs[0].shape(1);
  encoder.dispatch([xin, o = out.data<int32_t>(), rows, V, n = n_] {
    const auto& kernels = cpu_kernels();
    const float* xp = xin.data<float>();
    const int width = rows * V < kMinParallelElements ? 1 : static_cast<int>(std::min<int64_t>(num_threads(), rows));
    parallel_for(static_cast<int>(rows), width, [&](int row, int) {
      top_ids_row(kernels, xp + row * V, V, n, o + row * n, thread_scratch(V));
    });
  });
}

void SampleCandidateRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("sample_candidates_rows: CPU only; GPU streams use metrale.sampling.ops");
}

void TopIdsRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("top_ids_rows: CPU only; GPU streams use metrale.sampling.ops.largest");
}

void LogsumexpRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("logsumexp_rows: CPU only; GPU streams use metrale.sampling.logprobs");
}

void SampleFullRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("sample_full_rows: CPU only; GPU streams use metrale.sampling.ops");
}

void ArgmaxRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("argmax_rows: CPU only; GPU streams use mx.argmax");
}

}  // namespace metrale
