/*
 * layout_cuda.cuh: pieces shared by the CUDA token layout kernels (permute, unpermute, chunk
 * sorting, token dropping): element conversions that round exactly as the C core does, the
 * widest vector access a row allows, a single-block int64 scan, and the token → rows maps and
 * gather-sum of layout.cu that the combine and permute's backward share.
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

/* ---- the token → rows maps and the gather-sum (layout.cu) ------------------------------------
 * Shared by the combine (unpermute.cu) and permute's backward (permute_bwd.cu). Both maps live
 * in the op's workspace, moe_cuda_unpermute_workspace_size(T, R) bytes (the larger of the two). */

#define MOE_SLOTS 16 /* rows per token held in the slots table; topk <= 16 never overflows */
#define MOE_GATHER_THREADS 256 /* threads per block of the data kernels */

/* The CSR map: token t's rows, ascending, with each row's expert. */
typedef struct {
    int64_t *start;  /* [T + 1]: token t owns entries [start[t], start[t + 1]) */
    int64_t *cursor; /* [T]: fill cursors */
    int64_t *rows;   /* [R]: rows, ascending within each token */
    int64_t *rexp;   /* [R]: the expert of each entry's row (when expert_offsets are given) */
    double *dots;    /* [R]: per-entry fp64 scratch (unpermute_bwd's grad_probs terms) */
} moe_cuda_token_rows_t;

/* The slots table: token t's first MOE_SLOTS rows in arrival order, the rest in one list. */
typedef struct {
    int64_t *count;  /* [T]: the token's rows (all of them, slots and overflow) */
    int64_t *ovf_n;  /* [1]: entries in the overflow list */
    int64_t *slot;   /* [T, MOE_SLOTS]: the token's first rows, in arrival order */
    longlong2 *ovf;  /* [R]: (token, row) of every row past its token's slots */
} moe_cuda_token_slots_t;

/* Whether the forward gathers (and unpermute_bwd without probs) take the slots (else the CSR). */
int moe_cuda_use_slots(int64_t T);

/* The maps of sorted_indices [R] (entries outside [0, T) are skipped), built on `st`. The CSR
 * gets each entry's expert when expert_offsets [E + 1] is given. */
moe_status_t moe_cuda_token_slots_build(moe_cuda_token_slots_t *m, void *workspace,
                                       size_t workspace_bytes, const int64_t *sorted_indices,
                                       int64_t T, int64_t R, cudaStream_t st);
moe_status_t moe_cuda_token_rows_build(moe_cuda_token_rows_t *m, void *workspace,
                                      size_t workspace_bytes, const int64_t *sorted_indices,
                                      const int64_t *expert_offsets, int64_t T, int64_t E,
                                      int64_t R, cudaStream_t st);

/* grad_probs [T, E] = Σ per (token, expert) of dots[entry] (unpermute_bwd), or, with dots NULL,
 * of grad_permuted_probs[row] (permute_bwd), over the CSR map m (built with expert_offsets). */
moe_status_t moe_cuda_token_expert_sum(void *grad_probs, const double *dots,
                                       const void *grad_permuted_probs,
                                       const moe_cuda_token_rows_t *m, int64_t T, int64_t E,
                                       moe_dtype_t probs_dtype, cudaStream_t st);

/* The kernels' own limit, after the op's shared check. */
static inline moe_status_t moe_cuda_layout_check_tokens(int64_t num_tokens) {
    MOE_CHECK(num_tokens <= 0x7fffffffLL, "num_tokens=%lld; the CUDA kernels take at most 2^31-1",
              (long long)num_tokens);
    return MOE_OK;
}

/* VE elements of type T moved as one access of VE·sizeof(T) bytes. */
template <typename T, int VE>
union moe_pack {
    typename moe_vec_t<sizeof(T) * VE>::type raw;
    T v[VE];
};

/* Compute type and product rounding for a token dtype and (optional) probs dtype. */
typedef struct {
    int compute_fp64; /* C = double */
    int rp;           /* MOE_RP_* */
} moe_cuda_math_t;

