/*
 * cuda_common.cuh: launch checking for the CUDA kernels (no torch, no STL).
 *
 * Every launcher ends with MOE_CHECK_LAUNCH(): a bad configuration is reported as MOE_ERR_CUDA
 * with the kernel's name at the call that caused it, instead of surfacing in the next op.
 */
#ifndef MOE_CORE_CUDA_COMMON_CUH_
#define MOE_CORE_CUDA_COMMON_CUH_

#include <cuda_runtime.h>

#include "../common.h"

#define MOE_CHECK_LAUNCH(name)                                                          \
    do {                                                                                \
        cudaError_t moe_launch_err_ = cudaGetLastError();                               \
        if (moe_launch_err_ != cudaSuccess)                                             \
            return moe_fail(MOE_ERR_CUDA, "%s launch failed: %s", name,                 \
                            cudaGetErrorString(moe_launch_err_));                       \
    } while (0)

#define MOE_CUDA_THREADS 128

static inline unsigned moe_blocks_for(int64_t n, int64_t threads) {
    return (unsigned)((n + threads - 1) / threads);
}

#endif /* MOE_CORE_CUDA_COMMON_CUH_ */
