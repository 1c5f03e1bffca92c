/* Attention of one incremental decoding step on a CPU, in one pass per query row.
 *
 * softmax(q . k * scale + mask) . v for every (entry, head, query) of a step: each key and
 * value read once, the scores, mask and softmax in a scratch row of the L1 cache, and keys
 * the mask hides (-inf) never touched, where eager PyTorch spends several dispatched ops and
 * as many passes over memory (nmt/inference/fused_attention.py calls this).
 *
 * Shapes: q (E, H, G, D), k (E', H, L, D), v (E', H, L, DV), mask (E', 1, G, L) additive
 * (0 / -inf, the same for every head; broadcast by zero strides) or none, out (E, H, G,
 * DV), query entry e reading cache entry entries[e] (e itself without a list: E' = E; a
 * list lets a step feed only the sentences still decoding while the finished ones stay
 * in the caches untouched). Incremental decoding folds a sentence's G beam rows as the G
 * queries of its entry; with the grouped cache's slot mask each query reads only the keys
 * of its own hypothesis. Vectors along D and DV are contiguous; everything else goes by
 * strides in elements. Types: float32 or bfloat16 (q, k, v, mask and out alike; arithmetic
 * in float32, the output rounded to nearest even).
 */
#include "simd.h"

/* The parameters, one int64 array (one ctypes argument instead of thirty). Pointers are
 * addresses; strides in elements of the tensors' type. */
enum {
    P_Q, P_K, P_V, P_MASK, P_OUT,
    P_E, P_H, P_G, P_L, P_D, P_DV,
    P_Q_E, P_Q_H, P_Q_G,
    P_K_E, P_K_H, P_K_L,
    P_V_E, P_V_H, P_V_L,
    P_M_E, P_M_G, P_M_L,
    P_OUT_E, P_OUT_H, P_OUT_G,
    P_BF16, P_THREADS, P_SCALE_BITS, /* 1 = bfloat16; threads; scale as float32 bits */
    P_ENTRIES, /* int64 (E,): the cache entry of each query entry; 0: entry e is entry e */
    P_COUNT
};

int64_t nmt_attention_params(void) { return P_COUNT; }

/* A 64-wide head is NV vectors of the build's width (simd.h). */
#define NV (64 / LANES)

/* One (entry, head): for each query, the positions the mask allows are listed first
 * (branch-free), then scored, softmaxed and summed over that list only. Scratch: `scores`
 * holds L floats, `lists` and `biases` G * L. D = DV = 64 (every preset's head size) runs on
 * vector registers (VEC: the vector loader); other sizes on plain loops. */
#define DEFINE_ATTEND(NAME, LIST, T, LOAD, STORE, VEC)                                       \
/* The positions row `m_r` of an additive mask allows (all L without a mask) into `index`,   \
 * their mask values into `bias`; returns how many. Branch-free. */                          \
static int64_t LIST(const T *m_r, int64_t m_l, int64_t L, int32_t *index, float *bias) {     \
    int64_t n = 0;                                                                           \
    for (int64_t pos = 0; pos < L; pos++) {                                                  \
        const float b = m_r ? LOAD(m_r[pos * m_l]) : 0.0f;                                   \
        index[n] = (int32_t)pos;                                                             \
        bias[n] = b;                                                                         \
        n += b != -INFINITY;                                                                 \
    }                                                                                        \
    return n;                                                                                \
}                                                                                            \
                                                                                             \
/* The entry's lists, made once for all its heads: query i's at lists + i * L, its mask    \
 * values at biases + i * L, counts[i] of them. */                                          \
