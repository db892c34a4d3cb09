// The machine's two roofs for the quantized matmul kernels, compiled and run by benchmarks/qmm_roofline.py:
//   peak    int8 dot products: a tight loop of independent 512-bit vpdpbusd (AVX-512 VNNI; 64 u8 x s8
//           multiply-adds each), or of vpmaddubsw + vpaddw on 256 bits (AVX2: 32 per 2 ops, int16 sums)
//   read    a STREAM-like read (sum of 64-bit words, 4 accumulators, 512- or 256-bit loads) of a buffer
//           larger than the caches, split over the same number of threads as the kernels: once on 4 KiB
//           pages (read_gbs_*), once on transparent huge pages (read_huge_gbs_*, madvise(MADV_HUGEPAGE)
//           before the first touch, as the loader holds the weights: ext.huge_page_copy; huge_pages_advised
//           is false where the advice failed, and then both reads are of 4 KiB pages)
// Each thread's own CPU time is measured as well as the wall time: on a shared machine the CPU-time
// rate is what a core does while it runs. Prints one JSON object.
//
//   cc -O2 -fopenmp -mavx2 -mfma [-mavx512f -mavx512bw -mavx512vnni] roofline_probe.c -o probe
//   ./probe THREADS BUFFER_MIB
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(clockid_t clock) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum { kIters = 20 * 1000 * 1000 };

// Returns the int8 multiply-adds done; *cpu the thread's CPU seconds.
static double dot_loop(double* cpu, int32_t* sink) {
  const double start = now(CLOCK_THREAD_CPUTIME_ID);
#if defined(__AVX512VNNI__)
  // Sixteen independent vpdpbusd per iteration, in assembly: from intrinsics (12 sums, 6 of them pinned to
  // registers) GCC's loop ran ~1.6 per ns per core on a Zen 4 where this one runs 3.67 (stop 18), and the
  // kernels' own 16-token tiles keep 16 sums.
#define METRALE_DP(n) "vpdpbusd %%zmm17, %%zmm16, %%zmm" #n "\n\t"
  const long iters = kIters / 4;
  __asm__ volatile(
      "vpternlogd $0xff, %%zmm16, %%zmm16, %%zmm16\n\t"
      "vpabsb %%zmm16, %%zmm17\n\t"
      "mov %0, %%rcx\n\t"
      "1:\n\t"
      METRALE_DP(0) METRALE_DP(1) METRALE_DP(2) METRALE_DP(3) METRALE_DP(4) METRALE_DP(5) METRALE_DP(6)
      METRALE_DP(7) METRALE_DP(8) METRALE_DP(9) METRALE_DP(10) METRALE_DP(11) METRALE_DP(12) METRALE_DP(13)
      METRALE_DP(14) METRALE_DP(15)
      "dec %%rcx\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      :
      : "r"(iters)
      : "rcx", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "cc");
#undef METRALE_DP
  *sink = (int32_t)iters;
  const double macs = (double)iters * 16 * 64;
#else
  // Eight independent vpmaddubsw (32 u8 x s8 products, summed in pairs to int16), each added into an
  // int16 sum (vpaddw): the inner step of the AVX2 4-bit tiles. In assembly: from intrinsics, GCC
  // computed the loop-invariant products once outside the loop (an earlier version of this probe
  // measured a loop of adds), or kept sums on the stack.
  const long iters = kIters * 4;  // ~0.1 s: a shorter loop times the threads' start
  __asm__ volatile(
      "vpcmpeqb %%ymm15, %%ymm15, %%ymm15\n\t"
      "vpabsb %%ymm15, %%ymm14\n\t"
      "mov %0, %%rcx\n\t"
      "1:\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm0\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm1\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm2\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm3\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm4\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm5\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm6\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm7\n\t"
      "vpaddw %%ymm0, %%ymm8, %%ymm8\n\t"
      "vpaddw %%ymm1, %%ymm9, %%ymm9\n\t"
      "vpaddw %%ymm2, %%ymm10, %%ymm10\n\t"
      "vpaddw %%ymm3, %%ymm11, %%ymm11\n\t"
      "vpaddw %%ymm4, %%ymm12, %%ymm12\n\t"
      "vpaddw %%ymm5, %%ymm13, %%ymm13\n\t"
      "vpaddw %%ymm6, %%ymm8, %%ymm8\n\t"
      "vpaddw %%ymm7, %%ymm9, %%ymm9\n\t"
      "dec %%rcx\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      :
      : "r"(iters)
      : "rcx", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15", "cc");
  *sink = (int32_t)iters;
  const double macs = (double)iters * 8 * 32;
#endif
  *cpu = now(CLOCK_THREAD_CPUTIME_ID) - start;
  return macs;
}

static uint64_t read_sum(const uint64_t* p, size_t words) {
#if defined(__AVX512F__)
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 32 <= words; i += 32) {
    s0 = _mm512_add_epi64(s0, _mm512_load_si512(p + i));
    s1 = _mm512_add_epi64(s1, _mm512_load_si512(p + i + 8));
    s2 = _mm512_add_epi64(s2, _mm512_load_si512(p + i + 16));
    s3 = _mm512_add_epi64(s3, _mm512_load_si512(p + i + 24));
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
#else
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 16 <= words; i += 16) {
    s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i*)(p + i)));
    s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i*)(p + i + 4)));
    s2 = _mm256_add_epi64(s2, _mm256_load_si256((const __m256i*)(p + i + 8)));
    s3 = _mm256_add_epi64(s3, _mm256_load_si256((const __m256i*)(p + i + 12)));
  }
  uint64_t lanes[4];
  _mm256_storeu_si256((__m256i*)lanes, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
}

