/* Attention of query rows over a paged KV cache, read in place (no gather, no padding).

   Built by blocktune.kernels.cpu_library with the machine's C compiler and called
   through ctypes. Each query row attends the first context_lens[row] tokens of its
   block-table row (row_of[row], or the row itself where row_of is NULL): a decode
   token its whole sequence, a prefill token its sequence up to itself. Each (row, KV
   head) pair is one task: the scores of the KV head's group of query heads over the
   context, an exact softmax in fp32, then the weighted sum of the values, all read
   block by block through the block table. Queries, caches and outputs share one
   storage type, float32 or bfloat16 (`is_bf16`); the arithmetic is fp32. Layouts:

     query  [num_rows, num_kv_heads, group, head_dim], rows query_stride apart
     out    [num_rows, num_kv_heads, group, head_dim], rows out_stride apart
     caches [num_slots, num_kv_heads, head_dim]
     block_table  [table rows, table_stride]  int32
     context_lens [num_rows]                  int32
     row_of       [num_rows] int32, or NULL
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* The two halves of a (row, KV head) task, for either storage type:

   - `scores`: one token's key against the group's query heads (scores[g * len]); the
     key's head_dim values are read (and, for bfloat16, widened) once for the group.
     `scores4` does four consecutive tokens at once (keys `stride` apart): four
     independent sums, each in the same order as `scores` takes it (so the same scores),
     whose chains and final reductions overlap instead of waiting on one another.
   - `weigh`: a run of `count` tokens' values, `stride` apart, weighted by their
     probabilities (p[g * len + i]) into the group's outputs; each query head's output is
     accumulated in a stack array over the whole run, in token order (the same sums, in
     the same order, as one token at a time).

   `dim` is a compile-time constant in the common cases so that the loops unroll and
   vectorise fully. */
#define DEFINE_TOKEN_OPS(NAME, TYPE, WIDEN, LOAD)                                         \
  static inline void NAME##_scores(const float *q, const TYPE *k, int group, int dim,     \
                                   float scale, float *scores, int len) {                \
    WIDEN(wide, k, dim);                                                                 \
    for (int g = 0; g < group; g++) {                                                    \
      const float *qg = q + g * dim;                                                     \
      float acc = 0.f;                                                                   \
      _Pragma("omp simd reduction(+ : acc)") for (int d = 0; d < dim; d++)               \
          acc = fmaf(qg[d], wide[d], acc);                                                        \
      scores[g * len] = acc * scale;                                                     \
    }                                                                                    \
  }                                                                                      \
  static inline void NAME##_scores4(const float *q, const TYPE *k, int64_t stride,      \
                                    int group, int dim, float scale, float *scores,     \
                                    int len) {                                           \
    WIDEN(w0, k, dim);                                                                   \
    WIDEN(w1, k + stride, dim);                                                          \
    WIDEN(w2, k + 2 * stride, dim);                                                      \
    WIDEN(w3, k + 3 * stride, dim);                                                      \
    for (int g = 0; g < group; g++) {                                                    \
      const float *qg = q + g * dim;                                                     \
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;                                      \
      _Pragma("omp simd reduction(+ : a0, a1, a2, a3)") for (int d = 0; d < dim; d++) {  \
        a0 = fmaf(qg[d], w0[d], a0);                                                     \
        a1 = fmaf(qg[d], w1[d], a1);                                                     \
        a2 = fmaf(qg[d], w2[d], a2);                                                     \
        a3 = fmaf(qg[d], w3[d], a3);                                                     \
      }                                                                                  \
      float *sg = scores + g * len;                                                      \
      sg[0] = a0 * scale;                                                                \
      sg[1] = a1 * scale;                                                                \
      sg[2] = a2 * scale;                                                                \
      sg[3] = a3 * scale;                                                                \
    }                                                                                    \
  }                                                                                      \
  static inline void NAME##_weigh(const float *p, const TYPE *v, int64_t stride,         \
                                  int count, int group, int dim, float *out, int len) {  \
    for (int g = 0; g < group; g++) {                                                    \
      float acc[(dim)], *og = out + g * dim;                                             \
      const float *w = p + g * len;                                                      \
      const TYPE *vi = v;                                                                \
      _Pragma("omp simd") for (int d = 0; d < dim; d++) acc[d] = og[d];                  \
      for (int i = 0; i < count; i++, vi += stride) {                                    \
        float wi = w[i];                                                                 \
        _Pragma("omp simd") for (int d = 0; d < dim; d++) acc[d] = fmaf(wi, LOAD(vi[d]), acc[d]);    \
      }                                                                                  \
      _Pragma("omp simd") for (int d = 0; d < dim; d++) og[d] = acc[d];                  \
    }                                                                                    \
  }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) widen(x)
