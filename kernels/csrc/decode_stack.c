// A decode step of a dense Llama-family decoder in one native call: every layer of the stack,
// for M tokens of M requests (one query token each), without returning to Python.
//
// Per layer, in the order the torch modules run (services/worker/models/llama.py), with the
// same roundings to the model dtype between stages:
//   residual add + RMSNorm -> qkv GEMV (+ bias) -> RoPE of q and k, K/V written to the paged
//   cache -> decode attention (decode_attention.c) -> o GEMV -> residual add + RMSNorm ->
//   gate|up GEMV -> SiLU-and-mul -> down GEMV.
// Weights are read once per step whatever M is (each W row meets all M inputs while it is in
// L1), so a batch-1 step is bound by the weights' bytes over the memory bandwidth. A matrix
// may be held quantized (GGUF blocks, int8): its parts then run quant_gemm.c's kvq_linear, or
// (W8A8 weights packed into AMX tiles, STACK_AMX_W8A8) w8a8.c's kvw8_amx_linear.
//
// Activations live in float32 work buffers; in bfloat16 each stage's output is rounded to
// bfloat16 where the module path stores a bfloat16 tensor. The caller owns every buffer.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

// One run of a matrix's output rows: float rows in the model dtype (qtype 0, [rows, K]
// contiguous) or GGUF / int8 blocks (qtype a kvq code of quant_gemm.c, rows of ldw bytes,
// wscale the I8 per-row scales or NULL), multiplied by kvq_linear; or qtype STACK_AMX_W8A8:
// a W8A8 int8 weight as kvw8_amx_pack packs it (w), its per-row scales (wscale), multiplied
// by kvw8_amx_linear (activations quantized per token, int8 tiles).
typedef struct {
    const void *w;
    const float *wscale;
    int64_t qtype;
    int64_t ldw;
    int64_t row_offset;
    int64_t rows;
} stack_part;

#define STACK_MAX_PARTS 4
#define STACK_AMX_W8A8 300  // kernels/decode_stack.py AMX_W8A8
// A matrix [N, K]: its parts cover rows 0..N in order (a fused qkv of three GGUF tensors may
// hold three types).
typedef struct {
    stack_part parts[STACK_MAX_PARTS];
    int64_t num_parts;
} stack_matrix;

// The weights and cache of one layer. Matrices are [out, in].
typedef struct {
    const float *input_norm;   // [H] float32
    const float *post_norm;    // [H] float32
    stack_matrix qkv;          // [Hq*D + 2*Hkv*D, H]
    const float *qkv_b;        // [Hq*D + 2*Hkv*D] float32, or NULL
    stack_matrix o;            // [H, Hq*D]
    stack_matrix gate_up;      // [2*I, H]
    stack_matrix down;         // [H, I]
    void *key_cache;           // [num_blocks, block_size, Hkv, D]
    void *value_cache;         // same
    const float *cos_sin;      // [max_position, D]: cos | sin halves
    int64_t sliding_window;    // 0: none
} stack_layer;

// quant_gemm.c's kvq_linear (another library: the caller passes its address).
typedef int (*kvq_linear_fn)(int qtype, const uint8_t *w, int64_t ldw, const float *wscale,
                             int N, int K, const float *x, int64_t ldx, int M, float *out,
                             int64_t ldo);
// w8a8.c's kvw8_amx_linear (another library: the caller passes its address).
typedef void (*amx_linear_fn)(const void *x, int is_bf16, int64_t ldx, int m, int k,
                              const int8_t *packed, int n, const float *sw, const float *bias,
                              void *out, int out_bf16, int64_t ldo, int *status);

// The model's shape (the same for every layer of the stack).
typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_size, intermediate, block_size;
    int64_t is_bf16;
    float eps, scale, soft_cap, pad;
    const void *kvq_linear;  // a kvq_linear_fn, or NULL when no part is quantized
    const void *amx_linear;  // an amx_linear_fn, or NULL when no part is STACK_AMX_W8A8
} stack_shape;

