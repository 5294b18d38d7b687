// W8A8 int8 (compressed-tensors' dynamic per-token scheme, kernels/w8a8.py): the two memory
// passes around the integer GEMM, which torch's oneDNN matmul (AMX-INT8 / VNNI) computes, and
// (below) the fused AMX-INT8 linear that does all three on a weight packed once.
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

// One row: q = round(x / s), s = max|x| / 127 (0 for an all-zero row, q all 0).
static void quantize_row(const void *x, int is_bf16, int k, int8_t *dst, float *scale) {
    const float *f32 = (const float *)x;
    const uint16_t *b16 = (const uint16_t *)x;
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
    *scale = s;
}

void kvw8_quantize_rows(const void *x, int is_bf16, int64_t ldx, int m, int k, int8_t *q,
                        float *scales) {
    const size_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (m > 16)
    for (int i = 0; i < m; i++)
        quantize_row((const char *)x + (size_t)i * ldx * elem, is_bf16, k, q + (int64_t)i * k,
                     scales + i);
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

// ------------------------------------------------------------------ the fused AMX-INT8 linear
//
// y [M, N] = (q_x s_x) (W s_w)^T (+ bias) in one call, on AMX-INT8 tiles:
//   kvw8_amx_pack        once per weight: int8 W [N, K] into B tiles, N padded to a multiple
//                        of 32 and K to 64 with zeros. Tile (nb, kb) = 1024 bytes at
//                        (nb * K_pad / 64 + kb) * 1024; its row r holds, for the 16 columns
//                        c, the 4 bytes W[16 nb + c][64 kb + 4 r .. 4 r + 3] (VNNI groups
//                        of 4 K-values, TDPBSSD's B layout)
//   kvw8_amx_linear      per call, one OpenMP region: each row quantized per token into
//                        16-row A blocks (zero padded), then per pair of 16-column blocks
//                        (static over threads; their B tiles stay in L1 across the row
//                        blocks) and pair of 16-row blocks: 2 A x 2 B tiles into 4 int32 C
//                        tiles over K, stored, rescaled acc * s_x * s_w (+ bias) and written
//                        as float32 or bfloat16 (round to nearest even). The integer sums
//                        are exact, so y is the per-token reference's up to float rounding.
// Without AMX-INT8 (or AVX512-BF16) on the CPU this was built for, or when Linux refuses the
// tile state, kvw8_amx_available says 0 and kvw8_amx_linear sets *status = -1.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define W8A8_AMX 1
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Linux hands AMX state to a process only on request (once per process, for all threads).
static int amx_permitted(void) {
    static int state;  // 0 unknown, 1 granted, -1 refused
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {  // all 8 tiles 16 rows x 64 bytes
    tile_config cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

static inline __mmask16 first_lanes(int n) {
    return n >= 16 ? (__mmask16)0xffff : (n <= 0 ? 0 : (__mmask16)((1u << n) - 1u));
}

// Rows [row0, row0 + rows) x columns [col0, col0 + 32) of y from two 16 x 16 int32 tiles.
static void rescale_tiles(const int32_t *c0, const int32_t *c1, int row0, int rows, int col0,
                          int n, const float *sx, const float *sw, const float *bias, void *out,
                          int out_bf16, int64_t ldo) {
    for (int h = 0; h < 2; h++) {
        const int col = col0 + 16 * h;
        if (col >= n) break;
        const __mmask16 mask = first_lanes(n - col);
        const __m512 w = _mm512_maskz_loadu_ps(mask, sw + col);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
        const int32_t *c = h ? c1 : c0;
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r));
            const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(a, _mm512_set1_ps(sx[row0 + r])), w, b);
            const int64_t at = (int64_t)(row0 + r) * ldo + col;
            if (out_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)out + at, mask,
                                         (__m256i)_mm512_cvtneps_pbh(y));
            else
                _mm512_mask_storeu_ps((float *)out + at, mask, y);
        }
    }
}
#endif

void kvw8_amx_available(int *out) {
#ifdef W8A8_AMX
    *out = amx_permitted();
#else
    *out = 0;
#endif
}

