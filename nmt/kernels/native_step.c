/* One incremental decoder step's layer stack on a CPU in one call: post-norm, float32 or
 * bfloat16 activations.
 *
 * A decoder step in eager PyTorch is hundreds of dispatched ops (views, transposes, splits,
 * the cache writes, the checks around the C kernels); at a beam of one sentence they cost
 * more than the matrix products (docs/performance.md). This runs the same arithmetic from
 * one call: each linear on the kernel its layer uses (fp32: MKL's packed sgemm on the
 * weights nmt/inference/mkl_linear.py packed, through the `cblas_sgemm_compute` torch's
 * library exports, each output row starting as the bias, beta = 1; int8 and bf16: the AMX
 * kernel of amx_linear.c on its packed weights, int8 activations quantized per row inside
 * it; int8 without AMX: the AVX2 kernel of avx2_linear.c, the same way), the attention and
 * the add + LayerNorm through nmt's own kernels (fused_attention.c, add_norm.c), all called
 * by address. Activations are float32 (MKL, int8 layers) or bfloat16 (bf16 layers),
 * P_BF16. Same functions, same order, same rounding: the features are bit-identical to the
 * PyTorch path's (nmt/inference/native_step.py checks it once per process).
 *
 * Shapes: m rows fed, g rows per group (a sentence's beam), e = m / g groups fed, group i
 * of them being cache group entries[i] (i itself without a list). The self-attention caches
 * are the grouped cache's (groups, heads, capacity, g, d) buffers (nmt/inference/kv_cache.py),
 * written here at this position in each row's own slot; the cross keys (groups, heads,
 * src_len, d_k) and values (groups, heads, src_len, d_v). Embedding, slot mask and output
 * projection stay in Python.
 */
#include "simd.h"

typedef void (*sgemm_compute_t)(int, int, int, int, int, int, const float *, int,
                                const float *, int, float, float *, int);
typedef int (*kernel_t)(const int64_t *);

/* The parameters, one int64 array: the header, then P_LAYERS blocks of L_COUNT. Pointers
 * are addresses; strides in elements; eps and scale are float32 bit patterns. */
enum {
    P_COMPUTE, P_ATTENTION, P_ADD_NORM, /* cblas_sgemm_compute, nmt_attention, nmt_add_norm */
    P_BF16, P_W_BF16,                   /* activations, LayerNorm weights: 1 = bfloat16 */
    P_ROWS, P_G, P_ENTRIES, P_FED,      /* m, g, (e,) int64 or 0, e */
    P_HEADS, P_DK, P_DV, P_D, P_F, P_S, P_POS, P_EPS, P_SCALE, P_THREADS,
    P_SMASK, P_SM_E, P_SM_G, P_SM_L,    /* slot mask (groups, 1, g, L) additive, or 0 */
    P_CMASK, P_CM_E, P_CM_L,            /* source mask (groups, 1, 1, S) additive, or 0 */
    P_SK_E, P_SK_H, P_SK_P, P_SK_S,     /* self keys: group, head, position, slot strides */
    P_SV_E, P_SV_H, P_SV_P, P_SV_S,     /* self values */
    P_CK_E, P_CK_H, P_CK_L,             /* cross keys (d_k contiguous) */
    P_CV_E, P_CV_H, P_CV_L,             /* cross values */
    P_X, P_O, P_QKV, P_CTX, P_HID,      /* (m, d) x2, (m, 2 h d_k + h d_v), (m, h d_v), (m, f) */
    P_LAYERS,
    P_COUNT
};

/* Per layer: its linears, LayerNorm weights and biases, and the layer's caches. A linear is
 * LIN_COUNT entries: the kernel that runs it (a function taking the linear kernels' 12-entry
 * block, amx_linear.c's or avx2_linear.c's, and its op there; 0 for MKL's sgemm), packed
 * weight, bias or 0, int8 weight scales or 0. */
