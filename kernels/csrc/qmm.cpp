// The QuantizedMatmul and QuantizedRows primitives: graph construction, checks, scratch and threads.
// The compute is the kernel table's (isa.h): quantize the activations once per call, then panels of
// 16 output rows spread over the kernel thread pool.
#include "qmm.h"

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
#include "mlx/transforms.h"
#include "parallel.h"
#include "qmm_common.h"
#include "row_major.h"

namespace metrale {

namespace {

[[noreturn]] void fail(const std::string& fn, const std::string& msg) {
  throw std::invalid_argument(fn + ": " + msg);
}

// Checks the packed weight; returns K.
int check_packed(const char* fn, const mx::array& q, const mx::array& scales, const mx::array& biases, int bits,
                 int group_size) {
  if (bits != 4 && bits != 8) fail(fn, "bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail(fn, "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  if (q.ndim() != 2 || q.dtype() != mx::uint8) fail(fn, "q must be (panels, bytes) uint8, got " + shape_str(q));
  if (scales.ndim() != 3 || scales.shape() != biases.shape() || scales.dtype() != biases.dtype() ||
      (scales.dtype() != mx::float16 && scales.dtype() != mx::float32) || scales.shape(2) != kPanelRows)
    fail(fn, "scales and biases must both be (panels, K / group_size, 16) float16 or float32, got " +
                 shape_str(scales) + " and " + shape_str(biases));
  const int K = scales.shape(1) * group_size;
  if (scales.shape(0) != q.shape(0) || static_cast<int64_t>(q.shape(1)) * 8 != int64_t{kPanelRows} * K * bits)
    fail(fn, "q " + shape_str(q) + " does not fit scales " + shape_str(scales) + " at " + std::to_string(bits) +
                 " bits, group " + std::to_string(group_size));
  return K;
}

mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

// A call of up to kDecodeTokens token rows streams its weights once (bandwidth-bound): its tasks are
// 16 panels (256 KiB of 4-bit weights at K = 2048) so that each thread reads long contiguous runs. With
// the weights on huge pages (ext.huge_page_copy), a decode-shaped harness (16 layers of 1B matrices,
// 2 threads) read 27.5-28.3 GB/s with 4-panel tasks and 30.6-32.6 with 16 (the read probe: 30-32);
// on 4 KiB pages both ~25. Through MLX (step_profile.py, 1B, huge pages, alternated): a step 34.7-35.1 ms
// with 4, 31.7-32.6 with 16; 32 and 64 no better (docs/quantized-kernels.md, "Decode at the read bandwidth").
constexpr int64_t kDecodeTokens = 8;
constexpr int64_t kDecodePanelsPerTask = 16;

}  // namespace

std::vector<mx::array> quantized_matmul(const mx::array& x, const mx::array& q, const mx::array& scales,
                                        const mx::array& biases, int bits, int group_size,
                                        const std::vector<int>& columns, int glu, int activation_bits,
                                        float bias_per_scale) {
  const char* fn = "quantized_matmul";
  const int K = check_packed(fn, q, scales, biases, bits, group_size);
  if (x.ndim() < 1 || x.shape(-1) != K || x.dtype() != mx::float32)
    fail(fn, "x must be (..., K=" + std::to_string(K) + ") float32, got " + shape_str(x));
  if (columns.empty()) fail(fn, "columns must name at least one output");
  if (glu != -1 && glu != static_cast<int>(GatedKind::silu) && glu != static_cast<int>(GatedKind::gelu_tanh))
    fail(fn, "glu must be -1 (none), 0 (silu) or 1 (gelu_tanh), got " + std::to_string(glu));
  if (glu >= 0 && columns.size() != 1) fail(fn, "glu takes exactly one output");
  if (activation_bits != 8 && activation_bits != 12 && activation_bits != 16)
    fail(fn, "activation_bits must be 8, 12 or 16, got " + std::to_string(activation_bits));
  int64_t panels = 0;
  for (int c : columns) {
    if (c < 1) fail(fn, "every output needs at least one column");
    panels += ceil_div(c, kPanelRows) * (glu >= 0 ? 2 : 1);
  }
  if (panels != q.shape(0))
    fail(fn, "the outputs need " + std::to_string(panels) + " panels of 16 rows, the weight has " +
                 std::to_string(q.shape(0)));
  auto s = cpu_stream();
  std::vector<mx::Shape> shapes;
  for (int c : columns) {
    mx::Shape shape = x.shape();
    shape.back() = c;
    shapes.push_back(std::move(shape));
  }
  if (!std::isfinite(bias_per_scale)) fail(fn, "bias_per_scale must be finite (0: none)");
  auto primitive =
      std::make_shared<QuantizedMatmul>(s, bits, group_size, columns, glu, activation_bits, bias_per_scale);
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(columns.size(), mx::float32), primitive,
                                {x, q, scales, biases});
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (int c : columns_) {
    mx::Shape shape = inputs[0].shape();
    shape.back() = c;
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmul&>(other);
  return bits_ == o.bits_ && group_size_ == o.group_size_ && columns_ == o.columns_ && glu_ == o.glu_ &&
         activation_bits_ == o.activation_bits_ && bias_per_scale_ == o.bias_per_scale_;
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("quantized_matmul: CPU only; GPU streams use MLX's quantized_matmul");
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& q = inputs[1];
  const auto& sc = inputs[2];
  const auto& bi = inputs[3];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  const RowMajor xin(x, encoder);
  std::vector<QmmOut> outs;
  int64_t first_panel = 0;
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    const int64_t columns = out.shape(-1);
    outs.push_back({out.data<float>(), columns, first_panel, columns, glu_});
    first_panel += ceil_div(columns, kPanelRows);
  }
  const int K = static_cast<int>(x.shape(-1));
  const QmmWeights w{q.data<uint8_t>(), sc.data<void>(), bi.data<void>(), q.shape(0), K, bits_, group_size_,
                     sc.dtype() == mx::float16, false, bias_per_scale_};
  const int64_t tokens = static_cast<int64_t>(x.size()) / K;
  encoder.dispatch([w, outs, tokens, act_bits = activation_bits_, xin] {
    if (tokens == 0) return;
    const float* xp = xin.data<float>();
    const auto& kernels = cpu_kernels();
    // scratch: xq (T, act_row_bytes) int8 | xd (T, K / 32) | xisum (T, K / 32) | xsum (T, K / group)
    thread_local std::vector<int64_t> scratch;  // per calling thread (the CPU stream's)
    const int64_t blocks = w.K / kActBlock, groups = w.K / w.group_size, row_bytes = act_row_bytes(w.K, act_bits);
    const int64_t bytes = tokens * (row_bytes + blocks * 8 + groups * 4);
    scratch.resize(static_cast<size_t>(ceil_div(bytes, 8)));
    auto* base = reinterpret_cast<uint8_t*>(scratch.data());
    QmmActs acts{reinterpret_cast<int8_t*>(base), nullptr, nullptr, nullptr, tokens, w.K, w.group_size, act_bits};
    acts.xd = reinterpret_cast<float*>(base + tokens * row_bytes);
    acts.xisum = reinterpret_cast<int32_t*>(acts.xd + tokens * blocks);
    acts.xsum = reinterpret_cast<float*>(acts.xisum + tokens * blocks);

    const int quantize_tasks = static_cast<int>(ceil_div(tokens, kRowsPerQuantizeTask));
    const int quantize_width = tokens * w.K < (1 << 16) ? 1 : std::min(num_threads(), quantize_tasks);
    parallel_for(quantize_tasks, quantize_width, [&](int task, int) {
      const int64_t begin = task * kRowsPerQuantizeTask;
      kernels.qmm_quantize(xp, acts, begin, std::min(tokens, begin + kRowsPerQuantizeTask));
    });

    // Tasks: a few panels (pairs with glu) of one output x a block of tokens whose
    // activations stay in L2 (every panel of the task reads all of them), token blocks outermost so
    // that a thread's consecutive tasks share activations.
    // (the kernel set says what suits its panels: qmm_task_shape)
    const QmmTaskShape shape = kernels.qmm_task_shape(act_bits, tokens);
    const int64_t block = std::max<int64_t>(shape.min_tokens, kActivationBlockBytes / row_bytes / 16 * 16);
    const int64_t per_task = tokens <= kDecodeTokens ? kDecodePanelsPerTask : shape.panels_per_task;
    struct Task { int out; int64_t begin, end, t_begin, t_end; };
    std::vector<Task> tasks;
    for (int64_t t0 = 0; t0 < tokens; t0 += block) {
      for (int j = 0; j < static_cast<int>(outs.size()); ++j) {
        const int64_t first = outs[j].first_panel, n = ceil_div(outs[j].columns, kPanelRows);
        for (int64_t p = first; p < first + n; p += per_task)
          tasks.push_back({j, p, std::min(first + n, p + per_task), t0, std::min(tokens, t0 + block)});
      }
    }
    const int64_t weight_bytes = w.panels * int64_t{kPanelRows} * w.K * w.bits / 8;
    const int64_t tiles = ceil_div(tokens, 8);
    const int width =
        weight_bytes * tiles < kMinParallelBytes ? 1 : std::min(num_threads(), static_cast<int>(tasks.size()));
    parallel_for(static_cast<int>(tasks.size()), width, [&](int i, int) {
      const Task& t = tasks[i];
      kernels.qmm_panels(w, acts, outs[t.out], t.begin, t.end, t.t_begin, t.t_end);
    });
  });
}

// ---- QuantizedRows: an embedding lookup from the packed weight ----

mx::array quantized_rows(const mx::array& q, const mx::array& scales, const mx::array& biases, const mx::array& ids,
                         int bits, int group_size, int rows) {
  const char* fn = "quantized_rows";
  const int K = check_packed(fn, q, scales, biases, bits, group_size);
  if (!mx::issubdtype(ids.dtype(), mx::integer)) fail(fn, "ids must be integers, got " + shape_str(ids));
  if (rows < 1 || ceil_div(rows, kPanelRows) != q.shape(0))
    fail(fn, "rows " + std::to_string(rows) + " does not fit " + std::to_string(q.shape(0)) + " panels");
  auto s = cpu_stream();
  mx::Shape shape = ids.shape();
  shape.push_back(K);
  return mx::array(std::move(shape), mx::float32, std::make_shared<QuantizedRows>(s, bits, group_size, rows),
                   {q, scales, biases, mx::astype(ids, mx::int32, s)});
}

void QuantizedRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[0];
  const auto& sc = inputs[1];
  const auto& bi = inputs[2];
  const auto& ids = inputs[3];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const int K = static_cast<int>(out.shape(-1)), groups = sc.shape(1), bits = bits_, gs = group_size_, rows = rows_;
  const int64_t panel_bytes = q.shape(1);
  const bool f16 = sc.dtype() == mx::float16;
  const RowMajor idin(ids, encoder);
  encoder.dispatch([=, qp = q.data<uint8_t>(), sp = sc.data<void>(), bp = bi.data<void>(), op = out.data<float>(),
                    n = static_cast<int64_t>(ids.size())] {
    const int32_t* ip = idin.data<int32_t>();
    auto scale_at = [&](const void* base, int64_t i) {
      return f16 ? static_cast<float>(static_cast<const mx::float16_t*>(base)[i]) : static_cast<const float*>(base)[i];
    };
    for (int64_t t = 0; t < n; ++t) {
      float* o = op + t * K;
      const int32_t id = ip[t];
      if (id < 0 || id >= rows) {  // the Python wrapper checks ids; never read out of bounds
        std::fill(o, o + K, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const int64_t p = id / kPanelRows, r = id % kPanelRows;
      const uint8_t* panel = qp + p * panel_bytes;
      for (int k = 0; k < K; ++k) {
        int value;
        if (bits == 8) {
          value = panel[(k / 4) * 64 + 4 * r + k % 4];
        } else {
          const int within = k % 8;
          value = (panel[(k / 8) * 64 + 4 * r + within % 4] >> (4 * (within / 4))) & 15;
        }
        const int64_t si = (p * groups + k / gs) * kPanelRows + r;
        o[k] = static_cast<float>(value) * scale_at(sp, si) + scale_at(bp, si);
      }
    }
  });
}

void QuantizedRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("quantized_rows: CPU only; GPU streams use MLX's QuantizedEmbedding");
}

bool QuantizedRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedRows&>(other);
  return bits_ == o.bits_ && group_size_ == o.group_size_ && rows_ == o.rows_;
}

}  // namespace metrale