void decode_attention_f32(float *out, const float *query, int64_t q_token_stride,
                          int64_t q_head_stride, const float *key_cache,
                          const float *value_cache, int64_t block_stride, int64_t slot_stride,
                          const int32_t *block_table, int64_t table_stride,
                          const int32_t *seq_lens, const int64_t *token_rows, int num_reqs,
                          int num_heads, int num_kv_heads, int head_size, int block_size,
                          float scale, int sliding_window, float soft_cap,
                          const float *sinks);
void decode_attention_bf16(uint16_t *out, const uint16_t *query, int64_t q_token_stride,
                           int64_t q_head_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, int64_t block_stride,
                           int64_t slot_stride, const int32_t *block_table,
                           int64_t table_stride, const int32_t *seq_lens,
                           const int64_t *token_rows, int num_reqs, int num_heads,
                           int num_kv_heads, int head_size, int block_size, float scale,
                           int sliding_window, float soft_cap, const float *sinks);

static inline float round_to(float v, int bf16) {
    return bf16 ? bf16_to_f32(f32_to_bf16_rne(v)) : v;
}

static void round_all(float *x, int64_t n, int bf16) {
    if (!bf16) return;
    for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16_rne(x[i]));
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define GEMV_VECTOR 1
#else
#define GEMV_VECTOR 0
#endif

// y[m, n] = sum_k x[m, k] W[n, k] for m < M, n < N; x float32 [M, K], y float32 rows of
// stride ldy. Every output is summed in one fixed order, whatever M is and whichever tile
// computes it, so a row's result does not depend on what shares its step: (AVX2) two
// 8-wide accumulators over K in steps of 16 (the last 8-chunk into the first), their sum
// reduced, then the scalar tail. A thread reads its W rows one at a time (one contiguous
// stream: two rows read side by side cost 1.25x at one input, measured), each against the
// inputs four at a time, so each 8-wide W load feeds four FMAs. The four-input tile also
// prefetches the W row two ahead: with that much arithmetic per row the hardware
// prefetcher alone falls behind (0.8x the time at 8 inputs from DRAM; at one input the
// hint costs 1.1-1.2x, so the smaller tiles go without).
#if GEMV_VECTOR
#define GEMV_TILE(NAME, T, LOAD, LOAD8, MR, PREFETCH)                                         \
static inline void NAME(float *y, int64_t ldy, const float *x, const T *w, int n, int m,      \
                        int K) {                                                              \
    __m256 acc[MR][2];                                                                        \
    for (int c = 0; c < MR; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();                \
    const T *wn = w + (int64_t)n * K;                                                         \
    const float *xr[MR];                                                                      \
    for (int c = 0; c < MR; c++) xr[c] = x + (int64_t)(m + c) * K;                            \
    int k = 0;                                                                                \
    for (; k + 16 <= K; k += 16) {                                                            \
        if (PREFETCH) _mm_prefetch((const char *)(wn + k + 2 * (int64_t)K), _MM_HINT_T0);    \
        const __m256 w0 = LOAD8(wn + k), w1 = LOAD8(wn + k + 8);                              \
        for (int c = 0; c < MR; c++) {                                                        \
            acc[c][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[c] + k), w0, acc[c][0]);           \
            acc[c][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[c] + k + 8), w1, acc[c][1]);       \
        }                                                                                     \
    }                                                                                         \
    if (k + 8 <= K) {                                                                         \
        const __m256 w0 = LOAD8(wn + k);                                                      \
        for (int c = 0; c < MR; c++)                                                          \
            acc[c][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[c] + k), w0, acc[c][0]);           \
        k += 8;                                                                               \
    }                                                                                         \
    for (int c = 0; c < MR; c++) {                                                            \
        float sum = hsum8(_mm256_add_ps(acc[c][0], acc[c][1]));                               \
        for (int kk = k; kk < K; kk++) sum += xr[c][kk] * LOAD(wn, kk);                       \
        y[(int64_t)(m + c) * ldy + n] = sum;                                                  \
    }                                                                                         \
}

