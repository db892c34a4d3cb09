// The PagedPrefill primitive: graph construction, input checks and the CPU dispatch of prefill_kernel.h,
// or of the kernel set's staged kernel where it has one (prefill_amx.cpp: K/V converted once per chunk,
// then attended on AMX tiles; kernel_table.h PrefillStaged). Tasks (query tile, kv head), the tiles with
// the most keys first, are spread over the kernel thread pool. Block ids outside the pool give NaN rows,
// never an out-of-bounds read (the Python side checks them first and raises).
#include "paged_prefill.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "isa.h"
#include "kv_write.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/utils.h"
#include "parallel.h"
#include "row_major.h"
#include "softmax_parts.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace metrale {

namespace {

constexpr int64_t kMinParallelWork = 1 << 16;  // query-key pairs x heads below which one thread is faster
constexpr int kTasksPerThread = 2;  // split key ranges until the threads have this many tasks each
constexpr int kMinSplitKeys = 512;  // ... but never into parts shorter than this (a part re-reads its queries)

std::string shape_of(const mx::array& a) {
  std::ostringstream os;
  os << a.shape() << " " << a.dtype();
  return os.str();
}

// Queries per task: a task's working set (queries^T and outputs, rows x head_dim each, the score tile
// and the widened K/V tile) stays near L1 + L2: 32 queries at head_dim <= 64, 16 above. Measured with the
// 1B shape (4 query heads per kv head) at context 4k, one core: 32 x 32 keys beat 16 x 64 by ~10% at
// head_dim 64; at 128, 32 queries lost ~10% (benchmarks/prefill_attention_bench.py).
int query_tile(int head_dim) { return head_dim <= 64 ? kPrefillQueries : kPrefillQueries / 2; }

int parallel_width(const PrefillDims& dm, int n_tasks) {
  const int64_t keys = static_cast<int64_t>(dm.first_position) + dm.q_len;
  const int64_t work = static_cast<int64_t>(dm.q_len) * (dm.window > 0 ? std::min<int64_t>(keys, dm.window) : keys) * dm.n_heads;
  return work < kMinParallelWork ? 1 : std::min(num_threads(), n_tasks);
}

// The staged kernel (kernel_table.h PrefillStaged): the chunk's K/V converted once per (kv head, key block),
// then tasks (kv head, query tile), a kv head's tiles consecutive (its staged keys stay in cache), the
// longest first. Both buffers are allocated here, so the tasks never allocate.
// The staged K/V of the chunks this thread runs, kept between calls up to kKeepBytes: a fresh buffer costs a
// page fault per 4 KiB page (measured ~5 ms of a 50 ms 4k-context call of the 1B shape); 2 MiB aligned and
// advised to huge pages (fewer TLB misses: every task walks the whole context).
class StagingBuffer {
 public:
  static constexpr int64_t kKeepBytes = int64_t{256} << 20;
  static constexpr size_t kAlign = size_t{2} << 20;
  ~StagingBuffer() { std::free(data_); }
  void* get(int64_t bytes) {
    if (bytes > capacity_) {
      std::free(data_);
      data_ = nullptr;
      capacity_ = 0;
      const size_t size = (static_cast<size_t>(bytes) + kAlign - 1) / kAlign * kAlign;
      data_ = std::aligned_alloc(kAlign, size);
      if (data_ == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
      madvise(data_, size, MADV_HUGEPAGE);  // advice only: without huge pages it still works
#endif
      capacity_ = static_cast<int64_t>(size);
    }
    return data_;
  }
  void trim() {  // after a call: a buffer beyond kKeepBytes is not kept
    if (capacity_ > kKeepBytes) {
      std::free(data_);
      data_ = nullptr;
      capacity_ = 0;
    }
  }

 private:
  void* data_ = nullptr;
  int64_t capacity_ = 0;
};

void run_staged(const PrefillStaged& st, int64_t bytes, const PrefillDims dm, Dtype dtype, const float* q,
                const void* kp, const void* vp, const int32_t* table, float* out) {
  static thread_local StagingBuffer buffer;
  void* staged = buffer.get(bytes);
  constexpr int kStageBlocks = 8;  // key blocks per staging task
  const int blocks = st.key_blocks(dm), parts = (blocks + kStageBlocks - 1) / kStageBlocks;
  parallel_for(dm.n_kv * parts, parallel_width(dm, dm.n_kv * parts), [&](int task, int) {
    const int g = task / parts, b0 = task % parts * kStageBlocks;
    st.stage(dm, dtype, kp, vp, table, staged, g, b0, std::min(blocks, b0 + kStageBlocks));
  });
  const int tile_q = st.query_tile(dm), tiles = (dm.q_len + tile_q - 1) / tile_q, n_tasks = tiles * dm.n_kv;
  const int width = parallel_width(dm, n_tasks);
  const int64_t per_thread = st.scratch_floats(dm);
  std::vector<float> scratch(per_thread * width);
  parallel_for(n_tasks, width, [&](int task, int me) {
    const int g = task / tiles, tile = tiles - 1 - task % tiles;
    const int q_begin = tile * tile_q, q_end = std::min(dm.q_len, q_begin + tile_q);
    st.task(dm, dtype, q, table, staged, out, scratch.data() + me * per_thread, g, q_begin, q_end);
  });
  buffer.trim();
}

// One prefill task: kv head g, queries [q_begin, q_end), keys [key_begin, key_end); part -1: the whole key range,
// written normalized; else the index of its partial (O, m, l), merged by merge_parts.
struct PrefillTask {
  int g, q_begin, q_end, key_begin, key_end;
  int64_t part;
};

// One task per (kv head, query tile), the longest rows first; when those are fewer than two per thread (few kv
// heads, a short chunk: the default model's 3 kv heads on 2 threads left one thread idle a third of the time),
// each task's key range is split into equal parts on key-tile boundaries, none shorter than kMinSplitKeys.
std::vector<PrefillTask> plan_tasks(const PrefillDims& dm, int tile_q, int width, int64_t* n_parts) {
  const int tiles = (dm.q_len + tile_q - 1) / tile_q, n_tasks = tiles * dm.n_kv;
  const int want = width * kTasksPerThread;
  std::vector<PrefillTask> tasks;
  *n_parts = 0;
  for (int task = 0; task < n_tasks; ++task) {
    const int tile = tiles - 1 - task / dm.n_kv, g = task % dm.n_kv;
    const int q_begin = tile * tile_q, q_end = std::min(dm.q_len, q_begin + tile_q);
    const int first = dm.first_position + q_begin, last = dm.first_position + q_end - 1;
    const int lo = dm.window > 0 ? std::max(0, first - dm.window + 1) : 0;
    const int keys = last - lo + 1;
    int parts = width > 1 && n_tasks < want ? (want + n_tasks - 1) / n_tasks : 1;
    parts = std::max(1, std::min(parts, keys / kMinSplitKeys));
    if (parts == 1) {
      tasks.push_back({g, q_begin, q_end, 0, std::numeric_limits<int>::max(), -1});
      continue;
    }
    const int step = ((keys + parts - 1) / parts + kPrefillKeys - 1) / kPrefillKeys * kPrefillKeys;
    for (int k = lo; k <= last; k += step)
      tasks.push_back({g, q_begin, q_end, k, std::min(last + 1, k + step), (*n_parts)++});
  }
  return tasks;
}

// out's rows of each split task: its parts merged (merge_row), their maxima in log2 units as prefill_kernel.h
// keeps them.
void merge_parts(const PrefillDims& dm, const std::vector<PrefillTask>& tasks, const float* parts, int64_t stride,
                 float* out) {
  const int hd = dm.head_dim, rep = dm.n_heads / dm.n_kv;
  std::vector<const float*> group;
  for (size_t i = 0; i < tasks.size();) {
    size_t end = i + 1;
    if (tasks[i].part < 0) {
      i = end;
      continue;
    }
    while (end < tasks.size() && tasks[end].part >= 0 && tasks[end].g == tasks[i].g &&
           tasks[end].q_begin == tasks[i].q_begin)
      ++end;
    group.clear();
    for (size_t p = i; p < end; ++p) group.push_back(parts + tasks[p].part * stride);
    const PrefillTask& t = tasks[i];
    const int rows = (t.q_end - t.q_begin) * rep;
    for (int r = 0; r < rows; ++r) {
      float* o = out + (static_cast<int64_t>(t.q_begin + r / rep) * dm.n_heads + t.g * rep + r % rep) * hd;
      merge_row(group.data(), group.size(), rows, hd, r, [](float x) { return std::exp2(x); }, o);
    }
    i = end;
  }
}

void run_prefill(const PrefillDims dm, Dtype dtype, const float* q, const void* kp, const void* vp,
                 const int32_t* table, float* out) {
  const auto& kernels = cpu_kernels();
  if (kernels.prefill_staged != nullptr) {
    const int64_t bytes = kernels.prefill_staged->staged_bytes(dm, dtype);
    if (bytes > 0) return run_staged(*kernels.prefill_staged, bytes, dm, dtype, q, kp, vp, table, out);
  }
  const int tile_q = query_tile(dm.head_dim);
  const int width = parallel_width(dm, std::numeric_limits<int>::max());  // the threads the work is worth
  int64_t n_parts = 0;
  const std::vector<PrefillTask> tasks = plan_tasks(dm, tile_q, width, &n_parts);
  const int threads = std::min(width, static_cast<int>(tasks.size()));
  const int rows = tile_q * (dm.n_heads / dm.n_kv);
  const int64_t per_thread = prefill_scratch_floats(rows, dm.head_dim), stride = prefill_part_floats(rows, dm.head_dim);
  // allocated here, so the tasks never allocate: per-thread scratch, the parts of split tasks
  std::vector<float> scratch(per_thread * threads), parts(stride * n_parts);
  parallel_for(static_cast<int>(tasks.size()), threads, [&](int i, int me) {
    const PrefillTask& t = tasks[i];
    float* part = t.part < 0 ? nullptr : parts.data() + t.part * stride;
    kernels.prefill_task(dm, dtype, q, kp, vp, table, out, scratch.data() + me * per_thread, t.g, t.q_begin, t.q_end,
                         t.key_begin, t.key_end, part);
  });
  merge_parts(dm, tasks, parts.data(), stride, out);
}

}  // namespace

mx::array paged_prefill(const mx::array& queries, const mx::array& k_pool, const mx::array& v_pool,
                        const mx::array& block_table, int first_position, float scale, int block_size, int window) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("paged_prefill: " + msg); };
  if (queries.ndim() != 3) fail("queries must be (q_len, n_heads, head_dim), got " + shape_of(queries));
  if (k_pool.ndim() != 4 || k_pool.shape() != v_pool.shape() || k_pool.dtype() != v_pool.dtype())
    fail("pools must both be (num_blocks, n_kv_heads, block_size, head_dim) of one dtype, got " + shape_of(k_pool) +
         " and " + shape_of(v_pool));
  const bool q8 = k_pool.dtype() == mx::int8;
  if (k_pool.dtype() != mx::float32 && k_pool.dtype() != mx::float16 && k_pool.dtype() != mx::bfloat16 && !q8)
    fail("pools must be float32, float16, bfloat16 or int8 (q8), got " + shape_of(k_pool));
  const int H = queries.shape(1), D = queries.shape(2), KV = k_pool.shape(1);
  if (q8 ? q8_group(D, k_pool.shape(3)) == 0 : k_pool.shape(3) != D)
    fail("pool rows of " + std::to_string(k_pool.shape(3)) + " elements do not hold head_dim " + std::to_string(D) +
         (q8 ? " int8 values and their float16 scales" : " values"));
  if (H % KV != 0) fail("n_heads " + std::to_string(H) + " is not a multiple of n_kv_heads " + std::to_string(KV));
  if (D % 8 != 0 || D > kMaxHeadDim) fail("head_dim " + std::to_string(D) + " must be a multiple of 8 and at most 256");
  if (block_table.ndim() != 1) fail("block_table must be (max_blocks,), got " + shape_of(block_table));
  if (block_size != k_pool.shape(2))
    fail("block_size " + std::to_string(block_size) + " is not the pools' " + std::to_string(k_pool.shape(2)));
  if (first_position < 0) fail("first_position must be >= 0, got " + std::to_string(first_position));
  if (static_cast<int64_t>(first_position) + queries.shape(0) > static_cast<int64_t>(block_table.shape(0)) * block_size)
    fail("block_table of " + std::to_string(block_table.shape(0)) + " blocks does not cover position " +
         std::to_string(first_position + queries.shape(0) - 1));
  if (window < 0) fail("window must be >= 0 (0: no window), got " + std::to_string(window));
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::astype(queries, mx::float32, s), k_pool, v_pool,
                                   mx::astype(block_table, mx::int32, s)};
  return mx::array(queries.shape(), mx::float32,
                   std::make_shared<PagedPrefill>(s, first_position, scale, block_size, window), std::move(inputs));
}

