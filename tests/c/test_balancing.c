/* test_balancing.c: the load-balancing kernels against brute-force C references. */
#include <stdlib.h>
#include <string.h>

#include "moe_core.h"
#include "ctest.h"

#ifdef _OPENMP
#include <omp.h>
#endif

enum { T = 24, E = 6, K = 2 };

static void fill_normal(double *x, int n, unsigned long long seed, double scale) {
    unsigned long long s = seed;
    for (int i = 0; i < n; ++i) x[i] = scale * ctest_rand_normal(&s);
}

/* Reference scores of one row in fp64 (no rounding). */
static void ref_scores(const double *x, int sf, double *out) {
    double m = -INFINITY, sum = 0.0;
    for (int e = 0; e < E; ++e) m = x[e] > m ? x[e] : m;
    for (int e = 0; e < E; ++e) {
        out[e] = sf == 0 ? exp(x[e] - m) : sf == 1 ? 1.0 / (1.0 + exp(-x[e])) : sqrt(log1p(exp(x[e])));
        sum += out[e];
    }
    for (int e = 0; e < E; ++e) out[e] /= sf == 0 ? sum : sum + 1e-20;
}

static moe_status_t scores_fwd(double *scores, uint8_t *map, const double *logits,
                               const uint8_t *pad, int64_t n, int sf) {
    size_t ws = moe_aux_loss_scores_workspace_size(n, E, K);
    void *w = malloc(ws);
    moe_status_t st = moe_aux_loss_scores_fwd(scores, map, logits, pad, n, E, K, MOE_DTYPE_FP64,
                                              (moe_score_function_t)sf, w, ws, NULL);
    free(w);
    return st;
}

static void test_aux_scores_forward(void) {
    static double logits[T * E], scores[T * E];
    static uint8_t map[T * E], pad[T];
    fill_normal(logits, T * E, 7, 2.0);
    for (int t = 0; t < T; ++t) pad[t] = t % 5 == 3;
    for (int sf = 0; sf < 3; ++sf) {
        CHECK(scores_fwd(scores, map, logits, pad, T, sf) == MOE_OK, "%s", moe_last_error());
        for (int t = 0; t < T; ++t) {
            double ref[E];
            ref_scores(logits + t * E, sf, ref);
            int count = 0;
            for (int e = 0; e < E; ++e) {
                double want = pad[t] ? 0.0 : ref[e];
                CHECK(fabs(scores[t * E + e] - want) < 1e-14, "sf %d t %d e %d: %g vs %g", sf, t, e,
                      scores[t * E + e], want);
                count += map[t * E + e];
                /* a mapped expert beats every unmapped one */
                for (int f = 0; f < E; ++f)
                    if (map[t * E + e] && !map[t * E + f])
                        CHECK(ref[e] >= ref[f], "sf %d t %d: %d mapped over %d", sf, t, e, f);
            }
            CHECK(count == (pad[t] ? 0 : K), "sf %d t %d: %d experts mapped", sf, t, count);
        }
    }
}

static void test_aux_scores_backward_finite_differences(void) {
    enum { N = 3 };
    double logits[N * E], w[N * E], grad[N * E], s[N * E], sp[N * E];
    uint8_t map[N * E];
    fill_normal(logits, N * E, 11, 1.5);
    fill_normal(w, N * E, 12, 1.0);
    for (int sf = 0; sf < 3; ++sf) {
        CHECK(moe_aux_loss_scores_bwd(grad, w, logits, NULL, N, E, MOE_DTYPE_FP64,
                                      (moe_score_function_t)sf, NULL, 0, NULL) == MOE_OK,
              "%s", moe_last_error());
        for (int i = 0; i < N * E; ++i) {
            const double h = 1e-6, keep = logits[i];
            double up = 0.0, down = 0.0;
            logits[i] = keep + h;
            scores_fwd(sp, map, logits, NULL, N, sf);
            logits[i] = keep - h;
            scores_fwd(s, map, logits, NULL, N, sf);
            logits[i] = keep;
            for (int j = 0; j < N * E; ++j) {
                up += w[j] * sp[j];
                down += w[j] * s[j];
            }
            double fd = (up - down) / (2 * h);
            CHECK(fabs(grad[i] - fd) < 1e-7, "sf %d i %d: %g vs fd %g", sf, i, grad[i], fd);
        }
    }
}