static inline moe_cuda_math_t moe_cuda_math_for(moe_dtype_t dtype, const void *probs,
                                                moe_dtype_t probs_dtype) {
    /* the promoted dtype P of the product (torch.promote_types of two float dtypes) */
    const moe_dtype_t p = !probs || dtype == probs_dtype ? dtype
                          : dtype == MOE_DTYPE_FP64 || probs_dtype == MOE_DTYPE_FP64
                              ? MOE_DTYPE_FP64
                              : MOE_DTYPE_FP32;
    moe_cuda_math_t m;
    m.compute_fp64 = p == MOE_DTYPE_FP64;
    m.rp = !probs ? MOE_RP_NONE
           : p == MOE_DTYPE_BF16 ? MOE_RP_BF16
           : p == MOE_DTYPE_FP16 ? MOE_RP_FP16 : MOE_RP_NONE;
    return m;
}

/* The arguments of a data kernel over the rows (the gather-sum, unpermute's backward). */
typedef struct {
    void *dst;             /* gather: output [T, H]; bwd: grad_x [R, H] */
    double *dots;          /* bwd only */
    const void *src;       /* gather: rows [R, H]; bwd: grad_output [T, H] */
    const void *x_rows;    /* bwd only: permuted_tokens, or NULL */
    const moe_cuda_token_rows_t *m;   /* the CSR map, or NULL when the gather reads the slots */
    const moe_cuda_token_slots_t *sl; /* forward only: the slots table, or NULL */
    const int64_t *sorted_indices, *expert_offsets; /* the slots gather's own lookups */
    int64_t num_rows;
    const void *probs;
    moe_dtype_t probs_dtype;
    int64_t T, E, hidden;
    cudaStream_t st;
} moe_cuda_rows_args_t;

/* The gather-sum of every token's rows (the combine; permute's backward without probs). */
moe_status_t moe_cuda_gather_sum(const moe_cuda_rows_args_t *a, moe_dtype_t dtype,
                                 moe_cuda_math_t mt);

/* L<ET, C, RP, VE>::launch(a) for the element type ET, with 16-byte accesses (VE elements each)
 * when the row size and a's buffers allow, else one element per access. */
template <template <typename, typename, int, int> class L, typename ET, typename C, int RP>
static moe_status_t moe_cuda_launch_rows_t(const moe_cuda_rows_args_t *a) {
    const int w = moe_vec_bytes((size_t)a->hidden * sizeof(ET), a->dst, a->src, a->x_rows);
    if (w == 16) return L<ET, C, RP, 16 / sizeof(ET)>::launch(a);
    return L<ET, C, RP, 1>::launch(a);
}

/* L's launch for the token dtype and the math: element type, compute type C, product rounding. */
template <template <typename, typename, int, int> class L>
static moe_status_t moe_cuda_launch_rows(const moe_cuda_rows_args_t *a, moe_dtype_t dtype,
                                         moe_cuda_math_t mt) {
    if (a->T == 0) return MOE_OK;
    switch (dtype) {
    case MOE_DTYPE_FP32:
        return mt.compute_fp64 ? moe_cuda_launch_rows_t<L, float, double, MOE_RP_NONE>(a)
                               : moe_cuda_launch_rows_t<L, float, float, MOE_RP_NONE>(a);
    case MOE_DTYPE_FP64: return moe_cuda_launch_rows_t<L, double, double, MOE_RP_NONE>(a);
    case MOE_DTYPE_BF16:
        if (mt.compute_fp64) return moe_cuda_launch_rows_t<L, moe_bf16_s, double, MOE_RP_NONE>(a);
        return mt.rp == MOE_RP_BF16 ? moe_cuda_launch_rows_t<L, moe_bf16_s, float, MOE_RP_BF16>(a)
                                    : moe_cuda_launch_rows_t<L, moe_bf16_s, float, MOE_RP_NONE>(a);
    case MOE_DTYPE_FP16:
        if (mt.compute_fp64) return moe_cuda_launch_rows_t<L, moe_fp16_s, double, MOE_RP_NONE>(a);
        return mt.rp == MOE_RP_FP16 ? moe_cuda_launch_rows_t<L, moe_fp16_s, float, MOE_RP_FP16>(a)
                                    : moe_cuda_launch_rows_t<L, moe_fp16_s, float, MOE_RP_NONE>(a);
    default: return moe_fail(MOE_ERR_INTERNAL, "token layout: unexpected dtype %d", (int)dtype);
    }
}

#endif /* MOE_CORE_LAYOUT_CUDA_CUH_ */
