/* test_grouped_gemm.c: grouped GEMM fwd / dgrad / wgrad against a naive per-expert triple loop. */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "ctest.h"
#include "tuning.h"

/* MOE_CORE_GEMM_KERNEL set to `value` (NULL: unset), read again by the core */
static void set_gemm_kernel(const char *value) {
    if (value)
        setenv("MOE_CORE_GEMM_KERNEL", value, 1);
    else
        unsetenv("MOE_CORE_GEMM_KERNEL");
    moe_tuning_reload();
}

static moe_grouped_gemm_params_t gg_params(int64_t rows, int64_t E, int64_t K, int64_t N, int trans,
                                           moe_dtype_t dt, moe_dtype_t out_dt) {
    moe_grouped_gemm_params_t p = {rows, E, K, N, trans, dt, out_dt, MOE_GG_GATHER_NONE, NULL, 0};
    return p;
}

/* kind 0 fwd, 1 dgrad, 2 wgrad; allocates and frees its own workspace, like the binding */
static moe_status_t gg_call(int kind, void *out, const void *in0, const void *in1,
                            const int64_t *off, const moe_grouped_gemm_params_t *p) {
    size_t ws = moe_grouped_gemm_workspace_size(p);
    void *w = malloc(ws);
    moe_status_t st = kind == 0   ? moe_grouped_gemm_fwd(out, in0, in1, off, p, w, ws, NULL)
                      : kind == 1 ? moe_grouped_gemm_dgrad(out, in0, in1, off, p, w, ws, NULL)
                                  : moe_grouped_gemm_wgrad(out, in0, in1, off, p, w, ws, NULL);
    free(w);
    return st;
}

/* W(e, k, n) in either layout */
static int64_t widx(int trans, int64_t e, int64_t k, int64_t n, int64_t K, int64_t N) {
    return trans ? (e * N + n) * K + k : (e * K + k) * N + n;
}

static void *rand_buf(unsigned long long *s, moe_dtype_t dt, int64_t n) {
    void *b = malloc((size_t)(n > 0 ? n : 1) * moe_dtype_size(dt));
    for (int64_t i = 0; i < n; ++i) moe_store(b, dt, i, ctest_rand_normal(s));
    return b;
}

static void *nan_buf(moe_dtype_t dt, int64_t n) {
    void *b = malloc((size_t)(n > 0 ? n : 1) * moe_dtype_size(dt));
    for (int64_t i = 0; i < n; ++i) moe_store(b, dt, i, NAN);
    return b;
}

static double eps_of(moe_dtype_t dt) {
    return dt == MOE_DTYPE_FP64 ? 0x1p-52 : dt == MOE_DTYPE_FP32 ? 0x1p-23 :
           dt == MOE_DTYPE_FP16 ? 0x1p-10 : 0x1p-7;
}

/* One full check of the three products for one set of counts, dtype pair and layout. Bound per
 * element: one rounding to the output dtype plus red · eps(accumulator) · Σ|a·b|. */
