/* Weight-only quantized linear on the CPU: out = x @ W^T (+ bias), W stored as integers.
 *
 * Built by kernels/native.py like cpu_attention.c (-O3 -march=native -fopenmp, the OpenMP
 * runtime torch already loaded) and called through ctypes.
 *
 * W [N, K] is kept as integers q with one scale (and optionally one offset) per group of
 * G consecutive inputs of a row:  w[n, k] = scale[n, k / G] * q[n, k] + min[n, k / G].
 *   bits 8: q is int8, one byte per weight, G a multiple of 16 (GGUF Q8_0, Q6_K, Q5_x);
 *   bits 4: q is unsigned 4-bit in blocks of 32 weights packed in 16 bytes, byte j holding
 *           weight j in its low nibble and weight j + 16 in its high one (GGUF's Q4_0/Q4_1
 *           layout; Q4_K is repacked into it at load), G a multiple of 32.
 * Scales and offsets are float16 (GGUF's own d/m) or float32 (products such as Q4_K's
 * d * sc, which float16 cannot hold exactly).
 *
 * Activations stay float32: nothing is quantized but the weights, so a row's result
 * depends only on that row of x and on W, never on the other rows. The work is tiles of
 * NT output features: a tile is dequantized once into a per-thread float32 scratch (shared
 * by every row of x), then each row's NT dot products accumulate 16 lanes in increasing k
 * and are summed horizontally in a fixed order. The same instructions run on a row
 * whatever M is and whichever thread computes it, so a verification of 7 tokens gives each
 * token bit for bit what a decode of that token alone gives: the identity speculative
 * decoding needs to stay token-identical to autoregressive decoding.
 *
 * Vectors are GCC/Clang vector extensions of 16 lanes: one AVX-512 register on AVX-512
 * builds, two AVX2 registers on AVX2 builds, four NEON ones on ARM (the build is per CPU).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define NT 8 /* output features per tile */

static inline float hsum(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* 16 int8 -> 16 floats; 16 bytes -> their low and high nibbles as 2x16 floats. Intrinsics
 * on x86 (GCC scalarises __builtin_convertvector of bytes), vector extensions elsewhere. */
static inline v16 i8_to_f32(const int8_t *p) {
    v16 r;
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&r, &f, sizeof r);
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    memcpy(&r, &f0, sizeof f0);
    memcpy((char *)&r + 32, &f1, sizeof f1);
#else
    i8x16 b;
    memcpy(&b, p, sizeof b);
    r = __builtin_convertvector(b, v16);
#endif
    return r;
}

static inline void u4_to_f32(const uint8_t *p, v16 *lo, v16 *hi) {
#if defined(__AVX512F__)
    __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512 l = _mm512_cvtepi32_ps(_mm512_and_si512(u, _mm512_set1_epi32(0xf)));
    __m512 h = _mm512_cvtepi32_ps(_mm512_srli_epi32(u, 4));
    memcpy(lo, &l, sizeof l);
    memcpy(hi, &h, sizeof h);
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i u0 = _mm256_cvtepu8_epi32(b), u1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    __m256i m = _mm256_set1_epi32(0xf);
    __m256 l0 = _mm256_cvtepi32_ps(_mm256_and_si256(u0, m)), l1 = _mm256_cvtepi32_ps(_mm256_and_si256(u1, m));
    __m256 h0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(u0, 4)), h1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(u1, 4));
    memcpy(lo, &l0, 32);
    memcpy((char *)lo + 32, &l1, 32);
    memcpy(hi, &h0, 32);
    memcpy((char *)hi + 32, &h1, 32);
#else
    u8x16 b;
    memcpy(&b, p, sizeof b);
    u32x16 u = __builtin_convertvector(b, u32x16);
    *lo = __builtin_convertvector(u & 0xf, v16);
    *hi = __builtin_convertvector(u >> 4, v16);
#endif
}

