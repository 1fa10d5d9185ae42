/*
 * glu_probs_math.h: the per-element math of glu_probs (gated activation × router probs), shared
 * verbatim by the C kernel (csrc/glu_probs.c) and the CUDA kernel (csrc/cuda/glu_probs.cu).
 *
 * What it computes is Megatron's unfused expert activation, as PyTorch's eager CPU kernels do it:
 *
 *     g, l = a[:, :F], a[:, F:]                      (GLU; without GLU g = a and there is no l;
                                                   interleaved: alternating blocks of s gate
                                                   and s linear columns, moe_gp_gate_col)
 *     g = g.clamp(max=v); l = l.clamp(-v, v)         (only with activation_func_clamp_value v)
 *     s = act(g)                                     rounded to dtype
 *     h0 = s * (l + offset)                          (l + offset) rounded, the product rounded
 *     h = (h0 * p).to(dtype)                         product in promote(dtype, probs dtype),
 *                                                    rounded there, then rounded to dtype
 *
 * The one idea: every rounding point of that sequence is a function call here (moe_gp_rnd), and
 * each activation is written as torch's *scalar* CPU lambda is (same operation order, same float
 * constants, same libm call), so the CPU result equals torch's scalar path bit for bit in every
 * dtype. (torch's vectorised lanes call SLEEF instead of libm for exp/erf/tanh; the two can differ
 * by one fp32/fp64 ulp before rounding, so torch's own fp32 result depends on an element's position
 * in the tensor. After rounding to bf16/fp16 the difference almost never survives;
 * tests/experts/test_glu_probs.py measures it exhaustively.) Products and sums go through
 * MOE_GP_MUL/ADD so that nvcc cannot contract them into FMAs: CUDA then differs from the CPU only
 * inside expf/erff/tanhf.
 * torch's AVX2/AVX-512 CPU kernels are built by GCC with -mfma and FP contraction on, so some a*b+c
 * of their scalar lambdas are fused; MOE_GP_FMA* marks exactly those (found by comparing against
 * torch 2.14's scalar path: gelu_tanh's inner polynomial, its 1 - t*t and 1 + 3k x^2; silu
 * backward's 1 + x(1 - s)). A torch built without FMA would differ there by an ulp in fp32/fp64.
 *
 * The backward recomputes the forward from a (nothing but a and probs is saved) and follows what
 * autograd runs for that sequence: MulBackward of h0 * p (grad_h cast to the product dtype, times
 * p, rounded there and cast back; grad_p is the row sum of grad_h * h0 in the product dtype), then
 * MulBackward of s * l2, the activation's backward kernel at the clamped g, and ClampBackward's
 * masks, which are strict against the bound rounded to the tensor's dtype (x < v passes; -v < x < v
 * for the linear half; a value at the bound and NaN do not pass), as torch 2.14's ClampBackward.
 */
#ifndef MOE_CORE_GLU_PROBS_MATH_H_
#define MOE_CORE_GLU_PROBS_MATH_H_

#include "common.h"
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

/* Round-to-nearest arithmetic that is never contracted into an FMA (nvcc contracts by default;
 * the C core is built with -std=c11, where GCC does not contract). */
#ifdef __CUDA_ARCH__
#define MOE_GP_MULF(a, b) __fmul_rn((a), (b))
#define MOE_GP_ADDF(a, b) __fadd_rn((a), (b))
#define MOE_GP_SUBF(a, b) __fsub_rn((a), (b))
#define MOE_GP_DIVF(a, b) __fdiv_rn((a), (b))
#define MOE_GP_MULD(a, b) __dmul_rn((a), (b))
#define MOE_GP_ADDD(a, b) __dadd_rn((a), (b))
#define MOE_GP_SUBD(a, b) __dsub_rn((a), (b))
#define MOE_GP_DIVD(a, b) __ddiv_rn((a), (b))
#define MOE_GP_FMAF(a, b, c) __fmaf_rn((a), (b), (c))
#define MOE_GP_FMAD(a, b, c) __fma_rn((a), (b), (c))
#else
#define MOE_GP_MULF(a, b) ((float)(a) * (float)(b))
#define MOE_GP_ADDF(a, b) ((float)(a) + (float)(b))
#define MOE_GP_SUBF(a, b) ((float)(a) - (float)(b))
#define MOE_GP_DIVF(a, b) ((float)(a) / (float)(b))
#define MOE_GP_MULD(a, b) ((double)(a) * (double)(b))
#define MOE_GP_ADDD(a, b) ((double)(a) + (double)(b))
#define MOE_GP_SUBD(a, b) ((double)(a) - (double)(b))
#define MOE_GP_DIVD(a, b) ((double)(a) / (double)(b))
#define MOE_GP_FMAF(a, b, c) fmaf((a), (b), (c))
#define MOE_GP_FMAD(a, b, c) fma((a), (b), (c))
#endif

