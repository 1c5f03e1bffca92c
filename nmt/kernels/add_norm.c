/* A post-norm residual at inference in one pass: out = LayerNorm(x + s) * w + b, row by row.
 *
 * Eager PyTorch spends two dispatched ops on it (the add writes the sum, layer_norm reads it
 * back for its moments and again for the output); this kernel keeps each row in the L1
 * cache: it sums x + s into the output row while adding up the row, takes the variance
 * about the mean in a second pass and normalises in place in a third
 * (nmt/inference/add_norm.py calls it). bfloat16 rows are summed as PyTorch's
 * bfloat16 add would (the sum rounded to bfloat16), then normalised in float32 and rounded
 * once, as its layer_norm does. Every row is computed alone, so a row's result never depends
 * on the other rows of its batch.
 */
#include "simd.h"

/* The parameters, one int64 array. Pointers are addresses; strides are row strides in
 * elements; `bf16` says the rows' dtype and `w_bf16` the weight's and bias's (0: float32,
 * 1: bfloat16); `eps` is a float32 bit pattern. */
enum {
    P_X, P_S, P_OUT, P_W, P_B, P_ROWS, P_D, P_LDX, P_LDS, P_LDO, P_BF16, P_W_BF16, P_EPS,
    P_THREADS,
    P_COUNT
};

int64_t nmt_add_norm_params(void) { return P_COUNT; }

#define MAX_D 8192 /* the widest row (add_norm.py checks) */

static inline float param(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

/* One float32 row: out = LN(x + s) * w + b. The sums run in four accumulators (a chain
 * of dependent vector adds would wait on each add's latency). */
static void row_f32(const float *x, const float *s, float *out, const void *w, const void *b,
                    int64_t d, int w_bf16, float eps) {
    int64_t j = 0;
    vf acc0 = (vf){0}, acc1 = (vf){0}, acc2 = (vf){0}, acc3 = (vf){0};
    for (; j + 4 * LANES <= d; j += 4 * LANES) {
        vf z0 = load_f32(x + j) + load_f32(s + j);
        vf z1 = load_f32(x + j + LANES) + load_f32(s + j + LANES);
        vf z2 = load_f32(x + j + 2 * LANES) + load_f32(s + j + 2 * LANES);
        vf z3 = load_f32(x + j + 3 * LANES) + load_f32(s + j + 3 * LANES);
        memcpy(out + j, &z0, sizeof z0);
        memcpy(out + j + LANES, &z1, sizeof z1);
        memcpy(out + j + 2 * LANES, &z2, sizeof z2);
        memcpy(out + j + 3 * LANES, &z3, sizeof z3);
        acc0 += z0;
        acc1 += z1;
        acc2 += z2;
        acc3 += z3;
    }
    for (; j + LANES <= d; j += LANES) {
        vf z = load_f32(x + j) + load_f32(s + j);
        memcpy(out + j, &z, sizeof z);
        acc0 += z;
    }
    float sum = sum_lanes((acc0 + acc1) + (acc2 + acc3));
    for (; j < d; j++) {
        out[j] = x[j] + s[j];
        sum += out[j];
    }
    const float mean = sum / (float)d;
    vf sq0 = (vf){0}, sq1 = (vf){0}, sq2 = (vf){0}, sq3 = (vf){0};
    for (j = 0; j + 4 * LANES <= d; j += 4 * LANES) {
        vf c0 = load_f32(out + j) - mean, c1 = load_f32(out + j + LANES) - mean;
        vf c2 = load_f32(out + j + 2 * LANES) - mean, c3 = load_f32(out + j + 3 * LANES) - mean;
        sq0 += c0 * c0;
        sq1 += c1 * c1;
        sq2 += c2 * c2;
        sq3 += c3 * c3;
    }
    for (; j + LANES <= d; j += LANES) {
        vf c = load_f32(out + j) - mean;
        sq0 += c * c;
    }
    float var = sum_lanes((sq0 + sq1) + (sq2 + sq3));
    for (; j < d; j++) var += (out[j] - mean) * (out[j] - mean);
    const float rstd = 1.0f / sqrtf(var / (float)d + eps);
    if (w_bf16) {
        for (j = 0; j + LANES <= d; j += LANES) {
            vf y = (load_f32(out + j) - mean) * rstd * load_bf16((const bf16_t *)w + j)
                 + load_bf16((const bf16_t *)b + j);
            memcpy(out + j, &y, sizeof y);
        }
    } else {
        for (j = 0; j + LANES <= d; j += LANES) {
            vf y = (load_f32(out + j) - mean) * rstd * load_f32((const float *)w + j)
                 + load_f32((const float *)b + j);
            memcpy(out + j, &y, sizeof y);
        }
    }
    for (; j < d; j++) out[j] = (out[j] - mean) * rstd * param(w, j, w_bf16) + param(b, j, w_bf16);
}

#if defined(__AVX512BF16__) && LANES == 16
/* With AVX512-BF16 one instruction rounds 16 floats to bfloat16 (to nearest even, NaN kept
 * NaN; denormals flush to zero, which no LayerNorm input or output here comes near). */
static inline void store_bf16(bf16_t *out, vf y) {
    __m256bh half = _mm512_cvtneps_pbh((__m512)y);
    memcpy(out, &half, sizeof half);
}

static inline vf round_bf16(vf y) {
    __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)y));
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#else
/* The bfloat16 bit patterns (in the high halves) of a vector of floats rounded to nearest
 * even, NaN kept NaN. */
