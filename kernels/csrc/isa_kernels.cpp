// The compute kernels of one instruction set, compiled once per set with that set's flags
// (CMakeLists.txt: METRALE_ISA_NS = scalar | avx2 | avx512 on x86-64, scalar | neon | neon_dotprod on
// arm64) and picked at run time (isa.cpp).
// Everything defined here lives in namespace metrale::METRALE_ISA_NS, and nothing here includes MLX:
// an inline function compiled with AVX-512 flags must not be merged by the linker with the copy
// that a CPU without AVX-512 runs.
#include "kernel_table.h"

#include "activation_kernel.h"
#include "attention_kernel.h"
#include "norm_rope_kernel.h"
#include "prefill_kernel.h"
#include "qmm_kernel.h"
#include "sampling_kernel.h"
#include "vecmath.h"

#ifndef METRALE_ISA_NS
#error "compile with -DMETRALE_ISA_NS=scalar|avx2|avx512|neon|neon_dotprod"
#endif

#define METRALE_CAT2(a, b) a##b
#define METRALE_CAT(a, b) METRALE_CAT2(a, b)
#define METRALE_STR2(x) #x
#define METRALE_STR(x) METRALE_STR2(x)

namespace metrale::METRALE_ISA_NS {

namespace {

void decode_task(const DecodeDims& dm, Dtype dtype, const float* q, const void* kp, const void* vp,
                 const int32_t* table, int key_begin, int key_end, float* acc, float* ml, float* scratch,
                 bool normalize) {
  if (dtype == Dtype::float32) {
    kernel::decode_range(dm, q, static_cast<const float*>(kp), static_cast<const float*>(vp), table, key_begin,
                         key_end, acc, ml, scratch, normalize);
  } else if (dtype == Dtype::q8) {
    kernel::decode_range(dm, q, static_cast<const int8_t*>(kp), static_cast<const int8_t*>(vp), table, key_begin,
                         key_end, acc, ml, scratch, normalize);
  } else if (dtype == Dtype::float16) {
    kernel::decode_range(dm, q, static_cast<const kernel::f16_t*>(kp), static_cast<const kernel::f16_t*>(vp), table,
                         key_begin, key_end, acc, ml, scratch, normalize);
  } else {
    kernel::decode_range(dm, q, static_cast<const kernel::bf16_t*>(kp), static_cast<const kernel::bf16_t*>(vp), table,
                         key_begin, key_end, acc, ml, scratch, normalize);
  }
}

void prefill_task(const PrefillDims& dm, Dtype dtype, const float* q, const void* kp, const void* vp,
                  const int32_t* table, float* out, float* scratch, int g, int q_begin, int q_end, int key_begin,
                  int key_end, float* part) {
  if (dtype == Dtype::float32) {
    kernel::prefill_task(dm, q, static_cast<const float*>(kp), static_cast<const float*>(vp), table, out, scratch, g,
                         q_begin, q_end, key_begin, key_end, part);
  } else if (dtype == Dtype::q8) {
    kernel::prefill_task(dm, q, static_cast<const int8_t*>(kp), static_cast<const int8_t*>(vp), table, out, scratch, g,
                         q_begin, q_end, key_begin, key_end, part);
  } else if (dtype == Dtype::float16) {
    kernel::prefill_task(dm, q, static_cast<const kernel::f16_t*>(kp), static_cast<const kernel::f16_t*>(vp), table,
                         out, scratch, g, q_begin, q_end, key_begin, key_end, part);
  } else {
    kernel::prefill_task(dm, q, static_cast<const kernel::bf16_t*>(kp), static_cast<const kernel::bf16_t*>(vp), table,
                         out, scratch, g, q_begin, q_end, key_begin, key_end, part);
  }
}

void causal_softmax_rows(const float* src, float* dst, int64_t row_begin, int64_t row_end, int length, int q_len,
                         int offset, int window) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    float* row = dst + r * length;
    const float* in = src + r * length;
    if (row != in)
      for (int j = 0; j < length; ++j) row[j] = in[j];
    kernel::causal_softmax_row(row, length, static_cast<int>(r % q_len), offset, window);
  }
}

}  // namespace

}  // namespace metrale::METRALE_ISA_NS

namespace metrale {

const KernelTable* METRALE_CAT(kernel_table_, METRALE_ISA_NS)() {
  namespace isa = metrale::METRALE_ISA_NS;
  static const KernelTable table{
      METRALE_STR(METRALE_ISA_NS), isa::decode_task,
      isa::prefill_task,
      isa::causal_softmax_rows, isa::kernel::gated,
      isa::kernel::rms_norm_rows, isa::kernel::rope_rows, isa::qmm::quantize, isa::qmm::panels, isa::qmm::task_shape,
      isa::kernel::argmax_range, isa::kernel::sample_full_row, isa::kernel::logsumexp_row,
      isa::kernel::add_rms_norm_rows, isa::kernel::candidate_masses, isa::kernel::block_maxima,
      isa::kernel::gather_at_least, isa::kernel::gather_bucket, isa::kernel::store_floats,
  };
  return &table;
}

}  // namespace metrale
