/* int8 linear layers y ~ x W^T + b on 256-bit integer vectors (AVX2; AVX-VNNI where the
 * build has it: levels.py's avx2_vnni), one compiled kernel for every shape.
 *
 * Why: on a CPU without AMX, int8 inference otherwise runs torch's FBGEMM / oneDNN
 * dynamic-quantized layers, which the native decoder step (native_step.c) cannot call,
 * and which quantize a whole call's activations with one scale. This kernel quantizes
 * each row with its own scale (symmetric, as amx_linear.c's int8 kernel and CTranslate2
 * do; per-output weight scales) and is called by address from the native step.
 *
 * The products: activations as unsigned bytes u = q + OFFSET times W's signed bytes, the
 * offset's share (OFFSET x the output's weight sum, stored with the packed weights)
 * subtracted from each int32 sum. AVX2's vpmaddubsw adds each pair of u x w products into
 * int16, which full 8-bit u could overflow: there q takes 7 bits ([-63, 63], OFFSET 64,
 * every pair sum at most 2 x 127 x 127). VNNI's vpdpbusd sums into int32: 8 bits there.
 *
 * Operations (P_OP):
 * - OP_PACK: W (N, K) int8 row-major -> blocks of 16 outputs (N padded to 16 with zero
 *   rows): block nb is K / 4 runs of 64 bytes, run kq holding outputs 0-7 then 8-15 of the
 *   block, each as its four W[n][4kq .. 4kq+3] (one 256-bit vector per 8 outputs); then
 *   the padded N compensation terms, int32.
 * - OP_LINEAR: x (M, K) float32 (rows `ldx` apart) -> y (M, N) float32 (rows `ldy` apart):
 *   x's rows quantized, int32 sums, times row scale times output scale (P_SCALE) plus an
 *   optional bias (one fused multiply-add). K a multiple of 32.
 * - OP_LEVELS: returns QMAX, for the Python side's reference quantization.
 *
 * Blocking: 4 rows x 16 outputs of int32 sums in registers; within a chunk of rows that the
 * L2 cache holds, output blocks are the outer loop (a block's weights stay in L1 while the
 * chunk's rows pass) and are shared among `threads` OpenMP threads.
 */
#include "simd.h"

#if defined(__AVX2__)
#define NMT_AVX2_I8 1
#include <immintrin.h>
#endif

enum {
    P_OP, P_X, P_M, P_K, P_LDX, P_W, P_N, P_BIAS, P_Y, P_LDY, P_THREADS, P_SCALE,
    P_COUNT
};

enum { OP_AVAILABLE = 0, OP_PACK = 1, OP_LINEAR = 2, OP_LEVELS = 3 };

int64_t nmt_avx2_linear_params(void) { return P_COUNT; }

#ifdef NMT_AVX2_I8

enum { ROWS = 4, OUTS = 16, K_STEP = 32 };

/* Activations as unsigned bytes u = q + OFFSET, q in [-QMAX, QMAX]. vpmaddubsw adds pairs
 * of u x w into int16, so without VNNI u stays below 128 (7 bits: no pair can saturate);
 * vpdpbusd sums into int32 and takes all 8 bits. */
#if defined(__AVXVNNI__)
#define QMAX 127
#define OFFSET 128
#else
#define QMAX 63
#define OFFSET 64
#endif

static void pack(const int8_t *w, int64_t n, int64_t k, int8_t *out) {
    int64_t blocks = (n + OUTS - 1) / OUTS, quads = k / 4;
    for (int64_t nb = 0; nb < blocks; nb++)
        for (int64_t kq = 0; kq < quads; kq++) {
            int8_t *run = out + (nb * quads + kq) * 64;
            for (int64_t j = 0; j < OUTS; j++)
                for (int64_t i = 0; i < 4; i++) {
                    int64_t row = nb * OUTS + j;
                    run[4 * j + i] = row < n ? w[row * k + 4 * kq + i] : 0;
                }
        }
    int32_t *comp = (int32_t *)(out + blocks * OUTS * k);
    for (int64_t j = 0; j < blocks * OUTS; j++) { /* the padding's terms are 0 */
        int32_t sum = 0;
        if (j < n)
            for (int64_t i = 0; i < k; i++) sum += w[j * k + i];
        comp[j] = OFFSET * sum;
    }
}

/* Row x (k floats, k a multiple of 32) -> u = round(x * QMAX / absmax) + OFFSET (ties to
 * even) as unsigned bytes; returns the row's scale absmax / QMAX (0 for an all-zero row,
 * whose u is all OFFSET). */
static inline float quantize_row(const float *x, int64_t k, uint8_t *u) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float top = _mm_cvtss_f32(h);
    __m256 inv = _mm256_set1_ps(top > 0.0f ? QMAX / top : 0.0f);
    const __m256i lo = _mm256_set1_epi8(-QMAX), hi = _mm256_set1_epi8(QMAX);
    for (int64_t i = 0; i < k; i += 32) {
        __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
        __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv));
        __m256i v2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), inv));
        __m256i v3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), inv));
        /* packs work within 128-bit lanes: restore the order afterwards */
        __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
        w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        w = _mm256_min_epi8(_mm256_max_epi8(w, lo), hi);
        _mm256_storeu_si256((__m256i *)(u + i), _mm256_add_epi8(w, _mm256_set1_epi8(OFFSET)));
    }
    return top / QMAX;
}

/* acc += the 8 int32 sums over 4 k of u (4 bytes broadcast) times W's signed bytes. */
static inline __m256i dot4(__m256i acc, __m256i u, __m256i w) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, w);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, w), ones));
#endif
}

