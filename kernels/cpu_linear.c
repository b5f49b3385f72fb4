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
#include <math.h>
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

/* Per-thread scratch, grown as needed and kept between calls (a fresh allocation per call
 * would page-fault on every projection of every token). Two slots: TILE for work inside a
 * parallel region (a dequantized tile, a tile's scales), ROWS for the calling thread's
 * quantized rows of x, which the region's threads read, PREP for the calling thread's
 * row of x before it is quantized (triforce_qlinear_q8's nw or glu). */
enum { TILE, ROWS, PREP };
static void *scratch(int slot, size_t bytes) {
    static __thread void *buf[3];
    static __thread size_t cap[3];
    if (bytes > cap[slot]) {
        free(buf[slot]);
        buf[slot] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
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

/* Rows r < M of x (ldx apart) dotted with a tile's NT weight rows w[j] (K floats each; rows
 * from nt on are read but not stored): 16 lanes accumulated in increasing k, summed by hsum,
 * into out[r * ldo + n0 + j] (+ bias). The one arithmetic of both float32-activation paths:
 * the same instructions for a row whatever M, the tile's source or the calling thread. */
static void tile_rows(const float *x, int64_t M, int64_t K, int64_t ldx, const float *const *w, int64_t nt,
                      const float *bias, int64_t n0, float *out, int64_t ldo) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * ldx;
        v16 acc[NT];
        for (int j = 0; j < NT; j++) acc[j] = (v16){};
        for (int64_t k = 0; k < K; k += 16) {
            v16 xv;
            memcpy(&xv, xr + k, sizeof xv);
            for (int j = 0; j < NT; j++) {
                v16 wv;
                memcpy(&wv, w[j] + k, sizeof wv);
                acc[j] += wv * xv;
            }
        }
        for (int64_t j = 0; j < nt; j++)
            out[r * ldo + n0 + j] = hsum(acc[j]) + (bias ? bias[n0 + j] : 0.0f);
    }
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
        float *w = scratch(TILE, (size_t)NT * K * sizeof(float));
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
            const float *wp[NT];
            for (int j = 0; j < NT; j++) wp[j] = w + j * K;
            tile_rows(x, M, K, ldx, wp, nt, bias, n0, out, ldo);
        }
    }
    return failed ? -2 : 0;
}

/* The same for a dense float32 W [N, K] (rows ldw apart): out = x @ W^T (+ bias). Tiles of NT
 * rows are read in place (nothing to dequantize); each row of x is dotted with a tile in
 * the order above, so a row's result never depends on M or on the other rows: the
 * row-exact float32 linear that lets a verification equal its decodes, and rows of
 * several sequences share a forward (runtime/batch), bit for bit. */
int triforce_linear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *W, int64_t ldw,
                        const float *bias, int64_t N, float *out, int64_t ldo) {
    if (K <= 0 || N <= 0 || M < 0 || K % 16 || ldx < K || ldw < K || ldo < N) return -1;
    const int64_t tiles = (N + NT - 1) / NT;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NT, nt = N - n0 < NT ? N - n0 : NT;
        const float *w[NT];
        for (int j = 0; j < NT; j++) w[j] = W + (n0 + (j < nt ? j : 0)) * ldw; /* last tile: repeat a row */
        tile_rows(x, M, K, ldx, w, nt, bias, n0, out, ldo);
    }
    return 0;
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

/* ---- int8 activations: integer dot products (AVX-512 VNNI `vpdpbusd`) -------------------
 *
 * The same weights, with each row of x quantized by itself to int8 in blocks of 32 inputs
 * (d = max|x| / 127, q = round(x / d): GGUF's Q8_0, what llama.cpp does to activations). A
 * row's quantization and every instruction after it depend only on that row, never on M:
 * the identity speculative decoding needs still holds.
 *
 * Each (row of x, weight row) pair is a scalar recurrence over units of U inputs (U = 16 for
 * weight groups of 16, else 32: a unit never spans two x blocks or two weight groups), in
 * increasing k:
 *   isum = sum_{k in unit} qx[k] * qw[k]                 (exact, int32)
 *   acc  = fma(float(isum), dx[unit] * sw[unit], acc)   (the scale product rounded, then one FMA)
 *   acc  = fma(xs[unit], min[unit], acc)                 (weights with offsets: xs = dx * sum qx)
 * then out = acc (+ bias) (res + out with a residual). Only integer sums (exact in any order)
 * depend on how the work is laid out, so three layouts compute it, each for the rows it suits:
 * - many rows (M >= XL_MIN): lanes are 16 rows of x. x is stored transposed as it is
 *   quantized (16 rows x 4 bytes per vector, q + 128 unsigned), and 4 bytes of a weight row
 *   are broadcast into vpdpbusd's signed operand; the lane starts from -128 * (sum of the
 *   unit's weights). Per unit and 8 weight rows: 8 or 4 vpdpbusd per weight row against one
 *   conversion, scale product and FMA per 16 pairs, where a layout of lanes along k would
 *   convert and scale every lane of every pair each 64 inputs.
 * - few rows: lanes are 16 weight rows. A tile of 16 weight rows is transposed into 4-byte
 *   columns (int8 weights + 128 unsigned, int4 nibbles; once at load, triforce_qpack, or per
 *   call), and 4 bytes of a row of x are broadcast as the signed operand; int8 weights' lanes
 *   start from -128 * (sum of the unit's x). Packed tiles go two at a time against up to four
 *   rows (wl_grid): each column load meets four rows, each broadcast two tiles.
 * - one row (M <= WR_MAX): the same lanes along weight rows without the transposed columns
 *   (wr_rows): each weight row against the row of x with lanes along k, the 16 rows' lanes
 *   then summed into each unit's integer sums.
 * int4 weights are unpacked to bytes first (nibbles 0..15). Builds without VNNI compute the
 * same recurrence in portable C: slow, for sanitizer runs and other CPUs.
 *
 * Layouts taken: K a multiple of 64, G in {16, 32} or a multiple of 64; anything else returns
 * -1 and the caller uses float activations. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TRIFORCE_VNNI 1
#else
#define TRIFORCE_VNNI 0
#endif

#define QC 64     /* K is a multiple of this */
#ifndef XL_MIN
#define XL_MIN 64 /* rows of x from which lanes are rows of x (measured: below, weight rows win) */
#endif
#ifndef NJ
#define NJ 8      /* weight rows per tile, lanes along x rows */
#endif
#define WL 16     /* weight rows per tile, lanes along weight rows */
#ifndef PF_DIST
#define PF_DIST 2 /* packed tile pairs ahead that a pair's first rows ask for (measured: 1-4 alike) */
#endif
#ifndef PF_LOC
#define PF_LOC 2  /* their locality: prefetcht1, into L2 (measured: into L1 no better) */
#endif
#ifndef WR_MAX
#define WR_MAX 1  /* rows of x up to which a tile's weight rows are not transposed (wr_rows) */
#endif