/* glibc's M_SQRT1_2, M_SQRT2, M_2_SQRTPI (math.h hides them under -std=c11); torch uses those. */
#define MOE_GP_SQRT1_2 0.70710678118654752440
#define MOE_GP_SQRT2 1.41421356237309504880
#define MOE_GP_2_SQRTPI 1.12837916709551257390

/* Lanes of the canonical grad_probs reduction: one CUDA warp. */
#define MOE_GP_LANES 32

typedef struct moe_gp_ctx {
    int act;            /* moe_activation_t */
    int gated, has_clamp, has_probs;
    int64_t interleave;       /* 0: [gate | linear] halves; s: blocks of s alternate */
    moe_dtype_t dtype;        /* a, h, grad_a, grad_h */
    moe_dtype_t probs_dtype;  /* probs, grad_probs */
    moe_dtype_t prod_dtype;   /* promote(dtype, probs_dtype): where h0 * p is rounded */
    float clamp_f, offset_f;  /* v and offset as the fp32 / half kernels see them */
    double clamp_d, offset_d; /* ... and as the fp64 kernels see them */
} moe_gp_ctx_t;

/* torch.promote_types for the float dtypes. */
MOE_HD static inline moe_dtype_t moe_gp_promote(moe_dtype_t a, moe_dtype_t b) {
    if (a == b) return a;
    if (a == MOE_DTYPE_FP64 || b == MOE_DTYPE_FP64) return MOE_DTYPE_FP64;
    return MOE_DTYPE_FP32; /* fp32 with a half type, or bf16 with fp16 */
}

/* A float rounded to dtype's precision (a tensor of that dtype materialised). fp32: identity.
 * On the GPU the hardware's round-to-nearest-even conversions, one instruction each way: the same
 * value as the software conversions of common.h for every input (a NaN stays a NaN; only a NaN's
 * payload could differ, and a rounded value is never stored from here). */
MOE_HD static inline float moe_gp_rnd(moe_dtype_t dt, float x) {
#ifdef __CUDA_ARCH__
    if (dt == MOE_DTYPE_BF16) return __bfloat162float(__float2bfloat16_rn(x));
    if (dt == MOE_DTYPE_FP16) return __half2float(__float2half_rn(x));
#else
    if (dt == MOE_DTYPE_BF16) return moe_bf16_to_float(moe_float_to_bf16(x));
    if (dt == MOE_DTYPE_FP16) return moe_fp16_to_float(moe_float_to_fp16(x));
#endif
    return x;
}

MOE_HD static inline moe_gp_ctx_t moe_gp_ctx_make(const moe_glu_probs_params_t *p, moe_dtype_t dtype,
                                                 int has_probs, moe_dtype_t probs_dtype) {
    moe_gp_ctx_t c;
    c.act = (int)p->activation;
    c.gated = p->gated_linear_unit != 0;
    c.has_clamp = p->has_clamp != 0;
    c.has_probs = has_probs;
    c.interleave = p->gated_linear_unit ? p->interleave : 0;
    c.dtype = dtype;
    c.probs_dtype = has_probs ? probs_dtype : dtype;
    c.prod_dtype = moe_gp_promote(dtype, c.probs_dtype);
    c.clamp_f = (float)p->clamp_value;
    /* torch rounds a Python scalar added to a half tensor to the tensor's dtype first */
    c.offset_f = moe_gp_rnd(dtype, (float)p->linear_offset);
    c.clamp_d = p->clamp_value;
    c.offset_d = p->linear_offset;
    return c;
}

/* The column of a's row that holds the gate of h's column f, and the one that holds its linear
 * value (GLU): the halves' f and ffn + f, or with blocks of s interleaved, f's block b = f / s
 * starts at 2bs (f + bs) and its linear block s columns later. */
MOE_HD static inline int64_t moe_gp_gate_col(const moe_gp_ctx_t *c, int64_t f) {
    return c->interleave ? f + (f / c->interleave) * c->interleave : f;
}

MOE_HD static inline int64_t moe_gp_lin_col(const moe_gp_ctx_t *c, int64_t ffn, int64_t f) {
    return c->interleave ? moe_gp_gate_col(c, f) + c->interleave : ffn + f;
}

/* ---- activations, float kernels (bf16, fp16, fp32): x is a dtype value, the result rounded --- */

/* torch's scalar kernels differ between the half types and fp32 in one place: the gelu backward
 * constant kBeta is a float product for half types and a double product cast to float for fp32. */
