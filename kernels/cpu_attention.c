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
 * row's dot product vectorised over the head dimension and summed horizontally; this is
 * bound by reading K. More rows (a verification): up to 16 rows in the lanes of a vector,
 * a key broadcast, accumulated in head-dimension order over 8 keys in flight; with a
 * bfloat16 cache and queries on CPUs with AVX512-BF16 through vdpbf16ps (pairs of exact
 * bf16 products added in float32, twice the multiply-adds of FMA per instruction). Within
 * a path a row's result depends only on its own query and the keys it sees, never on the
 * other rows; the two paths round differently (float32 order of summation).
 * Probabilities and sums are float32 throughout.
 * Vectors are GCC/Clang vector extensions of 16 floats: the compiler maps them onto
 * whatever the CPU has (one AVX-512 register, two AVX2 ones, four NEON ones).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
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

#define FEW_ROWS 8 /* below: rows one by one (decode); from here: rows in vector lanes */
#define KEYS 8 /* keys in flight: independent accumulator chains hide the FMA latency */

/* st[(j - j0) * 16 + lane] = scale * q[lane] . k[j], float32 multiply-adds in d order */
static inline __attribute__((always_inline)) void scores_f32(
        float *restrict st, const v16 *qT, const void *k, int bf16, int64_t base, int64_t ss,
        int64_t j0, int64_t jend, float scale, const int DV) {
    for (int64_t j = j0; j < jend; j += KEYS) {
        const int nk = jend - j < KEYS ? (int)(jend - j) : KEYS;
        v16 kr[KEYS][MAXV];
        for (int u = 0; u < KEYS; u++)
            load_row(kr[u], k, bf16, base + (j + (u < nk ? u : 0)) * ss, DV);
        v16 acc[KEYS];
        for (int u = 0; u < KEYS; u++) acc[u] = (v16){0};
        for (int i = 0; i < DV; i++)
            for (int l = 0; l < 16; l++) {
                const v16 a = qT[16 * i + l];
                for (int u = 0; u < KEYS; u++) acc[u] += a * kr[u][i][l];
            }
        for (int u = 0; u < nk; u++) {
            const v16 x = acc[u] * scale;
            memcpy(st + (j + u - j0) * 16, &x, sizeof x);
        }
    }
}

