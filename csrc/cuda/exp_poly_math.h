/*
 * exp_poly_math.h: the fp64 exp that the CUDA router's lanes kernel evaluates instead of the
 * library's (csrc/cuda/router_topk_lanes.cu), and its host reference.
 *
 * a = k·ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so k·hi is exact), e^r by its Taylor
 * series to degree 13 (truncation < 0.03 ulp), then k added to the exponent field: 17 FMAs, no
 * table, nothing that diverges. The one property that matters: rounded to fp32 it gives what
 * glibc's exp gives, so the CUDA router's scores equal the C core's bit for bit.
 * tests/c/test_exp_poly.c checks (float)(1 / (1 + exp(-x))) and (float)exp(d), d <= 0, on a
 * stride of the fp32 inputs; MOE_EXP_POLY_STRIDE=1 checks all 2^32 of them (the full sweep's
 * result is in docs/perf-history.md).
 *
 * C11 and CUDA C++ alike; the functions are host-only (the kernel keeps its own batched copy of
 * the same operations, with the coefficients in constant memory).
 */
#ifndef MOE_CORE_EXP_POLY_MATH_H_
#define MOE_CORE_EXP_POLY_MATH_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

/* 1/13!, 1/12!, ..., 1/2!, then ln2's high and low parts and log2(e). */
#define MOE_EXP_POLY_COEFS                                                                      \
    {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, \
     1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5,         \
     6.93147180369123816490e-01, 1.90821492927058770002e-10, 1.4426950408889634}

/* exp(a) for |a| <= 708, c = MOE_EXP_POLY_COEFS; moe_exp_fd_n in router_topk_lanes.cu performs
 * these operations in this order. */
static inline double moe_exp_poly(const double *c, double a) {
    const double kd = rint(a * c[14]);
    double r = fma(-kd, c[12], a);
    r = fma(-kd, c[13], r);
    double p = c[0];
    for (int j = 1; j < 12; ++j) p = fma(p, r, c[j]);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    uint64_t u;
    memcpy(&u, &p, sizeof u);
    u += (uint64_t)(int64_t)kd << 52; /* k into the exponent field (the kernel: the high word) */
    memcpy(&p, &u, sizeof p);
    return p;
}

/* The lanes kernel's sigmoid, (float)(1 / (1 + exp(-x))): the clamp is exact in fp32, NaN stays. */
static inline float moe_sigmoid_poly_f(const double *c, float x) {
    const double a = (double)fminf(fmaxf(-x, -708.0f), 708.0f);
    const float y = (float)(1.0 / (1.0 + moe_exp_poly(c, a)));
    return x != x ? x : y;
}

/* The lanes kernel's softmax term, (float)exp(d) for d <= 0 or NaN. */
static inline float moe_expf_poly_f(const double *c, float d) {
    return d != d ? d : (float)moe_exp_poly(c, (double)fmaxf(d, -708.0f));
}

#endif
