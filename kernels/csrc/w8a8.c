// W8A8 int8 (compressed-tensors' dynamic per-token scheme, kernels/w8a8.py): the two memory
// passes around the integer GEMM, which torch's oneDNN matmul (AMX-INT8 / VNNI) computes.
//
//   kvw8_quantize_rows   x [M, K] (float32 or bfloat16) -> int8 q [M, K] and one scale per
//                        row: s = max|x_row| / 127, q = round(x / s) (ties to even, as
//                        vLLM's dynamic_scaled_int8_quant), clamped to [-127, 127]
//   kvw8_scale_rows      y [M, N] = acc [M, N] (int32) * sx[m] * sw[n] (+ bias[n]), written
//                        as float32 or bfloat16 (round to nearest even)
//
// OpenMP over rows; the inner loops are plain C that -O3 -march=native vectorizes.
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void kvw8_quantize_rows(const void *x, int is_bf16, int64_t ldx, int m, int k, int8_t *q,
                        float *scales) {
#pragma omp parallel for schedule(static) if (m > 16)
    for (int i = 0; i < m; i++) {
        const float *f32 = (const float *)x + (int64_t)i * ldx;
        const uint16_t *b16 = (const uint16_t *)x + (int64_t)i * ldx;
        int8_t *dst = q + (int64_t)i * k;
        int j = 0;
#ifdef __AVX512F__
        __m512 vmax = _mm512_setzero_ps();
        for (; j + 16 <= k; j += 16) {
            __m512 v = is_bf16 ? load_bf16(b16 + j) : _mm512_loadu_ps(f32 + j);
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        }
        float amax = _mm512_reduce_max_ps(vmax);
#else
        float amax = 0.0f;
#endif
        for (int t = j; t < k; t++) amax = fmaxf(amax, fabsf(is_bf16 ? bf16_to_f32(b16[t]) : f32[t]));
        float s = amax / 127.0f;
        float inv = s > 0.0f ? 127.0f / amax : 0.0f;
        j = 0;
#ifdef __AVX512F__
        __m512 vinv = _mm512_set1_ps(inv);
        for (; j + 16 <= k; j += 16) {
            __m512 v = is_bf16 ? load_bf16(b16 + j) : _mm512_loadu_ps(f32 + j);
            // round to nearest even, then saturate: |v * inv| <= 127 up to rounding
            __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));
            _mm_storeu_si128((__m128i *)(dst + j), _mm512_cvtsepi32_epi8(r));
        }
#endif
        for (; j < k; j++) {
            float v = nearbyintf((is_bf16 ? bf16_to_f32(b16[j]) : f32[j]) * inv);
            dst[j] = (int8_t)fminf(fmaxf(v, -127.0f), 127.0f);
        }
        scales[i] = s;
    }
}

void kvw8_scale_rows(const int32_t *acc, int m, int n, const float *sx, const float *sw,
                     const float *bias, void *out, int out_bf16, int64_t ldo) {
#pragma omp parallel for schedule(static) if (m > 16)
    for (int i = 0; i < m; i++) {
        const int32_t *a = acc + (int64_t)i * n;
        float s = sx[i];
        if (out_bf16) {
            uint16_t *y = (uint16_t *)out + (int64_t)i * ldo;
            for (int j = 0; j < n; j++) {
                float v = (float)a[j] * s * sw[j] + (bias ? bias[j] : 0.0f);
                y[j] = f32_to_bf16(v);
            }
        } else {
            float *y = (float *)out + (int64_t)i * ldo;
            for (int j = 0; j < n; j++) y[j] = (float)a[j] * s * sw[j] + (bias ? bias[j] : 0.0f);
        }
    }
}
