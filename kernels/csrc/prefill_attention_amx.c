// Prefill attention on AMX tiles (bfloat16): every prefill chunk of a step in one call.
//
// Built into the same library as decode_attention.c (kernels/cpu.py); on a CPU without AMX
// (or AVX512-BF16) the function is still there and returns -1, and the caller keeps torch's
// flash attention.
//
// For chunk c (request r, query rows [q0, q1), context_len = seq_len - (q1 - q0)), query head
// h and its KV head kh = h / (Hq / Hkv): row i of the chunk attends causally to keys
// [0, context_len + i], read through the block table as decode_attention.c does.
//
// Two passes, both OpenMP over work items:
// 1. Pack each (chunk, KV head)'s K and V once, for all the query heads of its group: K as
//    plain rows [keys][D] (an A tile is 16 keys x 32 d), V transposed into A tiles of 16 d
//    rows x 32 keys. Keys past seq_len are zeros.
// 2. Per (chunk, query head, block of 16 query rows): flash attention over 32-key blocks,
//    computed transposed so that the 16 query rows are the 16 lanes of a vector and the
//    softmax's reductions run down columns, not across lanes:
//      S^T [32 keys x 16 rows]  = K Q^T  (Q^T packed once per item as VNNI pairs along D)
//      online softmax per lane  (exp2 of S^T * scale * log2(e); running max and sum)
//      O^T [D x 16 rows]       += V^T P^T (P^T rounded to bfloat16 as VNNI pairs of keys)
//    O^T is kept in fp32 and rescaled by each block's correction. Key blocks wholly past the
//    block's last row are never visited; the diagonal blocks mask per lane.
//
// Tiles (all 16 rows x 64 bytes): tmm0 K or V^T (A), tmm1 a Q^T slice (B), tmm3 P^T (B),
// tmm4..tmm7 the fp32 products (S^T in tmm4/tmm5, then O^T partials in tmm4..tmm7).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(VEC_MATH_AVX512)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PREFILL_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MAX_HEAD_SIZE 256

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