/* `wide`: a token's head_dim values as fp32, read in place for fp32 storage and widened
   into a stack array for bfloat16. */
#define WIDEN_F32(wide, x, dim) const float *wide = (x)
#define WIDEN_BF16(wide, x, dim)                                                         \
  float wide[(dim)];                                                                     \
  _Pragma("omp simd") for (int d = 0; d < (dim); d++) wide[d] = LOAD_BF16((x)[d])
DEFINE_TOKEN_OPS(f32, float, WIDEN_F32, LOAD_F32)
DEFINE_TOKEN_OPS(bf16, uint16_t, WIDEN_BF16, LOAD_BF16)

/* Prefetching. A decode step's K and V come from memory (the layer's weights went through
   the caches since the last step read them), and the hardware prefetchers restart at every
   block. So while a task scores four tokens' keys it asks for the keys FETCH_AHEAD_BYTES of
   its head's rows further on (through the block table) and for the same four tokens'
   values, which the weighted sum reads after the softmax. */
#define FETCH_AHEAD_BYTES 2048

static inline void fetch_row(const char *row, int bytes) {
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

/* Prefetch `count` tokens' rows of one head (`bytes` from `offset` into a token's
   `token_bytes`) from token `from` of the sequence on, as far as its `len` tokens go. */
static inline void fetch_tokens(const void *cache, const int32_t *blocks, int block_size,
                                int len, int from, int count, int64_t token_bytes,
                                int64_t offset, int bytes) {
  for (int t = from; t < from + count && t < len; t++) {
    int64_t slot = (int64_t)blocks[t / block_size] * block_size + t % block_size;
    fetch_row((const char *)cache + slot * token_bytes + offset, bytes);
  }
}

#define DEFINE_ATTEND(NAME, TYPE, LOAD, STORE)                                           \
  static void NAME##_attend(const TYPE *query, const TYPE *keys, const TYPE *values,     \
                            const int32_t *blocks, int len, int num_kv_heads, int head,  \
                            int group, int dim, int block_size, float scale, TYPE *out,  \
                            float *scores) {                                             \
    int num_blocks = (len + block_size - 1) / block_size;                                \
    int64_t token_stride = (int64_t)num_kv_heads * dim;                                  \
    float q[group * dim], o[group * dim];                                                \
    int row_bytes = dim * (int)sizeof(TYPE), ahead = FETCH_AHEAD_BYTES / row_bytes / 4 * 4; \
    int64_t token_bytes = token_stride * (int64_t)sizeof(TYPE), offset = (int64_t)head * row_bytes; \
    ahead = ahead < 4 ? 4 : ahead;                                                       \
    fetch_tokens(keys, blocks, block_size, len, 0, ahead, token_bytes, offset, row_bytes); \
    for (int i = 0; i < group * dim; i++) q[i] = LOAD(query[i]);                         \
    for (int j = 0; j < num_blocks; j++) {                                               \
      const TYPE *k = keys + (int64_t)blocks[j] * block_size * token_stride +            \
                      (int64_t)head * dim;                                               \
      int first = j * block_size;                                                        \
      int count = len - first < block_size ? len - first : block_size;                   \
      int i = 0;                                                                         \
      for (; i + 4 <= count; i += 4, k += 4 * token_stride) {                            \
        fetch_tokens(keys, blocks, block_size, len, first + i + ahead, 4, token_bytes,   \
                     offset, row_bytes);                                                 \
        fetch_tokens(values, blocks, block_size, len, first + i, 4, token_bytes, offset, \
                     row_bytes);                                                         \
        NAME##_scores4(q, k, token_stride, group, dim, scale, scores + first + i, len);  \
      }                                                                                  \
      fetch_tokens(values, blocks, block_size, len, first + i, count - i, token_bytes,   \
                   offset, row_bytes);                                                   \
      for (; i < count; i++, k += token_stride)                                          \
        NAME##_scores(q, k, group, dim, scale, scores + first + i, len);                 \
    }                                                                                    \
    for (int g = 0; g < group; g++) {                                                    \
      float *p = scores + g * len, top = -INFINITY, sum = 0.f;                           \
      for (int t = 0; t < len; t++) top = p[t] > top ? p[t] : top;                       \
      _Pragma("omp simd reduction(+ : sum)") for (int t = 0; t < len; t++) {             \
        p[t] = exp_fast(p[t] - top);                                                     \
        sum += p[t];                                                                     \
      }                                                                                  \
      float inverse = 1.f / sum;                                                         \
      for (int t = 0; t < len; t++) p[t] *= inverse;                                     \
    }                                                                                    \
    memset(o, 0, sizeof(o));                                                             \
    for (int j = 0; j < num_blocks; j++) {                                               \
      const TYPE *v = values + (int64_t)blocks[j] * block_size * token_stride +          \
                      (int64_t)head * dim;                                               \
      int first = j * block_size;                                                        \
      int count = len - first < block_size ? len - first : block_size;                   \
      NAME##_weigh(scores + first, v, token_stride, count, group, dim, o, len);          \
    }                                                                                    \
    for (int i = 0; i < group * dim; i++) out[i] = STORE(o[i]);                          \
  }