MOE_HD static inline float moe_gp_act_fwd_f(int act, moe_dtype_t dt, float x) {
    switch (act) {
    case MOE_ACT_SILU: /* x / (1 + exp(-x)) */
        return moe_gp_rnd(dt, MOE_GP_DIVF(x, MOE_GP_ADDF(1.0f, expf(-x))));
    case MOE_ACT_GELU: { /* x * 0.5 * (1 + erf(x * sqrt(1/2))) */
        const float k_alpha = (float)MOE_GP_SQRT1_2;
        return moe_gp_rnd(dt, MOE_GP_MULF(MOE_GP_MULF(x, 0.5f),
                                          MOE_GP_ADDF(1.0f, erff(MOE_GP_MULF(x, k_alpha)))));
    }
    case MOE_ACT_GELU_TANH: { /* 0.5 * x * (1 + tanh(beta * (x + kappa * x^3))) */
        const float k_beta = (float)(MOE_GP_SQRT2 * MOE_GP_2_SQRTPI * 0.5), k_kappa = (float)0.044715;
        const float x_cube = MOE_GP_MULF(MOE_GP_MULF(x, x), x);
        const float inner = MOE_GP_MULF(k_beta, MOE_GP_FMAF(k_kappa, x_cube, x));
        return moe_gp_rnd(dt, MOE_GP_MULF(MOE_GP_MULF(0.5f, x), MOE_GP_ADDF(1.0f, tanhf(inner))));
    }
    case MOE_ACT_RELU:
        return x > 0.0f || x != x ? x : 0.0f;
    case MOE_ACT_SQUARED_RELU: { /* pow(relu(x), 2): x * x, rounded once */
        const float r = x > 0.0f || x != x ? x : 0.0f;
        return moe_gp_rnd(dt, MOE_GP_MULF(r, r));
    }
    case MOE_ACT_QUICK_GELU: { /* x * sigmoid(1.702 * x): three rounded tensors */
        const float t = moe_gp_rnd(dt, MOE_GP_MULF(x, (float)1.702));
        const float sg = moe_gp_rnd(dt, MOE_GP_DIVF(1.0f, MOE_GP_ADDF(1.0f, expf(-t))));
        return moe_gp_rnd(dt, MOE_GP_MULF(x, sg));
    }
    }
    return 0.0f;
}

/* d act(x) / dx times dy, as torch's backward kernels (or, for the composite activations, the
 * autograd graph of their forward) compute it; dy is a dtype value; the result rounded. */
