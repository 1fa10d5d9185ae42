/* test_layout.c: token dropping, permute / unpermute and chunk sorting against brute-force C. */
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "ctest.h"

/* A random [T, E] map with exactly k experts per token (partial Fisher-Yates per row). */
static void random_map(uint8_t *map, int64_t T, int64_t E, int64_t k, unsigned long long *s) {
    int64_t perm[256];
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = 0; e < E; ++e) perm[e] = e, map[t * E + e] = 0;
        for (int64_t j = 0; j < k; ++j) {
            int64_t i = j + (int64_t)(ctest_rand_u64(s) % (unsigned long long)(E - j));
            int64_t tmp = perm[j];
            perm[j] = perm[i], perm[i] = tmp;
            map[t * E + perm[j]] = 1;
        }
    }
}

/* A random map (k experts per token), normal fp64 tokens [T, H] and uniform probs where routed
 * (zero elsewhere). */
static void random_inputs(uint8_t *map, double *x, double *p, int64_t T, int64_t E, int64_t k,
                          int64_t H, unsigned long long *s) {
    random_map(map, T, E, k, s);
    for (int64_t i = 0; i < T * H; ++i) x[i] = ctest_rand_normal(s);
    for (int64_t i = 0; i < T * E; ++i) p[i] = map[i] ? ctest_rand_uniform(s) : 0.0;
}

/* Runs permute on fp64 tokens; returns R (the row count) and fills the outputs (caller frees). */
typedef struct {
    int64_t R;
    double *rows, *probs;
    int64_t *idx, *off, *cnt;
} permuted_t;

static permuted_t run_permute(const double *x, const uint8_t *map, const double *p, int64_t T,
                              int64_t H, int64_t E, int64_t num_out, int dap, int64_t align) {
    moe_permute_params_t prm = {num_out, align, dap};
    permuted_t o;
    o.R = moe_permute_num_rows(T, E, &prm);
    o.rows = malloc((size_t)(o.R * H + 1) * sizeof(double));
    o.probs = malloc((size_t)(o.R + 1) * sizeof(double));
    o.idx = malloc((size_t)(o.R + 1) * sizeof(int64_t));
    o.off = malloc((size_t)(E + 1) * sizeof(int64_t));
    o.cnt = malloc((size_t)E * sizeof(int64_t));
    moe_status_t st = moe_permute_fwd(o.rows, p ? o.probs : NULL, o.idx, o.off, o.cnt, x, map, p, T, H, E,
                                      MOE_DTYPE_FP64, MOE_DTYPE_FP64, &prm, NULL, 0, NULL);
    CHECK(st == MOE_OK, "permute: %s", moe_last_error());
    return o;
}

static void free_permuted(permuted_t *o) {
    free(o->rows), free(o->probs), free(o->idx), free(o->off), free(o->cnt);
}

/* Dropless: rows are (expert asc, token asc); counts, offsets, rows and probs as brute force. */
static void test_permute_dropless_order(void) {
    unsigned long long s = 7;
    enum { T = 50, E = 12, K = 3, H = 5 };
    static uint8_t map[T * E];
    static double x[T * H], p[T * E];
    random_inputs(map, x, p, T, E, K, H, &s);
    for (int64_t align = 0; align <= 4; align += 4) {
        permuted_t o = run_permute(x, map, p, T, H, E, T * K, 0, align);
        int64_t r = 0;
        for (int64_t e = 0; e < E; ++e) {
            CHECK(o.off[e] == r, "offset of expert %lld: %lld vs %lld", (long long)e,
                  (long long)o.off[e], (long long)r);
            int64_t n = 0;
            for (int64_t t = 0; t < T; ++t) {
                if (!map[t * E + e]) continue;
                CHECK(o.idx[r] == t, "row %lld: token %lld vs %lld", (long long)r,
                      (long long)o.idx[r], (long long)t);
                CHECK(o.probs[r] == p[t * E + e], "prob of row %lld", (long long)r);
                CHECK(memcmp(o.rows + r * H, x + t * H, H * sizeof(double)) == 0, "row %lld", (long long)r);
                ++r, ++n;
            }
            for (; align > 1 && n % align; ++n, ++r)
                CHECK(o.idx[r] == -1 && o.rows[r * H] == 0.0 && o.probs[r] == 0.0, "pad row %lld",
                      (long long)r);
            CHECK(o.cnt[e] == n, "count of expert %lld", (long long)e);
        }
        CHECK(o.off[E] == r, "used rows %lld vs %lld", (long long)o.off[E], (long long)r);
        for (; r < o.R; ++r) CHECK(o.idx[r] == -1, "tail row %lld is padding", (long long)r);
        free_permuted(&o);
    }
}