static void test_switch_loss(void) {
    double probs[T * E], loss = 0.0, grad[T * E], g = 2.0, total = 40.0;
    float counts[E];
    uint8_t pad[T];
    fill_normal(probs, T * E, 3, 1.0);
    for (int e = 0; e < E; ++e) counts[e] = (float)(e * 3 + 1);
    for (int t = 0; t < T; ++t) pad[t] = t % 4 == 0;
    moe_switch_aux_loss_params_t p = {K, E, 0.25};
    size_t ws = moe_switch_aux_loss_workspace_size(T, E);
    void *w = malloc(ws);
    CHECK(moe_switch_aux_loss_fwd(&loss, probs, counts, &total, pad, T, E, MOE_DTYPE_FP64, &p, w,
                                  ws, NULL) == MOE_OK, "%s", moe_last_error());
    double ref = 0.0;
    for (int t = 0; t < T; ++t)
        for (int e = 0; e < E; ++e)
            if (!pad[t]) ref += probs[t * E + e] * counts[e];
    ref *= E * 0.25 / (K * total * total);
    CHECK(fabs(loss - ref) < 1e-14 * fabs(ref) + 1e-16, "loss %g vs %g", loss, ref);
    CHECK(moe_switch_aux_loss_bwd(grad, &g, counts, &total, pad, T, E, MOE_DTYPE_FP64, &p, NULL, 0,
                                  NULL) == MOE_OK, "%s", moe_last_error());
    for (int t = 0; t < T; ++t)
        for (int e = 0; e < E; ++e) {
            double want = pad[t] ? 0.0 : g * counts[e] * E * 0.25 / (K * total * total);
            CHECK(fabs(grad[t * E + e] - want) < 1e-15, "grad %d %d", t, e);
        }
    CHECK(moe_switch_aux_loss_fwd(&loss, probs, counts, &total, pad, T, E, MOE_DTYPE_FP64, &p, w,
                                  ws - 1, NULL) == MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "workspace too small"),
          "short workspace named: %s", moe_last_error());
    free(w);
}

static void test_z_loss(void) {
    double logits[T * E], loss = 0.0, grad[T * E], g = 1.0;
    uint8_t pad[T];
    fill_normal(logits, T * E, 5, 3.0);
    for (int t = 0; t < T; ++t) pad[t] = t % 3 == 1;
    size_t ws = moe_z_loss_workspace_size(T, E);
    void *w = malloc(ws);
    CHECK(moe_z_loss_fwd(&loss, logits, pad, T, E, 0.1, MOE_DTYPE_FP64, w, ws, NULL) == MOE_OK,
          "%s", moe_last_error());
    double ref = 0.0;
    int n = 0;
    for (int t = 0; t < T; ++t) {
        if (pad[t]) continue;
        double sum = 0.0;
        for (int e = 0; e < E; ++e) sum += exp(logits[t * E + e]);
        ref += log(sum) * log(sum);
        ++n;
    }
    ref = ref / n * 0.1;
    CHECK(fabs(loss - ref) < 1e-13 * ref, "z %g vs %g", loss, ref);
    CHECK(moe_z_loss_bwd(grad, &g, logits, pad, T, E, 0.1, MOE_DTYPE_FP64, NULL, 0, NULL) == MOE_OK,
          "%s", moe_last_error());
    for (int i = 0; i < T * E; i += 7) {
        const double h = 1e-6, keep = logits[i];
        double up, down;
        logits[i] = keep + h;
        moe_z_loss_fwd(&up, logits, pad, T, E, 0.1, MOE_DTYPE_FP64, w, ws, NULL);
        logits[i] = keep - h;
        moe_z_loss_fwd(&down, logits, pad, T, E, 0.1, MOE_DTYPE_FP64, w, ws, NULL);
        logits[i] = keep;
        double fd = (up - down) / (2 * h);
        CHECK(fabs(grad[i] - fd) < 1e-7, "z grad %d: %g vs fd %g", i, grad[i], fd);
    }
    free(w);
    /* 0 tokens: empty tensors may have NULL storage; nothing to write, with or without a mask */
    CHECK(moe_z_loss_bwd(NULL, &g, NULL, NULL, 0, E, 0.1, MOE_DTYPE_FP32, NULL, 0, NULL) == MOE_OK,
          "%s", moe_last_error());
    CHECK(moe_z_loss_bwd(NULL, &g, NULL, pad, 0, E, 0.1, MOE_DTYPE_FP64, NULL, 0, NULL) == MOE_OK,
          "%s", moe_last_error());
    CHECK(moe_z_loss_bwd(NULL, &g, logits, pad, T, E, 0.1, MOE_DTYPE_FP64, NULL, 0, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "grad_logits must not be NULL"),
          "%s", moe_last_error());
    CHECK(moe_z_loss_bwd(grad, NULL, logits, pad, 0, E, 0.1, MOE_DTYPE_FP64, NULL, 0, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "grad_loss must not be NULL"),
          "%s", moe_last_error());
}