MOE_HD static inline float moe_gp_act_bwd_f(int act, moe_dtype_t dt, float dy, float x) {
    switch (act) {
    case MOE_ACT_SILU: { /* dy * sig * (1 + x * (1 - sig)) */
        const float sig = MOE_GP_DIVF(1.0f, MOE_GP_ADDF(1.0f, expf(-x)));
        return moe_gp_rnd(dt, MOE_GP_MULF(MOE_GP_MULF(dy, sig),
                                          MOE_GP_FMAF(x, MOE_GP_SUBF(1.0f, sig), 1.0f)));
    }
    case MOE_ACT_GELU: { /* dy * (cdf + x * pdf) */
        const float k_alpha = (float)MOE_GP_SQRT1_2;
        const float k_beta = dt == MOE_DTYPE_FP32
                                 ? (float)(MOE_GP_2_SQRTPI * MOE_GP_SQRT1_2 * 0.5)
                                 : MOE_GP_MULF(MOE_GP_MULF((float)MOE_GP_2_SQRTPI, (float)MOE_GP_SQRT1_2), 0.5f);
        const float cdf = MOE_GP_MULF(0.5f, MOE_GP_ADDF(1.0f, erff(MOE_GP_MULF(x, k_alpha))));
        const float pdf = MOE_GP_MULF(k_beta, expf(MOE_GP_MULF(MOE_GP_MULF(x, x), -0.5f)));
        return moe_gp_rnd(dt, MOE_GP_MULF(dy, MOE_GP_ADDF(cdf, MOE_GP_MULF(x, pdf))));
    }
    case MOE_ACT_GELU_TANH: {
        const float k_beta = (float)(MOE_GP_SQRT2 * MOE_GP_2_SQRTPI * 0.5), k_kappa = (float)0.044715;
        const float x_sq = MOE_GP_MULF(x, x);
        const float x_cube = MOE_GP_MULF(x_sq, x);
        const float inner = MOE_GP_MULF(k_beta, MOE_GP_FMAF(k_kappa, x_cube, x));
        const float t = tanhf(inner);
        const float left = MOE_GP_MULF(0.5f, x);
        const float right = MOE_GP_ADDF(1.0f, t);
        const float left_d = MOE_GP_MULF(0.5f, right);
        const float tanh_d = MOE_GP_FMAF(-t, t, 1.0f);
        const float inner_d =
            MOE_GP_MULF(k_beta, MOE_GP_FMAF(MOE_GP_MULF(3.0f, k_kappa), x_sq, 1.0f));
        const float right_d = MOE_GP_MULF(MOE_GP_MULF(left, tanh_d), inner_d);
        return moe_gp_rnd(dt, MOE_GP_MULF(dy, MOE_GP_ADDF(left_d, right_d)));
    }
    /* ReluBackward is threshold_backward(dy, relu(x), 0) = (r <= 0 ? 0 : dy): a NaN input
     * passes the gradient (relu) or the NaN of PowBackward's dy * 2r (squared_relu) */
    case MOE_ACT_RELU:
        return x <= 0.0f ? 0.0f : dy;
    case MOE_ACT_SQUARED_RELU: { /* PowBackward: dy * (2 * r), 2 * r a dtype tensor (fp16: inf
                                   * from r >= 32768 on), then ReluBackward */
        const float r = x > 0.0f || x != x ? x : 0.0f;
        return r <= 0.0f ? 0.0f
                         : moe_gp_rnd(dt, MOE_GP_MULF(dy, moe_gp_rnd(dt, MOE_GP_MULF(2.0f, r))));
    }
    case MOE_ACT_QUICK_GELU: { /* x * sg with sg = sigmoid(t), t = 1.702 x */
        const float t = moe_gp_rnd(dt, MOE_GP_MULF(x, (float)1.702));
        const float sg = moe_gp_rnd(dt, MOE_GP_DIVF(1.0f, MOE_GP_ADDF(1.0f, expf(-t))));
        const float gx_direct = moe_gp_rnd(dt, MOE_GP_MULF(dy, sg));
        const float g_sg = moe_gp_rnd(dt, MOE_GP_MULF(dy, x));
        /* sigmoid_backward: a * (1 - b) * b in float, except for fp16, whose torch Half operators
         * round every step */
        const float g_t =
            dt == MOE_DTYPE_FP16
                ? moe_gp_rnd(dt, MOE_GP_MULF(moe_gp_rnd(dt, MOE_GP_MULF(g_sg, moe_gp_rnd(dt, MOE_GP_SUBF(1.0f, sg)))), sg))
                : moe_gp_rnd(dt, MOE_GP_MULF(MOE_GP_MULF(g_sg, MOE_GP_SUBF(1.0f, sg)), sg));
        const float gx_chain = moe_gp_rnd(dt, MOE_GP_MULF(g_t, (float)1.702));
        return moe_gp_rnd(dt, MOE_GP_ADDF(gx_direct, gx_chain));
    }
    }
    return 0.0f;
}

/* ---- the same in double, for fp64 (no rounding points: every tensor is fp64) ---------------- */

MOE_HD static inline double moe_gp_act_fwd_d(int act, double x) {
    switch (act) {
    case MOE_ACT_SILU:
        return MOE_GP_DIVD(x, MOE_GP_ADDD(1.0, exp(-x)));
    case MOE_ACT_GELU:
        return MOE_GP_MULD(MOE_GP_MULD(x, 0.5), MOE_GP_ADDD(1.0, erf(MOE_GP_MULD(x, MOE_GP_SQRT1_2))));
    case MOE_ACT_GELU_TANH: {
        const double k_beta = MOE_GP_SQRT2 * MOE_GP_2_SQRTPI * 0.5, k_kappa = 0.044715;
        const double x_cube = MOE_GP_MULD(MOE_GP_MULD(x, x), x);
        const double inner = MOE_GP_MULD(k_beta, MOE_GP_FMAD(k_kappa, x_cube, x));
        return MOE_GP_MULD(MOE_GP_MULD(0.5, x), MOE_GP_ADDD(1.0, tanh(inner)));
    }
    case MOE_ACT_RELU:
        return x > 0.0 || x != x ? x : 0.0;
    case MOE_ACT_SQUARED_RELU: {
        const double r = x > 0.0 || x != x ? x : 0.0;
        return MOE_GP_MULD(r, r);
    }
    case MOE_ACT_QUICK_GELU: {
        const double t = MOE_GP_MULD(x, 1.702);
        return MOE_GP_MULD(x, MOE_GP_DIVD(1.0, MOE_GP_ADDD(1.0, exp(-t))));
    }
    }
    return 0.0;
}