// The best of 5 reads of buf (threads slices of per words, each first touched by its own thread): wall and
// slowest-thread CPU seconds; *total keeps the sums alive.
static void time_read(const uint64_t* buf, size_t per, double* best_wall, double* best_cpu, uint64_t* total) {
  *best_wall = *best_cpu = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    double cpu_slowest = 0;
    uint64_t sum = 0;
    const double r0 = now(CLOCK_MONOTONIC);
#pragma omp parallel reduction(+ : sum) reduction(max : cpu_slowest)
    {
      const double c0 = now(CLOCK_THREAD_CPUTIME_ID);
      sum += read_sum(buf + omp_get_thread_num() * per, per);
      cpu_slowest = now(CLOCK_THREAD_CPUTIME_ID) - c0;
    }
    const double wall = now(CLOCK_MONOTONIC) - r0;
    *total += sum;
    if (wall < *best_wall) *best_wall = wall;
    if (cpu_slowest < *best_cpu) *best_cpu = cpu_slowest;
  }
}

// A buffer of `words` 64-bit words, 2 MiB aligned, advised onto huge pages when `huge` (*advised: whether
// the kernel took the advice) and off them otherwise, each thread's slice of `per` words first touched by
// that thread.
static uint64_t* read_buffer(size_t words, size_t per, int huge, int* advised) {
  const size_t huge_page = (size_t)2 << 20, bytes = (words * 8 + huge_page - 1) / huge_page * huge_page;
  uint64_t* buf = aligned_alloc(huge_page, bytes);
  *advised = 0;
  if (!buf) return NULL;
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
  // (NOHUGEPAGE: with transparent huge pages "always", an unadvised buffer would get them too)
  const int ok = madvise(buf, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) == 0;
  *advised = huge && ok;
#else
  (void)huge;
#endif
#pragma omp parallel
  memset(buf + omp_get_thread_num() * per, 1, per * 8);
  return buf;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 1024;
  if (threads < 1 || threads > 256 || mib < 1 || mib > (1 << 16)) {
    fprintf(stderr, "usage: probe THREADS(1..256) BUFFER_MIB(1..65536)\n");
    return 2;
  }
  omp_set_num_threads(threads);
  // peak: every thread runs the dot loop at once
  double macs = 0, cpu_max = 0;
  int32_t sink = 0;
  const double t0 = now(CLOCK_MONOTONIC);
#pragma omp parallel reduction(+ : macs, sink) reduction(max : cpu_max)
  {
    double cpu;
    macs += dot_loop(&cpu, &sink);
    cpu_max = cpu;
  }
  const double dot_wall = now(CLOCK_MONOTONIC) - t0;
  // read: the buffer split in one contiguous slice per thread, touched first by its own thread
  const size_t words = mib << 17, per = words / threads / 32 * 32;
  double best_wall, best_cpu, huge_wall, huge_cpu;
  uint64_t total = 0;
  int advised;
  for (int huge = 0; huge < 2; ++huge) {  // one buffer at a time: the two would not fit everywhere
    uint64_t* buf = read_buffer(words, per, huge, &advised);
    if (!buf) {
      fprintf(stderr, "cannot allocate %zu MiB\n", mib);
      return 1;
    }
    time_read(buf, per, huge ? &huge_wall : &best_wall, huge ? &huge_cpu : &best_cpu, &total);
    free(buf);
  }
  const double bytes = (double)per * 8 * threads;
  printf("{\"threads\": %d, \"isa\": \"%s\", \"int8_gops_wall\": %.1f, \"int8_gops_cpu\": %.1f, "
         "\"read_mib\": %zu, \"read_gbs_wall\": %.2f, \"read_gbs_cpu\": %.2f, \"read_huge_gbs_wall\": %.2f, "
         "\"read_huge_gbs_cpu\": %.2f, \"huge_pages_advised\": %s, \"sink\": %llu}\n",
         threads,
#if defined(__AVX512VNNI__)
         "avx512-vnni vpdpbusd",
#else
         "avx2 vpmaddubsw+vpaddw",
#endif
         2 * macs / dot_wall * 1e-9, 2 * macs / cpu_max * 1e-9, mib, bytes / best_wall * 1e-9,
         bytes / best_cpu * 1e-9, bytes / huge_wall * 1e-9, bytes / huge_cpu * 1e-9, advised ? "true" : "false",
         (unsigned long long)(total + (uint64_t)sink));
  return 0;
}
