/*
 * router_topk_math.h: the per-token routing math, shared verbatim by the C kernel
 * (csrc/router_topk.c) and the CUDA kernels (csrc/cuda/router_topk*.cu).
 *
 * Sharing one definition is what makes "the same routing on CPU and CUDA" a property of the code
 * rather than of testing: selection order, tie-breaking and the rounding points are the same
 * function. A row needs O(topk + num_groups) scratch words and no [num_experts] buffer: scores are
 * recomputed on the fly (softmax-pre keeps only the row max and 1/sum), and the top-k is kept in a
 * sorted insertion list while the experts stream by.
 *
 * The rules beyond Megatron's (group score by the top n of a group for any n, the probs kept
 * unnormalised or always renormalised, a selection-only bias with softmax-pre) are flags of the
 * same functions, resolved once into the context, so every kernel that shares this code gets
 * them with the same rounding points.
 */
#ifndef MOE_CORE_ROUTER_TOPK_MATH_H_
#define MOE_CORE_ROUTER_TOPK_MATH_H_

#include "common.h"

typedef struct moe_topk_ctx {
    int64_t num_experts, topk, num_groups, group_topk, per_group, group_n;
    int score_function, pre_softmax, fp64, has_scaling;
    int renorm; /* the picked probs are divided by (their sum + 1e-20) (not softmax-post) */
    int grad_dense; /* backward: grad_probs is the dense [T, E] gradient, not [T, topk] */
    moe_dtype_t dtype;
    double scaling_factor; /* rounded to the compute precision */
} moe_topk_ctx_t;

/* Scratch words (8 bytes each) one row needs; topk here is moe_topk_scratch_k's. */
MOE_HD static inline int64_t moe_topk_scratch_words(int64_t topk, int64_t num_groups) {
    return 3 * topk + 3 * (num_groups > 0 ? num_groups : 0) + 1;
}

/* The list length the row scratch is sized for: topk, or a longer group-score list. */
MOE_HD static inline int64_t moe_topk_scratch_k(const moe_router_topk_params_t *p) {
    return p->group_score_topk > p->topk ? p->group_score_topk : p->topk;
}

/* Rounds to the precision Megatron's intermediate tensors have: fp32, or fp64 for fp64 logits. */
MOE_HD static inline double moe_cround(const moe_topk_ctx_t *c, double v) {
    return c->fp64 ? v : (double)(float)v;
}

MOE_HD static inline moe_topk_ctx_t moe_topk_ctx_make(const moe_router_topk_params_t *p,
                                                     int64_t num_experts, moe_dtype_t dtype) {
    moe_topk_ctx_t c;
    c.num_experts = num_experts;
    c.topk = p->topk;
    c.num_groups = p->group_topk > 0 ? p->num_groups : 0;
    c.group_topk = p->group_topk;
    c.per_group = c.num_groups > 0 ? num_experts / c.num_groups : num_experts;
    c.group_n = c.num_groups == 0 ? 0 : p->group_score_topk > 0 ? p->group_score_topk
                                                                : p->topk / p->group_topk;
    c.score_function = (int)p->score_function;
    c.pre_softmax = p->use_pre_softmax != 0;
    /* softmax-post is a softmax over the k, normalised by construction; softmax-pre is
     * renormalised only on request; sigmoid / sqrtsoftplus by default when topk > 1 */
    if (c.score_function == MOE_SCORE_SOFTMAX && !c.pre_softmax) c.renorm = 0;
    else if (p->norm == MOE_TOPK_NORM_SUM) c.renorm = 1;
    else if (p->norm == MOE_TOPK_NORM_NONE) c.renorm = 0;
    else c.renorm = c.score_function != MOE_SCORE_SOFTMAX && p->topk > 1;
    c.fp64 = dtype == MOE_DTYPE_FP64;
    c.dtype = dtype;
    c.has_scaling = p->scaling_factor != 0.0;
    c.grad_dense = 0;
    c.scaling_factor = c.fp64 ? p->scaling_factor : (double)(float)p->scaling_factor;
    return c;
}