MOE_HD static inline double moe_gp_act_bwd_d(int act, double dy, double x) {
    switch (act) {
    case MOE_ACT_SILU: {
        const double sig = MOE_GP_DIVD(1.0, MOE_GP_ADDD(1.0, exp(-x)));
        return MOE_GP_MULD(MOE_GP_MULD(dy, sig),
                           MOE_GP_FMAD(x, MOE_GP_SUBD(1.0, sig), 1.0));
    }
    case MOE_ACT_GELU: {
        const double k_beta = MOE_GP_2_SQRTPI * MOE_GP_SQRT1_2 * 0.5;
        const double cdf = MOE_GP_MULD(0.5, MOE_GP_ADDD(1.0, erf(MOE_GP_MULD(x, MOE_GP_SQRT1_2))));
        const double pdf = MOE_GP_MULD(k_beta, exp(MOE_GP_MULD(MOE_GP_MULD(x, x), -0.5)));
        return MOE_GP_MULD(dy, MOE_GP_ADDD(cdf, MOE_GP_MULD(x, pdf)));
    }
    case MOE_ACT_GELU_TANH: {
        const double k_beta = MOE_GP_SQRT2 * MOE_GP_2_SQRTPI * 0.5, k_kappa = 0.044715;
        const double x_sq = MOE_GP_MULD(x, x);
        const double x_cube = MOE_GP_MULD(x_sq, x);
        const double inner = MOE_GP_MULD(k_beta, MOE_GP_FMAD(k_kappa, x_cube, x));
        const double t = tanh(inner);
        const double left = MOE_GP_MULD(0.5, x);
        const double left_d = MOE_GP_MULD(0.5, MOE_GP_ADDD(1.0, t));
        const double tanh_d = MOE_GP_FMAD(-t, t, 1.0);
        const double inner_d =
            MOE_GP_MULD(k_beta, MOE_GP_FMAD(MOE_GP_MULD(3.0, k_kappa), x_sq, 1.0));
        const double right_d = MOE_GP_MULD(MOE_GP_MULD(left, tanh_d), inner_d);
        return MOE_GP_MULD(dy, MOE_GP_ADDD(left_d, right_d));
    }
    case MOE_ACT_RELU: /* threshold_backward: NaN passes, as in the float version */
        return x <= 0.0 ? 0.0 : dy;
    case MOE_ACT_SQUARED_RELU: {
        const double r = x > 0.0 || x != x ? x : 0.0;
        return r <= 0.0 ? 0.0 : MOE_GP_MULD(dy, MOE_GP_MULD(2.0, r));
    }
    case MOE_ACT_QUICK_GELU: {
        const double t = MOE_GP_MULD(x, 1.702);
        const double sg = MOE_GP_DIVD(1.0, MOE_GP_ADDD(1.0, exp(-t)));
        const double g_t = MOE_GP_MULD(MOE_GP_MULD(MOE_GP_MULD(dy, x), MOE_GP_SUBD(1.0, sg)), sg);
        return MOE_GP_ADDD(MOE_GP_MULD(dy, sg), MOE_GP_MULD(g_t, 1.702));
    }
    }
    return 0.0;
}

/* ---- one output element ---------------------------------------------------------------------
 * g, l: the gate and linear inputs as loaded (dtype values; l unused without GLU), p: the row's
 * prob (probs dtype value; unused without probs).
 *
 * Two versions of the same math. The _f functions take and return floats; they serve every case
 * moe_gp_float_math accepts (neither the dtype nor the product dtype is fp64), where every value
 * of the sequence is a float. The double functions serve all cases and call the _f ones there
 * (widening exactly), so both give the same bits. The CUDA kernels call the _f functions: on the
 * GPU a conversion to or from double runs at a fraction of the float rate, and a dozen of them per
 * element made the double path several times slower than its memory traffic. */

MOE_HD static inline int moe_gp_float_math(const moe_gp_ctx_t *c) {
    return c->dtype != MOE_DTYPE_FP64 && c->prod_dtype != MOE_DTYPE_FP64;
}

/* The forward's values before the probs multiply (float dtypes): the clamped inputs, the
 * activation s, the linear factor l2 (1 without GLU) and h0; pass_g / pass_l are ClampBackward's
 * masks, which compare strictly against the bound rounded to the tensor's dtype (in fp16 2.01
 * becomes 2.0098, so an input of exactly 2.0098 gets no gradient). */
typedef struct moe_gp_fwd_vals {
    float g, l, s, l2, h0;
    int pass_g, pass_l;
} moe_gp_fwd_vals_t;

MOE_HD static inline moe_gp_fwd_vals_t moe_gp_fwd_vals_f(const moe_gp_ctx_t *c, float g, float l) {
    const moe_dtype_t dt = c->dtype;
    moe_gp_fwd_vals_t v;
    v.pass_g = v.pass_l = 1;
    if (c->gated && c->has_clamp) {
        const float b = c->clamp_f, bb = moe_gp_rnd(dt, b);
        v.pass_g = g < bb;
        v.pass_l = l > -bb && l < bb;
        g = g > b ? bb : g;
        l = l < -b ? moe_gp_rnd(dt, -b) : (l > b ? bb : l);
    }
    v.g = g;
    v.l = l;
    v.s = moe_gp_act_fwd_f(c->act, dt, g);
    v.l2 = c->gated ? moe_gp_rnd(dt, MOE_GP_ADDF(l, c->offset_f)) : 1.0f;
    v.h0 = c->gated ? moe_gp_rnd(dt, MOE_GP_MULF(v.s, v.l2)) : v.s;
    return v;
}

