// One core's float32 FMA peak, for benchmarks/prefill_attention_bench.py: 12 independent chains of
// vfmadd on WIDTH-bit vectors (512 or 256), the thread's CPU time. Prints one JSON object.
//   cc -O2 -mfma -mavx512f -DWIDTH=512 fma_probe.c -o probe   (or -mavx2 -DWIDTH=256)
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if WIDTH == 512
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define LANES 16
#else
typedef __m256 vec;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define LANES 8
#endif

static double cpu_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  // 12 named chains (never an array: an array's address taken forces a store per step)
  const vec x = SET1(0.999f), y = SET1(1e-6f);
  vec a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5);
  vec a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10), a11 = SET1(11);
  const long iters = 600L * 1000 * 1000;
  const double start = cpu_now();
  for (long it = 0; it < iters / 12; ++it) {
    a0 = FMA(a0, x, y), a1 = FMA(a1, x, y), a2 = FMA(a2, x, y), a3 = FMA(a3, x, y);
    a4 = FMA(a4, x, y), a5 = FMA(a5, x, y), a6 = FMA(a6, x, y), a7 = FMA(a7, x, y);
    a8 = FMA(a8, x, y), a9 = FMA(a9, x, y), a10 = FMA(a10, x, y), a11 = FMA(a11, x, y);
  }
  const double cpu = cpu_now() - start;
  vec s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));
  s = ADD(s, ADD(ADD(a8, a9), ADD(a10, a11)));
  float lanes[LANES];
  memcpy(lanes, &s, sizeof(lanes));
  printf("{\"gflops_cpu\": %.1f, \"sink\": %g}\n", iters * 2.0 * LANES / cpu / 1e9, lanes[0]);
  return 0;
}
