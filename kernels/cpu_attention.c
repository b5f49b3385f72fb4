/* Decode/verify attention on the CPU: a few query rows over a long KV cache.
 *
 * Built by kernels/native.py with the system C compiler (-O3 -march=native -fopenmp) and
 * called through ctypes. The OpenMP runtime is the one torch already loaded (same soname),
 * so this shares torch's threads instead of competing with them.
 *
 * Work is split into (KV head, block of keys) items. Each item computes, for every query
 * row of that head, the block's max score m, sum of exp l and unnormalised output acc; a
 * second pass merges the blocks of a row in key order.
 *
 * Scores take one of two paths. Few rows (a decode, < FEW_ROWS): one key at a time, each
 * row's dot product vectorised over the head dimension (16 lanes, fused multiply-adds in
 * increasing d) and summed horizontally; this is bound by reading K. More rows (a
 * verification, a prefill chunk): a tile of 32 keys is transposed so keys sit in the
 * vector lanes, and tiles of up to 8 rows x 32 keys compute the same sums: per lane of
 * the head dimension, then the 16 lane sums in the horizontal sum's tree. So a row's
 * scores are the same bits on both paths, and softmax and the weighted sum of values run
 * row by row: a verification's row equals that token's decode bit for bit, also where
 * the activations feeding the next layer are quantized (a last-bit difference there can
 * flip a rounding). Blocks of keys have a fixed size (kernels/native.py BLOCK), so every
 * row's blocks and their merge order are the same too.
 * With bfloat16 K and V, head sizes a multiple of 32 and a CPU with AVX512_BF16 (the build
 * targets it), every call takes the bf16 path instead, decodes and verifications alike:
 * queries rounded to bfloat16, pairs of products by vdpbf16ps, probabilities rounded to
 * bfloat16 for the weighted sum of values (see BF_PATH below): half the instructions.
 * Probabilities and sums are float32 throughout otherwise. Soft-capped scores (Gemma 2: softcap > 0)
 * become softcap * tanh(score * scale / softcap), element by element after the dot
 * products, so that identity holds for them too; softcap 0 takes the plain scaling loop.
 * Vectors are GCC/Clang vector extensions of 16 floats: the compiler maps them onto
 * whatever the CPU has (one AVX-512 register, two AVX2 ones, four NEON ones).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

#define MAXV 16 /* head_dim up to 256 */

static inline float hsum(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* DV vectors of key/value row `off` as float32 */
static inline void load_row(v16 *restrict dst, const void *base, int bf16, int64_t off, int DV) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < DV; i++) {
            u16x16 h;
            memcpy(&h, p + 16 * i, sizeof h);
            u32x16 w = __builtin_convertvector(h, u32x16) << 16;
            memcpy(dst + i, &w, sizeof w);
        }
    } else {
        const float *p = (const float *)base + off;
        for (int i = 0; i < DV; i++) memcpy(dst + i, p + 16 * i, sizeof(v16));
    }
}

typedef int32_t i16x16 __attribute__((vector_size(64)));

static inline v16 vmax(v16 a, v16 b) {
    i16x16 gt = a > b; /* lanes: -1 where a > b */
    return (v16)(((i16x16)a & gt) | ((i16x16)b & ~gt));
}

/* exp of 16 values <= 0 (scores minus their max): Cephes' expf polynomial in vector
 * extensions, so it runs 16 lanes at a time without -ffast-math (which would also assume
 * there are no infinities). Relative error about 2e-7. */
#if defined(__AVX512F__)
/* The same operations as the vector-extension version below compiles to (its multiply-adds
 * fused as GCC fuses them), in fewer instructions: vmaxps is vmax (x where x > -87, else
 * -87, NaN included), and vscalefps multiplies by 2^n exactly as the built power of two
 * does (every result here is a normal float: x >= -87). So the same bits. */
static inline v16 exp_neg16(v16 xv) {
    __m512 x;
    memcpy(&x, &xv, sizeof x);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_cvtepi32_ps(_mm512_cvttps_epi32(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(-0.5f)))); /* round */
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x));
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(r, _mm512_mul_ps(p, r), r), _mm512_set1_ps(1.0f));
    const __m512 e = _mm512_scalef_ps(y, n);
    memcpy(&xv, &e, sizeof e);
    return xv;
}
#else
static inline v16 exp_neg16(v16 x) {
    v16 lo = {0};
    lo -= 87.0f;
    x = vmax(x, lo);
    const i16x16 ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i16x16); /* round */
    const v16 n = __builtin_convertvector(ni, v16);
    const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v16 y = p * r * r + r + 1.0f;
    return y * (v16)((ni + 127) << 23);
}
#endif

/* tanh of 16 values, Cephes' tanhf in vector extensions: x + x^3 P(x^2) below |x| 0.625,
 * else (1 - e) / (1 + e) with e = exp(-2|x|); the sign copied back. Relative error about
 * 3e-7; each lane on its own (a value's result does not depend on its neighbours). */
static inline v16 tanh16(v16 x) {
    const u32x16 sign = (u32x16)x & 0x80000000u;
    const v16 a = (v16)((u32x16)x & 0x7fffffffu);
    const v16 e = exp_neg16(a * -2.0f);
    const v16 big = (1.0f - e) / (1.0f + e);
    const v16 z = a * a;
    v16 p = z * -5.70498872745e-3f + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const v16 small = p * z * a + a;
    v16 edge = {0};
    edge += 0.625f;
    const i16x16 lo = a < edge;
    const v16 t = (v16)(((i16x16)small & lo) | ((i16x16)big & ~lo));
    return (v16)((u32x16)t | sign);
}

/* s[0 .. n-1] = cap * tanh(s * scale / cap): soft-capped scores (Gemma 2) */
static inline void softcap_row(float *restrict s, int64_t n, float scale, float cap) {
    for (int64_t j = 0; j < n; j += 16) {
        const int64_t w = n - j < 16 ? n - j : 16;
        v16 x = {0};
        memcpy(&x, s + j, sizeof(float) * w);
        x = tanh16(x * scale / cap) * cap;
        memcpy(s + j, &x, sizeof(float) * w);
    }
}

#if defined(__AVX512BF16__)
/* x's 16 values rounded to bfloat16 words (to nearest, ties to even; normal values and
 * zeros: vcvtneps2bf16 reads a subnormal as zero) */
static inline __m256bh bf16_words(v16 x) {
    __m512 f;
    memcpy(&f, &x, sizeof f);
    return _mm512_cvtneps_pbh(f);
}

/* 16 bfloat16 words as float32 */
static inline v16 widen_bf16(__m256bh w) {
    const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)w), 16);
    v16 x;
    memcpy(&x, &u, sizeof x);
    return x;
}
#endif

/* x rounded to bfloat16 (to nearest, ties to even; normal values and zeros), as float32 */
static inline v16 round_bf16(v16 x) {
#if defined(__AVX512BF16__)
    return widen_bf16(bf16_words(x));
#else
    u32x16 u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

/* softmax statistics of s[lo .. n-1] in place: s becomes exp(s - m) (0 below lo and from n
 * on, up to `len`, a multiple of 16; s[0 .. lo-1] must be -INFINITY); returns m, sets *l = sum */
static inline float softmax_row(float *restrict s, int64_t lo, int64_t n, int64_t len, float *l, int bfp) {
    v16 mv = {0};
    mv -= INFINITY;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        v16 x;
        memcpy(&x, s + j, sizeof x);
        mv = vmax(x, mv);
    }
    float m = -INFINITY;
    for (int i = 0; i < 16; i++) m = mv[i] > m ? mv[i] : m;
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    for (j = n; j < len; j++) s[j] = m; /* exp(0) = 1, zeroed below */
    v16 sum = {0};
    for (j = 0; j < len; j += 16) {
        v16 x;
        memcpy(&x, s + j, sizeof x);
        x = exp_neg16(x - m);
        if (bfp) x = round_bf16(x); /* the bf16 path weighs values by these: the sum is theirs */
        memcpy(s + j, &x, sizeof x);
    }
    for (j = n; j < len; j++) s[j] = 0.f;
    for (j = 0; j < lo; j++) s[j] = 0.f; /* a band's keys before its first (window layers) */
    for (j = 0; j < len; j += 16) {
        v16 x;
        memcpy(&x, s + j, sizeof x);
        sum += x;
    }
    *l = hsum(sum);
    return m;
}

