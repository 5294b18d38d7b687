// Dequantizing matmul over weights held as GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K), as MXFP4
// blocks (gpt-oss's experts) or as per-output-channel int8, on CPU.
//
//   y[m, n] = sum_k x[m, k] * W[n, k]        W never expanded to float
//
// Activations are quantized first, per row in blocks of 32 (kvq_quantize_rows): int8 values,
// one float scale per block, the block's exact float sum and its quantized sum times the scale.
// The dot product of a weight block with an activation block is then an integer dot product
// (AVX-512 VNNI vpdpbusd on 256-bit lanes, one 32-element block per instruction; AVX2
// maddubs where VNNI is absent; plain C elsewhere) scaled by both blocks' scales, plus each
// format's offset term:
//
//   Q8_0  w = d * q, q int8                 dot = dw dx sum(q qx)
//   Q4_0  w = d * (q - 8), q in 0..15       dot = dw dx sum(q qx) - 8 dw (dx sum qx)
//   Q4_1  w = d * q + m, q in 0..15         dot = dw dx sum(q qx) + m sum(x)
//   Q4_K  256-element super-blocks, 8 sub-blocks of 32 with 6-bit scales and mins:
//         w = d sc_j q - dmin m_j           dot = d sc_j dx sum(q qx) - dmin m_j sum(x)
//   I8    w = s_n * q, q int8, per row      dot = s_n sum_b dx_b sum(q qx)
//   MXFP4 w = 2^(e - 127) * f, f an e2m1 value in {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign:
//         a block is the e8m0 exponent byte e, then 16 bytes whose low nibble is element 2j
//         and high nibble element 2j + 1 (the checkpoint's order); 2f is an integer in
//         -12..12, so                       dot = 2^(e - 128) dx sum(2f qx)
//
// Work is split over output rows (OpenMP); each weight row is unpacked from L1 for every
// activation row, so at decode (few rows) the kernel streams the weight once: bandwidth-bound,
// a quarter to an eighth of the float32 bytes. kvq_dequantize expands rows to float32 for
// the prefill path (a GEMM library on a transient copy) and for embedding lookups.
//
// Built with the other C kernels' flags by kernels/quant.py (cc -O3 -march=native -fopenmp).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { KVQ_Q8_0 = 8, KVQ_Q4_0 = 2, KVQ_Q4_1 = 3, KVQ_Q4_K = 12, KVQ_MXFP4 = 39, KVQ_I8 = 100 };

