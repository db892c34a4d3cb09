// The GatherQuantizedMatmul primitive (moe.h): rows grouped by expert, then the qmm micro-kernels of the
// kernel table (isa.h) per expert, over the kernel thread pool.
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "isa.h"
#include "kernel_table.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "parallel.h"
#include "qmm_common.h"
#include "row_major.h"

namespace metrale {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("gather_quantized_matmul: " + msg); }

// Rows grouped by expert: order[offsets[e] .. offsets[e + 1]) are the rows of expert e, ascending.
struct ExpertGroups {
  std::vector<int64_t> offsets;  // (E + 1,)
  std::vector<int64_t> order;    // (valid rows,)
};

ExpertGroups group_rows(const int32_t* ids, int64_t rows, int64_t experts) {
  ExpertGroups g;
  g.offsets.assign(experts + 1, 0);
  for (int64_t r = 0; r < rows; ++r)
    if (ids[r] >= 0 && ids[r] < experts) ++g.offsets[ids[r] + 1];
  for (int64_t e = 0; e < experts; ++e) g.offsets[e + 1] += g.offsets[e];
  g.order.resize(g.offsets[experts]);
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  for (int64_t r = 0; r < rows; ++r)
    if (ids[r] >= 0 && ids[r] < experts) g.order[next[ids[r]]++] = r;
  return g;
}


// The stacked experts: expert e's panels start e * panels * panel_bytes into q and e * panels * scale_bytes
// into scales / biases; `base` describes expert 0.
struct ExpertWeights {
  QmmWeights base;
  int64_t experts, panel_bytes, scale_bytes;

  QmmWeights expert(int64_t e) const {
    QmmWeights w = base;
    w.q = base.q + e * base.panels * panel_bytes;
    w.scales = static_cast<const uint8_t*>(base.scales) + e * base.panels * scale_bytes;
    w.biases = static_cast<const uint8_t*>(base.biases) + e * base.panels * scale_bytes;
    return w;
  }
};

// Per-call buffers of the grouped rows, one allocation reused by the calling thread (the CPU stream's):
//   xs (rows, K) float32 | ys (rows, N) float32 | xq (rows, act_row_bytes) int8 | xd, xisum (rows, K / 32)
//   | xsum (rows, K / group_size)
struct Scratch {
  float* xs;
  float* ys;
  QmmActs acts;
  int64_t N;

  Scratch(int64_t rows, int K, int64_t n, int group_size, int act_bits) : N(n) {
    thread_local std::vector<int64_t> buffer;
    const int64_t blocks = K / kActBlock, row_bytes = act_row_bytes(K, act_bits), groups = K / group_size;
    buffer.resize(static_cast<size_t>(ceil_div(rows * (4 * K + 4 * N + row_bytes + blocks * 8 + groups * 4), 8)) + 1);
    xs = reinterpret_cast<float*>(buffer.data());
    ys = xs + rows * K;
    auto* bytes = reinterpret_cast<uint8_t*>(ys + rows * N);
    acts = QmmActs{reinterpret_cast<int8_t*>(bytes), nullptr, nullptr, nullptr, rows, K, group_size, act_bits};
    acts.xd = reinterpret_cast<float*>(bytes + rows * row_bytes);
    acts.xisum = reinterpret_cast<int32_t*>(acts.xd + rows * blocks);
    acts.xsum = reinterpret_cast<float*>(acts.xisum + rows * blocks);
  }
};