static void check_case(const int64_t *counts, int64_t E, int64_t K, int64_t N, int trans,
                       moe_dtype_t dt, moe_dtype_t out_dt, unsigned long long seed) {
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(E + 1));
    off[0] = 0;
    for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
    const int64_t R = off[E];
    unsigned long long s = seed;
    void *x = rand_buf(&s, dt, R * K), *w = rand_buf(&s, dt, E * K * N), *dy = rand_buf(&s, dt, R * N);
    void *y = nan_buf(out_dt, R * N), *dx = nan_buf(out_dt, R * K), *dw = nan_buf(out_dt, E * K * N);
    moe_grouped_gemm_params_t p = gg_params(R, E, K, N, trans, dt, out_dt);
    CHECK(gg_call(0, y, x, w, off, &p) == MOE_OK, "fwd: %s", moe_last_error());
    CHECK(gg_call(1, dx, dy, w, off, &p) == MOE_OK, "dgrad: %s", moe_last_error());
    CHECK(gg_call(2, dw, x, dy, off, &p) == MOE_OK, "wgrad: %s", moe_last_error());
    const double acc_eps = dt == MOE_DTYPE_FP64 ? 0x1p-52 : 0x1p-23, out_eps = eps_of(out_dt);
    int bad = 0;
    for (int64_t e = 0; e < E && bad < 5; ++e) {
        for (int64_t r = off[e]; r < off[e + 1]; ++r) {
            for (int64_t n = 0; n < N; ++n) { /* fwd */
                double ref = 0, mag = 0;
                for (int64_t k = 0; k < K; ++k) {
                    double t = moe_load(x, dt, r * K + k) * moe_load(w, dt, widx(trans, e, k, n, K, N));
                    ref += t, mag += fabs(t);
                }
                double got = moe_load(y, out_dt, r * N + n);
                double tol = out_eps * fabs(ref) + (double)(K + 1) * acc_eps * mag;
                if (!(fabs(got - ref) <= tol)) ++bad;
                CHECK(fabs(got - ref) <= tol, "fwd e %lld r %lld n %lld: %g vs %g", (long long)e,
                      (long long)r, (long long)n, got, ref);
            }
            for (int64_t k = 0; k < K; ++k) { /* dgrad */
                double ref = 0, mag = 0;
                for (int64_t n = 0; n < N; ++n) {
                    double t = moe_load(dy, dt, r * N + n) * moe_load(w, dt, widx(trans, e, k, n, K, N));
                    ref += t, mag += fabs(t);
                }
                double got = moe_load(dx, out_dt, r * K + k);
                double tol = out_eps * fabs(ref) + (double)(N + 1) * acc_eps * mag;
                if (!(fabs(got - ref) <= tol)) ++bad;
                CHECK(fabs(got - ref) <= tol, "dgrad e %lld r %lld k %lld: %g vs %g", (long long)e,
                      (long long)r, (long long)k, got, ref);
            }
        }
        for (int64_t k = 0; k < K; ++k) { /* wgrad, including experts with no rows (must be 0) */
            for (int64_t n = 0; n < N; ++n) {
                double ref = 0, mag = 0;
                for (int64_t r = off[e]; r < off[e + 1]; ++r) {
                    double t = moe_load(x, dt, r * K + k) * moe_load(dy, dt, r * N + n);
                    ref += t, mag += fabs(t);
                }
                double got = moe_load(dw, out_dt, widx(trans, e, k, n, K, N));
                double tol = out_eps * fabs(ref) + (double)(counts[e] + 1) * acc_eps * mag;
                if (!(fabs(got - ref) <= tol)) ++bad;
                CHECK(fabs(got - ref) <= tol, "wgrad e %lld k %lld n %lld: %g vs %g (rows %lld)",
                      (long long)e, (long long)k, (long long)n, got, ref, (long long)counts[e]);
            }
        }
    }
    free(off), free(x), free(w), free(dy), free(y), free(dx), free(dw);
}

static void test_grouped_gemm_matches_naive(void) {
    /* zeros, ones, counts that are no multiple of MR or MC */
    static const int64_t counts[6] = {0, 1, 37, 0, 130, 9};
    static const moe_dtype_t dts[4] = {MOE_DTYPE_FP32, MOE_DTYPE_BF16, MOE_DTYPE_FP16, MOE_DTYPE_FP64};
    for (int d = 0; d < 4; ++d)
        for (int trans = 0; trans < 2; ++trans)
            check_case(counts, 6, 45, 70, trans, dts[d], dts[d], 7 + (unsigned)d);
    /* narrow in, wide out and the reverse; K past one block (KC = 128) */
    check_case(counts, 6, 150, 33, 1, MOE_DTYPE_BF16, MOE_DTYPE_FP32, 11);
    check_case(counts, 6, 20, 140, 0, MOE_DTYPE_FP32, MOE_DTYPE_BF16, 12);
    /* past one tile in every direction (MC = NC = 256, KC = 128) */
    static const int64_t big[2] = {3, 270};
    check_case(big, 2, 130, 260, 0, MOE_DTYPE_BF16, MOE_DTYPE_BF16, 13);
    check_case(big, 2, 260, 130, 1, MOE_DTYPE_FP32, MOE_DTYPE_FP32, 14);
}

