/* test_common.c: half-precision conversions, status strings, the error buffer and the option
 * tables' checks. */
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "ctest.h"

/* Every bf16 and fp16 bit pattern widens exactly and narrows back to itself (NaN stays NaN). */
static void test_half_round_trip(void) {
    for (uint32_t h = 0; h < 65536; ++h) {
        float b = moe_bf16_to_float((uint16_t)h), f = moe_fp16_to_float((uint16_t)h);
        if (b == b) CHECK(moe_float_to_bf16(b) == h, "bf16 %04x -> %g -> %04x", h, b, moe_float_to_bf16(b));
        else CHECK(moe_float_to_bf16(b) != moe_float_to_bf16(1.0f), "bf16 NaN %04x", h);
        if (f == f) CHECK(moe_float_to_fp16(f) == h, "fp16 %04x -> %g -> %04x", h, f, moe_float_to_fp16(f));
        else CHECK((moe_float_to_fp16(f) & 0x7c00u) == 0x7c00u && (moe_float_to_fp16(f) & 0x3ffu), "fp16 NaN");
    }
}

/* Narrowing rounds to nearest, ties to even: the midpoint between two bf16 values goes to the
 * even one, and a hair above it goes up. */
static void test_half_rounding(void) {
    float one = 1.0f, next = moe_bf16_to_float(0x3f81); /* 1 + 2^-7 */
    float mid = (one + next) / 2.0f;
    CHECK(moe_float_to_bf16(mid) == 0x3f80, "tie goes to even: %04x", moe_float_to_bf16(mid));
    CHECK(moe_float_to_bf16(nextafterf(mid, 2.0f)) == 0x3f81, "above the tie rounds up");
    float h1 = moe_fp16_to_float(0x3c00), h2 = moe_fp16_to_float(0x3c01);
    CHECK(moe_float_to_fp16((h1 + h2) / 2.0f) == 0x3c00, "fp16 tie to even");
    CHECK(moe_float_to_fp16(65520.0f) == 0x7c00, "fp16 overflow rounds to inf");
    CHECK(moe_float_to_fp16(65519.0f) == 0x7bff, "fp16 max finite");
    CHECK(moe_float_to_fp16(moe_fp16_to_float(0x0001) * 0.5f) == 0x0000, "half the smallest subnormal ties to 0");
    CHECK(moe_float_to_fp16(moe_fp16_to_float(0x0001) * 1.5f) == 0x0002, "1.5 subnormal ties to even 2");
}

static void test_status_and_errors(void) {
    CHECK(strcmp(moe_status_string(MOE_ERR_INVALID_ARGUMENT), "MOE_ERR_INVALID_ARGUMENT") == 0, "name");
    CHECK(moe_dtype_size(MOE_DTYPE_BF16) == 2 && moe_dtype_size(MOE_DTYPE_INT64) == 8, "sizes");
    moe_router_topk_params_t p = {9, 0, 0, 0, MOE_SCORE_SOFTMAX, 0.0, MOE_TOPK_NORM_DEFAULT, 0};
    moe_status_t st = moe_router_topk_check(&p, 8, 0);
    CHECK(st == MOE_ERR_INVALID_ARGUMENT, "topk > E rejected");
    CHECK(strstr(moe_last_error(), "topk=9") != NULL, "message names the value: %s", moe_last_error());
}

/* The option tables (moe_types.h, moe_experts.h) and their one check each: every row's value
 * passes; the value past the last row is refused with a message that lists every row as
 * "name (value)" and names the bad value. */
#define MOE_TEST_ROW_COUNT(enumerator, value, name) +1
#define MOE_TEST_ROW_LISTED(enumerator, value, name)                                              \
    CHECK(strstr(moe_last_error(), name " (" #value ")") != NULL, "%s missing from: %s", name,   \
          moe_last_error());
#define MOE_TEST_OPTION_TABLE(TABLE, check, type, what)                                          \
    do {                                                                                          \
        const int rows = 0 TABLE(MOE_TEST_ROW_COUNT);                                             \
        char got[32];                                                                             \
        for (int v = 0; v < rows; ++v) CHECK(check((type)v) == MOE_OK, what " %d passes", v);     \
        CHECK(check((type)rows) == MOE_ERR_INVALID_ARGUMENT, what " %d refused", rows);           \
        CHECK(strncmp(moe_last_error(), what " must be one of ", strlen(what) + 13) == 0,         \
              "names the argument: %s", moe_last_error());                                        \
        TABLE(MOE_TEST_ROW_LISTED)                                                                \
        snprintf(got, sizeof got, "got %d", rows);                                                \
        CHECK(strstr(moe_last_error(), got) != NULL, "names the value: %s", moe_last_error());   \
    } while (0)

static void test_option_tables(void) {
    MOE_TEST_OPTION_TABLE(MOE_SCORE_FUNCTIONS, moe_check_score_function, moe_score_function_t,
                          "score_function");
    MOE_TEST_OPTION_TABLE(MOE_ACTIVATIONS, moe_check_activation, moe_activation_t, "activation");
}

void ctest_register_common(void) {
    ctest_add("half_round_trip", test_half_round_trip);
    ctest_add("half_rounding", test_half_rounding);
    ctest_add("status_and_errors", test_status_and_errors);
    ctest_add("option_tables", test_option_tables);
}