/* Drop and pad with capacity > T: every block has all T tokens (routed first) then -1 rows. */
static void test_permute_drop_and_pad(void) {
    unsigned long long s = 11;
    enum { T = 6, E = 3, H = 2, CAP = 9 };
    uint8_t map[T * E];
    double x[T * H];
    random_map(map, T, E, 1, &s);
    for (int i = 0; i < T * H; ++i) x[i] = i + 1.0;
    permuted_t o = run_permute(x, map, NULL, T, H, E, CAP * E, 1, 0);
    CHECK(o.R == CAP * E, "rows %lld", (long long)o.R);
    for (int64_t e = 0; e < E; ++e) {
        int64_t r = e * CAP;
        for (int pass = 1; pass >= 0; --pass)
            for (int64_t t = 0; t < T; ++t)
                if (map[t * E + e] == pass) CHECK(o.idx[r++] == t, "expert %lld order", (long long)e);
        for (; r < (e + 1) * CAP; ++r) CHECK(o.idx[r] == -1 && o.rows[r * H] == 0.0, "pad");
        CHECK(o.cnt[e] == CAP, "count");
    }
    free_permuted(&o);
}

/* unpermute(permute(x)) without probs is count(t)·x[t]; with probs Σ_e p[t,e]·x[t]. The backward
 * of permute is the same gather. */
static void test_round_trip_and_gather(void) {
    unsigned long long s = 5;
    enum { T = 40, E = 8, K = 2, H = 3 };
    static uint8_t map[T * E];
    static double x[T * H], p[T * E], out[T * H], gx[T * H], gp[T * E];
    random_inputs(map, x, p, T, E, K, H, &s);
    permuted_t o = run_permute(x, map, p, T, H, E, T * K, 0, 4);
    size_t ws_bytes = moe_unpermute_workspace_size(T, o.R);
    void *ws = malloc(ws_bytes);
    CHECK(moe_unpermute_fwd(out, o.rows, o.idx, p, o.off, T, H, E, o.R, MOE_DTYPE_FP64,
                            MOE_DTYPE_FP64, ws, ws_bytes, NULL) == MOE_OK, "%s", moe_last_error());
    for (int64_t t = 0; t < T; ++t) {
        double w = 0.0;
        for (int64_t e = 0; e < E; ++e) w += p[t * E + e];
        for (int64_t h = 0; h < H; ++h)
            CHECK(fabs(out[t * H + h] - w * x[t * H + h]) < 1e-12, "combine t %lld", (long long)t);
    }
    CHECK(moe_permute_bwd(gx, gp, o.rows, o.probs, o.idx, o.off, T, H, E, o.R, MOE_DTYPE_FP64,
                          MOE_DTYPE_FP64, ws, ws_bytes, NULL) == MOE_OK, "%s", moe_last_error());
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h)
            CHECK(fabs(gx[t * H + h] - K * x[t * H + h]) < 1e-12, "grad tokens t %lld", (long long)t);
        for (int64_t e = 0; e < E; ++e) CHECK(gp[t * E + e] == p[t * E + e], "grad probs");
    }
    CHECK(moe_unpermute_fwd(out, o.rows, o.idx, p, o.off, T, H, E, o.R, MOE_DTYPE_FP64,
                            MOE_DTYPE_FP64, ws, ws_bytes - 8, NULL) == MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "workspace") != NULL,
          "short workspace rejected: %s", moe_last_error());
    free(ws);
    free_permuted(&o);
}