#define GEMV_ROW_TILES(NAME, T, LOAD, LOAD8)                                                  \
GEMV_TILE(NAME##_x4, T, LOAD, LOAD8, 4, 1)                                                    \
GEMV_TILE(NAME##_x2, T, LOAD, LOAD8, 2, 0)                                                    \
GEMV_TILE(NAME##_x1, T, LOAD, LOAD8, 1, 0)                                                    \
static inline void NAME##_row(float *y, int64_t ldy, const float *x, const T *w, int n, int m, \
                              int M, int K) {                                                 \
    for (; m + 4 <= M; m += 4) NAME##_x4(y, ldy, x, w, n, m, K);                              \
    for (; m + 2 <= M; m += 2) NAME##_x2(y, ldy, x, w, n, m, K);                              \
    if (m < M) NAME##_x1(y, ldy, x, w, n, m, K);                                              \
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// (AVX-512) The four 16-lane accumulators' sums, each in GEMV_TILE's order bit for bit:
// lane j of an accumulator is GEMV_TILE's acc[j / 8][j % 8], so its sum is the tree
// ((j, j + 8) pairs, then (i, i + 4), (i, i + 2), (0, 1)) that low + high and hsum8 add.
// Each level adds two of the accumulators' partial sums at once (an add is commutative, so
// the lanes' order within a level does not matter).
static inline __m128 reduce4_16(__m512 a, __m512 b, __m512 c, __m512 d) {
    // (j, j + 8): [a | b] and [c | d], 8 lanes each
    const __m512 ab =
        _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd =
        _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    // (i, i + 4): [a b c d], 4 lanes each
    const __m512 q =
        _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    // (i, i + 2), then (0, 1): the sums in lane 0 of each 128-bit lane
    const __m512 h = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));
    const __m512 s = _mm512_add_ps(h, _mm512_permute_ps(h, 0xB1));
    const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, s));
}

// The value is loaded into a register once: without this GCC folds a load that several FMAs
// use into each of them as a memory operand (28 loads per 24 FMAs in the 6 x 4 tile, bound
// by the load ports: 74 GFLOP/s at 32 rows, 91 with it, one thread of a Zen 4).
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))

// (AVX-512) R W rows against C inputs: each 16-wide W load (bfloat16 widened in the register)
// feeds C FMAs and each input load R, where GEMV_TILE's one-row tile is bound by its input
// loads (one per FMA). Every output is summed in GEMV_TILE's order, bit for bit: the 16-lane
// accumulator holds GEMV_TILE's two 8-wide ones (lane j = acc[j / 8][j % 8]), the last
// 8-chunk goes into the low half, reduce4_16 adds them up as low + high and hsum8 do, then
// the scalar tail. 6 x 4 (24 accumulators; the default model's N are multiples of 6, its
// M of 32 of 4) reads the inputs N / 6 times where 4 x 4 read them N / 4 times. Each step
// also prefetches pf_per_step of the pf_lines lines from pf toward L2 (the caller's next
// block of W rows, which comes from memory: the LM head's 113 MB ran at half the layers'
// rate without it). 1.3-1.5x the 4 x 4 tile's rate at 4-32 rows in float32, 1.7x in
// bfloat16, 1.6-1.9x on the LM head (bench/RESULTS.md, issue 51). R * C: a multiple of 4.
#define GEMV_TILE_RXC(NAME, T, LOAD, LOAD8, LOAD16, R, C)                                     \
static inline void NAME(float *y, int64_t ldy, const float *x, const T *w, int n, int m,      \
                        int K, const char *pf, int pf_lines, int pf_per_step) {               \
    __m512 acc[R][C];                                                                         \
    const T *wr[R];                                                                           \
    const float *xr[C];                                                                       \
    for (int i = 0; i < R; i++) {                                                             \
        wr[i] = w + (int64_t)(n + i) * K;                                                     \
        for (int c = 0; c < C; c++) acc[i][c] = _mm512_setzero_ps();                          \
    }                                                                                         \
    for (int c = 0; c < C; c++) xr[c] = x + (int64_t)(m + c) * K;                             \
    int k = 0;                                                                                \
    for (; k + 16 <= K; k += 16) {                                                            \
        __m512 xv[C];                                                                         \
        for (int c = 0; c < C; c++) xv[c] = _mm512_loadu_ps(xr[c] + k);                       \
        for (int j = 0; j < pf_per_step && pf_lines > 0; j++, pf_lines--, pf += 64)           \
            _mm_prefetch(pf, _MM_HINT_T1);                                                    \
        for (int r = 0; r < R; r++) {                                                         \
            __m512 wv = LOAD16(wr[r] + k);                                                    \
            KEEP_IN_REGISTER(wv);                                                             \
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xv[c], wv, acc[r][c]);    \
        }                                                                                     \
    }                                                                                         \
    if (k + 8 <= K) { /* the last 8-chunk: into the low half */                               \
        for (int r = 0; r < R; r++) {                                                         \
            const __m512 wv = _mm512_castps256_ps512(LOAD8(wr[r] + k));                       \
            for (int c = 0; c < C; c++)                                                       \
                acc[r][c] = _mm512_mask3_fmadd_ps(                                            \
                    _mm512_castps256_ps512(_mm256_loadu_ps(xr[c] + k)), wv, acc[r][c], 0xFF);  \
        }                                                                                     \
        k += 8;                                                                               \
    }                                                                                         \
    float sums[R * C];                                                                        \
    for (int i = 0; i < R * C; i += 4)                                                        \
        _mm_storeu_ps(sums + i, reduce4_16(acc[i / C][i % C], acc[(i + 1) / C][(i + 1) % C],   \
                                           acc[(i + 2) / C][(i + 2) % C],                     \
                                           acc[(i + 3) / C][(i + 3) % C]));                   \
    for (int r = 0; r < R; r++)                                                               \
        for (int c = 0; c < C; c++) {                                                         \
            float sum = sums[r * C + c];                                                      \
            for (int kk = k; kk < K; kk++) sum += xr[c][kk] * LOAD(wr[r], kk);                \
            y[(int64_t)(m + c) * ldy + n + r] = sum;                                          \
        }                                                                                     \
}