/* The backward from the gradient reaching h0 (gh0, a dtype value) on: MulBackward of s * l2, the
 * activation's backward at the clamped g, the clamp masks. */
MOE_HD static inline void moe_gp_bwd_from_gh0_f(const moe_gp_ctx_t *c, const moe_gp_fwd_vals_t *v,
                                                float gh0, float *grad_g, float *grad_l) {
    const moe_dtype_t dt = c->dtype;
    if (c->gated) {
        const float gs = moe_gp_rnd(dt, MOE_GP_MULF(gh0, v->l2));
        *grad_l = v->pass_l ? moe_gp_rnd(dt, MOE_GP_MULF(gh0, v->s)) : 0.0f;
        *grad_g = v->pass_g ? moe_gp_act_bwd_f(c->act, dt, gs, v->g) : 0.0f;
    } else {
        *grad_l = 0.0f;
        *grad_g = moe_gp_act_bwd_f(c->act, dt, gh0, v->g);
    }
}

/* h, when moe_gp_float_math(c): (h0 * p) rounded to the product dtype, then to dtype. */
MOE_HD static inline float moe_gp_elem_fwd_f(const moe_gp_ctx_t *c, float g, float l, float p) {
    const float h0 = moe_gp_fwd_vals_f(c, g, l).h0;
    if (!c->has_probs) return h0;
    return moe_gp_rnd(c->dtype, moe_gp_rnd(c->prod_dtype, MOE_GP_MULF(h0, p)));
}

/* Gradients of one element, when moe_gp_float_math(c): *grad_g, *grad_l (dtype values; grad_l 0
 * without GLU), the row-sum term of grad_probs, grad_h * h0 rounded to the product dtype (0
 * without probs), and, when h is not NULL, the forward's output h recomputed. */
MOE_HD static inline void moe_gp_elem_bwd_f(const moe_gp_ctx_t *c, float dy, float g, float l,
                                            float p, float *grad_g, float *grad_l, float *term,
                                            float *h) {
    const moe_gp_fwd_vals_t v = moe_gp_fwd_vals_f(c, g, l);
    const moe_dtype_t dt = c->dtype, pt = c->prod_dtype;
    float gh0 = dy;
    *term = 0.0f;
    if (h) *h = v.h0;
    if (c->has_probs) {
        gh0 = moe_gp_rnd(dt, moe_gp_rnd(pt, MOE_GP_MULF(dy, p)));
        *term = moe_gp_rnd(pt, MOE_GP_MULF(dy, v.h0));
        if (h) *h = moe_gp_rnd(dt, moe_gp_rnd(pt, MOE_GP_MULF(v.h0, p)));
    }
    moe_gp_bwd_from_gh0_f(c, &v, gh0, grad_g, grad_l);
}

MOE_HD static inline double moe_gp_elem_fwd(const moe_gp_ctx_t *c, double g, double l, double p) {
    if (c->dtype != MOE_DTYPE_FP64) {
        if (c->prod_dtype != MOE_DTYPE_FP64)
            return (double)moe_gp_elem_fwd_f(c, (float)g, (float)l, (float)p);
        /* a half or fp32 tensor times fp64 probs: the product in fp64, rounded to dtype */
        const float h0 = moe_gp_fwd_vals_f(c, (float)g, (float)l).h0;
        return c->has_probs ? (double)moe_gp_rnd(c->dtype, (float)MOE_GP_MULD((double)h0, p))
                            : (double)h0;
    }
    double h0;
    if (c->gated) {
        if (c->has_clamp) {
            g = g > c->clamp_d ? c->clamp_d : g;
            l = l < -c->clamp_d ? -c->clamp_d : (l > c->clamp_d ? c->clamp_d : l);
        }
        h0 = MOE_GP_MULD(moe_gp_act_fwd_d(c->act, g), MOE_GP_ADDD(l, c->offset_d));
    } else {
        h0 = moe_gp_act_fwd_d(c->act, g);
    }
    return c->has_probs ? MOE_GP_MULD(h0, p) : h0;
}

