/*
 * layout_cuda.cuh: pieces shared by the CUDA token layout kernels (permute, unpermute, chunk
 * sorting, token dropping): element conversions that round exactly as the C core does, the
 * widest vector access a row allows, and a single-block int64 scan.
 *
 * The one idea: every float conversion and every product/sum that the CPU reference rounds is
 * spelled here with the same helpers (common.h's bit-exact half conversions, __f*_rn intrinsics
 * that nvcc never fuses into an FMA), so a kernel that follows the CPU's order of operations gets
 * the CPU's bits.
 */
#ifndef MOE_CORE_LAYOUT_CUDA_CUH_
#define MOE_CORE_LAYOUT_CUDA_CUH_

#include "cuda_common.cuh"

/* Storage tags for the 16-bit float types (both are uint16_t underneath). */
struct moe_bf16_s { uint16_t bits; };
struct moe_fp16_s { uint16_t bits; };

/* ---- element → compute type (exact widening) ------------------------------------------------ */
__device__ __forceinline__ float moe_widen(float x) { return x; }
__device__ __forceinline__ double moe_widen(double x) { return x; }
__device__ __forceinline__ float moe_widen(moe_bf16_s x) { return moe_bf16_to_float(x.bits); }
__device__ __forceinline__ float moe_widen(moe_fp16_s x) { return moe_fp16_to_float(x.bits); }

/* ---- compute type → element, as moe_store does (a double goes through float for half types) - */
template <typename T> __device__ __forceinline__ T moe_narrow(float v);
template <typename T> __device__ __forceinline__ T moe_narrow(double v);
template <> __device__ __forceinline__ float moe_narrow<float>(float v) { return v; }
template <> __device__ __forceinline__ float moe_narrow<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ double moe_narrow<double>(double v) { return v; }
template <> __device__ __forceinline__ double moe_narrow<double>(float v) { return (double)v; }
template <> __device__ __forceinline__ moe_bf16_s moe_narrow<moe_bf16_s>(float v) {
    return moe_bf16_s{moe_float_to_bf16(v)};
}
template <> __device__ __forceinline__ moe_bf16_s moe_narrow<moe_bf16_s>(double v) {
    return moe_bf16_s{moe_float_to_bf16((float)v)};
}
template <> __device__ __forceinline__ moe_fp16_s moe_narrow<moe_fp16_s>(float v) {
    return moe_fp16_s{moe_float_to_fp16(v)};
}
template <> __device__ __forceinline__ moe_fp16_s moe_narrow<moe_fp16_s>(double v) {
    return moe_fp16_s{moe_float_to_fp16((float)v)};
}

/* ---- arithmetic that is never contracted into an FMA (the CPU rounds after each op) --------- */
__device__ __forceinline__ float moe_mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double moe_mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float moe_add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double moe_add_rn(double a, double b) { return __dadd_rn(a, b); }

/* Rounding of a product to the promoted dtype P when P is narrower than the compute type:
 * MOE_RP_NONE (P is the compute type: fp32 or fp64), MOE_RP_BF16, MOE_RP_FP16. */
enum { MOE_RP_NONE = 0, MOE_RP_BF16 = 1, MOE_RP_FP16 = 2 };

template <int RP, typename C>
__device__ __forceinline__ C moe_round_p(C v) {
    if (RP == MOE_RP_BF16) return (C)moe_bf16_to_float(moe_float_to_bf16((float)v));
    if (RP == MOE_RP_FP16) return (C)moe_fp16_to_float(moe_float_to_fp16((float)v));
    return v;
}

/* ---- vector width ---------------------------------------------------------------------------- */

/* The widest access (16, 8, 4, 2 or 1 bytes) that divides the row size and every base address,
 * so each row of each buffer starts on a vector boundary. */
static inline int moe_vec_bytes(size_t row_bytes, const void *a, const void *b, const void *c) {
    uintptr_t bits = (uintptr_t)row_bytes | (uintptr_t)a | (uintptr_t)b | (uintptr_t)c;
    for (int w = 16; w > 1; w /= 2)
        if ((bits & (uintptr_t)(w - 1)) == 0) return w;
    return 1;
}

template <int W> struct moe_vec_t;
template <> struct moe_vec_t<16> { typedef uint4 type; };
template <> struct moe_vec_t<8> { typedef uint2 type; };
template <> struct moe_vec_t<4> { typedef uint32_t type; };
template <> struct moe_vec_t<2> { typedef uint16_t type; };
template <> struct moe_vec_t<1> { typedef uint8_t type; };

