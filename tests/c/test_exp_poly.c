/* test_exp_poly.c: the CUDA router's polynomial exp (csrc/cuda/exp_poly_math.h), rounded to fp32,
 * against glibc's exp over the fp32 inputs: every MOE_EXP_POLY_STRIDE-th bit pattern (61 by
 * default, 70 M inputs; 1 = all 2^32) and the edges of its ranges. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ctest.h"
#include "cuda/exp_poly_math.h"

static const double coef[15] = MOE_EXP_POLY_COEFS;

static float sigmoid_ref(float x) { return (float)(1.0 / (1.0 + exp(-(double)x))); }
static float expf_ref(float d) { return (float)exp((double)d); }

/* bitwise equal, or both NaN */
static int same(float a, float b) {
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    return ua == ub || (a != a && b != b);
}

static void test_exp_poly_rounds_as_glibc(void) {
    const char *env = getenv("MOE_EXP_POLY_STRIDE");
    long long stride = env ? atoll(env) : 61;
    if (stride < 1) stride = 1;
    long long bad_sig = 0, bad_exp = 0, first_sig = -1, first_exp = -1;
#pragma omp parallel for schedule(static) reduction(+ : bad_sig, bad_exp)
    for (long long b = 0; b < (1LL << 32); b += stride) {
        const uint32_t bits = (uint32_t)b;
        float x;
        memcpy(&x, &bits, 4);
        if (!same(moe_sigmoid_poly_f(coef, x), sigmoid_ref(x))) {
            ++bad_sig;
#pragma omp critical
            if (first_sig < 0) first_sig = b;
        }
        if ((bits >> 31 || bits == 0) && !same(moe_expf_poly_f(coef, x), expf_ref(x))) {
            ++bad_exp;
#pragma omp critical
            if (first_exp < 0) first_exp = b;
        }
    }
    CHECK(bad_sig == 0, "sigmoid: %lld mismatches (stride %lld), one at bits 0x%llx", bad_sig,
          stride, first_sig);
    CHECK(bad_exp == 0, "exp: %lld mismatches (stride %lld), one at bits 0x%llx", bad_exp, stride,
          first_exp);
    /* the clamp, the fp32 under- and overflow edges, infinities, NaN, zeros */
    const float edge[] = {0.0f, -0.0f, 708.0f, -708.0f, 708.5f, -708.5f, 103.27f, -103.27f,
                          103.28f, -103.28f, 88.72f, -88.72f, 87.33f, -87.34f, 16.64f, -16.64f,
                          1e-8f, -1e-8f, 1e30f, -1e30f, INFINITY, -INFINITY, NAN, 1e-45f};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; ++i) {
        const float x = edge[i];
        CHECK(same(moe_sigmoid_poly_f(coef, x), sigmoid_ref(x)), "sigmoid(%a)", x);
        const float d = x > 0.0f ? -x : x;
        CHECK(same(moe_expf_poly_f(coef, d), expf_ref(d)), "exp(%a)", d);
    }
}

void ctest_register_exp_poly(void) {
    ctest_add("exp_poly_rounds_as_glibc", test_exp_poly_rounds_as_glibc);
}
