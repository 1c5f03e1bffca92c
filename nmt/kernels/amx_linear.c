/* bf16 and int8 linear layers y = x W^T + b on Intel AMX tiles, one compiled kernel for
 * every shape.
 *
 * Why: oneDNN (what PyTorch's bf16 linears run) compiles a new kernel for every row count
 * it meets, and beam search meets a new row count at almost every step, in every worker
 * process afresh and, with a shortlist, for every batch's width.
 * This kernel is compiled once (nmt/native.py) and takes any rows x K -> N with K a
 * multiple of 32 (nmt/inference/amx_linear.py checks and packs).
 *
 * Operations (P_OP):
 * - OP_PACK: W (N, K) bf16 row-major -> the tile layout below, N padded to a multiple of 32
 *   with zero rows: block (nb, kb) of 16 outputs x 32 inputs is 16 rows of 64 bytes, row kp
 *   holding for each output n the pair W[n][2kp], W[n][2kp+1] (AMX's "VNNI" pairs).
 * - OP_LINEAR: x (M, K) bf16 (rows `ldx` apart) times the packed W, plus an optional bias
 *   (N,) bf16, rounded to bf16 into y (M, N) (rows `ldy` apart). Accumulation in fp32 by
 *   32-input blocks, as oneDNN's AMX kernels do, so results agree to bf16 rounding.
 *
 * - OP_PACK_I8: W (N, K) int8 row-major -> tiles as above with int8 quads: block (nb, kb) of
 *   16 outputs x 64 inputs is 16 rows of 64 bytes, row kq holding for each output n the
 *   four W[n][4kq .. 4kq+3].
 * - OP_LINEAR_I8: x (M, K) float32 (rows `ldx` apart), each row quantized to int8 with its
 *   own scale (absmax / 127, symmetric, as CTranslate2 quantizes activations), times the
 *   packed int8 W (per-output scales P_SCALE, float32) with int32 accumulation (tdpbssd:
 *   signed x signed, so no zero point or compensation term), rescaled, plus an optional
 *   float32 bias, into y (M, N) float32 (rows `ldy` apart). K a multiple of 64.
 *
 * Blocking: 32 outputs x 32 rows per pass over K (four 16x16 fp32 accumulator tiles, two
 * tiles of x, two of W); within a chunk of rows that the L2 cache holds, the output blocks
 * are the outer loop (W is read once per chunk, x stays in cache) and are shared among
 * `threads` OpenMP threads. The last, partial block of rows is copied into a zero-padded
 * buffer first, so no tile reads past x.
 */
#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define NMT_AMX 1
#if defined(__AMX_INT8__)
#define NMT_AMX_INT8 1
#endif
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum {
    P_OP, P_X, P_M, P_K, P_LDX, P_W, P_N, P_BIAS, P_Y, P_LDY, P_THREADS, P_SCALE,
    P_COUNT
};

enum { OP_AVAILABLE = 0, OP_PACK = 1, OP_LINEAR = 2, OP_AVAILABLE_I8 = 3, OP_PACK_I8 = 4,
       OP_LINEAR_I8 = 5 };

int64_t nmt_amx_linear_params(void) { return P_COUNT; }

#ifdef NMT_AMX

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The tile configuration: palette 1, tiles 0-3 accumulators (16 rows x 64 bytes of fp32),
 * 4-5 rows of x, 6-7 blocks of W (16 rows x 64 bytes each). */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Linux hands out AMX state only to a process that asked (once; forked children inherit). */
static int permitted(void) {
    static int state = 0; /* 0 unknown, 1 yes, -1 no */
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

static void pack(const bf16_t *w, int64_t n, int64_t k, bf16_t *out) {
    int64_t np = (n + 31) / 32 * 32, kb_count = k / 32;
    for (int64_t nb = 0; nb < np / 16; nb++)
        for (int64_t kb = 0; kb < kb_count; kb++) {
            bf16_t *tile = out + (nb * kb_count + kb) * 512;
            for (int64_t kp = 0; kp < 16; kp++)
                for (int64_t j = 0; j < 16; j++) {
                    int64_t row = nb * 16 + j, col = kb * 32 + 2 * kp;
                    tile[kp * 32 + 2 * j] = row < n ? w[row * k + col] : 0;
                    tile[kp * 32 + 2 * j + 1] = row < n ? w[row * k + col + 1] : 0;
                }
        }
}

/* Rows [0, rows) of one 16x16 fp32 accumulator block (`acc`, 16 floats a row) plus bias
 * -> bf16 columns [0, cols) of y. */
static inline void store(const float *acc, int64_t rows, int64_t cols, const bf16_t *bias,
                         bf16_t *y, int64_t ldy) {
    __mmask16 mask = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b);
        __m256bh h = _mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)h);
    }
}

