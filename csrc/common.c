/*
 * common.c: status strings, the thread-local error message, dtype sizes, the overflow and option
 * checks shared by every op's argument check.
 *
 * The message buffer is thread-local, so concurrent callers (PyTorch's inter-op threads, the
 * autograd engine's device threads) never read each other's errors.
 */
#include <stdarg.h>
#include <stdio.h>

#include "common.h"

static _Thread_local char moe_error_message[1024];

moe_status_t moe_fail(moe_status_t status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(moe_error_message, sizeof moe_error_message, fmt, args);
    va_end(args);
    return status;
}

void moe_clear_error(void) { moe_error_message[0] = '\0'; }

size_t moe_fail_size(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(moe_error_message, sizeof moe_error_message, fmt, args);
    va_end(args);
    return MOE_SIZE_OVERFLOW;
}

moe_status_t moe_check_mul(int64_t a, const char *a_name, int64_t b, const char *b_name) {
    int64_t product;
    MOE_CHECK(!moe_checked_mul_i64(a, b, &product),
              "%s=%lld times %s=%lld overflows int64", a_name, (long long)a, b_name,
              (long long)b);
    return MOE_OK;
}

/* An option table's rows as a value test and as the list a message shows ("softmax (0), ..."). */
#define MOE_IS_ROW_(enumerator, value, name) || v == enumerator
#define MOE_LISTED_ROW_(enumerator, value, name) name " (" #value "), "

moe_status_t moe_check_score_function(moe_score_function_t v) {
    MOE_CHECK(0 MOE_SCORE_FUNCTIONS(MOE_IS_ROW_),
              "score_function must be one of " MOE_SCORE_FUNCTIONS(MOE_LISTED_ROW_) "got %d",
              (int)v);
    return MOE_OK;
}

moe_status_t moe_check_activation(moe_activation_t v) {
    MOE_CHECK(0 MOE_ACTIVATIONS(MOE_IS_ROW_),
              "activation must be one of " MOE_ACTIVATIONS(MOE_LISTED_ROW_) "got %d", (int)v);
    return MOE_OK;
}

moe_status_t moe_check_workspace(const void *workspace, size_t have, size_t need, const char *fn) {
    if (need == MOE_SIZE_OVERFLOW) return MOE_ERR_INVALID_ARGUMENT; /* message: the size function's */
    MOE_CHECK(need == 0 || (workspace != NULL && have >= need),
              "workspace too small: %zu bytes, need %zu (%s)", have, need, fn);
    return MOE_OK;
}

const char *moe_last_error(void) { return moe_error_message; }

const char *moe_status_string(moe_status_t status) {
    switch (status) {
    case MOE_OK: return "MOE_OK";
    case MOE_ERR_INVALID_ARGUMENT: return "MOE_ERR_INVALID_ARGUMENT";
    case MOE_ERR_UNSUPPORTED: return "MOE_ERR_UNSUPPORTED";
    case MOE_ERR_CUDA: return "MOE_ERR_CUDA";
    case MOE_ERR_INTERNAL: return "MOE_ERR_INTERNAL";
    }
    return "MOE_ERR_UNKNOWN";
}

size_t moe_dtype_size(moe_dtype_t dtype) {
    switch (dtype) {
    case MOE_DTYPE_FP32: return 4;
    case MOE_DTYPE_FP64: return 8;
    case MOE_DTYPE_FP16: return 2;
    case MOE_DTYPE_BF16: return 2;
    case MOE_DTYPE_INT32: return 4;
    case MOE_DTYPE_INT64: return 8;
    case MOE_DTYPE_BOOL: return 1;
    }
    return 0;
}

int moe_has_cuda(void) {
#ifdef MOE_CORE_WITH_CUDA
    return 1;
#else
    return 0;
#endif
}