int triforce_linear_vnni(void) { return TRIFORCE_VNNI; }

/* One row of x (K floats) -> qx [K] int8, per unit of U: dxu (its x block's scale), sq (the
 * sum of its qx). */
static void quantize_row(const float *restrict x, int64_t K, int64_t U, int8_t *restrict qx,
                         float *restrict dxu, int32_t *restrict sq) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        int8_t *q = qx + b * 32;
#if TRIFORCE_VNNI
        const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, id))));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(c, id))));
#else
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) {
            const float a = xb[k] < 0 ? -xb[k] : xb[k];
            amax = a > amax ? a : amax;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < 32; k++) {
            const float v = __builtin_nearbyintf(xb[k] * id);
            q[k] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
#endif
        const float d = amax / 127.0f;
        for (int64_t u = b * 32 / U; u < (b + 1) * 32 / U; u++) {
            int32_t s = 0;
            for (int64_t k = 0; k < U; k++) s += qx[u * U + k];
            dxu[u] = d;
            sq[u] = s;
        }
    }
}

/* Weight row n's scale and offset per unit (float32) into sw, mu [Uc] */
static void unit_params(const void *scale, const void *minv, int f16, int64_t n, int64_t groups, int64_t G,
                        int64_t U, float *sw, float *mu) {
    for (int64_t g = 0; g < groups; g++)
        for (int64_t u = g * (G / U); u < (g + 1) * (G / U); u++) {
            sw[u] = load_param(scale, n * groups + g, f16);
            if (minv) mu[u] = load_param(minv, n * groups + g, f16);
        }
}

#if !TRIFORCE_VNNI
/* Weight row n as signed bytes in natural order: int8 rows in place, int4 rows unpacked into
 * dst (nibbles 0..15). */
static const int8_t *row_bytes(const uint8_t *q, int bits, int64_t K, int64_t n, int8_t *dst) {
    if (bits == 8) return (const int8_t *)q + n * K;
    const uint8_t *src = q + n * (K / 2);
    for (int64_t b = 0; b < K / 32; b++)
        for (int k = 0; k < 16; k++) {
            dst[b * 32 + k] = (int8_t)(src[b * 16 + k] & 0xf);
            dst[b * 32 + 16 + k] = (int8_t)(src[b * 16 + k] >> 4);
        }
    return dst;
}
#endif

#if TRIFORCE_VNNI
/* A tile's weights and a group of 16 x rows (transposed: x [K/4][16 rows x 4 bytes] as
 * q + 128, then dx [Uc][16], xs [Uc][16]) -> res[j][lane] for the tile's NJ weight rows
 * wb[j] (signed bytes), with cw [NJ][Uc] the lanes' starting values and sw, mu [NJ][Uc]. */
static inline __attribute__((always_inline)) void xl_tile(const uint8_t *grp, int64_t K, int64_t Uc,
                                                          const int8_t *const *wb, const int32_t *cw,
                                                          const float *sw, const float *mu, const int U,
                                                          const int MINV, float res[NJ][16]) {
    const float *dxt = (const float *)(grp + 16 * K), *xst = dxt + Uc * 16;
    __m512 acc[NJ];
    for (int j = 0; j < NJ; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t u = 0; u < Uc; u++) {
        __m512i is[NJ];
        for (int j = 0; j < NJ; j++) is[j] = _mm512_set1_epi32(cw[j * Uc + u]);
        for (int t = 0; t < U / 4; t++) {
            const __m512i xv = _mm512_loadu_si512(grp + (u * (U / 4) + t) * 64);
            for (int j = 0; j < NJ; j++) {
                int32_t wd;
                memcpy(&wd, wb[j] + u * U + 4 * t, sizeof wd);
                is[j] = _mm512_dpbusd_epi32(is[j], xv, _mm512_set1_epi32(wd));
            }
        }
        const __m512 sx = _mm512_loadu_ps(dxt + u * 16);
        for (int j = 0; j < NJ; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[j]), _mm512_mul_ps(sx, _mm512_set1_ps(sw[j * Uc + u])), acc[j]);
        if (MINV) {
            const __m512 xs = _mm512_loadu_ps(xst + u * 16);
            for (int j = 0; j < NJ; j++) acc[j] = _mm512_fmadd_ps(xs, _mm512_set1_ps(mu[j * Uc + u]), acc[j]);
        }
    }
    for (int j = 0; j < NJ; j++) _mm512_storeu_ps(res[j], acc[j]);
}

static void xl_tile_any(const uint8_t *grp, int64_t K, int64_t Uc, const int8_t *const *wb, const int32_t *cw,
                        const float *sw, const float *mu, int U, int minv, float res[NJ][16]) {
    if (U == 32) {
        if (minv) xl_tile(grp, K, Uc, wb, cw, sw, mu, 32, 1, res);
        else xl_tile(grp, K, Uc, wb, cw, sw, mu, 32, 0, res);
    } else {
        if (minv) xl_tile(grp, K, Uc, wb, cw, sw, mu, 16, 1, res);
        else xl_tile(grp, K, Uc, wb, cw, sw, mu, 16, 0, res);
    }
}

/* r[j] lane t <- r[t] lane j: a 16 x 16 transpose of 32-bit elements */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + 4 + k], 0x88);
            t[i + 4 + k] = _mm512_shuffle_i32x4(r[i + k], r[i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    }
}

/* 32 packed int4 bytes (64 inputs of a row: blocks A, B of 16 bytes) as [low nibbles |
 * high nibbles]: inputs 0..15, 32..47, 16..31, 48..63 by 128-bit lane, values 0..15 */
static inline __m512i nibbles(const uint8_t *p) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1),
                            _mm512_set1_epi8(0xf));
}

/* 64 inputs (chunk c) of weight row n as bytes in natural order (int4: nibbles 0..15) */
static inline __m512i chunk_bytes(const uint8_t *q, int bits, int64_t K, int64_t n, int64_t c) {
    if (bits == 8) return _mm512_loadu_si512(q + n * K + c * QC);
    const __m512i v = nibbles(q + n * (K / 2) + c * (QC / 2));
    return _mm512_shuffle_i64x2(v, v, 0xd8); /* 128-bit lanes 0, 2, 1, 3 */
}

/* A tile's x-lane weight row n: bytes (int4 unpacked into dst), cw [Uc] = -128 * each unit's sum */
static const int8_t *xl_row(const uint8_t *q, int bits, int64_t K, int64_t n, int64_t U, int8_t *dst, int32_t *cw) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t c = 0; c < K / QC; c++) {
        const __m512i w = chunk_bytes(q, bits, K, n, c);
        if (bits == 4) _mm512_storeu_si512(dst + c * QC, w);
        int32_t s[16];
        _mm512_storeu_si512(s, _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w));
        for (int u = 0; u < QC / U; u++) {
            int32_t t = 0;
            for (int i = 0; i < U / 4; i++) t += s[u * (U / 4) + i];
            cw[c * (QC / U) + u] = -128 * t;
        }
    }
    return bits == 8 ? (const int8_t *)q + n * K : dst;
}

