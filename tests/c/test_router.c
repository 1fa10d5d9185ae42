/* test_router.c: router_topk and router_gating_linear against brute-force C references. */
#include <stdlib.h>
#include <string.h>

#include "moe_core.h"
#include "ctest.h"

static moe_router_topk_params_t params(int64_t topk, int sf, int pre, int64_t groups, int64_t gk,
                                       double scale) {
    moe_router_topk_params_t p = {topk, groups, gk, pre, (moe_score_function_t)sf, scale,
                                  MOE_TOPK_NORM_DEFAULT, 0};
    return p;
}

static moe_status_t run_fwd(double *probs, int64_t *idx, const double *logits, const float *bias,
                            int64_t T, int64_t E, const moe_router_topk_params_t *p) {
    size_t ws = moe_router_topk_workspace_size(T, E, p);
    void *w = malloc(ws ? ws : 1);
    moe_status_t st = moe_router_topk_fwd(probs, idx, logits, bias, T, E, MOE_DTYPE_FP64, p, w, ws, NULL);
    free(w);
    return st;
}

/* Reference: rank every expert by (value desc, index asc) with a selection sort. */
static void ref_topk(const double *v, int64_t E, int64_t k, int64_t *out) {
    char used[1024] = {0};
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
            if (!used[e] && (best < 0 || v[e] > v[best])) best = e;
        used[best] = 1;
        out[j] = best;
    }
}

static void test_topk_matches_reference(void) {
    unsigned long long s = 42;
    enum { T = 64, E = 48, K = 6 };
    static double logits[T * E], probs[T * K];
    static int64_t idx[T * K];
    static float bias[E];
    for (int i = 0; i < T * E; ++i) logits[i] = ctest_rand_normal(&s);
    for (int e = 0; e < E; ++e) bias[e] = (float)(0.1 * ctest_rand_normal(&s));
    for (int sf = 0; sf < 3; ++sf) {
        for (int pre = 0; pre < 2; ++pre) {
            moe_router_topk_params_t p = params(K, sf, pre, 0, 0, 2.5);
            const float *b = sf ? bias : NULL;
            CHECK(run_fwd(probs, idx, logits, b, T, E, &p) == MOE_OK, "%s", moe_last_error());
            for (int t = 0; t < T; ++t) {
                double score[E], sel[E], m = -INFINITY, sum = 0.0;
                const double *x = logits + t * E;
                for (int e = 0; e < E; ++e) m = x[e] > m ? x[e] : m;
                for (int e = 0; e < E; ++e) sum += exp(x[e] - m);
                for (int e = 0; e < E; ++e) {
                    if (sf == 0) score[e] = pre ? exp(x[e] - m) / sum : x[e];
                    else if (sf == 1) score[e] = 1.0 / (1.0 + exp(-x[e]));
                    else score[e] = sqrt(log1p(exp(x[e])));
                    sel[e] = score[e] + (sf ? bias[e] : 0.0);
                }
                int64_t want[K];
                ref_topk(sel, E, K, want);
                double pw[K], tot = 0.0, mx = score[want[0]];
                for (int j = 0; j < K; ++j) {
                    CHECK(idx[t * K + j] == want[j], "sf %d pre %d t %d j %d: %lld vs %lld", sf, pre, t, j,
                          (long long)idx[t * K + j], (long long)want[j]);
                    pw[j] = (sf == 0 && !pre) ? exp(score[want[j]] - mx) : score[want[j]];
                    tot += pw[j];
                }
                for (int j = 0; j < K; ++j) {
                    double ref = 2.5 * ((sf == 0 && pre) ? pw[j] : pw[j] / tot);
                    CHECK(fabs(probs[t * K + j] - ref) < 1e-12, "prob %g vs %g", probs[t * K + j], ref);
                }
            }
        }
    }
}

static void test_ties_go_to_lowest_index(void) {
    double logits[2 * 8] = {0}, probs[2 * 3];
    int64_t idx[2 * 3];
    for (int e = 0; e < 8; ++e) logits[8 + e] = (e == 5 || e == 2) ? 1.0 : 0.0; /* row 1: two 1s */
    moe_router_topk_params_t p = params(3, MOE_SCORE_SOFTMAX, 0, 0, 0, 0.0);
    CHECK(run_fwd(probs, idx, logits, NULL, 2, 8, &p) == MOE_OK, "%s", moe_last_error());
    CHECK(idx[0] == 0 && idx[1] == 1 && idx[2] == 2, "all equal: %lld %lld %lld", (long long)idx[0],
          (long long)idx[1], (long long)idx[2]);
    CHECK(idx[3] == 2 && idx[4] == 5 && idx[5] == 0, "ties then lowest: %lld %lld %lld",
          (long long)idx[3], (long long)idx[4], (long long)idx[5]);
}