// Twice the e2m1 value of each nibble (sign bit 3): integers, for the int8 dot products.
static const int8_t kvq_e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 127) of an e8m0 exponent byte (e = 0: 2^-127, a float32 subnormal).
static inline float e8m0_to_f32(uint8_t e) {
    const uint32_t bits = e ? (uint32_t)e << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define QK 32     // elements per activation block and per Q8_0/Q4_0/Q4_1 block
#define QK_K 256  // elements per Q4_K super-block

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while ((mant & 0x400) == 0) {
                mant <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

// Q4_K: the 6-bit scale and min of sub-block j from the 12 packed bytes.
static inline void q4k_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

int kvq_block_elems(int qtype) {
    switch (qtype) {
        case KVQ_Q4_K: return QK_K;
        case KVQ_I8: return 1;
        default: return QK;
    }
}

int kvq_block_bytes(int qtype) {
    switch (qtype) {
        case KVQ_Q8_0: return 34;
        case KVQ_Q4_0: return 18;
        case KVQ_Q4_1: return 20;
        case KVQ_Q4_K: return 144;
        case KVQ_MXFP4: return 17;
        case KVQ_I8: return 1;
        default: return 0;
    }
}

// ------------------------------------------------------------------ activation quantization

// x [M, K] (row stride ldx floats) -> qx [M, K] int8, dx/sx/dsq [M, K/32]: per block the
// scale, the exact float sum and dx * sum(qx). K must be a multiple of 32.
void kvq_quantize_rows(const float *x, int64_t ldx, int M, int K, int8_t *qx, float *dx,
                       float *sx, float *dsq) {
    const int nb = K / QK;
#pragma omp parallel for schedule(static) if ((int64_t)M * K >= 65536)
    for (int m = 0; m < M; m++) {
        const float *xr = x + (int64_t)m * ldx;
        int8_t *qr = qx + (int64_t)m * K;
        for (int b = 0; b < nb; b++) {
            const float *xb = xr + b * QK;
            float amax = 0.f, sum = 0.f;
            for (int i = 0; i < QK; i++) {
                amax = fmaxf(amax, fabsf(xb[i]));
                sum += xb[i];
            }
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            int isum = 0;
            for (int i = 0; i < QK; i++) {
                const int q = (int)lrintf(xb[i] * inv);
                qr[b * QK + i] = (int8_t)q;
                isum += q;
            }
            dx[(int64_t)m * nb + b] = d;
            sx[(int64_t)m * nb + b] = sum;
            dsq[(int64_t)m * nb + b] = d * (float)isum;
        }
    }
}

// ------------------------------------------------------------------ block dot products

#if defined(__AVX2__)
// Unsigned x signed byte dot product, 4 bytes per int32 lane, added to acc.
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else  // maddubs saturates at int16: fine here (|u| <= 128, |s| <= 127, pairs of products)
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// Signed x signed: |w| times x with w's sign.
static inline __m256i dot_s8s8(__m256i w, __m256i x) {
    return dot_u8s8(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

static inline __m256i nibbles_32(const uint8_t *qs) {  // 16 bytes -> 32 values (lo | hi)
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm256_set_m128i(hi, lo);
}

// 16 MXFP4 bytes -> 32 int8 values 2f in element order (lo nibble of byte j = element 2j).
static inline __m256i mxfp4_32(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lut = _mm_loadu_si128((const __m128i *)kvq_e2m1_x2);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, mask));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define LOAD_X(p) _mm256_loadu_si256((const __m256i *)(p))
#define ACC(acc, idot, scale) \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), _mm256_set1_ps(scale), acc)
#endif

// One weight row against NR (1, 2 or 4) activation rows at once: each weight block is
// unpacked once and used NR times. w: the row's blocks; qx/dx/sx/dsq: per activation row its
// quantized blocks; wscale: the I8 row scale. rows_dot is always inlined into rows_dot_1/2/4,
// so each gets a copy specialised to its constant NR (decode's single row does one dot
// product per block, not four).
#define NR_MAX 4
static inline __attribute__((always_inline)) void rows_dot(
    const int NR, int qtype, const uint8_t *w, float wscale, int K,
    const int8_t *const qx[NR_MAX], const float *const dx[NR_MAX],
    const float *const sx[NR_MAX], const float *const dsq[NR_MAX], float res[NR_MAX]) {
    const int nb = K / QK;
    float extra[NR_MAX] = {0.f};
#if defined(__AVX2__)
    __m256 acc[NR_MAX];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    switch (qtype) {
        case KVQ_Q8_0:
            for (int b = 0; b < nb; b++, w += 34) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
                const __m256i aq = _mm256_abs_epi8(q);
                const float d = fp16_to_f32(rd16(w));
                for (int r = 0; r < NR; r++) {
                    const __m256i x = _mm256_sign_epi8(LOAD_X(qx[r] + b * QK), q);
                    ACC(acc[r], dot_u8s8(zero, aq, x), d * dx[r][b]);
                }
            }
            break;
        case KVQ_Q4_0:
            for (int b = 0; b < nb; b++, w += 18) {
                const float d = fp16_to_f32(rd16(w));
                const __m256i q = nibbles_32(w + 2);
                for (int r = 0; r < NR; r++) {
                    ACC(acc[r], dot_u8s8(zero, q, LOAD_X(qx[r] + b * QK)), d * dx[r][b]);
                    extra[r] -= 8.f * d * dsq[r][b];
                }
            }
            break;
        case KVQ_Q4_1:
            for (int b = 0; b < nb; b++, w += 20) {
                const float d = fp16_to_f32(rd16(w)), mn = fp16_to_f32(rd16(w + 2));
                const __m256i q = nibbles_32(w + 4);
                for (int r = 0; r < NR; r++) {
                    ACC(acc[r], dot_u8s8(zero, q, LOAD_X(qx[r] + b * QK)), d * dx[r][b]);
                    extra[r] += mn * sx[r][b];
                }
            }
            break;
        case KVQ_Q4_K: {
            const __m256i mask = _mm256_set1_epi8(0x0f);
            for (int sb = 0; sb < K / QK_K; sb++, w += 144) {
                const float d = fp16_to_f32(rd16(w)), dmin = fp16_to_f32(rd16(w + 2));
                const uint8_t *scales = w + 4, *qs = w + 16;
                for (int pair = 0; pair < 4; pair++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * pair));
                    const __m256i lo = _mm256_and_si256(q, mask);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                    const int b0 = sb * 8 + 2 * pair, b1 = b0 + 1;
                    int sc0, m0, sc1, m1;
                    q4k_scale_min(2 * pair, scales, &sc0, &m0);
                    q4k_scale_min(2 * pair + 1, scales, &sc1, &m1);
                    const float a0 = d * sc0, a1 = d * sc1, c0 = dmin * m0, c1 = dmin * m1;
                    for (int r = 0; r < NR; r++) {
                        ACC(acc[r], dot_u8s8(zero, lo, LOAD_X(qx[r] + b0 * QK)), a0 * dx[r][b0]);
                        ACC(acc[r], dot_u8s8(zero, hi, LOAD_X(qx[r] + b1 * QK)), a1 * dx[r][b1]);
                        extra[r] -= c0 * sx[r][b0] + c1 * sx[r][b1];
                    }
                }
            }
            break;
        }
        case KVQ_MXFP4:
            for (int b = 0; b < nb; b++, w += 17) {
                const float d = 0.5f * e8m0_to_f32(w[0]);
                const __m256i q = mxfp4_32(w + 1);
                const __m256i aq = _mm256_abs_epi8(q);
                for (int r = 0; r < NR; r++) {
                    const __m256i x = _mm256_sign_epi8(LOAD_X(qx[r] + b * QK), q);
                    ACC(acc[r], dot_u8s8(zero, aq, x), d * dx[r][b]);
                }
            }
            break;
        case KVQ_I8: {
            const int8_t *q8 = (const int8_t *)w;
            for (int b = 0; b < nb; b++) {
                const __m256i q = LOAD_X(q8 + b * QK);
                const __m256i aq = _mm256_abs_epi8(q);
                for (int r = 0; r < NR; r++) {
                    const __m256i x = _mm256_sign_epi8(LOAD_X(qx[r] + b * QK), q);
                    ACC(acc[r], dot_u8s8(zero, aq, x), dx[r][b]);
                }
            }
            for (int r = 0; r < NR; r++) res[r] = wscale * hsum8(acc[r]);
            return;
        }
    }
    for (int r = 0; r < NR; r++) res[r] = hsum8(acc[r]) + extra[r];
#else  // portable C
    for (int r = 0; r < NR; r++) {
        float total = 0.f;
        for (int b = 0; b < nb; b++) {
            const int8_t *xb = qx[r] + b * QK;
            int isum = 0;
            switch (qtype) {
                case KVQ_Q8_0: {
                    const uint8_t *blk = w + 34 * b;
                    for (int i = 0; i < QK; i++) isum += (int8_t)blk[2 + i] * xb[i];
                    total += fp16_to_f32(rd16(blk)) * dx[r][b] * isum;
                    break;
                }
                case KVQ_Q4_0: {
                    const uint8_t *blk = w + 18 * b;
                    for (int i = 0; i < 16; i++)
                        isum += (blk[2 + i] & 15) * xb[i] + (blk[2 + i] >> 4) * xb[16 + i];
                    const float d = fp16_to_f32(rd16(blk));
                    total += d * dx[r][b] * isum - 8.f * d * dsq[r][b];
                    break;
                }
                case KVQ_Q4_1: {
                    const uint8_t *blk = w + 20 * b;
                    for (int i = 0; i < 16; i++)
                        isum += (blk[4 + i] & 15) * xb[i] + (blk[4 + i] >> 4) * xb[16 + i];
                    total += fp16_to_f32(rd16(blk)) * dx[r][b] * isum +
                             fp16_to_f32(rd16(blk + 2)) * sx[r][b];
                    break;
                }
                case KVQ_Q4_K: {
                    const uint8_t *blk = w + 144 * (b / 8);
                    const int j = b % 8;
                    int sc, mn;
                    q4k_scale_min(j, blk + 4, &sc, &mn);
                    const uint8_t *qs = blk + 16 + 32 * (j / 2);
                    for (int i = 0; i < QK; i++)
                        isum += ((j & 1) ? (qs[i] >> 4) : (qs[i] & 15)) * xb[i];
                    total += fp16_to_f32(rd16(blk)) * sc * dx[r][b] * isum -
                             fp16_to_f32(rd16(blk + 2)) * mn * sx[r][b];
                    break;
                }
                case KVQ_MXFP4: {
                    const uint8_t *blk = w + 17 * b;
                    for (int i = 0; i < 16; i++)
                        isum += kvq_e2m1_x2[blk[1 + i] & 15] * xb[2 * i] +
                                kvq_e2m1_x2[blk[1 + i] >> 4] * xb[2 * i + 1];
                    total += 0.5f * e8m0_to_f32(blk[0]) * dx[r][b] * isum;
                    break;
                }
                case KVQ_I8: {
                    const int8_t *q = (const int8_t *)w + b * QK;
                    for (int i = 0; i < QK; i++) isum += q[i] * xb[i];
                    total += wscale * dx[r][b] * isum;
                    break;
                }
            }
        }
        res[r] = total + extra[r];
    }
#endif
}