static void NAME(const int64_t *p, int64_t e, int64_t ke, int64_t h, float *scores,        \
                 const int32_t *lists, const float *biases, const int64_t *counts) {         \
    const T *q = (const T *)p[P_Q], *k = (const T *)p[P_K], *v = (const T *)p[P_V];            \
    T *out = (T *)p[P_OUT];                                                                  \
    const int64_t G = p[P_G], L = p[P_L], D = p[P_D], DV = p[P_DV];                          \
    const int64_t k_l = p[P_K_L], v_l = p[P_V_L];                                            \
    const int vec = D == 64 && DV == 64;                                                     \
    float scale;                                                                             \
    const int32_t scale_bits = (int32_t)p[P_SCALE_BITS];                                     \
    memcpy(&scale, &scale_bits, sizeof scale);                                               \
    const T *k_eh = k + ke * p[P_K_E] + h * p[P_K_H];                                        \
    const T *v_eh = v + ke * p[P_V_E] + h * p[P_V_H];                                        \
    for (int64_t i = 0; i < G; i++) {                                                        \
        const T *q_r = q + e * p[P_Q_E] + h * p[P_Q_H] + i * p[P_Q_G];                       \
        const int32_t *index = lists + i * L;                                                \
        const float *bias = biases + i * L;                                                  \
        const int64_t n = counts[i];                                                         \
        float top = -INFINITY;                                                               \
        if (vec) {                                                                           \
            vf qv[NV];                                                                       \
            for (int c = 0; c < NV; c++) qv[c] = VEC(q_r + c * LANES) * scale;               \
            int64_t j = 0;                                                                   \
            for (; j + 4 <= n; j += 4) { /* four keys, their lane sums together */           \
                vf a[4];                                                                     \
                for (int u = 0; u < 4; u++) {                                                \
                    const T *key = k_eh + index[j + u] * k_l;                                \
                    a[u] = qv[0] * VEC(key);                                                 \
                    for (int c = 1; c < NV; c++) a[u] += qv[c] * VEC(key + c * LANES);       \
                }                                                                            \
                sum4_lanes(a[0], a[1], a[2], a[3], scores + j);                              \
                for (int u = 0; u < 4; u++) {                                                \
                    const float s = scores[j + u] + bias[j + u];                             \
                    scores[j + u] = s;                                                       \
                    top = s > top ? s : top;                                                 \
                }                                                                            \
            }                                                                                \
            for (; j < n; j++) {                                                             \
                const T *key = k_eh + index[j] * k_l;                                        \
                vf a = qv[0] * VEC(key);                                                     \
                for (int c = 1; c < NV; c++) a += qv[c] * VEC(key + c * LANES);              \
                const float s = sum_lanes(a) + bias[j];                                      \
                scores[j] = s;                                                               \
                top = s > top ? s : top;                                                     \
            }                                                                                \
        } else {                                                                             \
            for (int64_t j = 0; j < n; j++) {                                                \
                const T *key = k_eh + index[j] * k_l;                                        \
                float dot = 0.0f;                                                            \
                for (int64_t c = 0; c < D; c++) dot += LOAD(q_r[c]) * LOAD(key[c]);          \
                const float s = dot * scale + bias[j];                                       \
                scores[j] = s;                                                               \
                top = s > top ? s : top;                                                     \
            }                                                                                \
        }                                                                                    \
        vf sum = (vf){0};                                                                    \
        int64_t jv = 0;                                                                      \
        for (; jv + LANES <= n; jv += LANES) {                                               \
            const vf w = vexp_nonpositive(load_f32(scores + jv) - top);                      \
            memcpy(scores + jv, &w, sizeof w);                                               \
            sum += w;                                                                        \
        }                                                                                    \
        float total = sum_lanes(sum);                                                        \
        for (; jv < n; jv++) {                                                               \
            const float w = exp_nonpositive(scores[jv] - top);                               \
            scores[jv] = w;                                                                  \
            total += w;                                                                      \
        }                                                                                    \
        const float norm = 1.0f / total;                                                     \
        T *o = out + e * p[P_OUT_E] + h * p[P_OUT_H] + i * p[P_OUT_G];                       \
        if (vec) {                                                                           \
            vf acc[NV];                                                                      \
            for (int c = 0; c < NV; c++) acc[c] = (vf){0};                                   \
            for (int64_t j = 0; j < n; j++) {                                                \
                const float w = scores[j] * norm;                                            \
                const T *val = v_eh + index[j] * v_l;                                        \
                for (int c = 0; c < NV; c++) acc[c] += w * VEC(val + c * LANES);             \
            }                                                                                \
            for (int c = 0; c < NV; c++)                                                     \
                for (int l = 0; l < LANES; l++) o[c * LANES + l] = STORE(acc[c][l]);         \
        } else {                                                                             \
            for (int64_t c = 0; c < DV; c++) {                                               \
                float acc = 0.0f;                                                            \
                for (int64_t j = 0; j < n; j++)                                              \
                    acc += scores[j] * norm * LOAD(v_eh[index[j] * v_l + c]);                \
                o[c] = STORE(acc);                                                           \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_ATTEND(attend_f32, list_f32, float, LOAD_F32, STORE_F32, load_f32)
DEFINE_ATTEND(attend_bf16, list_bf16, bf16_t, bf16_to_float, float_to_bf16, load_bf16)

/* Run the step's attention: every entry, its heads and queries, over `threads` OpenMP
 * threads (the runtime PyTorch itself uses, so no second pool) split by entry. The mask is
 * listed once per entry and query, for all heads. Returns 0, or -1 when the scratch memory
 * could not be had. */
int nmt_attention(const int64_t *p) {
    const int64_t E = p[P_E], H = p[P_H], G = p[P_G], L = p[P_L];
    const int threads = (int)p[P_THREADS];
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && E >= 2 * threads)
    {
        /* scores (L), lists (G * L), biases (G * L), counts (G) */
        const size_t floats = (size_t)(L + 2 * G * L + 2 * G);
        float *scratch = malloc(sizeof(float) * floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        float *scores = scratch, *biases = scratch + L + G * L;
        int32_t *lists = (int32_t *)(scratch + L);
        int64_t *counts = (int64_t *)(biases + G * L);
#pragma omp for schedule(static)
        for (int64_t e = 0; e < E; e++) {
            if (!scratch) continue; /* every thread still meets the loop's barrier */
            const int64_t ke = p[P_ENTRIES] ? ((const int64_t *)p[P_ENTRIES])[e] : e;
            for (int64_t i = 0; i < G; i++) {
                const int64_t row = ke * p[P_M_E] + i * p[P_M_G];
                counts[i] = p[P_BF16]
                    ? list_bf16(p[P_MASK] ? (const bf16_t *)p[P_MASK] + row : NULL, p[P_M_L],
                                L, lists + i * L, biases + i * L)
                    : list_f32(p[P_MASK] ? (const float *)p[P_MASK] + row : NULL, p[P_M_L],
                               L, lists + i * L, biases + i * L);
            }
            for (int64_t h = 0; h < H; h++) {
                if (p[P_BF16]) attend_bf16(p, e, ke, h, scores, lists, biases, counts);
                else attend_f32(p, e, ke, h, scores, lists, biases, counts);
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
