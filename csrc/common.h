/*
 * common.h: internal helpers shared by the C kernels and the CUDA launchers (not installed).
 *
 * Error reporting, element loads/stores for every moe_dtype_t, and the portable half-precision
 * conversions. The one idea worth knowing: a kernel never returns an error code it made up on the
 * spot; every failure goes through moe_fail(), which formats one message naming the argument and
 * its value into the thread-local buffer that moe_last_error() returns, so the binding can raise
 * it verbatim.
 */
#ifndef MOE_CORE_COMMON_H_
#define MOE_CORE_COMMON_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "checks.h" /* every op's argument check, shared by its CPU and CUDA entry points */
#include "moe_core.h"

/* Marks the small helpers that the CUDA kernels share with the C kernels. */
#ifdef __CUDACC__
#define MOE_HD __host__ __device__
#else
#define MOE_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Records a formatted message for moe_last_error() and returns `status`. */
moe_status_t moe_fail(moe_status_t status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Clears the thread-local message; every public entry point calls it first. */
void moe_clear_error(void);

/* Records a formatted message (as moe_fail) and returns MOE_SIZE_OVERFLOW: how a size function
 * (size_t result, no status to return) reports a size that does not fit. */
size_t moe_fail_size(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* MOE_OK when a · b fits in int64, else MOE_ERR_INVALID_ARGUMENT naming both factors and their
 * values. The per-op checks call it on every product of sizes (elements of a [rows, cols]
 * buffer), so the index arithmetic of the kernels behind them cannot wrap. */
moe_status_t moe_check_mul(int64_t a, const char *a_name, int64_t b, const char *b_name);

/* MOE_OK when the value is a row of its option table (moe_types.h), else MOE_ERR_INVALID_ARGUMENT
 * listing the table: the one check of each option, which every op taking it calls. */
moe_status_t moe_check_score_function(moe_score_function_t score_function);
moe_status_t moe_check_activation(moe_activation_t activation);

/* Checks a workspace against the bytes its size function asked for. MOE_SIZE_OVERFLOW (the size
 * function has already recorded why) is an invalid argument, not a request for SIZE_MAX bytes. */
moe_status_t moe_check_workspace(const void *workspace, size_t have, size_t need, const char *fn);

#ifdef __cplusplus
}
#endif

/* Returns MOE_ERR_INVALID_ARGUMENT with a message when `cond` is false. */
#define MOE_CHECK(cond, ...)                                        \
    do {                                                            \
        if (!(cond)) return moe_fail(MOE_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
    } while (0)

/* ---- checked int64 arithmetic: every size the core computes from caller values goes through
 * these. Signed overflow is undefined behaviour in C, and a wrapped size is worse than a crash:
 * it passes range checks and sizes buffers too small. Each returns 0 with *out = the exact
 * result, or 1 when the result does not fit in int64 (*out is then unspecified). Host code only
 * (C and the host side of the .cu files); the kernels index buffers whose sizes were checked. */
static inline int moe_checked_add_i64(int64_t a, int64_t b, int64_t *out) {
    return __builtin_add_overflow(a, b, out) ? 1 : 0;
}

static inline int moe_checked_mul_i64(int64_t a, int64_t b, int64_t *out) {
    return __builtin_mul_overflow(a, b, out) ? 1 : 0;
}

/* count · elem_bytes as a size_t, or MOE_SIZE_OVERFLOW when count < 0 or the product overflows
 * (no message: the caller, which knows the arguments, records one). */
static inline size_t moe_checked_bytes(int64_t count, int64_t elem_bytes) {
    int64_t bytes;
    if (count < 0 || elem_bytes < 0 || moe_checked_mul_i64(count, elem_bytes, &bytes))
        return MOE_SIZE_OVERFLOW;
    return (size_t)bytes;
}

/* *total += count · elem_bytes rounded up to a multiple of align (a power of two), all checked:
 * one section of a workspace layout. Returns 1 on overflow (or a negative count), else 0. */
static inline int moe_checked_section(int64_t *total, int64_t count, int64_t elem_bytes,
                                      int64_t align) {
    int64_t b;
    if (count < 0 || moe_checked_mul_i64(count, elem_bytes, &b) ||
        moe_checked_add_i64(b, align - 1, &b))
        return 1;
    return moe_checked_add_i64(*total, b & ~(align - 1), total);
}

/* Checks an entry point's `workspace` / `workspace_bytes` against what size_fn(...) asks for; the
 * message names size_fn. */
#define MOE_CHECK_WORKSPACE(size_fn, ...)                                                  \
    MOE_TRY(moe_check_workspace(workspace, workspace_bytes, size_fn(__VA_ARGS__), #size_fn))

/* Propagates a non-OK status. */
#define MOE_TRY(expr)                          \
    do {                                       \
        moe_status_t moe_try_status_ = (expr); \
        if (moe_try_status_ != MOE_OK) return moe_try_status_; \
    } while (0)

MOE_HD static inline int moe_is_float_dtype(moe_dtype_t dt) {
    return dt == MOE_DTYPE_FP32 || dt == MOE_DTYPE_FP64 || dt == MOE_DTYPE_FP16 ||
           dt == MOE_DTYPE_BF16;
}

static inline const char *moe_dtype_name(moe_dtype_t dt) {
    switch (dt) {
    case MOE_DTYPE_FP32: return "float32";
    case MOE_DTYPE_FP64: return "float64";
    case MOE_DTYPE_FP16: return "float16";
    case MOE_DTYPE_BF16: return "bfloat16";
    case MOE_DTYPE_INT32: return "int32";
    case MOE_DTYPE_INT64: return "int64";
    case MOE_DTYPE_BOOL: return "bool";
    }
    return "unknown";
}

/* ---- half precision on the host: exact widening, round-to-nearest-even narrowing ---------- */

MOE_HD static inline float moe_bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

MOE_HD static inline uint32_t moe_float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

MOE_HD static inline float moe_bf16_to_float(uint16_t h) { return moe_bits_to_float((uint32_t)h << 16); }

MOE_HD static inline uint16_t moe_float_to_bf16(float f) {
    uint32_t u = moe_float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

MOE_HD static inline float moe_fp16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man · 2^-24, exact in float */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (exp == 31) return moe_bits_to_float(sign | 0x7f800000u | (man << 13));
    return moe_bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

MOE_HD static inline uint16_t moe_float_to_fp16(float f) {
    uint32_t u = moe_float_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (au >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (au < 0x38800000u) {
        /* result is subnormal (or zero): round |f| / 2^-24 to nearest even integer */
        float a = moe_bits_to_float(au);
        float q = a * 16777216.0f; /* exact: power of two */
        float r = nearbyintf(q);   /* default rounding mode: ties to even */
        return (uint16_t)(sign | (uint16_t)r);
    }
    /* normal: rebias and round the 13 dropped mantissa bits to nearest even */
    uint32_t v = au - (112u << 23);
    v += 0xfffu + ((v >> 13) & 1u);
    return (uint16_t)(sign | (uint16_t)(v >> 13));
}

/* ---- typed element access (the CPU reference path favours clarity over speed here) -------- */

MOE_HD static inline double moe_load(const void *p, moe_dtype_t dt, int64_t i) {
    switch (dt) {
    case MOE_DTYPE_FP32: return (double)((const float *)p)[i];
    case MOE_DTYPE_FP64: return ((const double *)p)[i];
    case MOE_DTYPE_FP16: return (double)moe_fp16_to_float(((const uint16_t *)p)[i]);
    case MOE_DTYPE_BF16: return (double)moe_bf16_to_float(((const uint16_t *)p)[i]);
    case MOE_DTYPE_INT32: return (double)((const int32_t *)p)[i];
    case MOE_DTYPE_INT64: return (double)((const int64_t *)p)[i];
    case MOE_DTYPE_BOOL: return (double)((const uint8_t *)p)[i];
    }
    return 0.0;
}

/* Stores v rounded to dt. Half types round from the float value, as torch's casts from fp32 do. */
MOE_HD static inline void moe_store(void *p, moe_dtype_t dt, int64_t i, double v) {
    switch (dt) {
    case MOE_DTYPE_FP32: ((float *)p)[i] = (float)v; break;
    case MOE_DTYPE_FP64: ((double *)p)[i] = v; break;
    case MOE_DTYPE_FP16: ((uint16_t *)p)[i] = moe_float_to_fp16((float)v); break;
    case MOE_DTYPE_BF16: ((uint16_t *)p)[i] = moe_float_to_bf16((float)v); break;
    case MOE_DTYPE_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
    case MOE_DTYPE_INT64: ((int64_t *)p)[i] = (int64_t)v; break;
    case MOE_DTYPE_BOOL: ((uint8_t *)p)[i] = (uint8_t)(v != 0.0); break;
    }
}

/* Rounds v to the precision of dt (identity for fp64). Emulates a tensor materialised in dt. */
MOE_HD static inline double moe_round_to(moe_dtype_t dt, double v) {
    switch (dt) {
    case MOE_DTYPE_FP32: return (double)(float)v;
    case MOE_DTYPE_FP16: return (double)moe_fp16_to_float(moe_float_to_fp16((float)v));
    case MOE_DTYPE_BF16: return (double)moe_bf16_to_float(moe_float_to_bf16((float)v));
    default: return v;
    }
}

/* ---- OpenMP shims, so the core also builds without -fopenmp -------------------------------- */
#ifdef _OPENMP
#include <omp.h>
static inline int moe_max_threads(void) { return omp_get_max_threads(); }
static inline int moe_thread_id(void) { return omp_get_thread_num(); }
#else
static inline int moe_max_threads(void) { return 1; }
static inline int moe_thread_id(void) { return 0; }
#endif

#endif /* MOE_CORE_COMMON_H_ */