static void configure_tiles(void) {
    tile_config cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

// 2^x for the softmax: x = n + f with |f| <= 1/2, 2^f by a degree-3 minimax polynomial
// (relative error under 8e-5, 50x under bfloat16's 4e-3: P is rounded to it), 2^n by scalef.
// Below -126 the result is ~0.
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(5.5171669e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4261115e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9326099e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992807e-1f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first_lanes(int n) {
    return n >= 16 ? (__mmask16)0xffff : (n <= 0 ? 0 : (__mmask16)((1u << n) - 1u));
}

// The lanes (query rows) that see a key `hidden` rows past the first row's position.
static inline __mmask16 visible(int hidden) { return (__mmask16)~first_lanes(hidden); }

// A 16 x 16 matrix of 32-bit words transposed in registers: x[i] holds row i, then column i.
static inline void transpose16(__m512i x[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of words
        t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // 4 x 4
        x[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        x[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        x[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        x[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // Now x[4 g + m] holds, in its 128-bit lane L, column 4 L + m of rows 4 g .. 4 g + 3:
    // a 4 x 4 transpose of 128-bit lanes puts column 4 L + m in x[4 L + m].
    for (int m = 0; m < 4; m++) {
        const __m512i u0 = _mm512_shuffle_i32x4(x[m], x[4 + m], 0x44);
        const __m512i u1 = _mm512_shuffle_i32x4(x[m], x[4 + m], 0xee);
        const __m512i u2 = _mm512_shuffle_i32x4(x[8 + m], x[12 + m], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(x[8 + m], x[12 + m], 0xee);
        t[m] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + m] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
        t[8 + m] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
    }
    for (int i = 0; i < 16; i++) x[i] = t[i];
}

typedef struct {
    const uint16_t *key_cache, *value_cache;
    int64_t kv_block_stride, kv_slot_stride;  // elements
    const int32_t *block_table;
    int64_t bt_stride;
    int Hkv, D, block_size;
} kv_source;

static inline const uint16_t *kv_row(const kv_source *s, const uint16_t *cache, const int32_t *bt,
                                     int key, int kvh) {
    return cache + (int64_t)bt[key / s->block_size] * s->kv_block_stride +
           (int64_t)(key % s->block_size) * s->kv_slot_stride + (int64_t)kvh * s->D;
}

// Keys [32 j, 32 j + 32) of one (chunk, KV head): their K rows into kc ([32][D]) and their
// V^T tiles into vt (D / 16 tiles of [16 d][32 keys]); keys at or past seq_len are zeros.
static void pack_block(const kv_source *s, const int32_t *bt, int kvh, int j, int seq_len,
                       uint16_t *kc, uint16_t *vt) {
    const int D = s->D;
    uint16_t v[32 * MAX_HEAD_SIZE] __attribute__((aligned(64)));
    for (int n = 0; n < 32; n++) {
        const int key = 32 * j + n;
        if (key < seq_len) {
            memcpy(kc + n * D, kv_row(s, s->key_cache, bt, key, kvh), (size_t)D * 2);
            memcpy(v + n * D, kv_row(s, s->value_cache, bt, key, kvh), (size_t)D * 2);
        } else {
            memset(kc + n * D, 0, (size_t)D * 2);
            memset(v + n * D, 0, (size_t)D * 2);
        }
    }
    // V^T: per 32 d (16 words), the words of keys 0..15 and of keys 16..31 transposed (a row
    // per d pair, a word per key), then each pair split into its even d and its odd d.
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36,
                                          34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6,
                                          4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int w0 = 0; w0 < D / 2; w0 += 16) {
        __m512i a[16], b[16];
        for (int n = 0; n < 16; n++) {
            a[n] = _mm512_load_si512(v + n * D + 2 * w0);
            b[n] = _mm512_load_si512(v + (16 + n) * D + 2 * w0);
        }
        transpose16(a);
        transpose16(b);
        for (int w = 0; w < 16; w++) {
            const int d = 2 * (w0 + w);
            _mm512_store_si512(vt + (d / 16) * 512 + (d % 16) * 32,
                               _mm512_permutex2var_epi16(a[w], even, b[w]));
            _mm512_store_si512(vt + ((d + 1) / 16) * 512 + ((d + 1) % 16) * 32,
                               _mm512_permutex2var_epi16(a[w], odd, b[w]));
        }
    }
}

// One half of an item: 16 query rows, one per lane.
typedef struct {
    __m512 m, l;     // running max (log2 units) and sum, per lane
    __mmask16 live;  // the lanes that are rows of the chunk
    int pos0;        // lane 0's position: it sees keys [0, pos0]
} half_state;

// The online softmax of one half over 32-key block j: S^T (st, [32 keys][16 lanes]) to P^T
// as VNNI pairs of keys (pt, 16 rows of 32 bf16); returns the correction of the earlier sum.
static inline __m512 softmax_block(half_state *h, const float *st, uint16_t *pt, int j, __m512 c,
                                   __m512i pairs) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    // Key 32 j + n is visible to lane i where 32 j + n <= pos0 + i: all of them but on the
    // diagonal blocks. Lanes past `live` (zero queries) are never stored.
    const int diagonal = 32 * j + 31 > h->pos0;
    __m512 bmax = ninf;
    if (diagonal) {
        for (int n = 0; n < 32; n++)
            bmax = _mm512_mask_max_ps(bmax, visible(32 * j + n - h->pos0) & h->live, bmax,
                                      _mm512_load_ps(st + 16 * n));
    } else {
        for (int n = 0; n < 32; n++) bmax = _mm512_max_ps(bmax, _mm512_load_ps(st + 16 * n));
    }
    const __m512 m_new = _mm512_max_ps(h->m, _mm512_mul_ps(bmax, c));
    // Lanes that have seen no key yet keep max -inf: subtract 0 there (their p is 0).
    const __mmask16 seen = _mm512_cmp_ps_mask(m_new, ninf, _CMP_NEQ_OQ);
    const __m512 base = _mm512_maskz_mov_ps(seen, m_new);
    const __m512 alpha = _mm512_maskz_mov_ps(seen, exp2_16(_mm512_sub_ps(h->m, base)));
    __m512 sum = _mm512_setzero_ps();
    for (int r = 0; r < 16; r++) {
        __m512 p0 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(st + 32 * r), c, base));
        __m512 p1 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(st + 32 * r + 16), c, base));
        if (diagonal) {
            p0 = _mm512_maskz_mov_ps(visible(32 * j + 2 * r - h->pos0) & h->live, p0);
            p1 = _mm512_maskz_mov_ps(visible(32 * j + 2 * r + 1 - h->pos0) & h->live, p1);
        }
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        // [p0 lanes, p1 lanes] as bfloat16, then interleaved: lane n's pair (p0, p1).
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
        _mm512_store_si512(pt + 32 * r, _mm512_permutexvar_epi16(pairs, both));
    }
    h->l = _mm512_fmadd_ps(h->l, alpha, sum);
    h->m = m_new;
    return alpha;
}

// Q^T of up to 16 query rows as D / 32 B tiles: tile t, row r, column n = the pair
// d = 32 t + 2 r, + 1 of row n (rows past `rows` zero).
static void pack_queries(uint32_t *qt, const uint16_t *query, int64_t q_token_stride, int rows,
                         int D) {
    for (int t = 0; t < D / 32; t++) {
        __m512i x[16];
        for (int n = 0; n < 16; n++)
            x[n] = n < rows ? _mm512_loadu_si512(query + (int64_t)n * q_token_stride + 32 * t)
                            : _mm512_setzero_si512();
        transpose16(x);
        for (int r = 0; r < 16; r++) _mm512_store_si512(qt + t * 256 + r * 16, x[r]);
    }
}

// out[i][:] = acc[:][i] / l[i] for the half's rows: O^T's columns back to rows, as bf16.
static void store_half(uint16_t *out, int64_t out_token_stride, const float *acc, __m512 l,
                       int rows, int D) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int v = 0; v < D / 16; v++) {  // 16 d at a time
        __m512i x[16];
        for (int d = 0; d < 16; d++)
            x[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(acc + 16 * (16 * v + d)), inv));
        transpose16(x);
        for (int i = 0; i < rows; i++)
            vm_store16_bf16(out + (int64_t)i * out_token_stride + 16 * v, _mm512_castsi512_ps(x[i]),
                            0xffff);
    }
}