/* "a ranks before b": larger value first, NaN above everything, ties to the lower index. */
MOE_HD static inline int moe_topk_before(double a, int64_t ia, double b, int64_t ib) {
    int na = a != a, nb = b != b;
    if (na || nb) return na && (!nb || ia < ib);
    if (a != b) return a > b;
    return ia < ib;
}

/* Inserts (v, i) into a list kept sorted by moe_topk_before, holding at most `cap` entries. */
MOE_HD static inline void moe_topk_insert(double *vals, int64_t *idx, int64_t *len, int64_t cap,
                                          double v, int64_t i) {
    int64_t n = *len;
    if (n == cap) {
        if (!moe_topk_before(v, i, vals[n - 1], idx[n - 1])) return;
        --n;
    }
    int64_t j = n;
    while (j > 0 && moe_topk_before(v, i, vals[j - 1], idx[j - 1])) {
        vals[j] = vals[j - 1];
        idx[j] = idx[j - 1];
        --j;
    }
    vals[j] = v;
    idx[j] = i;
    *len = n + 1;
}

/* sigmoid or sqrt(softplus) of one logit, each step rounded as torch's fp32 tensors are. */
MOE_HD static inline double moe_topk_score(const moe_topk_ctx_t *c, double x) {
    if (c->score_function == MOE_SCORE_SIGMOID) return moe_cround(c, 1.0 / (1.0 + exp(-x)));
    double sp = moe_cround(c, x > 20.0 ? x : log1p(exp(x))); /* softplus, beta 1, threshold 20 */
    return moe_cround(c, sqrt(sp));
}

/* Max and 1/sum of exp(x - max) over n values at stride 1 (a softmax's two reductions). */
MOE_HD static inline void moe_topk_softmax_stats(const moe_topk_ctx_t *c, const void *x,
                                                 moe_dtype_t dt, int64_t base, int64_t n,
                                                 double *max_out, double *inv_out) {
    double m = -INFINITY;
    int has_nan = 0;
    for (int64_t e = 0; e < n; ++e) {
        double v = moe_load(x, dt, base + e);
        has_nan |= v != v;
        m = v > m ? v : m;
    }
    if (has_nan) m = NAN;
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e)
        sum += moe_cround(c, exp(moe_cround(c, moe_load(x, dt, base + e) - m)));
    *max_out = m;
    *inv_out = moe_cround(c, 1.0 / moe_cround(c, sum));
}

MOE_HD static inline double moe_topk_softmax_at(const moe_topk_ctx_t *c, double x, double m,
                                                double inv) {
    return moe_cround(c, moe_cround(c, exp(moe_cround(c, x - m))) * inv);
}

/* The value expert e is ranked by: its score plus the selection bias, if any (softmax: only
 * softmax-pre takes a bias, moe_router_topk_check). */
MOE_HD static inline double moe_topk_selection(const moe_topk_ctx_t *c, const void *logits,
                                               int64_t base, int64_t e, const float *bias,
                                               double m, double inv) {
    double x = moe_load(logits, c->dtype, base + e);
    double s;
    if (c->score_function == MOE_SCORE_SOFTMAX) {
        if (!c->pre_softmax) return x;
        s = moe_topk_softmax_at(c, x, m, inv);
    } else {
        s = moe_topk_score(c, x);
    }
    return bias ? moe_cround(c, s + (double)bias[e]) : s;
}

/* p[j] / (Σ p + 1e-20) over the k probs (the sigmoid renormalisation of Megatron, and the
 * renormalisation asked for by ctx->renorm). The sum of the k values is taken in fp64 and
 * rounded to the compute precision once: a left-to-right fp32 sum drifts by up to ~k/2 ulps,
 * while k non-negative fp32 terms summed in fp64 are off by at most (k - 1)·2^-29 fp32 ulps
 * before that single rounding, so the fp32 sum is within 0.5 + (k - 1)·2^-29 ulps of the exact
 * one. Sequential, as the CUDA kernels' copies of this sum. */
