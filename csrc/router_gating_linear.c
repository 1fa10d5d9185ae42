/*
 * router_gating_linear.c: logits = inp · weightᵀ (+ bias) in the router dtype, and its backward.
 *
 * The router GEMM is tiny next to the experts ([T, H] x [H, E] with E in the hundreds), so this
 * is a plain blocked loop nest rather than a tuned GEMM. What matters is the contract: inputs are
 * widened element by element to the router dtype (so bf16 activations are never stored upcast),
 * sums run in a fixed order with a wide accumulator (fp64 for fp32/fp64 router math), and the
 * result is rounded once to the router dtype: deterministic, and never less accurate than the
 * router-dtype torch.mm it replaces.
 */
#include "common.h"

#define MOE_GATING_BLOCK 64 /* columns of the output accumulated per pass, held on the stack */

moe_status_t moe_router_gating_linear_check(int64_t num_tokens, int64_t hidden,
                                            int64_t num_experts, moe_dtype_t inp_dtype,
                                            moe_dtype_t weight_dtype, moe_dtype_t router_dtype) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(hidden >= 1, "hidden must be >= 1, got %lld", (long long)hidden);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(moe_is_float_dtype(inp_dtype), "inp must be a float dtype, got %s",
              moe_dtype_name(inp_dtype));
    MOE_CHECK(moe_is_float_dtype(weight_dtype), "weight must be a float dtype, got %s",
              moe_dtype_name(weight_dtype));
    MOE_CHECK(moe_is_float_dtype(router_dtype), "router_dtype must be a float dtype, got %s",
              moe_dtype_name(router_dtype));
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", hidden, "hidden"));
    MOE_TRY(moe_check_mul(num_experts, "num_experts", hidden, "hidden"));
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", num_experts, "num_experts"));
    return MOE_OK;
}

size_t moe_router_gating_linear_workspace_size(int64_t num_tokens, int64_t hidden,
                                               int64_t num_experts, moe_dtype_t inp_dtype,
                                               moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                               int backward) {
    (void)num_tokens, (void)hidden, (void)num_experts, (void)inp_dtype, (void)weight_dtype,
        (void)router_dtype, (void)backward;
    return 0; /* the loops accumulate on the stack */
}

/* Element of a tensor converted to the router dtype, as `tensor.to(router_dtype)` does. */
static inline double widen(const void *p, moe_dtype_t dt, int64_t i, moe_dtype_t rd) {
    return moe_round_to(rd, moe_load(p, dt, i));
}

/* Widening to an fp32/fp64 router dtype is exact for every input dtype, so the conversion can be
 * a plain cast in a loop specialised per dtype (which the compiler vectorises) instead of a
 * per-element switch. */
static inline int exact_widening(moe_dtype_t rd) {
    return rd == MOE_DTYPE_FP32 || rd == MOE_DTYPE_FP64;
}

#define MOE_GATING_TYPED(dt, BODY)                                                   \
    switch (dt) {                                                                   \
    case MOE_DTYPE_FP32: { typedef float elem_t; BODY(elem_t, (double)); break; }    \
    case MOE_DTYPE_FP64: { typedef double elem_t; BODY(elem_t, (double)); break; }   \
    case MOE_DTYPE_BF16: { typedef uint16_t elem_t; BODY(elem_t, (double)moe_bf16_to_float); break; } \
    case MOE_DTYPE_FP16: { typedef uint16_t elem_t; BODY(elem_t, (double)moe_fp16_to_float); break; } \
    default: break;                                                                 \
    }

/* Σ_h a[h]·b[h] over n elements of one dtype in fp64: eight interleaved partial sums (lane j
 * takes h ≡ j mod 8, so the compiler can keep them in one vector register), added in a fixed
 * tree at the end. A fixed order, so deterministic, and a shorter error chain than one sum. */