static void test_grouped_gemm_one_expert_holds_all(void) {
    static const int64_t counts[4] = {0, 0, 300, 0};
    check_case(counts, 4, 129, 31, 0, MOE_DTYPE_FP32, MOE_DTYPE_FP32, 21);
    check_case(counts, 4, 31, 129, 1, MOE_DTYPE_BF16, MOE_DTYPE_BF16, 22);
}

static void test_grouped_gemm_generic_kernel(void) {
    static const int64_t counts[3] = {5, 0, 140};
    set_gemm_kernel("generic");
    CHECK(moe_tuning_get().cpu_gemm_kernel == MOE_TUNING_GEMM_GENERIC, "switch not read");
    check_case(counts, 3, 130, 40, 0, MOE_DTYPE_FP32, MOE_DTYPE_FP32, 31);
    check_case(counts, 3, 40, 130, 1, MOE_DTYPE_FP16, MOE_DTYPE_FP16, 32);
    set_gemm_kernel(NULL);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    /* the switch takes effect: where the default is the AVX-512 FMA kernel, the portable loop's
     * separate multiply and add round differently somewhere over 140 x 40 sums of 130 terms */
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f")) return;
    const int64_t off[4] = {0, 5, 5, 145}, R = 145, K = 130, N = 40;
    unsigned long long s = 33;
    void *x = rand_buf(&s, MOE_DTYPE_FP32, R * K), *w = rand_buf(&s, MOE_DTYPE_FP32, 3 * K * N);
    float *y[2] = {malloc(sizeof(float) * R * N), malloc(sizeof(float) * R * N)};
    moe_grouped_gemm_params_t p = gg_params(R, 3, K, N, 0, MOE_DTYPE_FP32, MOE_DTYPE_FP32);
    for (int v = 0; v < 2; ++v) {
        set_gemm_kernel(v ? "generic" : NULL);
        CHECK(gg_call(0, y[v], x, w, off, &p) == MOE_OK, "%s", moe_last_error());
    }
    set_gemm_kernel(NULL);
    CHECK(memcmp(y[0], y[1], sizeof(float) * R * N) != 0, "generic gave the FMA kernel's bits");
    free(x), free(w), free(y[0]), free(y[1]);
#endif
}

/* bf16 through AVX512_BF16's pair dot product equals the fp32 FMA kernel bit for bit (same
 * products, same order) on normal numbers; odd K exercises the half-filled last pair. Skipped
 * where the CPU lacks either. */
static void test_grouped_gemm_bf16_pairs_match_fma(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) return;
    const int64_t E = 3, K = 301, N = 45, R = 420;
    int64_t off[4] = {0, 7, 7, R};
    for (int trans = 0; trans < 2; ++trans) {
        unsigned long long s = 77 + (unsigned)trans;
        void *x = rand_buf(&s, MOE_DTYPE_BF16, R * K), *w = rand_buf(&s, MOE_DTYPE_BF16, E * K * N);
        void *dy = rand_buf(&s, MOE_DTYPE_BF16, R * N);
        moe_grouped_gemm_params_t p = gg_params(R, E, K, N, trans, MOE_DTYPE_BF16, MOE_DTYPE_FP32);
        float *out[2][3];
        for (int v = 0; v < 2; ++v) {
            if (v) set_gemm_kernel("avx512");
            out[v][0] = malloc(sizeof(float) * R * N), out[v][1] = malloc(sizeof(float) * R * K);
            out[v][2] = malloc(sizeof(float) * E * K * N);
            CHECK(gg_call(0, out[v][0], x, w, off, &p) == MOE_OK, "%s", moe_last_error());
            CHECK(gg_call(1, out[v][1], dy, w, off, &p) == MOE_OK, "%s", moe_last_error());
            CHECK(gg_call(2, out[v][2], x, dy, off, &p) == MOE_OK, "%s", moe_last_error());
            if (v) set_gemm_kernel(NULL);
        }
        CHECK(memcmp(out[0][0], out[1][0], sizeof(float) * R * N) == 0, "fwd trans %d", trans);
        CHECK(memcmp(out[0][1], out[1][1], sizeof(float) * R * K) == 0, "dgrad trans %d", trans);
        CHECK(memcmp(out[0][2], out[1][2], sizeof(float) * E * K * N) == 0, "wgrad trans %d", trans);
        for (int v = 0; v < 2; ++v) free(out[v][0]), free(out[v][1]), free(out[v][2]);
        free(x), free(w), free(dy);
    }