// Blocks of six W rows, split over the threads; inputs four at a time through the 6 x 4
// tile (the block's W rows stay in L1 across them), the rest (and N's last rows: four
// through the 4 x 4 tile, then one by one) row by row.
#define DEFINE_GEMV(NAME, T, LOAD, LOAD8, LOAD16)                                             \
GEMV_ROW_TILES(NAME, T, LOAD, LOAD8)                                                          \
GEMV_TILE_RXC(NAME##_6x4, T, LOAD, LOAD8, LOAD16, 6, 4)                                       \
GEMV_TILE_RXC(NAME##_4x4, T, LOAD, LOAD8, LOAD16, 4, 4)                                       \
static void NAME(float *y, int64_t ldy, const float *x, const T *w, int M, int N, int K) {    \
    _Pragma("omp parallel for schedule(static)")                                              \
    for (int nb = 0; nb < (N + 5) / 6; nb++) {                                                \
        const int n0 = 6 * nb, rows = N - n0 < 6 ? N - n0 : 6;                               \
        int m = 0, tiled = 0; /* rows n0..n0 + tiled: inputs 0..m done by a tile */           \
        if (rows == 6) {                                                                      \
            /* the next block's W lines, shared out over this block's tiles (with the T0    \
               hint the LM head ran 0.7x as fast at 4-8 rows) */                              \
            const char *next = (const char *)(w + (int64_t)(N - n0 >= 12 ? n0 + 6 : n0) * K);  \
            const int lines = N - n0 >= 12 ? (int)((6 * (int64_t)K * sizeof(T) + 63) / 64) : 0;  \
            const int tiles = M / 4, steps = K / 16 > 0 ? K / 16 : 1;                         \
            for (int t = 0; t < tiles; t++, m += 4) {                                         \
                const int lo = lines * t / tiles, hi = lines * (t + 1) / tiles;               \
                NAME##_6x4(y, ldy, x, w, n0, m, K, next + 64 * (int64_t)lo, hi - lo,          \
                           (hi - lo + steps - 1) / steps);                                    \
            }                                                                                 \
            tiled = 6;                                                                        \
        } else if (rows >= 4) {                                                               \
            for (; m + 4 <= M; m += 4) NAME##_4x4(y, ldy, x, w, n0, m, K, NULL, 0, 0);        \
            tiled = 4;                                                                        \
        }                                                                                     \
        /* one call site: GCC inlines it (at one input, 1.05x the time called) */              \
        for (int n = n0; n < n0 + rows; n++)                                                  \
            NAME##_row(y, ldy, x, w, n, n < n0 + tiled ? m : 0, M, K);                        \
    }                                                                                         \
}
#else
#define DEFINE_GEMV(NAME, T, LOAD, LOAD8, LOAD16)                                             \
GEMV_ROW_TILES(NAME, T, LOAD, LOAD8)                                                          \
static void NAME(float *y, int64_t ldy, const float *x, const T *w, int M, int N, int K) {    \
    _Pragma("omp parallel for schedule(static)")                                              \
    for (int n = 0; n < N; n++) NAME##_row(y, ldy, x, w, n, 0, M, K);                         \
}
#endif
#else
// Without AVX2: each output a plain sum over k, in order.
#define DEFINE_GEMV(NAME, T, LOAD, LOAD8, LOAD16)                                             \
static void NAME(float *y, int64_t ldy, const float *x, const T *w, int M, int N, int K) {    \
    _Pragma("omp parallel for schedule(static)")                                              \
    for (int n = 0; n < N; n++) {                                                             \
        const T *wn = w + (int64_t)n * K;                                                     \
        for (int m = 0; m < M; m++) {                                                         \
            const float *xm = x + (int64_t)m * K;                                             \
            float acc = 0.f;                                                                  \
            for (int k = 0; k < K; k++) acc += xm[k] * LOAD(wn, k);                           \
            y[(int64_t)m * ldy + n] = acc;                                                    \
        }                                                                                     \
    }                                                                                         \
}
#endif

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float load_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }

DEFINE_GEMV(gemv_f32, float, load_f32, load8_f32, load16_f32)
DEFINE_GEMV(gemv_bf16, uint16_t, load_bf16, load8_bf16, load16_bf16)

// y [M, N] (float32) = x W^T, each part of the matrix into its columns of y.
static void gemv(const stack_shape *s, float *y, const float *x, const stack_matrix *w, int M,
                 int N, int K) {
    for (int p = 0; p < w->num_parts; p++) {
        const stack_part *part = &w->parts[p];
        float *yp = y + part->row_offset;
        if (part->qtype == STACK_AMX_W8A8) {
            // float32 in and out; each row quantized alone, exact int32 sums: a row's result
            // does not depend on the rows beside it (the Python side checked AMX is granted)
            int status = 0;
            ((amx_linear_fn)s->amx_linear)(x, 0, K, M, K, (const int8_t *)part->w, (int)part->rows,
                                           part->wscale, NULL, yp, 0, N, &status);
        } else if (part->qtype != 0)
            ((kvq_linear_fn)s->kvq_linear)((int)part->qtype, (const uint8_t *)part->w, part->ldw,
                                           part->wscale, (int)part->rows, K, x, K, M, yp, N);
        else if (s->is_bf16)
            gemv_bf16(yp, N, x, (const uint16_t *)part->w, M, (int)part->rows, K);
        else
            gemv_f32(yp, N, x, (const float *)part->w, M, (int)part->rows, K);
    }
}

// y = x W^T (+ bias) for a few rows, in the model dtype: x [M, K], W [N, K], y [M, N]
// (contiguous), bias float32 [N] or NULL. The decode stack's GEMV as a linear layer.
#define DEFINE_SMALL_LINEAR(NAME, T, GEMV, LOAD, STORE_ROUNDED)                             \
void NAME(T *y, const T *x, const T *w, const float *bias, int M, int N, int K) {             \
    float *xf = (float *)malloc(sizeof(float) * (size_t)M * K);                                \
    float *yf = (float *)malloc(sizeof(float) * (size_t)M * N);                                \
    for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = LOAD(x, i);                          \
    GEMV(yf, N, xf, w, M, N, K);                                                              \
    for (int m = 0; m < M; m++)                                                               \
        for (int n = 0; n < N; n++) {                                                         \
            const float v = yf[(int64_t)m * N + n] + (bias ? bias[n] : 0.f);                  \
            STORE_ROUNDED(y, (int64_t)m * N + n, v);                                          \
        }                                                                                     \
    free(xf);                                                                                 \
    free(yf);                                                                                 \
}

static inline void store_f32(float *p, int64_t i, float v) { p[i] = v; }
static inline void store_bf16(uint16_t *p, int64_t i, float v) { p[i] = f32_to_bf16_rne(v); }