/* scores[r * block + j - j0] for rows 0..R-1 and keys j0..jend-1 */
static inline __attribute__((always_inline)) void scores_by_key(
        float *restrict scores, const float *qh, const void *k, int bf16, int64_t base, int64_t ss,
        int64_t j0, int64_t jend, int64_t R, int64_t block, const int DV) {
    /* one key at a time, every row's dot product with it (few rows: decode) */
    for (int64_t j = j0; j < jend; j++) {
        v16 kv[MAXV];
        load_row(kv, k, bf16, base + j * ss, DV);
        for (int64_t r = 0; r < R; r++) {
            const float *qr = qh + r * 16 * DV;
            v16 a = {0};
            for (int i = 0; i < DV; i++) {
                v16 qv;
                memcpy(&qv, qr + 16 * i, sizeof qv);
                a += qv * kv[i];
            }
            scores[r * block + (j - j0)] = hsum(a);
        }
    }
}

#define FEW_ROWS 8 /* below: rows one by one (decode); from here: keys in vector lanes */
#define TK 32 /* keys per transposed tile: two vectors */
#ifndef K_AHEAD
#define K_AHEAD 128 /* keys on that a key read asks for into L2 (measured: 96-384 alike) */
#endif
#define MR 8 /* query rows per register tile (the packed rows are padded to a multiple) */
/* How triforce_attend_seqs shares its items (a sequence's KV head's block) and rows' merges
 * among threads: where the sequences differ in rows or blocks (a verification's 21 rows over
 * 16K keys beside decodes over 2K), equal counts of items are unequal work, so threads take
 * SEQS_CHUNK items at a time in order (measured on 2 cores: a 7-token verification over 16K
 * keys with three decodes over 2K 1.58 -> 1.36 ms a layer, the time of its work balanced);
 * where every sequence has the same rows and blocks, each thread takes an equal run in
 * order (static: its K stream and the reads asked for ahead stay its own; about 5% better
 * there than chunks). Which thread computes an item never changes its numbers: each item
 * writes its own part, each row's merge reads them in key order. */
#define SEQS_CHUNK 8

/* a tile of n rows (1..MR) runs ROWS_CASE(n): code unrolled for each row count */
#define ROW_TILE_SWITCH(n) \
    switch (n) { ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8) }

/* 16x16 transpose of 32-bit elements: x[i][e] -> x[e][i], four butterfly stages (each
 * swaps one bit of the row index with the same bit of the column index) */
#define SWAP_STAGE(H, ...)                                                                   \
    for (int i = 0; i < 16; i++)                                                            \
        if (!(i & H)) {                                                                     \
            const u32x16 a = x[i], b = x[i + H];                                            \
            x[i] = __builtin_shufflevector(a, b, __VA_ARGS__);                              \
            x[i + H] = __builtin_shufflevector(a, b, SWAP_HI_##H);                          \
        }
#define SWAP_HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define SWAP_HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define SWAP_HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define SWAP_HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
static inline void transpose16(u32x16 *x) {
    SWAP_STAGE(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
    SWAP_STAGE(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
    SWAP_STAGE(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
    SWAP_STAGE(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
}

/* kt[e * TK + u] = element e of key j0 + u as float32 bits, for P elements per key (bf16 1:
 * a bfloat16 key widened; 2: element e is the pair (2e, 2e+1) of a bfloat16 key, its bits
 * untouched, the bf16 path's). Keys past jend repeat the last one (their scores are never used).
 * vpf (the bf16 path: the values, or NULL): each key read asks for its values and a key
 * K_AHEAD on into L2, so the value rows and the next block's keys arrive while this block's
 * scores are computed (the hint only: no bits change). */
static inline __attribute__((always_inline)) void transpose_keys(
        uint32_t *restrict kt, const void *k, int bf16, int64_t base, int64_t ss,
        int64_t j0, int64_t jend, const int P, const uint16_t *vpf) {
    for (int h = 0; h < TK / 16; h++)
        for (int c = 0; c < P / 16; c++) {
            u32x16 x[16];
            for (int u = 0; u < 16; u++) {
                int64_t j = j0 + 16 * h + u;
                j = j < jend ? j : jend - 1;
                if (bf16 == 2) {
                    memcpy(x + u, (const uint16_t *)k + base + j * ss + 32 * c, sizeof x[u]);
                    /* the key 2 tiles on (a hint: reading K streams from memory) */
                    __builtin_prefetch((const uint16_t *)k + base + (j + 2 * TK) * ss + 32 * c);
                    if (vpf) { /* into L2: this key's values (read after the block's scores), and
                                * the key K_AHEAD on (past the block: the next item's, as a
                                * thread's items run through a head's blocks in order) */
                        __builtin_prefetch(vpf + base + j * ss + 32 * c, 0, 2);
                        __builtin_prefetch((const uint16_t *)k + base + (j + K_AHEAD) * ss + 32 * c, 0, 2);
                    }
                }
                else if (bf16) {
#if defined(__AVX512F__)
                    const __m512i w = _mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)k + base + j * ss + 16 * c))), 16);
                    memcpy(x + u, &w, sizeof w);
#else
                    u16x16 w;
                    memcpy(&w, (const uint16_t *)k + base + j * ss + 16 * c, sizeof w);
                    x[u] = __builtin_convertvector(w, u32x16) << 16;
#endif
                } else
                    memcpy(x + u, (const float *)k + base + j * ss + 16 * c, sizeof x[u]);
            }
            transpose16(x);
            for (int e = 0; e < 16; e++) memcpy(kt + (16 * c + e) * TK + 16 * h, x + e, sizeof x[e]);
        }
}

/* scores of NR query rows (qr, float32 bits) against the TK keys of a transposed tile (kt),
 * written at column `col` of rows r0.. of `scores`, in scores_by_key's order of operations:
 * lane l of the head dimension (elements l, 16 + l, ...) accumulates by fused multiply-adds
 * in increasing d, then the 16 lane sums add up in hsum's tree. So a row's scores are the
 * same bits on either path: a verification's rows equal the decodes' rows. */
static inline __attribute__((always_inline)) void score_rows(
        float *restrict scores, const uint32_t *qr, const uint32_t *kt, int64_t r0, int64_t col,
        int64_t block, const int DV, const int NR) {
    const int P = 16 * DV;
    v16 part[16][MR][TK / 16];
    for (int l = 0; l < 16; l++) {
        v16 acc[MR][TK / 16];
        for (int rr = 0; rr < NR; rr++)
            for (int h = 0; h < TK / 16; h++) acc[rr][h] = (v16){0};
        for (int i = 0; i < DV; i++) {
            v16 kv[TK / 16];
            memcpy(kv, kt + (16 * i + l) * TK, sizeof kv);
            for (int rr = 0; rr < NR; rr++) {
                float a;
                memcpy(&a, qr + rr * P + 16 * i + l, sizeof a);
                for (int h = 0; h < TK / 16; h++) acc[rr][h] += a * kv[h];
            }
        }
        for (int rr = 0; rr < NR; rr++)
            for (int h = 0; h < TK / 16; h++) part[l][rr][h] = acc[rr][h];
    }
    for (int rr = 0; rr < NR; rr++)
        for (int h = 0; h < TK / 16; h++) {
#define X(l) part[l][rr][h]
            const v16 b0 = (X(0) + X(8)) + (X(4) + X(12)), b1 = (X(1) + X(9)) + (X(5) + X(13));
            const v16 b2 = (X(2) + X(10)) + (X(6) + X(14)), b3 = (X(3) + X(11)) + (X(7) + X(15));
#undef X
            const v16 sum = (b0 + b2) + (b1 + b3);
            memcpy(scores + (r0 + rr) * block + col + 16 * h, &sum, sizeof sum);
        }
}

/* scores[r * block + j - j0] = q[r] . k[j] for rows 0..R-1, keys j0..jend-1 (padded to TK):
 * keys in the vector lanes (a tile of K transposed), tiles of up to MR rows x TK keys of
 * accumulators, the last tile holding exactly the rows left. qp holds the rows as float32
 * bits. Every row's dot products are the same instructions in the same order whatever R is
 * and whichever tile holds it. */
static inline __attribute__((always_inline)) void scores_by_tile(
        float *restrict scores, const uint32_t *qp, const void *k, int bf16,
        int64_t base, int64_t ss, int64_t j0, int64_t jend, int64_t R, int64_t block,
        uint32_t *restrict kt, const int DV) {
    const int P = 16 * DV; /* elements per key */
    for (int64_t jt = j0; jt < jend; jt += TK) {
        transpose_keys(kt, k, bf16, base, ss, jt, jend, P, NULL);
        for (int64_t r0 = 0; r0 < R; r0 += MR) {
            const uint32_t *qr = qp + r0 * P;
#define ROWS_CASE(N) case N: score_rows(scores, qr, kt, r0, jt - j0, block, DV, N); break;
            ROW_TILE_SWITCH(R - r0 < MR ? (int)(R - r0) : MR)
#undef ROWS_CASE
        }
    }
}

