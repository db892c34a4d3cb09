// Vector math shared by the CPU kernels: 8-float vectors, loads/stores with dtype conversion, a
// vectorized exp (MLX's own exp is scalar on x86 Linux, ~10 ns per element) and a logistic sigmoid.
// Vectors are GCC/Clang vector extensions (8 floats): AVX2/AVX-512 with -march=native, NEON on arm,
// pairs of SSE registers on a baseline x86-64 build.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "mlx/types/half_types.h"

namespace metrale::kernel {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));  // the bits of 8 float16 / bfloat16 values
constexpr int kW = 8;

// 8 elements of T (float, or a type with a conversion to float) from p, as floats.
template <typename T>
inline v8f load8(const T* p) {
  v8f v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    float tmp[kW];
    for (int i = 0; i < kW; ++i) tmp[i] = static_cast<float>(p[i]);
    std::memcpy(&v, tmp, sizeof(v));
  }
  return v;
}

inline void store8(float* p, v8f v) {
  std::memcpy(p, &v, sizeof(v));
}

// Vectorized conversions between float and the half types, for kernels where a scalar conversion
// per element would dominate (elementwise ops). Bit-identical to mlx's scalar ones except for the
// bits of a NaN (still a NaN): bfloat16 rounds to nearest even, float16 through F16C where the
// build has it (-march=native on x86), else element by element.
template <typename T>
inline v8f load8_fast(const T* p) {
  if constexpr (std::is_same_v<T, mlx::core::bfloat16_t>) {
#if defined(__AVX2__)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
    v8h h;
    std::memcpy(&h, p, sizeof(h));
    const v8u bits = __builtin_convertvector(h, v8u) << 16;
#endif
    v8f v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<T, mlx::core::float16_t>) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v8f v;
    std::memcpy(&v, &f, sizeof(v));
    return v;
#endif
  } else {
    return load8(p);
  }
}

// 8 floats written to p as T (float, float16_t or bfloat16_t; see load8_fast).
template <typename T>
inline void store8_fast(T* p, v8f v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, mlx::core::bfloat16_t>) {
    v8u bits;
    std::memcpy(&bits, &v, sizeof(bits));
    bits = (bits + ((bits >> 16) & 1u) + 0x7fffu) >> 16;  // round to nearest even, as mlx
    const v8u nan = reinterpret_cast<v8u>(v != v);  // all ones where v is NaN
    bits = (nan & 0x7fc0u) | (~nan & bits);
    const v8h h = __builtin_convertvector(bits, v8h);
    std::memcpy(p, &h, sizeof(h));
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<T, mlx::core::float16_t>) {
    __m256 f;
    std::memcpy(&f, &v, sizeof(f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
#endif
  } else {
    for (int i = 0; i < kW; ++i) p[i] = static_cast<T>(v[i]);
  }
}

inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Cephes expf core, ~2 ulp: x = n ln(2) + r with |r| <= ln(2) / 2; returns e^r, and n in `n`.
// |x| must be small enough for n to fit an int (the callers clamp x).
inline v8f exp8_reduced(v8f x, v8i& n) {
  v8f fx = x * 1.44269504088896341f + 0.5f;  // n = floor(x log2(e) + 1/2)
  n = __builtin_convertvector(fx, v8i);  // truncation toward zero ...
  v8f nf = __builtin_convertvector(n, v8f);
  n = n + (nf > fx);  // ... made a floor (a true comparison is -1)
  nf = __builtin_convertvector(n, v8f);
  v8f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v8f y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * r * r + r + 1.0f;
}

// 2^n as a float, for -126 <= n <= 127 (the bits of the exponent field).
inline v8f pow2_8(v8i n) {
  v8i bits = (n + 127) << 23;
  v8f two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return two_n;
}

// exp for x <= 0 (scores minus their max): x < -87 gives ~0 (exp(-87) ~ 1.6e-38, never subnormal).
inline v8f exp8(v8f x) {
  const v8f lo = v8f{} - 87.0f;
  x = x < lo ? lo : x;
  v8i n;
  const v8f y = exp8_reduced(x, n);
  return y * pow2_8(n);
}

// exp for x <= 0 down to the subnormal results: 2^n is applied as 2^(n - n/2) 2^(n/2) (each
// factor normal, one rounding into the subnormals), so exp(-88) ~ 6e-39 is not lost; 0 below
// about -103.9 (x is clamped at -104). NaN stays NaN.
inline v8f exp8_subnormal(v8f x) {
  const v8f lo = v8f{} - 104.0f;
  x = x < lo ? lo : x;
  v8i n;
  const v8f y = exp8_reduced(x, n);
  const v8i half = n >> 1;
  return y * pow2_8(n - half) * pow2_8(half);
}

inline v8f abs8(v8f x) {
  v8i bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits &= 0x7fffffff;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// 1 / (1 + exp(-x)) for any x, without overflow: with e = exp(-|x|) in (0, 1], it is 1 / (1 + e)
// for x >= 0 and e / (1 + e) for x < 0. The same values as mlx's sigmoid over the whole range
// (within a few ulp): subnormal results for -88 <= x < -87.3, 0 below -88 (mlx's exp(|x|) is
// inf there), sigmoid(-inf) = 0, sigmoid(inf) = 1, NaN stays NaN.
inline v8f sigmoid8(v8f x) {
  const v8f zero = v8f{}, one = zero + 1.0f;
  const v8f neg = zero - abs8(x);  // -|x| <= 0, or NaN
  v8f e = exp8_subnormal(neg);
  e = neg < zero - 88.0f ? zero : e;  // NaN compares false: stays NaN
  return (x < zero ? e : one) / (one + e);
}

}  // namespace metrale::kernel