DEFINE_SMALL_LINEAR(small_linear_f32, float, gemv_f32, load_f32, store_f32)
DEFINE_SMALL_LINEAR(small_linear_bf16, uint16_t, gemv_bf16, load_bf16, store_bf16)

// The per-row stages (norms, bias + RoPE + the K/V write, SiLU-and-mul) split their rows over
// the threads from this many rows on: at 32-64 rows they cost as much as the W8A8 GEMMs.
#define PARALLEL_ROWS 8

// out[m] = rms_norm(x[m]) * weight, rounded; x float32 [M, H] (already rounded).
static void rms_norm_rows(float *out, const float *x, const float *weight, int M, int H,
                          float eps, int bf16) {
    // rows apart over the threads from PARALLEL_ROWS on (each row's arithmetic unchanged)
#pragma omp parallel for schedule(static) if (M >= PARALLEL_ROWS)
    for (int m = 0; m < M; m++) {
        const float *xm = x + (int64_t)m * H;
        float sum_sq = 0.f;
        _Pragma("omp simd reduction(+:sum_sq)")
        for (int i = 0; i < H; i++) sum_sq += xm[i] * xm[i];
        const float inv_rms = 1.f / sqrtf(sum_sq / H + eps);
        float *om = out + (int64_t)m * H;
        for (int i = 0; i < H; i++) om[i] = round_to(xm[i] * inv_rms * weight[i], bf16);
    }
}

// Neox RoPE of one [heads, D] row in place (float32), rounded.
static void rope_row(float *x, const float *cos, const float *sin, int heads, int D, int bf16) {
    const int half = D / 2;
    for (int h = 0; h < heads; h++) {
        float *xh = x + (int64_t)h * D;
        for (int i = 0; i < half; i++) {
            const float x1 = xh[i], x2 = xh[i + half];
            xh[i] = round_to(x1 * cos[i] - x2 * sin[i], bf16);
            xh[i + half] = round_to(x2 * cos[i] + x1 * sin[i], bf16);
        }
    }
}

