// Paged decode attention for CPUs: one query token per request, K/V read in place through
// the block table (no gather copy), OpenMP over requests.
//
// Built at first use by kernels/cpu.py with `cc -O3 -march=native -fopenmp -fno-math-errno`;
// it links the libgomp that torch already loaded, so it shares torch's OpenMP thread pool.
//
// For request r, query head h and its KV head kh = h / (num_heads / num_kv_heads):
//   scores[h][t] = scale * q[r, h, :] . K[slot(r, t), kh, :]        t < seq_lens[r]
//   out[r, h, :] = sum_t softmax(scores[h])[t] * V[slot(r, t), kh, :]
// slot(r, t) = block_table[r][t / block_size], offset t % block_size.
//
// Options (0 = off): a sliding window keeps only the last `sliding_window` keys (t >=
// seq_len - sliding_window; the blocks wholly before it are skipped, the keys before it in its
// first block get weight 0), and a soft cap squashes each score to cap * tanh(score / cap)
// before the softmax (Gemma 2). Chunked local attention (Llama 4, the `_chunked` entry points)
// keeps only the keys of the query's own chunk of `chunk_size` positions: t >= (seq_len - 1)
// rounded down to a multiple of chunk_size, a window start like the sliding one's. Attention
// sinks (gpt-oss; NULL = none) are one logit per query head that joins the softmax's
// denominator with no value:
//   out[r, h, :] = sum_t e^scores[h][t] V[t] / (e^sinks[h] + sum_t e^scores[h][t]).
//
// Loops run KV head by KV head: each K/V row is read once for the `group` query heads that
// share it (float32 rows in place, bfloat16 rows widened once into a small buffer). The head
// size is a compile-time constant for the common sizes (64, 128) so the dot products unroll,
// and the softmax's exp is a polynomial the compiler vectorizes (libm's expf is a scalar call
// per score).
//
// An fp8 cache (--kv-cache-dtype; the `_<e4m3|e5m2>_chunked_scaled` entry points, bytes for
// the cache type TC) holds K / k_scale and V / v_scale: its rows are widened to float32 in
// registers (fp8_kv.h), the caller folds k_scale into `scale`, and `v_scale` multiplies each
// output row once.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_kv.h"
#include "qk_avx512.h"
#include "vec_math.h"

static inline float load_f32(const float *p, int i) { return p[i]; }
static inline float load_bf16(const uint16_t *p, int i) { return bf16_to_f32(p[i]); }
static inline void store_f32(float *p, int i, float v) { p[i] = v; }
static inline void store_bf16(uint16_t *p, int i, float v) { p[i] = f32_to_bf16_rne(v); }

static inline const float *widen_f32(float *buf, const float *src, int n) {
    (void)buf;
    (void)n;
    return src;
}

static inline const float *widen_bf16(float *buf, const uint16_t *src, int n) {
    for (int d = 0; d < n; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

// scores[o] = q . k_o for m <= 16 tokens of one block: `q_scaled` is the query times the
// softmax scale in float32, `q_raw` the query as stored; `row` is scratch for one widened row.
#define DEFINE_QK_CHUNK(NAME, T, WIDEN)                                                       \
static inline void NAME##_portable(float *scores, const float *q_scaled, const T *k,           \
                                   int64_t slot_stride, int m, int head_size, float *row) {    \
    for (int o = 0; o < m; o++) {                                                             \
        const float *kr = WIDEN(row, k + o * slot_stride, head_size);                         \
        float dot = 0.f;                                                                      \
        _Pragma("omp simd reduction(+:dot)")                                                  \
        for (int d = 0; d < head_size; d++) dot += q_scaled[d] * kr[d];                       \
        scores[o] = dot;                                                                      \
    }                                                                                         \
}

DEFINE_QK_CHUNK(qk_chunk_f32, float, widen_f32)
DEFINE_QK_CHUNK(qk_chunk_bf16, uint16_t, widen_bf16)
DEFINE_QK_CHUNK(qk_chunk_e4m3, uint8_t, widen_e4m3)
DEFINE_QK_CHUNK(qk_chunk_e5m2, uint8_t, widen_e5m2)

// fp8 keys against the float32 scaled query, whatever the query's own dtype (q_raw unused).
#ifdef QK_AVX512
#define QK16_FP8(FMT, ...) qk16_##FMT(__VA_ARGS__)
#else
#define QK16_FP8(FMT, ...) ((void)0)
#endif
#define DEFINE_QK_CHUNK_FP8(FMT)                                                              \
static inline void qk_chunk_##FMT(float *scores, const float *q_scaled, const void *q_raw,    \
                                  const uint8_t *k, int64_t slot_stride, int m,              \
                                  int head_size, float scale, float *row) {                  \
    (void)q_raw;                                                                              \
    (void)scale;                                                                              \
    if (QK_AVX512_ON && head_size % 16 == 0) {                                                \
        QK16_FP8(FMT, scores, q_scaled, k, slot_stride, m, head_size);                        \
        return;                                                                               \
    }                                                                                         \
    qk_chunk_##FMT##_portable(scores, q_scaled, k, slot_stride, m, head_size, row);           \
}
#ifdef QK_AVX512
#define QK_AVX512_ON 1
#else
#define QK_AVX512_ON 0
#endif
DEFINE_QK_CHUNK_FP8(e4m3)
DEFINE_QK_CHUNK_FP8(e5m2)

