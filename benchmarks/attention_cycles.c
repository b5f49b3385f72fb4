/* Cycles per query row and key of the native attention kernel's bf16 path, by phase: what
 * benchmarks/attention_cycles.py compiles and runs (it includes the kernel's source, so the
 * static functions are callable here). Prints one "name value" pair per line.
 *
 *   attention_cycles ROWS HEAD_DIM KEYS LAYERS
 *
 * clock_ghz      a dependent chain of adds (one a cycle) over its time
 * dp_per_cycle   vdpbf16ps with 12 independent accumulators (0 without AVX512_BF16)
 * block_hot      one block of 256 keys, its K and V in the caches, called through a pointer
 *                as attend_blocks calls it
 * block_memory   the same over 512 blocks' K and V (32 MB for a head of 64): from memory
 * scores, transposes, softmax, pv   the block's phases alone, in the caches
 * call           the whole kernel (attend_blocks with its threads): ROWS rows over KEYS keys of
 *                3 KV heads, LAYERS distinct K/V cycled; cycles per row and key per thread */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include ATTENTION_SOURCE

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float uniform(void) { return (float)rand() / (float)RAND_MAX - 0.5f; }

static double clock_ghz(void) {
    const long n = 200000000;
    uint64_t x = 1;
    const double t = now();
    for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0" : "+r"(x));
    return (double)n / (now() - t) / 1e9;
}

static double dp_per_ns(void) {
#if defined(__AVX512BF16__)
    const long n = 20000000;
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    const double t = now();
    for (long i = 0; i < n; i++) {
        for (int j = 0; j < 12; j++) a[j] = _mm512_dpbf16_ps(a[j], b, b);
        __asm__ volatile("" : "+v"(b));
    }
    const double dt = now() - t;
    float s = 0.f;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(a[i]);
    if (s == 1.2345f) printf("#\n");
    return 12.0 * (double)n / dt / 1e9;
#else
    return 0.0;
#endif
}

typedef void (*block_fn)(const float *, const uint32_t *, const void *, const void *, int, float, float, int64_t,
                         int64_t, const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t,
                         float *restrict, uint32_t *restrict, float *restrict, const int, const int);

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s ROWS HEAD_DIM KEYS LAYERS\n", argv[0]);
        return 2;
    }
    const int R = atoi(argv[1]), D = atoi(argv[2]), L = atoi(argv[4]);
    const int64_t S = atol(argv[3]), block = 256, H = 3;
    const int DV = D / 16;
    if (R < 1 || D % 32 || D > 256 || S < block || L < 1) {
        fprintf(stderr, "ROWS >= 1, HEAD_DIM a multiple of 32 up to 256, KEYS >= 256, LAYERS >= 1\n");
        return 2;
    }
#if !BF_PATH
    fprintf(stderr, "this build has no bf16 path (no AVX512_BF16)\n");
    return 3;