void PagedPrefill::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[0];
  const auto& kp = inputs[1];
  const auto& vp = inputs[2];
  const auto& table = inputs[3];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const Dtype dtype = kp.dtype() == mx::int8      ? Dtype::q8
                      : kp.dtype() == mx::float32 ? Dtype::float32
                      : kp.dtype() == mx::float16 ? Dtype::float16
                                                  : Dtype::bfloat16;
  const int group = kp.dtype() == mx::int8 ? q8_group(q.shape(2), kp.shape(3)) : 0;
  const PrefillDims dm{q.shape(0), q.shape(1), kp.shape(1), q.shape(2), table.shape(0), block_size_, window_, first_,
                       kp.shape(0), scale_, kp.shape(3), group};
  const RowMajor qin(q, encoder), kin(kp, encoder), vin(vp, encoder), tin(table, encoder);
  encoder.dispatch([=, op = out.data<float>()] {
    run_prefill(dm, dtype, qin.data<float>(), kin.data<void>(), vin.data<void>(), tin.data<int32_t>(), op);
  });
}

void PagedPrefill::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("paged_prefill: CPU only; use the reference attention on GPU streams");
}

bool PagedPrefill::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedPrefill&>(other);
  return first_ == o.first_ && scale_ == o.scale_ && block_size_ == o.block_size_ && window_ == o.window_;
}

}  // namespace metrale
