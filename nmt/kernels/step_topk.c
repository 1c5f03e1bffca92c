/* One beam-search step's candidates on a CPU: log-softmax and top-k of each row in one call.
 *
 * For each row of next-token logits x (rows, V): lse = log sum_j exp(x_j) over every column,
 * and the k largest allowed columns c with their log-probabilities x_c - lse, best first
 * (equal values in no particular order). The (rows, V) log-probabilities are never
 * written: one pass finds the row maximum and every block's maximum, only the k blocks
 * that can hold the top k are scanned, and a second pass sums exp(x - max) from the L1
 * cache. Eager PyTorch spends a log_softmax (three passes, one written), the restriction
 * fills and a top-k on the same (nmt/inference/step_topk.py builds and calls this).
 *
 * Allowed columns: all but PAD and BOS, and but EOS where EOS is banned (all rows, below
 * the minimum length); a row whose `only` entry is a column c >= 0 allows c alone (EOS at
 * the maximum length, a forced prefix piece), -2 allows none, -1 is the rule above. Slots
 * beyond the allowed columns get -inf and column PAD. Logits are float32 or bfloat16.
 */
#include "simd.h"

/* The parameters, one int64 array. Pointers are addresses (0: none); `ld` is the logits'
 * row stride in elements. */
enum {
    P_X, P_ROWS, P_V, P_LD, P_BF16, P_K, P_VALUES, P_INDICES, P_ONLY,
    P_BAN_EOS, P_PAD, P_BOS, P_EOS, P_THREADS,
    P_COUNT
};

int64_t nmt_step_topk_params(void) { return P_COUNT; }

#define BLOCK 64 /* columns per block of the first pass */
#define NB (BLOCK / LANES)
#define MAX_K 256 /* the largest k (step_topk.py checks) */
#define MAX_BLOCKS 4096 /* the widest row: MAX_BLOCKS * BLOCK columns (step_topk.py checks) */

/* Insert column c of value x into the sorted best list (vals, idx) of `*n` <= k entries,
 * after the entries of equal value. */
static inline void insert(float *vals, int64_t *idx, int64_t *n, int64_t k, float x,
                          int64_t c) {
    int64_t pos = *n < k ? (*n)++ : k - 1;
    while (pos > 0 && vals[pos - 1] < x) {
        vals[pos] = vals[pos - 1];
        idx[pos] = idx[pos - 1];
        pos--;
    }
    vals[pos] = x;
    idx[pos] = c;
}

/* Is column j one the rule allows (see the top of the file)? */
static inline int allowed(int64_t j, int64_t pad, int64_t bos, int64_t eos) {
    return j != pad && j != bos && j != eos;
}

/* Offer column j of value v to the best list: taken when allowed and above the k-th value
 * (at least `kth`, the cut, while the list is not full). Returns the new k-th value. */
static inline float offer(float *vals, int64_t *idx, int64_t *n, int64_t k, float kth,
                          float v, int64_t j, int64_t pad, int64_t bos, int64_t eos) {
    if ((*n < k ? v >= kth : v > kth) && allowed(j, pad, bos, eos)) {
        insert(vals, idx, n, k, v, j);
        if (*n == k) return vals[k - 1];
    }
    return kth;
}

/* One row. Pass 1: the maximum of every block of 64 columns (the allowed columns' only in
 * the blocks that hold a banned one) and of the row. Then only the blocks whose maximum is
 * among the k largest are scanned: each of the k best blocks holds an allowed value at
 * least the k-th largest block maximum T, so the k-th best allowed value is >= T, and a
 * block below T holds none of the top k. Pass 2: the sum of exp(x - max), in chunks through
 * an L1-resident scratch row so that the exp vectorises. */