static void test_nan_ranks_first(void) {
    double logits[6] = {0.1, 0.5, NAN, 0.2, 0.3, 0.0}, probs[2];
    int64_t idx[2];
    moe_router_topk_params_t p = params(2, MOE_SCORE_SIGMOID, 0, 0, 0, 0.0);
    CHECK(run_fwd(probs, idx, logits, NULL, 1, 6, &p) == MOE_OK, "%s", moe_last_error());
    CHECK(idx[0] == 2 && idx[1] == 1, "NaN first, then the largest: %lld %lld", (long long)idx[0],
          (long long)idx[1]);
    CHECK(isnan(probs[0]) && isnan(probs[1]), "NaN propagates into the row's probs");
}

static void test_group_limited(void) {
    /* 8 experts in 4 groups of 2; group_topk 2, topk 4 → group score = sum of top 2 of its pair.
     * Group sums: g0 = 0.9+0.1 = 1.0, g1 = 0.8+0.7 = 1.5, g2 = 0.95+0 = 0.95, g3 = 0.6+0.5 = 1.1:
     * keep g1 and g3, although expert 4 (0.95, in g2) is the second-best single expert. */
    double logits[8] = {0.9, 0.1, 0.8, 0.7, 0.95, 0.0, 0.6, 0.5}, probs[4];
    int64_t idx[4];
    moe_router_topk_params_t p = params(4, MOE_SCORE_SOFTMAX, 0, 4, 2, 0.0);
    CHECK(run_fwd(probs, idx, logits, NULL, 1, 8, &p) == MOE_OK, "%s", moe_last_error());
    CHECK(idx[0] == 2 && idx[1] == 3 && idx[2] == 6 && idx[3] == 7, "kept groups 1 and 3: %lld %lld %lld %lld",
          (long long)idx[0], (long long)idx[1], (long long)idx[2], (long long)idx[3]);
}

