// The AVX2 quantized-matmul tiles (kernels/csrc/qmm_kernel.h: run_panels) timed alone, on one core: one
// task of P panels (16 rows each) x T tokens over K, 4-bit weights with float16 scales (Q4_0's group 32),
// int12 (or --act 8 / 16) activations, everything in the caches; the best of `reps` calls. Free of MLX's
// per-call cost, the activation quantization and the thread pool: the tile's own rate.
//
//   c++ -std=c++20 -O3 -mavx2 -mfma -mf16c -Ikernels/csrc benchmarks/qmm_tile_probe.cpp -o /tmp/qmm_tile_probe
//   taskset -c 1 /tmp/qmm_tile_probe 2048 4 48 3000 12     # K P T reps activation-bits: a prompt chunk's task
//   taskset -c 1 /tmp/qmm_tile_probe 2048 512 1 300 12     # one token over 8 MiB of weights (L3)
//
// Prints one JSON line: ms per call, GOP/s (2 x rows x K x T), nanoseconds per 32-value block and token pair
// (x the clock in GHz for cycles: docs/quantized-kernels.md, "AVX2 on an AVX2-only CPU"), and the largest
// error against a float64 reference computed here from the same packed integers (the tiles sum in int32
// and float32, so it is float32 rounding only).
#define METRALE_ISA_NS avx2
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "qmm_kernel.h"

using namespace metrale;
using namespace metrale::avx2::qmm;

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s K P T reps activation-bits\n", argv[0]);
    return 2;
  }
  const int K = std::atoi(argv[1]), P = std::atoi(argv[2]), T = std::atoi(argv[3]), reps = std::atoi(argv[4]);
  const int act = std::atoi(argv[5]);
  if (K < 32 || K % 32 != 0 || P < 1 || T < 1 || reps < 1 || (act != 8 && act != 12 && act != 16)) {
    std::fprintf(stderr, "need K a multiple of 32, P, T, reps >= 1, activation bits 8, 12 or 16\n");
    return 2;
  }
  const int gs = 32, groups = K / gs, blocks = K / kActBlock, rows = P * R;
  std::srand(1);
  std::vector<uint8_t> q(static_cast<size_t>(P) * R * K / 2);
  for (auto& b : q) b = static_cast<uint8_t>(std::rand() & 0xff);
  std::vector<uint16_t> scales(static_cast<size_t>(P) * groups * R), biases(scales.size());
  for (auto& s : scales) s = static_cast<uint16_t>(0x2000 + (std::rand() & 0x3ff));  // ~0.01
  for (auto& b : biases) b = static_cast<uint16_t>(0xa000 + (std::rand() & 0x3ff));  // ~-0.01
  const QmmWeights w{q.data(), scales.data(), biases.data(), P, K, 4, gs, true};
  // planes as the quantizer writes them: int8 X (|X| <= 127); int12 hi -127..127, lo 0..15; int16 |hi|, |lo| <= 127
  std::vector<int8_t> xq(static_cast<size_t>(T) * act_row_bytes(K, act));
  for (int t = 0; t < T; ++t)
    for (int b = 0; b < blocks; ++b) {
      int8_t* at = xq.data() + act_at(t, b, K, act);
      for (int i = 0; i < kActBlock; ++i) {
        at[i] = static_cast<int8_t>(std::rand() % 255 - 127);
        if (act_two_planes(act)) at[kActBlock + i] = static_cast<int8_t>(act == 12 ? std::rand() % 16 : std::rand() % 255 - 127);
      }
    }
  std::vector<float> xd(static_cast<size_t>(T) * blocks), xsum(static_cast<size_t>(T) * groups);
  std::vector<int32_t> xisum(static_cast<size_t>(T) * blocks);
  for (auto& d : xd) d = 1e-3f * (1 + std::rand() % 100);
  for (auto& s : xsum) s = 0.01f * (std::rand() % 200 - 100);
  for (int t = 0; t < T; ++t)  // sum of X per block (the 8-bit weights' correction; kept true here)
    for (int b = 0; b < blocks; ++b) {
      const int8_t* at = xq.data() + act_at(t, b, K, act);
      int32_t sum = 0;
      for (int i = 0; i < kActBlock; ++i)
        sum += act_two_planes(act) ? act_hi_weight(act) * at[i] + at[kActBlock + i] : at[i];
      xisum[static_cast<size_t>(t) * blocks + b] = sum;
    }
  const QmmActs a{xq.data(), xd.data(), xsum.data(), xisum.data(), T, K, gs, act};
  std::vector<float> out(static_cast<size_t>(T) * rows);
  const QmmOut o{out.data(), rows, 0, rows, -1};
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    panels(w, a, o, 0, P, 0, T);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  // float64 reference: y[t][n] = sum_b scale[n, g] d[t, b] sum_k q[n, k] X[t, k] + sum_g bias[n, g] xsum[t, g]
  double max_err = 0.0, max_ref = 0.0;
  for (int t = 0; t < T; ++t)
    for (int n = 0; n < rows; ++n) {
      const int p = n / R, r = n % R;
      const uint8_t* panel = q.data() + static_cast<size_t>(p) * R * K / 2;
      double y = 0.0;
      for (int b = 0; b < blocks; ++b) {
        const int8_t* at = xq.data() + act_at(t, b, K, act);
        int64_t dot = 0;
        for (int i = 0; i < kActBlock; ++i) {
          const int k = b * kActBlock + i, c = k / 8, j = k % 8;
          const uint8_t byte = panel[c * 64 + 4 * r + j % 4];
          const int qv = j < 4 ? byte & 15 : byte >> 4;
          const int x = act_two_planes(act) ? act_hi_weight(act) * at[i] + at[kActBlock + i] : at[i];
          dot += static_cast<int64_t>(qv) * x;
        }
        const int g = b * kActBlock / gs;
        y += static_cast<double>(_cvtsh_ss(scales[(static_cast<size_t>(p) * groups + g) * R + r])) *
             xd[static_cast<size_t>(t) * blocks + b] * static_cast<double>(dot);
      }
      for (int g = 0; g < groups; ++g)
        y += static_cast<double>(_cvtsh_ss(biases[(static_cast<size_t>(p) * groups + g) * R + r])) *
             xsum[static_cast<size_t>(t) * groups + g];
      max_err = std::max(max_err, std::abs(y - out[static_cast<size_t>(t) * rows + n]));
      max_ref = std::max(max_ref, std::abs(y));
    }
  const double pairs = P * static_cast<double>(blocks) * (T / 2.0);  // 32-value blocks x token pairs
  std::printf("{\"K\": %d, \"panels\": %d, \"tokens\": %d, \"activation_bits\": %d, \"ms\": %.4f, \"gops\": %.2f, "
              "\"ns_per_block_pair\": %.3f, \"max_abs_err\": %.3g, \"max_abs_ref\": %.3g}\n",
              K, P, T, act, best * 1e3, 2.0 * rows * K * T / best * 1e-9, best * 1e9 / pairs, max_err, max_ref);
  return max_err <= 1e-5 * std::max(1.0, max_ref) ? 0 : 1;
}