// Row i of the grouped order reads x row order[i] / per_token; copied into xs and quantized into acts.
void quantize_gathered(const float* x, const ExpertGroups& g, int64_t per_token, Scratch& s) {
  const int64_t rows = s.acts.tokens, K = s.acts.K;
  const auto& kernels = cpu_kernels();
  const int tasks = static_cast<int>(ceil_div(rows, kRowsPerQuantizeTask));
  const int width = rows * K < (1 << 16) ? 1 : std::min(num_threads(), tasks);
  parallel_for(tasks, width, [&](int task, int) {
    const int64_t begin = task * kRowsPerQuantizeTask, end = std::min(rows, begin + kRowsPerQuantizeTask);
    for (int64_t i = begin; i < end; ++i)
      std::memcpy(s.xs + i * K, x + (g.order[i] / per_token) * K, sizeof(float) * K);
    kernels.qmm_quantize(s.xs, s.acts, begin, end);
  });
}

// ys rows of each used expert from its panels. Tasks: (expert, up to kPanelsPerTask panels or glu pairs,
// a block of its rows whose activations stay in L2); one thread below kMinParallelBytes of weights.
void run_experts(const ExpertWeights& w, const ExpertGroups& g, int glu, const Scratch& s) {
  const int64_t out_panels = glu >= 0 ? w.base.panels / 2 : w.base.panels;
  const int64_t block = std::max<int64_t>(8, kActivationBlockBytes / act_row_bytes(w.base.K, s.acts.bits) / 8 * 8);
  struct Task { int64_t expert, begin, end, t_begin, t_end; };
  std::vector<Task> tasks;
  int64_t touched = 0;  // weight bytes the call streams, once per tile of 8 rows
  for (int64_t e = 0; e < w.experts; ++e) {
    const int64_t r0 = g.offsets[e], r1 = g.offsets[e + 1];
    if (r0 == r1) continue;
    touched += w.base.panels * w.panel_bytes * ceil_div(r1 - r0, 8);
    for (int64_t t0 = r0; t0 < r1; t0 += block)
      for (int64_t p = 0; p < out_panels; p += kPanelsPerTask)
        tasks.push_back({e, p, std::min(out_panels, p + kPanelsPerTask), t0, std::min(r1, t0 + block)});
  }
  const auto& kernels = cpu_kernels();
  const int width = touched < kMinParallelBytes ? 1 : std::min(num_threads(), static_cast<int>(tasks.size()));
  parallel_for(static_cast<int>(tasks.size()), width, [&](int i, int) {
    const Task& t = tasks[i];
    kernels.qmm_panels(w.expert(t.expert), s.acts, QmmOut{s.ys, s.N, 0, s.N, glu}, t.begin, t.end, t.t_begin,
                       t.t_end);
  });
}

// ys (grouped order) back to the rows' order in out (rows, N); rows whose expert id is out of range
// (never made by metrale.models.moe.route) are NaN rather than read out of bounds.
void scatter_rows(const ExpertGroups& g, const float* ys, int64_t N, int64_t rows, float* out) {
  std::vector<char> written(static_cast<size_t>(rows), 0);
  for (size_t i = 0; i < g.order.size(); ++i) {
    std::memcpy(out + g.order[i] * N, ys + i * N, sizeof(float) * N);
    written[g.order[i]] = 1;
  }
  for (int64_t r = 0; r < rows; ++r)
    if (!written[r]) std::fill(out + r * N, out + (r + 1) * N, std::numeric_limits<float>::quiet_NaN());
}

}  // namespace

