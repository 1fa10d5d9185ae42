/*
 * cuda_common.cuh: launch checking for the CUDA kernels (no torch, no STL).
 *
 * Every launcher ends with MOE_CHECK_LAUNCH(): a bad configuration is reported as MOE_ERR_CUDA
 * with the kernel's name at the call that caused it, instead of surfacing in the next op.
 */
#ifndef MOE_CORE_CUDA_COMMON_CUH_
#define MOE_CORE_CUDA_COMMON_CUH_

#include <cuda_runtime.h>
#include <stdlib.h>

#include "../common.h"
#include "../tuning.h"

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

/* ---- programmatic dependent launch (sm_90+) -------------------------------------------------
 * The kernels of one op form a chain. Each kernel after the first is launched with programmatic
 * stream serialization (MOE_LAUNCH_CHAINED): its blocks may start while the previous kernel
 * still runs, do the work that needs only the op's inputs (loads of the tokens, the map), and
 * call moe_pdl_wait() before touching anything the previous kernel writes; the wait returns once
 * that kernel has finished and its writes are visible. Every kernel of a chain calls
 * moe_pdl_trigger() first, so the next one is launched as early as possible; that is safe because
 * the next one still waits for the whole grid. The first kernel of an op is launched normally,
 * which orders the chain after the op's inputs; the launch gaps between the rest disappear.
 * Without the attribute (before sm_90, or with the pdl switch off: MOE_CORE_PDL=0, tuning.h)
 * the two instructions do nothing and the launches are ordinary. */
__device__ __forceinline__ void moe_pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void moe_pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* ---- per-device answers, asked once ------------------------------------------------------
 * A yes / no the runtime gives for the current device and never changes (an attribute, whether
 * a kernel holds code for it), kept in the caller's int by_device[MOE_MAX_DEVICES]: 0 not asked
 * yet, 1 no, 2 yes (racing writers agree). ask(dev) answers 1 or 0, or -1 when the runtime
 * could not say, which is not kept (and its error not left for the next launch). A device past
 * the table is asked every time. */
#define MOE_MAX_DEVICES 64
static inline int moe_device_flag(int *by_device, int (*ask)(int dev)) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) {
        cudaGetLastError();
        return 0;
    }
    if (dev >= MOE_MAX_DEVICES) return ask(dev) == 1;
    int known = __atomic_load_n(&by_device[dev], __ATOMIC_RELAXED);
    if (known == 0) {
        const int answer = ask(dev);
        if (answer < 0) return 0;
        known = answer ? 2 : 1;
        __atomic_store_n(&by_device[dev], known, __ATOMIC_RELAXED);
    }
    return known == 2;
}

static inline int moe_pdl_ask(int dev) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return major >= 9;
}

/* Whether the current device takes programmatic launches (compute capability >= 9), asked once
 * per device: a host-side attribute query, nothing on the stream. The pdl switch (tuning.h)
 * turns them off everywhere. */
static inline int moe_pdl_enabled(void) {
    static int by_device[MOE_MAX_DEVICES];
    return moe_tuning_get().pdl && moe_device_flag(by_device, moe_pdl_ask);
}

/* kernel<<<grid, block, smem, stream>>>(args...) as a chained launch (see above). The launch
 * error, if any, is left for MOE_CHECK_LAUNCH. */
#define MOE_LAUNCH_CHAINED(kernel_, grid_, block_, smem_, stream_, ...)                        \
    do {                                                                                  \
        cudaLaunchAttribute moe_attr_[1];                                                 \
        moe_attr_[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;             \
        moe_attr_[0].val.programmaticStreamSerializationAllowed = 1;                      \
        cudaLaunchConfig_t moe_cfg_ = {};                                                 \
        moe_cfg_.gridDim = (grid_);                                                        \
        moe_cfg_.blockDim = (block_);                                                      \
        moe_cfg_.dynamicSmemBytes = (smem_);                                               \
        moe_cfg_.stream = (stream_);                                                       \
        moe_cfg_.attrs = moe_attr_;                                                       \
        moe_cfg_.numAttrs = moe_pdl_enabled() ? 1 : 0;                                    \
        cudaLaunchKernelEx(&moe_cfg_, kernel_, __VA_ARGS__);                               \
    } while (0)

#endif /* MOE_CORE_CUDA_COMMON_CUH_ */