/* The params of 16 weight rows n[j] per unit, as columns sw, mu [Uc][16] */
static void wl_params(const void *scale, const void *minv, int f16, const int64_t *n, int64_t groups, int64_t G,
                      int64_t U, int64_t Uc, float *sw, float *mu) {
    if (G != U) { /* groups of 64 or more: few, one at a time */
        for (int j = 0; j < WL; j++)
            for (int64_t g = 0; g < groups; g++) {
                const float a = load_param(scale, n[j] * groups + g, f16), b = minv ? load_param(minv, n[j] * groups + g, f16) : 0.0f;
                for (int64_t u = g * (G / U); u < (g + 1) * (G / U); u++) {
                    sw[u * WL + j] = a;
                    if (minv) mu[u * WL + j] = b;
                }
            }
        return;
    }
    for (int which = 0; which < (minv ? 2 : 1); which++) {
        const void *src = which ? minv : scale;
        float *dst = which ? mu : sw;
        for (int64_t u0 = 0; u0 < Uc; u0 += 16) {
            const int64_t left = Uc - u0;
            const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __m512i r[16];
            for (int j = 0; j < WL; j++) {
                const __m512 v = f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)src + n[j] * groups + u0))
                                     : _mm512_maskz_loadu_ps(m, (const float *)src + n[j] * groups + u0);
                r[j] = _mm512_castps_si512(v);
            }
            transpose16(r);
            for (int64_t t = 0; t < (left < 16 ? left : 16); t++) _mm512_storeu_si512(dst + (u0 + t) * 16, r[t]);
        }
    }
}

/* 16 weight rows n[j] into columns wt [K/4][16 rows x 4 bytes] (int8: q + 128 unsigned; int4:
 * nibbles), every 64 inputs one transpose. */
static void wl_columns(const uint8_t *q, int bits, int64_t K, const int64_t *n, uint8_t *wt) {
    const __m512i flip = _mm512_set1_epi8(bits == 8 ? (char)0x80 : 0);
    for (int64_t c = 0; c < K / QC; c++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = chunk_bytes(q, bits, K, n[j], c);
        transpose16(r);
        for (int t = 0; t < 16; t++) _mm512_storeu_si512(wt + (c * 16 + t) * 64, _mm512_xor_si512(r[t], flip));
    }
}

/* Column vector t of unit u in a tile's columns: as wl_columns writes them, or (PK, int4 packed
 * by triforce_qpack) two units' vectors in one, the first unit's in the low nibbles */
static inline __attribute__((always_inline)) __m512i wl_col(const uint8_t *wt, int64_t u, int t, const int U,
                                                            const int PK) {
    if (!PK) return _mm512_loadu_si512(wt + (u * (U / 4) + t) * 64);
    const __m512i v = _mm512_loadu_si512(wt + ((u >> 1) * 8 + t) * 64);
    return _mm512_and_si512(u & 1 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0xf));
}

/* Unit u's 16 weight rows' scales (offsets) from columns [Uc][16]: float32, or float16 (H16)
 * widened exactly */
static inline __attribute__((always_inline)) __m512 wl_par(const void *p, int64_t u, const int H16) {
    if (H16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + u * 16)));
    return _mm512_loadu_ps((const float *)p + u * 16);
}

/* RB rows of x from xrec (natural records: qx [K], dxu [Uc], xs [Uc], cx [Uc] = -128 * sq)
 * against TB tiles of 16 weight columns wt[i], sw[i] and mu[i] [Uc][16] -> tile j's row i at
 * res + (j * ldm + i) * 16.
 * Each (tile, row) keeps its own integer sum and float accumulator, in the same order
 * whatever TB and RB are: tiles and rows side by side share the column loads and the x
 * broadcasts (each column vector meets RB rows, each broadcast TB tiles) and give the core
 * independent chains, never each other's values. Where fewer than four (tile, row) pairs run,
 * each sum is split in two chains (one chain alone waits on its own latency); the integer
 * sums are exact, so the split does not change them. The columns and scales come from
 * wl_columns and wl_params (this call's transposition) or from triforce_qpack (PK for packed
 * int4, H16 for float16 scales): the same integers and floats either way. */
static inline __attribute__((always_inline)) void wl_grid(const uint8_t *const *wt, const void *const *sw,
                                                          const void *const *mu, const uint8_t *xrec,
                                                          size_t rec_bytes, const int TB, const int RB, int64_t K,
                                                          int64_t Uc, const int bits, const int U, const int MINV,
                                                          const int PK, const int H16, const uint8_t *pf,
                                                          int64_t pf_bytes, float *res, int64_t ldm) {
    const int two = TB * RB < 4; /* two chains per sum */
    const int64_t pf_u = pf ? (pf_bytes + 64 * Uc - 1) / (64 * Uc) : 0; /* lines asked for per unit */
    const uint8_t *rec[4];
    const float *dxu[4], *xs[4];
    const int32_t *cx[4];
    __m512 acc[2][4];
    for (int i = 0; i < RB; i++) {
        rec[i] = xrec + i * rec_bytes;
        dxu[i] = (const float *)(rec[i] + K);
        xs[i] = dxu[i] + Uc;
        cx[i] = (const int32_t *)(xs[i] + Uc);
        for (int j = 0; j < TB; j++) acc[j][i] = _mm512_setzero_ps();
    }
    for (int64_t u = 0; u < Uc; u++) {
        __m512i a[2][4], b[2][4];
        for (int64_t l = u * pf_u; l < (u + 1) * pf_u && 64 * l < pf_bytes; l++) __builtin_prefetch(pf + 64 * l, 0, PF_LOC);
        for (int j = 0; j < TB; j++)
            for (int i = 0; i < RB; i++) {
                a[j][i] = bits == 8 ? _mm512_set1_epi32(cx[i][u]) : _mm512_setzero_si512();
                b[j][i] = _mm512_setzero_si512();
            }
        for (int t = 0; t < U / 4; t += 2) {
            __m512i w0[2], w1[2];
            for (int j = 0; j < TB; j++) {
                w0[j] = wl_col(wt[j], u, t, U, PK);
                w1[j] = wl_col(wt[j], u, t + 1, U, PK);
            }
            for (int i = 0; i < RB; i++) {
                int32_t x0, x1;
                memcpy(&x0, rec[i] + u * U + 4 * t, sizeof x0);
                memcpy(&x1, rec[i] + u * U + 4 * t + 4, sizeof x1);
                const __m512i v0 = _mm512_set1_epi32(x0), v1 = _mm512_set1_epi32(x1);
                for (int j = 0; j < TB; j++) {
                    a[j][i] = _mm512_dpbusd_epi32(a[j][i], w0[j], v0);
                    if (two) b[j][i] = _mm512_dpbusd_epi32(b[j][i], w1[j], v1);
                    else a[j][i] = _mm512_dpbusd_epi32(a[j][i], w1[j], v1);
                }
            }
        }
        for (int j = 0; j < TB; j++) {
            const __m512 s = wl_par(sw[j], u, H16);
            for (int i = 0; i < RB; i++) {
                const __m512 comb = _mm512_mul_ps(_mm512_set1_ps(dxu[i][u]), s);
                const __m512i is = two ? _mm512_add_epi32(a[j][i], b[j][i]) : a[j][i];
                acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), comb, acc[j][i]);
                if (MINV) acc[j][i] = _mm512_fmadd_ps(_mm512_set1_ps(xs[i][u]), wl_par(mu[j], u, H16), acc[j][i]);
            }
        }
    }
    for (int j = 0; j < TB; j++)
        for (int i = 0; i < RB; i++) _mm512_storeu_ps(res + (j * ldm + i) * 16, acc[j][i]);
}

