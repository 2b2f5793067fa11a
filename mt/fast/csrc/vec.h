// Helpers shared by mt's training kernels (dropout.cpp, smoothed_ce.cpp), written with GCC's
// and Clang's vector extensions so that they vectorize for whatever -march=native gives.

#pragma once

#include <cstdint>
#include <cstring>

namespace mt_vec {

// 8 floats as one value, an AVX register; not 16 even with AVX-512: CPUs that execute AVX-512
// in 256-bit halves gain nothing from 16 and pay for the longer tails (docs/performance.md).
constexpr int kLanes = 8;
typedef float fvec __attribute__((vector_size(kLanes * 4)));
typedef int32_t ivec __attribute__((vector_size(kLanes * 4)));
typedef float f4v __attribute__((vector_size(16)));

inline fvec load(const float* p) {
  fvec x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store(float* p, fvec x) { std::memcpy(p, &x, sizeof x); }

// bfloat16, as its 16 bits, to and from float32: widened exactly, and rounded back to nearest
// even as c10::BFloat16 rounds, NaN to its quiet NaN 0x7fc0; one element or 8 lanes at a time.
typedef uint16_t u16x8 __attribute__((vector_size(kLanes * 2)));
typedef uint32_t u32x8 __attribute__((vector_size(kLanes * 4)));

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7fc0u;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline fvec load_bf16(const uint16_t* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<fvec>(__builtin_convertvector(h, u32x8) << 16);
}

inline void store_bf16(uint16_t* p, fvec v) {
  const u32x8 u = reinterpret_cast<u32x8>(v);
  const u32x8 rounded = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
  const u16x8 h = __builtin_convertvector(v != v ? u32x8{} + 0x7fc0u : rounded, u16x8);
  std::memcpy(p, &h, sizeof h);
}

// The lanes of x added up, as a tree of halves (a loop of adds would wait on each other).
inline float hsum(fvec x) {
  f4v lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  const f4v q = lo + hi;
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// exp(x) for x <= 0, a register at a time: Cephes' single-precision polynomial (relative
// error ~1e-7); 0 below -87, where exp(x) is below float's smallest normal number.
inline fvec exp_nonpositive(fvec x) {
  const ivec under = x < -87.f;
  x = under ? fvec{} - 87.f : x;
  const fvec y = x * 1.44269504088896341f + 0.5f;  // x / ln 2 + 1/2, floored below
  ivec n = __builtin_convertvector(y, ivec);        // truncated toward 0
  n += __builtin_convertvector(n, fvec) > y;        // -1 where that rounded up: the floor
  const fvec nf = __builtin_convertvector(n, fvec);
  const fvec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // x - n ln 2, in two parts
  fvec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const fvec scale = reinterpret_cast<fvec>((n + 127) << 23);  // 2^n
  return under ? fvec{} : p * scale;
}

}  // namespace mt_vec
