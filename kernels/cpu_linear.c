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
 * row of x before it is quantized (triforce_qlinear_q8x). */
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
 * (d = max|x| / 127, q = round(x / d): GGUF's Q8_0, what llama.cpp does to activations), so
 * a 64-input chunk of a weight row dots with a chunk of x in one instruction: 16 int32 lanes,
 * each the exact sum of 4 byte products. A row's quantization and every instruction after it
 * depend only on that row, never on M: the identity speculative decoding needs still holds.
 *
 * Lane i of a chunk covers 4 consecutive bytes. For int4 weights the bytes are the chunk's
 * two 32-blocks unpacked as [A0..15, B0..15, A16..31, B16..31] (low nibbles, then high), so
 * x is stored in that order too; int8 weights are in natural order. Each lane's integer sum
 * is scaled by its weight group's scale times its x block's scale:
 *   acc += float(idot) * sx_lane * sw_lane   (one FMA after the multiply),
 * and a group's offset adds min[g] * sum_{k in g} d_b q_k (the dot of the dequantized x).
 * Signed int8 weights go into vpdpbusd's signed operand with x + 128 as the unsigned one;
 * the lane starts from -128 * (sum of the lane's weights), so the sum is exactly q . w.
 * Builds without VNNI compute the same lanes in portable C (same integer sums, same float
 * operations in the same order): slow, for sanitizer runs and other CPUs.
 *
 * Layouts taken: K a multiple of 64, G in {16, 32} or a multiple of 64 (a lane never spans
 * two groups); anything else returns -1 and the caller uses float activations. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TRIFORCE_VNNI 1
#else
#define TRIFORCE_VNNI 0
#endif

#define QC 64 /* inputs per chunk */
#define NTQ 4 /* output features per tile (int8 activations) */

int triforce_linear_vnni(void) { return TRIFORCE_VNNI; }

/* input position (within its chunk) of lane i's first byte */
static inline int lane_pos(int bits, int i) {
    if (bits == 8) return 4 * i;
    static const int p4[16] = {0, 4, 8, 12, 32, 36, 40, 44, 16, 20, 24, 28, 48, 52, 56, 60};
    return p4[i];
}

/* One row of x (K floats) -> bytes in the chunk order of `bits` (int4: q as int8, int8: q + 128
 * as uint8), lane scales sxl [K/64][16], and per weight group the dot of dequantized x with
 * ones, xsg [ngp] (zero padded; only when the weights have offsets). */
static void quantize_row(const float *restrict x, int64_t K, int bits, int64_t G, uint8_t *restrict xq,
                         float *restrict sxl, float *restrict xsg, int64_t ngp) {
    if (xsg)
        for (int64_t g = 0; g < ngp; g++) xsg[g] = 0.0f;
    for (int64_t c = 0; c < K / QC; c++) {
        float d[2];
        int8_t q[QC];
        for (int h = 0; h < 2; h++) { /* the chunk's two blocks of 32 */
            const float *xb = x + c * QC + h * 32;
#if TRIFORCE_VNNI
            const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            _mm_storeu_si128((__m128i *)(q + h * 32), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, id))));
            _mm_storeu_si128((__m128i *)(q + h * 32 + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, id))));
#else
            float amax = 0.0f;
            for (int k = 0; k < 32; k++) {
                const float a = xb[k] < 0 ? -xb[k] : xb[k];
                amax = a > amax ? a : amax;
            }
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int k = 0; k < 32; k++) {
                const float v = __builtin_nearbyintf(xb[k] * id);
                q[h * 32 + k] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
#endif
            d[h] = amax / 127.0f;
        }
        for (int i = 0; i < 16; i++) {
            const int p = lane_pos(bits, i);
            sxl[c * 16 + i] = d[p / 32];
            for (int b = 0; b < 4; b++)
                xq[c * QC + 4 * i + b] = bits == 8 ? (uint8_t)(q[p + b] + 128) : (uint8_t)q[p + b];
        }
        if (xsg)
            for (int s = 0; s < 4; s++) {
                int sum = 0;
                for (int k = 0; k < 16; k++) sum += q[s * 16 + k];
                xsg[(c * QC + s * 16) / G] += d[s / 2] * (float)sum;
            }
    }
}

/* Weight row n's scales and offsets as float32, zero padded to ngp + 16 (the lane gather
 * below reads 16 from a chunk's first group). */