#if defined(__AVX512BF16__)
/* the same with vdpbf16ps: qT2[i] holds the 16 rows' bf16 pair (2i, 2i+1) */
static inline __attribute__((always_inline)) void scores_bf16(
        float *restrict st, const __m512i *qT2, const uint16_t *k, int64_t base, int64_t ss,
        int64_t j0, int64_t jend, float scale, const int DV) {
    for (int64_t j = j0; j < jend; j += KEYS) {
        const int nk = jend - j < KEYS ? (int)(jend - j) : KEYS;
        const uint16_t *kp[KEYS];
        for (int u = 0; u < KEYS; u++) kp[u] = k + base + (j + (u < nk ? u : 0)) * ss;
        __m512 acc[KEYS];
        for (int u = 0; u < KEYS; u++) acc[u] = _mm512_setzero_ps();
        for (int i = 0; i < 8 * DV; i++) {
            const __m512bh a = (__m512bh)qT2[i];
            for (int u = 0; u < KEYS; u++) {
                uint32_t pair;
                memcpy(&pair, kp[u] + 2 * i, sizeof pair);
                acc[u] = _mm512_dpbf16_ps(acc[u], a, (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
        for (int u = 0; u < nk; u++)
            _mm512_storeu_ps(st + (j + u - j0) * 16, _mm512_mul_ps(acc[u], _mm512_set1_ps(scale)));
    }
}
#endif

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
        const float *qh, const void *k, const void *v, int bf16, int dot_bf16, float scale,
        int64_t base, int64_t ss, const int64_t *nvis, int64_t R, int64_t j0, int64_t jend,
        int64_t block, float *restrict scores, float *restrict st, v16 *restrict qT,
        float *restrict ph, const int DV) {
    const int64_t D = 16 * DV, W = D + 2, n = jend - j0;
    if (R < FEW_ROWS) { /* decode: one key at a time, each row's dot product and a sum */
        scores_by_key(scores, qh, k, bf16, base, ss, j0, jend, R, block, DV);
        const int64_t len = (n + 15) / 16 * 16;
        for (int64_t r = 0; r < R; r++) {
            float *pr = ph + r * W, *s = scores + r * block, l = 0.f;
            const int64_t nr = (nvis[r] < jend ? nvis[r] : jend) - j0;
            for (int64_t jj = 0; jj < nr; jj++) s[jj] *= scale;
            pr[D] = nr > 0 ? softmax_row(s, nr, len, &l) : -INFINITY;
            if (nr <= 0) memset(s, 0, sizeof(float) * len);
            pr[D + 1] = l;
        }
    } else {
        for (int64_t c = 0; c < R; c += 16) { /* 16 rows at a time in the vector lanes */
            const int nr = R - c < 16 ? (int)(R - c) : 16;
            i16x16 vis;
            for (int l = 0; l < 16; l++) vis[l] = l < nr ? (int32_t)(nvis[c + l] - j0) : 0;
#if defined(__AVX512BF16__)
            if (dot_bf16) {
                uint32_t *q2 = (uint32_t *)qT; /* [D/2][16] bf16 pairs; q is bf16-exact */
                for (int64_t i = 0; i < D / 2; i++)
                    for (int l = 0; l < 16; l++) {
                        uint32_t lo = 0, hi = 0;
                        if (l < nr) {
                            memcpy(&lo, qh + (c + l) * D + 2 * i, 4);
                            memcpy(&hi, qh + (c + l) * D + 2 * i + 1, 4);
                        }
                        q2[i * 16 + l] = (lo >> 16) | (hi & 0xffff0000u);
                    }
                scores_bf16(st, (const __m512i *)qT, (const uint16_t *)k, base, ss, j0, jend, scale, DV);
            } else
#endif
            {
                (void)dot_bf16;
                for (int64_t d = 0; d < D; d++)
                    for (int l = 0; l < 16; l++) qT[d][l] = l < nr ? qh[(c + l) * D + d] : 0.f;
                scores_f32(st, qT, k, bf16, base, ss, j0, jend, scale, DV);
            }
            /* softmax statistics per row (lane) over the keys it sees; unseen keys weigh 0 */
            v16 m = {0}, l = {0};
            m -= INFINITY;
            v16 ninf = m;
            for (int64_t jj = 0; jj < n; jj++) {
                v16 x;
                memcpy(&x, st + jj * 16, sizeof x);
                const i16x16 ok = (i16x16){0} + (int32_t)jj < vis;
                x = (v16)(((i16x16)x & ok) | ((i16x16)ninf & ~ok));
                m = vmax(x, m);
            }
            const i16x16 any = m > ninf;
            const v16 m0 = (v16)((i16x16)m & any); /* rows that see nothing: 0, all weights 0 */
            for (int64_t jj = 0; jj < n; jj++) {
                v16 x;
                memcpy(&x, st + jj * 16, sizeof x);
                const i16x16 ok = (i16x16){0} + (int32_t)jj < vis;
                x = (v16)((i16x16)exp_neg16(x - m0) & ok);
                l += x;
                for (int r = 0; r < nr; r++) scores[(c + r) * block + jj] = x[r];
            }
            for (int r = 0; r < nr; r++) {
                ph[(c + r) * W + D] = any[r] ? m[r] : -INFINITY;
                ph[(c + r) * W + D + 1] = l[r];
            }
        }
    }
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) pv_rows(ph, W, scores, v, bf16, base, ss, j0, jend, r0, block, 4, DV);
    for (; r0 < R; r0++) pv_rows(ph, W, scores, v, bf16, base, ss, j0, jend, r0, block, 1, DV);
    if (jend <= j0)
        for (int64_t r = 0; r < R; r++) memset(ph + r * W, 0, sizeof(float) * D);
}

/*
 * q     [H, R, D] float32, contiguous (q_bf16: its values are bfloat16-exact)
 * scale softmax scale, applied to the dot products
 * k, v  head h, key j, dim d at  h*hs + j*ss + d  (float32 or bfloat16)
 * nvis  [R] keys each row sees (a prefix 0 .. nvis[r]-1 of the S keys)
 * part  [H, NB, R, D + 2] float32 scratch, NB = ceil(S / block)
 * out   [H, R, D] float32;  lse [H, R] float32 (natural log, of the scaled scores)
 * Returns 0, or -1 when D is not a multiple of 16 up to 256.
 */
int triforce_attend(const float *q, const void *k, const void *v, int bf16, int q_bf16, float scale,
                    int64_t H, int64_t R, int64_t D, int64_t S, int64_t hs, int64_t ss,
                    const int64_t *nvis, int64_t block, float *part, float *out, float *lse) {
    const int dot_bf16 = bf16 && q_bf16;
    if (D % 16 || D / 16 > MAXV || block < 16 || block % 16) return -1;
    const int DV = (int)(D / 16);
    const int64_t NB = (S + block - 1) / block;
    const int64_t W = D + 2;
    int64_t maxvis = 0;
    for (int64_t r = 0; r < R; r++) maxvis = nvis[r] > maxvis ? nvis[r] : maxvis;

#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (R > 0 ? R : 1) * block);
        float *st = (float *)aligned_alloc(64, sizeof(float) * 16 * block);
        v16 *qT = (v16 *)aligned_alloc(64, sizeof(v16) * 16 * MAXV);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < H * NB; item++) {
            const int64_t h = item / NB, b = item % NB;
            const int64_t j0 = b * block, j1 = j0 + block < S ? j0 + block : S;
            const int64_t jend = j1 < maxvis ? j1 : maxvis; /* keys past every row's view */
            const float *qh = q + h * R * D;
            float *ph = part + (h * NB + b) * R * W;
            /* the common head sizes get fully unrolled code */
            if (DV == 4)
                block_item(qh, k, v, bf16, dot_bf16, scale, h * hs, ss, nvis, R, j0, jend, block,
                           scores, st, qT, ph, 4);
            else if (DV == 8)
                block_item(qh, k, v, bf16, dot_bf16, scale, h * hs, ss, nvis, R, j0, jend, block,
                           scores, st, qT, ph, 8);
            else
                block_item(qh, k, v, bf16, dot_bf16, scale, h * hs, ss, nvis, R, j0, jend, block,
                           scores, st, qT, ph, DV);
        }
        free(scores);
        free(st);
        free(qT);

        /* merge the blocks of each (head, row) in key order */
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
    return 0;
}