static inline void qk_chunk_f32(float *scores, const float *q_scaled, const float *q_raw,
                                const float *k, int64_t slot_stride, int m, int head_size,
                                float scale, float *row) {
    (void)q_raw;
    (void)scale;
#ifdef QK_AVX512
    if (head_size % 16 == 0) {
        qk16_f32(scores, q_scaled, k, slot_stride, m, head_size, 1.f);
        return;
    }
#endif
    qk_chunk_f32_portable(scores, q_scaled, k, slot_stride, m, head_size, row);
}

static inline void qk_chunk_bf16(float *scores, const float *q_scaled, const uint16_t *q_raw,
                                 const uint16_t *k, int64_t slot_stride, int m, int head_size,
                                 float scale, float *row) {
    (void)q_raw;
    (void)scale;
#ifdef QK_AVX512_BF16
    if (head_size % 32 == 0) {
        qk16_bf16(scores, q_raw, k, slot_stride, m, head_size, scale);
        return;
    }
#endif
    qk_chunk_bf16_portable(scores, q_scaled, k, slot_stride, m, head_size, row);
}

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2  // how far ahead the decode loops prefetch
#endif
#ifdef QK_AVX512
#define PREFETCH_ROWS prefetch_rows
#else
#define PREFETCH_ROWS(...) ((void)0)
#endif

// bfloat16: the grouped PV of qk_avx512.h where it applies; float32: never.
#ifdef QK_AVX512_BF16
#define PV_GROUP_bf16 pv_grouped_bf16
#else
#define PV_GROUP_bf16(...) 0
#endif
#define PV_GROUP_f32(...) 0
#define PV_GROUP_fp8(...) 0

#ifdef QK_AVX512
#define PV_FAST(head_size) ((head_size) % 16 == 0 && (head_size) <= 256)
#else
#define PV_FAST(head_size) 0
#define pv_f32(...) ((void)0)
#define pv_bf16(...) ((void)0)
#define pv_e4m3(...) ((void)0)
#define pv_e5m2(...) ((void)0)
#endif

// The next request's K and V blocks are brought toward the cache while this request computes,
// a few lines per query-key chunk: a decode step at concurrency 32 reads hundreds of MB of K/V
// in scattered blocks, and this request's own data is then already in L2 when it starts
// (1.7x at 32 requests of 320 keys, bench/RESULTS.md issue 51). A whole block's prefetches
// at once (PREFETCH_BLOCKS below) overflow the core's miss queues and are mostly dropped, so
// they are spread: NEXT_REQUEST_LINES lines of K and of V per chunk. Where the data is in
// cache already the prefetches only cost (1.4x on a step of 32 requests over the same 20
// blocks), hence the skips where the next request is the same sequence (below).
// Requests are handed to the threads REQUEST_CHUNK at a time (balance against the long
// runs of one thread's requests that let it bring in its next one: 1.2x over chunks of 4 on
// two threads, the same as a static split).
#define REQUEST_CHUNK 8
#ifndef NEXT_REQUEST_LINES
#define NEXT_REQUEST_LINES 48
#endif
typedef struct {
    const char *k, *v;      // the caches' first bytes
    const int32_t *blocks;  // the next request's block ids (NULL: none)
    int64_t block_bytes;    // bytes of one block's K (or V): slots of every head
    int64_t stride_bytes;   // bytes from one block to the next in the cache
    int num_blocks, block, line;
} next_request;