static void test_counts_and_expert_bias(void) {
    uint8_t map[4 * 3] = {1, 0, 1, 0, 1, 1, 1, 1, 0, 1, 0, 0}, pad[4] = {0, 1, 0, 0};
    int64_t counts[3];
    CHECK(moe_tokens_per_expert_fwd(counts, map, pad, 4, 3, NULL, 0, NULL) == MOE_OK, "counts");
    CHECK(counts[0] == 3 && counts[1] == 1 && counts[2] == 1, "counts %lld %lld %lld",
          (long long)counts[0], (long long)counts[1], (long long)counts[2]);
    /* the spec's example: counts (1, 5, 3, 3) -> (+rate, -rate, 0, 0) */
    float c[4] = {1, 5, 3, 3}, bias[4] = {0, 0, 0.5f, -0.25f}, out[4];
    CHECK(moe_expert_bias_update_fwd(out, c, bias, 1, 4, 1e-3, NULL, 0, NULL) == MOE_OK, "bias");
    CHECK(out[0] == 1e-3f && out[1] == -1e-3f && out[2] == 0.5f && out[3] == -0.25f,
          "bias %g %g %g %g", out[0], out[1], out[2], out[3]);
    CHECK(moe_expert_bias_update_fwd(bias, c, bias, 1, 4, 1e-3, NULL, 0, NULL) == MOE_OK &&
              bias[0] == 1e-3f,
          "in place");
    CHECK(moe_expert_bias_update_fwd(out, c, bias, 1, 4, NAN, NULL, 0, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "expert_bias_update_rate"),
          "nan rate named: %s", moe_last_error());
}

static void test_sinkhorn_balances(void) {
    enum { N = 40, M = 5 };
    double cost[N * M], out[N * M];
    fill_normal(cost, N * M, 9, 1.0);
    for (int t = 0; t < N; ++t) cost[t * M + 4] += 3.0; /* everyone prefers expert 4 */
    size_t ws = moe_sinkhorn_workspace_size(N, M, 0);
    void *w = malloc(ws);
    CHECK(moe_sinkhorn_fwd(out, cost, N, M, MOE_DTYPE_FP64, 1e-7, 10000, w, ws, NULL) == MOE_OK, "%s",
          moe_last_error());
    for (int e = 0; e < M; ++e) {
        double col = 0.0;
        for (int t = 0; t < N; ++t) col += out[t * M + e];
        CHECK(fabs(col - 1.0 / M) < 1e-6, "column %d sums to %g", e, col);
    }
    free(w);
    /* routing: eval top-1 is the argmax of the sigmoid; training spreads the load */
    double probs[N * M];
    uint8_t map[N * M];
    ws = moe_sinkhorn_routing_workspace_size(N, M, 1, 1);
    w = malloc(ws);
    CHECK(moe_sinkhorn_routing_fwd(probs, map, cost, N, M, 1, MOE_DTYPE_FP64, 0, 1e-4, w, ws,
                                   NULL) == MOE_OK, "%s", moe_last_error());
    int on4 = 0;
    for (int t = 0; t < N; ++t) on4 += map[t * M + 4];
    CHECK(moe_sinkhorn_routing_fwd(probs, map, cost, N, M, 1, MOE_DTYPE_FP64, 1, 1e-4, w, ws,
                                   NULL) == MOE_OK, "%s", moe_last_error());
    int on4_balanced = 0;
    for (int t = 0; t < N; ++t) {
        on4_balanced += map[t * M + 4];
        for (int e = 0; e < M; ++e)
            if (map[t * M + e])
                CHECK(fabs(probs[t * M + e] - 1.0 / (1.0 + exp(-cost[t * M + e]))) < 1e-15, "prob");
    }
    CHECK(on4_balanced < on4, "sinkhorn moved load off expert 4: %d vs %d", on4_balanced, on4);
    free(w);
}