static inline int32_t quad(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 8 int32 sums of one output vector, less the offset's share `comp` -> float32 y columns
 * [0, cols): (acc - comp) * xs * ws + b. */
static inline void store(__m256i acc, const int32_t *comp, float xs, const float *ws,
                         const float *bias, float *y, int64_t cols) {
    acc = _mm256_sub_epi32(acc, _mm256_loadu_si256((const __m256i *)comp));
    if (cols >= 8) {
        __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(xs));
        _mm256_storeu_ps(y, _mm256_fmadd_ps(v, _mm256_loadu_ps(ws), b));
        return;
    }
    int32_t sums[8];
    _mm256_storeu_si256((__m256i *)sums, acc);
    for (int64_t c = 0; c < cols; c++)
        y[c] = __builtin_fmaf((float)sums[c] * xs, ws[c], bias ? bias[c] : 0.0f);
}

/* y rows [0, R) of outputs [n0, n0 + 16) of n: quantized rows u (k bytes apart), their
 * scales xs, the packed block wb and its compensation terms comp. R is a constant where
 * this is inlined. */
static inline __attribute__((always_inline)) void tile(
        int R, const uint8_t *u, int64_t k, const float *xs, const int8_t *wb,
        const int32_t *comp, int64_t n0, int64_t n, const float *ws, const float *bias,
        float *y, int64_t ldy) {
    __m256i acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t kq = 0; kq < k / 4; kq++) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + kq * 64));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + kq * 64 + 32));
        for (int r = 0; r < R; r++) {
            __m256i uv = _mm256_set1_epi32(quad(u + r * k + 4 * kq));
            acc[r][0] = dot4(acc[r][0], uv, w0);
            acc[r][1] = dot4(acc[r][1], uv, w1);
        }
    }
    int64_t left = n - n0;
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 2 && left > 8 * v; v++) {
            int64_t c = n0 + 8 * v;
            store(acc[r][v], comp + 8 * v, xs[r], ws + c, bias ? bias + c : NULL,
                  y + r * ldy + c, left - 8 * v);
        }
}

static void tiles(int64_t rows, const uint8_t *u, int64_t k, const float *xs,
                  const int8_t *wb, const int32_t *comp, int64_t n0, int64_t n,
                  const float *ws, const float *bias, float *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + ROWS <= rows; r += ROWS)
        tile(ROWS, u + r * k, k, xs + r, wb, comp, n0, n, ws, bias, y + r * ldy, ldy);
    switch (rows - r) {
    case 3: tile(3, u + r * k, k, xs + r, wb, comp, n0, n, ws, bias, y + r * ldy, ldy); break;
    case 2: tile(2, u + r * k, k, xs + r, wb, comp, n0, n, ws, bias, y + r * ldy, ldy); break;
    case 1: tile(1, u + r * k, k, xs + r, wb, comp, n0, n, ws, bias, y + r * ldy, ldy); break;
    default: break;
    }
}

static int linear(const int64_t *p) {
    const float *x = (const float *)p[P_X], *bias = (const float *)p[P_BIAS];
    const float *ws = (const float *)p[P_SCALE];
    const int8_t *w = (const int8_t *)p[P_W];
    float *y = (float *)p[P_Y];
    int64_t m = p[P_M], k = p[P_K], ldx = p[P_LDX], n = p[P_N], ldy = p[P_LDY];
    int64_t blocks = (n + OUTS - 1) / OUTS;
    const int32_t *comp = (const int32_t *)(w + blocks * OUTS * k);
    int threads = (int)p[P_THREADS];
    if (m <= 0 || n <= 0)
        return 0;
    if (k % K_STEP)
        return 1;
    uint8_t *u = (uint8_t *)malloc((size_t)(m * k));
    float *xs = (float *)malloc((size_t)m * sizeof(float));
    if (!u || !xs) {
        free(u);
        free(xs);
        return 1;
    }
    /* rows per chunk: 128 KB of u, which L2 keeps while the output blocks pass */
    int64_t chunk = (128 * 1024 / k) / ROWS * ROWS;
    if (chunk < ROWS)
        chunk = ROWS;
    if (threads < 1 || (blocks < 2 * threads && m < 32 * threads))
        threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            xs[r] = quantize_row(x + r * ldx, k, u + r * k);
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
            int64_t rows = m - c0 < chunk ? m - c0 : chunk;
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < blocks; nb++)
                tiles(rows, u + c0 * k, k, xs + c0, w + nb * OUTS * k, comp + nb * OUTS,
                      nb * OUTS, n, ws, bias, y + c0 * ldy, ldy);
        }
    }
    free(u);
    free(xs);
    return 0;
}

#endif /* NMT_AVX2_I8 */

/* Returns 0 on success; OP_AVAILABLE returns 0 where the kernel was built with AVX2, 2
 * where not; OP_LEVELS the activations' largest quantized magnitude (QMAX). */
int nmt_avx2_linear(const int64_t *p) {
#ifdef NMT_AVX2_I8
    switch (p[P_OP]) {
    case OP_AVAILABLE:
        return 0;
    case OP_PACK:
        pack((const int8_t *)p[P_W], p[P_N], p[P_K], (int8_t *)p[P_Y]);
        return 0;
    case OP_LINEAR:
        return linear(p);
    case OP_LEVELS:
        return QMAX;
    }
    return 1;
#else
    (void)p;
    return 2;
#endif
}
