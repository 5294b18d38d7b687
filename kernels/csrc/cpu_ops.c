// Row-wise CPU kernels of the decoder layer: RMSNorm (with the fused residual add), SiLU-and-
// mul and the neox rotary embedding, in float32 and bfloat16, and the paged KV write.
//
// Each op is one pass over its rows: the torch references spend most of their time in dtype
// casts and in one OpenMP fork/join per elementwise op, which on two cores costs more than the
// arithmetic. Numerics follow the references (kernels/norm.py, activation.py, rotary.py):
// math in float32, every value the reference rounds to the activation dtype rounded here too.
//
// Built with decode_attention.c by kernels/cpu.py (`cc -O3 -march=native -fopenmp`).
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

// Ops over fewer than 16384 elements in all run on one thread (the `if` clauses below): a
// fork/join costs more than the work.
static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float load_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void store_f32(float *p, int64_t i, float v) { p[i] = v; }
static inline void store_bf16(uint16_t *p, int64_t i, float v) { p[i] = f32_to_bf16_rne(v); }
// The value a store then a load would give: what the reference reads back after rounding.
static inline float round_f32(float v) { return v; }
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16_rne(v)); }

#if defined(VEC_MATH_AVX512)
// AVX-512: 16 lanes at a time with masked row tails; the same math and rounding as the
// portable loops below, which GCC vectorizes only in part (bf16 conversions on 256-bit
// vectors; the SiLU-and-mul in bfloat16 ran at 2.5x the float32 time).
static inline __m512 vm_round16_f32(__m512 v) { return v; }

// out[t] = rms_norm(s) * weight, s = x[t] (+ residual[t], rounded, stored to residual_out[t]).
// residual may be NULL (plain RMSNorm; residual_out unused). weight is float32 [H].
#define DEFINE_RMS_NORM(NAME, T, LOAD16, STORE16, ROUND16)                                    \
void NAME(T *out, const T *x, int64_t x_stride, const T *residual, int64_t residual_stride,    \
          T *residual_out, const float *weight, int num_tokens, int hidden_size, float eps) { \
    _Pragma("omp parallel for schedule(static) if(num_tokens * hidden_size >= 16384)")       \
    for (int t = 0; t < num_tokens; t++) {                                                    \
        float row[hidden_size];                                                               \
        const T *xt = x + (int64_t)t * x_stride;                                              \
        __m512 sum_sq = _mm512_setzero_ps();                                                  \
        for (int i = 0; i < hidden_size; i += 16) {                                           \
            const __mmask16 m = tail16(i, hidden_size);                                       \
            __m512 s = LOAD16(xt + i, m);                                                     \
            if (residual != NULL) {                                                           \
                const T *rt = residual + (int64_t)t * residual_stride;                        \
                s = ROUND16(_mm512_add_ps(s, LOAD16(rt + i, m)));                             \
                STORE16(residual_out + (int64_t)t * hidden_size + i, s, m);                   \
            }                                                                                 \
            vm_store16_f32(row + i, s, m);                                                       \
            sum_sq = _mm512_fmadd_ps(s, s, sum_sq);                                           \
        }                                                                                     \
        const __m512 inv_rms =                                                                \
            _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(sum_sq) / hidden_size + eps));   \
        T *ot = out + (int64_t)t * hidden_size;                                               \
        for (int i = 0; i < hidden_size; i += 16) {                                           \
            const __mmask16 m = tail16(i, hidden_size);                                       \
            const __m512 y = _mm512_mul_ps(vm_load16_f32(row + i, m), inv_rms);                  \
            STORE16(ot + i, _mm512_mul_ps(y, vm_load16_f32(weight + i, m)), m);                  \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_RMS_NORM(rms_norm_f32, float, vm_load16_f32, vm_store16_f32, vm_round16_f32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, vm_load16_bf16, vm_store16_bf16, vm_round16_bf16)

// out[t] = silu(gate) * up with x[t] = [gate | up]; silu is rounded before the product, as
// the reference's `F.silu(gate).mul_(up)` does in the activation dtype.
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD16, STORE16, ROUND16)                                \
void NAME(T *out, const T *x, int64_t x_stride, int num_tokens, int intermediate_size) {      \
    _Pragma("omp parallel for schedule(static) if(num_tokens * intermediate_size >= 16384)") \
    for (int t = 0; t < num_tokens; t++) {                                                    \
        const T *gate = x + (int64_t)t * x_stride;                                            \
        const T *up = gate + intermediate_size;                                               \
        T *ot = out + (int64_t)t * intermediate_size;                                         \
        const __m512 one = _mm512_set1_ps(1.f);                                               \
        for (int i = 0; i < intermediate_size; i += 16) {                                     \
            const __mmask16 m = tail16(i, intermediate_size);                                 \
            const __m512 g = LOAD16(gate + i, m);                                             \
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));                    \
            const __m512 silu = ROUND16(_mm512_div_ps(g, _mm512_add_ps(one, e)));              \
            STORE16(ot + i, _mm512_mul_ps(silu, LOAD16(up + i, m)), m);                       \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, vm_load16_f32, vm_store16_f32, vm_round16_f32)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, vm_load16_bf16, vm_store16_bf16, vm_round16_bf16)