enum { LIN_FN, LIN_OP, LIN_W, LIN_B, LIN_SCALE, LIN_COUNT };
enum {
    L_QKV = 0, L_O = L_QKV + LIN_COUNT, L_N1W = L_O + LIN_COUNT, L_N1B,
    L_Q, L_O2 = L_Q + LIN_COUNT, L_N2W = L_O2 + LIN_COUNT, L_N2B,
    L_FC1, L_FC2 = L_FC1 + LIN_COUNT, L_N3W = L_FC2 + LIN_COUNT, L_N3B,
    L_SK, L_SV, L_CK, L_CV,
    L_COUNT
};

int64_t nmt_decoder_step_params(void) { return P_COUNT; }

int64_t nmt_decoder_step_layer_params(void) { return L_COUNT; }

/* out (m, n) = x (m, k) W^T + b by the layer's kernel (`lin`: LIN_COUNT entries), in the
 * activations' type. Returns 0, or -1 when the layer's kernel failed. */
static int linear(const int64_t *p, const void *x, int64_t m, int64_t k, const int64_t *lin,
                  int64_t n, void *out) {
    if (lin[LIN_FN]) {
        const int64_t a[12] = {lin[LIN_OP], (int64_t)x, m, k, k, lin[LIN_W], n, lin[LIN_B],
                               (int64_t)out, n, p[P_THREADS], lin[LIN_SCALE]};
        return ((kernel_t)lin[LIN_FN])(a) ? -1 : 0;
    }
    const float *bias = (const float *)lin[LIN_B];
    float *y = (float *)out;
    if (bias)
        for (int64_t r = 0; r < m; r++) memcpy(y + r * n, bias, sizeof(float) * n);
    ((sgemm_compute_t)p[P_COMPUTE])(101, 111, 151, (int)m, (int)n, (int)k, (const float *)x,
                                    (int)k, (const float *)lin[LIN_W], (int)k,
                                    bias ? 1.0f : 0.0f, y, (int)n);
    return 0;
}

/* s = LayerNorm(x + s) * w + b over rows of d (nmt_add_norm). */
static int add_norm(const int64_t *p, const void *x, void *s, int64_t w, int64_t b) {
    const int64_t m = p[P_ROWS], d = p[P_D];
    const int64_t q[14] = {(int64_t)x, (int64_t)s, (int64_t)s, w, b, m, d, d, d, d,
                           p[P_BF16], p[P_W_BF16], p[P_EPS], p[P_THREADS]};
    return ((kernel_t)p[P_ADD_NORM])(q);
}

/* out (m, h d_v) = attention of the queries q (row stride q_g) of the fed groups against
 * keys/values (strides in elements), mask (or 0), over L positions (nmt_attention). */
static int attention(const int64_t *p, const void *q, int64_t q_g, const void *k,
                     int64_t k_e, int64_t k_h, int64_t k_l, const void *v, int64_t v_e,
                     int64_t v_h, int64_t v_l, int64_t mask, int64_t m_e, int64_t m_g,
                     int64_t m_l, int64_t L, void *out) {
    const int64_t g = p[P_G], H = p[P_HEADS], dk = p[P_DK], dv = p[P_DV];
    const int64_t a[30] = {
        (int64_t)q, (int64_t)k, (int64_t)v, mask, (int64_t)out,
        p[P_FED], H, g, L, dk, dv,
        g * q_g, dk, q_g,                 /* q (e, h, g, d_k) */
        k_e, k_h, k_l, v_e, v_h, v_l,
        m_e, m_g, m_l,
        g * H * dv, dv, H * dv,           /* out (e, h, g, d_v) in (m, h d_v) rows */
        p[P_BF16], p[P_THREADS], p[P_SCALE], p[P_ENTRIES]};
    return ((kernel_t)p[P_ATTENTION])(a);
}

/* max(x, 0) over n values of the activations' type, in place. */
static void relu(void *x, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *h = (uint16_t *)x; /* a negative bfloat16 has its sign bit set */
        for (int64_t i = 0; i < n; i++) h[i] = (h[i] & 0x8000) ? 0 : h[i];
    } else {
        float *f = (float *)x;
        for (int64_t i = 0; i < n; i++) f[i] = f[i] > 0.0f ? f[i] : 0.0f;
    }
}

