// The PagedDecode primitive: graph construction, input checks and the CPU dispatch of kernel.h.
// Tasks (a sequence, or a range of a long sequence's keys, with all its heads: attention_kernel.h) are
// spread over a small persistent thread pool (METRALE_ATTENTION_THREADS, default: the CPUs this process
// may use); the partials of a split sequence are merged here. A row whose block ids or
// context length are out of range gets NaN, never an out-of-bounds read; the Python wrapper checks
// the ranges first and raises.
#include "paged_decode.h"

#include "kv_write.h"

#include "isa.h"
#include "parallel.h"
#include "row_major.h"
#include "softmax_parts.h"

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

constexpr int64_t kMinParallelWork = 1 << 12;  // keys x heads below which threads cost more than they save
constexpr int kTasksPerThread = 4;  // split long contexts until the threads have this many tasks each
constexpr int kMinSplitKeys = 256;  // ... but never into parts shorter than this (the merge costs a pass)
constexpr int kMinShortSplitKeys = 64;  // ... except to give every thread a task at all (a short row alone)

Dtype kernel_dtype(mx::Dtype dtype) {
  if (dtype == mx::int8) return Dtype::q8;
  return dtype == mx::float32 ? Dtype::float32 : dtype == mx::float16 ? Dtype::float16 : Dtype::bfloat16;
}

// The keys [begin, end) row b attends to, or begin = end = -1 when its context length or a block id it
// would read is out of range (the row becomes NaN) or it has no key.
struct KeyRange {
  int begin, end;
};

KeyRange key_range(const DecodeDims& dm, const int32_t* table, int ctx) {
  if (ctx < 1 || static_cast<int64_t>(ctx) > static_cast<int64_t>(dm.max_blocks) * dm.block_size) return {-1, -1};
  const int begin = dm.window > 0 ? std::max(0, ctx - dm.window) : 0;
  for (int j = begin / dm.block_size; j <= (ctx - 1) / dm.block_size; ++j)
    if (table[j] < 0 || table[j] >= dm.num_blocks) return {-1, -1};
  return {begin, ctx};
}

// One task: keys [begin, end) of row b. A row in one task is written normalized straight into the
// output; a split row's parts write partials (acc (H, hd), ml (2, H)) at `partial`, merged afterwards.
struct DecodeTask {
  int b, begin, end;
  int64_t partial;  // index of the task's partial, -1: a whole row
};

// Whole rows, unless there are fewer than threads x kTasksPerThread of them: then every row longer than
// `part` keys (whole blocks, at least kMinSplitKeys) is split into parts of `part` keys (flash decoding).
// Where parts of kMinSplitKeys would still leave a thread without a task (one row of a few hundred
// keys: every decode step of one stream), the parts shrink to one per thread, down to kMinShortSplitKeys.
std::vector<DecodeTask> plan_tasks(const DecodeDims& dm, const std::vector<KeyRange>& ranges, int width,
                                   int64_t* n_partials) {
  int64_t total = 0, rows = 0;
  for (const auto& r : ranges) total += r.end - r.begin, rows += r.begin >= 0;
  const int64_t want = static_cast<int64_t>(width) * kTasksPerThread;
  int64_t part = std::numeric_limits<int>::max();
  if (width > 1 && rows < want) {
    part = std::max<int64_t>(kMinSplitKeys, (total + want - 1) / want);
    if (total < part * width) part = std::max<int64_t>(kMinShortSplitKeys, (total + width - 1) / width);
    part = (part + dm.block_size - 1) / dm.block_size * dm.block_size;
  }
  std::vector<DecodeTask> tasks;
  *n_partials = 0;
  for (int b = 0; b < dm.batch; ++b) {
    const auto [begin, end] = ranges[b];
    if (begin < 0) continue;
    if (end - begin <= part) {
      tasks.push_back({b, begin, end, -1});
      continue;
    }
    for (int64_t t = begin; t < end;) {  // part boundaries on whole blocks
      const int64_t next = std::min<int64_t>(end, (t / dm.block_size) * dm.block_size + part);
      tasks.push_back({b, static_cast<int>(t), static_cast<int>(next), (*n_partials)++});
      t = next;
    }
  }
  return tasks;
}

// out[b] = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i over the parts i of row b, M = max_i m_i (merge_row).
void merge_partials(const DecodeDims& dm, const std::vector<DecodeTask>& tasks, const float* partials, float* out) {
  const int H = dm.n_heads, hd = dm.head_dim;
  const int64_t stride = static_cast<int64_t>(H) * hd + 2 * H;
  std::vector<const float*> parts;
  for (size_t i = 0; i < tasks.size();) {
    size_t end = i;
    while (end < tasks.size() && tasks[end].b == tasks[i].b && tasks[end].partial >= 0) ++end;
    if (end == i) {
      ++i;
      continue;
    }
    parts.clear();
    for (size_t p = i; p < end; ++p) parts.push_back(partials + tasks[p].partial * stride);
    float* o = out + static_cast<int64_t>(tasks[i].b) * H * hd;
    for (int h = 0; h < H; ++h)
      merge_row(parts.data(), parts.size(), H, hd, h, [](float x) { return std::exp(x); }, o + h * hd);
    i = end;
  }
}

