// One paged prefill task (kernels/csrc/prefill_kernel.h: prefill_task) timed alone, on one core: the kernel's
// own rate, free of MLX's per-call cost (~0.5 ms a call, more than a short chunk's whole task) and of the
// thread pool. kv head 0's rows of a chunk of T queries ending at context `ctx`, float16 pool in the kernels'
// layout (block, kv head, slot, hd), block size 16, head_dim 64; the best of `reps` calls.
//
//   c++ -std=c++20 -O3 -mavx2 -mfma -mf16c -Ikernels/csrc benchmarks/prefill_task_probe.cpp -o /tmp/prefill_probe
//   /tmp/prefill_probe 4096 32 30 3 9      # ctx T reps n_kv n_heads: the default model's GQA (3 kv, 9 q heads)
//
// Prints one JSON line: ms per task, GFLOP/s (4 x head_dim per query row and key: QK^T and PV), and the
// nanoseconds per key and per (key, row); compare the rate with benchmarks/fma_probe.c's one-core peak. To see
// where a task's time goes, time copies of prefill_kernel.h with one part removed (-I a folder holding the
// copy first): docs/attention.md, "The float32 kernel on an AVX2-only CPU", has such a table.
#define METRALE_ISA_NS avx2
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "prefill_kernel.h"

using namespace metrale;
using namespace metrale::avx2::kernel;

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s ctx T reps n_kv n_heads\n", argv[0]);
    return 2;
  }
  const int ctx = std::atoi(argv[1]), T = std::atoi(argv[2]), reps = std::atoi(argv[3]);
  const int n_kv = std::atoi(argv[4]), n_heads = std::atoi(argv[5]);
  const int hd = 64, bs = 16, blocks = (ctx + bs - 1) / bs, rep = n_heads / n_kv;
  if (T < 1 || T > kPrefillQueries || T > ctx || reps < 1 || n_kv < 1 || n_heads % n_kv != 0) {
    std::fprintf(stderr, "need 1 <= T <= min(%d, ctx), reps >= 1, n_heads a multiple of n_kv\n", kPrefillQueries);
    return 2;
  }
  PrefillDims dm{T, n_heads, n_kv, hd, blocks, bs, 0, ctx - T, blocks, 0.125f, hd, 0};
  std::vector<f16_t> k(static_cast<size_t>(blocks) * bs * n_kv * hd), v(k.size());
  std::srand(1);
  for (auto& x : k) x.bits = 0x3000 + (std::rand() & 0x3ff);  // values in [0.125, 0.25)
  for (auto& x : v) x.bits = 0x3000 + (std::rand() & 0x3ff);
  std::vector<int32_t> table(blocks);
  for (int i = 0; i < blocks; ++i) table[i] = i;
  std::vector<float> q(static_cast<size_t>(T) * n_heads * hd), out(q.size());
  std::vector<float> scratch(prefill_scratch_floats(T * rep, hd));
  for (auto& x : q) x = (std::rand() % 200 - 100) * 0.01f;
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    prefill_task(dm, q.data(), k.data(), v.data(), table.data(), out.data(), scratch.data(), 0, 0, T, 0, ctx, nullptr);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  bool finite = true;
  for (int i = 0; i < T; ++i)
    for (int r = 0; r < rep; ++r)
      for (int d = 0; d < hd; ++d) finite = finite && std::isfinite(out[(static_cast<size_t>(i) * n_heads + r) * hd + d]);
  const double pairs = static_cast<double>(T) * rep * ctx;  // (query row, key) pairs; causal edge ignored
  std::printf("{\"ctx\": %d, \"queries\": %d, \"rows\": %d, \"ms\": %.4f, \"gflops\": %.2f, \"ns_per_key\": %.3f, "
              "\"ns_per_key_row\": %.4f, \"finite\": %s}\n",
              ctx, T, T * rep, best * 1e3, pairs * 4 * hd / best * 1e-9, best * 1e9 / ctx, best * 1e9 / pairs,
              finite ? "true" : "false");
  return finite ? 0 : 1;
}