MOE_HD static inline void moe_topk_renorm(const moe_topk_ctx_t *c, double *probs) {
    double sum = 0.0;
    for (int64_t j = 0; j < c->topk; ++j) sum += probs[j];
    double d = moe_cround(c, moe_cround(c, sum) + moe_cround(c, 1e-20));
    for (int64_t j = 0; j < c->topk; ++j) probs[j] = moe_cround(c, probs[j] / d);
}

/*
 * Softmax-pre with a selection bias: the winners' values become their unbiased softmax values
 * (what moe_topk_probs reads for softmax-pre). Other rules read the logits again or have no bias.
 */
MOE_HD static inline void moe_topk_unbias(const moe_topk_ctx_t *c, const void *logits,
                                          int64_t base, const float *bias, double m, double inv,
                                          const int64_t *idx, double *vals) {
    if (!bias || c->score_function != MOE_SCORE_SOFTMAX || !c->pre_softmax) return;
    for (int64_t j = 0; j < c->topk; ++j)
        vals[j] = moe_topk_softmax_at(c, moe_load(logits, c->dtype, base + idx[j]), m, inv);
}

/*
 * The probs of one token's k picked experts, from their selection values `vals` and ids `idx`
 * (best first). Sequential on purpose: the sums are order-dependent, and the CPU kernel and the
 * CUDA kernel (one lane) both run this exact code; the renormalising sum is moe_topk_renorm's.
 */
MOE_HD static inline void moe_topk_probs(const moe_topk_ctx_t *c, const void *logits,
                                         int64_t base, const double *vals, const int64_t *idx,
                                         double *probs) {
    const int64_t k = c->topk;
    const int softmax = c->score_function == MOE_SCORE_SOFTMAX;
    if (softmax && c->pre_softmax) {
        /* the softmax values (unbiased: moe_topk_unbias) */
        for (int64_t j = 0; j < k; ++j) probs[j] = vals[j];
    } else if (softmax) {
        /* softmax over the k picked logits; vals[0] is their max (sorted, NaN first) */
        double sum = 0.0;
        for (int64_t j = 0; j < k; ++j) {
            probs[j] = moe_cround(c, exp(moe_cround(c, vals[j] - vals[0])));
            sum += probs[j];
        }
        double pinv = moe_cround(c, 1.0 / moe_cround(c, sum));
        for (int64_t j = 0; j < k; ++j) probs[j] = moe_cround(c, probs[j] * pinv);
    } else {
        for (int64_t j = 0; j < k; ++j)
            probs[j] = moe_topk_score(c, moe_load(logits, c->dtype, base + idx[j]));
    }
    if (c->renorm) moe_topk_renorm(c, probs);
    if (c->has_scaling)
        for (int64_t j = 0; j < k; ++j) probs[j] = moe_cround(c, probs[j] * c->scaling_factor);
}

/*
 * One token: writes its topk expert ids (best first) and their probs (in compute precision;
 * the caller stores them in the logits dtype).
 * scratch: moe_topk_scratch_words(moe_topk_scratch_k(params), groups).
 */