#define DEFINE_ROW(NAME, T, LOAD, VEC)                                                       \
static void NAME(const int64_t *p, int64_t r) {                                              \
    const int64_t V = p[P_V], k = p[P_K];                                                    \
    const T *x = (const T *)p[P_X] + r * p[P_LD];                                            \
    float *vals = (float *)p[P_VALUES] + r * k;                                              \
    int64_t *idx = (int64_t *)p[P_INDICES] + r * k;                                          \
    const int64_t only = p[P_ONLY] ? ((const int64_t *)p[P_ONLY])[r] : -1;                   \
    const int64_t pad = p[P_PAD], bos = p[P_BOS];                                            \
    const int64_t eos = p[P_BAN_EOS] ? p[P_EOS] : -1;                                        \
    const int64_t blocks = V / BLOCK, whole = blocks * BLOCK;                                \
    float bmax[MAX_BLOCKS];                                                                  \
    float top = -INFINITY;                                                                   \
    for (int64_t b = 0; b < blocks; b++) {                                                   \
        const T *xb = x + b * BLOCK;                                                         \
        vf m = VEC(xb);                                                                      \
        for (int c = 1; c < NB; c++) m = vmax(m, VEC(xb + c * LANES));                       \
        const float bm = max_lanes(m);                                                       \
        bmax[b] = bm;                                                                        \
        top = bm > top ? bm : top;                                                           \
    }                                                                                        \
    for (int64_t j = whole; j < V; j++) {                                                    \
        const float v = LOAD(x[j]);                                                          \
        top = v > top ? v : top;                                                             \
    }                                                                                        \
    int64_t n = 0;                                                                           \
    if (only == -1) {                                                                        \
        const int64_t banned[3] = {pad, bos, eos};                                           \
        for (int i = 0; i < 3; i++) {                                                        \
            const int64_t b = banned[i] / BLOCK;                                             \
            if (banned[i] < 0 || b >= blocks) continue;                                      \
            float bm = -INFINITY;                                                            \
            for (int64_t j = b * BLOCK; j < (b + 1) * BLOCK; j++) {                          \
                const float v = LOAD(x[j]);                                                  \
                if (allowed(j, pad, bos, eos) && v > bm) bm = v;                             \
            }                                                                                \
            bmax[b] = bm;                                                                    \
        }                                                                                    \
        /* the k blocks of the largest maxima, best first (vals, idx as scratch) */          \
        int64_t m = 0;                                                                       \
        for (int64_t b = 0; b < blocks; b++)                                                 \
            if (m < k || bmax[b] > vals[k - 1]) insert(vals, idx, &m, k, bmax[b], b);        \
        const float cut = m == k ? vals[k - 1] : -INFINITY; /* T */                          \
        int64_t best[MAX_K];                                                                 \
        memcpy(best, idx, (size_t)m * sizeof *best);                                         \
        float kth = cut;                                                                     \
        for (int64_t i = 0; i < m; i++) {                                                    \
            for (int64_t c = best[i] * BLOCK; c < (best[i] + 1) * BLOCK; c += LANES) {       \
                if (!any_lane(n < k ? VEC(x + c) >= kth : VEC(x + c) > kth)) continue;       \
                for (int64_t j = c; j < c + LANES; j++)                                      \
                    kth = offer(vals, idx, &n, k, kth, LOAD(x[j]), j, pad, bos, eos);        \
            }                                                                                \
        }                                                                                    \
        for (int64_t j = whole; j < V; j++) /* the columns no block holds */                \
            kth = offer(vals, idx, &n, k, kth, LOAD(x[j]), j, pad, bos, eos);                \
    } else if (only >= 0 && only < V) {                                                      \
        vals[0] = LOAD(x[only]);                                                             \
        idx[0] = only;                                                                       \
        n = 1;                                                                               \
    }                                                                                        \
    vf acc = (vf){0};                                                                        \
    int64_t j = 0;                                                                           \
    for (; j + LANES <= V; j += LANES) acc += vexp_nonpositive(VEC(x + j) - top);            \
    for (; j < V; j++) acc[0] += exp_nonpositive(LOAD(x[j]) - top);                          \
    const float lse = top + logf(sum_lanes(acc));                                            \
    for (int64_t i = 0; i < n; i++) vals[i] -= lse;                                          \
    for (int64_t i = n; i < k; i++) {                                                        \
        vals[i] = -INFINITY;                                                                 \
        idx[i] = pad;                                                                        \
    }                                                                                        \
}

static inline float load_f32_scalar(float x) { return x; }

DEFINE_ROW(row_f32, float, load_f32_scalar, load_f32)
DEFINE_ROW(row_bf16, bf16_t, bf16_to_float, load_bf16)

/* Every row; rows split over `threads` OpenMP threads. */
int nmt_step_topk(const int64_t *p) {
    const int64_t rows = p[P_ROWS];
    const int bf16 = (int)p[P_BF16];
#pragma omp parallel for num_threads((int)p[P_THREADS]) if (p[P_THREADS] > 1 && rows > 1) \
    schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) row_bf16(p, r);
        else row_f32(p, r);
    }
    return 0;
}