/* The layout-only permute (hidden = 0, no row buffers) writes the full mode's indices, probs,
 * offsets and counts bit for bit; the probs-only backward (hidden = 0) the full backward's
 * grad_probs. Over dropless, drop-and-pad (capacity below and above T), align_size > 1 and a row
 * bound below the routed count (rows cut off). */
static void test_permute_layout_only(void) {
    unsigned long long s = 13;
    enum { T = 37, E = 6, K = 2, H = 3 };
    static uint8_t map[T * E];
    static double x[T * H], p[T * E];
    random_inputs(map, x, p, T, E, K, H, &s);
    const struct { int64_t num_out; int dap; int64_t align; } cases[] = {
        {T * K, 0, 0},     /* dropless */
        {T * K, 0, 4},     /* aligned blocks */
        {T * K - 9, 0, 0}, /* a row bound below the routed count: the tail is cut off */
        {T * K - 9, 0, 8}, /* cut off, aligned */
        {5 * E, 1, 0},     /* drop and pad, capacity 5 < T */
        {45 * E, 1, 4},    /* capacity 45 > T, aligned to 48 */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        const moe_permute_params_t prm = {cases[c].num_out, cases[c].align, cases[c].dap};
        permuted_t full = run_permute(x, map, p, T, H, E, prm.num_out_tokens, prm.drop_and_pad,
                                      prm.align_size);
        const int64_t R = full.R;
        double *probs = malloc((size_t)(R + 1) * sizeof(double));
        int64_t *idx = malloc((size_t)(R + 1) * sizeof(int64_t));
        int64_t off[E + 1], cnt[E];
        for (int with_probs = 0; with_probs <= 1; ++with_probs) {
            memset(idx, 0x5a, (size_t)(R + 1) * sizeof(int64_t));
            memset(off, 0x5a, sizeof off), memset(cnt, 0x5a, sizeof cnt);
            CHECK(moe_permute_fwd(NULL, with_probs ? probs : NULL, idx, off, cnt, NULL, map,
                                  with_probs ? p : NULL, T, 0, E, MOE_DTYPE_FP64, MOE_DTYPE_FP64,
                                  &prm, NULL, 0, NULL) == MOE_OK,
                  "layout only, case %zu: %s", c, moe_last_error());
            CHECK(memcmp(idx, full.idx, (size_t)R * sizeof(int64_t)) == 0, "indices, case %zu", c);
            CHECK(memcmp(off, full.off, sizeof off) == 0, "offsets, case %zu", c);
            CHECK(memcmp(cnt, full.cnt, sizeof cnt) == 0, "counts, case %zu", c);
            CHECK(!with_probs || memcmp(probs, full.probs, (size_t)R * sizeof(double)) == 0,
                  "probs, case %zu", c);
        }
        /* the cut-off case really cuts: fewer rows than routed pairs */
        CHECK(c != 2 || full.off[E] == R, "case 2 fills its %lld rows", (long long)R);

        /* backward: grad_probs of the probs-only call == the full call's */
        size_t ws_bytes = moe_unpermute_workspace_size(T, R);
        void *ws = malloc(ws_bytes);
        double *g_rows = malloc((size_t)(R * H + 1) * sizeof(double));
        double *g_pp = malloc((size_t)(R + 1) * sizeof(double));
        static double gx[T * H], gp_full[T * E], gp_only[T * E];
        for (int64_t i = 0; i < R * H; ++i) g_rows[i] = ctest_rand_normal(&s);
        for (int64_t r = 0; r < R; ++r) g_pp[r] = full.idx[r] >= 0 ? ctest_rand_normal(&s) : 0.0;
        CHECK(moe_permute_bwd(gx, gp_full, g_rows, g_pp, full.idx, full.off, T, H, E, R,
                              MOE_DTYPE_FP64, MOE_DTYPE_FP64, ws, ws_bytes, NULL) == MOE_OK,
              "full backward, case %zu: %s", c, moe_last_error());
        memset(gp_only, 0x5a, sizeof gp_only);
        CHECK(moe_permute_bwd(NULL, gp_only, NULL, g_pp, full.idx, full.off, T, 0, E, R,
                              MOE_DTYPE_FP64, MOE_DTYPE_FP64, ws, ws_bytes, NULL) == MOE_OK,
              "probs-only backward, case %zu: %s", c, moe_last_error());
        CHECK(memcmp(gp_only, gp_full, sizeof gp_full) == 0, "grad_probs, case %zu", c);
        int64_t nonzero = 0;
        for (int64_t i = 0; i < T * E; ++i) nonzero += gp_full[i] != 0.0;
        CHECK(nonzero > 0, "case %zu: grad_probs has values to compare", c);
        free(g_pp), free(g_rows), free(ws), free(idx), free(probs);
        free_permuted(&full);
    }
}