MOE_HD static inline void moe_topk_row_fwd(const moe_topk_ctx_t *c, const void *logits, int64_t t,
                                           const float *bias, double *scratch, int64_t *idx,
                                           double *probs) {
    const int64_t E = c->num_experts, k = c->topk, base = t * E;
    double m = 0.0, inv = 0.0;
    const int softmax = c->score_function == MOE_SCORE_SOFTMAX;
    if (softmax && c->pre_softmax) moe_topk_softmax_stats(c, logits, c->dtype, base, E, &m, &inv);

    double *vals = scratch;
    int64_t len = 0;
    if (c->num_groups == 0) {
        for (int64_t e = 0; e < E; ++e)
            moe_topk_insert(vals, idx, &len, k, moe_topk_selection(c, logits, base, e, bias, m, inv),
                            e);
    } else {
        const int64_t G = c->num_groups, n = c->group_n, gk = c->group_topk, P = c->per_group;
        const int64_t kn = n > k ? n : k; /* the lists' room: moe_topk_scratch_k */
        double *nvals = scratch + k;
        int64_t *nidx = (int64_t *)(nvals + kn);
        double *gvals = (double *)(nidx + kn);
        int64_t *gidx = (int64_t *)(gvals + G);
        int64_t glen = 0;
        for (int64_t g = 0; g < G; ++g) {
            int64_t nlen = 0;
            for (int64_t e = g * P; e < (g + 1) * P; ++e)
                moe_topk_insert(nvals, nidx, &nlen, n,
                                moe_topk_selection(c, logits, base, e, bias, m, inv), e);
            /* torch sums a small fp32 row left to right in fp32 (bf16 in fp32, rounded once) */
            double acc = 0.0;
            for (int64_t j = 0; j < nlen; ++j) acc = moe_cround(c, acc + nvals[j]);
            if (softmax && !c->pre_softmax) acc = moe_round_to(c->dtype, acc);
            moe_topk_insert(gvals, gidx, &glen, gk, acc, g);
        }
        /* experts of the kept groups, in ascending index order */
        for (int64_t g = 0; g < G; ++g) {
            int kept = 0;
            for (int64_t j = 0; j < glen; ++j) kept |= gidx[j] == g;
            if (!kept) continue;
            for (int64_t e = g * P; e < (g + 1) * P; ++e)
                moe_topk_insert(vals, idx, &len, k,
                                moe_topk_selection(c, logits, base, e, bias, m, inv), e);
        }
    }

    moe_topk_unbias(c, logits, base, bias, m, inv, idx, vals);
    moe_topk_probs(c, logits, base, vals, idx, probs);
}

/*
 * Backward, the part that touches only the k picked experts of token t: gsel[j] receives
 * d(loss)/d(logits[t, idx[j]]). For softmax-pre every expert has a gradient; the others get
 * s_e · (-dot): the caller passes the row's softmax stats (m, inv; fp64, from
 * moe_topk_softmax_stats or a parallel reduction) and receives dot.
 * scratch: 2·topk words. Runs in fp64 throughout: there is no tensor to match bit for bit, and
 * the formulas cancel (g/D - Σgv/D², s·(g - Σgs)), so it rounds once, when the caller stores.
 */