/* IEEE half -> float, exact (normals, subnormals, inf, nan) */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: renormalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load_param(const void *p, int64_t i, int f16) {
#if defined(__F16C__)
    if (f16) return _cvtsh_ss(((const uint16_t *)p)[i]);
#endif
    return f16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The dequantization (contracted to one FMA where the CPU has it). */
static inline v16 dq(v16 qf, v16 s, v16 m) { return qf * s + m; }

/* Row n of W (K weights) as float32 into dst. */
static void dequant_row(float *restrict dst, const uint8_t *restrict q, int bits, int64_t K, int64_t G,
                        const void *scale, const void *minv, int f16, int64_t n) {
    const int64_t groups = K / G;
    for (int64_t g = 0; g < groups; g++) {
        const v16 s = (v16){} + load_param(scale, n * groups + g, f16);
        const v16 m = (v16){} + (minv ? load_param(minv, n * groups + g, f16) : 0.0f);
        if (bits == 8) {
            const int8_t *src = (const int8_t *)q + n * K + g * G;
            for (int64_t k = 0; k < G; k += 16) {
                v16 w = dq(i8_to_f32(src + k), s, m);
                memcpy(dst + g * G + k, &w, sizeof w);
            }
        } else {
            const uint8_t *src = q + n * (K / 2) + g * (G / 2);
            for (int64_t k = 0; k < G; k += 32) {
                v16 lo, hi;
                u4_to_f32(src + k / 2, &lo, &hi);
                lo = dq(lo, s, m);
                hi = dq(hi, s, m);
                memcpy(dst + g * G + k, &lo, sizeof lo);
                memcpy(dst + g * G + k + 16, &hi, sizeof hi);
            }
        }
    }
}

/* Per-thread scratch for one dequantized tile, grown as needed and kept between calls
 * (a fresh allocation per call would page-fault on every projection of every token). */
static float *scratch(int64_t floats) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (floats > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)floats * sizeof(float));
        cap = buf ? floats : 0;
    }
    return buf;
}

int triforce_linear_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) || defined(__ARM_NEON)
    return 256;
#else
    return 128;
#endif
}

/* out[m, n] (rows ldo apart) = sum_k x[m, k] w[n, k] (+ bias[n]) for m < M, n < N; x rows ldx
 * apart. Returns 0, -1 for a layout it does not take, -2 when scratch memory is short. */
int triforce_qlinear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q, int bits,
                     int64_t G, const void *scale, const void *minv, int f16, const float *bias,
                     int64_t N, float *out, int64_t ldo) {
    if (K <= 0 || N <= 0 || M < 0 || G <= 0 || K % G || (bits == 8 && G % 16) ||
        (bits == 4 && G % 32) || (bits != 8 && bits != 4) || ldx < K || ldo < N)
        return -1;
    const int64_t tiles = (N + NT - 1) / NT;
    int failed = 0;
#pragma omp parallel
    {
        float *w = scratch(NT * K);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!w) continue;
            const int64_t n0 = t * NT, nt = N - n0 < NT ? N - n0 : NT;
            for (int64_t j = 0; j < nt; j++) dequant_row(w + j * K, q, bits, K, G, scale, minv, f16, n0 + j);
            if (nt < NT) memset(w + nt * K, 0, (size_t)((NT - nt) * K) * sizeof(float)); /* last tile */
            for (int64_t r = 0; r < M; r++) {
                const float *xr = x + r * ldx;
                v16 acc[NT];
                for (int j = 0; j < NT; j++) acc[j] = (v16){};
                for (int64_t k = 0; k < K; k += 16) {
                    v16 xv;
                    memcpy(&xv, xr + k, sizeof xv);
                    for (int j = 0; j < NT; j++) {
                        v16 wv;
                        memcpy(&wv, w + j * K + k, sizeof wv);
                        acc[j] += wv * xv;
                    }
                }
                for (int64_t j = 0; j < nt; j++)
                    out[r * ldo + n0 + j] = hsum(acc[j]) + (bias ? bias[n0 + j] : 0.0f);
            }
        }
    }
    return failed ? -2 : 0;
}

/* Rows `ids` of W dequantized into out [n_ids, K] (an embedding lookup in the same format). */
int triforce_qrows(const int64_t *ids, int64_t n_ids, int64_t K, const uint8_t *q, int bits, int64_t G,
                   const void *scale, const void *minv, int f16, int64_t N, float *out) {
    if (K <= 0 || G <= 0 || K % G || (bits == 8 && G % 16) || (bits == 4 && G % 32) ||
        (bits != 8 && bits != 4))
        return -1;
    for (int64_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= N) return -1;
        dequant_row(out + i * K, q, bits, K, G, scale, minv, f16, ids[i]);
    }
    return 0;
}
