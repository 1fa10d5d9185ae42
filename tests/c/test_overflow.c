/* test_overflow.c: the checked int64 helpers, and every CPU size function on arguments whose size
 * does not fit (MOE_SIZE_OVERFLOW or -1, with a message naming the argument). */
#include <string.h>

#include "common.h"
#include "ctest.h"

static void test_checked_helpers(void) {
    int64_t r = 0;
    CHECK(moe_checked_add_i64(INT64_MAX - 1, 1, &r) == 0 && r == INT64_MAX, "max - 1 + 1 fits");
    CHECK(moe_checked_add_i64(INT64_MAX, 1, &r) == 1, "max + 1 overflows");
    CHECK(moe_checked_add_i64(INT64_MIN, -1, &r) == 1, "min - 1 overflows");
    CHECK(moe_checked_mul_i64((int64_t)1 << 31, (int64_t)1 << 31, &r) == 0 && r == (int64_t)1 << 62,
          "2^31 * 2^31 fits");
    CHECK(moe_checked_mul_i64((int64_t)1 << 32, (int64_t)1 << 31, &r) == 1, "2^63 overflows");
    CHECK(moe_checked_mul_i64(-1, INT64_MIN, &r) == 1, "-1 * min overflows");
    CHECK(moe_checked_bytes(3, 8) == 24, "3 words");
    CHECK(moe_checked_bytes(-1, 8) == MOE_SIZE_OVERFLOW, "negative count");
    CHECK(moe_checked_bytes(INT64_MAX / 4, 8) == MOE_SIZE_OVERFLOW, "bytes overflow");
    int64_t total = 0;
    CHECK(moe_checked_section(&total, 3, 4, 16) == 0 && total == 16, "12 bytes pad to 16");
    CHECK(moe_checked_section(&total, INT64_MAX / 2, 4, 16) == 1, "section overflows");
    CHECK(moe_check_mul((int64_t)1 << 40, "num_tokens", (int64_t)1 << 30, "num_experts") ==
              MOE_ERR_INVALID_ARGUMENT, "product rejected");
    CHECK(strstr(moe_last_error(), "num_tokens=1099511627776") != NULL &&
              strstr(moe_last_error(), "num_experts=1073741824") != NULL,
          "message names both factors: %s", moe_last_error());
    CHECK(moe_check_workspace(NULL, 0, MOE_SIZE_OVERFLOW, "f") == MOE_ERR_INVALID_ARGUMENT,
          "the sentinel is never a satisfiable workspace");
}

/* The workspace-size functions answer MOE_SIZE_OVERFLOW with a message, never a wrapped size. */
static void test_workspace_sizes_overflow(void) {
    const int64_t huge = INT64_MAX / 2;
    moe_clear_error();
    CHECK(moe_unpermute_workspace_size(huge, huge) == MOE_SIZE_OVERFLOW, "unpermute");
    CHECK(strstr(moe_last_error(), "moe_unpermute_workspace_size") != NULL &&
              strstr(moe_last_error(), "num_rows=4611686018427387903") != NULL,
          "message: %s", moe_last_error());
    CHECK(moe_unpermute_workspace_size(4, 8) == 13 * sizeof(int64_t), "small size unchanged");
    moe_router_topk_params_t p = {huge, 0, 0, 0, MOE_SCORE_SOFTMAX, 0.0, MOE_TOPK_NORM_DEFAULT, 0};
    CHECK(moe_router_topk_workspace_size(8, huge, &p) == MOE_SIZE_OVERFLOW, "router_topk");
    CHECK(strstr(moe_last_error(), "topk=4611686018427387903") != NULL, "%s", moe_last_error());
    CHECK(moe_aux_loss_scores_workspace_size(8, huge, huge) == MOE_SIZE_OVERFLOW, "aux scores");
    CHECK(moe_sinkhorn_workspace_size(huge, 4, 0) == MOE_SIZE_OVERFLOW, "sinkhorn");
    CHECK(moe_sinkhorn_workspace_size((int64_t)1 << 32, (int64_t)1 << 32, 0) == MOE_SIZE_OVERFLOW,
          "sinkhorn T*E");
    CHECK(moe_z_loss_workspace_size(huge, 4) == MOE_SIZE_OVERFLOW, "z_loss");
    CHECK(moe_routing_metrics_workspace_size(huge, 4) == MOE_SIZE_OVERFLOW, "routing_metrics");
    CHECK(moe_switch_aux_loss_workspace_size(4, huge) == MOE_SIZE_OVERFLOW, "switch");
    CHECK(moe_token_dropping_workspace_size(huge, 4, MOE_DROP_PROBS, MOE_DTYPE_FP32) ==
              MOE_SIZE_OVERFLOW,
          "token_dropping");
    moe_grouped_gemm_params_t g = {8, 2, 4, 4, 0, MOE_DTYPE_FP32, MOE_DTYPE_FP32, MOE_GG_GATHER_NONE,
                                   NULL, 0};
    CHECK(moe_grouped_gemm_workspace_size(&g) != MOE_SIZE_OVERFLOW, "grouped gemm: fixed size");
}

/* moe_permute_num_rows: -1 and a message when the row bound overflows (it used to wrap and drop
 * every token past the first expert). */
static void test_permute_num_rows_overflow(void) {
    moe_permute_params_t p = {8, (int64_t)1 << 62, 0};
    moe_clear_error();
    CHECK(moe_permute_num_rows(4, 4, &p) == -1, "align_size=2^62 overflows");
    CHECK(strstr(moe_last_error(), "align_size=4611686018427387904") != NULL, "%s",
          moe_last_error());
    moe_permute_params_t d = {(int64_t)1 << 62, 4, 1};
    CHECK(moe_permute_num_rows(4, 4, &d) == 16 * ((int64_t)1 << 58), "drop_and_pad bound fits");
    moe_permute_params_t d2 = {INT64_MAX - 1, (int64_t)1 << 62, 1};
    CHECK(moe_permute_num_rows(4, 4, &d2) == -1, "drop_and_pad bound overflows");
    CHECK(strstr(moe_last_error(), "drop_and_pad") != NULL, "%s", moe_last_error());
    moe_permute_params_t ok = {8, 4, 0};
    CHECK(moe_permute_num_rows(4, 4, &ok) == 8 + 4 * 3, "small bound unchanged");
}

/* sort_chunks_by_idxs: split sizes whose int64 sum wraps to the row count are rejected before any
 * row moves. */
static void test_sort_chunks_sum_overflow(void) {
    const int64_t split[3] = {INT64_MAX, INT64_MAX, 4};
    const int64_t order[3] = {0, 1, 2};
    uint16_t in[4 * 2] = {0}, out[4 * 2] = {0};
    moe_status_t st = moe_sort_chunks_by_idxs_fwd(out, in, split, order, 4, 2, 3, MOE_DTYPE_BF16,
                                                  NULL, 0, NULL);
    CHECK(st == MOE_ERR_INVALID_ARGUMENT, "wrapped sum rejected");
    CHECK(strstr(moe_last_error(), "split_sizes") != NULL &&
              strstr(moe_last_error(), "9223372036854775807") != NULL,
          "message: %s", moe_last_error());
}

void ctest_register_overflow(void) {
    ctest_add("checked_helpers", test_checked_helpers);
    ctest_add("workspace_sizes_overflow", test_workspace_sizes_overflow);
    ctest_add("permute_num_rows_overflow", test_permute_num_rows_overflow);
    ctest_add("sort_chunks_sum_overflow", test_sort_chunks_sum_overflow);
}