static void row_params(const void *scale, const void *minv, int f16, int64_t n, int64_t groups, int64_t ngp,
                       float *restrict sw, float *restrict mf) {
#if TRIFORCE_VNNI
    for (int which = 0; which < (minv ? 2 : 1); which++) {
        const void *src = which ? minv : scale;
        float *dst = which ? mf : sw;
        for (int64_t g = 0; g < ngp + 16; g += 16) {
            const int64_t left = groups - g;
            const __mmask16 m = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __m512 v = f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)src + n * groups + g))
                                 : _mm512_maskz_loadu_ps(m, (const float *)src + n * groups + g);
            _mm512_storeu_ps(dst + g, v);
        }
    }
#else
    for (int64_t g = 0; g < ngp + 16; g++) sw[g] = g < groups ? load_param(scale, n * groups + g, f16) : 0.0f;
    if (minv)
        for (int64_t g = 0; g < ngp + 16; g++) mf[g] = g < groups ? load_param(minv, n * groups + g, f16) : 0.0f;
#endif
}

#if !TRIFORCE_VNNI
/* sum over lanes of float(idot) * sx * sw, accumulated chunk by chunk in increasing k, for one
 * x row and one weight row: the portable definition of what dot_tile computes with VNNI. */
static float dot_row(const uint8_t *restrict xq, const float *restrict sxl, const uint8_t *restrict wrow,
                     const float *restrict sw, int bits, int64_t G, int64_t C, const int *gl) {
    v16 acc = (v16){};
    for (int64_t c = 0; c < C; c++) {
        for (int i = 0; i < 16; i++) {
            int32_t sum = 0;
            for (int b = 0; b < 4; b++) {
                const int k = 4 * i + b; /* byte k of the chunk, in the lane order above */
                if (bits == 4) {
                    const uint8_t byte = wrow[c * (QC / 2) + (k % 32)];
                    sum += (int32_t)(k < 32 ? byte & 0xf : byte >> 4) * (int8_t)xq[c * QC + k];
                } else {
                    sum += ((int32_t)xq[c * QC + k] - 128) * (int8_t)wrow[c * QC + k];
                }
            }
            const float s = G <= 32 ? sw[c * QC / G + gl[i]] : sw[c * QC / G];
            acc[i] = __builtin_fmaf((float)sum * sxl[c * 16 + i], s, acc[i]);
        }
    }
    return hsum(acc);
}
#endif

#if TRIFORCE_VNNI
/* Rows r < RBN of x (row_bytes apart from xq) against weight rows j < NTN, every chunk: res[r][j]
 * as dot_row computes it, lane for lane and chunk for chunk (so a row's result does not
 * depend on RBN or NTN); each weight chunk is unpacked and its lane scales gathered once for
 * the RBN rows. RBN, NTN and bits are constants in each specialization (tile_q8 below). */
static inline __attribute__((always_inline)) void dot_tile(const uint8_t *xq, size_t row_bytes, int64_t K,
                                                           const uint8_t *const *w, const float *const *sw,
                                                           const int bits, int64_t G, int64_t C, __m512i idx,
                                                           const int RBN, const int NTN, float res[4][4]) {
    const __m256i lo4 = _mm256_set1_epi8(0xf);
    const __m512i bias8 = _mm512_set1_epi8((char)0x80);
    __m512 acc[4][4];
    for (int r = 0; r < RBN; r++)
        for (int j = 0; j < NTN; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
        __m512i wv[4], cr[4];
        __m512 s[4];
        for (int j = 0; j < NTN; j++) {
            if (bits == 4) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(w[j] + c * (QC / 2)));
                wv[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, lo4)),
                                           _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4), 1);
            } else {
                wv[j] = _mm512_loadu_si512(w[j] + c * QC);
                /* -128 * (sum of the lane's weights): the accumulator each row's dot starts from,
                 * so that (x + 128) . w lands on x . w with no subtraction per row (exact: int32) */
                cr[j] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                         _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias8, wv[j]));
            }
            s[j] = G <= 32 ? _mm512_permutexvar_ps(idx, _mm512_loadu_ps(sw[j] + c * QC / G))
                           : _mm512_set1_ps(sw[j][c * QC / G]);
        }
        for (int r = 0; r < RBN; r++) {
            const uint8_t *xr = xq + r * row_bytes;
            const __m512i xv = _mm512_loadu_si512(xr + c * QC);
            const __m512 sx = _mm512_loadu_ps((const float *)(xr + K) + c * 16);
            for (int j = 0; j < NTN; j++) {
                const __m512i idot = bits == 4 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv)
                                               : _mm512_dpbusd_epi32(cr[j], xv, wv[j]);
                acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(idot), sx), s[j], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < RBN; r++)
        for (int j = 0; j < NTN; j++) {
            v16 v;
            memcpy(&v, &acc[r][j], sizeof v);
            res[r][j] = hsum(v);
        }
}

