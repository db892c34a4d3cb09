// RMSNorm and RoPE rows for the fused CPU ops of norm_rope.cpp. MLX's CPU rms_norm and rope are
// built from ~8 and ~25 graph nodes each (its fast kernels are GPU only); at one token per step the
// nodes' dispatch costs more than the arithmetic. The arithmetic follows MLX's (float32):
//   rms_norm  out = (x * (1 / sqrt(mean(x^2) + eps))) * (w + w_offset)     w_offset 1: gemma's (1 + w)
//   rope      with c = cos(theta), s = sin(theta) per token and pair i < D / 2 (the caller's table):
//             half-split pairs (i, i + D/2), or interleaved (2i, 2i + 1) when traditional:
//             out_a = x_a c - x_b s,  out_b = x_a s + x_b c
// Compiled per instruction set inside namespace METRALE_ISA_NS (isa_kernels.cpp).
#pragma once

#include <cstdint>

#include "vecmath.h"

namespace metrale::METRALE_ISA_NS::kernel {

inline void rms_norm_rows(const float* x, const float* w, float* out, int64_t r0, int64_t r1, int D, float eps,
                          float w_offset) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    v8f acc = {};
    int i = 0;
    for (; i + kW <= D; i += kW) {
      const v8f v = load8(xr + i);
      acc += v * v;
    }
    float sum = hsum(acc);
    for (; i < D; ++i) sum += xr[i] * xr[i];
    const float inv = 1.0f / __builtin_sqrtf(sum / static_cast<float>(D) + eps);
    for (i = 0; i + kW <= D; i += kW) store8(o + i, (load8(xr + i) * inv) * (load8(w + i) + w_offset));
    for (; i < D; ++i) o[i] = (xr[i] * inv) * (w[i] + w_offset);
  }
}

// Rows [r0, r1) of h = x + residual (h may be x or residual), then RMSNorm of h into out: the residual add
// and the next norm in one pass, each bit for bit the unfused Add then rms_norm_rows.
inline void add_rms_norm_rows(const float* x, const float* residual, const float* w, float* h, float* out, int64_t r0,
                              int64_t r1, int D, float eps, float w_offset) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * D;
    const float* rr = residual + r * D;
    float* hr = h + r * D;
    int i = 0;
    for (; i + kW <= D; i += kW) store8(hr + i, load8(xr + i) + load8(rr + i));
    for (; i < D; ++i) hr[i] = xr[i] + rr[i];
    rms_norm_rows(h, w, out, r, r + 1, D, eps, w_offset);
  }
}

// x (T, H, D) float32, tokens [t0, t1); cos, sin (T, D / 2); out (T, H, D) (may be x).
inline void rope_rows(const float* x, const float* cos, const float* sin, float* out, int64_t t0, int64_t t1, int H,
                      int D, bool traditional) {
  const int half = D / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int h = 0; h < H; ++h) {
      const float* xr = x + (t * H + h) * D;
      float* o = out + (t * H + h) * D;
      if (traditional) {
        for (int i = 0; i < half; ++i) {
          const float a = xr[2 * i], b = xr[2 * i + 1];
          o[2 * i] = a * c[i] - b * s[i];
          o[2 * i + 1] = a * s[i] + b * c[i];
        }
        continue;
      }
      int i = 0;
      for (; i + kW <= half; i += kW) {
        const v8f a = load8(xr + i), b = load8(xr + half + i), cv = load8(c + i), sv = load8(s + i);
        store8(o + i, a * cv - b * sv);
        store8(o + half + i, a * sv + b * cv);
      }
      for (; i < half; ++i) {
        const float a = xr[i], b = xr[half + i];
        o[i] = a * c[i] - b * s[i];
        o[half + i] = a * s[i] + b * c[i];
      }
    }
  }
}

}  // namespace metrale::METRALE_ISA_NS::kernel
