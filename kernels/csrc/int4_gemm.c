// Matmul over 4-bit weight-only checkpoints (AWQ, GPTQ, compressed-tensors W4A16) held as
// the W4G<g> blocks of kernels/int4.py, on CPU.
//
// A weight row [K] is K/g blocks, one per group of g input features (g = 32, 64 or 128):
//
//   bytes 0..3   scale s (float32: fp16 and bf16 checkpoint scales convert exactly)
//   byte  4      zero point z (int8; 8 for a symmetric checkpoint)
//   bytes 5..7   zero
//   bytes 8..    g/2 bytes of unsigned 4-bit values q, in runs of 16 bytes per 32 elements:
//                the low nibble of byte j is element j of the run, the high one element
//                16 + j (Q4_0's order, so a run unpacks like a Q4_0 block)
//
//   w = (q - z) * s      in float32, exactly the checkpoint tool's dequantization
//
// The kernels are of quant_gemm.c's kind, and use its activation quantization (per row in
// blocks of 32: int8 values, a scale, sums), called through the pointer w4_init is given
// (the two libraries load side by side; this one stays small to build). Per 32-run
//
//   dot = s dx sum(q qx) - z s (dx sum qx)          (VNNI vpdpbusd: q unsigned, qx signed)
//
// and w4_dequantize_rows expands rows to float32 for the many-row path (F.linear on chunks).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define NR_MAX 4
#define W4_HEADER 8

typedef void (*quantize_rows_fn)(const float *x, int64_t ldx, int M, int K, int8_t *qx,
                                 float *dx, float *sx, float *dsq);
typedef int (*linear_fn)(int qtype, const uint8_t *w, int64_t ldw, const float *wscale, int N,
                         int K, const float *x, int64_t ldx, int M, float *out, int64_t ldo);
static quantize_rows_fn kvq_quantize_rows = NULL;
static linear_fn kvq_linear = NULL;

// quant_gemm.c's kvq_quantize_rows and kvq_linear (kernels/int4.py passes them at load).
void w4_init(quantize_rows_fn quantize_rows, linear_fn linear) {
    kvq_quantize_rows = quantize_rows;
    kvq_linear = linear;
}

#if defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else  // maddubs saturates at int16: fine here (u <= 15, |s| <= 127, pairs of products)
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

static inline __m256i nibbles_32(const uint8_t *qs) {  // 16 bytes -> 32 values (lo | hi)
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm256_set_m128i(hi, lo);
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

static inline int w4_block_bytes(int g) { return W4_HEADER + g / 2; }

static inline float w4_scale(const uint8_t *blk) {
    float s;
    memcpy(&s, blk, 4);
    return s;
}

// One weight row against NR activation rows (1, 2 or 4); see rows_dot in quant_gemm.c.
static inline __attribute__((always_inline)) void w4_rows_dot(
    const int NR, int g, const uint8_t *w, int K, const int8_t *const qx[NR_MAX],
    const float *const dx[NR_MAX], const float *const dsq[NR_MAX], float res[NR_MAX]) {
    const int groups = K / g, runs = g / QK, bpb = w4_block_bytes(g);
    float extra[NR_MAX] = {0.f};
#if defined(__AVX2__)
    __m256 acc[NR_MAX];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    for (int gr = 0; gr < groups; gr++, w += bpb) {
        const float s = w4_scale(w), sz = s * (float)(int8_t)w[4];
        for (int j = 0; j < runs; j++) {
            const int b = gr * runs + j;
            const __m256i q = nibbles_32(w + W4_HEADER + 16 * j);
            for (int r = 0; r < NR; r++) {
                ACC(acc[r], dot_u8s8(zero, q, LOAD_X(qx[r] + b * QK)), s * dx[r][b]);
                extra[r] -= sz * dsq[r][b];
            }
        }
    }
    for (int r = 0; r < NR; r++) res[r] = hsum8(acc[r]) + extra[r];
#else  // portable C
    for (int r = 0; r < NR; r++) {
        float total = 0.f;
        for (int gr = 0; gr < groups; gr++) {
            const uint8_t *blk = w + (int64_t)gr * bpb;
            const float s = w4_scale(blk), sz = s * (float)(int8_t)blk[4];
            for (int j = 0; j < runs; j++) {
                const int b = gr * runs + j;
                const uint8_t *qs = blk + W4_HEADER + 16 * j;
                const int8_t *xb = qx[r] + b * QK;
                int isum = 0;
                for (int i = 0; i < 16; i++) isum += (qs[i] & 15) * xb[i] + (qs[i] >> 4) * xb[16 + i];
                total += s * dx[r][b] * isum - sz * dsq[r][b];
            }
        }
        res[r] = total + extra[r];
    }
#endif
}

#define W4_ROWS_DOT_N(n)                                                                      \
    static void w4_rows_dot_##n(int g, const uint8_t *w, int K, const int8_t *const qx[NR_MAX], \
                                const float *const dx[NR_MAX], const float *const dsq[NR_MAX], \
                                float res[NR_MAX]) {                                          \
        w4_rows_dot(n, g, w, K, qx, dx, dsq, res);                                            \
    }
