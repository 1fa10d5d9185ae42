/*
 * moe_types.h: what every op of moe-core shares: the status codes, the element types, the option
 * tables (the router score functions here), the error message and the workspace-size sentinel.
 * Included by each area header (moe_router.h, moe_layout.h, moe_balancing.h, moe_experts.h) and
 * by moe_core.h, which documents the calling convention.
 */
#ifndef MOE_TYPES_H_
#define MOE_TYPES_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_CORE_VERSION_MAJOR 0
#define MOE_CORE_VERSION_MINOR 1

/** Result of every op. */
typedef enum moe_status {
    MOE_OK = 0,                   /**< success */
    MOE_ERR_INVALID_ARGUMENT = 1, /**< an argument is out of its documented range */
    MOE_ERR_UNSUPPORTED = 2,      /**< a valid combination this build does not implement */
    MOE_ERR_CUDA = 3,             /**< the CUDA runtime reported an error (launch or config) */
    MOE_ERR_INTERNAL = 4          /**< a bug in moe-core; please report it */
} moe_status_t;

/** Element type of a buffer. Half types are stored as their 16-bit patterns. */
typedef enum moe_dtype {
    MOE_DTYPE_FP32 = 0,
    MOE_DTYPE_FP64 = 1,
    MOE_DTYPE_FP16 = 2,
    MOE_DTYPE_BF16 = 3,
    MOE_DTYPE_INT32 = 4,
    MOE_DTYPE_INT64 = 5,
    MOE_DTYPE_BOOL = 6 /**< one byte per element, 0 or 1 */
} moe_dtype_t;

/*
 * The named options (score functions here, activations in moe_experts.h) are each listed once, as
 * a table of X(enumerator, value, "name") rows. The enum, the core's check of a value
 * (csrc/common.h) and the binding's name lookup are all made from the table, and the Python list
 * (moe_core/ops/names.py) is tested against it, so a new option is one row plus its math.
 */

/** One enumerator of an option table: `X(enumerator, value, name)` -> `enumerator = value,`. */
#define MOE_ENUMERATOR(enumerator, value, name) enumerator = value,

/**
 * Router score functions (Megatron's moe_router_score_function):
 *   softmax:      softmax over the experts (pre) or over the top-k (post)
 *   sigmoid:      sigmoid(x), renormalised over the top-k when topk > 1
 *   sqrtsoftplus: sqrt(softplus(x)), renormalised like sigmoid
 */
#define MOE_SCORE_FUNCTIONS(X)                   \
    X(MOE_SCORE_SOFTMAX, 0, "softmax")           \
    X(MOE_SCORE_SIGMOID, 1, "sigmoid")           \
    X(MOE_SCORE_SQRTSOFTPLUS, 2, "sqrtsoftplus")

/** Router score function, one of MOE_SCORE_FUNCTIONS. */
typedef enum moe_score_function { MOE_SCORE_FUNCTIONS(MOE_ENUMERATOR) } moe_score_function_t;

/**
 * What every *_workspace_size function returns when the size does not fit (an argument so large
 * that the byte count overflows int64): never a valid request, since no buffer can have SIZE_MAX
 * bytes. moe_last_error() then names the function and its arguments.
 */
#define MOE_SIZE_OVERFLOW SIZE_MAX

/** Name of a status code, e.g. "MOE_ERR_INVALID_ARGUMENT". Never NULL. */
const char *moe_status_string(moe_status_t status);

/** The message of the last failed call on this thread ("" if none). Valid until the next call. */
const char *moe_last_error(void);

/** Size in bytes of one element of `dtype`, or 0 for an unknown value. */
size_t moe_dtype_size(moe_dtype_t dtype);

/**
 * 1 if this build runs the CUDA entry points (moe_cuda_*), else 0: a build without CUDA defines
 * them all, but each returns MOE_ERR_UNSUPPORTED (and each of its workspace sizes is 0).
 */
int moe_has_cuda(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_TYPES_H_ */