#endif
}

/* Same inputs twice → the same bits (fixed summation order, no atomics). */
static void test_grouped_gemm_deterministic(void) {
    const int64_t E = 3, K = 300, N = 70, R = 500;
    int64_t off[4] = {0, 200, 200, R};
    unsigned long long s = 5;
    void *x = rand_buf(&s, MOE_DTYPE_FP32, R * K), *dy = rand_buf(&s, MOE_DTYPE_FP32, R * N);
    float *a = malloc(sizeof(float) * E * K * N), *b = malloc(sizeof(float) * E * K * N);
    moe_grouped_gemm_params_t p = gg_params(R, E, K, N, 0, MOE_DTYPE_FP32, MOE_DTYPE_FP32);
    CHECK(gg_call(2, a, x, dy, off, &p) == MOE_OK, "%s", moe_last_error());
    CHECK(gg_call(2, b, x, dy, off, &p) == MOE_OK, "%s", moe_last_error());
    CHECK(memcmp(a, b, sizeof(float) * E * K * N) == 0, "wgrad differs between two runs");
    free(x), free(dy), free(a), free(b);
}

/* Re-entrant: called from inside a parallel region (the nested team has one thread) by two
 * threads at once, each with its own workspace and output, it gives the serial result. */
static void test_grouped_gemm_reentrant(void) {
    const int64_t E = 4, K = 70, N = 90, R = 600;
    int64_t off[5] = {0, 300, 301, 301, R};
    unsigned long long s = 8;
    void *x = rand_buf(&s, MOE_DTYPE_BF16, R * K), *w = rand_buf(&s, MOE_DTYPE_BF16, E * K * N);
    float *ref = malloc(sizeof(float) * R * N), *out[2];
    moe_grouped_gemm_params_t p = gg_params(R, E, K, N, 1, MOE_DTYPE_BF16, MOE_DTYPE_FP32);
    CHECK(gg_call(0, ref, x, w, off, &p) == MOE_OK, "%s", moe_last_error());
    moe_status_t st[2] = {MOE_ERR_INTERNAL, MOE_ERR_INTERNAL};
    out[0] = malloc(sizeof(float) * R * N), out[1] = malloc(sizeof(float) * R * N);
#pragma omp parallel num_threads(2)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num();
#else
        const int id = 0;
#endif
        st[id] = gg_call(0, out[id], x, w, off, &p);
    }
    for (int i = 0; i < 2; ++i) {
        if (st[i] == MOE_ERR_INTERNAL) continue; /* a team of one: only thread 0 ran */
        CHECK(st[i] == MOE_OK, "thread %d: %s", i, moe_status_string(st[i]));
        CHECK(memcmp(out[i], ref, sizeof(float) * R * N) == 0, "thread %d differs", i);
    }
    free(x), free(w), free(ref), free(out[0]), free(out[1]);
}

/* rows × K > 2^31 elements: x is calloc'd (untouched pages are the shared zero page, so this
 * needs no real memory) and only the last expert's rows hold data. */
