// Which compiled kernel set runs: the best instruction set this CPU has, unless set_cpu_isa asks for
// another (kernels/ext.py passes KernelSettings.cpu_isa, METRALE_CPU_ISA, when the module loads, e.g.
// to test the fallback); a set the CPU lacks is refused (an illegal instruction would kill the process).
#pragma once

#include <string>
#include <vector>

#include "kernel_table.h"

namespace metrale {

// The kernel table in use (thread-safe, decided on the first call).
const KernelTable& cpu_kernels();

// The instruction sets this build has and this CPU runs, best last (always starts with "scalar").
std::vector<std::string> supported_isas();

// Switch to `name` (one of supported_isas()); std::invalid_argument otherwise. For tests and
// benchmarks: call it while no kernel runs.
void set_cpu_isa(const std::string& name);

}  // namespace metrale