/* the rows of qh [R][D] as float32 bits in qp, padded with zero rows to a multiple of MR */
static inline void pack_rows(uint32_t *restrict qp, const float *qh, int64_t R, int64_t D) {
    const int64_t Rp = (R + MR - 1) / MR * MR;
    memcpy(qp, qh, sizeof(float) * R * D);
    memset(qp + R * D, 0, sizeof(uint32_t) * (Rp - R) * D);
}

/* acc rows r0 .. r0+NR-1 = sum_j p[r][j] v[j], kept in registers across the keys */
static inline __attribute__((always_inline)) void pv_rows(
        float *restrict ph, int64_t W, const float *scores, const void *v, int bf16, int64_t base,
        int64_t ss, int64_t j0, int64_t jend, int64_t r0, int64_t block, const int NR, const int DV) {
    v16 a[NR][MAXV];
    for (int rr = 0; rr < NR; rr++)
        for (int i = 0; i < DV; i++) a[rr][i] = (v16){0};
    for (int64_t j = j0; j < jend; j++) {
        v16 vv[MAXV];
        load_row(vv, v, bf16, base + j * ss, DV);
        for (int rr = 0; rr < NR; rr++) {
            const float p = scores[(r0 + rr) * block + (j - j0)];
            for (int i = 0; i < DV; i++) a[rr][i] += p * vv[i];
        }
    }
    for (int rr = 0; rr < NR; rr++) memcpy(ph + (r0 + rr) * W, a[rr], sizeof(float) * 16 * DV);
}


#if defined(__AVX512BF16__)
/* The bf16 path (bfloat16 K and V, head size a multiple of 32, a CPU with AVX512_BF16):
 * vdpbf16ps takes pairs of bfloat16 products, each exact in float32, and adds them to
 * float32 accumulators, so a row costs half the instructions of float32 fused
 * multiply-adds. Queries are rounded to bfloat16 once per call and probabilities after the
 * exponential (the row's sum is of the rounded ones), as GPU flash attention does. Each
 * score is one chain over the head dimension's pairs in increasing order, keys in the
 * vector lanes; each output one chain over key pairs in increasing order: the same
 * instructions in the same order for every row whatever the call, so a verification's rows
 * are their decodes' bits. */
#define BF_PATH 1

/* qb[r][e] = the bfloat16 pair (q[r][2e], q[r][2e+1]) of each row, rows padded to MR */
static inline void pack_rows_bf(uint32_t *restrict qb, const float *qh, int64_t R, int64_t D) {
    const int64_t Rp = (R + MR - 1) / MR * MR, P2 = D / 2;
    for (int64_t r = 0; r < R; r++)
        for (int64_t e = 0; e < P2; e++) {
            uint32_t a, b;
            memcpy(&a, qh + r * D + 2 * e, 4);
            memcpy(&b, qh + r * D + 2 * e + 1, 4);
            a = (a + 0x7fffu + ((a >> 16) & 1u)) >> 16;
            b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
            qb[r * P2 + e] = b | a;
        }
    memset(qb + R * P2, 0, sizeof(uint32_t) * (Rp - R) * P2);
}

static inline __attribute__((always_inline)) void score_rows_bf(
        float *restrict scores, const uint32_t *qr, const uint32_t *kt, int64_t r0, int64_t col,
        int64_t block, const int P2, const int NR) {
    __m512 acc[MR][TK / 16];
    for (int rr = 0; rr < NR; rr++)
        for (int h = 0; h < TK / 16; h++) acc[rr][h] = _mm512_setzero_ps();
    for (int e = 0; e < P2; e++) {
        __m512i kv[TK / 16];
        for (int h = 0; h < TK / 16; h++) kv[h] = _mm512_loadu_si512(kt + e * TK + 16 * h);
        for (int rr = 0; rr < NR; rr++) {
            const __m512i b = _mm512_set1_epi32((int)qr[rr * P2 + e]);
            for (int h = 0; h < TK / 16; h++) acc[rr][h] = _mm512_dpbf16_ps(acc[rr][h], (__m512bh)kv[h], (__m512bh)b);
        }
    }
    for (int rr = 0; rr < NR; rr++)
        for (int h = 0; h < TK / 16; h++) _mm512_storeu_ps(scores + (r0 + rr) * block + col + 16 * h, acc[rr][h]);
}

static inline __attribute__((always_inline)) void scores_by_tile_bf(
        float *restrict scores, const uint32_t *qb, const uint16_t *k, int64_t base, int64_t ss,
        int64_t j0, int64_t jend, int64_t R, int64_t block, uint32_t *restrict kt, const int DV,
        const uint16_t *vpf) {
    const int P2 = 8 * DV; /* pairs per key */
    for (int64_t jt = j0; jt < jend; jt += TK) {
        transpose_keys(kt, k, 2, base, ss, jt, jend, P2, vpf);
        for (int64_t r0 = 0; r0 < R; r0 += MR) {
            const uint32_t *qr = qb + r0 * P2;
#define ROWS_CASE(N) case N: score_rows_bf(scores, qr, kt, r0, jt - j0, block, P2, N); break;
            ROW_TILE_SWITCH(R - r0 < MR ? (int)(R - r0) : MR)
#undef ROWS_CASE
        }
    }
}

/* a row's n probabilities (float32, already bfloat16 values; zero from n to a multiple of
 * 16, the row `block` floats long) become bfloat16 pairs in place: dword i = (p[2i], p[2i+1]) */
static inline void pack_probs(float *restrict s, int64_t n) {
    for (int64_t j = 0; j < n; j += 32) { /* writes trail reads: dwords j/2.. from floats j.. */
        const __m512 lo = _mm512_loadu_ps(s + j), hi = _mm512_loadu_ps(s + j + 16);
        const __m512bh pr = _mm512_cvtne2ps_pbh(hi, lo); /* exact: the values are bfloat16 */
        memcpy((uint32_t *)s + j / 2, &pr, sizeof pr);
    }
}

/* softmax_row, the scaling before it and pack_probs after it in two passes over the row
 * instead of seven (the bf16 path without soft-capping): the same operations on every
 * element in the same order, so the same bits. Pass one scales s[0 .. n-1], sets keys
 * before lo to -inf and finds the max; pass two takes exp(s - m) rounded to bfloat16 (0
 * before lo and from n on), sums them in key order and packs pairs in place, the last
 * pair's upper half read from beyond len as pack_probs reads it. Needs n > lo. */
static inline float softmax_pack_bf(float *restrict s, int64_t lo, int64_t n, int64_t nb, float scale, float *l) {
    const int64_t len = (nb + 15) / 16 * 16; /* the block's keys (nb >= n), padded */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
        if (j >= lo && j + 16 <= n) { /* every lane in and visible: no masks */
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), sc);
            _mm512_storeu_ps(s + j, x);
            mv = _mm512_max_ps(x, mv); /* as below with every lane in */
            continue;
        }
        const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32((int)j));
        const __mmask16 in = _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32((int)n));
        const __mmask16 band = _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32((int)lo));
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, s + j), sc);
        x = _mm512_mask_mov_ps(x, band, ninf);
        _mm512_mask_storeu_ps(s + j, in, x);
        mv = _mm512_mask_max_ps(mv, in, x, mv); /* vmax's: x where x > mv, else mv (NaN, ties) */
    }
    const float m = _mm512_reduce_max_ps(mv);
    v16 sum = {0};
    for (int64_t j = 0; j < len; j += 32) {
        if (j >= lo && j + 64 <= n) { /* 64 keys, every one visible: four exponentials' long
                                        * dependency chains side by side, the same operations */
            v16 y[4];
            __m256bh c[4]; /* each vector's 16 probabilities rounded to bfloat16 (round_bf16's) */
            memcpy(y, s + j, sizeof y);
            for (int h = 0; h < 4; h++) {
                c[h] = bf16_words(exp_neg16(y[h] - m));
                y[h] = widen_bf16(c[h]);
            }
            for (int h = 0; h < 4; h++) sum += y[h];
            for (int h = 0; h < 4; h += 2) { /* pairs in key order: two vectors' words side by side */
                const __m512i pr = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)c[h]), (__m256i)c[h + 1], 1);
                memcpy((uint32_t *)s + j / 2 + 8 * h, &pr, sizeof pr);
            }
            j += 32;
            continue;
        }
        __m512 x[2];
        for (int h = 0; h < 2; h++) {
            const int64_t jj = j + 16 * h;
            if (jj >= len) { /* the last pair's upper half: what is there (pack_probs) */
                x[h] = _mm512_loadu_ps(s + jj);
                continue;
            }
            v16 y;
            memcpy(&y, s + jj, sizeof y);
            y = round_bf16(exp_neg16(y - m));
            memcpy(&x[h], &y, sizeof y);
            if (jj < lo || jj + 16 > n) { /* keys outside [lo, n) weigh 0 (else every lane is kept) */
                const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32((int)jj));
                const __mmask16 keep = _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32((int)n)) &
                                       _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32((int)lo));
                x[h] = _mm512_maskz_mov_ps(keep, x[h]);
                memcpy(&y, &x[h], sizeof y);
            }
            sum += y;
        }
        const __m512bh pr = _mm512_cvtne2ps_pbh(x[1], x[0]); /* exact: bfloat16 values */
        memcpy((uint32_t *)s + j / 2, &pr, sizeof pr);
    }
    *l = hsum(sum);
    return m;
}

