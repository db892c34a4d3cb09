/* The AMX int8 peak of one core, for benchmarks/qmm_amx_bench.py (Linux x86-64 with AMX-INT8 only):
 *   cc -O2 -mavx512f -mamx-tile -mamx-int8 benchmarks/amx_probe.c -o amx_probe && ./amx_probe
 * Prints JSON, GOP/s (2 per multiply-add) per CPU second of this process:
 *   dot_k64    4 independent TDPBSSD on 16x64 int8 tiles, back to back (the tile unit's peak)
 *   dot_k32    the same with K = 32 per product (the qmm kernel's block: one weight scale per 32 k)
 *   block_k32  per product: load A (16x32) and B (8x64) tiles from L1, zero C, TDPBSUD, store C (1 KiB):
 *              the kernel's tile work per block, without its float epilogue
 *   store_k32  the same without the loads: what the 1 KiB tile store per product costs
 * and whether the tile unit and the AVX-512 float ports work at the same time (qmm_amx.cpp's fold of
 * each product is 16 vector ops per product): ns per product of
 *   mix_amx_ns block_k32's loop alone, mix_fma_ns 16 independent 512-bit fmas alone,
 *   mix_both_ns both in one loop (mix_amx_ns + mix_fma_ns: no overlap at all; their maximum: full overlap)
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct __attribute__((aligned(64))) {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

static double cpu_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void configure(int k) {
  static tile_config c; /* static: GCC may drop stores to a stack copy that only ldtilecfg reads */
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 4; i++) c.colsb[i] = 64, c.rows[i] = 16;   /* C: 16 x 16 int32 */
  for (int i = 4; i < 6; i++) c.colsb[i] = k, c.rows[i] = 16;    /* A: 16 x k int8 */
  for (int i = 6; i < 8; i++) c.colsb[i] = 64, c.rows[i] = k / 4; /* B: k/4 x (16 x 4) int8 */
  _tile_loadconfig(&c);
}

static double dots(int k, long iters) {
  static int8_t a[1024] __attribute__((aligned(64))), b[1024] __attribute__((aligned(64)));
  configure(k);
  _tile_loadd(4, a, 64); _tile_loadd(5, a, 64); _tile_loadd(6, b, 64); _tile_loadd(7, b, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  double t0 = cpu_seconds();
  for (long i = 0; i < iters; i++) {
    _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
  }
  double t = cpu_seconds() - t0;
  _tile_release();
  return 2.0 * 4 * iters * 16 * 16 * k / t / 1e9;
}

/* ns per product: with_loads (block_k32), without (store_k32); fmas: 0 or 16 fmas per product (mix_*) */
static double blocks(long iters, int with_loads, int with_tiles, int fmas) {
  static int8_t a[4096] __attribute__((aligned(64))), b[4096] __attribute__((aligned(64)));
  static int32_t c[4][256] __attribute__((aligned(64)));
  __m512 v[16];
  for (int j = 0; j < 16; j++) v[j] = _mm512_set1_ps((float)j);
  const __m512 m = _mm512_set1_ps(0.999f), k = _mm512_set1_ps(0.001f);
  configure(32);
  _tile_loadd(4, a, 32); _tile_loadd(5, a + 512, 32); _tile_loadd(6, b, 64); _tile_loadd(7, b + 512, 64);
  double t0 = cpu_seconds();
  for (long i = 0; i < iters; i++) {
    if (with_tiles) {
      if (with_loads) { _tile_loadd(6, b, 64); _tile_loadd(4, a, 32); }
      _tile_zero(0); _tile_dpbsud(0, 4, 6); _tile_stored(0, c[0], 64);
    }
    for (int j = 0; j < fmas; j++) v[j] = _mm512_fmadd_ps(v[j], m, k);
    if (with_tiles) {
      if (with_loads) { _tile_loadd(7, b + 512, 64); _tile_loadd(5, a + 512, 32); }
      _tile_zero(1); _tile_dpbsud(1, 5, 7); _tile_stored(1, c[1], 64);
    }
    for (int j = 0; j < fmas; j++) v[j] = _mm512_fmadd_ps(v[j], m, k);
    /* the fmas' results are live: the compiler may not drop them */
    __asm__ volatile("" : "+v"(v[0]), "+v"(v[1]), "+v"(v[2]), "+v"(v[3]), "+v"(v[4]), "+v"(v[5]), "+v"(v[6]),
                     "+v"(v[7]));
    __asm__ volatile("" : "+v"(v[8]), "+v"(v[9]), "+v"(v[10]), "+v"(v[11]), "+v"(v[12]), "+v"(v[13]), "+v"(v[14]),
                     "+v"(v[15]));
  }
  double t = cpu_seconds() - t0;
  _tile_release();
  return t / (2.0 * iters) * 1e9;
}

static double gops(double ns_per_product) { return 2.0 * 16 * 16 * 32 / ns_per_product; }

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    printf("{\"error\": \"the kernel refused the AMX tile state\"}\n");
    return 1;
  }
  printf("{\"dot_k64_gops\": %.0f, \"dot_k32_gops\": %.0f, \"block_k32_gops\": %.0f, \"store_k32_gops\": %.0f, "
         "\"mix_amx_ns\": %.2f, \"mix_fma_ns\": %.2f, \"mix_both_ns\": %.2f}\n",
         dots(64, 2000000), dots(32, 2000000), gops(blocks(1000000, 1, 1, 0)), gops(blocks(1000000, 0, 1, 0)),
         blocks(1000000, 1, 1, 0), blocks(1000000, 0, 0, 16), blocks(1000000, 1, 1, 16));
  return 0;
}
