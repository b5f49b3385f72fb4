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
 * Probabilities and sums are float32 throughout. Soft-capped scores (Gemma 2: softcap > 0)
 * become softcap * tanh(score * scale / softcap), element by element after the dot
 * products, so that identity holds for them too; softcap 0 takes the plain scaling loop.
 * Vectors are GCC/Clang vector extensions of 16 floats: the compiler maps them onto
 * whatever the CPU has (one AVX-512 register, two AVX2 ones, four NEON ones).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* softmax statistics of s[0 .. n-1] in place: s becomes exp(s - m) (0 from n on, up to
 * `len`, a multiple of 16); returns m, sets *l = sum */
static inline float softmax_row(float *restrict s, int64_t n, int64_t len, float *l) {
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
        memcpy(s + j, &x, sizeof x);
    }
    for (j = n; j < len; j++) s[j] = 0.f;
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
#define MR 8 /* query rows per register tile (the packed rows are padded to a multiple) */

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

/* kt[e * TK + u] = element e of key j0 + u as float32 bits, for P elements per key (a
 * bfloat16 key widened). Keys past jend repeat the last one (their scores are never used). */
static inline __attribute__((always_inline)) void transpose_keys(
        uint32_t *restrict kt, const void *k, int bf16, int64_t base, int64_t ss,
        int64_t j0, int64_t jend, const int P) {
    for (int h = 0; h < TK / 16; h++)
        for (int c = 0; c < P / 16; c++) {
            u32x16 x[16];
            for (int u = 0; u < 16; u++) {
                int64_t j = j0 + 16 * h + u;
                j = j < jend ? j : jend - 1;
                if (bf16) {
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
        transpose_keys(kt, k, bf16, base, ss, jt, jend, P);
        for (int64_t r0 = 0; r0 < R; r0 += MR) {
            const uint32_t *qr = qp + r0 * P;
            switch (R - r0 < MR ? (int)(R - r0) : MR) {
#define ROWS_CASE(N) case N: score_rows(scores, qr, kt, r0, jt - j0, block, DV, N); break;
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
                ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
            }
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

static inline __attribute__((always_inline)) void block_item(
        const float *qh, const uint32_t *qp, const void *k, const void *v, int bf16,
        float scale, float softcap, int64_t base, int64_t ss, const int64_t *nvis, int64_t R, int64_t j0,
        int64_t jend, int64_t block, float *restrict scores, uint32_t *restrict kt,
        float *restrict ph, const int DV) {
    const int64_t D = 16 * DV, W = D + 2, n = jend - j0;
    if (n <= 0) { /* the block starts past every row's last visible key: it adds nothing */
        for (int64_t r = 0; r < R; r++) {
            memset(ph + r * W, 0, sizeof(float) * D);
            ph[r * W + D] = -INFINITY;
            ph[r * W + D + 1] = 0.f;
        }
        return;
    }
    if (R < FEW_ROWS) /* decode: one key at a time, each row's dot product and a sum */
        scores_by_key(scores, qh, k, bf16, base, ss, j0, jend, R, block, DV);
    else /* verification, prefill: a tile of keys in the lanes, a tile of rows, the same sums */
        scores_by_tile(scores, qp, k, bf16, base, ss, j0, jend, R, block, kt, DV);
    /* softmax statistics per row over the keys it sees; unseen keys weigh 0 */
    const int64_t len = (n + 15) / 16 * 16;
    for (int64_t r = 0; r < R; r++) {
        float *pr = ph + r * W, *s = scores + r * block, l = 0.f;
        const int64_t nr = (nvis[r] < jend ? nvis[r] : jend) - j0;
        if (softcap > 0.f)
            softcap_row(s, nr, scale, softcap);
        else
            for (int64_t jj = 0; jj < nr; jj++) s[jj] *= scale;
        pr[D] = nr > 0 ? softmax_row(s, nr, len, &l) : -INFINITY;
        if (nr <= 0) memset(s, 0, sizeof(float) * len);
        pr[D + 1] = l;
    }
    /* the weighted sum of values, NR rows sharing each value row loaded */
    int64_t r0 = 0;
    if (DV <= 4)
        for (; r0 + 6 <= R; r0 += 6) pv_rows(ph, W, scores, v, bf16, base, ss, j0, jend, r0, block, 6, DV);
    for (; r0 + 3 <= R; r0 += 3) pv_rows(ph, W, scores, v, bf16, base, ss, j0, jend, r0, block, 3, DV);
    for (; r0 < R; r0++) pv_rows(ph, W, scores, v, bf16, base, ss, j0, jend, r0, block, 1, DV);
}

/*
 * q     [H, R, D] float32, contiguous
 * scale softmax scale, applied to the dot products
 * softcap  > 0: scores -> softcap * tanh(score * scale / softcap) (Gemma 2); 0: off
 * k, v  head h, key j, dim d at  h*hs + j*ss + d  (float32 or bfloat16)
 * nvis  [R] keys each row sees (a prefix 0 .. nvis[r]-1 of the S keys)
 * part  [H, NB, R, D + 2] float32 scratch, NB = ceil(S / block)
 * out   [H, R, D] float32;  lse [H, R] float32 (natural log, of the scaled scores)
 * Returns 0; -1 when D is not a multiple of 16 up to 256 or `block` not a multiple of TK;
 * -2 when scratch memory could not be allocated.
 */
int triforce_attend(const float *q, const void *k, const void *v, int bf16, float scale, float softcap,
                    int64_t H, int64_t R, int64_t D, int64_t S, int64_t hs, int64_t ss,
                    const int64_t *nvis, int64_t block, float *part, float *out, float *lse) {
    /* the tiled scores write whole tiles of TK keys into a row of `block` floats */
    if (D % 16 || D / 16 > MAXV || block < TK || block % TK) return -1;
    const int DV = (int)(D / 16);
    const int64_t NB = (S + block - 1) / block;
    const int64_t W = D + 2;
    int64_t maxvis = 0;
    for (int64_t r = 0; r < R; r++) maxvis = nvis[r] > maxvis ? nvis[r] : maxvis;
    /* the rows packed for the tiled scores, once per call (not per block) */
    const int64_t Rp = (R + MR - 1) / MR * MR, P = D;
    uint32_t *qp = NULL;
    if (R >= FEW_ROWS) {
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
            const uint32_t *qph = qp ? qp + h * Rp * P : NULL; /* packed rows: tiled path only */
            float *ph = part + (h * NB + b) * R * W;
            /* the common head sizes get fully unrolled code */
            if (DV == 4)
                block_item(qh, qph, k, v, bf16, scale, softcap, h * hs, ss, nvis, R,
                           j0, jend, block, scores, kt, ph, 4);
            else if (DV == 8)
                block_item(qh, qph, k, v, bf16, scale, softcap, h * hs, ss, nvis, R,
                           j0, jend, block, scores, kt, ph, 8);
            else
                block_item(qh, qph, k, v, bf16, scale, softcap, h * hs, ss, nvis, R,
                           j0, jend, block, scores, kt, ph, DV);
        }
        free(scores);
        free(kt);

        /* merge the blocks of each (head, row) in key order (the barrier at the end of
         * the loop above makes `failed` the same for every thread) */
        if (!failed)
#pragma omp for schedule(static)
        for (int64_t hr = 0; hr < H * R; hr++) {
            const int64_t h = hr / R, r = hr % R;
            float m = -INFINITY;
            for (int64_t b = 0; b < NB; b++) {
                const float mb = part[((h * NB + b) * R + r) * W + D];
                m = mb > m ? mb : m;
            }
            float *o = out + hr * D;
            memset(o, 0, sizeof(float) * D);
            float l = 0.f;
            if (m != -INFINITY) {
                for (int64_t b = 0; b < NB; b++) {
                    const float *pb = part + ((h * NB + b) * R + r) * W;
                    if (pb[D] == -INFINITY) continue;
                    const float w = expf(pb[D] - m);
                    l += w * pb[D + 1];
                    for (int64_t d = 0; d < D; d++) o[d] += w * pb[d];
                }
                const float inv = 1.f / l;
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
            lse[hr] = m == -INFINITY ? -INFINITY : m + logf(l);
        }
    }
    free(qp);
    return failed ? -2 : 0;
}

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