static inline void prefetch_next(next_request *c, int lines) {
#ifdef QK_AVX512
    for (int i = 0; i < lines && c->block < c->num_blocks; i++) {
        const int64_t at = (int64_t)c->blocks[c->block] * c->stride_bytes + (int64_t)c->line * 64;
        _mm_prefetch(c->k + at, _MM_HINT_T1);
        _mm_prefetch(c->v + at, _MM_HINT_T1);
        if ((int64_t)++c->line * 64 >= c->block_bytes) {
            c->line = 0;
            c->block++;
        }
    }
#else
    (void)c;
    (void)lines;
#endif
}

// One request. q: [H, D] float scratch; scores: [H, seq_len] scratch; acc: [H, D] scratch;
// next: the next request's blocks to bring in meanwhile (NULL: none).
// T: the query's and output's type; TC: the cache's (T, or bytes of fp8).
#define DEFINE_ATTEND_ONE(NAME, T, TC, LOAD, STORE, WIDEN, QK_CHUNK, PV, PV_GROUP)            \
static inline __attribute__((always_inline)) void NAME(                                       \
        T *out, const T *query, int64_t q_head_stride, const TC *key_cache,                   \
        const TC *value_cache, int64_t block_stride, int64_t slot_stride,                     \
        const int32_t *blocks, int seq_len, int num_masked, int num_heads, int group,         \
        const int head_size, int block_size, float scale, float soft_cap,                     \
        const float *sinks, float *q, float *scores, float *acc, float v_scale,               \
        next_request *next) {                                                                 \
    for (int h = 0; h < num_heads; h++)                                                       \
        for (int d = 0; d < head_size; d++)                                                   \
            q[h * head_size + d] = LOAD(query + h * q_head_stride, d) * scale;                \
    const int num_blocks = (seq_len + block_size - 1) / block_size;                           \
    float row[head_size];                                                                     \
    for (int kh = 0; kh < num_heads / group; kh++) {                                          \
        const int64_t head_offset = (int64_t)kh * head_size;                                  \
        float *sk = scores + (int64_t)kh * group * seq_len;                                   \
        for (int b = 0; b < num_blocks; b++) {                                                \
            const TC *k_block = key_cache + blocks[b] * block_stride + head_offset;           \
            const int n = seq_len - b * block_size < block_size ? seq_len - b * block_size    \
                                                                : block_size;                 \
            /* The first KV head's pass brings in whole blocks ahead, K and V of every head   \
               (a block's slots are contiguous): the other heads' passes and the PV then read \
               them from cache, and the memory streams while the first pass computes. */      \
            if (kh == 0 && b + PREFETCH_BLOCKS < num_blocks) {                                \
                const int64_t ahead = blocks[b + PREFETCH_BLOCKS] * block_stride;             \
                PREFETCH_ROWS(key_cache + ahead, 1, 0, block_size * slot_stride * sizeof(TC)); \
                PREFETCH_ROWS(value_cache + ahead, 1, 0, block_size * slot_stride * sizeof(TC)); \
            }                                                                                 \
            for (int o = 0; o < n; o += 16) {                                                 \
                const int m = n - o < 16 ? n - o : 16;                                        \
                for (int g = 0; g < group; g++) {                                             \
                    const int h = kh * group + g;                                             \
                    if (next) prefetch_next(next, NEXT_REQUEST_LINES);                        \
                    QK_CHUNK(sk + (int64_t)g * seq_len + b * block_size + o,                  \
                             q + h * head_size, query + h * q_head_stride,                    \
                             k_block + o * slot_stride, slot_stride, m, head_size, scale,     \
                             row);                                                            \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int h = 0; h < num_heads; h++) {                                                     \
        float *s = scores + (int64_t)h * seq_len;                                             \
        if (soft_cap > 0.f) {                                                                 \
            /* cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^2x + 1): vectorizes, saturates. */   \
            const float two_over_cap = 2.f / soft_cap;                                        \
            _Pragma("omp simd")                                                               \
            for (int t = num_masked; t < seq_len; t++)                                        \
                s[t] = soft_cap * (1.f - 2.f / (exp_approx(s[t] * two_over_cap) + 1.f));      \
        }                                                                                     \
        float max = sinks ? sinks[h] : -INFINITY, sum = 0.f;                                  \
        _Pragma("omp simd reduction(max:max)")                                                \
        for (int t = num_masked; t < seq_len; t++) max = s[t] > max ? s[t] : max;             \
        _Pragma("omp simd reduction(+:sum)")                                                  \
        for (int t = num_masked; t < seq_len; t++) {                                          \
            s[t] = exp_approx(s[t] - max);                                                    \
            sum += s[t];                                                                      \
        }                                                                                     \
        if (sinks) sum += exp_approx(sinks[h] - max); /* a key without a value */             \
        const float inv = 1.f / sum;                                                          \
        for (int t = 0; t < num_masked; t++) s[t] = 0.f;                                      \
        for (int t = num_masked; t < seq_len; t++) s[t] *= inv;                               \
    }                                                                                         \
    if (PV_GROUP(acc, scores, seq_len, value_cache, blocks, block_stride, slot_stride,        \
                 block_size, num_heads, group, head_size)) {                                  \
    } else if (PV_FAST(head_size)) {                                                          \
        for (int h = 0; h < num_heads; h++)                                                   \
            PV(acc + h * head_size, scores + (int64_t)h * seq_len,                            \
               value_cache + (int64_t)(h / group) * head_size, blocks, block_stride,          \
               slot_stride, seq_len, block_size, head_size);                                  \
    } else {                                                                                  \
        for (int i = 0; i < num_heads * head_size; i++) acc[i] = 0.f;                         \
        for (int kh = 0; kh < num_heads / group; kh++) {                                      \
            const int64_t head_offset = (int64_t)kh * head_size;                              \
            const float *sk = scores + (int64_t)kh * group * seq_len;                         \
            float *ak = acc + (int64_t)kh * group * head_size;                                \
            for (int b = 0; b < num_blocks; b++) {                                            \
                const TC *v_block = value_cache + blocks[b] * block_stride + head_offset;     \
                const int n = seq_len - b * block_size < block_size                           \
                              ? seq_len - b * block_size : block_size;                        \
                for (int o = 0; o < n; o++) {                                                 \
                    const float *vr = WIDEN(row, v_block + o * slot_stride, head_size);       \
                    for (int g = 0; g < group; g++) {                                         \
                        const float p = sk[(int64_t)g * seq_len + b * block_size + o];        \
                        float *a = ak + g * head_size;                                        \
                        for (int d = 0; d < head_size; d++) a[d] += p * vr[d];                \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int h = 0; h < num_heads; h++)                                                       \
        for (int d = 0; d < head_size; d++)                                                   \
            STORE(out + h * head_size, d, acc[h * head_size + d] * v_scale);                  \
}

DEFINE_ATTEND_ONE(attend_one_f32, float, float, load_f32, store_f32, widen_f32, qk_chunk_f32,
                  pv_f32, PV_GROUP_f32)
DEFINE_ATTEND_ONE(attend_one_bf16, uint16_t, uint16_t, load_bf16, store_bf16, widen_bf16,
                  qk_chunk_bf16, pv_bf16, PV_GROUP_bf16)
DEFINE_ATTEND_ONE(attend_one_f32_e4m3, float, uint8_t, load_f32, store_f32, widen_e4m3,
                  qk_chunk_e4m3, pv_e4m3, PV_GROUP_fp8)
DEFINE_ATTEND_ONE(attend_one_f32_e5m2, float, uint8_t, load_f32, store_f32, widen_e5m2,
                  qk_chunk_e5m2, pv_e5m2, PV_GROUP_fp8)
DEFINE_ATTEND_ONE(attend_one_bf16_e4m3, uint16_t, uint8_t, load_bf16, store_bf16, widen_e4m3,
                  qk_chunk_e4m3, pv_e4m3, PV_GROUP_fp8)
DEFINE_ATTEND_ONE(attend_one_bf16_e5m2, uint16_t, uint8_t, load_bf16, store_bf16, widen_e5m2,
                  qk_chunk_e5m2, pv_e5m2, PV_GROUP_fp8)

// The entry point: requests in parallel; head sizes 64 and 128 get specialized bodies.
// (v_scale: the fp8 caches' value scale, 1 for float caches.)
#define DEFINE_DECODE_ATTENTION_SCALED(NAME, T, TC, ATTEND_ONE, UNIT)                         \
void NAME##_chunked_scaled(T *out, const T *query, int64_t q_token_stride,                    \
          int64_t q_head_stride, const TC *key_cache, const TC *value_cache,                 \
          int64_t block_stride, int64_t slot_stride, const int32_t *block_table,             \
          int64_t table_stride, const int32_t *seq_lens, const int64_t *token_rows,          \
          int num_reqs, int num_heads, int num_kv_heads, int head_size, int block_size,      \
          float scale, int sliding_window, float soft_cap, int chunk_size,                   \
          const float *sinks, float v_scale) {                                               \
    /* The cache format's widening gives values / UNIT (fp8_kv.h): scale them back. */       \
    scale *= UNIT;                                                                           \
    v_scale *= UNIT;                                                                         \
    const int group = num_heads / num_kv_heads;                                              \
    _Pragma("omp parallel")                                                                  \
    {                                                                                        \
        int capacity = 0;                                                                    \
        float *scores = NULL;                                                                \
        float *q = (float *)malloc(sizeof(float) * (size_t)num_heads * head_size);           \
        float *acc = (float *)malloc(sizeof(float) * (size_t)num_heads * head_size);         \
        const int alone = omp_get_num_threads() == 1;                                        \
        _Pragma("omp for schedule(dynamic, REQUEST_CHUNK)")                                  \
        for (int r = 0; r < num_reqs; r++) {                                                 \
            /* A window that starts mid-block: attend from that block on, mask its head. */  \
            int window_start = sliding_window > 0 && seq_lens[r] > sliding_window            \
                               ? seq_lens[r] - sliding_window : 0;                           \
            /* Chunked local attention: the query's own chunk starts the same way. */         \
            if (chunk_size > 0 && seq_lens[r] > 0) {                                         \
                const int chunk_start = (seq_lens[r] - 1) / chunk_size * chunk_size;          \
                if (chunk_start > window_start) window_start = chunk_start;                  \
            }                                                                                \
            const int first_block = window_start / block_size;                               \
            const int num_masked = window_start - first_block * block_size;                  \
            const int seq_len = seq_lens[r] - first_block * block_size;                      \
            if (seq_len > capacity) {                                                        \
                free(scores);                                                                \
                capacity = seq_len + 1024;                                                   \
                scores = (float *)malloc(sizeof(float) * (size_t)capacity * num_heads);      \
            }                                                                                \
            const int64_t token = token_rows[r];                                             \
            T *o = out + token * num_heads * (int64_t)head_size;                             \
            const T *qr = query + token * q_token_stride;                                    \
            const int32_t *blocks = block_table + (int64_t)r * table_stride + first_block;   \
            /* r + 1 is this thread's next request unless r ends a chunk of the schedule   \
               (then another thread's: not brought in). Not with a window or chunked        \
               attention (most of its blocks go unread), nor                                \
               when it starts at this one's first block: the next token of the same prefill \
               chunk, or a shared prefix, already in cache (the prefetches would only cost). */ \
            next_request next = {(const char *)key_cache, (const char *)value_cache, NULL,   \
                                 (int64_t)block_size * slot_stride * (int64_t)sizeof(TC),    \
                                 block_stride * (int64_t)sizeof(TC), 0, 0, 0};               \
            if (r + 1 < num_reqs && sliding_window <= 0 && chunk_size <= 0 &&                \
                block_table[(int64_t)(r + 1) * table_stride] != blocks[0] &&                 \
                (alone || (r + 1) % REQUEST_CHUNK != 0)) {                                   \
                next.blocks = block_table + (int64_t)(r + 1) * table_stride;                 \
                next.num_blocks = (seq_lens[r + 1] + block_size - 1) / block_size;           \
            }                                                                                \
            if (head_size == 64)                                                             \
                ATTEND_ONE(o, qr, q_head_stride, key_cache, value_cache, block_stride,       \
                           slot_stride, blocks, seq_len, num_masked, num_heads, group,       \
                           64, block_size, scale, soft_cap, sinks, q, scores,                \
                           acc, v_scale, next.blocks ? &next : NULL);                        \
            else if (head_size == 128)                                                       \
                ATTEND_ONE(o, qr, q_head_stride, key_cache, value_cache, block_stride,       \
                           slot_stride, blocks, seq_len, num_masked, num_heads, group,       \
                           128, block_size, scale, soft_cap, sinks, q, scores,               \
                           acc, v_scale, next.blocks ? &next : NULL);                        \
            else                                                                             \
                ATTEND_ONE(o, qr, q_head_stride, key_cache, value_cache, block_stride,       \
                           slot_stride, blocks, seq_len, num_masked, num_heads, group,       \
                           head_size, block_size, scale, soft_cap, sinks, q, scores,         \
                           acc, v_scale, next.blocks ? &next : NULL);                        \
        }                                                                                    \
        free(scores);                                                                        \
        free(q);                                                                             \
        free(acc);                                                                           \
    }                                                                                        \
}

#define DEFINE_DECODE_ATTENTION(NAME, T, ATTEND_ONE)                                          \
DEFINE_DECODE_ATTENTION_SCALED(NAME, T, T, ATTEND_ONE, 1.f)                                  \
void NAME##_chunked(T *out, const T *query, int64_t q_token_stride, int64_t q_head_stride,    \
          const T *key_cache, const T *value_cache, int64_t block_stride,                    \
          int64_t slot_stride, const int32_t *block_table, int64_t table_stride,             \
          const int32_t *seq_lens, const int64_t *token_rows, int num_reqs, int num_heads,   \
          int num_kv_heads, int head_size, int block_size, float scale, int sliding_window,  \
          float soft_cap, int chunk_size, const float *sinks) {                              \
    NAME##_chunked_scaled(out, query, q_token_stride, q_head_stride, key_cache, value_cache, \
                          block_stride, slot_stride, block_table, table_stride, seq_lens,    \
                          token_rows, num_reqs, num_heads, num_kv_heads, head_size,          \
                          block_size, scale, sliding_window, soft_cap, chunk_size, sinks,    \
                          1.f);                                                              \
}                                                                                            \
void NAME(T *out, const T *query, int64_t q_token_stride, int64_t q_head_stride,              \
          const T *key_cache, const T *value_cache, int64_t block_stride,                    \
          int64_t slot_stride, const int32_t *block_table, int64_t table_stride,             \
          const int32_t *seq_lens, const int64_t *token_rows, int num_reqs, int num_heads,   \
          int num_kv_heads, int head_size, int block_size, float scale, int sliding_window,  \
          float soft_cap, const float *sinks) {                                              \
    NAME##_chunked(out, query, q_token_stride, q_head_stride, key_cache, value_cache,        \
                   block_stride, slot_stride, block_table, table_stride, seq_lens,           \
                   token_rows, num_reqs, num_heads, num_kv_heads, head_size, block_size,     \
                   scale, sliding_window, soft_cap, 0, sinks);                               \
}

DEFINE_DECODE_ATTENTION(decode_attention_f32, float, attend_one_f32)
DEFINE_DECODE_ATTENTION(decode_attention_bf16, uint16_t, attend_one_bf16)
DEFINE_DECODE_ATTENTION_SCALED(decode_attention_f32_e4m3, float, uint8_t, attend_one_f32_e4m3,
                               FP8_E4M3_UNIT)
DEFINE_DECODE_ATTENTION_SCALED(decode_attention_f32_e5m2, float, uint8_t, attend_one_f32_e5m2,
                               FP8_E5M2_UNIT)
DEFINE_DECODE_ATTENTION_SCALED(decode_attention_bf16_e4m3, uint16_t, uint8_t,
                               attend_one_bf16_e4m3, FP8_E4M3_UNIT)
DEFINE_DECODE_ATTENTION_SCALED(decode_attention_bf16_e5m2, uint16_t, uint8_t,
                               attend_one_bf16_e5m2, FP8_E5M2_UNIT)