MOE_HD static inline void moe_topk_bwd_selected(const moe_topk_ctx_t *ctx, const void *logits,
                                                const void *grad_probs, int64_t t,
                                                const int64_t *idx, double m, double inv,
                                                double *scratch, double *gsel, double *dot_out) {
    moe_topk_ctx_t c64 = *ctx;
    c64.fp64 = 1;
    const moe_topk_ctx_t *c = &c64;
    const int64_t E = c->num_experts, k = c->topk, base = t * E;
    double *g = scratch, *v = scratch + k;
    for (int64_t j = 0; j < k; ++j) {
        g[j] = moe_load(grad_probs, c->dtype, c->grad_dense ? t * E + idx[j] : t * k + j);
        if (c->has_scaling) g[j] = g[j] * c->scaling_factor;
    }
    *dot_out = 0.0;
    (void)E;
    if (c->score_function == MOE_SCORE_SOFTMAX && c->pre_softmax) {
        double dot = 0.0, sum = 0.0;
        for (int64_t j = 0; j < k; ++j) {
            v[j] = moe_topk_softmax_at(c, moe_load(logits, c->dtype, base + idx[j]), m, inv);
            sum += v[j];
        }
        if (c->renorm) { /* through p = v / (Σ v + 1e-20) first: g <- dL/dv */
            double d = sum + 1e-20, gd = 0.0;
            for (int64_t j = 0; j < k; ++j) gd -= g[j] * v[j] / (d * d);
            for (int64_t j = 0; j < k; ++j) g[j] = g[j] / d + gd;
        }
        for (int64_t j = 0; j < k; ++j) dot += g[j] * v[j];
        for (int64_t j = 0; j < k; ++j) gsel[j] = v[j] * (g[j] - dot);
        *dot_out = dot;
        return;
    }
    if (c->score_function == MOE_SCORE_SOFTMAX) {
        double x0 = moe_load(logits, c->dtype, base + idx[0]), sum = 0.0, dot = 0.0;
        for (int64_t j = 0; j < k; ++j) {
            v[j] = exp(moe_load(logits, c->dtype, base + idx[j]) - x0);
            sum += v[j];
        }
        for (int64_t j = 0; j < k; ++j) {
            v[j] = v[j] / sum;
            dot += g[j] * v[j];
        }
        for (int64_t j = 0; j < k; ++j) gsel[j] = v[j] * (g[j] - dot);
        return;
    }
    /* sigmoid / sqrtsoftplus: through the renormalisation, the gather and the score function */
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
        v[j] = moe_topk_score(c, moe_load(logits, c->dtype, base + idx[j]));
        sum += v[j];
    }
    if (c->renorm) {
        double d = sum + 1e-20, gd = 0.0;
        for (int64_t j = 0; j < k; ++j) gd -= g[j] * v[j] / (d * d);
        for (int64_t j = 0; j < k; ++j) g[j] = g[j] / d + gd;
    }
    for (int64_t j = 0; j < k; ++j) {
        double x = moe_load(logits, c->dtype, base + idx[j]);
        if (c->score_function == MOE_SCORE_SIGMOID) {
            gsel[j] = g[j] * (1.0 - v[j]) * v[j];
        } else {
            double gu = g[j] / (2.0 * v[j]);
            gsel[j] = x > 20.0 ? gu : gu * (1.0 / (1.0 + exp(-x))); /* softplus' = sigmoid */
        }
    }
}

/* Backward of expert e that is not among the picked: nonzero only for softmax-pre. */
MOE_HD static inline double moe_topk_bwd_unpicked(const moe_topk_ctx_t *c, const void *logits,
                                                  int64_t i, double m, double inv, double dot) {
    if (!(c->score_function == MOE_SCORE_SOFTMAX && c->pre_softmax)) return 0.0;
    return exp(moe_load(logits, c->dtype, i) - m) * inv * -dot;
}

/*
 * One token's backward: stores d(loss)/d(logits[t, :]) in the logits dtype through moe_store.
 * grad_probs is [T, topk] in the logits dtype ([T, E] with ctx->grad_dense); idx the forward's
 * indices for this row.
 * scratch: 3·topk words.
 */
MOE_HD static inline void moe_topk_row_bwd(const moe_topk_ctx_t *c, const void *logits,
                                           const void *grad_probs, int64_t t, const int64_t *idx,
                                           double *scratch, void *grad_logits) {
    const int64_t E = c->num_experts, k = c->topk, base = t * E;
    double *gsel = scratch + 2 * k, m = 0.0, inv = 0.0, dot;
    moe_topk_ctx_t c64 = *c;
    c64.fp64 = 1;
    if (c->score_function == MOE_SCORE_SOFTMAX && c->pre_softmax)
        moe_topk_softmax_stats(&c64, logits, c->dtype, base, E, &m, &inv);
    moe_topk_bwd_selected(c, logits, grad_probs, t, idx, m, inv, scratch, gsel, &dot);
    for (int64_t e = 0; e < E; ++e)
        moe_store(grad_logits, c->dtype, base + e,
                  moe_topk_bwd_unpicked(&c64, logits, base + e, m, inv, dot));
    for (int64_t j = 0; j < k; ++j) moe_store(grad_logits, c->dtype, base + idx[j], gsel[j]);
}