#else  // the portable loops

// out[t] = rms_norm(s) * weight, s = x[t] (+ residual[t], rounded, stored to residual_out[t]).
// residual may be NULL (plain RMSNorm; residual_out unused). weight is float32 [H].
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                          \
void NAME(T *out, const T *x, int64_t x_stride, const T *residual, int64_t residual_stride,    \
          T *residual_out, const float *weight, int num_tokens, int hidden_size, float eps) { \
    _Pragma("omp parallel for schedule(static) if(num_tokens * hidden_size >= 16384)")       \
    for (int t = 0; t < num_tokens; t++) {                                                    \
        float row[hidden_size];                                                               \
        const T *xt = x + (int64_t)t * x_stride;                                              \
        float sum_sq = 0.f;                                                                   \
        if (residual != NULL) {                                                               \
            const T *rt = residual + (int64_t)t * residual_stride;                            \
            T *ro = residual_out + (int64_t)t * hidden_size;                                  \
            for (int i = 0; i < hidden_size; i++) {                                           \
                float s = ROUND(LOAD(xt, i) + LOAD(rt, i));                                   \
                STORE(ro, i, s);                                                              \
                row[i] = s;                                                                   \
            }                                                                                 \
        } else {                                                                              \
            for (int i = 0; i < hidden_size; i++) row[i] = LOAD(xt, i);                       \
        }                                                                                     \
        _Pragma("omp simd reduction(+:sum_sq)")                                               \
        for (int i = 0; i < hidden_size; i++) sum_sq += row[i] * row[i];                      \
        const float inv_rms = 1.f / sqrtf(sum_sq / hidden_size + eps);                        \
        T *ot = out + (int64_t)t * hidden_size;                                               \
        for (int i = 0; i < hidden_size; i++) STORE(ot, i, row[i] * inv_rms * weight[i]);     \
    }                                                                                         \
}

DEFINE_RMS_NORM(rms_norm_f32, float, load_f32, store_f32, round_f32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, load_bf16, store_bf16, round_bf16)