/* Rows r < M of x against TB tiles (wl_grid): four at a time, then what is left; res
 * [TB][M][16] */
static inline __attribute__((always_inline)) void wl_rows(const uint8_t *const *wt, const void *const *sw,
                                                          const void *const *mu, const uint8_t *xrec,
                                                          size_t rec_bytes, int64_t M, const int TB, int64_t K,
                                                          int64_t Uc, const int bits, const int U, const int MINV,
                                                          const int PK, const int H16, const uint8_t *pf,
                                                          int64_t pf_bytes, float *res) {
    for (int64_t r = 0; r < M;) {
        const int rb = M - r >= 4 ? 4 : M - r >= 2 ? 2 : 1;
        const uint8_t *x = xrec + r * rec_bytes;
        const uint8_t *p = r ? NULL : pf; /* the next tiles asked for while the first rows run */
        if (rb == 4) wl_grid(wt, sw, mu, x, rec_bytes, TB, 4, K, Uc, bits, U, MINV, PK, H16, p, pf_bytes, res + r * 16, M);
        else if (rb == 2) wl_grid(wt, sw, mu, x, rec_bytes, TB, 2, K, Uc, bits, U, MINV, PK, H16, p, pf_bytes, res + r * 16, M);
        else wl_grid(wt, sw, mu, x, rec_bytes, TB, 1, K, Uc, bits, U, MINV, PK, H16, p, pf_bytes, res + r * 16, M);
        r += rb;
    }
}

/* wl_rows for tb (1 or 2) tiles of this call's columns (pk = 0: wl_columns, float32 scales)
 * or packed ones (pk = 1: triforce_qpack's, scales as stored, h16 for float16) */
static void wl_rows_any(const uint8_t *const *wt, const void *const *sw, const void *const *mu, const uint8_t *xrec,
                        size_t rec_bytes, int64_t M, int tb, int64_t K, int64_t Uc, int bits, int U, int minv, int pk,
                        int h16, const uint8_t *pf, int64_t pf_bytes, float *res) {
#define WL_CASE(B, UU, MV, P, H)                                                                          \
    if (bits == B && U == UU && !!minv == MV && pk == P && h16 == H) {                                    \
        if (tb == 2)                                                                                      \
            return wl_rows(wt, sw, mu, xrec, rec_bytes, M, 2, K, Uc, B, UU, MV, B == 4 && P, H, pf, pf_bytes, res); \
        return wl_rows(wt, sw, mu, xrec, rec_bytes, M, 1, K, Uc, B, UU, MV, B == 4 && P, H, pf, pf_bytes, res);   \
    }
    WL_CASE(8, 32, 0, 0, 0) WL_CASE(8, 32, 1, 0, 0) WL_CASE(8, 16, 0, 0, 0) WL_CASE(8, 16, 1, 0, 0)
    WL_CASE(4, 32, 0, 0, 0) WL_CASE(4, 32, 1, 0, 0)
    WL_CASE(8, 32, 0, 1, 0) WL_CASE(8, 32, 1, 1, 0) WL_CASE(8, 16, 0, 1, 0) WL_CASE(8, 16, 1, 1, 0)
    WL_CASE(4, 32, 0, 1, 0) WL_CASE(4, 32, 1, 1, 0)
    WL_CASE(8, 32, 0, 1, 1) WL_CASE(8, 32, 1, 1, 1) WL_CASE(8, 16, 0, 1, 1) WL_CASE(8, 16, 1, 1, 1)
    WL_CASE(4, 32, 0, 1, 1) WL_CASE(4, 32, 1, 1, 1)
#undef WL_CASE
}
#endif

#if TRIFORCE_VNNI
/* wl_rows without the transposed columns, for very few rows of x (M <= WR_MAX): per 64
 * inputs, each of the 16 weight rows n[j] against the row of x by vpdpbusd with lanes
 * along k (weight bytes unsigned as wl_columns makes them, x signed), then the 16 vectors
 * summed into two: each unit's integer sum per weight row, lanes along weight rows. The
 * integer sums are exact, so they equal wl_rows' and the float recurrence after them is
 * wl_rows' own: the same bits, without transposing the tile for one row of x. */