/* The accumulators of one block of up to 32 rows x 32 outputs into `acc` (four 16 x 16
 * tiles of 4-byte sums, 256 each: rows 0-15 then 16-31, outputs 0-15 then 16-31; the last
 * two only when rows > 16): DP (the tile product: _tile_dpbf16ps, _tile_dpbssd) over
 * `kb_count` steps of 64 bytes of K, x's rows from `a` (`ldab` bytes apart, 32 rows
 * readable), W's two halves from `wb` and `wb1` (1,024 bytes a step). */
#define ACCUMULATE(DP, a, ldab, rows, wb, wb1, kb_count, acc)                             \
    do {                                                                                 \
        _tile_zero(0);                                                                   \
        _tile_zero(1);                                                                   \
        if ((rows) > 16) {                                                               \
            _tile_zero(2);                                                               \
            _tile_zero(3);                                                               \
        }                                                                                \
        for (int64_t kb = 0; kb < (kb_count); kb++) {                                    \
            _tile_loadd(4, (const char *)(a) + kb * 64, (ldab));                         \
            _tile_loadd(6, (const char *)(wb) + kb * 1024, 64);                          \
            _tile_loadd(7, (const char *)(wb1) + kb * 1024, 64);                         \
            DP(0, 4, 6);                                                                 \
            DP(1, 4, 7);                                                                 \
            if ((rows) > 16) {                                                           \
                _tile_loadd(5, (const char *)(a) + 16 * (ldab) + kb * 64, (ldab));       \
                DP(2, 5, 6);                                                             \
                DP(3, 5, 7);                                                             \
            }                                                                            \
        }                                                                                \
        _tile_stored(0, (acc), 64);                                                      \
        _tile_stored(1, (acc) + 256, 64);                                                \
        if ((rows) > 16) {                                                               \
            _tile_stored(2, (acc) + 512, 64);                                            \
            _tile_stored(3, (acc) + 768, 64);                                            \
        }                                                                                \
    } while (0)

/* Quarter q (0-3) of a block of `rows` x outputs [n0, n0 + 32) of n: its first row (0 or
 * 16), first output (0 or 16), and how many of each it holds (0 or fewer: none). */
static inline void quarter(int q, int64_t rows, int64_t n0, int64_t n, int64_t *r,
                           int64_t *c, int64_t *nr, int64_t *nc) {
    *r = q < 2 ? 0 : 16;
    *c = (q & 1) * 16;
    *nr = rows - *r < 16 ? rows - *r : 16;
    *nc = n - n0 - *c < 16 ? n - n0 - *c : 16;
}

/* y rows [m0, m0 + rows) (rows <= 32), outputs [n0, n0 + 32) of n, from tiles of x rows
 * `a` (32 rows, `lda` elements apart, zero-padded past `rows` or readable) and the packed
 * blocks of W from `wb` (output block pair n0 / 16). */
static inline void block(const bf16_t *a, int64_t lda, int64_t rows, const bf16_t *wb,
                         int64_t kb_count, int64_t n0, int64_t n, const bf16_t *bias,
                         bf16_t *y, int64_t ldy, float *acc) {
    ACCUMULATE(_tile_dpbf16ps, a, lda * 2, rows, wb, wb + kb_count * 512, kb_count, acc);
    for (int q = 0; q < 4; q++) {
        int64_t r, c, nr, nc;
        quarter(q, rows, n0, n, &r, &c, &nr, &nc);
        if (nr > 0 && nc > 0)
            store(acc + q * 256, nr, nc, bias ? bias + n0 + c : NULL, y + r * ldy + n0 + c,
                  ldy);
    }
}