#else
    const double ghz = clock_ghz();
    printf("clock_ghz %.3f\n", ghz);
    printf("dp_per_cycle %.2f\n", dp_per_ns() / ghz);
    srand(1);
    const int64_t NBK = 512, Rp = (R + MR - 1) / MR * MR;
    float *q = malloc(sizeof(float) * H * R * D);
    uint16_t *kb = malloc(2 * (size_t)NBK * block * D), *vb = malloc(2 * (size_t)NBK * block * D);
    uint32_t *qp = malloc(sizeof(uint32_t) * Rp * D / 2), *kt = aligned_alloc(64, sizeof(uint32_t) * TK * 16 * MAXV);
    float *scores = malloc(sizeof(float) * R * block), *s2 = malloc(sizeof(float) * R * block);
    float *ph = malloc(sizeof(float) * R * (D + 2));
    int64_t *nvis = malloc(sizeof(int64_t) * R);
    if (!q || !kb || !vb || !qp || !kt || !scores || !s2 || !ph || !nvis) return 1;
    for (int64_t i = 0; i < H * R * D; i++) q[i] = uniform();
    for (int64_t i = 0; i < NBK * block * D; i++) kb[i] = to_bf16(uniform()), vb[i] = to_bf16(uniform());
    for (int r = 0; r < R; r++) nvis[r] = block;
    pack_rows_bf(qp, q, R, D);
    const float scale = 1.f / sqrtf((float)D);
    const double row_keys = (double)R * (double)block;
    volatile block_fn fn = block_item_dv;
    const long N = (long)(4e8 / row_keys / DV) + 1;
    for (int pass = 0; pass < 2; pass++) { /* the caches, then memory */
        const int64_t nb = pass ? NBK : 1;
        double t = now();
        for (long it = 0; it < N; it++)
            fn(q, qp, kb, vb, 1, scale, 0.f, (it % nb) * block * D, D, nvis, NULL, R, 0, block, block, scores, kt,
               ph, 1, DV);
        printf("%s %.2f\n", pass ? "block_memory" : "block_hot", (now() - t) / N * ghz * 1e9 / row_keys);
    }
    double t = now();
    for (long it = 0; it < N; it++) {
        scores_by_tile_bf(scores, qp, kb, 0, D, 0, block, R, block, kt, DV, NULL);
        __asm__ volatile("" ::"r"(scores) : "memory");
    }
    printf("scores %.2f\n", (now() - t) / N * ghz * 1e9 / row_keys);
    t = now();
    for (long it = 0; it < N; it++) {
        transpose_keys(kt, kb, 2, 0, D, (it * TK) % block, block, D / 2, NULL);
        __asm__ volatile("" ::"r"(kt) : "memory");
    }
    printf("transposes %.2f\n", (now() - t) / N * (block / TK) * ghz * 1e9 / row_keys);
    t = now();
    for (long it = 0; it < N; it++) {
        memcpy(s2, scores, sizeof(float) * R * block);
        float l;
        for (int r = 0; r < R; r++) softmax_pack_bf(s2 + r * block, 0, block, block, scale, &l);
        __asm__ volatile("" ::"r"(s2) : "memory");
    }
    printf("softmax %.2f\n", (now() - t) / N * ghz * 1e9 / row_keys);
    t = now();
    for (long it = 0; it < N; it++) {
        if (DV == 4) {
            int64_t r0 = 0;
            for (; r0 + 6 <= R; r0 += 6) pv_rows_bf4(ph, D + 2, s2, vb, 0, D, 0, block, r0, block, 6);
            if (R - r0 >= 3) {
                pv_rows_bf4(ph, D + 2, s2, vb, 0, D, 0, block, r0, block, 3);
                r0 += 3;
            }
            for (; r0 < R; r0++) pv_rows_bf4(ph, D + 2, s2, vb, 0, D, 0, block, r0, block, 1);
        } else
            for (int64_t r0 = 0; r0 < R; r0++) pv_rows_bf(ph, D + 2, s2, vb, 0, D, 0, block, r0, block, 1, DV);
        __asm__ volatile("" ::"r"(ph) : "memory");
    }
    printf("pv%s %.2f\n", DV == 4 ? "" : "_one_row_at_a_time", (now() - t) / N * ghz * 1e9 / row_keys);

    /* the whole kernel over S keys of H heads, L layers' K and V cycled */
    uint16_t **kl = malloc(sizeof(uint16_t *) * L), **vl = malloc(sizeof(uint16_t *) * L);
    for (int l = 0; l < L; l++) {
        kl[l] = malloc(2 * (size_t)H * S * D);
        vl[l] = malloc(2 * (size_t)H * S * D);
        if (!kl[l] || !vl[l]) return 1;
        for (int64_t i = 0; i < H * S * D; i++) kl[l][i] = to_bf16(uniform()), vl[l][i] = to_bf16(uniform());
    }
    const int64_t NB = (S + block - 1) / block;
    float *part = malloc(sizeof(float) * H * NB * R * (D + 2)), *out = malloc(sizeof(float) * H * R * D);
    float *lse = malloc(sizeof(float) * H * R);
    for (int r = 0; r < R; r++) nvis[r] = S;
    const long M = (long)(2e9 / ((double)R * S * H)) + 1;
    attend_blocks(q, kl[0], vl[0], 1, scale, 0.f, H, R, D, S, S * D, D, nvis, NULL, block, 0, 1, part, out, lse);
    t = now();
    for (long it = 0; it < M; it++)
        for (int l = 0; l < L; l++)
            attend_blocks(q, kl[l], vl[l], 1, scale, 0.f, H, R, D, S, S * D, D, nvis, NULL, block, 0, 1, part, out, lse);
    const double per = (now() - t) / M / L;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    printf("call_ms %.3f\n", per * 1e3);
    printf("call %.2f\n", per * ghz * 1e9 * threads / ((double)R * S * H));
    return 0;
#endif
}