static void test_invalid_params(void) {
    struct { moe_router_topk_params_t p; int64_t E; int bias; const char *needle; } cases[] = {
        {params(0, 0, 0, 0, 0, 0), 8, 0, "topk must be in"},
        {params(2, 0, 0, 3, 1, 0), 8, 0, "divisible by num_groups=3"},
        {params(2, 0, 0, 4, 5, 0), 8, 0, "group_topk must be in [1, num_groups=4]"},
        {params(6, 0, 0, 4, 2, 0), 8, 0, "exceeds the experts in the kept groups"},
        {params(2, 0, 0, 0, 0, 0), 8, 1, "expert_bias"},
        {params(2, 7, 0, 0, 0, 0), 8, 0, "score_function"},
        {params(2, 0, 0, 0, 2, 0), 8, 0, "num_groups must be >= 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        moe_status_t st = moe_router_topk_check(&cases[i].p, cases[i].E, cases[i].bias);
        CHECK(st == MOE_ERR_INVALID_ARGUMENT && strstr(moe_last_error(), cases[i].needle),
              "case %zu: status %d, message '%s'", i, (int)st, moe_last_error());
    }
}

/* The backward equals central finite differences of Σ w·probs in fp64. */
static void test_backward_finite_differences(void) {
    unsigned long long s = 7;
    enum { T = 5, E = 12, K = 3 };
    double logits[T * E], w[T * K], probs[T * K], grad[T * E];
    int64_t idx[T * K], idx2[T * K];
    for (int i = 0; i < T * E; ++i) logits[i] = ctest_rand_normal(&s);
    for (int i = 0; i < T * K; ++i) w[i] = ctest_rand_normal(&s);
    for (int sf = 0; sf < 3; ++sf) {
        for (int pre = 0; pre < 2; ++pre) {
            moe_router_topk_params_t p = params(K, sf, pre, 0, 0, 1.5);
            run_fwd(probs, idx, logits, NULL, T, E, &p);
            size_t ws = moe_router_topk_workspace_size(T, E, &p);
            void *wk = malloc(ws);
            CHECK(moe_router_topk_bwd(grad, w, logits, idx, T, E, MOE_DTYPE_FP64, &p, wk, ws, NULL) == MOE_OK,
                  "%s", moe_last_error());
            free(wk);
            for (int i = 0; i < T * E; ++i) {
                double h = 1e-6, save = logits[i], fp = 0, fm = 0;
                logits[i] = save + h;
                run_fwd(probs, idx2, logits, NULL, T, E, &p);
                for (int j = 0; j < T * K; ++j) fp += w[j] * probs[j];
                logits[i] = save - h;
                run_fwd(probs, idx2, logits, NULL, T, E, &p);
                for (int j = 0; j < T * K; ++j) fm += w[j] * probs[j];
                logits[i] = save;
                double fd = (fp - fm) / (2 * h);
                CHECK(fabs(fd - grad[i]) < 1e-6, "sf %d pre %d i %d: fd %g vs %g", sf, pre, i, fd, grad[i]);
            }
        }
    }
}

/* The rules beyond Megatron's: a params struct with norm / group_score_topk set. */
static moe_router_topk_params_t params_x(int64_t topk, int sf, int pre, int64_t groups, int64_t gk,
                                         moe_topk_norm_t norm, int64_t group_score_topk) {
    moe_router_topk_params_t p = params(topk, sf, pre, groups, gk, 0.0);
    p.norm = norm;
    p.group_score_topk = group_score_topk;
    return p;
}

static void test_invalid_rule_params(void) {
    struct { moe_router_topk_params_t p; int bias; const char *needle; } cases[] = {
        {params_x(2, 1, 0, 0, 0, (moe_topk_norm_t)3, 0), 0, "norm must be default (0), none (1) or sum (2), got 3"},
        {params_x(2, 0, 0, 0, 0, MOE_TOPK_NORM_SUM, 0), 0, "norm=2: softmax without use_pre_softmax"},
        {params_x(2, 0, 0, 0, 0, MOE_TOPK_NORM_NONE, 0), 0, "norm=1: softmax without use_pre_softmax"},
        {params_x(2, 1, 0, 0, 0, MOE_TOPK_NORM_DEFAULT, 2), 0, "group_score_topk=2 needs group-limited"},
        {params_x(2, 1, 0, 4, 2, MOE_TOPK_NORM_DEFAULT, 3), 0, "group_score_topk=3 exceeds the 2 experts"},
        {params_x(2, 1, 0, 4, 2, MOE_TOPK_NORM_DEFAULT, -1), 0, "group_score_topk must be >= 0"},
        {params_x(2, 0, 0, 0, 0, MOE_TOPK_NORM_DEFAULT, 0), 1, "needs use_pre_softmax"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        moe_status_t st = moe_router_topk_check(&cases[i].p, 8, cases[i].bias);
        CHECK(st == MOE_ERR_INVALID_ARGUMENT && strstr(moe_last_error(), cases[i].needle),
              "case %zu: status %d, message '%s'", i, (int)st, moe_last_error());
    }
    /* accepted: softmax-pre with a bias; a group score beyond topk (the scratch grows for it) */
    moe_router_topk_params_t ok = params_x(2, 0, 1, 0, 0, MOE_TOPK_NORM_SUM, 0);
    CHECK(moe_router_topk_check(&ok, 8, 1) == MOE_OK, "%s", moe_last_error());
    ok = params_x(1, 1, 0, 2, 1, MOE_TOPK_NORM_NONE, 4);
    CHECK(moe_router_topk_check(&ok, 8, 0) == MOE_OK, "%s", moe_last_error());
}

static void test_group_score_rules(void) {
    /* the example of test_group_limited: a group's max picks groups 2 and 0 (0.95, 0.9), the
     * Megatron sum of the top 2 picks groups 1 and 3 */
    double logits[8] = {0.9, 0.1, 0.8, 0.7, 0.95, 0.0, 0.6, 0.5}, probs[4];
    int64_t idx[4];
    moe_router_topk_params_t p = params_x(4, MOE_SCORE_SOFTMAX, 0, 4, 2, MOE_TOPK_NORM_DEFAULT, 1);
    CHECK(run_fwd(probs, idx, logits, NULL, 1, 8, &p) == MOE_OK, "%s", moe_last_error());
    CHECK(idx[0] == 4 && idx[1] == 0 && idx[2] == 1 && idx[3] == 5, "max: %lld %lld %lld %lld",
          (long long)idx[0], (long long)idx[1], (long long)idx[2], (long long)idx[3]);
    /* top-1 routing, 2 groups of 4 scored by their top-4 sum (a list longer than topk: the row
     * scratch grows for it): 1.57 (g0) < 2.05 (g1) keeps group 1 and its expert 4, where the
     * Megatron rule (top 1 // 1 = the max: 0.97 > 0.95) would keep group 0 */
    moe_router_topk_params_t q = params_x(1, MOE_SCORE_SOFTMAX, 0, 2, 1, MOE_TOPK_NORM_DEFAULT, 4);
    double l2[8] = {0.97, 0.1, 0.2, 0.3, 0.95, 0.0, 0.6, 0.5};
    CHECK(run_fwd(probs, idx, l2, NULL, 1, 8, &q) == MOE_OK, "%s", moe_last_error());
    CHECK(idx[0] == 4, "top-4 sums keep group 1: %lld", (long long)idx[0]);
    q.group_score_topk = 0;
    CHECK(run_fwd(probs, idx, l2, NULL, 1, 8, &q) == MOE_OK, "%s", moe_last_error());
    CHECK(idx[0] == 0, "the group max keeps group 0: %lld", (long long)idx[0]);
}

/* The backward of the new rules equals central finite differences of Σ w·probs in fp64. */
static void test_rule_backward_finite_differences(void) {
    unsigned long long s = 11;
    enum { T = 4, E = 12, K = 3 };
    double logits[T * E], w[T * K], probs[T * K], grad[T * E];
    int64_t idx[T * K], idx2[T * K];
    float bias[E];
    for (int i = 0; i < T * E; ++i) logits[i] = ctest_rand_normal(&s);
    for (int i = 0; i < T * K; ++i) w[i] = ctest_rand_normal(&s);
    for (int e = 0; e < E; ++e) bias[e] = (float)(0.02 * ctest_rand_normal(&s));
    struct { int sf, pre; moe_topk_norm_t norm; int k; int bias; } cases[] = {
        {MOE_SCORE_SIGMOID, 0, MOE_TOPK_NORM_NONE, K, 1},
        {MOE_SCORE_SQRTSOFTPLUS, 0, MOE_TOPK_NORM_NONE, K, 0},
        {MOE_SCORE_SIGMOID, 0, MOE_TOPK_NORM_SUM, 1, 0},
        {MOE_SCORE_SOFTMAX, 1, MOE_TOPK_NORM_SUM, K, 1},
        {MOE_SCORE_SOFTMAX, 1, MOE_TOPK_NORM_DEFAULT, K, 1},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        const int k = cases[c].k;
        const float *b = cases[c].bias ? bias : NULL;
        moe_router_topk_params_t p = params_x(k, cases[c].sf, cases[c].pre, 4, 2, cases[c].norm,
                                              1);
        p.scaling_factor = 1.5;
        CHECK(run_fwd(probs, idx, logits, b, T, E, &p) == MOE_OK, "%s", moe_last_error());
        size_t ws = moe_router_topk_workspace_size(T, E, &p);
        void *wk = malloc(ws);
        CHECK(moe_router_topk_bwd(grad, w, logits, idx, T, E, MOE_DTYPE_FP64, &p, wk, ws, NULL) ==
                  MOE_OK, "%s", moe_last_error());
        free(wk);
        for (int i = 0; i < T * E; ++i) {
            double h = 1e-6, save = logits[i], fp = 0, fm = 0;
            logits[i] = save + h;
            run_fwd(probs, idx2, logits, b, T, E, &p);
            for (int j = 0; j < T * k; ++j) fp += w[j] * probs[j];
            logits[i] = save - h;
            run_fwd(probs, idx2, logits, b, T, E, &p);
            for (int j = 0; j < T * k; ++j) fm += w[j] * probs[j];
            logits[i] = save;
            double fd = (fp - fm) / (2 * h);
            CHECK(fabs(fd - grad[i]) < 1e-6, "case %zu i %d: fd %g vs %g", c, i, fd, grad[i]);
        }
    }
}

static void test_gating_linear(void) {
    unsigned long long s = 3;
    enum { T = 7, H = 70, E = 5 };
    float inp[T * H], w[E * H], b[E], out[T * E], gl[T * E], gi[T * H], gw[E * H], gb[E];
    for (int i = 0; i < T * H; ++i) inp[i] = (float)ctest_rand_normal(&s);
    for (int i = 0; i < E * H; ++i) w[i] = (float)ctest_rand_normal(&s);
    for (int i = 0; i < E; ++i) b[i] = (float)ctest_rand_normal(&s);
    for (int i = 0; i < T * E; ++i) gl[i] = (float)ctest_rand_normal(&s);
    CHECK(moe_router_gating_linear_fwd(out, inp, w, b, T, H, E, MOE_DTYPE_FP32, MOE_DTYPE_FP32,
                                       MOE_DTYPE_FP32, NULL, 0, NULL) == MOE_OK, "%s", moe_last_error());
    CHECK(moe_router_gating_linear_bwd(gi, gw, gb, gl, inp, w, T, H, E, MOE_DTYPE_FP32, MOE_DTYPE_FP32,
                                       MOE_DTYPE_FP32, NULL, 0, NULL) == MOE_OK, "%s", moe_last_error());
    for (int t = 0; t < T; ++t)
        for (int e = 0; e < E; ++e) {
            double acc = 0;
            for (int h = 0; h < H; ++h) acc += (double)inp[t * H + h] * w[e * H + h];
            acc = (float)acc;
            CHECK(fabs(out[t * E + e] - (acc + b[e])) <= 1e-6 * (1 + fabs(acc)), "logit %d %d", t, e);
        }
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
            double acc = 0;
            for (int e = 0; e < E; ++e) acc += (double)gl[t * E + e] * w[e * H + h];
            CHECK(gi[t * H + h] == (float)acc, "grad_inp %d %d", t, h);
        }
    for (int e = 0; e < E; ++e) {
        double acc = 0;
        for (int t = 0; t < T; ++t) acc += gl[t * E + e];
        CHECK(gb[e] == (float)acc, "grad_bias %d", e);
        for (int h = 0; h < H; ++h) {
            double a2 = 0;
            for (int t = 0; t < T; ++t) a2 += (double)gl[t * E + e] * inp[t * H + h];
            CHECK(gw[e * H + h] == (float)a2, "grad_weight %d %d", e, h);
        }
    }
    CHECK(moe_router_gating_linear_fwd(out, inp, w, b, T, 0, E, MOE_DTYPE_FP32, MOE_DTYPE_FP32,
                                       MOE_DTYPE_FP32, NULL, 0, NULL) == MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "hidden"), "hidden = 0 rejected: %s", moe_last_error());
}

