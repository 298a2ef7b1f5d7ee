/* Conversions and an exp for the C kernels (paged_decode.c, layer_ops.c), inlined so
   that the loops calling them vectorise.

   The library is built with -ffp-contract=off: a product and a sum are rounded apart,
   as torch's operators round them, unless the source asks for fmaf. */
#ifndef BLOCKTUNE_CPU_MATH_H
#define BLOCKTUNE_CPU_MATH_H

#include <math.h>
#include <stdint.h>

/* bfloat16 bits to float32 (exact). */
static inline float widen(uint16_t bits) {
  union { uint32_t u; float f; } value = {.u = (uint32_t)bits << 16};
  return value.f;
}

/* float32 to bfloat16 bits, rounded to nearest even as torch rounds (a NaN stays one). */
static inline uint16_t narrow(float f) {
  union { float f; uint32_t u; } value = {.f = f};
  uint32_t nearest = (value.u + 0x7FFFu + ((value.u >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (value.u >> 16) | 0x40u;
  return (uint16_t)(f != f ? quiet_nan : nearest); /* a select, which vectorises */
}

/* e^x to within a few float32 ulp (Cody-Waite reduction by ln 2, then a degree-6
   polynomial), in operations a loop vectorises, where libm's expf is called once per
   value. x is clamped to [-87, 88]: e^-87 stands for anything smaller, which no caller
   tells from zero. */
static inline float exp_fast(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  /* n = round(x / ln 2), by truncation of a positive value (floorf does not vectorise) */
  float n = (float)(int32_t)(fmaf(x, 1.44269504088896341f, 0.5f) + 128.f) - 128.f;
  float r = fmaf(n, -0.693359375f, x);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p, r * r, r) + 1.f;
  union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
  return p * scale.f;
}

#endif