/* moe_gp_elem_bwd_f for every case, in doubles; h may be NULL. */
MOE_HD static inline void moe_gp_elem_bwd(const moe_gp_ctx_t *c, double dy, double g, double l,
                                          double p, double *grad_g, double *grad_l,
                                          double *term, double *h) {
    if (c->dtype == MOE_DTYPE_FP64) {
        const double v = c->clamp_d;
        /* ClampBackward's mask is strict (x < max, x > min; a value at the bound gets 0) */
        const int pass_g = !c->gated || !c->has_clamp || g < v;
        const int pass_l = !c->has_clamp || (l > -v && l < v);
        if (c->gated && c->has_clamp) {
            g = g > v ? v : g;
            l = l < -v ? -v : (l > v ? v : l);
        }
        const double s = moe_gp_act_fwd_d(c->act, g);
        const double l2 = c->gated ? MOE_GP_ADDD(l, c->offset_d) : 1.0;
        const double h0 = c->gated ? MOE_GP_MULD(s, l2) : s;
        double gh0 = dy;
        *term = 0.0;
        if (h) *h = h0;
        if (c->has_probs) {
            gh0 = MOE_GP_MULD(dy, p);
            *term = MOE_GP_MULD(dy, h0);
            if (h) *h = MOE_GP_MULD(h0, p);
        }
        if (c->gated) {
            const double gs = MOE_GP_MULD(gh0, l2);
            *grad_l = pass_l ? MOE_GP_MULD(gh0, s) : 0.0;
            *grad_g = pass_g ? moe_gp_act_bwd_d(c->act, gs, g) : 0.0;
        } else {
            *grad_l = 0.0;
            *grad_g = moe_gp_act_bwd_d(c->act, gh0, g);
        }
        return;
    }
    float gg, gl;
    if (c->prod_dtype != MOE_DTYPE_FP64) {
        float t, hf;
        moe_gp_elem_bwd_f(c, (float)dy, (float)g, (float)l, (float)p, &gg, &gl, &t, h ? &hf : NULL);
        *term = t;
        if (h) *h = hf;
    } else {
        /* a half or fp32 tensor times fp64 probs: the products in fp64 */
        const moe_gp_fwd_vals_t v = moe_gp_fwd_vals_f(c, (float)g, (float)l);
        float gh0 = (float)dy;
        *term = 0.0;
        if (h) *h = v.h0;
        if (c->has_probs) {
            gh0 = moe_gp_rnd(c->dtype, (float)MOE_GP_MULD(dy, p));
            *term = MOE_GP_MULD(dy, (double)v.h0);
            if (h) *h = moe_gp_rnd(c->dtype, (float)MOE_GP_MULD((double)v.h0, p));
        }
        moe_gp_bwd_from_gh0_f(c, &v, gh0, &gg, &gl);
    }
    *grad_g = gg;
    *grad_l = gl;
}

/* Elements per reduction chunk: one 16-byte vector when F is a multiple of it, else 1. The CPU and
 * the CUDA kernel both sum chunk j of a row into lane j % 32 (in element order), then fold the 32
 * lanes by the warp butterfly (offsets 16, 8, 4, 2, 1), all in fp64: the same order, so the same
 * bits on both devices. */
MOE_HD static inline int64_t moe_gp_chunk(moe_dtype_t dt, int64_t ffn) {
    const int64_t v = dt == MOE_DTYPE_FP64 ? 2 : (dt == MOE_DTYPE_FP32 ? 4 : 8);
    return ffn % v == 0 ? v : 1;
}

/* The reduced sum, rounded to the product dtype then to the probs dtype (the engine's cast). */
MOE_HD static inline double moe_gp_grad_probs_round(const moe_gp_ctx_t *c, double sum) {
    if (c->prod_dtype == MOE_DTYPE_FP64)
        return c->probs_dtype == MOE_DTYPE_FP64 ? sum : (double)moe_gp_rnd(c->probs_dtype, (float)sum);
    return (double)moe_gp_rnd(c->probs_dtype, moe_gp_rnd(c->prod_dtype, (float)sum));
}

/* ---- 16-byte vectors (CUDA): the element loop of glu_probs.cu's forward kernel --------------- */
#ifdef __CUDACC__
union moe_gp_vec {
    uint4 u;
    uint16_t h[8];
    float f[4];
    double d[2];
};

/* Elements of dtype DT in 16 bytes. */
template <int DT>
__device__ __forceinline__ constexpr int moe_gp_vec_n() {
    return DT == MOE_DTYPE_FP64 ? 2 : (DT == MOE_DTYPE_FP32 ? 4 : 8);
}

template <int DT>
__device__ __forceinline__ double moe_gp_vget(const moe_gp_vec &v, int e) {
    if (DT == MOE_DTYPE_FP64) return v.d[e];
    if (DT == MOE_DTYPE_FP32) return (double)v.f[e];
    if (DT == MOE_DTYPE_BF16) return (double)moe_bf16_to_float(v.h[e]);
    return (double)moe_fp16_to_float(v.h[e]);
}