W4_ROWS_DOT_N(1)
W4_ROWS_DOT_N(2)
W4_ROWS_DOT_N(4)

// out[m, n] (row stride ldo) = x[m] . W[n] for M quantized activation rows; W: N rows of ldw
// bytes of W4G<g> blocks.
static void w4_gemm(int g, const uint8_t *w, int64_t ldw, int N, int K, const int8_t *qx,
                    const float *dx, const float *dsq, int M, float *out, int64_t ldo) {
    const int nb = K / QK;
    const int tile = 8, tiles = (N + tile - 1) / tile;
#pragma omp parallel for schedule(static) if ((int64_t)N * K * M >= 262144)
    for (int t = 0; t < tiles; t++) {
        const int n0 = t * tile, n1 = n0 + tile < N ? n0 + tile : N;
        for (int m0 = 0; m0 < M;) {
            const int nr = M - m0 >= 4 ? 4 : M - m0 >= 2 ? 2 : 1;
            const int8_t *q[NR_MAX];
            const float *d[NR_MAX], *ds[NR_MAX];
            for (int r = 0; r < nr; r++) {
                const int64_t m = m0 + r;
                q[r] = qx + m * K;
                d[r] = dx + m * nb;
                ds[r] = dsq + m * nb;
            }
            for (int n = n0; n < n1; n++) {
                float res[NR_MAX];
                const uint8_t *wn = w + (int64_t)n * ldw;
                if (nr == 4)
                    w4_rows_dot_4(g, wn, K, q, d, ds, res);
                else if (nr == 2)
                    w4_rows_dot_2(g, wn, K, q, d, ds, res);
                else
                    w4_rows_dot_1(g, wn, K, q, d, ds, res);
                for (int r = 0; r < nr; r++) out[(int64_t)(m0 + r) * ldo + n] = res[r];
            }
            m0 += nr;
        }
    }
}

// Quantize the M activation rows into a per-thread buffer, then w4_gemm. Returns 0, or -1
// when the buffer cannot be allocated.
int w4_linear(int g, const uint8_t *w, int64_t ldw, int N, int K, const float *x, int64_t ldx,
              int M, float *out, int64_t ldo) {
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
    w4_gemm(g, w, ldw, N, K, qx, dx, dsq, M, out, ldo);
    return 0;
}

// (q - z) * s per element: the subtraction is exact, one rounding in the product, the same
// as the tools'. The portable loop is not auto-vectorized: GCC's combiner takes tens of
// seconds on its vectorized form.
__attribute__((optimize("no-tree-vectorize"))) static void w4_dequantize_row(int g,
                                                                             const uint8_t *w,
                                                                             int K, float *y) {
    const int bpb = w4_block_bytes(g);
    for (int gr = 0; gr < K / g; gr++, w += bpb) {
        const float s = w4_scale(w), z = (float)(int8_t)w[4];
        for (int j = 0; j < g / QK; j++) {
            const uint8_t *qs = w + W4_HEADER + 16 * j;
            float *yr = y + gr * g + j * QK;
#if defined(__AVX2__)
            const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
            const __m256i q = nibbles_32(qs);  // elements 0..31 as bytes
            const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int c = 0; c < 4; c++) {
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c]));
                _mm256_storeu_ps(yr + 8 * c, _mm256_mul_ps(_mm256_sub_ps(v, vz), vs));
            }
#else
            for (int i = 0; i < 16; i++) {
                yr[i] = ((float)(qs[i] & 15) - z) * s;
                yr[16 + i] = ((float)(qs[i] >> 4) - z) * s;
            }
#endif
        }
    }
}

// out[r] (row stride ldo floats) = W[rows[r]] as float32, R rows; rows NULL means 0..R-1.
void w4_dequantize_rows(int g, const uint8_t *w, int64_t ldw, const int64_t *rows, int R, int K,
                        float *out, int64_t ldo) {
#pragma omp parallel for schedule(static) if ((int64_t)R * K >= 65536)
    for (int r = 0; r < R; r++) {
        const int64_t n = rows ? rows[r] : r;
        w4_dequantize_row(g, w + n * ldw, K, out + (int64_t)r * ldo);
    }
}

// kvq_linear's signature over every held type: W4G codes (200 + g / 32) run w4_linear, the
// rest quant_gemm.c's kvq_linear (through the pointer w4_init got). The native decode stack
// calls this one when a layer holds W4G parts (kernels/decode_stack.py).
int w4_any_linear(int qtype, const uint8_t *w, int64_t ldw, const float *wscale, int N, int K,
                  const float *x, int64_t ldx, int M, float *out, int64_t ldo) {
    if (qtype == 201 || qtype == 202 || qtype == 204)
        return w4_linear(32 * (qtype - 200), w, ldw, N, K, x, ldx, M, out, ldo);
    return kvq_linear(qtype, w, ldw, wscale, N, K, x, ldx, M, out, ldo);
}