/* hidden = 0 goes with NULL row buffers and nothing else: each inconsistent call names the
 * argument. */
static void test_bad_layout_only_args(void) {
    double x[4] = {0}, rows[8], pp[8], gp[4];
    uint8_t map[4] = {1, 0, 0, 1};
    int64_t idx[8] = {0, 1}, off[3] = {0, 1, 2}, cnt[2];
    const moe_permute_params_t p = {2, 0, 0};
    struct { void *out; const void *in; int64_t hidden; const char *msg; } fwd[] = {
        {rows, NULL, 0, "permuted_tokens must be NULL with hidden = 0"},
        {NULL, x, 0, "tokens must be NULL with hidden = 0"},
        {NULL, x, 2, "permuted_tokens must not be NULL with hidden=2"},
        {rows, NULL, 2, "tokens must not be NULL with hidden=2"},
        {NULL, NULL, -1, "hidden must be >= 0"},
    };
    for (size_t i = 0; i < sizeof fwd / sizeof fwd[0]; ++i)
        CHECK(moe_permute_fwd(fwd[i].out, NULL, idx, off, cnt, fwd[i].in, map, NULL, 2,
                              fwd[i].hidden, 2, MOE_DTYPE_FP64, MOE_DTYPE_FP64, &p, NULL, 0,
                              NULL) == MOE_ERR_INVALID_ARGUMENT &&
                  strstr(moe_last_error(), fwd[i].msg) != NULL,
              "forward case %zu: %s", i, moe_last_error());
    int64_t ws[16];
    struct { void *gt; void *gprobs; const void *grows; int64_t hidden; const char *msg; } bwd[] = {
        {x, gp, NULL, 0, "grad_tokens must be NULL with hidden = 0"},
        {NULL, gp, rows, 0, "grad_permuted_tokens must be NULL with hidden = 0"},
        {NULL, NULL, NULL, 0, "grad_probs must not be NULL with hidden = 0"},
        {NULL, gp, rows, 2, "grad_tokens must not be NULL with hidden=2"},
        {x, gp, NULL, 2, "grad_permuted_tokens must not be NULL with hidden=2"},
        {NULL, gp, NULL, -1, "hidden must be >= 0"},
    };
    for (size_t i = 0; i < sizeof bwd / sizeof bwd[0]; ++i)
        CHECK(moe_permute_bwd(bwd[i].gt, bwd[i].gprobs, bwd[i].grows, pp, idx, off, 2,
                              bwd[i].hidden, 2, 2, MOE_DTYPE_FP64, MOE_DTYPE_FP64, ws, sizeof ws,
                              NULL) == MOE_ERR_INVALID_ARGUMENT &&
                  strstr(moe_last_error(), bwd[i].msg) != NULL,
              "backward case %zu: %s", i, moe_last_error());
}