/* Smallest power of two >= n, clamped to [lo, hi]. */
static inline int moe_pow2_clamp(int64_t n, int lo, int hi) {
    int p = lo;
    while (p < hi && p < n) p *= 2;
    return p;
}

/* Zero the rows r0 + j for each bit j of pad_bits (a ballot over the warp's 32 rows; all 32
 * lanes call it with the same arguments), nvec vectors of W bytes each. */
template <int W>
__device__ __forceinline__ void moe_zero_rows_warp(void *__restrict__ rows_base, uint32_t pad_bits,
                                                   int64_t r0, int64_t nvec) {
    typedef typename moe_vec_t<W>::type V;
    const int lane = threadIdx.x & 31;
    V zero;
    memset(&zero, 0, sizeof zero);
    while (pad_bits) { /* warp-uniform */
        const int j = __ffs(pad_bits) - 1;
        pad_bits &= pad_bits - 1;
        V *out = (V *)rows_base + (r0 + j) * nvec;
        for (int64_t v = lane; v < nvec; v += 32) out[v] = zero;
    }
}

/* Rows [r0, r0 + 32) whose index is not a token in [0, num_tokens) (padding, -1) are zeroed by
 * one warp (all 32 lanes call it with the same r0): the 32 indices are one coalesced load, a
 * ballot names the padding rows, and the warp zeroes only those (nvec vectors of W bytes each),
 * so a buffer without padding (the dropless layout) costs one load per 32 rows. */
template <int W>
__device__ __forceinline__ void moe_zero_pad_warp(void *__restrict__ rows_base,
                                                  const int64_t *__restrict__ sorted_indices,
                                                  int64_t r0, int64_t num_rows,
                                                  int64_t num_tokens, int64_t nvec) {
    const int lane = threadIdx.x & 31;
    bool pad = false;
    if (r0 + lane < num_rows) {
        const int64_t t = sorted_indices[r0 + lane];
        pad = t < 0 || t >= num_tokens;
    }
    moe_zero_rows_warp<W>(rows_base, __ballot_sync(0xffffffffu, pad), r0, nvec);
}

/* The padding rows of a whole buffer: one thread per row, blockDim a multiple of 32. It may be
 * the chained kernel of an op (it reads sorted_indices only after the wait). */
template <int W>
__global__ void moe_zero_pad_rows_kernel(void *__restrict__ rows_base,
                                         const int64_t *__restrict__ sorted_indices,
                                         int64_t num_rows, int64_t num_tokens, int64_t nvec) {
    moe_pdl_trigger();
    moe_pdl_wait();
    const int64_t r0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) & ~(int64_t)31;
    if (r0 >= num_rows) return; /* whole warps: the ballot sees all 32 lanes */
    moe_zero_pad_warp<W>(rows_base, sorted_indices, r0, num_rows, num_tokens, nvec);
}

/* ---- one-block exclusive scan ---------------------------------------------------------------- */

#define MOE_SCAN_THREADS 1024

/* Exclusive prefix sum of one value per thread over a block of NT threads (a multiple of 32, at
 * most 1024; all must call it). Returns the thread's exclusive prefix; *total gets the block's
 * sum. Integer only, so the order of the additions does not matter. */
template <int NT>
__device__ __forceinline__ int64_t moe_block_exclusive_scan_n(int64_t v, int64_t *total) {
    __shared__ int64_t warp_sums[NT / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t x = v;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
        int64_t y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int64_t s = lane < NT / 32 ? warp_sums[lane] : 0;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
            int64_t y = __shfl_up_sync(0xffffffffu, s, d);
            if (lane >= d) s += y;
        }
        if (lane < NT / 32) warp_sums[lane] = s; /* inclusive over warps */
    }
    __syncthreads();
    const int64_t before = warp > 0 ? warp_sums[warp - 1] : 0;
    *total = warp_sums[NT / 32 - 1];
    __syncthreads(); /* warp_sums may be reused by the next call */
    return before + x - v;
}

/* The same over a block of MOE_SCAN_THREADS threads. */
__device__ __forceinline__ int64_t moe_block_exclusive_scan(int64_t v, int64_t *total) {
    return moe_block_exclusive_scan_n<MOE_SCAN_THREADS>(v, total);
}

#endif /* MOE_CORE_LAYOUT_CUDA_CUH_ */