void kvw8_amx_pack(const int8_t *w, int n, int k, int8_t *packed) {
    const int n_pad = (n + 31) / 32 * 32, kbs = (k + 63) / 64;
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < n_pad / 16; nb++)
        for (int kb = 0; kb < kbs; kb++) {
            int8_t *tile = packed + ((int64_t)nb * kbs + kb) * 1024;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    for (int j = 0; j < 4; j++) {
                        const int row = 16 * nb + c, col = 64 * kb + 4 * r + j;
                        tile[r * 64 + c * 4 + j] = row < n && col < k ? w[(int64_t)row * k + col] : 0;
                    }
        }
}

void kvw8_amx_linear(const void *x, int is_bf16, int64_t ldx, int m, int k, const int8_t *packed,
                     int n, const float *sw, const float *bias, void *out, int out_bf16,
                     int64_t ldo, int *status) {
#ifdef W8A8_AMX
    if (!amx_permitted()) {
        *status = -1;
        return;
    }
    const int k_pad = (k + 63) / 64 * 64, kbs = k_pad / 64, m_blocks = (m + 15) / 16;
    const int n_pairs = (n + 31) / 32;
    const int sb_rows = (512 * 1024 / k_pad) / 32 * 32, sb_blocks = sb_rows < 32 ? 2 : sb_rows / 16;
    const size_t elem = is_bf16 ? 2 : 4;
    int8_t *a = aligned_alloc(64, (size_t)m_blocks * 16 * k_pad);
    float *sx = malloc(sizeof(float) * (size_t)m);
    if (a == NULL || sx == NULL) {
        free(a), free(sx);
        *status = -2;
        return;
    }
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int i = 0; i < m_blocks * 16; i++) {
            int8_t *dst = a + (int64_t)i * k_pad;
            if (i < m) {
                quantize_row((const char *)x + (size_t)i * ldx * elem, is_bf16, k, dst, sx + i);
                memset(dst + k, 0, (size_t)(k_pad - k));
            } else {
                memset(dst, 0, (size_t)k_pad);
            }
        }
        configure_tiles();
        int32_t acc[4][256] __attribute__((aligned(64)));
        // Row super-blocks of A small enough to stay in L2 (~512 KB) while every column pair
        // passes over them (a barrier each; one super-block up to ~900 rows at K = 576).
        for (int sb = 0; sb < m_blocks; sb += sb_blocks) {
            const int mb_end = sb + sb_blocks < m_blocks ? sb + sb_blocks : m_blocks;
#pragma omp for schedule(static)
            for (int np = 0; np < n_pairs; np++) {
                const int8_t *b0 = packed + (int64_t)(2 * np) * kbs * 1024, *b1 = b0 + kbs * 1024;
                for (int mb = sb; mb < mb_end; mb += 2) {
                    const int8_t *a0 = a + (int64_t)mb * 16 * k_pad, *a1 = a0 + 16 * k_pad;
                    const int row0 = 16 * mb, rows0 = m - row0 < 16 ? m - row0 : 16;
                    if (mb + 1 < mb_end) {
                        _tile_zero(4);
                        _tile_zero(5);
                        _tile_zero(6);
                        _tile_zero(7);
                        for (int kb = 0; kb < kbs; kb++) {
                            _tile_loadd(0, a0 + 64 * kb, k_pad);
                            _tile_loadd(1, a1 + 64 * kb, k_pad);
                            _tile_loadd(2, b0 + kb * 1024, 64);
                            _tile_loadd(3, b1 + kb * 1024, 64);
                            _tile_dpbssd(4, 0, 2);
                            _tile_dpbssd(5, 0, 3);
                            _tile_dpbssd(6, 1, 2);
                            _tile_dpbssd(7, 1, 3);
                        }
                        _tile_stored(4, acc[0], 64);
                        _tile_stored(5, acc[1], 64);
                        _tile_stored(6, acc[2], 64);
                        _tile_stored(7, acc[3], 64);
                        const int rows1 = m - row0 - 16 < 16 ? m - row0 - 16 : 16;
                        rescale_tiles(acc[0], acc[1], row0, rows0, 32 * np, n, sx, sw, bias, out,
                                      out_bf16, ldo);
                        rescale_tiles(acc[2], acc[3], row0 + 16, rows1, 32 * np, n, sx, sw, bias,
                                      out, out_bf16, ldo);
                    } else {
                        _tile_zero(4);
                        _tile_zero(5);
                        for (int kb = 0; kb < kbs; kb++) {
                            _tile_loadd(0, a0 + 64 * kb, k_pad);
                            _tile_loadd(2, b0 + kb * 1024, 64);
                            _tile_loadd(3, b1 + kb * 1024, 64);
                            _tile_dpbssd(4, 0, 2);
                            _tile_dpbssd(5, 0, 3);
                        }
                        _tile_stored(4, acc[0], 64);
                        _tile_stored(5, acc[1], 64);
                        rescale_tiles(acc[0], acc[1], row0, rows0, 32 * np, n, sx, sw, bias, out,
                                      out_bf16, ldo);
                    }
                }
            }
        }
        _tile_release();
    }
    free(a), free(sx);
    *status = 0;