#define ROWS_DOT_N(n)                                                                     \
    static void rows_dot_##n(int qtype, const uint8_t *w, float wscale, int K,               \
                             const int8_t *const qx[NR_MAX], const float *const dx[NR_MAX],  \
                             const float *const sx[NR_MAX], const float *const dsq[NR_MAX],  \
                             float res[NR_MAX]) {                                            \
        rows_dot(n, qtype, w, wscale, K, qx, dx, sx, dsq, res);                              \
    }
ROWS_DOT_N(1)
ROWS_DOT_N(2)
ROWS_DOT_N(4)

// out[m, n] (row stride ldo) = x[m] . W[n] for the M quantized activation rows.
// w: N rows of ldw bytes; wscale: I8 per-row scales (NULL otherwise).
void kvq_gemm(int qtype, const uint8_t *w, int64_t ldw, const float *wscale, int N, int K,
              const int8_t *qx, const float *dx, const float *sx, const float *dsq, int M,
              float *out, int64_t ldo) {
    const int nb = K / QK;
    // Tiles of 8 weight rows: a tile stays in L1 while every activation row passes over it.
    const int tile = 8, tiles = (N + tile - 1) / tile;
#pragma omp parallel for schedule(static) if ((int64_t)N * K * M >= 262144)
    for (int t = 0; t < tiles; t++) {
        const int n0 = t * tile, n1 = n0 + tile < N ? n0 + tile : N;
        for (int m0 = 0; m0 < M;) {
            const int nr = M - m0 >= 4 ? 4 : M - m0 >= 2 ? 2 : 1;
            const int8_t *q[NR_MAX];
            const float *d[NR_MAX], *s[NR_MAX], *ds[NR_MAX];
            for (int r = 0; r < nr; r++) {
                const int64_t m = m0 + r;
                q[r] = qx + m * K;
                d[r] = dx + m * nb;
                s[r] = sx + m * nb;
                ds[r] = dsq + m * nb;
            }
            for (int n = n0; n < n1; n++) {
                float res[NR_MAX];
                const uint8_t *wn = w + (int64_t)n * ldw;
                const float sn = wscale ? wscale[n] : 0.f;
                if (nr == 4)
                    rows_dot_4(qtype, wn, sn, K, q, d, s, ds, res);
                else if (nr == 2)
                    rows_dot_2(qtype, wn, sn, K, q, d, s, ds, res);
                else
                    rows_dot_1(qtype, wn, sn, K, q, d, s, ds, res);
                for (int r = 0; r < nr; r++) out[(int64_t)(m0 + r) * ldo + n] = res[r];
            }
            m0 += nr;
        }
    }
}