/* ---- the extra outputs of the fused router (moe_router_topk_fused_fwd) ---------------------- */

/*
 * logsumexp of one row in fp64, the quantity the z-loss squares. The same loop as z_loss.c's
 * (a NaN propagates, a ±inf max is returned as is, else m + log Σ exp(x − m) summed in ascending
 * expert order), so the CPU value is bit for bit the one moe_z_loss_fwd squares.
 */
MOE_HD static inline double moe_router_row_lse(const void *logits, moe_dtype_t dt, int64_t base,
                                               int64_t n) {
    double m = -INFINITY;
    int has_nan = 0;
    for (int64_t e = 0; e < n; ++e) {
        double v = moe_load(logits, dt, base + e);
        has_nan |= v != v;
        m = v > m ? v : m;
    }
    if (has_nan) return NAN;
    if (isinf(m)) return m;
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += exp(moe_load(logits, dt, base + e) - m);
    return m + log(sum);
}

/*
 * Megatron's compute_routing_scores_for_aux_loss for token t, exactly as moe_aux_loss_scores_fwd
 * (csrc/aux_loss_scores.c) computes it: softmax over all experts, or the unnormalised score
 * s / (Σ s + 1e-20) (Σ in fp64 in ascending order, then the same rounding points); the map row
 * is the top c->topk of exactly the values written (no groups, no bias, ties to the lower id).
 * scores: [T, E] fp32 (fp64 when c->fp64); map: [T, E]; scratch: 2·topk words.
 */
MOE_HD static inline void moe_router_aux_row(const moe_topk_ctx_t *c, const void *logits, int64_t t,
                                             void *scores, uint8_t *map, double *scratch) {
    const int64_t E = c->num_experts, k = c->topk, base = t * E;
    const moe_dtype_t sdt = c->fp64 ? MOE_DTYPE_FP64 : MOE_DTYPE_FP32;
    double *vals = scratch;
    int64_t *idx = (int64_t *)(scratch + k), len = 0;
    for (int64_t e = 0; e < E; ++e) map[base + e] = 0;
    if (c->score_function == MOE_SCORE_SOFTMAX) {
        double m, inv;
        moe_topk_softmax_stats(c, logits, c->dtype, base, E, &m, &inv);
        for (int64_t e = 0; e < E; ++e) {
            double s = moe_topk_softmax_at(c, moe_load(logits, c->dtype, base + e), m, inv);
            moe_store(scores, sdt, base + e, s);
            moe_topk_insert(vals, idx, &len, k, s, e);
        }
    } else {
        double sum = 0.0;
        for (int64_t e = 0; e < E; ++e) {
            double s = moe_topk_score(c, moe_load(logits, c->dtype, base + e));
            moe_store(scores, sdt, base + e, s);
            sum += s;
        }
        double d = moe_cround(c, moe_cround(c, sum) + moe_cround(c, 1e-20));
        for (int64_t e = 0; e < E; ++e) { /* ranked after the division: torch's ties */
            double s = moe_cround(c, moe_load(scores, sdt, base + e) / d);
            moe_store(scores, sdt, base + e, s);
            moe_topk_insert(vals, idx, &len, k, s, e);
        }
    }
    for (int64_t j = 0; j < len; ++j) map[base + idx[j]] = 1;
}

/* d lse / d logits of token t: grad_lse[t] · exp(x − lse[t]) (softmax), zero on padded rows;
 * the product is z_loss.c's, so with grad_lse = scale · lse the CPU result is bit for bit
 * moe_z_loss_bwd's. */
MOE_HD static inline double moe_router_lse_grad(double grad_lse, double x, double lse, int pad) {
    return pad ? 0.0 : grad_lse * exp(x - lse);
}

#endif /* MOE_CORE_ROUTER_TOPK_MATH_H_ */