static void test_grouped_gemm_int64_index(void) {
    const int64_t K = 65537, R = 32771, N = 2, E = 2; /* R·K = 2147647... > 2^31 */
    CHECK(R * K > ((int64_t)1 << 31), "the case must pass 2^31");
    int64_t off[3] = {0, R - 3, R};
    uint16_t *x = calloc((size_t)(R * K), sizeof(uint16_t));
    if (!x) return; /* no address space for it here: nothing to test */
    unsigned long long s = 9;
    uint16_t *w = rand_buf(&s, MOE_DTYPE_BF16, E * K * N);
    for (int64_t i = (R - 3) * K; i < R * K; ++i) x[i] = moe_float_to_bf16((float)ctest_rand_normal(&s));
    float *y = nan_buf(MOE_DTYPE_FP32, R * N);
    moe_grouped_gemm_params_t p = gg_params(R, E, K, N, 0, MOE_DTYPE_BF16, MOE_DTYPE_FP32);
    CHECK(gg_call(0, y, x, w, off, &p) == MOE_OK, "%s", moe_last_error());
    for (int64_t r = R - 3; r < R; ++r)
        for (int64_t n = 0; n < N; ++n) {
            double ref = 0, mag = 0;
            for (int64_t k = 0; k < K; ++k) {
                double t = (double)moe_bf16_to_float(x[r * K + k]) *
                           moe_bf16_to_float(w[(K + k) * N + n]);
                ref += t, mag += fabs(t);
            }
            CHECK(fabs(y[r * N + n] - ref) <= 1e-4 * mag, "row %lld: %g vs %g", (long long)r,
                  y[r * N + n], ref);
        }
    CHECK(y[0] == 0.0f && y[(R - 4) * N + 1] == 0.0f, "zero rows give zeros");
    free(x), free(w), free(y);
}

/* The packing and store conversions (branch-free copies of common.h's) are exact: every fp16 and
 * bf16 pattern times 1 comes out as moe_*_to_float, and fp32 → fp16 outputs round exactly like
 * moe_float_to_fp16 over a sweep of fp32 patterns (subnormal ties, the overflow edge, inf, NaN). */
static void test_grouped_gemm_conversions_exact(void) {
    const int64_t R = 65536;
    int64_t off[2] = {0, R};
    uint16_t *h = malloc(sizeof(uint16_t) * R), one16[2] = {0x3c00, 0x3f80};
    float *y = malloc(sizeof(float) * R), one = 1.0f;
    for (int64_t i = 0; i < R; ++i) h[i] = (uint16_t)i;
    for (int b = 0; b < 2; ++b) {
        moe_dtype_t dt = b ? MOE_DTYPE_BF16 : MOE_DTYPE_FP16;
        moe_grouped_gemm_params_t p = gg_params(R, 1, 1, 1, 0, dt, MOE_DTYPE_FP32);
        /* the widening path (the AVX512_BF16 path flushes bf16 subnormals, as documented) */
        set_gemm_kernel("avx512");
        CHECK(gg_call(0, y, h, &one16[b], off, &p) == MOE_OK, "%s", moe_last_error());
        set_gemm_kernel(NULL);
        int bad = 0;
        for (int64_t i = 0; i < R && bad < 3; ++i) {
            float want = b ? moe_bf16_to_float(h[i]) : moe_fp16_to_float(h[i]);
            int ok = (want != want) ? (y[i] != y[i]) : (y[i] == want);
            bad += !ok;
            CHECK(ok, "%s %04x: %g vs %g", b ? "bf16" : "fp16", (unsigned)h[i], y[i], want);
        }
    }
    const uint32_t edges[] = {0x477ff000u, 0x477fefffu, 0x477fe000u, 0x38800000u, 0x387fffffu,
                              0x33000000u, 0x33000001u, 0x33800000u, 0x33c00000u, 0x7f800000u,
                              0x7fc00000u, 0x7f800001u, 0x00000001u, 0x80000000u, 0xc77ff000u};
    const int64_t ne = (int64_t)(sizeof edges / sizeof edges[0]), n = ne + 1048576;
    float *x = malloc(sizeof(float) * n);
    uint16_t *out = malloc(sizeof(uint16_t) * n);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u = i < ne ? edges[i] : (uint32_t)((i - ne) * 4099u);
        memcpy(&x[i], &u, sizeof u);
    }
    int64_t off2[2] = {0, n};
    moe_grouped_gemm_params_t p = gg_params(n, 1, 1, 1, 0, MOE_DTYPE_FP32, MOE_DTYPE_FP16);
    CHECK(gg_call(0, out, x, &one, off2, &p) == MOE_OK, "%s", moe_last_error());
    int bad = 0;
    for (int64_t i = 0; i < n && bad < 3; ++i) {
        uint16_t want = moe_float_to_fp16(x[i] * 1.0f + 0.0f);
        const int want_nan = (want & 0x7c00u) == 0x7c00u && (want & 0x3ffu);
        const int got_nan = (out[i] & 0x7c00u) == 0x7c00u && (out[i] & 0x3ffu);
        int ok = want_nan ? got_nan : out[i] == want;
        bad += !ok;
        CHECK(ok, "fp32 %a -> fp16 %04x, want %04x", (double)x[i], (unsigned)out[i], (unsigned)want);
    }
    free(h), free(y), free(x), free(out);
}

