// Paged decode attention for CPUs: one query token per request, K/V read in place through
// the block table (no gather copy), OpenMP over requests.
//
// Built at first use by kernels/cpu.py with `cc -O3 -march=native -fopenmp -fno-math-errno`;
// it links the libgomp that torch already loaded, so it shares torch's OpenMP thread pool.
//
// For request r, query head qh and its KV head kh = qh / (num_heads / num_kv_heads):
//   scores[qh][t] = scale * q[r, qh, :] . K[slot(r, t), kh, :]        t < seq_lens[r]
//   out[r, qh, :] = sum_t softmax(scores[qh])[t] * V[slot(r, t), kh, :]
// slot(r, t) = block_table[r][t / block_size], offset t % block_size. One slot holds all KV
// heads contiguously ([Hkv, D]), so each pass streams a request's blocks front to back.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (uint16_t)(u >> 16);
}

// A cache row as floats: fp32 rows are read in place, bf16 rows converted into `buf` (a
// plain loop the compiler vectorizes).
static inline const float *load_row_f32(float *buf, const float *src, int n) {
    (void)buf;
    (void)n;
    return src;
}

static inline const float *load_row_bf16(float *buf, const uint16_t *src, int n) {
    uint32_t *bits = (uint32_t *)buf;
#pragma omp simd
    for (int d = 0; d < n; d++) bits[d] = ((uint32_t)src[d]) << 16;
    return buf;
}

static inline void store_row_f32(float *dst, const float *src, float mul, int n) {
    for (int d = 0; d < n; d++) dst[d] = src[d] * mul;
}

static inline void store_row_bf16(uint16_t *dst, const float *src, float mul, int n) {
    for (int d = 0; d < n; d++) dst[d] = f32_to_bf16(src[d] * mul);
}

// One request: q [H, D] (pre-scaled), scores [H, seq_len], acc [H, D], row [Hkv * D].
#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD_ROW, STORE_ROW)                                 \
void NAME(T *out, const T *query, int64_t q_token_stride, int64_t q_head_stride,              \
          const T *key_cache, const T *value_cache, int64_t block_stride,                    \
          int64_t slot_stride, const int32_t *block_table, int64_t table_stride,             \
          const int32_t *seq_lens, const int64_t *token_rows, int num_reqs, int num_heads,   \
          int num_kv_heads, int head_size, int block_size, float scale) {                    \
    const int group = num_heads / num_kv_heads;                                              \
    const int slot_width = num_kv_heads * head_size;                                         \
    _Pragma("omp parallel")                                                                  \
    {                                                                                        \
        int capacity = 0;                                                                    \
        float *scores = NULL;                                                                \
        float *q = (float *)malloc(sizeof(float) * (size_t)num_heads * head_size);           \
        float *acc = (float *)malloc(sizeof(float) * (size_t)num_heads * head_size);         \
        const int row_len = slot_width > head_size ? slot_width : head_size;                 \
        float *row = (float *)malloc(sizeof(float) * (size_t)row_len);                       \
        _Pragma("omp for schedule(dynamic, 4)")                                              \
        for (int r = 0; r < num_reqs; r++) {                                                 \
            const int seq_len = seq_lens[r];                                                 \
            if (seq_len > capacity) {                                                        \
                free(scores);                                                                \
                capacity = seq_len + 1024;                                                   \
                scores = (float *)malloc(sizeof(float) * (size_t)capacity * num_heads);      \
            }                                                                                \
            const int64_t token = token_rows[r];                                             \
            for (int h = 0; h < num_heads; h++) {                                            \
                const float *qh = LOAD_ROW(row, query + token * q_token_stride               \
                                           + (int64_t)h * q_head_stride, head_size);         \
                for (int d = 0; d < head_size; d++) q[h * head_size + d] = qh[d] * scale;    \
            }                                                                                \
            const int32_t *blocks = block_table + (int64_t)r * table_stride;                 \
            for (int t = 0; t < seq_len; t++) {                                              \
                const float *keys = LOAD_ROW(                                                \
                    row, key_cache + (int64_t)blocks[t / block_size] * block_stride          \
                    + (int64_t)(t % block_size) * slot_stride, slot_width);                  \
                for (int h = 0; h < num_heads; h++) {                                        \
                    const float *k = keys + (h / group) * head_size;                         \
                    const float *qh = q + h * head_size;                                     \
                    float dot = 0.f;                                                         \
                    _Pragma("omp simd reduction(+:dot)")                                     \
                    for (int d = 0; d < head_size; d++) dot += qh[d] * k[d];                 \
                    scores[(int64_t)h * seq_len + t] = dot;                                  \
                }                                                                            \
            }                                                                                \
            for (int h = 0; h < num_heads; h++) {                                            \
                float *s = scores + (int64_t)h * seq_len;                                    \
                float max = -INFINITY, sum = 0.f;                                            \
                for (int t = 0; t < seq_len; t++) max = s[t] > max ? s[t] : max;             \
                _Pragma("omp simd reduction(+:sum)")                                         \
                for (int t = 0; t < seq_len; t++) {                                          \
                    s[t] = expf(s[t] - max);                                                 \
                    sum += s[t];                                                             \
                }                                                                            \
                const float inv = 1.f / sum;                                                 \
                for (int t = 0; t < seq_len; t++) s[t] *= inv;                               \
            }                                                                                \
            memset(acc, 0, sizeof(float) * (size_t)num_heads * head_size);                   \
            for (int t = 0; t < seq_len; t++) {                                              \
                const float *values = LOAD_ROW(                                              \
                    row, value_cache + (int64_t)blocks[t / block_size] * block_stride        \
                    + (int64_t)(t % block_size) * slot_stride, slot_width);                  \
                for (int h = 0; h < num_heads; h++) {                                        \
                    const float p = scores[(int64_t)h * seq_len + t];                        \
                    const float *v = values + (h / group) * head_size;                       \
                    float *a = acc + h * head_size;                                          \
                    _Pragma("omp simd")                                                      \
                    for (int d = 0; d < head_size; d++) a[d] += p * v[d];                    \
                }                                                                            \
            }                                                                                \
            for (int h = 0; h < num_heads; h++)                                              \
                STORE_ROW(out + (token * num_heads + h) * (int64_t)head_size,                \
                          acc + h * head_size, 1.f, head_size);                              \
        }                                                                                    \
        free(scores);                                                                        \
        free(q);                                                                             \
        free(acc);                                                                           \
        free(row);                                                                           \
    }                                                                                        \
}

DEFINE_DECODE_ATTENTION(decode_attention_f32, float, load_row_f32, store_row_f32)
DEFINE_DECODE_ATTENTION(decode_attention_bf16, uint16_t, load_row_bf16, store_row_bf16)