/* The named accumulators of pv_rows_bf4 and pv_rows_bf8 (a0 .. a23), and their rows' outputs
 * at ph, V vectors per row (element order as pv_rows_bf's) */
#define PV_ACCUMULATORS                                                                               \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;   \
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;             \
    __m512 a16 = a0, a17 = a0, a18 = a0, a19 = a0, a20 = a0, a21 = a0, a22 = a0, a23 = a0;
#define PV_P(R) __attribute__((unused)) const uint32_t *p##R = (const uint32_t *)(scores + (r0 + (NR > R ? R : 0)) * block);
/* the body of pv_rows_bf4/8: each row's packed probabilities p0 .. p5 (pack_probs; rows
 * from NR on are never read), the whole pairs of keys, an odd last key, the outputs */
#define PV_BODY(PAIR, V)                                                                              \
    PV_ACCUMULATORS                                                                                  \
    PV_P(0) PV_P(1) PV_P(2) PV_P(3) PV_P(4) PV_P(5)                                                  \
    const int64_t pairs = (jend - j0) >> 1;                                                          \
    for (int64_t pj = 0; pj < pairs; pj++) PAIR(1, j0 + 2 * pj, pj);                                 \
    if ((jend - j0) & 1) PAIR(0, jend - 1, pairs);                                                   \
    PV_STORE(V)
#define PV_STORE(V)                                                                                   \
    {                                                                                                \
        const __m512 acc[24] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,                    \
                                a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23};         \
        for (int rr = 0; rr < NR; rr++) pv_store_row(ph + (r0 + rr) * W, acc + (V) * rr, V);         \
    }

/* a row's V accumulators (pv_rows_bf's lane order) into its output o in element order */
static inline void pv_store_row(float *o, const __m512 *acc, const int V) {
    for (int i = 0; i < V; i++) {
        float t[16];
        _mm512_storeu_ps(t, acc[i]);
        for (int kk = 0; kk < 16; kk++) o[32 * (i / 2) + 8 * (kk / 4) + 4 * (i % 2) + kk % 4] = t[kk];
    }
}

/* rows r0 .. r0+NR-1 of sum_j p[r][j] v[j] by pairs of keys: the pair (p[j], p[j+1]) (the
 * rounded probabilities' bits) against the values of keys j and j+1 interleaved element by
 * element (unpack within 128-bit lanes: accumulator c's lane k holds element
 * 32 (c / 2) + 8 (k / 4) + 4 (c % 2) + k % 4, put back in order at the end) */
static inline __attribute__((always_inline)) void pv_rows_bf(
        float *restrict ph, int64_t W, const float *scores, const uint16_t *v, int64_t base,
        int64_t ss, int64_t j0, int64_t jend, int64_t r0, int64_t block, const int NR, const int DV) {
    __m512 a[NR][MAXV];
    for (int rr = 0; rr < NR; rr++)
        for (int i = 0; i < DV; i++) a[rr][i] = _mm512_setzero_ps();
    for (int64_t j = j0; j < jend; j += 2) {
        const int two = j + 1 < jend;
        __m512i vp[MAXV];
        for (int c = 0; c < DV / 2; c++) {
            __builtin_prefetch(v + base + (j + 16) * ss + 32 * c); /* 16 keys on */
            __builtin_prefetch(v + base + (j + 17) * ss + 32 * c);
            const __m512i va = _mm512_loadu_si512(v + base + j * ss + 32 * c);
            const __m512i vb = two ? _mm512_loadu_si512(v + base + (j + 1) * ss + 32 * c) : _mm512_setzero_si512();
            vp[2 * c] = _mm512_unpacklo_epi16(va, vb);
            vp[2 * c + 1] = _mm512_unpackhi_epi16(va, vb);
        }
        for (int rr = 0; rr < NR; rr++) {
            const uint32_t *pp = (const uint32_t *)(scores + (r0 + rr) * block); /* pack_probs */
            const __m512i b = _mm512_set1_epi32((int)pp[(j - j0) / 2]);
            for (int i = 0; i < DV; i++) a[rr][i] = _mm512_dpbf16_ps(a[rr][i], (__m512bh)vp[i], (__m512bh)b);
        }
    }
    for (int rr = 0; rr < NR; rr++) pv_store_row(ph + (r0 + rr) * W, a[rr], DV);
}
/* pv_rows_bf for a head size of 64 (DV 4) and up to 6 rows, each accumulator a named
 * variable: GCC keeps pv_rows_bf's accumulator array in registers but also stores it to
 * memory on every pair of keys, which costs about as much as the dot products. The same
 * instructions in the same order otherwise, so the same bits. */