template <int DT>
__device__ __forceinline__ void moe_gp_vset(moe_gp_vec &v, int e, double x) {
    if (DT == MOE_DTYPE_FP64) v.d[e] = x;
    else if (DT == MOE_DTYPE_FP32) v.f[e] = (float)x;
    else if (DT == MOE_DTYPE_BF16) v.h[e] = moe_float_to_bf16((float)x);
    else v.h[e] = moe_float_to_fp16((float)x);
}

/* The same as floats, for the dtypes other than fp64 (the _f element functions). */
template <int DT>
__device__ __forceinline__ float moe_gp_vgetf(const moe_gp_vec &v, int e) {
    if (DT == MOE_DTYPE_FP32) return v.f[e];
    if (DT == MOE_DTYPE_BF16) return moe_bf16_to_float(v.h[e]);
    return moe_fp16_to_float(v.h[e]);
}

template <int DT>
__device__ __forceinline__ void moe_gp_vsetf(moe_gp_vec &v, int e, float x) {
    if (DT == MOE_DTYPE_FP32) v.f[e] = x;
    else if (DT == MOE_DTYPE_BF16) v.h[e] = moe_float_to_bf16(x);
    else v.h[e] = moe_float_to_fp16(x);
}

/* h for one vector: g, l the gate and linear vectors of a (l ignored without GLU), p the row's
 * prob. c->dtype must be DT; FLT: moe_gp_float_math(c) holds (the float element functions). */
template <int DT, bool FLT>
__device__ __forceinline__ uint4 moe_gp_vec_fwd(const moe_gp_ctx_t *c, uint4 g_bits, uint4 l_bits,
                                                double p) {
    moe_gp_vec g, l, out;
    g.u = g_bits;
    l.u = l_bits;
    if constexpr (FLT && DT != MOE_DTYPE_FP64) {
        const float pf = (float)p;
#pragma unroll
        for (int e = 0; e < moe_gp_vec_n<DT>(); ++e)
            moe_gp_vsetf<DT>(out, e, moe_gp_elem_fwd_f(c, moe_gp_vgetf<DT>(g, e),
                                                       c->gated ? moe_gp_vgetf<DT>(l, e) : 0.0f, pf));
    } else {
#pragma unroll
        for (int e = 0; e < moe_gp_vec_n<DT>(); ++e)
            moe_gp_vset<DT>(out, e, moe_gp_elem_fwd(c, moe_gp_vget<DT>(g, e),
                                                    c->gated ? moe_gp_vget<DT>(l, e) : 0.0, p));
    }
    return out.u;
}
#endif /* __CUDACC__ */

/* Argument checks shared by both entry points (host code). */
static inline moe_status_t moe_gp_check_args(const void *out, const void *a, int64_t num_rows,
                                             int64_t ffn, moe_dtype_t dtype, const void *probs,
                                             moe_dtype_t probs_dtype,
                                             const moe_glu_probs_params_t *p) {
    MOE_CHECK(p != NULL, "params must not be NULL");
    MOE_CHECK(num_rows >= 0, "num_rows must be >= 0, got %lld", (long long)num_rows);
    MOE_CHECK(ffn >= 1, "ffn must be >= 1, got %lld", (long long)ffn);
    MOE_CHECK(moe_is_float_dtype(dtype), "dtype must be a float dtype, got %s",
              moe_dtype_name(dtype));
    MOE_CHECK(!probs || moe_is_float_dtype(probs_dtype), "probs_dtype must be a float dtype, got %s",
              moe_dtype_name(probs_dtype));
    MOE_TRY(moe_check_activation(p->activation));
    MOE_CHECK(!p->has_clamp || p->clamp_value >= 0.0,
              "clamp_value must be >= 0 (the linear half is clamped to [-v, v]), got %g",
              p->clamp_value);
    MOE_CHECK(p->interleave >= 0, "interleave must be >= 0, got %lld", (long long)p->interleave);
    MOE_CHECK(p->interleave == 0 || p->gated_linear_unit,
              "interleave=%lld needs gated_linear_unit (it orders the gate and linear columns)",
              (long long)p->interleave);
    MOE_CHECK(p->interleave == 0 || ffn % p->interleave == 0,
              "interleave=%lld must divide ffn=%lld (whole blocks of gate and linear columns)",
              (long long)p->interleave, (long long)ffn);
    MOE_CHECK(num_rows == 0 || (out && a), "the output and a must not be NULL");
    /* a is [num_rows, 2 ffn] with GLU: that element count must fit in int64 */
    int64_t width;
    MOE_CHECK(!moe_checked_mul_i64(ffn, p->gated_linear_unit ? 2 : 1, &width),
              "ffn=%lld: the GLU input width 2 * ffn overflows int64", (long long)ffn);
    return moe_check_mul(num_rows, "num_rows", width, p->gated_linear_unit ? "2 * ffn" : "ffn");
}

#endif /* MOE_CORE_GLU_PROBS_MATH_H_ */