#define TILE_CASE(B, R, T) \
    case (B) * 100 + (R) * 10 + (T): dot_tile(xq, row_bytes, K, w, sw, B, G, C, idx, R, T, res); break;
#define TILE_ROWS(B, R) TILE_CASE(B, R, 1) TILE_CASE(B, R, 2) TILE_CASE(B, R, 3) TILE_CASE(B, R, 4)

static void tile_q8(const uint8_t *xq, size_t row_bytes, int64_t K, const uint8_t *const *w, const float *const *sw,
                    int bits, int64_t G, int64_t C, __m512i idx, int rb, int nt, float res[4][4]) {
    switch (bits * 100 + rb * 10 + nt) {
        TILE_ROWS(4, 1) TILE_ROWS(4, 2) TILE_ROWS(4, 3) TILE_ROWS(4, 4)
        TILE_ROWS(8, 1) TILE_ROWS(8, 2) TILE_ROWS(8, 3) TILE_ROWS(8, 4)
    }
}
#endif

static float dot_offsets(const float *mf, const float *xsg, int64_t ngp) {
#if TRIFORCE_VNNI
    __m512 a = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngp; g += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(mf + g), _mm512_loadu_ps(xsg + g), a);
    v16 acc;
    memcpy(&acc, &a, sizeof acc);
#else
    v16 acc = (v16){};
    for (int64_t g = 0; g < ngp; g += 16) {
        v16 m, s;
        memcpy(&m, mf + g, sizeof m);
        memcpy(&s, xsg + g, sizeof s);
        for (int i = 0; i < 16; i++) acc[i] = __builtin_fmaf(m[i], s[i], acc[i]);
    }
#endif
    return hsum(acc);
}

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