#define PV4_ROW(R, A0, A1, A2, A3, PJ)                                                                 \
    if (NR > R) {                                                                                    \
        const __m512bh b = (__m512bh)_mm512_set1_epi32((int)p##R[PJ]);                               \
        A0 = _mm512_dpbf16_ps(A0, u0, b);                                                            \
        A1 = _mm512_dpbf16_ps(A1, u1, b);                                                            \
        A2 = _mm512_dpbf16_ps(A2, u2, b);                                                            \
        A3 = _mm512_dpbf16_ps(A3, u3, b);                                                            \
    }
#define PV4_PAIR(TWO, J, PJ)                                                                          \
    do {                                                                                             \
        const uint16_t *vj = v + base + (J) * ss;                                                    \
        const __m512i va0 = _mm512_loadu_si512(vj), va1 = _mm512_loadu_si512(vj + 32);               \
        const __m512i vb0 = (TWO) ? _mm512_loadu_si512(vj + ss) : _mm512_setzero_si512();            \
        const __m512i vb1 = (TWO) ? _mm512_loadu_si512(vj + ss + 32) : _mm512_setzero_si512();       \
        __builtin_prefetch(vj + 16 * ss); /* 16 keys on */                                           \
        __builtin_prefetch(vj + 17 * ss);                                                            \
        __builtin_prefetch(vj + 16 * ss + 32);                                                       \
        __builtin_prefetch(vj + 17 * ss + 32);                                                       \
        const __m512bh u0 = (__m512bh)_mm512_unpacklo_epi16(va0, vb0);                               \
        const __m512bh u1 = (__m512bh)_mm512_unpackhi_epi16(va0, vb0);                               \
        const __m512bh u2 = (__m512bh)_mm512_unpacklo_epi16(va1, vb1);                               \
        const __m512bh u3 = (__m512bh)_mm512_unpackhi_epi16(va1, vb1);                               \
        PV4_ROW(0, a0, a1, a2, a3, PJ) PV4_ROW(1, a4, a5, a6, a7, PJ)                                \
        PV4_ROW(2, a8, a9, a10, a11, PJ) PV4_ROW(3, a12, a13, a14, a15, PJ)                          \
        PV4_ROW(4, a16, a17, a18, a19, PJ) PV4_ROW(5, a20, a21, a22, a23, PJ)                        \
    } while (0)

static inline __attribute__((always_inline)) void pv_rows_bf4(
        float *restrict ph, int64_t W, const float *scores, const uint16_t *v, int64_t base,
        int64_t ss, int64_t j0, int64_t jend, int64_t r0, int64_t block, const int NR) {
    PV_BODY(PV4_PAIR, 4)
}
#undef PV4_PAIR
#undef PV4_ROW
/* pv_rows_bf4 for 128 values of a head (DV 8: a head of 128; twice for 256) and up to 3
 * rows: each 32 values' pair of unpacked vectors goes to every row before the next is
 * loaded (24 accumulators, 2 value vectors and 3 probability pairs in registers) */
#define PV8_DP(R, A, B)                                                                              \
    if (NR > R) {                                                                                    \
        A = _mm512_dpbf16_ps(A, ul, b##R);                                                           \
        B = _mm512_dpbf16_ps(B, uh, b##R);                                                           \
    }
#define PV8_HALF(TWO, C, R0A, R0B, R1A, R1B, R2A, R2B)                                                \
    {                                                                                                \
        const __m512i va = _mm512_loadu_si512(vj + 32 * (C));                                        \
        const __m512i vb = (TWO) ? _mm512_loadu_si512(vj + ss + 32 * (C)) : _mm512_setzero_si512();  \
        __builtin_prefetch(vj + 16 * ss + 32 * (C)); /* 16 keys on */                                \
        __builtin_prefetch(vj + 17 * ss + 32 * (C));                                                 \
        const __m512bh ul = (__m512bh)_mm512_unpacklo_epi16(va, vb);                                 \
        const __m512bh uh = (__m512bh)_mm512_unpackhi_epi16(va, vb);                                 \
        PV8_DP(0, R0A, R0B) PV8_DP(1, R1A, R1B) PV8_DP(2, R2A, R2B)                                  \
    }
#define PV8_PAIR(TWO, J, PJ)                                                                          \
    do {                                                                                             \
        const uint16_t *vj = v + base + (J) * ss;                                                    \
        const __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)p0[PJ]);                                \
        const __m512bh b1 = (__m512bh)_mm512_set1_epi32((int)p1[PJ]);                                \
        const __m512bh b2 = (__m512bh)_mm512_set1_epi32((int)p2[PJ]);                                \
        PV8_HALF(TWO, 0, a0, a1, a8, a9, a16, a17) PV8_HALF(TWO, 1, a2, a3, a10, a11, a18, a19)      \
        PV8_HALF(TWO, 2, a4, a5, a12, a13, a20, a21) PV8_HALF(TWO, 3, a6, a7, a14, a15, a22, a23)    \
    } while (0)

static inline __attribute__((always_inline)) void pv_rows_bf8(
        float *restrict ph, int64_t W, const float *scores, const uint16_t *v, int64_t base,
        int64_t ss, int64_t j0, int64_t jend, int64_t r0, int64_t block, const int NR) {
    PV_BODY(PV8_PAIR, 8)
}
#undef PV8_PAIR
#undef PV8_HALF
#undef PV8_DP
#undef PV_ACCUMULATORS
#undef PV_STORE
#undef PV_P
#undef PV_BODY
#else
#define BF_PATH 0
#endif

static inline __attribute__((always_inline)) void block_item(
        const float *qh, const uint32_t *qp, const void *k, const void *v, int bf16,
        float scale, float softcap, int64_t base, int64_t ss, const int64_t *nvis, const int64_t *nlo,
        int64_t R, int64_t j0,
        int64_t jend, int64_t block, float *restrict scores, uint32_t *restrict kt,
        float *restrict ph, const int bfp, const int DV) {
    const int64_t D = 16 * DV, W = D + 2, n = jend - j0;
    if (n <= 0) { /* the block starts past every row's last visible key: it adds nothing */
        for (int64_t r = 0; r < R; r++) {
            memset(ph + r * W, 0, sizeof(float) * D);
            ph[r * W + D] = -INFINITY;
            ph[r * W + D + 1] = 0.f;
        }
        return;
    }
#if BF_PATH
    if (bfp)
        scores_by_tile_bf(scores, qp, (const uint16_t *)k, base, ss, j0, jend, R, block, kt, DV, (const uint16_t *)v);
    else
#endif
    if (R < FEW_ROWS) /* decode: one key at a time, each row's dot product and a sum */
        scores_by_key(scores, qh, k, bf16, base, ss, j0, jend, R, block, DV);
    else /* verification, prefill: a tile of keys in the lanes, a tile of rows, the same sums */
        scores_by_tile(scores, qp, k, bf16, base, ss, j0, jend, R, block, kt, DV);
    /* softmax statistics per row over the keys it sees; unseen keys weigh 0 */
    const int64_t len = (n + 15) / 16 * 16;
    int packed = 0; /* the rows' probabilities are bfloat16 pairs already (softmax_pack_bf) */
#if BF_PATH
    if (bfp && softcap <= 0.f) {
        packed = 1;
        for (int64_t r = 0; r < R; r++) {
            float *pr = ph + r * W, *s = scores + r * block, l = 0.f;
            const int64_t nr = (nvis[r] < jend ? nvis[r] : jend) - j0;
            const int64_t lo = nlo && nlo[r] > j0 ? (nlo[r] - j0 < nr ? nlo[r] - j0 : nr) : 0;
            if (nr > lo) {
                pr[D] = softmax_pack_bf(s, lo, nr, n, scale, &l);
            } else {
                pr[D] = -INFINITY;
                memset(s, 0, sizeof(float) * len);
                pack_probs(s, n);
            }
            pr[D + 1] = l;
        }
    }
#endif
    for (int64_t r = 0; r < (packed ? 0 : R); r++) {
        float *pr = ph + r * W, *s = scores + r * block, l = 0.f;
        const int64_t nr = (nvis[r] < jend ? nvis[r] : jend) - j0;
        /* keys before the row's first visible one (nlo: a window layer's band) weigh 0 */
        const int64_t lo = nlo && nlo[r] > j0 ? (nlo[r] - j0 < nr ? nlo[r] - j0 : nr) : 0;
        if (softcap > 0.f)
            softcap_row(s, nr, scale, softcap);
        else
            for (int64_t jj = 0; jj < nr; jj++) s[jj] *= scale;
        for (int64_t jj = 0; jj < lo; jj++) s[jj] = -INFINITY;
        pr[D] = nr > lo ? softmax_row(s, lo, nr, len, &l, bfp) : -INFINITY;
        if (nr <= lo) memset(s, 0, sizeof(float) * len);
        pr[D + 1] = l;
    }
    /* the weighted sum of values, NR rows sharing each value row loaded */
    int64_t r0 = 0;
#if BF_PATH
    if (bfp) {
        const uint16_t *vb = (const uint16_t *)v;
        for (int64_t r = 0; r < (packed ? 0 : R); r++) pack_probs(scores + r * block, n);
        if (DV == 4) { /* head size 64: the accumulators in named registers */
            for (; r0 + 6 <= R; r0 += 6) pv_rows_bf4(ph, W, scores, vb, base, ss, j0, jend, r0, block, 6);
            if (R - r0 >= 3) {
                pv_rows_bf4(ph, W, scores, vb, base, ss, j0, jend, r0, block, 3);
                r0 += 3;
            }
            for (; r0 < R; r0++) pv_rows_bf4(ph, W, scores, vb, base, ss, j0, jend, r0, block, 1);
            return;
        }
        if (DV % 8 == 0) { /* head sizes 128, 256: the same, three rows and 128 values at a time */
            for (int64_t e = 0; e < 16 * DV; e += 128) {
                int64_t r = 0;
                for (; r + 3 <= R; r += 3) pv_rows_bf8(ph + e, W, scores, vb, base + e, ss, j0, jend, r, block, 3);
                if (R - r == 2) pv_rows_bf8(ph + e, W, scores, vb, base + e, ss, j0, jend, r, block, 2);
                if (R - r == 1) pv_rows_bf8(ph + e, W, scores, vb, base + e, ss, j0, jend, r, block, 1);
            }
            return;
        }
        if (DV <= 4)
            for (; r0 + 6 <= R; r0 += 6) pv_rows_bf(ph, W, scores, vb, base, ss, j0, jend, r0, block, 6, DV);
        for (; r0 + 3 <= R; r0 += 3) pv_rows_bf(ph, W, scores, vb, base, ss, j0, jend, r0, block, 3, DV);
        for (; r0 < R; r0++) pv_rows_bf(ph, W, scores, vb, base, ss, j0, jend, r0, block, 1, DV);
        return;
    }
#endif
    if (DV <= 4)
        for (; r0 + 6 <= R; r0 += 6) pv_rows(ph, W, scores, v, bf16, base, ss, j0, jend, r0, block, 6, DV);
    for (; r0 + 3 <= R; r0 += 3) pv_rows(ph, W, scores, v, bf16, base, ss, j0, jend, r0, block, 3, DV);
    for (; r0 < R; r0++) pv_rows(ph, W, scores, v, bf16, base, ss, j0, jend, r0, block, 1, DV);
}

/* block_item with the common head sizes' code fully unrolled (DV 4, 8, 16), else general */
static void block_item_dv(const float *qh, const uint32_t *qp, const void *k, const void *v, int bf16,
                          float scale, float softcap, int64_t base, int64_t ss, const int64_t *nvis,
                          const int64_t *nlo, int64_t R, int64_t j0, int64_t jend, int64_t block,
                          float *restrict scores, uint32_t *restrict kt, float *restrict ph, const int bfp,
                          const int DV) {
#define BLOCK_ITEM(SS, BLOCK, DV) \
    block_item(qh, qp, k, v, bf16, scale, softcap, base, SS, nvis, nlo, R, j0, jend, BLOCK, scores, kt, ph, bfp, DV)
    /* with the usual layout (keys D apart, blocks of 256) as constants the compiler keeps
     * fewer pointers and strides in registers: about 12% off a block of a verification */
    if (DV == 4 && ss == 64 && block == 256)
        BLOCK_ITEM(64, 256, 4);
    else if (DV == 4)
        BLOCK_ITEM(ss, block, 4);
    else if (DV == 8 && ss == 128 && block == 256)
        BLOCK_ITEM(128, 256, 8);
    else if (DV == 8)
        BLOCK_ITEM(ss, block, 8);
    else if (DV == 16 && ss == 256 && block == 256) /* Gemma's head of 256 */
        BLOCK_ITEM(256, 256, 16);
#undef BLOCK_ITEM
    else
        block_item(qh, qp, k, v, bf16, scale, softcap, base, ss, nvis, nlo, R, j0, jend, block, scores, kt, ph, bfp, DV);
}

/* seconds since *t0 (CLOCK_MONOTONIC) */
static inline double since(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0->tv_nsec);
}

