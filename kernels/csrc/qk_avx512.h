// AVX-512 pieces of the decode attention.
// - Query-key scores 16 tokens at a time: one 16-lane partial dot product per token, then a
//   transposing reduction that adds all 16 at once (45 shuffles and adds instead of 16
//   horizontal reductions of ~8 each). bfloat16 keys are multiplied as they are stored, with
//   AVX512-BF16's pairwise dot product (no widening to float32).
// - The probability-weighted sum of values keeps its [D] accumulator in registers over all
//   of a request's tokens.
// Without AVX-512 (QK_AVX512 undefined) the caller's portable loops run instead.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

#define QK_AVX512 1

// r[i] = sum of the 16 lanes of v[i].
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // per 128-bit lane: [a, b, c, d], each a lane's sum
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // Add the four 128-bit lanes: [L0+L1, L2+L3] of two vectors, then once more.
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                    _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// scores[o] = scale * q . k[o * slot_stride], o < num_tokens <= 16; head_size % 16 == 0.
static inline void qk16_f32(float *scores, const float *q, const float *k, int64_t slot_stride,
                            int num_tokens, int head_size, float scale) {
    __m512 acc[16];
    for (int o = 0; o < 16; o++) {
        acc[o] = _mm512_setzero_ps();
        if (o >= num_tokens) continue;
        const float *ko = k + o * slot_stride;
        for (int d = 0; d < head_size; d += 16)
            acc[o] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(ko + d), acc[o]);
    }
    const __m512 r = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores, (__mmask16)((1u << num_tokens) - 1), r);
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// out[d] = sum_t p[t] * v_t[d] over one request's blocks for one head, the [D] accumulator in
// registers (head_size % 16 == 0, head_size <= 256). v_t = value_head + block * block_stride +
// offset * slot_stride, for t = block_index * block_size + offset.
#define DEFINE_PV(NAME, T, LOAD16)                                                            \
static inline __attribute__((always_inline)) void NAME(                                       \
        float *out, const float *p, const T *value_head, const int32_t *blocks,               \
        int64_t block_stride, int64_t slot_stride, int seq_len, int block_size,               \
        const int head_size) {                                                                \
    __m512 acc[16];                                                                           \
    const int num_chunks = head_size / 16;                                                    \
    for (int c = 0; c < num_chunks; c++) acc[c] = _mm512_setzero_ps();                        \
    for (int start = 0, b = 0; start < seq_len; start += block_size, b++) {                   \
        const T *v = value_head + blocks[b] * block_stride;                                   \
        const int n = seq_len - start < block_size ? seq_len - start : block_size;            \
        for (int o = 0; o < n; o++, v += slot_stride) {                                       \
            const __m512 weight = _mm512_set1_ps(p[start + o]);                               \
            for (int c = 0; c < num_chunks; c++)                                              \
                acc[c] = _mm512_fmadd_ps(weight, LOAD16(v + 16 * c), acc[c]);                 \
        }                                                                                     \
    }                                                                                         \
    for (int c = 0; c < num_chunks; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);              \
}

DEFINE_PV(pv_f32, float, load16_f32)
DEFINE_PV(pv_bf16, uint16_t, load16_bf16)

#if defined(__AVX512BF16__)
#define QK_AVX512_BF16 1

// The same for bfloat16 q and k (head_size % 32 == 0); products and sums in float32.
static inline void qk16_bf16(float *scores, const uint16_t *q, const uint16_t *k,
                             int64_t slot_stride, int num_tokens, int head_size, float scale) {
    __m512 acc[16];
    for (int o = 0; o < 16; o++) {
        acc[o] = _mm512_setzero_ps();
        if (o >= num_tokens) continue;
        const uint16_t *ko = k + o * slot_stride;
        for (int d = 0; d < head_size; d += 32)
            acc[o] = _mm512_dpbf16_ps(acc[o], (__m512bh)_mm512_loadu_si512(q + d),
                                      (__m512bh)_mm512_loadu_si512(ko + d));
    }
    const __m512 r = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores, (__mmask16)((1u << num_tokens) - 1), r);
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__
