/* A decoder layer's small operators, fused: the stretches between its weight products.

   Built with paged_decode.c by blocktune.kernels.cpu_library and called through ctypes
   by blocktune.kernels.cpu_layer_ops. Each function does in one call what the torch
   operators of blocktune.runtime.model do in several, with the same roundings: every
   value torch rounds to the storage type (bfloat16, to nearest even) is rounded here at
   the same point, and no product and sum are fused (the library is built with
   -ffp-contract=off), so the residual add and the rotary embedding are bitwise equal to
   torch's. The norm sums its squares in another order, and SiLU takes `exp_fast`, so
   those two move by float32 rounding (bfloat16 results almost never). Tensors are
   contiguous float32 or bfloat16 rows (`is_bf16`); the arithmetic is float32.
   `write_slots` copies a step's new K/V rows into the paged cache (no arithmetic), and
   `argmax_rows` picks each row's greedy token from float32 logits.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define LOAD_BF16(x) widen(x)
#define STORE_BF16(x) narrow(x)

#define DEFINE_LAYER_OPS(NAME, TYPE, LOAD, STORE)                                        \
  static void NAME##_add_rms_norm(TYPE *x, const TYPE *delta, const TYPE *weight,        \
                                  TYPE *out, int rows, int hidden, float eps) {          \
    for (int r = 0; r < rows; r++) {                                                     \
      TYPE *xr = x + (int64_t)r * hidden, *outr = out + (int64_t)r * hidden;             \
      float squares = 0.f;                                                               \
      if (delta) {                                                                       \
        const TYPE *dr = delta + (int64_t)r * hidden;                                    \
        _Pragma("omp simd") for (int i = 0; i < hidden; i++) xr[i] =                     \
            STORE(LOAD(xr[i]) + LOAD(dr[i]));                                            \
      }                                                                                  \
      _Pragma("omp simd reduction(+ : squares)") for (int i = 0; i < hidden; i++) {      \
        float value = LOAD(xr[i]);                                                       \
        squares += value * value;                                                        \
      }                                                                                  \
      float scale = 1.f / sqrtf(squares / (float)hidden + eps);                          \
      _Pragma("omp simd") for (int i = 0; i < hidden; i++) {                             \
        float normed = LOAD(STORE(LOAD(xr[i]) * scale));                                 \
        outr[i] = STORE(LOAD(weight[i]) * normed);                                       \
      }                                                                                  \
    }                                                                                    \
  }                                                                                      \
  static void NAME##_rotate(TYPE *base, int64_t row_stride, int rows, int heads, int dim, \
                            const TYPE *cos, const TYPE *sin) {                          \
    int half = dim / 2;                                                                  \
    for (int r = 0; r < rows; r++) {                                                     \
      const TYPE *c = cos + (int64_t)r * dim, *s = sin + (int64_t)r * dim;               \
      for (int h = 0; h < heads; h++) {                                                  \
        TYPE *x = base + (int64_t)r * row_stride + (int64_t)h * dim;                     \
        float turned[dim], kept[dim];                                                    \
        _Pragma("omp simd") for (int d = 0; d < half; d++) {                             \
          turned[d] = -LOAD(x[d + half]);                                                \
          turned[d + half] = LOAD(x[d]);                                                 \
        }                                                                                \
        _Pragma("omp simd") for (int d = 0; d < dim; d++) kept[d] = LOAD(x[d]);          \
        _Pragma("omp simd") for (int d = 0; d < dim; d++) x[d] =                         \
            STORE(LOAD(STORE(kept[d] * LOAD(c[d]))) + LOAD(STORE(turned[d] * LOAD(s[d])))); \
      }                                                                                  \
    }                                                                                    \
  }                                                                                      \
  static void NAME##_silu_and_mul(const TYPE *gate_up, TYPE *out, int rows, int width) { \
    for (int r = 0; r < rows; r++) {                                                     \
      const TYPE *gate = gate_up + (int64_t)r * 2 * width, *up = gate + width;           \
      TYPE *outr = out + (int64_t)r * width;                                             \
      _Pragma("omp simd") for (int i = 0; i < width; i++) {                              \
        float g = LOAD(gate[i]);                                                         \
        float silu = LOAD(STORE(g / (1.f + exp_fast(-g))));                              \
        outr[i] = STORE(silu * LOAD(up[i]));                                             \
      }                                                                                  \
    }                                                                                    \
  }

DEFINE_LAYER_OPS(f32, float, LOAD_F32, STORE_F32)
DEFINE_LAYER_OPS(bf16, uint16_t, LOAD_BF16, STORE_BF16)

/* x += delta (where delta is not NULL), then per row out = weight * round(x * rsqrt(
   mean(x^2) + eps)), as RMSNorm in model.py. x, delta, out: [rows, hidden]; weight:
   [hidden]. */
void add_rms_norm(void *x, const void *delta, const void *weight, void *out, int rows,
                  int hidden, float eps, int is_bf16) {
  if (is_bf16)
    bf16_add_rms_norm(x, delta, weight, out, rows, hidden, eps);
  else
    f32_add_rms_norm(x, delta, weight, out, rows, hidden, eps);
}

/* The rotary embedding of the first `heads` heads of every row, in place, in Hugging
   Face's half-split layout: x * cos + rotate_half(x) * sin. Row r's heads start at
   r * row_stride elements; cos and sin are [rows, dim]. */
void rotate(void *base, int64_t row_stride, int rows, int heads, int dim, const void *cos,
            const void *sin, int is_bf16) {
  if (is_bf16)
    bf16_rotate(base, row_stride, rows, heads, dim, cos, sin);
  else
    f32_rotate(base, row_stride, rows, heads, dim, cos, sin);
}

/* SwiGLU's silu(gate) * up: gate_up [rows, 2 * width] holds each row's gate, then its up
   projection; out [rows, width]. */
void silu_and_mul(const void *gate_up, void *out, int rows, int width, int is_bf16) {
  if (is_bf16)
    bf16_silu_and_mul(gate_up, out, rows, width);
  else
    f32_silu_and_mul(gate_up, out, rows, width);
}

/* Each token's new K and V into its slot of the flat caches [slots, row_bytes]: token t's
   row of `row_bytes` bytes starts at key + t * key_stride (value + t * value_stride)
   bytes. The slots are checked by the caller. */
void write_slots(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                 void *key_cache, void *value_cache, const int64_t *slots, int tokens,
                 int64_t row_bytes) {
  for (int t = 0; t < tokens; t++) {
    memcpy((char *)key_cache + slots[t] * row_bytes, (const char *)key + t * key_stride,
           row_bytes);
    memcpy((char *)value_cache + slots[t] * row_bytes, (const char *)value + t * value_stride,
           row_bytes);
  }
}

/* Each row's index of its largest value, as torch.argmax takes it: the first of equal
   largest values, and the first NaN where a row has one. logits [rows, cols] float32, rows
   `stride` values apart; out [rows] int64. One vectorised pass finds the largest value (and
   whether there is a NaN), a second the first index holding it. */
void argmax_rows(const float *logits, int64_t stride, int rows, int cols, int64_t *out) {
  for (int r = 0; r < rows; r++) {
    const float *row = logits + r * stride;
    float top = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int i = 0; i < cols; i++) {
      top = row[i] > top ? row[i] : top;
      nan |= row[i] != row[i];
    }
    int64_t best = 0;
    for (int i = 0; i < cols; i++)
      if (nan ? row[i] != row[i] : row[i] == top) {
        best = i;
        break;
      }
    out[r] = best;
  }
}