/* A row's output and log-sum-exp from its blocks' results (m, l, unnormalised acc), in
 * key order: `na` blocks at a, a + sa, ..., then `nb` blocks at b, b + sb, ... (a shared
 * prefix's blocks, then the sequence's own) */
static void merge_row(const float *a, int64_t na, int64_t sa, const float *b, int64_t nb, int64_t sb,
                      int64_t D, float *restrict o, float *lse) {
    float m = -INFINITY;
    for (int64_t i = 0; i < na + nb; i++) {
        const float mb = (i < na ? a + i * sa : b + (i - na) * sb)[D];
        m = mb > m ? mb : m;
    }
    memset(o, 0, sizeof(float) * D);
    float l = 0.f;
    if (m != -INFINITY) {
        for (int64_t i = 0; i < na + nb; i++) {
            const float *pb = i < na ? a + i * sa : b + (i - na) * sb;
            if (pb[D] == -INFINITY) continue;
            const float w = expf(pb[D] - m);
            l += w * pb[D + 1];
            for (int64_t d = 0; d < D; d++) o[d] += w * pb[d];
        }
        const float inv = 1.f / l;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
    if (lse) *lse = m == -INFINITY ? -INFINITY : m + logf(l);
}

/*
 * q     [H, R, D] float32, contiguous
 * scale softmax scale, applied to the dot products
 * softcap  > 0: scores -> softcap * tanh(score * scale / softcap) (Gemma 2); 0: off
 * k, v  head h, key j, dim d at  h*hs + j*ss + d  (float32 or bfloat16)
 * nvis  [R] keys each row sees (a prefix 0 .. nvis[r]-1 of the S keys)
 * nlo   [R] or NULL: the first key each row sees (keys before it weigh 0)
 * part  [H, NB, R, D + 2] float32 scratch, NB = ceil(S / block)
 * out   [H, R, D] float32;  lse [H, R] float32 (natural log, of the scaled scores)
 * Returns 0; -1 when D is not a multiple of 16 up to 256 or `block` not a multiple of TK;
 * -2 when scratch memory could not be allocated.
 */
static int attend_blocks(const float *q, const void *k, const void *v, int bf16, float scale, float softcap,
                         int64_t H, int64_t R, int64_t D, int64_t S, int64_t hs, int64_t ss,
                         const int64_t *nvis, const int64_t *nlo, int64_t block, int64_t nb_pre, int merge,
                         float *part, float *out, float *lse) {
    /* the tiled scores write whole tiles of TK keys into a row of `block` floats */
    if (D % 16 || D / 16 > MAXV || block < TK || block % TK) return -1;
    const int DV = (int)(D / 16);
    const int64_t NB = (S + block - 1) / block; /* this call's blocks */
    const int64_t NT = nb_pre + NB; /* the row's blocks in `part`: the given ones first */
    const int64_t W = D + 2;
    int64_t maxvis = 0;
    for (int64_t r = 0; r < R; r++) maxvis = nvis[r] > maxvis ? nvis[r] : maxvis;
    /* the rows packed for the tiled scores, once per call (not per block) */
    const int64_t Rp = (R + MR - 1) / MR * MR, P = D;
    const int bfp = BF_PATH && bf16 && D % 32 == 0; /* the bf16 path (above) */
    uint32_t *qp = NULL;
    if (bfp) {
        qp = (uint32_t *)malloc(sizeof(uint32_t) * (H * Rp * P / 2 > 0 ? H * Rp * P / 2 : 1));
        if (!qp) return -2;
#if BF_PATH
        for (int64_t h = 0; h < H; h++) pack_rows_bf(qp + h * Rp * P / 2, q + h * R * D, R, D);
#endif
    } else if (R >= FEW_ROWS) {
        qp = (uint32_t *)malloc(sizeof(uint32_t) * H * Rp * P);
        if (!qp) return -2;
        for (int64_t h = 0; h < H; h++) pack_rows(qp + h * Rp * P, q + h * R * D, R, D);
    }

    int failed = 0; /* a thread's scratch allocation failed: the call returns -2 */
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (R > 0 ? R : 1) * block);
        uint32_t *kt = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * TK * 16 * MAXV);
        if (!scores || !kt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < H * NB; item++) {
            if (!scores || !kt) continue; /* this thread has no scratch: its items are lost */
            const int64_t h = item / NB, b = item % NB;
            const int64_t j0 = b * block, j1 = j0 + block < S ? j0 + block : S;
            const int64_t jend = j1 < maxvis ? j1 : maxvis; /* keys past every row's view */
            const float *qh = q + h * R * D;
            const uint32_t *qph = qp ? qp + h * Rp * (bfp ? P / 2 : P) : NULL; /* packed rows: tiled paths only */
            float *ph = part + (h * NT + nb_pre + b) * R * W;
            block_item_dv(qh, qph, k, v, bf16, scale, softcap, h * hs, ss, nvis, nlo, R,
                          j0, jend, block, scores, kt, ph, bfp, DV);
        }
        free(scores);
        free(kt);

        /* merge the blocks of each (head, row) in key order (the barrier at the end of
         * the loop above makes `failed` the same for every thread) */
        if (!failed && merge)
#pragma omp for schedule(static)
        for (int64_t hr = 0; hr < H * R; hr++) {
            const int64_t h = hr / R, r = hr % R;
            merge_row(part + (h * NT * R + r) * W, NT, R * W, NULL, 0, 0, D, out + hr * D, lse + hr);
        }
    }
    free(qp);
    return failed ? -2 : 0;
}

int triforce_attend(const float *q, const void *k, const void *v, int bf16, float scale, float softcap,
                    int64_t H, int64_t R, int64_t D, int64_t S, int64_t hs, int64_t ss,
                    const int64_t *nvis, int64_t block, float *part, float *out, float *lse) {
    return attend_blocks(q, k, v, bf16, scale, softcap, H, R, D, S, hs, ss, nvis, NULL, block, 0, 1, part, out, lse);
}

/* A shared prefix's part of attention (runtime/cache/shared.py): the rows of several
 * sequences over keys every one of them sees whole (S a multiple of `block`), their
 * per-block results only, into part [H, S / block, R, D + 2]; no merge. */
int triforce_attend_parts(const float *q, const void *k, const void *v, int bf16, float scale, float softcap,
                          int64_t H, int64_t R, int64_t D, int64_t S, int64_t hs, int64_t ss,
                          const int64_t *nvis, int64_t block, float *part) {
    return attend_blocks(q, k, v, bf16, scale, softcap, H, R, D, S, hs, ss, nvis, NULL, block, 0, 0, part, NULL, NULL);
}