static inline __attribute__((always_inline)) void wr_rows(const uint8_t *q, const int bits, int64_t K,
                                                          const int64_t *n, const float *sw, const float *mu,
                                                          const uint8_t *xrec, size_t rec_bytes, int64_t M,
                                                          int64_t Uc, const int MINV, float *res) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t r = 0; r < M; r++) {
        const uint8_t *rec = xrec + r * rec_bytes;
        const float *dxu = (const float *)(rec + K), *xs = dxu + Uc;
        const int32_t *cx = (const int32_t *)(xs + Uc);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < K / QC; c++) {
            __m512i xv = _mm512_loadu_si512(rec + c * QC);
            /* int4: the weights as `nibbles` leaves them (chunk_bytes' order without its lane
             * shuffle, which one row's x pays once instead of each weight row) */
            if (bits == 4) xv = _mm512_shuffle_i64x2(xv, xv, 0xd8);
            __m512i d[16];
            for (int j = 0; j < 16; j++) {
                const __m512i w = bits == 8 ? _mm512_xor_si512(chunk_bytes(q, 8, K, n[j], c), flip)
                                            : nibbles(q + n[j] * (K / 2) + c * (QC / 2));
                d[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
            }
            __m512i s1[8], s2[4];
            for (int i = 0; i < 8; i++) /* per 128-bit lane: rows 2i, 2i+1, pairs of k summed */
                s1[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2 * i], d[2 * i + 1]),
                                         _mm512_unpackhi_epi32(d[2 * i], d[2 * i + 1]));
            for (int m = 0; m < 4; m++) /* rows 4m .. 4m+3, each 128-bit lane's 16 inputs summed */
                s2[m] = _mm512_add_epi32(_mm512_unpacklo_epi64(s1[2 * m], s1[2 * m + 1]),
                                         _mm512_unpackhi_epi64(s1[2 * m], s1[2 * m + 1]));
            /* units (inputs 0..31, 32..63): 128-bit lanes 0 + 1 and 2 + 3 (int4: 0 + 2 and 1 + 3) */
            const int ua = bits == 8 ? 0x88 : 0x44, ub = bits == 8 ? 0xdd : 0xee;
            const __m512i t0 = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[0], s2[1], ua),
                                                _mm512_shuffle_i32x4(s2[0], s2[1], ub));
            const __m512i t1 = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[2], s2[3], ua),
                                                _mm512_shuffle_i32x4(s2[2], s2[3], ub));
            const __m512i is[2] = {_mm512_shuffle_i32x4(t0, t1, 0x88), _mm512_shuffle_i32x4(t0, t1, 0xdd)};
            for (int h = 0; h < 2; h++) {
                const int64_t u = 2 * c + h;
                const __m512i a = bits == 8 ? _mm512_add_epi32(is[h], _mm512_set1_epi32(cx[u])) : is[h];
                const __m512 comb = _mm512_mul_ps(_mm512_set1_ps(dxu[u]), _mm512_loadu_ps(sw + u * 16));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), comb, acc);
                if (MINV) acc = _mm512_fmadd_ps(_mm512_set1_ps(xs[u]), _mm512_loadu_ps(mu + u * 16), acc);
            }
        }
        _mm512_storeu_ps(res + r * 16, acc);
    }
}

static void wr_rows_any(const uint8_t *q, int bits, int64_t K, const int64_t *n, const float *sw, const float *mu,
                        const uint8_t *xrec, size_t rec_bytes, int64_t M, int64_t Uc, int minv, float *res) {
    if (bits == 8) {
        if (minv) wr_rows(q, 8, K, n, sw, mu, xrec, rec_bytes, M, Uc, 1, res);
        else wr_rows(q, 8, K, n, sw, mu, xrec, rec_bytes, M, Uc, 0, res);
    } else {
        if (minv) wr_rows(q, 4, K, n, sw, mu, xrec, rec_bytes, M, Uc, 1, res);
        else wr_rows(q, 4, K, n, sw, mu, xrec, rec_bytes, M, Uc, 0, res);
    }
}
#endif

/* One row of x as the int8 kernel takes it, before quantization: RMS-normalised with
 * weight nw (x * (1 / sqrtf(sum(x^2) / K + eps)) * nw, the sum in increasing k), or the
 * SwiGLU of a row [gate K | up K] (silu(gate) * up), into dst [K]. Row by row, so a row's
 * values never depend on the others of the batch. */
static void prep_row(const float *restrict x, int64_t K, const float *restrict nw, float eps, int glu,
                     float *restrict dst) {
    if (nw) {
        float ss = 0.0f;
        for (int64_t k = 0; k < K; k++) ss += x[k] * x[k];
        const float inv = 1.0f / sqrtf(ss / (float)K + eps);
        for (int64_t k = 0; k < K; k++) dst[k] = x[k] * inv * nw[k];
    } else {
        for (int64_t k = 0; k < K; k++) {
            const float g = x[k];
            dst[k] = g / (1.0f + expf(-g)) * x[K + k];
        }
    }
}

/* out[r, n] from the pair's recurrence value o (bias, residual as documented above) */
static inline void store(float *out, int64_t ldo, const float *bias, const float *radd, int64_t ldr, int64_t r,
                         int64_t n, float o) {
    if (bias) o += bias[n];
    out[r * ldo + n] = radd ? radd[r * ldr + n] + o : o;
}

/* W as the int8 kernel takes it: K a multiple of QC, groups of 16, 32 or a multiple of 64
 * (int4: of 32) */
static int q8_layout_ok(int64_t K, int64_t N, int64_t G, int bits) {
    return K > 0 && N > 0 && G > 0 && K % QC == 0 && K % G == 0 && (bits == 8 || bits == 4) &&
           (G == 16 || G == 32 || G % 64 == 0) && !(bits == 4 && G % 32);
}

/* triforce_qpack's tile of 16 weight rows: its columns (int8 16K bytes, int4 8K), then the
 * scales per unit [Uc][16] (pk_par bytes), then the offsets */
static int64_t pk_cols(int bits, int64_t K) { return bits == 8 ? 16 * K : 8 * K; }
static int64_t pk_par(int64_t Uc, int f16) { return Uc * 16 * (f16 ? 2 : 4); }
static int64_t pk_tile(int bits, int64_t K, int64_t Uc, int f16, int minv) {
    return pk_cols(bits, K) + (minv ? 2 : 1) * pk_par(Uc, f16);
}

/* As triforce_qlinear, with x quantized per row to int8 (above), and the ops around a
 * projection in the same pass (what a decoder layer's Python would run as several small
 * ops): x RMS-normalised first (nw: the norm's weight, eps) or x a row [gate | up] of 2K
 * whose SwiGLU is the input (glu), and the output added to radd [M, N] (ldr; radd may be
 * out: out = radd + x W^T + bias); NULL, 0 for none. packed: the weight's columns from
 * triforce_qpack, or NULL: calls of fewer than XL_MIN rows read them instead of transposing
 * each tile of W (the same integers, scales and order: the same bits); the others read q.
 * Returns 0, -1 for a layout it does not take, -2 when scratch memory is short. */