// kvq_quantize_rows then kvq_gemm in one call, the activation blocks in a per-thread buffer
// that grows as needed (decode's many small linears pay no allocation and one FFI call each).
// Returns 0, or -1 when the buffer cannot be allocated.
int kvq_linear(int qtype, const uint8_t *w, int64_t ldw, const float *wscale, int N, int K,
               const float *x, int64_t ldx, int M, float *out, int64_t ldo) {
    static __thread uint8_t *buf = NULL;
    static __thread size_t cap = 0;
    const size_t nb = (size_t)(K / QK), need = (size_t)M * K + 3 * (size_t)M * nb * sizeof(float);
    if (need > cap) {
        uint8_t *grown = realloc(buf, need);
        if (grown == NULL) return -1;
        buf = grown;
        cap = need;
    }
    float *dx = (float *)buf, *sx = dx + (size_t)M * nb, *dsq = sx + (size_t)M * nb;
    int8_t *qx = (int8_t *)(dsq + (size_t)M * nb);
    kvq_quantize_rows(x, ldx, M, K, qx, dx, sx, dsq);
    kvq_gemm(qtype, w, ldw, wscale, N, K, qx, dx, sx, dsq, M, out, ldo);
    return 0;
}

// ------------------------------------------------------------------ dequantization

static void dequantize_row(int qtype, const uint8_t *w, float wscale, int K, float *y) {
    switch (qtype) {
        case KVQ_Q8_0:
            for (int b = 0; b < K / QK; b++, w += 34) {
                const float d = fp16_to_f32(rd16(w));
                for (int i = 0; i < QK; i++) y[b * QK + i] = d * (int8_t)w[2 + i];
            }
            break;
        case KVQ_Q4_0:
            for (int b = 0; b < K / QK; b++, w += 18) {
                const float d = fp16_to_f32(rd16(w));
                for (int i = 0; i < 16; i++) {
                    y[b * QK + i] = d * ((w[2 + i] & 15) - 8);
                    y[b * QK + 16 + i] = d * ((w[2 + i] >> 4) - 8);
                }
            }
            break;
        case KVQ_Q4_1:
            for (int b = 0; b < K / QK; b++, w += 20) {
                const float d = fp16_to_f32(rd16(w)), mn = fp16_to_f32(rd16(w + 2));
                for (int i = 0; i < 16; i++) {
                    y[b * QK + i] = d * (w[4 + i] & 15) + mn;
                    y[b * QK + 16 + i] = d * (w[4 + i] >> 4) + mn;
                }
            }
            break;
        case KVQ_Q4_K:
            for (int sb = 0; sb < K / QK_K; sb++, w += 144) {
                const float d = fp16_to_f32(rd16(w)), dmin = fp16_to_f32(rd16(w + 2));
                float *ys = y + sb * QK_K;
                for (int j = 0; j < 8; j++) {
                    int sc, mn;
                    q4k_scale_min(j, w + 4, &sc, &mn);
                    const uint8_t *qs = w + 16 + 32 * (j / 2);
                    const float a = d * sc, c = dmin * mn;
                    for (int i = 0; i < QK; i++)
                        ys[j * QK + i] = a * ((j & 1) ? (qs[i] >> 4) : (qs[i] & 15)) - c;
                }
            }
            break;
        case KVQ_MXFP4:
            for (int b = 0; b < K / QK; b++, w += 17) {
                const float d = 0.5f * e8m0_to_f32(w[0]);
                for (int i = 0; i < 16; i++) {
                    y[b * QK + 2 * i] = d * kvq_e2m1_x2[w[1 + i] & 15];
                    y[b * QK + 2 * i + 1] = d * kvq_e2m1_x2[w[1 + i] >> 4];
                }
            }
            break;
        case KVQ_I8:
            for (int k = 0; k < K; k++) y[k] = wscale * ((const int8_t *)w)[k];
            break;
    }
}