/* Gathered operand == the op on the materialised rows, bit for bit: for every op and operand it
 * may gather, each dtype, both layouts and each CPU kernel (the default, the fp32 AVX-512 one that
 * every dtype can be forced to, the portable one). The index has -1 (zero rows), repeats, an
 * empty expert, rows past expert_offsets[E], and a source with fewer rows than the buffer. Sizes
 * cross one tile in every direction (MC = NC = 256 rows / columns, KC = 128) with odd K and N
 * (the half-filled last bf16 pair). */
static void test_grouped_gemm_gather_equals_materialised(void) {
    static const moe_dtype_t dts[4] = {MOE_DTYPE_FP32, MOE_DTYPE_BF16, MOE_DTYPE_FP16, MOE_DTYPE_FP64};
    static const char *kernels[3] = {NULL, "avx512", "generic"};
    const int64_t E = 4, K = 131, N = 267, R = 300, S = 97;
    const int64_t off[5] = {0, 5, 5, 280, 290}; /* expert 1 empty; rows 290.. past the last */
    int64_t *idx = malloc(sizeof(int64_t) * R);
    for (int64_t r = 0; r < R; ++r) /* repeats (r·7 mod S hits each source row ~3 times), -1s */
        idx[r] = r % 11 == 3 ? -1 : (r * 7) % S;
    for (int d = 0; d < 4; ++d) {
        const moe_dtype_t dt = dts[d];
        const size_t es = moe_dtype_size(dt);
        unsigned long long s = 100 + (unsigned)d;
        void *xs = rand_buf(&s, dt, S * K), *dys = rand_buf(&s, dt, S * N);
        void *w = rand_buf(&s, dt, E * K * N), *x = rand_buf(&s, dt, R * K);
        void *dy = rand_buf(&s, dt, R * N);
        /* the materialised rows: xg = xs[idx], dyg = dys[idx], zero where idx = -1 */
        char *xg = calloc((size_t)(R * K), es), *dyg = calloc((size_t)(R * N), es);
        for (int64_t r = 0; r < R; ++r) {
            if (idx[r] < 0) continue;
            memcpy(xg + (size_t)(r * K) * es, (char *)xs + (size_t)(idx[r] * K) * es, (size_t)K * es);
            memcpy(dyg + (size_t)(r * N) * es, (char *)dys + (size_t)(idx[r] * N) * es, (size_t)N * es);
        }
        const size_t out_bytes = (size_t)(E * K * N + R * N + R * K) * es;
        char *want = malloc(out_bytes), *got = malloc(out_bytes);
        for (int kv = 0; kv < (dt == MOE_DTYPE_FP64 ? 1 : 3); ++kv) {
            set_gemm_kernel(kernels[kv]);
            for (int trans = 0; trans < 2; ++trans) {
                moe_grouped_gemm_params_t p = gg_params(R, E, K, N, trans, dt, dt), g = p;
                g.gather_index = idx, g.gather_rows = S;
                /* (op, operand): fwd x, dgrad dy, wgrad x, wgrad dy */
                for (int c = 0; c < 4; ++c) {
                    const int kind = c < 2 ? c : 2;
                    g.gather_operand = c == 1 || c == 3 ? MOE_GG_GATHER_DY : MOE_GG_GATHER_X;
                    const int64_t n_out = kind == 0 ? R * N : kind == 1 ? R * K : E * K * N;
                    const void *m0 = kind == 0 ? xg : kind == 1 ? dyg : (c == 2 ? xg : x);
                    const void *m1 = kind == 2 ? (c == 3 ? dyg : dy) : w;
                    const void *g0 = kind == 0 ? xs : kind == 1 ? dys : (c == 2 ? xs : x);
                    const void *g1 = kind == 2 ? (c == 3 ? dys : dy) : w;
                    memset(want, 0xab, out_bytes), memset(got, 0xcd, out_bytes);
                    CHECK(gg_call(kind, want, m0, m1, off, &p) == MOE_OK, "%s", moe_last_error());
                    CHECK(gg_call(kind, got, g0, g1, off, &g) == MOE_OK, "%s", moe_last_error());
                    CHECK(memcmp(want, got, (size_t)n_out * es) == 0,
                          "case %d dtype %s trans %d kernel %s: gathered differs", c,
                          moe_dtype_name(dt), trans, kernels[kv] ? kernels[kv] : "default");
                }
            }
        }
        set_gemm_kernel(NULL);
        free(xs), free(dys), free(w), free(x), free(dy), free(xg), free(dyg), free(want), free(got);
    }
    free(idx);
}