int triforce_qlinear_q8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q, int bits,
                        int64_t G, const void *scale, const void *minv, int f16, const float *bias,
                        int64_t N, float *out, int64_t ldo, const float *nw, float eps, int glu,
                        const float *radd, int64_t ldr, const uint8_t *packed) {
    if (!q8_layout_ok(K, N, G, bits) || M < 0 || ldx < (glu ? 2 * K : K) || ldo < N || (nw && glu) ||
        (radd && ldr < N))
        return -1;
    if (M == 0) return 0;
    const int64_t U = G == 16 ? 16 : 32, Uc = K / U, groups = K / G;
    /* natural records (few rows, portable builds): qx [K], dxu, xs [Uc] floats, cx [Uc] int32;
     * x-lane groups of 16 rows: x [K/4][64], dx [Uc][16], xs [Uc][16] */
    const size_t rec_bytes = ((size_t)K + 12 * (size_t)Uc + 63) / 64 * 64, grp_bytes = 16 * (size_t)K + 128 * (size_t)Uc;
    const int xl = TRIFORCE_VNNI && M >= XL_MIN;
    const int64_t ngrp = (M + 15) / 16;
    uint8_t *xbuf = scratch(ROWS, xl ? (size_t)ngrp * grp_bytes : (size_t)M * rec_bytes);
    float *xp = scratch(PREP, (size_t)K * sizeof(float) + rec_bytes);
    if (!xbuf || !xp) return -2;
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        if (nw || glu) {
            prep_row(row, K, nw, eps, glu, xp);
            row = xp;
        }
        uint8_t *rec = xl ? (uint8_t *)(xp + K) : xbuf + r * rec_bytes;
        float *dxu = (float *)(rec + K), *xs = dxu + Uc;
        int32_t *sq = (int32_t *)(xs + Uc);
        quantize_row(row, K, U, (int8_t *)rec, dxu, sq);
        for (int64_t u = 0; u < Uc; u++) {
            xs[u] = dxu[u] * (float)sq[u];
            sq[u] = -128 * sq[u]; /* cx: an int8 weight column's lanes start here */
        }
        if (xl) { /* into lane r % 16 of its group, x + 128 as unsigned bytes */
            uint8_t *grp = xbuf + (r / 16) * grp_bytes;
            const int l = (int)(r % 16);
            if (l == 0 && M - r < 16) { /* a last, partial group: the lanes past M hold x = 0 */
                memset(grp, 0x80, 16 * (size_t)K);
                memset(grp + 16 * (size_t)K, 0, 128 * (size_t)Uc);
            }
            for (int64_t k = 0; k < K; k += 4) {
                uint32_t d;
                memcpy(&d, rec + k, sizeof d);
                d ^= 0x80808080u;
                memcpy(grp + k * 16 + 4 * l, &d, sizeof d);
            }
            float *dxt = (float *)(grp + 16 * K), *xst = dxt + Uc * 16;
            for (int64_t u = 0; u < Uc; u++) {
                dxt[u * 16 + l] = dxu[u];
                xst[u * 16 + l] = xs[u];
            }
        }
    }
    const int64_t nt_w = xl ? NJ : WL, tiles = (N + nt_w - 1) / nt_w;
#if TRIFORCE_VNNI /* triforce_qpack's tiles: columns, scales, offsets */
    const int64_t p_cols = pk_cols(bits, K), p_par = pk_par(Uc, f16), p_tile = pk_tile(bits, K, Uc, f16, minv != NULL);
#else
    (void)packed;
#endif
    /* per thread: xl: NJ unpacked int4 rows, cw [NJ][Uc], sw, mu [NJ][Uc]; else: columns
     * [K/4][64], sw, mu [Uc][16] (and the portable path's unpacked row) */
    const size_t tile_bytes = xl ? (size_t)NJ * K + 12 * (size_t)NJ * Uc : (size_t)16 * K + 128 * (size_t)Uc + K;
#if TRIFORCE_VNNI
    if (packed && !xl) { /* packed tiles two at a time (wl_rows): each column load meets up to
                            * four rows, each x broadcast two tiles */
#pragma omp parallel for schedule(static)
        for (int64_t tp = 0; tp < (tiles + 1) / 2; tp++) {
            const int64_t t0 = 2 * tp, tb2 = t0 + 1 < tiles ? 2 : 1;
            const uint8_t *wt[2];
            const void *sw[2], *mu[2];
            for (int i = 0; i < tb2; i++) {
                wt[i] = packed + (t0 + i) * p_tile;
                sw[i] = wt[i] + p_cols;
                mu[i] = (const uint8_t *)sw[i] + p_par;
            }
            /* a later pair's bytes, asked for a few lines per unit while this pair's first rows
             * run: asked for all at once they stall the core until they arrive */
            const int64_t pf0 = (t0 + 2 * PF_DIST) * p_tile, left = tiles * p_tile - pf0;
            const int64_t pf_bytes = left <= 0 ? 0 : left < 2 * p_tile ? left : 2 * p_tile;
            for (int64_t r0 = 0; r0 < M; r0 += 16) {
                const int64_t rb = M - r0 < 16 ? M - r0 : 16;
                float res[2 * 16 * 16];
                wl_rows_any(wt, sw, mu, xbuf + r0 * rec_bytes, rec_bytes, rb, (int)tb2, K, Uc, bits, (int)U,
                            minv != NULL, 1, f16, r0 == 0 && pf_bytes ? packed + pf0 : NULL, pf_bytes, res);
                for (int i = 0; i < tb2; i++) {
                    const int64_t n0 = (t0 + i) * WL, nt = N - n0 < WL ? N - n0 : WL;
                    for (int64_t r = 0; r < rb; r++)
                        for (int64_t j = 0; j < nt; j++)
                            store(out, ldo, bias, radd, ldr, r0 + r, n0 + j, res[(i * rb + r) * 16 + j]);
                }
            }
        }
        return 0;
    }