#else
    (void)x, (void)is_bf16, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)sw;
    (void)bias, (void)out, (void)out_bf16, (void)ldo;
    *status = -1;
#endif
}

// ------------------------------------------------------------------ a bfloat16 AMX linear
//
// y [M, N] = x W^T for bfloat16 x [M, K] and W [N, K], float32 sums on AMX-BF16 tiles: what
// the native decode stack's LM head runs (services/worker/layers/embed_head.py), where the
// stack's AVX2 GEMV costs 3.6x oneDNN at 32 rows and oneDNN's result for a row depends on
// how many rows share the call. Here every output is one fixed sum (the tiles over K in
// order, each TDPBF16PS's pairs in the hardware's order), whatever M is.
//   kvw8_amx_bf16_pack    once per weight: W into B tiles, N padded to 32 and K to 32 with
//                         zeros; tile (nb, kb) = 1024 bytes at (nb * K_pad / 32 + kb) * 1024,
//                         its row r holding for the 16 columns c the pair W[16 nb + c][32 kb
//                         + 2 r, + 1] (TDPBF16PS's B layout)
//   kvw8_amx_bf16_linear  per call: x copied into zero-padded 16-row A blocks, then per pair
//                         of 16-column blocks (static over threads: the weight is read once)
//                         and pair of row blocks, 2 A x 2 B tiles into 4 float32 C tiles over
//                         K, written as bfloat16 (round to nearest even) or float32.
void kvw8_amx_bf16_pack(const uint16_t *w, int n, int k, uint16_t *packed) {
    const int n_pad = (n + 31) / 32 * 32, kbs = (k + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < n_pad / 16; nb++)
        for (int kb = 0; kb < kbs; kb++) {
            uint16_t *tile = packed + ((int64_t)nb * kbs + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    for (int j = 0; j < 2; j++) {
                        const int row = 16 * nb + c, col = 32 * kb + 2 * r + j;
                        tile[r * 32 + c * 2 + j] =
                            row < n && col < k ? w[(int64_t)row * k + col] : 0;
                    }
        }
}

#ifdef W8A8_AMX
static void store_tile_f32(const float *c, int row0, int rows, int col, int n, void *out,
                           int out_bf16, int64_t ldo) {
    if (col >= n) return;
    const __mmask16 mask = first_lanes(n - col);
    for (int r = 0; r < rows; r++) {
        const __m512 y = _mm512_load_ps(c + 16 * r);
        const int64_t at = (int64_t)(row0 + r) * ldo + col;
        if (out_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)out + at, mask, (__m256i)_mm512_cvtneps_pbh(y));
        else
            _mm512_mask_storeu_ps((float *)out + at, mask, y);
    }
}
#endif