static void expect_error(moe_status_t st, const char *needle) {
    CHECK(st == MOE_ERR_INVALID_ARGUMENT, "status %s", moe_status_string(st));
    CHECK(strstr(moe_last_error(), needle) != NULL, "message '%s' lacks '%s'", moe_last_error(),
          needle);
}

static void test_grouped_gemm_bad_input(void) {
    float x[12] = {0}, w[24] = {0}, y[12];
    moe_grouped_gemm_params_t p = gg_params(4, 2, 3, 4, 0, MOE_DTYPE_FP32, MOE_DTYPE_FP32);
    int64_t first[3] = {1, 2, 4}, decr[3] = {0, 3, 2}, last[3] = {0, 2, 5};
    expect_error(gg_call(0, y, x, w, first, &p), "expert_offsets[0] must be 0, got 1");
    expect_error(gg_call(1, y, x, w, decr, &p),
                 "non-decreasing, got expert_offsets[2]=2 < expert_offsets[1]=3");
    expect_error(gg_call(2, w, x, y, last, &p), "expert_offsets[num_experts=2] must be <= num_rows=4, got 5");
    expect_error(gg_call(0, y, x, w, NULL, &p), "expert_offsets must not be NULL");
    int64_t ok[3] = {0, 2, 4};
    moe_grouped_gemm_params_t q = p;
    q.dtype = MOE_DTYPE_INT32;
    expect_error(gg_call(0, y, x, w, ok, &q), "dtype must be float32, float16, bfloat16 or float64, got int32");
    q = p, q.num_experts = 0;
    expect_error(gg_call(0, y, x, w, ok, &q), "num_experts must be >= 1, got 0");
    q = p, q.trans_w = 2;
    expect_error(gg_call(0, y, x, w, ok, &q), "trans_w must be 0 or 1, got 2");
    q = p, q.in_features = -1;
    expect_error(gg_call(0, y, x, w, ok, &q), "in_features must be >= 0, got -1");
    char small[16];
    expect_error(moe_grouped_gemm_fwd(y, x, w, ok, &p, small, sizeof small, NULL), "workspace too small: 16 bytes");
    /* zero rows: nothing to read, OK; wgrad of zero rows writes zeros */
    int64_t zero[3] = {0, 0, 0};
    q = p, q.num_rows = 0;
    for (int i = 0; i < 24; ++i) w[i] = NAN;
    CHECK(gg_call(0, NULL, NULL, NULL, zero, &q) == MOE_OK, "%s", moe_last_error());
    CHECK(gg_call(2, w, NULL, NULL, zero, &q) == MOE_OK, "%s", moe_last_error());
    int zeros = 1;
    for (int i = 0; i < 24; ++i) zeros &= w[i] == 0.0f;
    CHECK(zeros, "wgrad with no rows must write zeros");
}