// out[r] (row stride ldo floats) = W[rows[r]] as float32, R rows; rows NULL means 0..R-1.
void kvq_dequantize_rows(int qtype, const uint8_t *w, int64_t ldw, const float *wscale,
                         const int64_t *rows, int R, int K, float *out, int64_t ldo) {
#pragma omp parallel for schedule(static) if ((int64_t)R * K >= 65536)
    for (int r = 0; r < R; r++) {
        const int64_t n = rows ? rows[r] : r;
        dequantize_row(qtype, w + n * ldw, wscale ? wscale[n] : 0.f, K, out + (int64_t)r * ldo);
    }
}

// out[m, n] = x[m] . W[n] with float32 activations: each tile of 4 weight rows is expanded to
// float32 once (an L1/L2-sized buffer, never the whole weight) and reused by every activation
// row, 4 fused multiply-add streams per x load. Exact up to float rounding (no activation
// quantization): the default path; kvq_gemm is the int8-activation (VNNI) one.
#define TILE_F32 4
void kvq_gemm_f32(int qtype, const uint8_t *w, int64_t ldw, const float *wscale, int N, int K,
                  const float *x, int64_t ldx, int M, float *out, int64_t ldo) {
    const int tiles = (N + TILE_F32 - 1) / TILE_F32;
#pragma omp parallel if ((int64_t)N * K * M >= 262144)
    {
        float *buf = (float *)aligned_alloc(64, sizeof(float) * TILE_F32 * (size_t)((K + 15) / 16 * 16));
        const int64_t ldb = (K + 15) / 16 * 16;
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            const int n0 = t * TILE_F32, rows = N - n0 < TILE_F32 ? N - n0 : TILE_F32;
            for (int r = 0; r < TILE_F32; r++) {
                const int n = n0 + (r < rows ? r : rows - 1);  // repeat the last row
                dequantize_row(qtype, w + (int64_t)n * ldw, wscale ? wscale[n] : 0.f, K,
                               buf + r * ldb);
            }
            const float *b0 = buf, *b1 = buf + ldb, *b2 = buf + 2 * ldb, *b3 = buf + 3 * ldb;
            for (int m = 0; m < M; m++) {
                const float *xm = x + (int64_t)m * ldx;
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int k = 0; k < K; k++) {
                    const float xv = xm[k];
                    a0 += b0[k] * xv;
                    a1 += b1[k] * xv;
                    a2 += b2[k] * xv;
                    a3 += b3[k] * xv;
                }
                float *o = out + (int64_t)m * ldo + n0;
                const float acc[TILE_F32] = {a0, a1, a2, a3};
                for (int r = 0; r < rows; r++) o[r] = acc[r];
            }
        }
        free(buf);
    }
}
