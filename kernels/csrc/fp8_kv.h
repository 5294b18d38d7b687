// fp8 KV-cache rows (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) widened to float32 for the decode
// attention (decode_attention.c). The cache holds K / k_scale and V / v_scale as bytes; the
// kernel folds k_scale into the softmax scale and v_scale into the output, so these return
// the stored value itself, exactly (every fp8 value is a float16 and a float32), e4m3's
// divided by FP8_E4M3_UNIT = 2^8 (exact too): the entry point multiplies both scales by it.
//
//   e4m3fn: s eeee mmm, bias 7, subnormals m * 2^-9, no infinities (0x7f / 0xff are NaN;
//           the write path clamps to +-448, so a NaN is only ever one the model produced).
//   e5m2:   s eeeee mm, bias 15: the high byte of a float16.
//
// With AVX-512 (F16C's vcvtph2ps), 16 bytes become 16 floats through float16 bits: e5m2 is
// the byte shifted up 8; e4m3's exponent and mantissa sit 7 bits up in a float16 (whose bias
// is 8 more: that float16 is the value / 2^8, the unit above), its sign at bit 15. e4m3 subnormals land on
// float16 subnormals, so nothing passes through a float32 denormal (no DAZ/FTZ surprises).
#pragma once

#include <math.h>
#include <stdint.h>

#define FP8_E4M3_UNIT 256.f
#define FP8_E5M2_UNIT 1.f

// The value / FP8_E4M3_UNIT, as load16_e4m3 gives it.
static inline float fp8_e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    const float magnitude = e ? ldexpf(1.f + 0.125f * m, e - 15) : 0x1p-17f * m;
    return b & 0x80 ? -magnitude : magnitude;
}

static inline float fp8_e5m2_to_f32(uint8_t b) {
    const int e = (b >> 2) & 0x1F, m = b & 3;
    float magnitude;
    if (e == 31)
        magnitude = m ? NAN : INFINITY;
    else
        magnitude = e ? ldexpf(1.f + 0.25f * m, e - 15) : ldexpf((float)m, -16);
    return b & 0x80 ? -magnitude : magnitude;
}

static inline const float *widen_e4m3(float *buf, const uint8_t *src, int n) {
    for (int d = 0; d < n; d++) buf[d] = fp8_e4m3_to_f32(src[d]);
    return buf;
}

static inline const float *widen_e5m2(float *buf, const uint8_t *src, int n) {
    for (int d = 0; d < n; d++) buf[d] = fp8_e5m2_to_f32(src[d]);
    return buf;
}

#if defined(__AVX512F__)
#include <immintrin.h>

#include "qk_avx512.h"

static inline __m512 load16_e4m3(const uint8_t *p) {
    // Sign-extended to 16 bits and shifted up 7: the sign lands on bit 15 and on bit 14,
    // the float16 exponent's top bit, which the mask clears (an e4m3 exponent is 4 bits).
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(-16512));
    return _mm512_cvtph_ps(bits);  // -16512 = 0xbf80: every bit but 14 and the low 7
}

static inline __m512 load16_e5m2(const uint8_t *p) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_slli_epi16(x, 8));
}

// qk16_f32's loop over fp8 keys: scores[o] = q . k_o for o < num_tokens <= 16 (q already
// scaled); head_size % 16 == 0.
#define DEFINE_QK16_FP8(NAME, LOAD16)                                                         \
static inline void NAME(float *scores, const float *q, const uint8_t *k, int64_t slot_stride, \
                        int num_tokens, int head_size) {                                      \
    __m512 acc[16];                                                                           \
    for (int o = 0; o < 16; o++) {                                                            \
        acc[o] = _mm512_setzero_ps();                                                         \
        if (o >= num_tokens) continue;                                                        \
        const uint8_t *ko = k + o * slot_stride;                                              \
        for (int d = 0; d < head_size; d += 16)                                               \
            acc[o] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), LOAD16(ko + d), acc[o]);         \
    }                                                                                         \
    _mm512_mask_storeu_ps(scores, (__mmask16)((1u << num_tokens) - 1), hsum16(acc));          \
}

DEFINE_QK16_FP8(qk16_e4m3, load16_e4m3)
DEFINE_QK16_FP8(qk16_e5m2, load16_e5m2)
DEFINE_PV(pv_e4m3, uint8_t, load16_e4m3)
DEFINE_PV(pv_e5m2, uint8_t, load16_e5m2)
#endif