// out[t] = silu(gate) * up with x[t] = [gate | up]; silu is rounded before the product, as
// the reference's `F.silu(gate).mul_(up)` does in the activation dtype.
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                      \
void NAME(T *out, const T *x, int64_t x_stride, int num_tokens, int intermediate_size) {      \
    _Pragma("omp parallel for schedule(static) if(num_tokens * intermediate_size >= 16384)") \
    for (int t = 0; t < num_tokens; t++) {                                                    \
        const T *gate = x + (int64_t)t * x_stride;                                            \
        const T *up = gate + intermediate_size;                                               \
        T *ot = out + (int64_t)t * intermediate_size;                                         \
        _Pragma("omp simd")                                                                   \
        for (int i = 0; i < intermediate_size; i++) {                                         \
            const float g = LOAD(gate, i);                                                    \
            const float silu = ROUND(g / (1.f + exp_approx(-g)));                             \
            STORE(ot, i, silu * LOAD(up, i));                                                 \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, load_f32, store_f32, round_f32)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, load_bf16, store_bf16, round_bf16)

#endif  // VEC_MATH_AVX512

#if defined(VEC_MATH_AVX512)
// Neox (rotate-half) RoPE of one [num_heads, D] row: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin,
// 16 lanes of each half at a time (AVX-512; the portable loop below otherwise).
#define DEFINE_ROPE_ROW(NAME, T, LOAD16, STORE16)                                             \
static inline void NAME(T *dst, const T *src, const float *cos, const float *sin,             \
                        int num_heads, int head_size) {                                       \
    const int half = head_size / 2;                                                           \
    for (int h = 0; h < num_heads; h++) {                                                     \
        const T *xh = src + (int64_t)h * head_size;                                           \
        T *yh = dst + (int64_t)h * head_size;                                                 \
        for (int i = 0; i < half; i += 16) {                                                  \
            const __mmask16 m = tail16(i, half);                                              \
            const __m512 x1 = LOAD16(xh + i, m), x2 = LOAD16(xh + i + half, m);               \
            const __m512 c = vm_load16_f32(cos + i, m), s = vm_load16_f32(sin + i, m);        \
            STORE16(yh + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)), m);    \
            STORE16(yh + i + half, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)), m); \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_ROPE_ROW(rope_row_f32, float, vm_load16_f32, vm_store16_f32)
DEFINE_ROPE_ROW(rope_row_bf16, uint16_t, vm_load16_bf16, vm_store16_bf16)