// One item: up to 32 query rows of one head, rows [0, rows) of `query` (row stride
// q_token_stride), the first at position pos0 (context_len plus its offset in the chunk). Its
// two halves of 16 rows run through the tiles side by side: each K and V^T tile loaded serves
// both, and the four independent products per step keep the tile unit busy.
static void attend_rows(uint16_t *out, int64_t out_token_stride, const uint16_t *query,
                        int64_t q_token_stride, int rows, int pos0, const uint16_t *kc,
                        const uint16_t *vt, int D, float scale_log2) {
    const int dt = D / 32, dv = D / 16;
    uint32_t qt[2][MAX_HEAD_SIZE / 32 * 256] __attribute__((aligned(64)));  // Q^T, VNNI
    float st[2][32 * 16] __attribute__((aligned(64)));                       // S^T
    uint16_t pt[2][16 * 32] __attribute__((aligned(64)));                    // P^T, VNNI
    float pv[2][MAX_HEAD_SIZE * 16] __attribute__((aligned(64)));            // O^T partials
    float acc[2][MAX_HEAD_SIZE * 16] __attribute__((aligned(64)));           // O^T
    const int rows_b = rows > 16 ? rows - 16 : 0;
    pack_queries(qt[0], query, q_token_stride, rows - rows_b, D);
    pack_queries(qt[1], query + 16 * q_token_stride, q_token_stride, rows_b, D);
    memset(acc, 0, sizeof acc);
    const __m512 c = _mm512_set1_ps(scale_log2), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    half_state half[2] = {{ninf, _mm512_setzero_ps(), first_lanes(rows - rows_b), pos0},
                          {ninf, _mm512_setzero_ps(), first_lanes(rows_b), pos0 + 16}};
    const int key_end = pos0 + rows;  // the last row's keys: [0, key_end)
    const int num_blocks = (key_end + 31) / 32;
    for (int j = 0; j < num_blocks; j++) {
        const uint16_t *k = kc + (int64_t)j * 32 * D;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int t = 0; t < dt; t++) {
            _tile_loadd(0, k + 32 * t, D * 2);           // keys 0..15 of the block
            _tile_loadd(3, k + 16 * D + 32 * t, D * 2);  // keys 16..31
            _tile_loadd(1, qt[0] + t * 256, 64);
            _tile_loadd(2, qt[1] + t * 256, 64);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 3, 1);
            _tile_dpbf16ps(6, 0, 2);
            _tile_dpbf16ps(7, 3, 2);
        }
        _tile_stored(4, st[0], 64);
        _tile_stored(5, st[0] + 256, 64);
        _tile_stored(6, st[1], 64);
        _tile_stored(7, st[1] + 256, 64);
        const __m512 alpha0 = softmax_block(&half[0], st[0], pt[0], j, c, pairs);
        const __m512 alpha1 = softmax_block(&half[1], st[1], pt[1], j, c, pairs);
        _tile_loadd(1, pt[0], 64);
        _tile_loadd(2, pt[1], 64);
        const uint16_t *v = vt + (int64_t)j * dv * 512;
        for (int c2 = 0; c2 < dv; c2 += 2) {  // two d-tiles of both halves per step
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            _tile_loadd(0, v + (int64_t)c2 * 512, 64);
            _tile_loadd(3, v + (int64_t)(c2 + 1) * 512, 64);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 3, 1);
            _tile_dpbf16ps(6, 0, 2);
            _tile_dpbf16ps(7, 3, 2);
            _tile_stored(4, pv[0] + 256 * c2, 64);
            _tile_stored(5, pv[0] + 256 * (c2 + 1), 64);
            _tile_stored(6, pv[1] + 256 * c2, 64);
            _tile_stored(7, pv[1] + 256 * (c2 + 1), 64);
        }
        for (int d = 0; d < D; d++) {
            float *a0 = acc[0] + 16 * d, *a1 = acc[1] + 16 * d;
            _mm512_store_ps(a0, _mm512_fmadd_ps(_mm512_load_ps(a0), alpha0,
                                                _mm512_load_ps(pv[0] + 16 * d)));
            _mm512_store_ps(a1, _mm512_fmadd_ps(_mm512_load_ps(a1), alpha1,
                                                _mm512_load_ps(pv[1] + 16 * d)));
        }
    }
    store_half(out, out_token_stride, acc[0], half[0].l, rows - rows_b, D);
    if (rows_b)
        store_half(out + 16 * out_token_stride, out_token_stride, acc[1], half[1].l, rows_b, D);
}