/* Rows of x per chunk, a multiple of 32: 128 K elements, which the core's L2 cache keeps
 * while every output block passes over them. */
static inline int64_t chunk_rows(int64_t k) {
    int64_t chunk = (128 * 1024 / k) / 32 * 32;
    return chunk < 32 ? 32 : chunk;
}

static int linear(const int64_t *p) {
    const bf16_t *x = (const bf16_t *)p[P_X], *w = (const bf16_t *)p[P_W];
    const bf16_t *bias = (const bf16_t *)p[P_BIAS];
    bf16_t *y = (bf16_t *)p[P_Y];
    int64_t m = p[P_M], k = p[P_K], ldx = p[P_LDX], n = p[P_N], ldy = p[P_LDY];
    int64_t kb_count = k / 32, pairs = (n + 31) / 32, full = m / 32 * 32;
    int threads = (int)p[P_THREADS];
    if (m <= 0 || n <= 0)
        return 0;
    /* The last rows, fewer than 32, zero-padded: tiles read 16 or 32 whole rows. */
    bf16_t *tail = NULL;
    if (full < m) {
        tail = (bf16_t *)calloc((size_t)(32 * k), sizeof(bf16_t));
        if (!tail)
            return 1;
        for (int64_t r = full; r < m; r++)
            memcpy(tail + (r - full) * k, x + r * ldx, (size_t)k * sizeof(bf16_t));
    }
    int64_t chunk = chunk_rows(k); /* 256 KB of bf16 x */
    if (threads < 1 || pairs < 2 * threads)
        threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float acc[1024] __attribute__((aligned(64)));
        configure();
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
            int64_t c1 = c0 + chunk < full ? c0 + chunk : full;
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < pairs; pair++) {
                const bf16_t *wb = w + pair * 2 * kb_count * 512;
                for (int64_t m0 = c0; m0 < c1; m0 += 32)
                    block(x + m0 * ldx, ldx, 32, wb, kb_count, pair * 32, n, bias,
                          y + m0 * ldy, ldy, acc);
                if (tail && c0 + chunk >= m)
                    block(tail, k, m - full, wb, kb_count, pair * 32, n, bias,
                          y + full * ldy, ldy, acc);
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}


#ifdef NMT_AMX_INT8

static void pack_i8(const int8_t *w, int64_t n, int64_t k, int8_t *out) {
    int64_t np = (n + 31) / 32 * 32, kb_count = k / 64;
    for (int64_t nb = 0; nb < np / 16; nb++)
        for (int64_t kb = 0; kb < kb_count; kb++) {
            int8_t *tile = out + (nb * kb_count + kb) * 1024;
            for (int64_t kq = 0; kq < 16; kq++)
                for (int64_t j = 0; j < 16; j++)
                    for (int64_t i = 0; i < 4; i++) {
                        int64_t row = nb * 16 + j, col = kb * 64 + 4 * kq + i;
                        tile[kq * 64 + 4 * j + i] = row < n ? w[row * k + col] : 0;
                    }
        }
}

/* Row x (k floats, k a multiple of 16) -> k int8 in q, round(x * 127 / absmax) (ties to
 * even); returns the row's scale absmax / 127 (0 for an all-zero row, whose q is 0). */
static inline float quantize_row(const float *x, int64_t k, int8_t *q) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    float a = _mm512_reduce_max_ps(amax);
    __m512 inv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    for (int64_t i = 0; i < k; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(v));
    }
    return a / 127.0f;
}

/* Rows [0, rows) of one 16x16 int32 accumulator block (`acc`) -> float32 columns [0, cols)
 * of y: acc * row scale * column scale + bias. */
static inline void store_i8(const int32_t *acc, int64_t rows, int64_t cols, const float *xs,
                            const float *ws, const float *bias, float *y, int64_t ldy) {
    __mmask16 mask = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    __m512 w = _mm512_maskz_loadu_ps(mask, ws);
    __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + r * 16));
        v = _mm512_fmadd_ps(_mm512_mul_ps(v, _mm512_set1_ps(xs[r])), w, b);
        _mm512_mask_storeu_ps(y + r * ldy, mask, v);
    }
}