#else
// Neox (rotate-half) RoPE of one [num_heads, D] row: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin.
#define DEFINE_ROPE_ROW(NAME, T, LOAD, STORE)                                                 \
static inline void NAME(T *dst, const T *src, const float *cos, const float *sin,             \
                        int num_heads, int head_size) {                                       \
    const int half = head_size / 2;                                                           \
    for (int h = 0; h < num_heads; h++) {                                                     \
        const T *xh = src + (int64_t)h * head_size;                                           \
        T *yh = dst + (int64_t)h * head_size;                                                 \
        _Pragma("omp simd")                                                                   \
        for (int i = 0; i < half; i++) {                                                      \
            const float x1 = LOAD(xh, i), x2 = LOAD(xh, i + half);                            \
            STORE(yh, i, x1 * cos[i] - x2 * sin[i]);                                          \
            STORE(yh, i + half, x2 * cos[i] + x1 * sin[i]);                                   \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_ROPE_ROW(rope_row_f32, float, load_f32, store_f32)
DEFINE_ROPE_ROW(rope_row_bf16, uint16_t, load_bf16, store_bf16)
#endif  // VEC_MATH_AVX512

// q_out [T, Hq * D] and k_out [T, Hkv * D] (contiguous) = RoPE of query / key rows (strided)
// at positions[t]; cos_sin_cache [max_position, D] float32: cos | sin halves.
#define DEFINE_ROTARY(NAME, T, ROPE_ROW)                                                      \
void NAME(T *q_out, T *k_out, const T *query, int64_t q_stride, const T *key,                 \
          int64_t k_stride, const int64_t *positions, const float *cos_sin_cache,             \
          int num_tokens, int num_heads, int num_kv_heads, int head_size) {                   \
    _Pragma("omp parallel for if(num_tokens * (num_heads + num_kv_heads) * head_size >= 16384)") \
    for (int t = 0; t < num_tokens; t++) {                                                    \
        const float *cos = cos_sin_cache + positions[t] * head_size;                          \
        const float *sin = cos + head_size / 2;                                               \
        ROPE_ROW(q_out + (int64_t)t * num_heads * head_size, query + (int64_t)t * q_stride,   \
                 cos, sin, num_heads, head_size);                                             \
        ROPE_ROW(k_out + (int64_t)t * num_kv_heads * head_size, key + (int64_t)t * k_stride,  \
                 cos, sin, num_kv_heads, head_size);                                          \
    }                                                                                         \
}

DEFINE_ROTARY(rotary_embedding_f32, float, rope_row_f32)
DEFINE_ROTARY(rotary_embedding_bf16, uint16_t, rope_row_bf16)

// RoPE and the paged KV write in one pass: q_out [T, Hq * D] (contiguous) = RoPE of the query
// rows; RoPE of token t's key row goes straight to row slots[t] of key_cache, its value row
// to the same row of value_cache (caches of [slot, Hkv * D] rows, contiguous). A slot < 0
// writes nothing of that token's K/V (its query still rotates). The rows rotate as in
// rotary_embedding_*, bit for bit; the rotated keys never exist outside the cache.
#define DEFINE_ROTARY_KV(NAME, T, ROPE_ROW)                                                   \
void NAME(T *q_out, const T *query, int64_t q_stride, const T *key, int64_t k_stride,         \
          const T *value, int64_t v_stride, const int64_t *positions,                         \
          const float *cos_sin_cache, T *key_cache, T *value_cache, const int64_t *slots,     \
          int num_tokens, int num_heads, int num_kv_heads, int head_size) {                   \
    const int64_t kv_row = (int64_t)num_kv_heads * head_size;                                 \
    _Pragma("omp parallel for if(num_tokens * (num_heads + num_kv_heads) * head_size >= 16384)") \
    for (int t = 0; t < num_tokens; t++) {                                                    \
        const float *cos = cos_sin_cache + positions[t] * head_size;                          \
        const float *sin = cos + head_size / 2;                                               \
        ROPE_ROW(q_out + (int64_t)t * num_heads * head_size, query + (int64_t)t * q_stride,   \
                 cos, sin, num_heads, head_size);                                             \
        const int64_t slot = slots[t];                                                        \
        if (slot < 0) continue;                                                               \
        ROPE_ROW(key_cache + slot * kv_row, key + (int64_t)t * k_stride, cos, sin,            \
                 num_kv_heads, head_size);                                                    \
        memcpy(value_cache + slot * kv_row, value + (int64_t)t * v_stride, kv_row * sizeof(T)); \
    }                                                                                         \
}

DEFINE_ROTARY_KV(rotary_write_kv_cache_f32, float, rope_row_f32)
DEFINE_ROTARY_KV(rotary_write_kv_cache_bf16, uint16_t, rope_row_bf16)

// The paged KV write: token t's key row (row_bytes, at key + t * key_stride bytes) to slot
// slots[t] of key_cache (rows of row_bytes, contiguous), the same for value; a slot < 0 is
// skipped. Any dtype: rows are copied as bytes.
void write_kv_cache_rows(uint8_t *key_cache, uint8_t *value_cache, const uint8_t *key,
                         int64_t key_stride, const uint8_t *value, int64_t value_stride,
                         const int64_t *slots, int num_tokens, int64_t row_bytes) {
    _Pragma("omp parallel for schedule(static) if((int64_t)num_tokens * row_bytes >= 262144)")
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(key_cache + slot * row_bytes, key + (int64_t)t * key_stride, row_bytes);
        memcpy(value_cache + slot * row_bytes, value + (int64_t)t * value_stride, row_bytes);
    }
}

// Each row's argmax as torch.argmax gives it: the first of equal maxima, and the first NaN
// where a row holds one (NaN counts as the largest). out[r] for row r of x (row stride
// `stride` elements, `cols` wide). The greedy sampler's pick: torch's CPU argmax ran at
// ~1.3 G elements/s (f32) and half that on bfloat16.
static inline float argmax_load(const float *row, int c) { return row[c]; }
static inline float argmax_load_bf16(const uint16_t *row, int c) { return bf16_to_f32(row[c]); }

#if defined(VEC_MATH_AVX512)
#define ARGMAX_BODY(LOAD16)                                                                   \
    {                                                                                         \
        const __m512 ninf = _mm512_set1_ps(-INFINITY);                                        \
        __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
        __m512 best = ninf;                                                                   \
        __m512i best_index = lane;                                                            \
        int64_t found = -1;                                                                   \
        for (int c = 0; c < cols && found < 0; c += 16) {                                     \
            const __mmask16 m = tail16(c, cols);                                              \
            const __m512 v = _mm512_mask_mov_ps(ninf, m, LOAD16(row + c, m));                 \
            const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);             \
            if (nan) {                                                                        \
                found = c + __builtin_ctz(nan);                                               \
                break;                                                                        \
            }                                                                                 \
            /* Strictly greater: each lane keeps its first maximum. The first chunk always */ \
            /* lands (a lane's first value, -inf included, is its maximum so far). */        \
            const __mmask16 gt = c == 0 ? m : _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);        \
            best = _mm512_mask_mov_ps(best, gt, v);                                           \
            best_index = _mm512_mask_mov_epi32(best_index, gt, lane);                         \
            lane = _mm512_add_epi32(lane, _mm512_set1_epi32(16));                             \
        }                                                                                     \
        if (found < 0) {                                                                      \
            const float top = _mm512_reduce_max_ps(best);                                     \
            const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ); \
            found = _mm512_mask_reduce_min_epi32(at_top, best_index);                         \
        }                                                                                     \
        out[r] = found;                                                                       \
    }