// Head size 64, 16 query rows: O^T's four tiles stay in tmm4..tmm7 across the key blocks.
// The running max moves lazily: a lane's max is raised only when a block's scores pass it by
// more than LAZY_MAX (log2 units; its p then stay under 2^LAZY_MAX), and only then are the
// tiles stored, rescaled and loaded back. S^T lands in tmm2/tmm3.
#define LAZY_MAX 8.0f

// S^T [32 keys][16 lanes] of one key block (kc: its 32 K rows) into st, through tmm2/tmm3.
static inline void scores_d64(float *st, const uint32_t *qt, const uint16_t *k) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(1, qt, 64);
    _tile_loadd(0, k, 128);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(0, k + 16 * 64, 128);
    _tile_dpbf16ps(3, 0, 1);
    _tile_loadd(1, qt + 256, 64);
    _tile_loadd(0, k + 32, 128);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(0, k + 16 * 64 + 32, 128);
    _tile_dpbf16ps(3, 0, 1);
    _tile_stored(2, st, 64);
    _tile_stored(3, st + 256, 64);
}
static void attend_rows_d64(uint16_t *out, int64_t out_token_stride, const uint16_t *query,
                            int64_t q_token_stride, int rows, int pos0, const uint16_t *kc,
                            const uint16_t *vt, float scale_log2) {
    enum { D = 64 };
    uint32_t qt[2 * 256] __attribute__((aligned(64)));  // Q^T, VNNI
    float st[2][32 * 16] __attribute__((aligned(64)));  // S^T, this block and the next
    uint16_t pt[16 * 32] __attribute__((aligned(64)));  // P^T, VNNI
    float acc[D * 16] __attribute__((aligned(64)));     // O^T, when stored
    pack_queries(qt, query, q_token_stride, rows, D);
    const __m512 c = _mm512_set1_ps(scale_log2), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 lazy = _mm512_set1_ps(LAZY_MAX);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    const __mmask16 live = first_lanes(rows);
    __m512 m = ninf, l = _mm512_setzero_ps();
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const int num_blocks = (pos0 + rows + 31) / 32;
    scores_d64(st[0], qt, kc);
    for (int j = 0; j < num_blocks; j++) {
        // S^T of the next block first: the tile unit works on it while the vector unit runs
        // this block's softmax.
        if (j + 1 < num_blocks) scores_d64(st[(j + 1) & 1], qt, kc + (int64_t)(j + 1) * 32 * D);
        const float *s = st[j & 1];
        const int diagonal = 32 * j + 31 > pos0;
        __m512 bmax = ninf;
        if (diagonal) {
            for (int n = 0; n < 32; n++)
                bmax = _mm512_mask_max_ps(bmax, visible(32 * j + n - pos0) & live, bmax,
                                          _mm512_load_ps(s + 16 * n));
        } else {
            for (int n = 0; n < 32; n++) bmax = _mm512_max_ps(bmax, _mm512_load_ps(s + 16 * n));
        }
        bmax = _mm512_mul_ps(bmax, c);
        // Raise the max where the block passes it by more than LAZY_MAX (or the lane had none).
        const __mmask16 raise = _mm512_cmp_ps_mask(bmax, _mm512_add_ps(m, lazy), _CMP_GT_OQ);
        if (raise) {
            const __m512 m_new = _mm512_mask_mov_ps(m, raise, bmax);
            const __mmask16 seen = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);
            const __m512 alpha = _mm512_maskz_mov_ps(seen, exp2_16(_mm512_sub_ps(m, m_new)));
            l = _mm512_mul_ps(l, alpha);
            if (seen) {  // O^T holds sums at the old max: rescale it
                _tile_stored(4, acc, 64);
                _tile_stored(5, acc + 256, 64);
                _tile_stored(6, acc + 512, 64);
                _tile_stored(7, acc + 768, 64);
                for (int d = 0; d < D; d++)
                    _mm512_store_ps(acc + 16 * d,
                                    _mm512_mul_ps(_mm512_load_ps(acc + 16 * d), alpha));
                _tile_loadd(4, acc, 64);
                _tile_loadd(5, acc + 256, 64);
                _tile_loadd(6, acc + 512, 64);
                _tile_loadd(7, acc + 768, 64);
            }
            m = m_new;
        }
        // Lanes that have seen no key yet keep max -inf: subtract 0 there (their p is 0).
        const __m512 base = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ), m);
        __m512 sum = _mm512_setzero_ps();
        for (int r = 0; r < 16; r++) {
            __m512 p0 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(s + 32 * r), c, base));
            __m512 p1 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(s + 32 * r + 16), c, base));
            if (diagonal) {
                p0 = _mm512_maskz_mov_ps(visible(32 * j + 2 * r - pos0) & live, p0);
                p1 = _mm512_maskz_mov_ps(visible(32 * j + 2 * r + 1 - pos0) & live, p1);
            }
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            _mm512_store_si512(pt + 32 * r, _mm512_permutexvar_epi16(pairs, both));
        }
        l = _mm512_add_ps(l, sum);
        const uint16_t *v = vt + (int64_t)j * 4 * 512;
        // V^T tiles rotate through tmm0, tmm2, tmm3 (free once S^T is stored): no load waits
        // on the product before it.
        _tile_loadd(1, pt, 64);
        _tile_loadd(0, v, 64);
        _tile_loadd(2, v + 512, 64);
        _tile_loadd(3, v + 1024, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 2, 1);
        _tile_dpbf16ps(6, 3, 1);
        _tile_loadd(0, v + 1536, 64);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, acc, 64);
    _tile_stored(5, acc + 256, 64);
    _tile_stored(6, acc + 512, 64);
    _tile_stored(7, acc + 768, 64);
    store_half(out, out_token_stride, acc, l, rows, D);
}

