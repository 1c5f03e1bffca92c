/* A bf16 linear layer y = x W^T + b on Intel AMX tiles, one compiled kernel for every shape.
 *
 * Why: oneDNN (what PyTorch's bf16 linears run) compiles a new kernel for every row count
 * it meets, about 1 ms each with AMX, and beam search meets a new row count at almost every
 * step, in every worker process afresh and, with a shortlist, for every batch's width.
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
 * Blocking: 32 outputs x 32 rows per pass over K (four 16x16 fp32 accumulator tiles, two
 * tiles of x, two of W); within a chunk of rows that the L2 cache holds, the output blocks
 * are the outer loop (W is read once per chunk, x stays in cache) and are shared among
 * `threads` OpenMP threads. The last, partial block
 * of rows is copied into a zero-padded buffer first, so no tile reads past x.
 */
#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define NMT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum {
    P_OP, P_X, P_M, P_K, P_LDX, P_W, P_N, P_BIAS, P_Y, P_LDY, P_THREADS,
    P_COUNT
};

enum { OP_AVAILABLE = 0, OP_PACK = 1, OP_LINEAR = 2 };

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

/* y rows [m0, m0 + rows) (rows <= 32), outputs [n0, n0 + 32) of n, from tiles of x rows
 * `a` (32 rows, `lda` elements apart, zero-padded past `rows` or readable) and the packed
 * blocks of W from `wb` (output block pair n0 / 16). */
static inline void block(const bf16_t *a, int64_t lda, int64_t rows, const bf16_t *wb,
                         int64_t kb_count, int64_t n0, int64_t n, const bf16_t *bias,
                         bf16_t *y, int64_t ldy, float *acc) {
    const bf16_t *wb1 = wb + kb_count * 512;
    _tile_zero(0);
    _tile_zero(1);
    if (rows > 16) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < kb_count; kb++) {
        _tile_loadd(4, a + kb * 32, lda * 2);
        _tile_loadd(6, wb + kb * 512, 64);
        _tile_loadd(7, wb1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows > 16) {
            _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    int64_t c0 = n - n0 < 16 ? n - n0 : 16, c1 = n - n0 - 16;
    int64_t r0 = rows < 16 ? rows : 16;
    store(acc, r0, c0, bias ? bias + n0 : NULL, y + n0, ldy);
    if (c1 > 0)
        store(acc + 256, r0, c1, bias ? bias + n0 + 16 : NULL, y + n0 + 16, ldy);
    if (rows > 16) {
        _tile_stored(2, acc + 512, 64);
        _tile_stored(3, acc + 768, 64);
        store(acc + 512, rows - 16, c0, bias ? bias + n0 : NULL, y + 16 * ldy + n0, ldy);
        if (c1 > 0)
            store(acc + 768, rows - 16, c1, bias ? bias + n0 + 16 : NULL,
                  y + 16 * ldy + n0 + 16, ldy);
    }
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
    /* Rows per chunk: about 256 KB of x, which the core's L2 cache keeps while every
     * output block passes over it. */
    int64_t chunk = (128 * 1024 / k) / 32 * 32;
    if (chunk < 32)
        chunk = 32;
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

#endif /* NMT_AMX */

/* Returns 0 on success; OP_AVAILABLE returns 0 where the kernel can run here (built with
 * AMX and the process allowed to use it), 2 where not. */
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
    }
    return 1;
#else
    (void)p;
    return 2;
#endif
}