#define STORE_F32(x) (x)
#define STORE_BF16(x) narrow(x)
DEFINE_ATTEND(f32, float, LOAD_F32, STORE_F32)
DEFINE_ATTEND(bf16, uint16_t, LOAD_BF16, STORE_BF16)

/* Returns 0, or -1 where a thread's score buffer could not be allocated. */
int paged_decode(const void *query, int64_t query_stride, const void *key_cache,
                 const void *value_cache, int is_bf16, const int32_t *block_table,
                 int table_stride, const int32_t *row_of, const int32_t *context_lens,
                 int num_seqs, int num_kv_heads, int group, int head_dim, int block_size,
                 float scale, int num_threads, void *out, int64_t out_stride) {
  int longest = 0;
  for (int s = 0; s < num_seqs; s++) longest = context_lens[s] > longest ? context_lens[s] : longest;
  int tasks = num_seqs * num_kv_heads, failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  {
    float *scores = malloc(sizeof(float) * (size_t)group * (longest > 0 ? longest : 1));
    if (!scores) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; task++) {
      if (!scores) continue;
      int s = task / num_kv_heads, head = task % num_kv_heads;
      int64_t in_row = (int64_t)head * group * head_dim;
      const int32_t *blocks = block_table + (int64_t)(row_of ? row_of[s] : s) * table_stride;
      int len = context_lens[s];
#define CALL(NAME, TYPE, DIM)                                                                \
  NAME##_attend((const TYPE *)query + s * query_stride + in_row, (const TYPE *)key_cache,   \
                (const TYPE *)value_cache, blocks, len, num_kv_heads, head, group, DIM,     \
                block_size, scale, (TYPE *)out + s * out_stride + in_row, scores)
      if (is_bf16) {
        if (head_dim == 64) CALL(bf16, uint16_t, 64);
        else if (head_dim == 128) CALL(bf16, uint16_t, 128);
        else CALL(bf16, uint16_t, head_dim);
      } else {
        if (head_dim == 64) CALL(f32, float, 64);
        else if (head_dim == 128) CALL(f32, float, 128);
        else CALL(f32, float, head_dim);
      }
#undef CALL
    }
    free(scores);
  }
  return failed ? -1 : 0;
}
