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
 * has AVX-512, else 8 (AVX2: two registers per 16-float vector would spill). Loaded from
 * float32 or bfloat16 without alignment assumptions. */
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

/* Lane-wise maximum, the largest lane, whether any lane of a comparison is set: one
 * instruction each where the ISA has it (intrinsics), portable bit arithmetic elsewhere. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
static inline float max_lanes(vf x) { return _mm512_reduce_max_ps((__m512)x); }
static inline int any_lane(vi m) { return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0; }
#elif defined(__AVX__)
#include <immintrin.h>
static inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
static inline float max_lanes(vf x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}
static inline int any_lane(vi m) { return _mm256_movemask_ps((__m256)m) != 0; }
#else
static inline vf vmax(vf a, vf b) {
    vi gt = a > b;
    vi ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    vi r = (ai & gt) | (bi & ~gt);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline float max_lanes(vf x) {
    float top = x[0];
    for (int i = 1; i < LANES; i++) top = x[i] > top ? x[i] : top;
    return top;
}

static inline int any_lane(vi m) {
    uint64_t words[LANES / 2];
    memcpy(words, &m, sizeof words);
    uint64_t acc = 0;
    for (int i = 0; i < LANES / 2; i++) acc |= words[i];
    return acc != 0;
}
#endif

/* exp_nonpositive on a vector, written out (gcc left the loop over the scalar one
 * unvectorised in AVX2 builds); below -87 it gives exp(-87), not 0: meant for terms of a
 * sum that holds a 1 (x - max). */
static inline vf vexp_nonpositive(vf x) {
    const vf lowest = (vf){0} - 87.0f;
    x = vmax(x, lowest);
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf q = (vf){0} + 1.9875691500e-4f;
    q = q * r + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    const vf y = q * r * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* The sums of four vectors' lanes at once, into out[0..3]: two rounds of pairing lanes
 * across vectors, then two within, instead of four separate trees (a score per key costs
 * about a quarter of the shuffles). */
static inline void sum4_lanes(vf a, vf b, vf c, vf d, float *out) {
#if defined(__clang__)
#define NMT_SHUFFLE2(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#define NMT_SHUFFLE1(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define NMT_SHUFFLE2(x, y, ...) __builtin_shuffle(x, y, (vi){__VA_ARGS__})
#define NMT_SHUFFLE1(x, ...) __builtin_shuffle(x, (vi){__VA_ARGS__})
#endif
#if LANES == 16
    vf ab = NMT_SHUFFLE2(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
          + NMT_SHUFFLE2(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf cd = NMT_SHUFFLE2(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
          + NMT_SHUFFLE2(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf x = NMT_SHUFFLE2(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + NMT_SHUFFLE2(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    x += NMT_SHUFFLE1(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += NMT_SHUFFLE1(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = x[0]; out[1] = x[4]; out[2] = x[8]; out[3] = x[12];
#else
    vf ab = NMT_SHUFFLE2(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + NMT_SHUFFLE2(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    vf cd = NMT_SHUFFLE2(c, d, 0, 1, 2, 3, 8, 9, 10, 11) + NMT_SHUFFLE2(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    vf x = NMT_SHUFFLE2(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) + NMT_SHUFFLE2(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    x += NMT_SHUFFLE1(x, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] = x[0]; out[1] = x[2]; out[2] = x[4]; out[3] = x[6];
#endif
#undef NMT_SHUFFLE2
#undef NMT_SHUFFLE1
}

#endif