/* Position keeps the first capacity routed tokens; probs keeps the largest, ties to low index. */
static void test_token_dropping_rules(void) {
    enum { T = 8, E = 2 };
    uint8_t map[T * E], fmap[T * E];
    float p[T * E], fp[T * E];
    const float vals[T] = {0.1f, 0.5f, 0.3f, 0.5f, 0.9f, 0.2f, 0.5f, 0.0f};
    for (int t = 0; t < T; ++t) {
        map[t * E] = t >= 2;          /* expert 0: tokens 2..7 */
        map[t * E + 1] = t == 5;      /* expert 1: token 5 only */
        p[t * E] = map[t * E] ? vals[t] : 0.0f;
        p[t * E + 1] = map[t * E + 1] ? 0.25f : 0.0f;
    }
    CHECK(moe_token_dropping_fwd(fp, fmap, p, map, T, E, 3, MOE_DROP_POSITION, 0, MOE_DTYPE_FP32,
                                 NULL, 0, NULL) == MOE_OK, "%s", moe_last_error());
    for (int t = 0; t < T; ++t) CHECK(fmap[t * E] == (t >= 2 && t <= 4), "position t %d", t);
    CHECK(fmap[5 * E + 1] == 1 && fmap[0 * E + 1] == 0, "short column keeps its token, no filler");
    CHECK(moe_token_dropping_fwd(fp, fmap, p, map, T, E, 3, MOE_DROP_POSITION, 1, MOE_DTYPE_FP32,
                                 NULL, 0, NULL) == MOE_OK, "%s", moe_last_error());
    CHECK(fmap[0 * E + 1] && fmap[1 * E + 1] && fmap[5 * E + 1] && !fmap[2 * E + 1],
          "pad fills with the first unrouted tokens");
    CHECK(fp[0 * E + 1] == 0.0f && fp[5 * E + 1] == 0.25f, "filler probs are zero");
    size_t ws_bytes = moe_token_dropping_workspace_size(T, E, MOE_DROP_PROBS, MOE_DTYPE_FP32);
    void *ws = malloc(ws_bytes);
    CHECK(moe_token_dropping_fwd(fp, fmap, p, map, T, E, 3, MOE_DROP_PROBS, 0, MOE_DTYPE_FP32, ws,
                                 ws_bytes, NULL) == MOE_OK, "%s", moe_last_error());
    /* 0.9 (t4), then the 0.5s at t3 and t6: t1 has 0.5 in no column 0 route (prob 0 there) */
    for (int t = 0; t < T; ++t) CHECK(fmap[t * E] == (t == 4 || t == 3 || t == 6), "probs t %d", t);
    CHECK(moe_token_dropping_fwd(fp, fmap, p, map, T, E, 3, MOE_DROP_PROBS, 0, MOE_DTYPE_FP32, ws,
                                 0, NULL) == MOE_ERR_INVALID_ARGUMENT, "workspace checked");
    free(ws);
}

static void test_sort_chunks(void) {
    enum { ROWS = 10, W = 3, C = 4 };
    const int64_t sizes[C] = {3, 0, 5, 2}, order[C] = {2, 3, 1, 0};
    float in[ROWS * W], out[ROWS * W], back[ROWS * W];
    for (int i = 0; i < ROWS * W; ++i) in[i] = (float)i;
    CHECK(moe_sort_chunks_by_idxs_fwd(out, in, sizes, order, ROWS, W, C, MOE_DTYPE_FP32, NULL, 0,
                                      NULL) == MOE_OK, "%s", moe_last_error());
    const int expect_rows[ROWS] = {3, 4, 5, 6, 7, 8, 9, 0, 1, 2};
    for (int r = 0; r < ROWS; ++r) CHECK(out[r * W] == (float)(expect_rows[r] * W), "row %d", r);
    CHECK(moe_sort_chunks_by_idxs_bwd(back, out, sizes, order, ROWS, W, C, MOE_DTYPE_FP32, NULL, 0,
                                      NULL) == MOE_OK, "%s", moe_last_error());
    CHECK(memcmp(back, in, sizeof in) == 0, "backward inverts the forward");
    const int64_t dup[C] = {2, 2, 1, 0};
    CHECK(moe_sort_chunks_by_idxs_fwd(out, in, sizes, dup, ROWS, W, C, MOE_DTYPE_FP32, NULL, 0,
                                      NULL) == MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "sorted_idxs") != NULL,
          "duplicate rejected: %s", moe_last_error());
    CHECK(moe_sort_chunks_by_idxs_fwd(out, in, sizes, order, ROWS + 1, W, C, MOE_DTYPE_FP32, NULL,
                                      0, NULL) == MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "split_sizes") != NULL,
          "bad sum rejected: %s", moe_last_error());
}

