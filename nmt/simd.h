/* What the package's C kernels share (nmt/native.py builds them with this directory on
 * the include path): bfloat16 conversions, an exp for the softmaxes, and vectors of the
 * build's width. */
#ifndef NMT_SIMD_H
#define NMT_SIMD_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_float(bf16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (bf16_t)(bits >> 16);
}

/* exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp), written so that loops over it
 * vectorise; x below -87 gives 0. */
static inline float exp_nonpositive(float x) {
    const float log2e = 1.44269504088896341f;
    float clamped = x < -87.0f ? -87.0f : x;
    float n = (clamped * log2e + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : y * scale;
}

/* Vectors of the CPU's width (GCC/Clang vector extensions): 16 floats where the build
 * has AVX-512, else 8 (AVX2; two registers per 16-float vector cost spills there: 4x
 * slower, measured). Loaded from float32 or bfloat16 without
 * alignment assumptions. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu32 __attribute__((vector_size(4 * LANES)));
typedef uint16_t vu16 __attribute__((vector_size(2 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
/* Lane indices 8..15 of a 16-lane shuffle mask (lane 0 is all that is read afterwards). */
#if LANES == 16
#define LANE_TAIL , 8, 9, 10, 11, 12, 13, 14, 15
#else
#define LANE_TAIL
#endif

static inline vf load_f32(const float *x) { vf r; memcpy(&r, x, sizeof r); return r; }

static inline vf load_bf16(const bf16_t *x) {
    vu16 half;
    memcpy(&half, x, sizeof half);
    vu32 wide = __builtin_convertvector(half, vu32) << 16;
    vf r;
    memcpy(&r, &wide, sizeof r);
    return r;
}

/* The sum of a vector's lanes as a tree (lanes rotated and added, log2(LANES) times), not
 * dependent scalar adds: without -ffast-math the compiler may not reorder a plain loop's
 * additions. __builtin_shuffle is GCC's (4.7+), __builtin_shufflevector Clang's. */
static inline float sum_lanes(vf x) {
#if defined(__clang__)
#if LANES == 16
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3 LANE_TAIL);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5 LANE_TAIL);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6 LANE_TAIL);
#else
#if LANES == 16
    x += __builtin_shuffle(x, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
#endif
    x += __builtin_shuffle(x, (vi){4, 5, 6, 7, 0, 1, 2, 3 LANE_TAIL});
    x += __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5 LANE_TAIL});
    x += __builtin_shuffle(x, (vi){1, 0, 3, 2, 5, 4, 7, 6 LANE_TAIL});
#endif
    return x[0];
}

#endif
