// Gated activations act(gate) * up on 8-float vectors: the fused SwiGLU / GeGLU kernel
// (activations.cpp) and the epilogue of the quantized gate/up matmul (qmm_kernel.h) share them.
// Compiled per instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernel_table.h"
#include "vecmath.h"

namespace metrale::METRALE_ISA_NS::kernel {

// 2 sqrt(2/pi) and 2 sqrt(2/pi) 0.044715: 1 + tanh(z) = 2 sigmoid(2z), so
// 0.5 g (1 + tanh(z)) = g sigmoid(g (kC1 + kC3 g^2)). This form has no cancellation for g < 0
// (mlx's 1 + tanh(z) loses digits there: its result is the less accurate one).
constexpr float kC1 = static_cast<float>(2.0 * 0.79788456080286535588);
constexpr float kC3 = static_cast<float>(2.0 * 0.79788456080286535588 * 0.044715);

struct SiluMul {
  v8f operator()(v8f g, v8f u) const { return g * sigmoid8(g) * u; }
};

struct GeluTanhMul {
  v8f operator()(v8f g, v8f u) const { return g * sigmoid8(g * (kC1 + kC3 * (g * g))) * u; }
};

// out[i] = op(gate[i], up[i]) for i in [begin, end). out may be gate or up (a donated buffer):
// each vector is read before it is written.
template <typename T, typename Op>
void gated_range(const T* gate, const T* up, T* out, int64_t begin, int64_t end, Op op) {
  int64_t i = begin;
  for (; i + kW <= end; i += kW) store8(out + i, op(load8(gate + i), load8(up + i)));
  if (i < end) {  // the tail, through a padded vector: the same arithmetic as the body
    const int n = static_cast<int>(end - i);
    T g[kW] = {}, u[kW] = {}, o[kW];
    for (int j = 0; j < n; ++j) g[j] = gate[i + j], u[j] = up[i + j];
    store8(o, op(load8(g), load8(u)));
    for (int j = 0; j < n; ++j) out[i + j] = o[j];
  }
}

template <typename Op>
void gated_dtype(Dtype dtype, const void* gate, const void* up, void* out, int64_t begin, int64_t end) {
  if (dtype == Dtype::float32) {
    gated_range(static_cast<const float*>(gate), static_cast<const float*>(up), static_cast<float*>(out), begin,
                end, Op{});
  } else if (dtype == Dtype::float16) {
    gated_range(static_cast<const f16_t*>(gate), static_cast<const f16_t*>(up), static_cast<f16_t*>(out), begin,
                end, Op{});
  } else {
    gated_range(static_cast<const bf16_t*>(gate), static_cast<const bf16_t*>(up), static_cast<bf16_t*>(out), begin,
                end, Op{});
  }
}

// n float32 values written as dtype (float32, float16 or bfloat16), rounded to nearest even as store8 (mlx's
// astype bits): float32 K/V rows into a 16-bit pool (kv_write.cpp) without an AsType node per layer.
inline void store_floats(const float* src, Dtype dtype, void* dst, int64_t n) {
  if (dtype == Dtype::float32) {
    for (int64_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = src[i];
    return;
  }
  auto run = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    int64_t i = 0;
    for (; i + kW <= n; i += kW) store8(out + i, load8(src + i));
    if (i < n) {  // the tail, through a padded vector
      float x[kW] = {};
      T o[kW];
      for (int64_t j = i; j < n; ++j) x[j - i] = src[j];
      store8(o, load8(x));
      for (int64_t j = i; j < n; ++j) out[j] = o[j - i];
    }
  };
  if (dtype == Dtype::float16) {
    run(static_cast<f16_t*>(dst));
  } else {
    run(static_cast<bf16_t*>(dst));
  }
}

inline void gated(GatedKind kind, Dtype dtype, const void* gate, const void* up, void* out, int64_t begin,
                  int64_t end) {
  if (kind == GatedKind::silu) {
    gated_dtype<SiluMul>(dtype, gate, up, out, begin, end);
  } else {
    gated_dtype<GeluTanhMul>(dtype, gate, up, out, begin, end);
  }
}

}  // namespace metrale::METRALE_ISA_NS::kernel