/* y rows [m0, m0 + rows) (rows <= 32), outputs [n0, n0 + 32) of n, from the quantized x
 * rows `a` (32 rows of k bytes, zero past `rows`), their scales `xs`, and the packed
 * blocks of W from `wb` (output block pair n0 / 16). */
static inline void block_i8(const int8_t *a, int64_t k, int64_t rows, const float *xs,
                            const int8_t *wb, int64_t kb_count, int64_t n0, int64_t n,
                            const float *ws, const float *bias, float *y, int64_t ldy,
                            int32_t *acc) {
    ACCUMULATE(_tile_dpbssd, a, k, rows, wb, wb + kb_count * 1024, kb_count, acc);
    for (int q = 0; q < 4; q++) {
        int64_t r, c, nr, nc;
        quarter(q, rows, n0, n, &r, &c, &nr, &nc);
        if (nr > 0 && nc > 0)
            store_i8(acc + q * 256, nr, nc, xs + r, ws + n0 + c, bias ? bias + n0 + c : NULL,
                     y + r * ldy + n0 + c, ldy);
    }
}

static int linear_i8(const int64_t *p) {
    const float *x = (const float *)p[P_X], *bias = (const float *)p[P_BIAS];
    const float *ws = (const float *)p[P_SCALE];
    const int8_t *w = (const int8_t *)p[P_W];
    float *y = (float *)p[P_Y];
    int64_t m = p[P_M], k = p[P_K], ldx = p[P_LDX], n = p[P_N], ldy = p[P_LDY];
    int64_t kb_count = k / 64, pairs = (n + 31) / 32, padded = (m + 31) / 32 * 32;
    int threads = (int)p[P_THREADS];
    if (m <= 0 || n <= 0)
        return 0;
    /* The quantized rows, zero past m up to a multiple of 32: tiles read whole blocks. */
    int8_t *q = (int8_t *)aligned_alloc(64, (size_t)(padded * k));
    float *xs = (float *)calloc((size_t)padded, sizeof(float));
    if (!q || !xs) {
        free(q);
        free(xs);
        return 1;
    }
    memset(q + m * k, 0, (size_t)((padded - m) * k));
    int64_t chunk = chunk_rows(k); /* 128 KB of int8 x */
    if (threads < 1 || (pairs < 2 * threads && m < 64 * threads))
        threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int32_t acc[1024] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            xs[r] = quantize_row(x + r * ldx, k, q + r * k);
        configure();
        for (int64_t c0 = 0; c0 < padded; c0 += chunk) {
            int64_t c1 = c0 + chunk < padded ? c0 + chunk : padded;
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < pairs; pair++) {
                const int8_t *wb = w + pair * 2 * kb_count * 1024;
                for (int64_t m0 = c0; m0 < c1; m0 += 32)
                    block_i8(q + m0 * k, k, m - m0 < 32 ? m - m0 : 32, xs + m0, wb, kb_count,
                             pair * 32, n, ws, bias, y + m0 * ldy, ldy, acc);
            }
        }
        _tile_release();
    }
    free(q);
    free(xs);
    return 0;
}

#endif /* NMT_AMX_INT8 */

#endif /* NMT_AMX */

/* Returns 0 on success; OP_AVAILABLE (OP_AVAILABLE_I8) returns 0 where the bf16 (int8)
 * kernel can run here (built with AMX and the process allowed to use it), 2 where not. */
int nmt_amx_linear(const int64_t *p) {
#ifdef NMT_AMX
    if (!permitted())
        return 2;
    switch (p[P_OP]) {
    case OP_AVAILABLE:
        return 0;
    case OP_PACK:
        pack((const bf16_t *)p[P_W], p[P_N], p[P_K], (bf16_t *)p[P_Y]);
        return 0;
    case OP_LINEAR:
        return linear(p);
#ifdef NMT_AMX_INT8
    case OP_AVAILABLE_I8:
        return 0;
    case OP_PACK_I8:
        pack_i8((const int8_t *)p[P_W], p[P_N], p[P_K], (int8_t *)p[P_Y]);
        return 0;
    case OP_LINEAR_I8:
        return linear_i8(p);
#else
    case OP_AVAILABLE_I8:
        return 2;
#endif
    }
    return 1;
#else
    (void)p;
    return 2;
#endif
}