void kvw8_amx_bf16_linear(const uint16_t *x, int64_t ldx, int m, int k, const uint16_t *packed,
                          int n, void *out, int out_bf16, int64_t ldo, int *status) {
#ifdef W8A8_AMX
    if (!amx_permitted()) {
        *status = -1;
        return;
    }
    const int k_pad = (k + 31) / 32 * 32, kbs = k_pad / 32, m_blocks = (m + 15) / 16;
    const int n_pairs = (n + 31) / 32;
    uint16_t *a = aligned_alloc(64, (size_t)m_blocks * 16 * k_pad * 2);
    if (a == NULL) {
        *status = -2;
        return;
    }
    for (int i = 0; i < m_blocks * 16; i++) {
        uint16_t *dst = a + (int64_t)i * k_pad;
        if (i < m) {
            memcpy(dst, x + (int64_t)i * ldx, sizeof(uint16_t) * (size_t)k);
            memset(dst + k, 0, sizeof(uint16_t) * (size_t)(k_pad - k));
        } else {
            memset(dst, 0, sizeof(uint16_t) * (size_t)k_pad);
        }
    }
    const int64_t lda = (int64_t)k_pad * 2;  // bytes
#pragma omp parallel
    {
        configure_tiles();
        float acc[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int np = 0; np < n_pairs; np++) {
            const uint16_t *b0 = packed + (int64_t)(2 * np) * kbs * 512, *b1 = b0 + kbs * 512;
            for (int mb = 0; mb < m_blocks; mb += 2) {
                const uint16_t *a0 = a + (int64_t)mb * 16 * k_pad, *a1 = a0 + 16 * k_pad;
                const int row0 = 16 * mb, rows0 = m - row0 < 16 ? m - row0 : 16;
                const int col = 32 * np;
                if (mb + 1 < m_blocks) {
                    _tile_zero(4);
                    _tile_zero(5);
                    _tile_zero(6);
                    _tile_zero(7);
                    for (int kb = 0; kb < kbs; kb++) {
                        _tile_loadd(0, a0 + 32 * kb, lda);
                        _tile_loadd(1, a1 + 32 * kb, lda);
                        _tile_loadd(2, b0 + kb * 512, 64);
                        _tile_loadd(3, b1 + kb * 512, 64);
                        _tile_dpbf16ps(4, 0, 2);
                        _tile_dpbf16ps(5, 0, 3);
                        _tile_dpbf16ps(6, 1, 2);
                        _tile_dpbf16ps(7, 1, 3);
                    }
                    _tile_stored(4, acc[0], 64);
                    _tile_stored(5, acc[1], 64);
                    _tile_stored(6, acc[2], 64);
                    _tile_stored(7, acc[3], 64);
                    const int rows1 = m - row0 - 16 < 16 ? m - row0 - 16 : 16;
                    store_tile_f32(acc[0], row0, rows0, col, n, out, out_bf16, ldo);
                    store_tile_f32(acc[1], row0, rows0, col + 16, n, out, out_bf16, ldo);
                    store_tile_f32(acc[2], row0 + 16, rows1, col, n, out, out_bf16, ldo);
                    store_tile_f32(acc[3], row0 + 16, rows1, col + 16, n, out, out_bf16, ldo);
                } else {
                    _tile_zero(4);
                    _tile_zero(5);
                    for (int kb = 0; kb < kbs; kb++) {
                        _tile_loadd(0, a0 + 32 * kb, lda);
                        _tile_loadd(2, b0 + kb * 512, 64);
                        _tile_loadd(3, b1 + kb * 512, 64);
                        _tile_dpbf16ps(4, 0, 2);
                        _tile_dpbf16ps(5, 0, 3);
                    }
                    _tile_stored(4, acc[0], 64);
                    _tile_stored(5, acc[1], 64);
                    store_tile_f32(acc[0], row0, rows0, col, n, out, out_bf16, ldo);
                    store_tile_f32(acc[1], row0, rows0, col + 16, n, out, out_bf16, ldo);
                }
            }
        }
        _tile_release();
    }
    free(a);
    *status = 0;
#else
    (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)out, (void)out_bf16;
    (void)ldo;
    *status = -1;
#endif
}