static void test_grouped_gemm_gather_bad_input(void) {
    float x[12] = {0}, w[24] = {0}, y[16];
    int64_t ok[3] = {0, 2, 4}, idx[4] = {0, -1, 2, 1};
    moe_grouped_gemm_params_t p = gg_params(4, 2, 3, 4, 0, MOE_DTYPE_FP32, MOE_DTYPE_FP32), q;
    p.gather_index = idx, p.gather_rows = 3;
    q = p, q.gather_operand = MOE_GG_GATHER_DY;
    expect_error(gg_call(0, y, x, w, ok, &q),
                 "gather_operand=2 is not allowed for moe_grouped_gemm_fwd (allowed: 0 = none, 1 = x)");
    q = p, q.gather_operand = MOE_GG_GATHER_X;
    expect_error(gg_call(1, y, x, w, ok, &q),
                 "gather_operand=1 is not allowed for moe_grouped_gemm_dgrad");
    q = p, q.gather_operand = 3;
    expect_error(gg_call(2, w, x, y, ok, &q),
                 "gather_operand=3 is not allowed for moe_grouped_gemm_wgrad");
    q = p, q.gather_operand = MOE_GG_GATHER_X, q.gather_rows = -1;
    expect_error(gg_call(0, y, x, w, ok, &q), "gather_rows must be >= 0, got -1");
    q = p, q.gather_operand = MOE_GG_GATHER_X, q.gather_index = NULL;
    expect_error(gg_call(0, y, x, w, ok, &q), "gather_index must not be NULL");
    q = p, q.gather_operand = MOE_GG_GATHER_DY, q.gather_rows = 2;
    expect_error(gg_call(2, w, x, y, ok, &q), "gather_index[2] = 2 is outside [-1, gather_rows=2)");
    idx[3] = -2;
    q = p, q.gather_operand = MOE_GG_GATHER_X;
    expect_error(gg_call(0, y, x, w, ok, &q), "gather_index[3] = -2 is outside [-1, gather_rows=3)");
    /* an empty source: every index -1, the source pointer may be NULL; all rows read zeros */
    int64_t none[4] = {-1, -1, -1, -1};
    q = p, q.gather_operand = MOE_GG_GATHER_X, q.gather_index = none, q.gather_rows = 0;
    for (int i = 0; i < 24; ++i) w[i] = 1.0f;
    CHECK(gg_call(0, y, NULL, w, ok, &q) == MOE_OK, "%s", moe_last_error());
    int zeros = 1;
    for (int i = 0; i < 16; ++i) zeros &= y[i] == 0.0f;
    CHECK(zeros, "an all -1 gather must give zero rows");
}

void ctest_register_grouped_gemm(void) {
    ctest_add("grouped_gemm_matches_naive", test_grouped_gemm_matches_naive);
    ctest_add("grouped_gemm_one_expert_holds_all", test_grouped_gemm_one_expert_holds_all);
    ctest_add("grouped_gemm_generic_kernel", test_grouped_gemm_generic_kernel);
    ctest_add("grouped_gemm_bf16_pairs_match_fma", test_grouped_gemm_bf16_pairs_match_fma);
    ctest_add("grouped_gemm_deterministic", test_grouped_gemm_deterministic);
    ctest_add("grouped_gemm_reentrant", test_grouped_gemm_reentrant);
    ctest_add("grouped_gemm_int64_index", test_grouped_gemm_int64_index);
    ctest_add("grouped_gemm_conversions_exact", test_grouped_gemm_conversions_exact);
    ctest_add("grouped_gemm_bad_input", test_grouped_gemm_bad_input);
    ctest_add("grouped_gemm_gather_equals_materialised", test_grouped_gemm_gather_equals_materialised);
    ctest_add("grouped_gemm_gather_bad_input", test_grouped_gemm_gather_bad_input);
}