static inline vu32 bf16_bits(vf y) {
    vu32 bits;
    memcpy(&bits, &y, sizeof bits);
    const vu32 nan = (vu32)((bits & 0x7fffffffu) > 0x7f800000u);
    const vu32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return (rounded & ~nan) | ((bits | 0x400000u) & 0xffff0000u & nan);
}

/* A vector of floats rounded to bfloat16, as floats. */
static inline vf round_bf16(vf y) {
    vu32 bits = bf16_bits(y);
    vf r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

/* A vector of floats rounded to bfloat16 into `out`. */
static inline void store_bf16(bf16_t *out, vf y) {
    vu16 half = __builtin_convertvector(bf16_bits(y) >> 16, vu16);
    memcpy(out, &half, sizeof half);
}
#endif

/* One bfloat16 row: the sum rounded to bfloat16 (kept as float32 in `z`, d entries), then
 * normalised as above and rounded once. */
static void row_bf16(const bf16_t *x, const bf16_t *s, bf16_t *out, const void *w,
                     const void *b, int64_t d, int w_bf16, float eps, float *z) {
    int64_t j = 0;
    vf acc0 = (vf){0}, acc1 = (vf){0};
    for (; j + 2 * LANES <= d; j += 2 * LANES) {
        vf z0 = round_bf16(load_bf16(x + j) + load_bf16(s + j));
        vf z1 = round_bf16(load_bf16(x + j + LANES) + load_bf16(s + j + LANES));
        memcpy(z + j, &z0, sizeof z0);
        memcpy(z + j + LANES, &z1, sizeof z1);
        acc0 += z0;
        acc1 += z1;
    }
    for (; j + LANES <= d; j += LANES) {
        vf v = round_bf16(load_bf16(x + j) + load_bf16(s + j));
        memcpy(z + j, &v, sizeof v);
        acc0 += v;
    }
    float sum = sum_lanes(acc0 + acc1);
    for (; j < d; j++) {
        z[j] = bf16_to_float(float_to_bf16(bf16_to_float(x[j]) + bf16_to_float(s[j])));
        sum += z[j];
    }
    const float mean = sum / (float)d;
    vf sq0 = (vf){0}, sq1 = (vf){0};
    for (j = 0; j + 2 * LANES <= d; j += 2 * LANES) {
        vf c0 = load_f32(z + j) - mean, c1 = load_f32(z + j + LANES) - mean;
        sq0 += c0 * c0;
        sq1 += c1 * c1;
    }
    for (; j + LANES <= d; j += LANES) {
        vf c = load_f32(z + j) - mean;
        sq0 += c * c;
    }
    float var = sum_lanes(sq0 + sq1);
    for (; j < d; j++) var += (z[j] - mean) * (z[j] - mean);
    const float rstd = 1.0f / sqrtf(var / (float)d + eps);
    if (w_bf16) {
        for (j = 0; j + LANES <= d; j += LANES)
            store_bf16(out + j, (load_f32(z + j) - mean) * rstd * load_bf16((const bf16_t *)w + j)
                                + load_bf16((const bf16_t *)b + j));
    } else {
        for (j = 0; j + LANES <= d; j += LANES)
            store_bf16(out + j, (load_f32(z + j) - mean) * rstd * load_f32((const float *)w + j)
                                + load_f32((const float *)b + j));
    }
    for (; j < d; j++)
        out[j] = float_to_bf16((z[j] - mean) * rstd * param(w, j, w_bf16) + param(b, j, w_bf16));
}

int nmt_add_norm(const int64_t *p) {
    const int64_t rows = p[P_ROWS], d = p[P_D];
    const int bf16 = (int)p[P_BF16], w_bf16 = (int)p[P_W_BF16];
    const void *w = (const void *)p[P_W], *b = (const void *)p[P_B];
    float eps;
    int32_t eps_bits = (int32_t)p[P_EPS];
    memcpy(&eps, &eps_bits, sizeof eps);
    if (d > MAX_D) return -1;
#pragma omp parallel for schedule(static) num_threads((int)p[P_THREADS]) \
    if (p[P_THREADS] > 1 && rows * d >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) {
            float z[MAX_D];
            row_bf16((const bf16_t *)p[P_X] + r * p[P_LDX], (const bf16_t *)p[P_S] + r * p[P_LDS],
                     (bf16_t *)p[P_OUT] + r * p[P_LDO], w, b, d, w_bf16, eps, z);
        } else {
            row_f32((const float *)p[P_X] + r * p[P_LDX], (const float *)p[P_S] + r * p[P_LDS],
                    (float *)p[P_OUT] + r * p[P_LDO], w, b, d, w_bf16, eps);
        }
    }
    return 0;
}