#define MOE_DOT_LANES 8
static double dot_exact(const void *a, const void *b, int64_t n, moe_dtype_t dt) {
    double part[MOE_DOT_LANES] = {0};
    const int64_t body = n - n % MOE_DOT_LANES;
#define DOT_BODY(T, CVT)                                                      \
    {                                                                         \
        const T *x = (const T *)a, *y = (const T *)b;                         \
        for (int64_t h = 0; h < body; h += MOE_DOT_LANES)                     \
            for (int j = 0; j < MOE_DOT_LANES; ++j)                           \
                part[j] += CVT(x[h + j]) * CVT(y[h + j]);                     \
        for (int64_t h = body; h < n; ++h) part[h - body] += CVT(x[h]) * CVT(y[h]); \
    }
    MOE_GATING_TYPED(dt, DOT_BODY)
#undef DOT_BODY
    return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

/* acc[h] += g·row[h] for n elements of one dtype. */
static void axpy_exact(double *acc, double g, const void *row, int64_t n, moe_dtype_t dt) {
#define AXPY_BODY(T, CVT)                                        \
    {                                                            \
        const T *x = (const T *)row;                             \
        for (int64_t h = 0; h < n; ++h) acc[h] += g * CVT(x[h]); \
    }
    MOE_GATING_TYPED(dt, AXPY_BODY)
#undef AXPY_BODY
}

moe_status_t moe_router_gating_linear_fwd(void *logits, const void *inp, const void *weight,
                                          const void *bias, int64_t num_tokens, int64_t hidden,
                                          int64_t num_experts, moe_dtype_t inp_dtype,
                                          moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                          void *workspace, size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(moe_router_gating_linear_check(num_tokens, hidden, num_experts, inp_dtype,
                                           weight_dtype, router_dtype));
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(logits && inp && weight, "logits, inp and weight must not be NULL");

    const int fast = exact_widening(router_dtype) && inp_dtype == weight_dtype;
    const size_t in_size = moe_dtype_size(inp_dtype), w_size = moe_dtype_size(weight_dtype);

#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        for (int64_t e = 0; e < num_experts; ++e) {
            double acc = 0.0;
            if (fast)
                acc = dot_exact((const char *)inp + (size_t)(t * hidden) * in_size,
                                (const char *)weight + (size_t)(e * hidden) * w_size, hidden,
                                inp_dtype);
            else
                for (int64_t h = 0; h < hidden; ++h)
                    acc += widen(inp, inp_dtype, t * hidden + h, router_dtype) *
                           widen(weight, weight_dtype, e * hidden + h, router_dtype);
            acc = moe_round_to(router_dtype, acc);
            if (bias) acc += widen(bias, weight_dtype, e, router_dtype);
            moe_store(logits, router_dtype, t * num_experts + e, acc);
        }
    }
    return MOE_OK;
}

moe_status_t moe_router_gating_linear_bwd(void *grad_inp, void *grad_weight, void *grad_bias,
                                          const void *grad_logits, const void *inp,
                                          const void *weight, int64_t num_tokens, int64_t hidden,
                                          int64_t num_experts, moe_dtype_t inp_dtype,
                                          moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                          void *workspace, size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(moe_router_gating_linear_check(num_tokens, hidden, num_experts, inp_dtype,
                                           weight_dtype, router_dtype));
    MOE_CHECK(num_tokens == 0 || (grad_logits && inp && weight),
              "grad_logits, inp and weight must not be NULL");

    const int exact = exact_widening(router_dtype);
    const size_t in_size = moe_dtype_size(inp_dtype), w_size = moe_dtype_size(weight_dtype);

    /* grad_inp[t, :] = Σ_e g[t, e] · W[e, :], one block of hidden columns at a time */
    if (grad_inp && num_tokens > 0) {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) {
            for (int64_t h0 = 0; h0 < hidden; h0 += MOE_GATING_BLOCK) {
                const int64_t hn = hidden - h0 < MOE_GATING_BLOCK ? hidden - h0 : MOE_GATING_BLOCK;
                double acc[MOE_GATING_BLOCK] = {0};
                for (int64_t e = 0; e < num_experts; ++e) {
                    const double g = moe_load(grad_logits, router_dtype, t * num_experts + e);
                    if (exact)
                        axpy_exact(acc, g, (const char *)weight + (size_t)(e * hidden + h0) * w_size,
                                   hn, weight_dtype);
                    else
                        for (int64_t h = 0; h < hn; ++h)
                            acc[h] += g * widen(weight, weight_dtype, e * hidden + h0 + h,
                                                router_dtype);
                }
                for (int64_t h = 0; h < hn; ++h)
                    moe_store(grad_inp, inp_dtype, t * hidden + h0 + h,
                              moe_round_to(router_dtype, acc[h]));
            }
        }
    }
    /* grad_weight[e, :] = Σ_t g[t, e] · inp[t, :] */
    if (grad_weight) {
#pragma omp parallel for schedule(static)
        for (int64_t e = 0; e < num_experts; ++e) {
            for (int64_t h0 = 0; h0 < hidden; h0 += MOE_GATING_BLOCK) {
                const int64_t hn = hidden - h0 < MOE_GATING_BLOCK ? hidden - h0 : MOE_GATING_BLOCK;
                double acc[MOE_GATING_BLOCK] = {0};
                for (int64_t t = 0; t < num_tokens; ++t) {
                    const double g = moe_load(grad_logits, router_dtype, t * num_experts + e);
                    if (exact)
                        axpy_exact(acc, g, (const char *)inp + (size_t)(t * hidden + h0) * in_size,
                                   hn, inp_dtype);
                    else
                        for (int64_t h = 0; h < hn; ++h)
                            acc[h] += g * widen(inp, inp_dtype, t * hidden + h0 + h, router_dtype);
                }
                for (int64_t h = 0; h < hn; ++h)
                    moe_store(grad_weight, weight_dtype, e * hidden + h0 + h,
                              moe_round_to(router_dtype, acc[h]));
            }
        }
    }
    /* grad_bias[e] = Σ_t g[t, e], summed in the router dtype's accumulator */
    if (grad_bias) {
        for (int64_t e = 0; e < num_experts; ++e) {
            double acc = 0.0;
            for (int64_t t = 0; t < num_tokens; ++t)
                acc += moe_load(grad_logits, router_dtype, t * num_experts + e);
            moe_store(grad_bias, weight_dtype, e, moe_round_to(router_dtype, acc));
        }
    }
    return MOE_OK;
}
