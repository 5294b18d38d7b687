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

#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1  // into L2: L1's few fill buffers would stall a burst
#endif
// Bring a block's rows toward the cache before they are read: the block table scatters a
// request's blocks over the cache, which the hardware prefetchers do not follow.
static inline void prefetch_rows(const void *first, int rows, int64_t stride_bytes,
                                 int64_t row_bytes) {
    const char *p = (const char *)first;
    for (int r = 0; r < rows; r++, p += stride_bytes)
        for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, PREFETCH_HINT);
}

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
        if (start + block_size < seq_len)                                                     \
            prefetch_rows(value_head + blocks[b + 1] * block_stride, block_size,              \
                          slot_stride * (int64_t)sizeof(T), head_size * (int)sizeof(T));      \
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

// The probability-weighted sum of values for the `group` heads that share one KV head, two
// tokens per AVX512-BF16 pairwise product: each V row pair is loaded once for all the group's
// heads and interleaved into (v_t[d], v_t+1[d]) pairs, each head's pair of probabilities
// (rounded to bfloat16, as a bfloat16 flash attention rounds P) broadcast against it.
// out: [group][D]; pw[g]: head g's probabilities as bfloat16 pairs (probability_pairs).
// Tokens pair up within a block: block_size must be even; the last odd token pairs with 0.
static inline __attribute__((always_inline)) void pv_pairs_bf16(
        float *out, const uint32_t *const *pw, const uint16_t *value_head, const int32_t *blocks,
        int64_t block_stride, int64_t slot_stride, int seq_len, int block_size, const int group,
        const int head_size) {
    const int nc = head_size / 16;
    __m512 acc[16];
    for (int i = 0; i < group * nc; i++) acc[i] = _mm512_setzero_ps();
    for (int start = 0, b = 0; start < seq_len; start += block_size, b++) {
        const uint16_t *v = value_head + blocks[b] * block_stride;
        const int n = seq_len - start < block_size ? seq_len - start : block_size;
        if (start + block_size < seq_len)
            prefetch_rows(value_head + blocks[b + 1] * block_stride, block_size, slot_stride * 2,
                          head_size * 2);
        for (int o = 0; o < n; o += 2) {
            const uint16_t *r0 = v + o * slot_stride, *r1 = r0 + slot_stride;
            const int pair = (start + o) / 2;  // start is even
            for (int c = 0; c < head_size / 32; c++) {
                const __m512i a = _mm512_loadu_si512(r0 + 32 * c);
                const __m512i x =
                    o + 1 < n ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
                // In-lane interleaves (one shuffle each): lane L of p_lo holds d = 8 L .. 8 L + 3
                // of this 32, p_hi d = 8 L + 4 .. 8 L + 7; the stores below put d back in order.
                const __m512bh p_lo = (__m512bh)_mm512_unpacklo_epi16(a, x);
                const __m512bh p_hi = (__m512bh)_mm512_unpackhi_epi16(a, x);
                for (int g = 0; g < group; g++) {
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw[g][pair]);
                    acc[g * nc + 2 * c] = _mm512_dpbf16_ps(acc[g * nc + 2 * c], p_lo, w);
                    acc[g * nc + 2 * c + 1] = _mm512_dpbf16_ps(acc[g * nc + 2 * c + 1], p_hi, w);
                }
            }
        }
    }
    for (int g = 0; g < group; g++)
        for (int c = 0; c < head_size / 32; c++) {
            float lo_d[16], hi_d[16];
            _mm512_storeu_ps(lo_d, acc[g * nc + 2 * c]);
            _mm512_storeu_ps(hi_d, acc[g * nc + 2 * c + 1]);
            float *o = out + g * head_size + 32 * c;
            for (int l = 0; l < 4; l++)
                for (int i = 0; i < 4; i++) {
                    o[8 * l + i] = lo_d[4 * l + i];
                    o[8 * l + 4 + i] = hi_d[4 * l + i];
                }
        }
}

// The first min(n, 16) lanes (n > 0).
static inline __mmask16 first16(int n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

// p[0 .. n) rewritten in place as bfloat16 pairs (word i = (p[2i], p[2i + 1]), rounded to
// nearest even; an odd n's last word pairs with 0). Word i is written after floats 2i, 2i + 1
// are read, so the in-place walk is safe.
static inline const uint32_t *probability_pairs(float *p, int n) {
    uint32_t *w = (uint32_t *)p;
    for (int t = 0; t < n; t += 32) {
        const int rest = n - t - 16;  // floats past the first 16 of this chunk
        const __m512 a = _mm512_maskz_loadu_ps(first16(n - t), p + t);
        const __m512 b = rest > 0 ? _mm512_maskz_loadu_ps(first16(rest), p + t + 16)
                                  : _mm512_setzero_ps();
        const int words = (n - t + 1) / 2;  // this chunk's pairs: none past the row's end
        _mm512_mask_storeu_epi32(w + t / 2, first16(words), (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    return w;
}

// The grouped bfloat16 PV for every KV head of one request, where it applies: returns 0
// (nothing done) unless block_size is even, head_size is 64 or 128 and the group's
// accumulators fit in registers (group * head_size / 16 <= 16).
static inline int pv_grouped_bf16(float *acc, float *scores, int seq_len,
                                  const uint16_t *value_cache, const int32_t *blocks,
                                  int64_t block_stride, int64_t slot_stride, int block_size,
                                  int num_heads, int group, int head_size) {
    if (block_size % 2 || (head_size != 64 && head_size != 128) || group * head_size > 256)
        return 0;
    for (int kh = 0; kh < num_heads / group; kh++) {
        const uint32_t *pw[16];
        for (int g = 0; g < group; g++)
            pw[g] = probability_pairs(scores + (int64_t)(kh * group + g) * seq_len, seq_len);
        float *out = acc + (int64_t)kh * group * head_size;
        const uint16_t *vh = value_cache + (int64_t)kh * head_size;
#define PV_PAIRS(G, D) \
    pv_pairs_bf16(out, pw, vh, blocks, block_stride, slot_stride, seq_len, block_size, G, D)
        if (head_size == 64) {
            switch (group) {
                case 1: PV_PAIRS(1, 64); break;
                case 2: PV_PAIRS(2, 64); break;
                case 3: PV_PAIRS(3, 64); break;
                default: PV_PAIRS(4, 64); break;
            }
        } else {
            if (group == 1) PV_PAIRS(1, 128); else PV_PAIRS(2, 128);
        }
#undef PV_PAIRS
    }
    return 1;
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__