#endif
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *tb = scratch(TILE, tile_bytes);
        if (!tb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < tiles; ti++) {
            if (!tb) continue;
            const int64_t n0 = ti * nt_w, nt = N - n0 < nt_w ? N - n0 : nt_w;
#if TRIFORCE_VNNI
            if (xl) {
                int32_t *cw = (int32_t *)(tb + (size_t)NJ * K);
                float *sw = (float *)(cw + NJ * Uc), *mu = sw + NJ * Uc;
                const int8_t *wb[NJ];
                for (int j = 0; j < NJ; j++) {
                    const int64_t n = n0 + (j < nt ? j : 0); /* last tile: repeat a row */
                    wb[j] = xl_row(q, bits, K, n, U, (int8_t *)tb + (size_t)j * K, cw + j * Uc);
                    unit_params(scale, minv, f16, n, groups, G, U, sw + j * Uc, mu + j * Uc);
                }
                for (int64_t g = 0; g < ngrp; g++) {
                    float res[NJ][16];
                    xl_tile_any(xbuf + g * grp_bytes, K, Uc, wb, cw, sw, mu, (int)U, minv != NULL, res);
                    for (int64_t l = 0; l < 16 && g * 16 + l < M; l++)
                        for (int64_t j = 0; j < nt; j++) store(out, ldo, bias, radd, ldr, g * 16 + l, n0 + j, res[j][l]);
                }
                continue;
            }
            {
                uint8_t *wt = tb;
                float *sw = (float *)(tb + 16 * (size_t)K), *mu = sw + 16 * Uc;
                int64_t n[WL];
                for (int j = 0; j < WL; j++) n[j] = n0 + (j < nt ? j : 0);
                wl_params(scale, minv, f16, n, groups, G, U, Uc, sw, mu);
                /* the next tile's scales asked for now (this tile's work leaves the loads far
                 * apart), and its weights: now for one row (wr_rows), a few lines per unit
                 * while the first rows run for several (wl_grid: all at once they stall the core) */
                const int64_t wbytes = bits == 4 ? K / 2 : K, pbytes = groups * (f16 ? 2 : 4);
                const int one = M <= WR_MAX && U == 32; /* wr_rows: no transposed columns */
                const int64_t next = ti + 1 < tiles ? (N - n0 - nt < WL ? N - n0 - nt : WL) : 0;
                if (next) {
                    if (one)
                        for (int64_t b = 0; b < next * wbytes; b += 64) __builtin_prefetch(q + (n0 + nt) * wbytes + b, 0, 0);
                    for (int64_t b = 0; b < next * pbytes; b += 64) {
                        __builtin_prefetch((const uint8_t *)scale + (n0 + nt) * pbytes + b, 0, 0);
                        if (minv) __builtin_prefetch((const uint8_t *)minv + (n0 + nt) * pbytes + b, 0, 0);
                    }
                }
                if (one) { /* a single row of x: no transposed columns */
                    float res[WR_MAX][16];
                    wr_rows_any(q, bits, K, n, sw, mu, xbuf, rec_bytes, M, Uc, minv != NULL, &res[0][0]);
                    for (int64_t r = 0; r < M; r++)
                        for (int64_t j = 0; j < nt; j++) store(out, ldo, bias, radd, ldr, r, n0 + j, res[r][j]);
                    continue;
                }
                wl_columns(q, bits, K, n, wt);
                for (int64_t r0 = 0; r0 < M; r0 += 16) {
                    const int64_t rb = M - r0 < 16 ? M - r0 : 16;
                    float res[16][16];
                    const uint8_t *wts[1] = {wt};
                    const void *sws[1] = {sw}, *mus[1] = {mu};
                    wl_rows_any(wts, sws, mus, xbuf + r0 * rec_bytes, rec_bytes, rb, 1, K, Uc, bits, (int)U,
                                minv != NULL, 0, 0, r0 == 0 && next ? q + (n0 + nt) * wbytes : NULL, next * wbytes,
                                &res[0][0]);
                    for (int64_t r = 0; r < rb; r++)
                        for (int64_t j = 0; j < nt; j++) store(out, ldo, bias, radd, ldr, r0 + r, n0 + j, res[r][j]);
                }
            }
#else
            float *sw = (float *)(tb + 16 * (size_t)K), *mu = sw + 16 * Uc;
            for (int64_t j = 0; j < nt; j++) {
                const int8_t *w = row_bytes(q, bits, K, n0 + j, (int8_t *)tb);
                unit_params(scale, minv, f16, n0 + j, groups, G, U, sw, mu);
                for (int64_t r = 0; r < M; r++) {
                    const uint8_t *rec = xbuf + r * rec_bytes;
                    const int8_t *qx = (const int8_t *)rec;
                    const float *dxu = (const float *)(rec + K), *xs = dxu + Uc;
                    float acc = 0.0f;
                    for (int64_t u = 0; u < Uc; u++) {
                        int32_t is = 0;
                        for (int64_t k = u * U; k < (u + 1) * U; k++) is += (int32_t)qx[k] * w[k];
                        const float comb = dxu[u] * sw[u];
                        acc = __builtin_fmaf((float)is, comb, acc);
                        if (minv) acc = __builtin_fmaf(xs[u], mu[u], acc);
                    }
                    store(out, ldo, bias, radd, ldr, r, n0 + j, acc);
                }
            }
#endif
        }
    }
    return failed ? -2 : 0;
}

/* W's columns as the int8 kernel's few-rows path reads them, made once (at load) instead of
 * by every call: per tile of 16 weight rows (rows past N repeat the tile's first, as the
 * kernel's last tile does), the tile's columns [K/4][16 rows x 4 bytes] (int8: q + 128;
 * int4: nibbles, unit 2c's vector t in the low nibbles and unit 2c + 1's in the high ones of
 * one byte, the bytes q takes), then the scales (then offsets) per unit [Uc][16] as stored
 * (float16 or float32). triforce_qpack_bytes gives the size, or -1 where the layout or the
 * build (no VNNI) has no packed path; triforce_qpack writes it: 0, -1, -2 (memory). */
int64_t triforce_qpack_bytes(int64_t K, int bits, int64_t G, int f16, int minv, int64_t N) {
    if (!TRIFORCE_VNNI || !q8_layout_ok(K, N, G, bits)) return -1;
    return (N + WL - 1) / WL * pk_tile(bits, K, K / (G == 16 ? 16 : 32), f16, minv);
}

int triforce_qpack(int64_t K, const uint8_t *q, int bits, int64_t G, const void *scale, const void *minv, int f16,
                   int64_t N, uint8_t *out) {
    const int64_t bytes = triforce_qpack_bytes(K, bits, G, f16, minv != NULL, N);
    if (bytes < 0) return -1;
#if TRIFORCE_VNNI
    const int64_t U = G == 16 ? 16 : 32, Uc = K / U, groups = K / G, tiles = (N + WL - 1) / WL, tile = bytes / tiles;
    const int64_t cols = pk_cols(bits, K), es = f16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *tmp = bits == 4 ? scratch(TILE, 16 * (size_t)K) : NULL;
        if (bits == 4 && !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < tiles; ti++) {
            if (bits == 4 && !tmp) continue;
            uint8_t *dst = out + ti * tile;
            int64_t n[WL];
            for (int j = 0; j < WL; j++) n[j] = ti * WL + j < N ? ti * WL + j : ti * WL;
            wl_columns(q, bits, K, n, bits == 8 ? dst : tmp);
            if (bits == 4)
                for (int64_t c = 0; c < K / QC; c++)
                    for (int t = 0; t < 8; t++) {
                        const __m512i lo = _mm512_loadu_si512(tmp + (c * 16 + t) * 64);
                        const __m512i hi = _mm512_loadu_si512(tmp + (c * 16 + t + 8) * 64);
                        _mm512_storeu_si512(dst + (c * 8 + t) * 64, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
                    }
            for (int which = 0; which < (minv ? 2 : 1); which++) {
                const uint8_t *src = which ? minv : scale;
                uint8_t *pd = dst + cols + which * pk_par(Uc, f16);
                for (int64_t u = 0; u < Uc; u++)
                    for (int j = 0; j < WL; j++)
                        memcpy(pd + (u * 16 + j) * es, src + (n[j] * groups + u * U / G) * es, es);
            }
        }
    }
    return failed ? -2 : 0;
#else
    (void)q, (void)scale, (void)out;
    return -1;
#endif
}