/* The rest of those rows' attention: the keys after the shared prefix (this call's S, key
 * 0 at the first position after it, `nvis` counted from there) into part's blocks from
 * nb_pre on, after the nb_pre blocks of the prefix already there (part [H, nb_pre +
 * ceil(S / block), R, D + 2]); then every block merged in key order. Each block and the
 * merge compute what triforce_attend over the whole of the keys computes, so a row's
 * output is the same bits as with its keys in one buffer. */
int triforce_attend_after(const float *q, const void *k, const void *v, int bf16, float scale, float softcap,
                          int64_t H, int64_t R, int64_t D, int64_t S, int64_t hs, int64_t ss,
                          const int64_t *nvis, int64_t block, int64_t nb_pre, float *part, float *out,
                          float *lse) {
    return attend_blocks(q, k, v, bf16, scale, softcap, H, R, D, S, hs, ss, nvis, NULL, block, nb_pre, 1, part, out, lse);
}

/* Many sequences' attention in one call (a batch's decodes and verifications): sequence i's
 * rows row0[i] .. row0[i] + nrows[i] - 1 of q [H, Rtot, D] over its own keys (k[i], v[i]:
 * S[i] keys, head stride hs[i], key stride ss[i], K and V alike), nvis [Rtot] counted from
 * its first key; where nb_pre > 0 every row first has the nb_pre blocks of a shared prefix
 * in pre [H, nb_pre, Rtot, D + 2] (triforce_attend_parts over all the rows), its own keys
 * following them. Row r of head h goes to out + (h * ohs + orow[r]) * D (no log-sum-exp).
 * secs (NULL: not asked) [nseq] gets the thread-seconds each sequence's work took (its
 * blocks and its rows' merges): what a batch charges each sequence's run for its part.
 * Each sequence's blocks are computed with the arguments a call of its own would pass (its
 * rows, its keys) and merged in the same order, so every row is the same bits as in
 * triforce_attend (nb_pre 0) or triforce_attend_after: one call instead of one per
 * sequence. Returns as attend_blocks. */
int triforce_attend_seqs(const float *q, int bf16, float scale, float softcap, int64_t H, int64_t D,
                         int64_t nseq, const int64_t *kp, const int64_t *vp, const int64_t *S,
                         const int64_t *hs, const int64_t *ss, const int64_t *row0, const int64_t *nrows,
                         const int64_t *nvis, int64_t block, int64_t nb_pre, const float *pre,
                         const int64_t *orow, int64_t ohs, float *out, double *secs) {
    if (D % 16 || D / 16 > MAXV || block < TK || block % TK || nseq < 1) return -1;
    const int DV = (int)(D / 16);
    const int64_t W = D + 2, Rtot = row0[nseq - 1] + nrows[nseq - 1];
    const int bfp = BF_PATH && bf16 && D % 32 == 0;
    const int64_t P = bfp ? D / 2 : D; /* packed words per row */
    /* per sequence: blocks, first item, its part's and packed rows' offsets, keys seen */
    int64_t *meta = (int64_t *)malloc(sizeof(int64_t) * (6 * nseq + Rtot + 1));
    if (!meta) return -2;
    int64_t *NB = meta, *item0 = meta + nseq, *part0 = meta + 2 * nseq, *qp0 = meta + 3 * nseq,
            *maxvis = meta + 4 * nseq, *Rp = meta + 5 * nseq, *seq_of = meta + 6 * nseq;
    int64_t items = 0, parts = 0, packed = 0, maxR = 1;
    for (int64_t i = 0; i < nseq; i++) {
        NB[i] = (S[i] + block - 1) / block;
        item0[i] = items;
        part0[i] = parts;
        qp0[i] = packed;
        Rp[i] = (nrows[i] + MR - 1) / MR * MR;
        maxvis[i] = 0;
        for (int64_t r = 0; r < nrows[i]; r++) {
            const int64_t n = nvis[row0[i] + r];
            maxvis[i] = n > maxvis[i] ? n : maxvis[i];
            seq_of[row0[i] + r] = i;
        }
        items += H * NB[i];
        parts += H * NB[i] * nrows[i] * W;
        if (bfp || nrows[i] >= FEW_ROWS) packed += H * Rp[i] * P;
        maxR = nrows[i] > maxR ? nrows[i] : maxR;
    }
    float *part = (float *)malloc(sizeof(float) * (parts > 0 ? parts : 1));
    uint32_t *qp = (uint32_t *)malloc(sizeof(uint32_t) * (packed > 0 ? packed : 1));
    if (!part || !qp) {
        free(meta);
        free(part);
        free(qp);
        return -2;
    }
    for (int64_t i = 0; i < nseq; i++)
        for (int64_t h = 0; h < H; h++) {
            const float *qh = q + (h * Rtot + row0[i]) * D;
#if BF_PATH
            if (bfp) pack_rows_bf(qp + qp0[i] + h * Rp[i] * P, qh, nrows[i], D);
            else
#endif
            if (nrows[i] >= FEW_ROWS) pack_rows(qp + qp0[i] + h * Rp[i] * P, qh, nrows[i], D);
        }
    int even = 1; /* every sequence the same rows and blocks: equal items */
    for (int64_t i = 1; i < nseq; i++) even &= nrows[i] == nrows[0] && NB[i] == NB[0];
#ifdef _OPENMP
    omp_set_schedule(even ? omp_sched_static : omp_sched_dynamic, even ? 0 : SEQS_CHUNK);
#endif
    int failed = 0;
    if (secs)
        for (int64_t i = 0; i < nseq; i++) secs[i] = 0.0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * maxR * block);
        uint32_t *kt = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * TK * 16 * MAXV);
        double *mine = secs ? (double *)calloc((size_t)nseq, sizeof(double)) : NULL; /* this thread's */
        if (!scores || !kt || (secs && !mine)) {
#pragma omp atomic write
            failed = 1;
        }
        struct timespec t0;
#pragma omp for schedule(runtime)
        for (int64_t item = 0; item < items; item++) {
            if (!scores || !kt || (secs && !mine)) continue;
            if (mine) clock_gettime(CLOCK_MONOTONIC, &t0);
            int64_t i = 0;
            while (i + 1 < nseq && item0[i + 1] <= item) i++;
            const int64_t h = (item - item0[i]) / NB[i], b = (item - item0[i]) % NB[i], R = nrows[i];
            const int64_t j0 = b * block, j1 = j0 + block < S[i] ? j0 + block : S[i];
            const int64_t jend = j1 < maxvis[i] ? j1 : maxvis[i];
            const float *qh = q + (h * Rtot + row0[i]) * D;
            const uint32_t *qph = bfp || R >= FEW_ROWS ? qp + qp0[i] + h * Rp[i] * P : NULL;
            float *ph = part + part0[i] + (h * NB[i] + b) * R * W;
            const void *k = (const void *)(intptr_t)kp[i], *v = (const void *)(intptr_t)vp[i];
            const int64_t *nv = nvis + row0[i];
            block_item_dv(qh, qph, k, v, bf16, scale, softcap, h * hs[i], ss[i], nv, NULL, R, j0, jend, block,
                          scores, kt, ph, bfp, DV);
            if (mine) mine[i] += since(&t0);
        }
        free(scores);
        free(kt);
        if (!failed)
#pragma omp for schedule(runtime)
        for (int64_t hr = 0; hr < H * Rtot; hr++) {
            const int64_t h = hr / Rtot, r = hr % Rtot, i = seq_of[r], rr = r - row0[i];
            if (mine) clock_gettime(CLOCK_MONOTONIC, &t0);
            merge_row(pre ? pre + (h * nb_pre * Rtot + r) * W : NULL, pre ? nb_pre : 0, Rtot * W,
                      part + part0[i] + (h * NB[i] * nrows[i] + rr) * W, NB[i], nrows[i] * W, D,
                      out + (h * ohs + orow[r]) * D, NULL);
            if (mine) mine[i] += since(&t0);
        }
        if (mine && !failed)
            for (int64_t i = 0; i < nseq; i++)
#pragma omp atomic
                secs[i] += mine[i];
        free(mine);
    }
    free(meta);
    free(part);
    free(qp);
    return failed ? -2 : 0;
}

/* triforce_attend where row r sees only keys nlo[r] .. nvis[r]-1 (a window layer's band:
 * keys before it weigh exactly 0; the same blocks, scores and merge as without) */