static void test_bad_layout_args(void) {
    double x[4] = {0}, rows[8];
    uint8_t map[4] = {1, 0, 0, 1};
    int64_t idx[8], off[3], cnt[2];
    moe_permute_params_t p = {-1, 0, 0};
    CHECK(moe_permute_fwd(rows, NULL, idx, off, cnt, x, map, NULL, 2, 2, 2, MOE_DTYPE_FP64,
                          MOE_DTYPE_FP64, &p, NULL, 0, NULL) == MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "num_out_tokens") != NULL,
          "negative num_out_tokens: %s", moe_last_error());
    CHECK(moe_permute_num_rows(2, 2, &p) == -1, "num_rows of bad params is -1");
    int64_t bad_idx[2] = {0, 5};
    int64_t ws[8];
    CHECK(moe_unpermute_fwd(x, rows, bad_idx, NULL, NULL, 2, 1, 1, 2, MOE_DTYPE_FP64,
                            MOE_DTYPE_FP64, ws, sizeof ws, NULL) == MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "sorted_indices[1] = 5") != NULL,
          "index out of range: %s", moe_last_error());
}

/* Index math is int64: a row offset past 2^31 elements. The helper is exact, and unpermute reads
 * the right rows out of a buffer of 2^31 + 3·2^19 bf16 elements, of which only the last three rows
 * are touched (calloc maps zero pages lazily); skipped with a note where the OS refuses 4 GiB. */
static void test_int64_offsets(void) {
    const int64_t H = (int64_t)1 << 19, R = ((int64_t)1 << 12) + 3;
    CHECK(moe_row_ptr((void *)0, R - 1, H, 2) == (char *)0 + (size_t)((R - 1) * H) * 2,
          "row pointer past 2^32 bytes");
    CHECK((size_t)((R - 1) * H) * 2 > ((size_t)1 << 32), "the offset really is past 2^32 bytes");
    uint16_t *big = calloc((size_t)(R * H), sizeof(uint16_t));
    if (!big) {
        fprintf(stderr, "note: 4 GiB calloc refused; int64 unpermute case not run\n");
        return;
    }
    int64_t *idx = malloc((size_t)R * sizeof(int64_t));
    for (int64_t r = 0; r < R; ++r) idx[r] = -1;
    for (int64_t j = 0; j < 3; ++j) {
        idx[R - 3 + j] = 2 - j;
        for (int64_t h = 0; h < H; h += 4099) big[(R - 3 + j) * H + h] = moe_float_to_bf16((float)(j + 1));
    }
    uint16_t *out = malloc((size_t)(3 * H) * sizeof(uint16_t));
    size_t ws_bytes = moe_unpermute_workspace_size(3, R);
    void *ws = malloc(ws_bytes);
    CHECK(moe_unpermute_fwd(out, big, idx, NULL, NULL, 3, H, 1, R, MOE_DTYPE_BF16, MOE_DTYPE_BF16,
                            ws, ws_bytes, NULL) == MOE_OK, "%s", moe_last_error());
    int ok = 1;
    for (int64_t t = 0; t < 3; ++t)
        for (int64_t h = 0; h < H; ++h) {
            float want = h % 4099 == 0 ? (float)(2 - t + 1) : 0.0f;
            ok &= moe_bf16_to_float(out[t * H + h]) == want;
        }
    CHECK(ok, "unpermute gathered the rows past 2^31 elements");
    free(ws), free(out), free(idx), free(big);
}

void ctest_register_layout(void) {
    ctest_add("permute_dropless_order", test_permute_dropless_order);
    ctest_add("permute_drop_and_pad", test_permute_drop_and_pad);
    ctest_add("round_trip_and_gather", test_round_trip_and_gather);
    ctest_add("permute_layout_only", test_permute_layout_only);
    ctest_add("bad_layout_only_args", test_bad_layout_only_args);
    ctest_add("token_dropping_rules", test_token_dropping_rules);
    ctest_add("sort_chunks", test_sort_chunks);
    ctest_add("bad_layout_args", test_bad_layout_args);
    ctest_add("int64_offsets", test_int64_offsets);
}
