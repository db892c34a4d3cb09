// Runtime choice of the kernel set (isa.h). The x86 sets need, besides the CPU flags, the OS to save
// the wider registers; __builtin_cpu_supports checks both (XGETBV) for AVX and AVX-512, runs_amx for AMX
// (which Linux also makes a process ask for). arm64: neon always, neon_dotprod where the OS reports the
// dot product (runs_dotprod).
#include "isa.h"

#include <atomic>
#include <stdexcept>

#if defined(__x86_64__) && defined(__linux__) && defined(METRALE_HAVE_AMX)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)  // the Linux arm64 hwcap bit of the dot product instructions
#endif
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace metrale {

namespace {

#if defined(__x86_64__) || defined(_M_X64)
bool runs_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}
#endif

#if defined(__x86_64__) && defined(__linux__) && defined(METRALE_HAVE_AMX)
// AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25), the OS saving their state (XCR0 bits 17, 18), and
// Linux granting this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 18:
// refused by kernels before 5.16 or by policy). Asked once per process; the grant covers every thread.
bool runs_amx() {
  static const bool granted = [] {
    unsigned a, b, c, d;
    if (!runs_avx512() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}
#endif

#if defined(__aarch64__)
// The int8 dot product (SDOT/UDOT, FEAT_DotProd, optional from Armv8.2): Linux reports it in AT_HWCAP,
// macOS in the sysctl hw.optional.arm.FEAT_DotProd (macOS 12 and later; every Apple M chip has it).
// Elsewhere the set is not offered.
bool runs_dotprod() {
#if defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
  int has = 0;
  size_t size = sizeof(has);
  return sysctlbyname("hw.optional.arm.FEAT_DotProd", &has, &size, nullptr, 0) == 0 && has != 0;
#else
  return false;
#endif
}
#endif

struct Entry {
  const char* name;
  const KernelTable* (*table)();
  bool (*runs)();
};

const std::vector<Entry>& entries() {
  static const std::vector<Entry> all = {
      {"scalar", kernel_table_scalar, [] { return true; }},
#if defined(__x86_64__) || defined(_M_X64)
      {"avx2", kernel_table_avx2,
       [] {
         __builtin_cpu_init();
         return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
       }},
      {"avx512", kernel_table_avx512, runs_avx512},
#if defined(__linux__) && defined(METRALE_HAVE_AMX)
#if defined(METRALE_HAVE_AMX_BF16)
      {"avx512_amx", kernel_table_avx512_amx_attention, runs_amx},
#else
      {"avx512_amx", kernel_table_avx512_amx, runs_amx},
#endif
#endif
#endif
#if defined(__aarch64__)
      {"neon", kernel_table_neon, [] { return true; }},  // NEON is part of every arm64 CPU
      {"neon_dotprod", kernel_table_neon_dotprod, runs_dotprod},
#endif
  };
  return all;
}

const KernelTable* find(const std::string& name) {
  for (const auto& e : entries())
    if (name == e.name) {
      if (!e.runs()) throw std::invalid_argument("this CPU cannot run the " + name + " kernels");
      return e.table();
    }
  std::string known;
  for (const auto& e : entries()) known += (known.empty() ? "" : ", ") + std::string(e.name);
  throw std::invalid_argument("unknown kernel set '" + name + "' (this build has: " + known + ")");
}

const KernelTable* best() {
  const KernelTable* table = nullptr;
  for (const auto& e : entries())
    if (e.runs()) table = e.table();
  return table;
}

std::atomic<const KernelTable*>& current() {
  static std::atomic<const KernelTable*> table{best()};
  return table;
}

}  // namespace

const KernelTable& cpu_kernels() {
  return *current().load(std::memory_order_acquire);
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const auto& e : entries())
    if (e.runs()) names.emplace_back(e.name);
  return names;
}

void set_cpu_isa(const std::string& name) {
  current().store(name == "auto" ? best() : find(name), std::memory_order_release);
}

}  // namespace metrale
