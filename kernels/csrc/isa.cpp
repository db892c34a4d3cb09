// Runtime choice of the kernel set (isa.h). The x86 sets need, besides the CPU flags, the OS to save
// the wider registers; __builtin_cpu_supports checks both (XGETBV) for AVX and AVX-512.
#include "isa.h"

#include <atomic>
#include <stdexcept>

namespace metrale {

namespace {

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
      {"avx512", kernel_table_avx512,
       [] {
         __builtin_cpu_init();
         return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                __builtin_cpu_supports("avx512vnni");
       }},
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