mx::array gather_quantized_matmul(const mx::array& x, const mx::array& q, const mx::array& scales,
                                  const mx::array& biases, const mx::array& indices, int bits, int group_size,
                                  int columns, int glu, int activation_bits, float bias_per_scale) {
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  if (q.ndim() != 3 || q.dtype() != mx::uint8) fail("q must be (experts, panels, bytes) uint8, got " + shape_str(q));
  if (scales.ndim() != 4 || scales.shape() != biases.shape() || scales.dtype() != biases.dtype() ||
      (scales.dtype() != mx::float16 && scales.dtype() != mx::float32) || scales.shape(3) != kPanelRows ||
      scales.shape(0) != q.shape(0) || scales.shape(1) != q.shape(1))
    fail("scales and biases must both be (experts, panels, K / group_size, 16) float16 or float32 matching q " +
         shape_str(q) + ", got " + shape_str(scales) + " and " + shape_str(biases));
  const int K = scales.shape(2) * group_size;
  if (static_cast<int64_t>(q.shape(2)) * 8 != int64_t{kPanelRows} * K * bits)
    fail("q " + shape_str(q) + " does not fit scales " + shape_str(scales) + " at " + std::to_string(bits) + " bits");
  if (x.ndim() < 1 || x.shape(-1) != K || x.dtype() != mx::float32)
    fail("x must be (..., K=" + std::to_string(K) + ") float32, got " + shape_str(x));
  if (!mx::issubdtype(indices.dtype(), mx::integer)) fail("indices must be integers, got " + shape_str(indices));
  const int64_t tokens = static_cast<int64_t>(x.size()) / K, rows = static_cast<int64_t>(indices.size());
  if ((tokens == 0) != (rows == 0) || (tokens > 0 && rows % tokens != 0))
    fail("indices " + shape_str(indices) + " must hold a whole number of rows per token of x " + shape_str(x));
  if (glu != -1 && glu != static_cast<int>(GatedKind::silu) && glu != static_cast<int>(GatedKind::gelu_tanh))
    fail("glu must be -1 (none), 0 (silu) or 1 (gelu_tanh), got " + std::to_string(glu));
  if (activation_bits != 8 && activation_bits != 12 && activation_bits != 16)
    fail("activation_bits must be 8, 12 or 16, got " + std::to_string(activation_bits));
  if (columns < 1 || ceil_div(columns, kPanelRows) * (glu >= 0 ? 2 : 1) != q.shape(1))
    fail(std::to_string(columns) + " columns do not fit " + std::to_string(q.shape(1)) + " panels per expert");
  if (!std::isfinite(bias_per_scale)) fail("bias_per_scale must be finite (0: none)");
  auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = indices.shape();
  shape.push_back(columns);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<GatherQuantizedMatmul>(s, bits, group_size, columns, glu, activation_bits,
                                                          bias_per_scale),
                   {x, q, scales, biases, mx::astype(indices, mx::int32, s)});
}

void GatherQuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& q = inputs[1];
  const auto& sc = inputs[2];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  const RowMajor xin(x, encoder), idin(inputs[4], encoder);
  const int K = static_cast<int>(x.shape(-1));
  const ExpertWeights w{{q.data<uint8_t>(), sc.data<void>(), inputs[3].data<void>(), q.shape(1), K, bits_, group_size_,
                         sc.dtype() == mx::float16, false, bias_per_scale_},
                        q.shape(0), q.shape(2), static_cast<int64_t>(sc.itemsize()) * sc.shape(2) * kPanelRows};
  encoder.dispatch([=, op = out.data<float>(), tokens = static_cast<int64_t>(x.size()) / K,
                    rows = static_cast<int64_t>(out.size()) / columns_, N = int64_t{columns_}, glu = glu_,
                    act_bits = activation_bits_] {
    if (rows == 0) return;
    const ExpertGroups g = group_rows(idin.data<int32_t>(), rows, w.experts);
    Scratch scratch(static_cast<int64_t>(g.order.size()), K, N, w.base.group_size, act_bits);
    quantize_gathered(xin.data<float>(), g, rows / tokens, scratch);
    run_experts(w, g, glu, scratch);
    scatter_rows(g, scratch.ys, N, rows, op);
  });
}

void GatherQuantizedMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("gather_quantized_matmul: CPU only; GPU streams use mx.gather_qmm");
}

bool GatherQuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatherQuantizedMatmul&>(other);
  return bits_ == o.bits_ && group_size_ == o.group_size_ && columns_ == o.columns_ && glu_ == o.glu_ &&
         activation_bits_ == o.activation_bits_ && bias_per_scale_ == o.bias_per_scale_;
}

}  // namespace metrale