static void test_metrics_and_overlap(void) {
    uint8_t map[4 * 2] = {1, 0, 0, 1, 1, 0, 0, 1};
    int64_t counts[2];
    float stats[MOE_ROUTING_STATS];
    double scores[4 * 2] = {0.5, 0.5, 1, 0, 0.5, 0.5, 0, 1};
    size_t ws = moe_routing_metrics_workspace_size(4, 2);
    void *w = malloc(ws);
    CHECK(moe_routing_metrics_fwd(counts, stats, map, scores, NULL, 4, 2, MOE_DTYPE_FP64, w, ws,
                                  NULL) == MOE_OK, "%s", moe_last_error());
    CHECK(counts[0] == 2 && counts[1] == 2 && stats[0] == 1.0f && stats[1] == 0.0f, "balanced");
    CHECK(fabs(stats[2] - log(2.0)) < 1e-6, "load entropy %g", stats[2]);
    CHECK(fabs(stats[3] - log(2.0) / 2) < 1e-6, "score entropy %g", stats[3]);
    free(w);
    int64_t a[3 * 2] = {0, 1, 2, 3, 4, 5}, b[3 * 2] = {1, 0, 2, 5, 6, 7};
    float overlap = -1.0f;
    CHECK(moe_topk_overlap_fwd(&overlap, a, b, NULL, 3, 2, 8, NULL, 0, NULL) == MOE_OK, "overlap");
    CHECK(fabs(overlap - 0.5f) < 1e-7, "overlap %g", overlap); /* (2 + 1 + 0) / 6 */
    b[5] = 8;
    CHECK(moe_topk_overlap_fwd(&overlap, a, b, NULL, 3, 2, 8, NULL, 0, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "indices_b has 8 at flat position 5"),
          "out-of-range id named: %s", moe_last_error());
}

static void test_invalid_arguments_named(void) {
    double logits[2 * E] = {0}, scores[2 * E];
    uint8_t map[2 * E];
    char ws[256];
    CHECK(moe_aux_loss_scores_fwd(scores, map, logits, NULL, 2, E, 0, MOE_DTYPE_FP64,
                                  MOE_SCORE_SOFTMAX, ws, sizeof ws, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "topk must be in [1, num_experts=6], got 0"),
          "topk: %s", moe_last_error());
    CHECK(moe_aux_loss_scores_fwd(scores, map, logits, NULL, 2, E, 1, MOE_DTYPE_FP64,
                                  (moe_score_function_t)7, ws, sizeof ws, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "got 7"),
          "score function: %s", moe_last_error());
    CHECK(moe_aux_loss_scores_fwd(scores, map, logits, NULL, 2, E, 1, MOE_DTYPE_INT64,
                                  MOE_SCORE_SOFTMAX, ws, sizeof ws, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "logits must be a float dtype, got int64"),
          "dtype: %s", moe_last_error());
    CHECK(moe_z_loss_fwd(scores, logits, NULL, -1, E, 0.1, MOE_DTYPE_FP64, ws, sizeof ws, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "num_tokens must be >= 0, got -1"),
          "num_tokens: %s", moe_last_error());
    CHECK(moe_sinkhorn_fwd(scores, logits, 2, E, MOE_DTYPE_FP64, -1.0, 0, ws, sizeof ws, NULL) ==
                  MOE_ERR_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "tol must be >= 0, got -1"),
          "tol: %s", moe_last_error());
}

static void test_deterministic_across_thread_counts(void) {
#ifdef _OPENMP
    enum { N = 301, M = 17 };
    static double logits[N * M], grad1[N * M], grad2[N * M];
    double z1, z2, g = 1.0;
    fill_normal(logits, N * M, 21, 2.0);
    size_t ws = moe_z_loss_workspace_size(N, M);
    void *w = malloc(ws);
    int before = omp_get_max_threads();
    omp_set_num_threads(1);
    moe_z_loss_fwd(&z1, logits, NULL, N, M, 0.01, MOE_DTYPE_FP64, w, ws, NULL);
    moe_z_loss_bwd(grad1, &g, logits, NULL, N, M, 0.01, MOE_DTYPE_FP64, NULL, 0, NULL);
    omp_set_num_threads(3);
    moe_z_loss_fwd(&z2, logits, NULL, N, M, 0.01, MOE_DTYPE_FP64, w, ws, NULL);
    moe_z_loss_bwd(grad2, &g, logits, NULL, N, M, 0.01, MOE_DTYPE_FP64, NULL, 0, NULL);
    omp_set_num_threads(before);
    CHECK(memcmp(&z1, &z2, sizeof z1) == 0, "z-loss differs across thread counts");
    CHECK(memcmp(grad1, grad2, sizeof grad1) == 0, "z-loss grad differs across thread counts");
    free(w);
#endif
}

void ctest_register_balancing(void) {
    ctest_add("aux_scores_forward", test_aux_scores_forward);
    ctest_add("aux_scores_backward_finite_differences", test_aux_scores_backward_finite_differences);
    ctest_add("switch_loss", test_switch_loss);
    ctest_add("z_loss", test_z_loss);
    ctest_add("counts_and_expert_bias", test_counts_and_expert_bias);
    ctest_add("sinkhorn_balances", test_sinkhorn_balances);
    ctest_add("metrics_and_overlap", test_metrics_and_overlap);
    ctest_add("invalid_arguments_named", test_invalid_arguments_named);
    ctest_add("deterministic_across_thread_counts", test_deterministic_across_thread_counts);
}