static void test_topk_to_dense_round_trip(void) {
    float tp[4] = {0.25f, 0.75f, 0.5f, 0.5f}, dense[2 * 5], back[4];
    int64_t ti[4] = {3, 0, 1, 4};
    uint8_t map[2 * 5];
    CHECK(moe_topk_to_dense_fwd(dense, map, tp, ti, 2, 5, 2, MOE_DTYPE_FP32, NULL, 0, NULL) == MOE_OK, "fwd");
    float want[10] = {0.75f, 0, 0, 0.25f, 0, 0, 0.5f, 0, 0, 0.5f};
    for (int i = 0; i < 10; ++i) {
        CHECK(dense[i] == want[i], "dense %d", i);
        CHECK(map[i] == (want[i] != 0), "map %d", i);
    }
    CHECK(moe_topk_to_dense_bwd(back, dense, ti, 2, 5, 2, MOE_DTYPE_FP32, NULL, 0, NULL) == MOE_OK, "bwd");
    for (int i = 0; i < 4; ++i) CHECK(back[i] == tp[i], "gather %d", i);
    ti[2] = 5;
    CHECK(moe_topk_to_dense_fwd(dense, map, tp, ti, 2, 5, 2, MOE_DTYPE_FP32, NULL, 0, NULL) ==
              MOE_ERR_INVALID_ARGUMENT && strstr(moe_last_error(), "topk_indices[1, 0] = 5"),
          "out-of-range index named: %s", moe_last_error());
}

void ctest_register_router(void) {
    ctest_add("topk_matches_reference", test_topk_matches_reference);
    ctest_add("ties_go_to_lowest_index", test_ties_go_to_lowest_index);
    ctest_add("nan_ranks_first", test_nan_ranks_first);
    ctest_add("group_limited", test_group_limited);
    ctest_add("invalid_params", test_invalid_params);
    ctest_add("backward_finite_differences", test_backward_finite_differences);
    ctest_add("invalid_rule_params", test_invalid_rule_params);
    ctest_add("group_score_rules", test_group_score_rules);
    ctest_add("rule_backward_finite_differences", test_rule_backward_finite_differences);
    ctest_add("gating_linear", test_gating_linear);
    ctest_add("topk_to_dense_round_trip", test_topk_to_dense_round_trip);
}