int triforce_attend_band(const float *q, const void *k, const void *v, int bf16, float scale, float softcap,
                         int64_t H, int64_t R, int64_t D, int64_t S, int64_t hs, int64_t ss,
                         const int64_t *nvis, const int64_t *nlo, int64_t block, float *part, float *out,
                         float *lse) {
    return attend_blocks(q, k, v, bf16, scale, softcap, H, R, D, S, hs, ss, nvis, nlo, block, 0, 1, part, out, lse);
}

/* RoPE of one head's D values (rotate-half; sin's first half negated by the caller, so
 * x * cos + swap(x) * sin): the product x * cos rounded, then swap(x) * sin added to it in
 * one fused multiply-add, as torch computes `torch.addcmul(x * cos, swapped, sin)`
 * (runtime/model/transformer.py rotate; transformer.one_call_ok checks the bits against it
 * once per process and head size before the model uses this). */
static inline void rope_head(float *restrict y, const float *restrict x, const float *restrict c,
                             const float *restrict s, int64_t D) {
    const int64_t h = D / 2;
    for (int64_t d = 0; d < D; d++) {
        const float p = x[d] * c[d];
        y[d] = fmaf(d < h ? x[d + h] : x[d - h], s[d], p);
    }
}

static inline void store_row(void *base, int bf16, int64_t off, const float *x, int64_t D) {
    if (bf16) { /* round to nearest even, as torch's float32 -> bfloat16 copy */
        uint16_t *p = (uint16_t *)base + off;
        for (int64_t d = 0; d < D; d++) {
            uint32_t u;
            memcpy(&u, &x[d], 4);
            p[d] = (x[d] != x[d]) ? (uint16_t)0x7fc0u : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    } else {
        memcpy((float *)base + off, x, sizeof(float) * D);
    }
}

/* One attention layer's step for T new tokens in one call (kernels/native.py rope_attend):
 * RoPE of their q and k heads, straight out of the qkv projection's rows, k and v written
 * into the cache at key slots s0 .. s0+T-1, then triforce_attend over keys 0 .. s0+T-1, and
 * the output laid out as the o projection reads it. The same numbers as the separate steps
 * (transformer.py rotate, the cache's write, native.attend): bit for bit.
 * qkv  [T] rows ldq floats apart: Hq*D q values, H*D k values, H*D v values (float32)
 * cos, sin [T, D] float32;  k, v: the cache, as triforce_attend reads it
 * qf   [H, G*T, D] float32 out: the rotated queries, row g*T + t of KV head h for query
 *      head h*G + g (triforce_attend's q)
 * o    [T, Hq*D] float32 out; part, out, lse: triforce_attend's scratch and results */
int triforce_rope_attend(const float *qkv, int64_t T, int64_t ldq, int64_t Hq, const float *cos, const float *sin,
                         void *k, void *v, int bf16, float scale, float softcap, int64_t H, int64_t D, int64_t s0,
                         int64_t hs, int64_t ss, const int64_t *nvis, int64_t block, float *qf, float *part,
                         float *out, float *lse, float *o) {
    if (D % 16 || D / 16 > MAXV || H <= 0 || Hq % H) return -1;
    const int64_t G = Hq / H, R = G * T;
    float kr[16 * MAXV];
    for (int64_t t = 0; t < T; t++) {
        const float *x = qkv + t * ldq, *c = cos + t * D, *sn = sin + t * D;
        for (int64_t hq = 0; hq < Hq; hq++)
            rope_head(qf + ((hq / G) * R + (hq % G) * T + t) * D, x + hq * D, c, sn, D);
        for (int64_t h = 0; h < H; h++) {
            rope_head(kr, x + (Hq + h) * D, c, sn, D);
            store_row(k, bf16, h * hs + (s0 + t) * ss, kr, D);
            store_row(v, bf16, h * hs + (s0 + t) * ss, x + (Hq + H + h) * D, D);
        }
    }
    const int rc = attend_blocks(qf, k, v, bf16, scale, softcap, H, R, D, s0 + T, hs, ss, nvis, NULL, block, 0, 1,
                                 part, out, lse);
    if (rc) return rc;
    for (int64_t t = 0; t < T; t++)
        for (int64_t hq = 0; hq < Hq; hq++)
            memcpy(o + (t * Hq + hq) * D, out + ((hq / G) * R + (hq % G) * T + t) * D, sizeof(float) * D);
    return 0;
}

/* triforce_rope_attend for the rows of several sequences in one call (kernels/native.py
 * rope_attend_seqs: a batch's ragged forward, runtime/batch/rows.py Ragged.rope_attend).
 * Sequence i's T[i] tokens are the qkv rows tok0[i] .. (cos and sin rows likewise); their
 * k and v go to its own cache (kp[i], vp[i], strides hs[i], ss[i]) at slots slot0[i] ..,
 * and its rows attend over its slots 0 .. slot0[i]+T[i]-1, each row seeing nvis of them
 * (per folded row, as triforce_attend_seqs takes them). The queries are folded as
 * triforce_attend_seqs reads them (KV head h, then sequence i's rows g*T[i] + t), the
 * output written as the o projection reads it: o [N, Hq*D], row tok0[i]+t, query head
 * h*G+g. The same RoPE and writes as triforce_rope_attend, the same attention as
 * triforce_attend_seqs: each row the bits of the separate steps, and of its solo step.
 * meta [5, nseq]: tok0, T, slot0, hs, ss.  qf [H, G*sum(T), D] float32 out. */
int triforce_rope_attend_seqs(const float *qkv, int64_t ldq, int64_t Hq, const float *cos, const float *sin,
                              int bf16, float scale, float softcap, int64_t H, int64_t D, int64_t nseq,
                              const int64_t *kp, const int64_t *vp, const int64_t *meta, const int64_t *nvis,
                              int64_t block, float *qf, float *o, double *secs) {
    if (D % 16 || D / 16 > MAXV || H <= 0 || Hq % H || nseq < 1 || block < TK || block % TK) return -1;
    const int64_t G = Hq / H;
    const int64_t *tok0 = meta, *T = meta + nseq, *slot0 = meta + 2 * nseq, *hs = meta + 3 * nseq,
                  *ss = meta + 4 * nseq;
    int64_t Rtot = 0;
    for (int64_t i = 0; i < nseq; i++) Rtot += G * T[i];
    int64_t *buf = (int64_t *)malloc(sizeof(int64_t) * (3 * nseq + Rtot));
    if (!buf) return -2;
    int64_t *S = buf, *row0 = buf + nseq, *nrows = buf + 2 * nseq, *orow = buf + 3 * nseq;
    float kr[16 * MAXV];
    for (int64_t i = 0, r0 = 0; i < nseq; r0 += G * T[i], i++) {
        void *k = (void *)(intptr_t)kp[i], *v = (void *)(intptr_t)vp[i];
        S[i] = slot0[i] + T[i];
        row0[i] = r0;
        nrows[i] = G * T[i];
        for (int64_t t = 0; t < T[i]; t++) {
            const int64_t n = tok0[i] + t;
            const float *x = qkv + n * ldq, *c = cos + n * D, *sn = sin + n * D;
            for (int64_t hq = 0; hq < Hq; hq++) {
                rope_head(qf + ((hq / G) * Rtot + r0 + (hq % G) * T[i] + t) * D, x + hq * D, c, sn, D);
                orow[r0 + (hq % G) * T[i] + t] = n * Hq + hq % G; /* out + (h G + n Hq + g) D */
            }
            for (int64_t h = 0; h < H; h++) {
                rope_head(kr, x + (Hq + h) * D, c, sn, D);
                store_row(k, bf16, h * hs[i] + (slot0[i] + t) * ss[i], kr, D);
                store_row(v, bf16, h * hs[i] + (slot0[i] + t) * ss[i], x + (Hq + H + h) * D, D);
            }
        }
    }
    const int rc = triforce_attend_seqs(qf, bf16, scale, softcap, H, D, nseq, kp, vp, S, hs, ss, row0, nrows, nvis,
                                        block, 0, NULL, orow, G, o, secs);
    free(buf);
    return rc;
}

/* 1 when this build has the bf16 path (bfloat16 K and V, head sizes a multiple of 32) */
int triforce_bf16_path(void) { return BF_PATH; }

/* Width in bits of the vector registers this build targets: the score tiles (8 rows x 32
 * keys, 16 accumulators of 16 floats) are sized for 32 512-bit registers; with 256-bit
 * registers they spill and the kernel runs slower than torch's (kernels/native.py only
 * uses it by default on 512-bit builds). */
int triforce_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) || defined(__AVX__)
    return 256;
#else
    return 128;
#endif
}