/* Run the step. Returns 0 when the output (m, d) is in P_X's buffer, 1 when in P_O's,
 * -1 when a kernel failed (no memory for the attention's scratch, a linear's kernel). */
int nmt_decoder_step(const int64_t *p) {
    const int64_t m = p[P_ROWS], g = p[P_G], H = p[P_HEADS], dk = p[P_DK], dv = p[P_DV];
    const int64_t D = p[P_D], F = p[P_F], pos = p[P_POS];
    const int64_t W = 2 * H * dk + H * dv; /* a fused q/k/v row */
    const int64_t es = p[P_BF16] ? 2 : 4;  /* bytes an activation */
    const int64_t *entries = (const int64_t *)p[P_ENTRIES];
    char *x = (char *)p[P_X], *o = (char *)p[P_O], *t;
    char *qkv = (char *)p[P_QKV], *ctx = (char *)p[P_CTX], *hid = (char *)p[P_HID];
    for (int64_t l = 0; l < p[P_LAYERS]; l++) {
        const int64_t *w = p + P_COUNT + l * L_COUNT;
        char *sk = (char *)w[L_SK], *sv = (char *)w[L_SV];

        /* self-attention: project, store this position's key/value in each row's slot */
        if (linear(p, x, m, D, w + L_QKV, W, qkv)) return -1;
        for (int64_t r = 0; r < m; r++) {
            const int64_t b = entries ? entries[r / g] : r / g, s = r % g;
            const char *row = qkv + r * W * es;
            for (int64_t h = 0; h < H; h++) {
                memcpy(sk + (b * p[P_SK_E] + h * p[P_SK_H] + pos * p[P_SK_P] + s * p[P_SK_S]) * es,
                       row + (H * dk + h * dk) * es, es * dk);
                memcpy(sv + (b * p[P_SV_E] + h * p[P_SV_H] + pos * p[P_SV_P] + s * p[P_SV_S]) * es,
                       row + (2 * H * dk + h * dv) * es, es * dv);
            }
        }
        /* the history: positions 0..pos of every slot, key l = position * g + slot */
        if (attention(p, qkv, W, sk, p[P_SK_E], p[P_SK_H], p[P_SK_S], sv, p[P_SV_E],
                      p[P_SV_H], p[P_SV_S], p[P_SMASK], p[P_SM_E], p[P_SM_G], p[P_SM_L],
                      (pos + 1) * g, ctx)) return -1;
        if (linear(p, ctx, m, H * dv, w + L_O, D, o)) return -1;
        if (add_norm(p, x, o, w[L_N1W], w[L_N1B])) return -1;
        t = x, x = o, o = t;

        /* encoder-decoder attention */
        if (linear(p, x, m, D, w + L_Q, H * dk, qkv)) return -1;
        if (attention(p, qkv, H * dk, (const void *)w[L_CK], p[P_CK_E], p[P_CK_H],
                      p[P_CK_L], (const void *)w[L_CV], p[P_CV_E], p[P_CV_H], p[P_CV_L],
                      p[P_CMASK], p[P_CM_E], 0, p[P_CM_L], p[P_S], ctx)) return -1;
        if (linear(p, ctx, m, H * dv, w + L_O2, D, o)) return -1;
        if (add_norm(p, x, o, w[L_N2W], w[L_N2B])) return -1;
        t = x, x = o, o = t;

        /* feed-forward */
        if (linear(p, x, m, D, w + L_FC1, F, hid)) return -1;
        relu(hid, m * F, (int)p[P_BF16]);
        if (linear(p, hid, m, F, w + L_FC2, D, o)) return -1;
        if (add_norm(p, x, o, w[L_N3W], w[L_N3B])) return -1;
        t = x, x = o, o = t;
    }
    return x == (char *)p[P_X] ? 0 : 1;
}
