// The PagedDecode primitive: graph construction, input checks and the CPU dispatch of kernel.h.
// Tasks (sequence, kv head) are spread over a small persistent thread pool
// (METRALE_ATTENTION_THREADS, default: the CPUs this process may use). A row whose block ids or
// context length are out of range gets NaN, never an out-of-bounds read; the Python wrapper checks
// the ranges first and raises.
#include "paged_decode.h"

#include "kv_write.h"

#include "isa.h"
#include "parallel.h"
#include "row_major.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/utils.h"

namespace metrale {

namespace {

constexpr int64_t kMinParallelWork = 1 << 14;  // keys x heads below which threads cost more than they save

Dtype kernel_dtype(mx::Dtype dtype) {
  if (dtype == mx::int8) return Dtype::q8;
  return dtype == mx::float32 ? Dtype::float32 : dtype == mx::float16 ? Dtype::float16 : Dtype::bfloat16;
}

void run_decode(const DecodeDims dm, Dtype dtype, const float* q, const void* kp, const void* vp,
                const int32_t* tables, const int32_t* ctx_lens, float* out) {
  const auto& kernels = cpu_kernels();
  const int rep = dm.n_heads / dm.n_kv, n_tasks = dm.batch * dm.n_kv;
  int64_t work = 0;
  int max_keys = 0;
  for (int b = 0; b < dm.batch; ++b) {
    // clamped to what the table can hold: a larger context_len is invalid (its row becomes NaN)
    int keys = std::min<int64_t>(ctx_lens[b], static_cast<int64_t>(dm.max_blocks) * dm.block_size);
    if (dm.window > 0) keys = std::min(keys, dm.window);
    max_keys = std::max(max_keys, keys);
    work += static_cast<int64_t>(std::max(keys, 0)) * dm.n_heads;
  }
  const int width = work < kMinParallelWork ? 1 : std::min(num_threads(), n_tasks);
  const int64_t per_thread = static_cast<int64_t>(kDecodeScratchRows) * std::max(max_keys, 1);
  std::vector<float> scratch(per_thread * width);  // allocated here, so the tasks never allocate
  parallel_for(n_tasks, width, [&](int task, int me) {
    const int b = task / dm.n_kv, g = task % dm.n_kv;
    const int64_t offset = (static_cast<int64_t>(b) * dm.n_heads + g * rep) * dm.head_dim;
    kernels.decode_task(dm, dtype, q + offset, kp, vp, tables + static_cast<int64_t>(b) * dm.max_blocks,
                        ctx_lens[b], out + offset, scratch.data() + me * per_thread, g);
  });
}

std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << a.shape();
  return os.str();
}

}  // namespace

mx::array paged_decode(const mx::array& queries, const mx::array& k_pool, const mx::array& v_pool,
                       const mx::array& block_tables, const mx::array& context_lens, float scale,
                       int block_size, int window) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("paged_decode: " + msg); };
  if (queries.ndim() != 3) fail("queries must be (B, n_heads, head_dim), got " + shape_str(queries));
  if (k_pool.ndim() != 3 || k_pool.shape() != v_pool.shape())
    fail("pools must both be (num_slots, n_kv_heads, head_dim), got " + shape_str(k_pool) + " and " + shape_str(v_pool));
  const bool q8 = k_pool.dtype() == mx::int8;
  if (k_pool.dtype() != v_pool.dtype() ||
      !(q8 || (mx::issubdtype(k_pool.dtype(), mx::floating) && k_pool.dtype() != mx::float64)))
    fail("pools must share one dtype among float32, float16, bfloat16, int8 (q8)");
  const int B = queries.shape(0), H = queries.shape(1), D = queries.shape(2), KV = k_pool.shape(1);
  if (q8 ? q8_group(D, k_pool.shape(2)) == 0 : k_pool.shape(2) != D)
    fail("pool rows of " + std::to_string(k_pool.shape(2)) + " elements do not hold head_dim " + std::to_string(D) +
         (q8 ? " int8 values and their float16 scales" : " values"));
  if (H % KV != 0) fail("n_heads " + std::to_string(H) + " is not a multiple of n_kv_heads " + std::to_string(KV));
  if (block_tables.ndim() != 2 || block_tables.shape(0) != B)
    fail("block_tables must be (B=" + std::to_string(B) + ", max_blocks), got " + shape_str(block_tables));
  if (context_lens.ndim() != 1 || context_lens.shape(0) != B)
    fail("context_lens must be (B=" + std::to_string(B) + ",), got " + shape_str(context_lens));
  if (block_size < 1 || k_pool.shape(0) % block_size != 0)
    fail("block_size " + std::to_string(block_size) + " must be >= 1 and divide num_slots " + std::to_string(k_pool.shape(0)));
  if (D % 8 != 0 || D > kMaxHeadDim)
    fail("head_dim " + std::to_string(D) + " must be a multiple of 8 and at most 256");
  if (window < 0) fail("window must be >= 0 (0: no window), got " + std::to_string(window));

  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {
      mx::astype(queries, mx::float32, s),
      k_pool,
      v_pool,
      mx::astype(block_tables, mx::int32, s),
      mx::astype(context_lens, mx::int32, s),
  };
  return mx::array(queries.shape(), mx::float32, std::make_shared<PagedDecode>(s, scale, block_size, window),
                   std::move(inputs));
}

void PagedDecode::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[0];
  const auto& kp = inputs[1];
  const auto& vp = inputs[2];
  const auto& tables = inputs[3];
  const auto& ctx = inputs[4];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);

  if (kp.dtype() != mx::float32 && kp.dtype() != mx::float16 && kp.dtype() != mx::bfloat16 && kp.dtype() != mx::int8)
    throw std::invalid_argument("paged_decode: unsupported pool dtype");
  const int group = kp.dtype() == mx::int8 ? q8_group(q.shape(2), kp.shape(2)) : 0;
  const DecodeDims dm{q.shape(0), q.shape(1), kp.shape(1), q.shape(2), tables.shape(1), block_size_, window_,
                      kp.shape(0) / block_size_, scale_, kp.shape(2), group};
  const RowMajor qin(q, encoder), kin(kp, encoder), vin(vp, encoder), tin(tables, encoder), cin(ctx, encoder);
  encoder.dispatch([=, op = out.data<float>(), dtype = kernel_dtype(kp.dtype())] {
    run_decode(dm, dtype, qin.data<float>(), kin.data<void>(), vin.data<void>(), tin.data<int32_t>(),
               cin.data<int32_t>(), op);
  });
}

void PagedDecode::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("paged_decode: CPU only; use the reference attention on GPU streams");
}

bool PagedDecode::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedDecode&>(other);
  return scale_ == o.scale_ && block_size_ == o.block_size_ && window_ == o.window_;
}

}  // namespace metrale