static int qlinear_q8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q, int bits,
                      int64_t G, const void *scale, const void *minv, int f16, const float *bias,
                      int64_t N, float *out, int64_t ldo, const float *nw, float eps, int glu,
                      const float *radd, int64_t ldr) {
    if (K <= 0 || N <= 0 || M < 0 || G <= 0 || K % QC || K % G || (bits != 8 && bits != 4) ||
        !(G == 16 || G == 32 || G % 64 == 0) || (bits == 4 && G % 32) || ldx < (glu ? 2 * K : K) ||
        ldo < N || (nw && glu) || (radd && ldr < N))
        return -1;
    if (M == 0) return 0;
    const int64_t C = K / QC, groups = K / G, ngp = (groups + 15) / 16 * 16;
    const int64_t wbytes = bits == 4 ? K / 2 : K;
    const size_t row_bytes = (size_t)K + (size_t)C * 16 * sizeof(float) + (size_t)ngp * sizeof(float);
    uint8_t *xbuf = scratch(ROWS, (size_t)M * row_bytes);
    float *xp = nw || glu ? scratch(PREP, (size_t)K * sizeof(float)) : NULL;
    if (!xbuf || ((nw || glu) && !xp)) return -2;
    for (int64_t r = 0; r < M; r++) {
        uint8_t *xr = xbuf + r * row_bytes;
        const float *row = x + r * ldx;
        if (xp) {
            prep_row(row, K, nw, eps, glu, xp);
            row = xp;
        }
        quantize_row(row, K, bits, G, xr, (float *)(xr + K), minv ? (float *)(xr + K) + C * 16 : NULL, ngp);
    }
    int gl[16]; /* lane i's group, relative to its chunk's first (0 when G is a multiple of 64) */
    for (int i = 0; i < 16; i++) gl[i] = G <= 32 ? lane_pos(bits, i) / (int)G : 0;
#if TRIFORCE_VNNI
    const __m512i idx = _mm512_loadu_si512(gl);
#endif
    /* One int8 weight row per tile for a single row of x (a decode step): measured on a Zen 4
     * VM with one thread, a 49152x576 Q8_0 matrix (the bundled model's LM head) streamed from
     * memory in 2.5 ms this way against 5.1 ms in tiles of four; int4 rows lost (3.5 -> 4.2 ms
     * for 92160x576), and so does anything served from cache. A row's result is the same
     * either way (every (row, feature) pair accumulates alone, in the same order). */
    const int64_t ntq = bits == 8 && M == 1 ? 1 : NTQ;
    const int64_t tiles = (N + ntq - 1) / ntq;
    int failed = 0;
#pragma omp parallel
    {
        float *sw = scratch(TILE, (size_t)NTQ * (2 * ngp + 32) * sizeof(float));
        if (!sw) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < tiles; ti++) {
            if (!sw) continue;
            const int64_t n0 = ti * ntq, nt = N - n0 < ntq ? N - n0 : ntq;
            for (int64_t j = 0; j < nt; j++)
                row_params(scale, minv, f16, n0 + j, groups, ngp, sw + j * (2 * ngp + 32), sw + j * (2 * ngp + 32) + ngp + 16);
            const uint8_t *w[NTQ];
            const float *swp[NTQ];
            for (int64_t j = 0; j < nt; j++) {
                w[j] = q + (n0 + j) * wbytes;
                swp[j] = sw + j * (2 * ngp + 32);
            }
            /* The next tile's weights asked for now: with several rows of x, the rows' dots
             * of this tile leave the loads far apart and the hardware prefetcher falls behind
             * (measured on a Zen 4 VM, 2 threads, Gemma 3's 262144x640 LM head at 8 rows:
             * 19.6 -> 9.4 ms; 2 rows 10.1 -> 4.1; one row unchanged at 4.9). */
            if (ti + 1 < tiles)
                for (int64_t b = 0; b < (N - n0 - nt < ntq ? N - n0 - nt : ntq) * wbytes; b += 64)
                    __builtin_prefetch(q + (n0 + nt) * wbytes + b, 0, 0);
            for (int64_t r0 = 0; r0 < M; r0 += 4) {
                const int rb = M - r0 < 4 ? (int)(M - r0) : 4;
                float res[4][4];
#if TRIFORCE_VNNI
                tile_q8(xbuf + r0 * row_bytes, row_bytes, K, w, swp, bits, G, C, idx, rb, (int)nt, res);
#else
                for (int r = 0; r < rb; r++)
                    for (int64_t j = 0; j < nt; j++) {
                        const uint8_t *xr = xbuf + (r0 + r) * row_bytes;
                        res[r][j] = dot_row(xr, (const float *)(xr + K), w[j], swp[j], bits, G, C, gl);
                    }
#endif
                for (int r = 0; r < rb; r++) {
                    const float *xsg = (const float *)(xbuf + (r0 + r) * row_bytes + K) + C * 16;
                    for (int64_t j = 0; j < nt; j++) {
                        float o = res[r][j];
                        if (minv) o += dot_offsets(swp[j] + ngp + 16, xsg, ngp);
                        if (bias) o += bias[n0 + j];
                        out[(r0 + r) * ldo + n0 + j] = radd ? radd[(r0 + r) * ldr + n0 + j] + o : o;
                    }
                }
            }
        }
    }
    return failed ? -2 : 0;
}

/* As triforce_qlinear, with x quantized per row to int8 (above). Returns 0, -1 for a layout
 * it does not take, -2 when scratch memory is short. */
int triforce_qlinear_q8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q, int bits,
                        int64_t G, const void *scale, const void *minv, int f16, const float *bias,
                        int64_t N, float *out, int64_t ldo) {
    return qlinear_q8(x, M, K, ldx, q, bits, G, scale, minv, f16, bias, N, out, ldo, NULL, 0.0f, 0, NULL, 0);
}

/* triforce_qlinear_q8 with the ops around a projection in the same pass (what a decoder
 * layer's Python would run as several small ops): x RMS-normalised first (nw: the norm's
 * weight, eps) or x a row [gate | up] of 2K whose SwiGLU is the input (glu), and the
 * output added to res [M, N] (ldr; res may be out: out = res + x W^T + bias). */
int triforce_qlinear_q8x(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q, int bits,
                         int64_t G, const void *scale, const void *minv, int f16, const float *bias,
                         int64_t N, float *out, int64_t ldo, const float *nw, float eps, int glu,
                         const float *res, int64_t ldr) {
    return qlinear_q8(x, M, K, ldx, q, bits, G, scale, minv, f16, bias, N, out, ldo, nw, eps, glu, res, ldr);
}