static void store_row(void *dst, const float *src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16_rne(src[i]);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

static void load_row(float *dst, const void *src, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

// Runs layers[0..num_layers) for M decode tokens.
//   hidden, residual: [M, H] in the model dtype, in and out (as the module path's
//     (hidden_states, residual) pair); has_residual 0: the stack's first layer starts the
//     residual stream from hidden (the model's first layer).
//   positions, slots: [M] int64 (a slot < 0 is not written); block_table [M, table_stride]
//     int32; seq_lens [M] int32 (context after this step); token_rows [M] int64 = 0..M-1.
//   work: float32 [M * (3 H + (Hq + 2 Hkv) D + 3 Hq D + 3 I)] (kernels/decode_stack.py sizes it).
void decode_stack(const stack_layer *layers, int num_layers, const stack_shape *s, void *hidden,
                  void *residual, int has_residual, int M, const int64_t *positions,
                  const int64_t *slots, const int32_t *block_table, int64_t table_stride,
                  const int32_t *seq_lens, const int64_t *token_rows, float *work) {
    const int bf16 = (int)s->is_bf16;
    const int H = (int)s->hidden, D = (int)s->head_size, Hq = (int)s->num_heads;
    const int Hkv = (int)s->num_kv_heads, I = (int)s->intermediate;
    const int QD = Hq * D, KVD = Hkv * D, NQKV = QD + 2 * KVD;
    const int64_t slot_stride = KVD, block_stride = (int64_t)s->block_size * KVD;
    const size_t elem = bf16 ? 2 : 4;

    float *h = work;                     // [M, H] this layer's output / next layer's input
    float *res = h + (int64_t)M * H;     // [M, H] the residual stream
    float *xn = res + (int64_t)M * H;    // [M, H] normed input of a GEMV
    float *qkv = xn + (int64_t)M * H;    // [M, NQKV]
    float *attn = qkv + (int64_t)M * NQKV;  // [M, QD]
    void *q_t = attn + (int64_t)M * QD;     // [M, QD] model dtype: the attention's query
    void *o_t = (float *)q_t + (int64_t)M * QD;  // [M, QD] model dtype: its output
    float *gate_up = (float *)o_t + (int64_t)M * QD;  // [M, 2I]
    float *act = gate_up + (int64_t)M * 2 * I;        // [M, I]

    load_row(h, hidden, (int64_t)M * H, bf16);
    if (has_residual)
        load_row(res, residual, (int64_t)M * H, bf16);

    for (int l = 0; l < num_layers; l++) {
        const stack_layer *L = &layers[l];
        // Input norm, the residual add fused (rounded as the fused kernel rounds it).
        if (l == 0 && !has_residual) {
            memcpy(res, h, sizeof(float) * (size_t)M * H);
        } else {
            for (int64_t i = 0; i < (int64_t)M * H; i++) res[i] = round_to(h[i] + res[i], bf16);
        }
        rms_norm_rows(xn, res, L->input_norm, M, H, s->eps, bf16);

        // qkv, RoPE, the K/V write.
        gemv(s, qkv, xn, &L->qkv, M, NQKV, H);
#pragma omp parallel for schedule(static) if (M >= PARALLEL_ROWS)
        for (int m = 0; m < M; m++) {
            float *row = qkv + (int64_t)m * NQKV;
            for (int i = 0; i < NQKV; i++)
                row[i] = round_to(L->qkv_b ? row[i] + L->qkv_b[i] : row[i], bf16);
            const float *cos = L->cos_sin + positions[m] * D, *sin = cos + D / 2;
            rope_row(row, cos, sin, Hq, D, bf16);
            rope_row(row + QD, cos, sin, Hkv, D, bf16);
            store_row((char *)q_t + (size_t)m * QD * elem, row, QD, bf16);
            if (slots[m] >= 0) {
                const int64_t block = slots[m] / s->block_size, offset = slots[m] % s->block_size;
                const int64_t at = (block * block_stride + offset * slot_stride) * (int64_t)elem;
                store_row((char *)L->key_cache + at, row + QD, KVD, bf16);
                store_row((char *)L->value_cache + at, row + QD + KVD, KVD, bf16);
            }
        }

        // Attention over the paged cache, then o_proj.
        if (bf16)
            decode_attention_bf16((uint16_t *)o_t, (const uint16_t *)q_t, QD, D,
                                  (const uint16_t *)L->key_cache,
                                  (const uint16_t *)L->value_cache, block_stride, slot_stride,
                                  block_table, table_stride, seq_lens, token_rows, M, Hq, Hkv, D,
                                  (int)s->block_size, s->scale, (int)L->sliding_window,
                                  s->soft_cap, NULL);  // sinks: never on the stack
        else
            decode_attention_f32((float *)o_t, (const float *)q_t, QD, D,
                                 (const float *)L->key_cache, (const float *)L->value_cache,
                                 block_stride, slot_stride, block_table, table_stride, seq_lens,
                                 token_rows, M, Hq, Hkv, D, (int)s->block_size, s->scale,
                                 (int)L->sliding_window, s->soft_cap, NULL);
        load_row(attn, o_t, (int64_t)M * QD, bf16);
        gemv(s, h, attn, &L->o, M, H, QD);
        round_all(h, (int64_t)M * H, bf16);

        // Post-attention norm with the residual add, the MLP.
        for (int64_t i = 0; i < (int64_t)M * H; i++) res[i] = round_to(h[i] + res[i], bf16);
        rms_norm_rows(xn, res, L->post_norm, M, H, s->eps, bf16);
        gemv(s, gate_up, xn, &L->gate_up, M, 2 * I, H);
#pragma omp parallel for schedule(static) if (M >= PARALLEL_ROWS)
        for (int m = 0; m < M; m++) {
            const float *g = gate_up + (int64_t)m * 2 * I, *u = g + I;
            float *a = act + (int64_t)m * I;
            for (int i = 0; i < I; i++) {
                const float gate = round_to(g[i], bf16);
                const float silu = round_to(gate / (1.f + exp_approx(-gate)), bf16);
                a[i] = round_to(silu * round_to(u[i], bf16), bf16);
            }
        }
        gemv(s, h, act, &L->down, M, H, I);
        round_all(h, (int64_t)M * H, bf16);
    }
    store_row(hidden, h, (int64_t)M * H, bf16);
    store_row(residual, res, (int64_t)M * H, bf16);
}
