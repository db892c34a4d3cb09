// Vector math shared by the CPU kernels: 8-float vectors, loads/stores with dtype conversion, a
// vectorized exp (MLX's own exp is scalar on x86 Linux, ~10 ns per element) and a logistic sigmoid.
// Vectors are GCC/Clang vector extensions (8 floats): AVX2/AVX-512 in the ISA builds that enable them,
// NEON on arm, pairs of SSE registers in the baseline x86-64 build.
//
// Included only by isa_kernels.cpp, once per instruction set, inside namespace METRALE_ISA_NS: the
// same inline function compiled with different flags must never share a (linker-merged) symbol.
// It includes no MLX header for the same reason; half types are their raw bits (f16_t, bf16_t).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef METRALE_ISA_NS
#error "vecmath.h is compiled per instruction set: include it from isa_kernels.cpp"
#endif

namespace metrale::METRALE_ISA_NS::kernel {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));  // the bits of 8 float16 / bfloat16 values
constexpr int kW = 8;

struct f16_t { uint16_t bits; };   // IEEE binary16, by its bits
struct bf16_t { uint16_t bits; };  // bfloat16, by its bits

template <typename T> inline T min_of(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max_of(T a, T b) { return a < b ? b : a; }

// float16 bits -> float, exact (subnormals, inf and NaN included).
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float -> float16 bits, rounded to nearest even (as F16C and mlx's conversion); NaN stays NaN.
inline uint16_t float_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf (or is inf)
  if (ax < 0x38800000u) {  // below the smallest normal half: round to a subnormal (or 0)
    if (ax < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t e = ax >> 23, man = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24: man >> shift is the subnormal mantissa
    uint32_t h = man >> shift;
    const uint32_t rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    h += (rest > half || (rest == half && (h & 1u))) ? 1u : 0u;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((ax >> 13) - (112u << 10));  // rebias the exponent, keep 10 mantissa bits
  const uint32_t rest = ax & 0x1fffu;
  h += (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u;  // a carry may round up to inf
  return static_cast<uint16_t>(sign | h);
}

// 8 elements of T (float, f16_t or bf16_t) from p, as floats.
template <typename T>
inline v8f load8(const T* p) {
  v8f v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<T, bf16_t>) {
#if defined(__AVX2__)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
    v8h h;
    std::memcpy(&h, p, sizeof(h));
    const v8u bits = __builtin_convertvector(h, v8u) << 16;
#endif
    std::memcpy(&v, &bits, sizeof(v));
  } else {
    static_assert(std::is_same_v<T, f16_t>, "load8: float, f16_t or bf16_t");
#if defined(__F16C__)
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    std::memcpy(&v, &f, sizeof(v));
#else
    for (int i = 0; i < kW; ++i) v[i] = f16_to_float(p[i].bits);
#endif
  }
  return v;
}

// 8 floats written to p as T (float, f16_t or bf16_t), each rounded to nearest even: the bits of
// mlx's own conversions except for the payload of a NaN (still a NaN).
template <typename T>
inline void store8(T* p, v8f v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    v8u bits;
    std::memcpy(&bits, &v, sizeof(bits));
    bits = (bits + ((bits >> 16) & 1u) + 0x7fffu) >> 16;  // round to nearest even, as mlx
    const v8u nan = reinterpret_cast<v8u>(v != v);  // all ones where v is NaN
    bits = (nan & 0x7fc0u) | (~nan & bits);
    const v8h h = __builtin_convertvector(bits, v8h);
    std::memcpy(p, &h, sizeof(h));
  } else {
    static_assert(std::is_same_v<T, f16_t>, "store8: float, f16_t or bf16_t");
#if defined(__F16C__)
    __m256 f;
    std::memcpy(&f, &v, sizeof(f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
#else
    for (int i = 0; i < kW; ++i) p[i].bits = float_to_f16(v[i]);
#endif
  }
}

inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < kW; ++i) m = max_of(m, v[i]);
  return m;
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

}  // namespace metrale::METRALE_ISA_NS::kernel