void run_decode(const DecodeDims dm, Dtype dtype, const float* q, const void* kp, const void* vp,
                const int32_t* tables, const int32_t* ctx_lens, float* out) {
  const auto& kernels = cpu_kernels();
  const int H = dm.n_heads, hd = dm.head_dim;
  std::vector<KeyRange> ranges(dm.batch);
  int64_t work = 0;
  for (int b = 0; b < dm.batch; ++b) {
    ranges[b] = key_range(dm, tables + static_cast<int64_t>(b) * dm.max_blocks, ctx_lens[b]);
    if (ranges[b].begin < 0)
      std::fill(out + static_cast<int64_t>(b) * H * hd, out + static_cast<int64_t>(b + 1) * H * hd,
                std::numeric_limits<float>::quiet_NaN());
    work += static_cast<int64_t>(ranges[b].end - ranges[b].begin) * H;
  }
  const int width = work < kMinParallelWork ? 1 : num_threads();
  int64_t n_partials = 0;
  const std::vector<DecodeTask> tasks = plan_tasks(dm, ranges, width, &n_partials);
  // allocated here, so the tasks never allocate: per-thread scratch (with a row's ml), the partials
  const int64_t partial_floats = static_cast<int64_t>(H) * hd + 2 * H;
  const int64_t per_thread = decode_scratch_floats(H, hd) + 2 * H;
  std::vector<float> scratch(per_thread * width), partials(partial_floats * n_partials);
  parallel_for(static_cast<int>(tasks.size()), width, [&](int i, int me) {
    const DecodeTask& t = tasks[i];
    float* mine = scratch.data() + me * per_thread;
    const bool whole = t.partial < 0;
    float* acc = whole ? out + static_cast<int64_t>(t.b) * H * hd : partials.data() + t.partial * partial_floats;
    float* ml = whole ? mine : acc + static_cast<int64_t>(H) * hd;
    kernels.decode_task(dm, dtype, q + static_cast<int64_t>(t.b) * H * hd, kp, vp,
                        tables + static_cast<int64_t>(t.b) * dm.max_blocks, t.begin, t.end, acc, ml, mine + 2 * H,
                        whole);
  });
  merge_partials(dm, tasks, partials.data(), out);
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
  if (k_pool.ndim() != 4 || k_pool.shape() != v_pool.shape())
    fail("pools must both be (num_blocks, n_kv_heads, block_size, head_dim), got " + shape_str(k_pool) + " and " +
         shape_str(v_pool));
  const bool q8 = k_pool.dtype() == mx::int8;
  if (k_pool.dtype() != v_pool.dtype() ||
      !(q8 || (mx::issubdtype(k_pool.dtype(), mx::floating) && k_pool.dtype() != mx::float64)))
    fail("pools must share one dtype among float32, float16, bfloat16, int8 (q8)");
  const int B = queries.shape(0), H = queries.shape(1), D = queries.shape(2), KV = k_pool.shape(1);
  if (q8 ? q8_group(D, k_pool.shape(3)) == 0 : k_pool.shape(3) != D)
    fail("pool rows of " + std::to_string(k_pool.shape(3)) + " elements do not hold head_dim " + std::to_string(D) +
         (q8 ? " int8 values and their float16 scales" : " values"));
  if (H % KV != 0) fail("n_heads " + std::to_string(H) + " is not a multiple of n_kv_heads " + std::to_string(KV));
  if (block_tables.ndim() != 2 || block_tables.shape(0) != B)
    fail("block_tables must be (B=" + std::to_string(B) + ", max_blocks), got " + shape_str(block_tables));
  if (context_lens.ndim() != 1 || context_lens.shape(0) != B)
    fail("context_lens must be (B=" + std::to_string(B) + ",), got " + shape_str(context_lens));
  if (block_size != k_pool.shape(2))
    fail("block_size " + std::to_string(block_size) + " is not the pools' " + std::to_string(k_pool.shape(2)));
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
  const int group = kp.dtype() == mx::int8 ? q8_group(q.shape(2), kp.shape(3)) : 0;
  const DecodeDims dm{q.shape(0), q.shape(1), kp.shape(1), q.shape(2), tables.shape(1), block_size_, window_,
                      kp.shape(0), scale_, kp.shape(3), group};
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