/* ---- a forward's layers in one call (runtime/model/program.py) ----
 * The layers of a plain pre-norm decoder (RMSNorm, qkv, RoPE + attention, o, RMSNorm,
 * gate|up, SwiGLU, down, residual adds) for T tokens of one sequence, each layer making the
 * calls the model's Python makes for it (transformer.py Block.forward through
 * QLinear.fused and a cache's rope_attend), with the same arguments in the same order: so
 * the same bits, without ~100 us of Python and ctypes per layer. The attention is
 * triforce_rope_attend of the attention library, given as a function pointer.
 *
 * prog [L, LAYER_W] int64: per layer four projections (qkv with the input norm, o with the
 * residual, gate|up with the post-attention norm, down with SwiGLU and the residual), each
 * PROJ_W words: K, N, norm weight (0: none), eps (float32 bits), glu, parts, then per part
 * PART_W words: q, bits, group, scale, minv, f16, bias, rows, column, packed columns (the
 * arguments QLinear's plan passes triforce_qlinear_q8).
 * kv [L, 2]: each layer's K and V buffers; qf [L, H, G*T, D] out: each layer's rotated queries.
 * x [T, hidden] in and out (the residual stream); y [T, hidden], qkv [T, N of qkv],
 * o [T, Hq*D], h [T, N of gate|up] scratch. The rest is triforce_rope_attend's. */
#define PART_W 10
#define MAX_PARTS 4
#define PROJ_W (6 + MAX_PARTS * PART_W)
#define LAYER_W (4 * PROJ_W)

typedef int (*rope_attend_fn)(const float *qkv, int64_t T, int64_t ldq, int64_t Hq, const float *cos,
                              const float *sin, void *k, void *v, int bf16, float scale, float softcap,
                              int64_t H, int64_t D, int64_t s0, int64_t hs, int64_t ss, const int64_t *nvis,
                              int64_t block, float *qf, float *part, float *out, float *lse, float *o);

#define PTR(w) ((void *)(intptr_t)(w))

/* out = (radd +) proj(norm(x)) or proj(silu(gate) * up) over its parts, as QLinear.fused */
static int program_proj(const int64_t *p, const float *x, int64_t M, float *out, const float *radd) {
    const int64_t K = p[0], N = p[1], glu = p[4], np = p[5];
    const uint32_t eb = (uint32_t)p[3];
    float eps;
    memcpy(&eps, &eb, sizeof eps);
    if (np < 1 || np > MAX_PARTS) return -1;
    for (int64_t i = 0; i < np; i++) {
        const int64_t *q = p + 6 + i * PART_W;
        const int rc = triforce_qlinear_q8(x, M, K, glu ? 2 * K : K, PTR(q[0]), (int)q[1], q[2], PTR(q[3]),
                                           PTR(q[4]), (int)q[5], PTR(q[6]), q[7], out + q[8], N, PTR(p[2]),
                                           eps, (int)glu, radd ? radd + q[8] : NULL, N, PTR(q[9]));
        if (rc) return rc;
    }
    return 0;
}

/* a layer's o projection (residual x into y), gate|up with the post-attention norm (y into h)
 * and down with SwiGLU (residual y into x), after its attention wrote o */
static int program_rest(const int64_t *pq, int64_t M, float *x, float *y, float *o, float *h) {
    const int64_t *po = pq + PROJ_W, *pg = po + PROJ_W, *pd = pg + PROJ_W;
    int rc = program_proj(po, o, M, y, x);
    if (!rc) rc = program_proj(pg, y, M, h, NULL);
    if (!rc) rc = program_proj(pd, h, M, x, y);
    return rc;
}

int triforce_forward_layers(int64_t L, const int64_t *prog, const int64_t *kv, float *qf, void *rope_attend, int64_t T,
                            float *x, float *y, float *qkv, float *o, float *h, const float *cos,
                            const float *sin, int bf16, float scale, float softcap, int64_t Hq, int64_t H,
                            int64_t D, int64_t s0, int64_t hs, int64_t ss, const int64_t *nvis, int64_t block,
                            float *part, float *out, float *lse) {
    const rope_attend_fn ra = (rope_attend_fn)rope_attend;
    if (L < 0 || T < 1 || !ra || H <= 0 || Hq % H) return -1;
    for (int64_t l = 0; l < L; l++) {
        const int64_t *pq = prog + l * LAYER_W, *lkv = kv + 2 * l;
        int rc = program_proj(pq, x, T, qkv, NULL);
        if (!rc)
            rc = ra(qkv, T, pq[1], Hq, cos, sin, PTR(lkv[0]), PTR(lkv[1]), bf16, scale, softcap, H, D, s0, hs, ss,
                    nvis, block, qf + l * H * (Hq / H) * T * D, part, out, lse, o);
        if (!rc) rc = program_rest(pq, T, x, y, o, h);
        if (rc) return rc;
    }
    return 0;
}

typedef int (*rope_attend_seqs_fn)(const float *qkv, int64_t ldq, int64_t Hq, const float *cos, const float *sin,
                                   int bf16, float scale, float softcap, int64_t H, int64_t D, int64_t nseq,
                                   const int64_t *kp, const int64_t *vp, const int64_t *meta, const int64_t *nvis,
                                   int64_t block, float *qf, float *o, double *secs);

/* triforce_forward_layers for a batch's ragged forward: the N rows of several sequences,
 * each layer's attention triforce_rope_attend_seqs (the attention library's, a function
 * pointer) with the plan the layer loop passes it (runtime/batch/rows.py Ragged.rope_attend):
 * meta, nvis as native.SeqSteps; kv [L, 2, nseq] each layer's sequences' K then V buffers;
 * qf [L] x qf_layer floats out (each layer's folded rotated queries); secs [L, nseq] or NULL
 * (each layer's thread-seconds per sequence). The projections as triforce_forward_layers'. */
int triforce_forward_layers_seqs(int64_t L, const int64_t *prog, const int64_t *kv, float *qf, int64_t qf_layer,
                                 void *rope_attend_seqs, int64_t N, float *x, float *y, float *qkv, float *o,
                                 float *h, const float *cos, const float *sin, int bf16, float scale, float softcap,
                                 int64_t Hq, int64_t H, int64_t D, int64_t nseq, const int64_t *meta,
                                 const int64_t *nvis, int64_t block, double *secs) {
    const rope_attend_seqs_fn ra = (rope_attend_seqs_fn)rope_attend_seqs;
    if (L < 0 || N < 1 || nseq < 1 || !ra) return -1;
    for (int64_t l = 0; l < L; l++) {
        const int64_t *pq = prog + l * LAYER_W, *lkv = kv + 2 * nseq * l;
        int rc = program_proj(pq, x, N, qkv, NULL);
        if (!rc)
            rc = ra(qkv, pq[1], Hq, cos, sin, bf16, scale, softcap, H, D, nseq, lkv, lkv + nseq, meta, nvis, block,
                    qf + l * qf_layer, o, secs ? secs + l * nseq : NULL);
        if (!rc) rc = program_rest(pq, N, x, y, o, h);
        if (rc) return rc;
    }
    return 0;
}