#endif  // AMX tiles, AMX-BF16, AVX512-BF16

int prefill_attention_amx_bf16(uint16_t *out, const uint16_t *query, int64_t q_token_stride,
                               int64_t q_head_stride, const uint16_t *key_cache,
                               const uint16_t *value_cache, int64_t kv_block_stride,
                               int64_t kv_slot_stride, const int32_t *block_table,
                               int64_t bt_stride, const int32_t *chunk_reqs,
                               const int32_t *query_start_loc, const int32_t *seq_lens,
                               int num_chunks, int Hq, int Hkv, int D, int block_size,
                               float scale) {
#ifdef PREFILL_AMX
    if (D % 64 != 0 || D > MAX_HEAD_SIZE || Hq % Hkv != 0 || !amx_permitted()) return -1;
    const kv_source src = {key_cache, value_cache, kv_block_stride, kv_slot_stride,
                           block_table, bt_stride, Hkv, D, block_size};
    const int group = Hq / Hkv;
    // Per chunk: its 32-key blocks, the offset of its packed K/V, the first of its work items.
    int64_t *pack_off = malloc(sizeof(int64_t) * (num_chunks + 1));
    int64_t *item_off = malloc(sizeof(int64_t) * (num_chunks + 1));
    int64_t *block_off = malloc(sizeof(int64_t) * (num_chunks + 1));
    if (!pack_off || !item_off || !block_off) {
        free(pack_off), free(item_off), free(block_off);
        return -1;
    }
    pack_off[0] = item_off[0] = block_off[0] = 0;
    for (int c = 0; c < num_chunks; c++) {
        const int r = chunk_reqs[c];
        const int qlen = query_start_loc[r + 1] - query_start_loc[r];
        const int nb = (seq_lens[r] + 31) / 32;
        pack_off[c + 1] = pack_off[c] + (int64_t)Hkv * nb * 32 * D;  // elements, K (and V)
        block_off[c + 1] = block_off[c] + (int64_t)Hkv * nb;
        item_off[c + 1] = item_off[c] + (int64_t)Hq * ((qlen + 31) / 32);
    }
    // The packed K/V live in a buffer kept per calling thread, grown as needed and never
    // returned: a step's call would otherwise fault its pages in afresh every layer.
    static __thread uint16_t *workspace;
    static __thread size_t workspace_elems;
    const size_t need = 2 * (size_t)pack_off[num_chunks];
    if (need > workspace_elems) {
        free(workspace);
        workspace_elems = need + need / 4;
        workspace = aligned_alloc(64, (sizeof(uint16_t) * workspace_elems + 63) / 64 * 64);
        if (!workspace) {
            workspace_elems = 0;
            free(pack_off), free(item_off), free(block_off);
            return -1;
        }
    }
    uint16_t *kpack = workspace, *vpack = workspace + pack_off[num_chunks];
    const int64_t num_blocks = block_off[num_chunks], num_items = item_off[num_chunks];
    const float scale_log2 = scale * 1.44269504088896341f;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks; b++) {
            int c = 0;
            while (block_off[c + 1] <= b) c++;
            const int r = chunk_reqs[c], nb = (seq_lens[r] + 31) / 32;
            const int kvh = (int)((b - block_off[c]) / nb), j = (int)((b - block_off[c]) % nb);
            const int64_t head = pack_off[c] + (int64_t)kvh * nb * 32 * D;
            pack_block(&src, block_table + (int64_t)r * bt_stride, kvh, j, seq_lens[r],
                       kpack + head + (int64_t)j * 32 * D, vpack + head + (int64_t)j * 32 * D);
        }
        configure_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; it++) {
            int c = 0;
            while (item_off[c + 1] <= it) c++;
            const int r = chunk_reqs[c], q0 = query_start_loc[r];
            const int qlen = query_start_loc[r + 1] - q0, nqb = (qlen + 31) / 32;
            const int nb = (seq_lens[r] + 31) / 32;
            const int h = (int)((it - item_off[c]) / nqb), qb = (int)((it - item_off[c]) % nqb);
            const int kvh = h / group, row0 = 32 * qb;
            const int rows = qlen - row0 < 32 ? qlen - row0 : 32;
            const int64_t head = pack_off[c] + (int64_t)kvh * nb * 32 * D;
            uint16_t *o = out + ((int64_t)(q0 + row0) * Hq + h) * D;
            const uint16_t *q =
                query + (int64_t)(q0 + row0) * q_token_stride + (int64_t)h * q_head_stride;
            const int pos0 = seq_lens[r] - qlen + row0;
            const int64_t out_stride = (int64_t)Hq * D;
            if (D == 64) {
                attend_rows_d64(o, out_stride, q, q_token_stride, rows < 16 ? rows : 16, pos0,
                                kpack + head, vpack + head, scale_log2);
                if (rows > 16)
                    attend_rows_d64(o + 16 * out_stride, out_stride, q + 16 * q_token_stride,
                                    q_token_stride, rows - 16, pos0 + 16, kpack + head,
                                    vpack + head, scale_log2);
            } else {
                attend_rows(o, out_stride, q, q_token_stride, rows, pos0, kpack + head,
                            vpack + head, D, scale_log2);
            }
        }
        _tile_release();
    }
    free(pack_off), free(item_off), free(block_off);
    return 0;
#else
    (void)out, (void)query, (void)q_token_stride, (void)q_head_stride, (void)key_cache;
    (void)value_cache, (void)kv_block_stride, (void)kv_slot_stride, (void)block_table;
    (void)bt_stride, (void)chunk_reqs, (void)query_start_loc, (void)seq_lens, (void)num_chunks;
    (void)Hq, (void)Hkv, (void)D, (void)block_size, (void)scale;
    return -1;  // no AMX tiles (or no AVX512-BF16) on the CPU this was built for
#endif
}