#define ARGMAX_ROW_F32 ARGMAX_BODY(vm_load16_f32)
#define ARGMAX_ROW_BF16 ARGMAX_BODY(vm_load16_bf16)
#else
#define ARGMAX_SCALAR(LOAD)                                                                   \
    {                                                                                         \
        int64_t found = 0;                                                                    \
        float top = LOAD(row, 0);                                                             \
        for (int c = 0; c < cols && top == top; c++) {                                        \
            const float v = LOAD(row, c);                                                     \
            if (v != v || v > top) top = v, found = c;                                        \
        }                                                                                     \
        out[r] = found;                                                                       \
    }
#define ARGMAX_ROW_F32 ARGMAX_SCALAR(argmax_load)
#define ARGMAX_ROW_BF16 ARGMAX_SCALAR(argmax_load_bf16)
#endif

#define DEFINE_ARGMAX(NAME, T, ROW_BODY)                                                      \
void NAME(int64_t *out, const T *x, int64_t stride, int rows, int cols) {                     \
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * cols >= 65536)")           \
    for (int r = 0; r < rows; r++) {                                                          \
        const T *row = x + (int64_t)r * stride;                                               \
        ROW_BODY                                                                              \
    }                                                                                         \
}

DEFINE_ARGMAX(argmax_rows_f32, float, ARGMAX_ROW_F32)
DEFINE_ARGMAX(argmax_rows_bf16, uint16_t, ARGMAX_ROW_BF16)

// Pins OpenMP thread t of an n-thread team to cpus[t] (the calling thread is thread 0), as
// vLLM's CPU worker does: a pinned team keeps its caches and is not migrated by the
// scheduler. The OpenMP runtime is torch's (one libgomp per process), so torch's own
// parallel regions run on the same pinned threads. ok[t] is 1 where the pin held.
void bind_omp_threads(const int *cpus, int n, int *ok) {
    _Pragma("omp parallel num_threads(n)")
    {
        int t = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[t], &set);
        ok[t] = sched_setaffinity(0, sizeof(set), &set) == 0;
    }
}
