/*
 * router_gating_linear.cu: logits = inp · weightᵀ (+ bias) in the router dtype, and its backward,
 * on CUDA through cuBLAS (cublasGemmEx_64).
 *
 * The contract is the C kernel's: each operand element is converted to the router dtype (rd), the
 * products are summed with a wide accumulator and the result is rounded once to rd; the bias is
 * added after that rounding (in a small kernel, as the C kernel and Megatron do), and gradients
 * are rounded to rd before the cast to the leaf's dtype. cuBLAS accumulates in fp32 for
 * fp32/half rd (CUBLAS_COMPUTE_32F, never TF32) and fp64 for fp64 rd, so fp32 logits carry the
 * error of an fp32 GEMM (as Megatron's torch.mm does) rather than the C kernel's fp64 sum.
 *
 * The one clever part is avoiding casts: bf16/fp16 inputs and weights with fp32 rd go to cuBLAS
 * as they are (a bf16 x bf16 product is exact in fp32, so this equals converting first). Only a
 * mixed pair, an fp64 rd, or the backward's fp32 grad against half operands needs a conversion,
 * done by a small kernel into the caller's workspace (see gating_plan).
 *
 * The backward of a bf16 router with fp32 rd (the forward ran on the tensor cores) stays on them
 * too: the fp32 gradient g is split into three bf16 terms, g = g_hi + g_mid + g_lo, exactly (each
 * takes the next 8 significant bits; bf16 has fp32's exponent range, so only |g| below about
 * 2^-100 loses bits), every product of a term with a bf16 operand is exact in fp32, and the GEMMs
 * accumulate in fp32: grad_inp is one GEMM over the 3E stacked terms, grad_weight three (one
 * [3E, H] product, the slices added in a fixed order). The result carries the error of an fp32
 * GEMM over 3E (or T, three times) terms instead of E (or T): the same order as Megatron's fp32
 * torch.mm, at bf16 tensor-core speed instead of fp32 SIMT speed.
 *
 * Handles and determinism: one cublasHandle_t per device, created lazily on first use and cached
 * for the life of the process (the one thing this core creates; the brief asked for it). A single
 * mutex guards creation and each call's SetStream → SetWorkspace → GemmEx sequence, because a
 * handle's stream and workspace are per-handle state. cuBLAS gives bitwise-reproducible results
 * for a fixed problem, GPU, library version and workspace size; its default pool is shared by
 * concurrent streams and can change the algorithm picked, so every call hands cuBLAS a fixed-size
 * slice of our own workspace (MOE_CUBLAS_WORKSPACE) instead — no CUBLAS_WORKSPACE_CONFIG needed.
 * cuBLAS never uses atomics unless cublasSetAtomicsMode allows them (it is left at its default,
 * not allowed), and reduced-precision split-K reductions are disallowed.
 */
#include <cublas_v2.h>
#include <pthread.h>

#include "balancing_cuda.cuh"

#define MOE_CUBLAS_WORKSPACE ((size_t)8 << 20) /* bytes handed to cuBLAS on every call */

/* ---- handles ------------------------------------------------------------------------------- */

static pthread_mutex_t g_cublas_lock = PTHREAD_MUTEX_INITIALIZER;
static cublasHandle_t g_cublas_handles[MOE_MAX_DEVICES];

/* Locks, and returns the current device's handle bound to `stream` and `ws`. On success the
 * caller must release(); on failure the lock is not held. */
static moe_status_t acquire_handle(cublasHandle_t *out, void *stream, void *ws, size_t ws_bytes) {
    int dev = 0;
    cudaError_t ce = cudaGetDevice(&dev);
    if (ce != cudaSuccess)
        return moe_fail(MOE_ERR_CUDA, "cudaGetDevice failed: %s", cudaGetErrorString(ce));
    if (dev < 0 || dev >= MOE_MAX_DEVICES)
        return moe_fail(MOE_ERR_UNSUPPORTED, "device %d is beyond the %d devices supported", dev,
                        MOE_MAX_DEVICES);
    pthread_mutex_lock(&g_cublas_lock);
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (g_cublas_handles[dev] == NULL) {
        cublasHandle_t h = NULL;
        st = cublasCreate(&h);
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasSetMathMode(h, (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
        if (st != CUBLAS_STATUS_SUCCESS) {
            if (h) cublasDestroy(h);
            pthread_mutex_unlock(&g_cublas_lock);
            return moe_fail(MOE_ERR_CUDA, "cublasCreate failed on device %d: %s", dev,
                            cublasGetStatusString(st));
        }
        g_cublas_handles[dev] = h;
    }
    cublasHandle_t h = g_cublas_handles[dev];
    st = cublasSetStream(h, (cudaStream_t)stream); /* resets the workspace: set it after */
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasSetWorkspace(h, ws, ws_bytes);
    if (st != CUBLAS_STATUS_SUCCESS) {
        pthread_mutex_unlock(&g_cublas_lock);
        return moe_fail(MOE_ERR_CUDA, "cublasSetStream/SetWorkspace failed: %s",
                        cublasGetStatusString(st));
    }
    *out = h;
    return MOE_OK;
}

static void release_handle(void) { pthread_mutex_unlock(&g_cublas_lock); }

static cudaDataType_t cuda_type(moe_dtype_t dt) {
    switch (dt) {
    case MOE_DTYPE_FP64: return CUDA_R_64F;
    case MOE_DTYPE_FP16: return CUDA_R_16F;
    case MOE_DTYPE_BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
    }
}

/* Column-major C [m, n] (ldc) = op(A) · op(B), operands in `ab`, C in `cdt`. */
static moe_status_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                         int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                         int64_t ldb, void *C, int64_t ldc, moe_dtype_t ab, moe_dtype_t cdt) {
    const double one64 = 1.0, zero64 = 0.0;
    const float one32 = 1.0f, zero32 = 0.0f;
    const int f64 = ab == MOE_DTYPE_FP64;
    cublasStatus_t st = cublasGemmEx_64(
        h, ta, tb, m, n, k, f64 ? (const void *)&one64 : (const void *)&one32, A, cuda_type(ab),
        lda, B, cuda_type(ab), ldb, f64 ? (const void *)&zero64 : (const void *)&zero32, C,
        cuda_type(cdt), ldc, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
        return moe_fail(MOE_ERR_CUDA, "cublasGemmEx (m=%lld n=%lld k=%lld) failed: %s",
                        (long long)m, (long long)n, (long long)k, cublasGetStatusString(st));
    return MOE_OK;
}

/* ---- small kernels ------------------------------------------------------------------------- */

/* out[i] = in[i] converted to `odt` (round to nearest even, through fp32 for half types). */
__global__ void moe_gating_cast_kernel(void *out, moe_dtype_t odt, const void *in,
                                       moe_dtype_t idt, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) moe_store(out, odt, i, moe_load(in, idt, i));
}

/* logits [T, E] (rd) += bias [E] converted to rd, rounded to rd once more. */
__global__ void moe_gating_bias_kernel(void *logits, moe_dtype_t rd, const void *bias,
                                       moe_dtype_t wd, int64_t T, int64_t E) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * E) return;
    moe_store(logits, rd, i, moe_load(logits, rd, i) + moe_round_to(rd, moe_load(bias, wd, i % E)));
}

/* grad_bias[e] = Σ_t grad_logits[t, e] (chunk partials in order), rounded to rd, stored in wd. */
__global__ void __launch_bounds__(MOE_BAL_FINAL_THREADS)
moe_gating_bias_grad_kernel(void *grad_bias, moe_dtype_t wd, moe_dtype_t rd,
                            const double *partial, int64_t nchunks, int64_t E) {
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x)
        moe_store(grad_bias, wd, e, moe_round_to(rd, moe_col_total(partial, nchunks, E, e)));
}

/* g [T, E] fp32 → g3 [T, 3E] bf16: g3[t, j·E + e] is term j of g[t, e]; g = hi + mid + lo. */
__global__ void moe_gating_split3_kernel(uint16_t *g3, const float *g, int64_t T, int64_t E) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * E) return;
    const int64_t t = i / E, e = i - t * E;
    const float v = g[i];
    const uint16_t hi = moe_float_to_bf16(v);
    const float r1 = v - moe_bf16_to_float(hi); /* exact: below hi's last bit */
    const uint16_t mid = moe_float_to_bf16(r1);
    const float r2 = r1 - moe_bf16_to_float(mid);
    uint16_t *row = g3 + t * 3 * E;
    row[e] = hi;
    row[E + e] = mid;
    row[2 * E + e] = moe_float_to_bf16(r2);
}

/* grad_weight [E, H] (wd) = (C3[e] + C3[E + e]) + C3[2E + e], the three terms' products (fp32). */
__global__ void moe_gating_sum3_kernel(void *grad_weight, moe_dtype_t wd, const float *c3,
                                       int64_t E, int64_t H) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= E * H) return;
    const float v = __fadd_rn(__fadd_rn(c3[i], c3[E * H + i]), c3[2 * E * H + i]);
    moe_store(grad_weight, wd, i, (double)v);
}

static moe_status_t cast(void *out, moe_dtype_t odt, const void *in, moe_dtype_t idt, int64_t n,
                         cudaStream_t s) {
    if (n == 0) return MOE_OK;
    moe_gating_cast_kernel<<<moe_blocks_for(n, 256), 256, 0, s>>>(out, odt, in, idt, n);
    MOE_CHECK_LAUNCH("moe_gating_cast_kernel");
    return MOE_OK;
}

/* ---- workspace plan ------------------------------------------------------------------------ */

/* Where each piece of scratch lives, and which conversions a call needs. */
typedef struct gating_plan {
    moe_dtype_t ab;          /* dtype both GEMM operands are given to cuBLAS in */
    int cast_inp, cast_w;    /* the operand must be converted to `ab` first */
    size_t off_inp, off_w;   /* converted operands */
    size_t off_out;          /* backward: a gradient in rd, before its cast to the leaf dtype */
    size_t off_bias;         /* backward: fp64 chunk partials of the bias gradient */
    int split3;              /* backward on the tensor cores: g split into three bf16 terms */
    size_t off_g3, off_w3, off_c3; /* g3 [T, 3E] bf16, W3 [3E, H] bf16, C3 [3E, H] fp32 */
    size_t total;
} gating_plan_t;

static gating_plan_t gating_plan(int64_t T, int64_t H, int64_t E, moe_dtype_t id, moe_dtype_t wd,
                                 moe_dtype_t rd, int backward) {
    gating_plan_t p;
    memset(&p, 0, sizeof p);
    const size_t t = (size_t)(T > 0 ? T : 0), h = (size_t)(H > 0 ? H : 0),
                 e = (size_t)(E > 0 ? E : 0);
    p.ab = rd;
    /* fp32 router with one half (or fp32) dtype for both: cuBLAS takes them as they are */
    if (!backward && rd == MOE_DTYPE_FP32 && id == wd && id != MOE_DTYPE_FP64) p.ab = id;
    /* ... and the backward of bf16 operands stays on the tensor cores (fp16's exponent range
     * cannot hold the split terms of an fp32 gradient) */
    p.split3 = backward && rd == MOE_DTYPE_FP32 && id == MOE_DTYPE_BF16 && wd == MOE_DTYPE_BF16;
    if (p.split3) p.ab = MOE_DTYPE_BF16;
    p.cast_inp = id != p.ab;
    p.cast_w = wd != p.ab;
    const size_t ab_size = moe_dtype_size(p.ab), rd_size = moe_dtype_size(rd);
    size_t off = moe_align256(MOE_CUBLAS_WORKSPACE);
    p.off_inp = off;
    if (p.cast_inp) off += moe_align256(t * h * ab_size);
    p.off_w = off;
    if (p.cast_w) off += moe_align256(e * h * ab_size);
    p.off_out = off;
    if (p.split3) {
        p.off_g3 = off;
        off += moe_align256(t * 3 * e * 2);
        p.off_w3 = off;
        off += moe_align256(3 * e * h * 2);
        p.off_c3 = off;
        off += moe_align256(3 * e * h * 4);
        p.off_out = off; /* unused: the GEMMs write their results directly */
        p.off_bias = off;
        off += moe_align256((size_t)moe_col_chunks(T) * e * sizeof(double));
    } else if (backward) {
        size_t gi = id != rd ? t * h : 0, gw = wd != rd ? e * h : 0;
        off += moe_align256((gi > gw ? gi : gw) * rd_size);
        p.off_bias = off;
        off += moe_align256((size_t)moe_col_chunks(T) * e * sizeof(double));
    }
    p.total = off;
    return p;
}

extern "C" size_t moe_cuda_router_gating_linear_workspace_size(
    int64_t num_tokens, int64_t hidden, int64_t num_experts, moe_dtype_t inp_dtype,
    moe_dtype_t weight_dtype, moe_dtype_t router_dtype, int backward) {
    /* gating_plan sums size_t sections: bound them first with checked arithmetic. Every section
     * is at most 40 bytes per element of [T, H], [E, H] and [T, E] together (the split-three
     * backward's copies are the largest), plus the column partials, cuBLAS's scratch and the
     * 256-byte alignment of each section. */
    if (!backward && num_tokens == 0) return 0; /* an empty forward runs no GEMM */
    const int64_t T = num_tokens > 0 ? num_tokens : 0, H = hidden > 0 ? hidden : 0,
                  E = num_experts > 0 ? num_experts : 0;
    int64_t th, eh, te, bound = 0;
    if (moe_checked_mul_i64(T, H, &th) ||
        moe_checked_mul_i64(E, H, &eh) || moe_checked_mul_i64(T, E, &te) ||
        moe_checked_add_i64(th, eh, &bound) || moe_checked_add_i64(bound, te, &bound) ||
        moe_checked_mul_i64(bound, 40, &bound) ||
        moe_checked_section(&bound, te, (int64_t)sizeof(double), 1) || /* chunks <= T */
        moe_checked_add_i64(bound, (int64_t)MOE_CUBLAS_WORKSPACE + 8 * 256, &bound))
        return moe_fail_size("moe_cuda_router_gating_linear_workspace_size: num_tokens=%lld, "
                             "hidden=%lld, num_experts=%lld overflow int64 bytes",
                             (long long)num_tokens, (long long)hidden, (long long)num_experts);
    return gating_plan(num_tokens, hidden, num_experts, inp_dtype, weight_dtype, router_dtype,
                       backward)
        .total;
}

extern "C" moe_status_t moe_cuda_router_gating_linear_fwd(
    void *logits, const void *inp, const void *weight, const void *bias, int64_t num_tokens,
    int64_t hidden, int64_t num_experts, moe_dtype_t inp_dtype, moe_dtype_t weight_dtype,
    moe_dtype_t router_dtype, void *workspace, size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_router_gating_linear_check(num_tokens, hidden, num_experts, inp_dtype,
                                           weight_dtype, router_dtype));
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(logits && inp && weight, "logits, inp and weight must not be NULL");
    const gating_plan_t p = gating_plan(num_tokens, hidden, num_experts, inp_dtype, weight_dtype,
                                        router_dtype, 0);
    MOE_TRY(moe_check_workspace(workspace, workspace_bytes, p.total,
                                "moe_cuda_router_gating_linear_workspace_size, backward=0"));
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t T = num_tokens, H = hidden, E = num_experts;
    char *ws = (char *)workspace;
    const void *a_inp = inp, *a_w = weight;
    if (p.cast_inp) {
        MOE_TRY(cast(ws + p.off_inp, p.ab, inp, inp_dtype, T * H, s));
        a_inp = ws + p.off_inp;
    }
    if (p.cast_w) {
        MOE_TRY(cast(ws + p.off_w, p.ab, weight, weight_dtype, E * H, s));
        a_w = ws + p.off_w;
    }
    /* row-major logits [T, E] is column-major [E, T] = Wᵀᵀ (col-major view [H, E]) · inp view */
    cublasHandle_t h;
    MOE_TRY(acquire_handle(&h, stream, ws, MOE_CUBLAS_WORKSPACE));
    moe_status_t st = gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, E, T, H, a_w, H, a_inp, H, logits, E, p.ab,
                           router_dtype);
    release_handle();
    MOE_TRY(st);
    if (bias) {
        moe_gating_bias_kernel<<<moe_blocks_for(T * E, 256), 256, 0, s>>>(
            logits, router_dtype, bias, weight_dtype, T, E);
        MOE_CHECK_LAUNCH("moe_gating_bias_kernel");
    }
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_router_gating_linear_bwd(
    void *grad_inp, void *grad_weight, void *grad_bias, const void *grad_logits, const void *inp,
    const void *weight, int64_t num_tokens, int64_t hidden, int64_t num_experts,
    moe_dtype_t inp_dtype, moe_dtype_t weight_dtype, moe_dtype_t router_dtype, void *workspace,
    size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_router_gating_linear_check(num_tokens, hidden, num_experts, inp_dtype,
                                           weight_dtype, router_dtype));
    MOE_CHECK(num_tokens == 0 || (grad_logits && inp && weight),
              "grad_logits, inp and weight must not be NULL");
    const gating_plan_t p = gating_plan(num_tokens, hidden, num_experts, inp_dtype, weight_dtype,
                                        router_dtype, 1);
    MOE_TRY(moe_check_workspace(workspace, workspace_bytes, p.total,
                                "moe_cuda_router_gating_linear_workspace_size, backward=1"));
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t T = num_tokens, H = hidden, E = num_experts;
    const moe_dtype_t rd = router_dtype;
    char *ws = (char *)workspace;
    void *tmp = ws + p.off_out; /* one staging buffer: the two GEMMs run one after the other */
    if (p.split3 && T > 0 && (grad_inp || grad_weight)) {
        uint16_t *g3 = (uint16_t *)(ws + p.off_g3);
        moe_gating_split3_kernel<<<moe_blocks_for(T * E, 256), 256, 0, s>>>(
            g3, (const float *)grad_logits, T, E);
        MOE_CHECK_LAUNCH("moe_gating_split3_kernel");
        /* grad_inp [T, H] = g3 [T, 3E] · W3 [3E, H] (W stacked three times), bf16 out */
        if (grad_inp) {
            char *w3 = ws + p.off_w3;
            const size_t wbytes = (size_t)(E * H) * 2;
            for (int j = 0; j < 3; ++j) {
                cudaError_t ce = cudaMemcpyAsync(w3 + j * wbytes, weight, wbytes,
                                                 cudaMemcpyDeviceToDevice, s);
                if (ce != cudaSuccess)
                    return moe_fail(MOE_ERR_CUDA, "cudaMemcpyAsync(W3) failed: %s",
                                    cudaGetErrorString(ce));
            }
            cublasHandle_t h;
            MOE_TRY(acquire_handle(&h, stream, ws, MOE_CUBLAS_WORKSPACE));
            moe_status_t st = gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, H, T, 3 * E, w3, H, g3, 3 * E,
                                   grad_inp, H, MOE_DTYPE_BF16, MOE_DTYPE_BF16);
            release_handle();
            MOE_TRY(st);
        }
        /* C3 [3E, H] = g3ᵀ · inp: column-major [H, 3E] = inp view [H, T] · g3 view [3E, T]ᵀ */
        if (grad_weight) {
            float *c3 = (float *)(ws + p.off_c3);
            cublasHandle_t h;
            MOE_TRY(acquire_handle(&h, stream, ws, MOE_CUBLAS_WORKSPACE));
            moe_status_t st = gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, H, 3 * E, T, inp, H, g3, 3 * E,
                                   c3, H, MOE_DTYPE_BF16, MOE_DTYPE_FP32);
            release_handle();
            MOE_TRY(st);
            moe_gating_sum3_kernel<<<moe_blocks_for(E * H, 256), 256, 0, s>>>(
                grad_weight, weight_dtype, c3, E, H);
            MOE_CHECK_LAUNCH("moe_gating_sum3_kernel");
        }
        grad_inp = grad_weight = NULL; /* done; the bias gradient below still runs */
    }

    /* grad_inp [T, H] = g [T, E] · W [E, H]: column-major [H, T] = W view [H, E] · g view [E, T] */
    if (grad_inp && T > 0) {
        const void *a_w = weight;
        if (p.cast_w) {
            MOE_TRY(cast(ws + p.off_w, rd, weight, weight_dtype, E * H, s));
            a_w = ws + p.off_w;
        }
        void *out = inp_dtype == rd ? grad_inp : tmp;
        cublasHandle_t h;
        MOE_TRY(acquire_handle(&h, stream, ws, MOE_CUBLAS_WORKSPACE));
        moe_status_t st = gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, H, T, E, a_w, H, grad_logits, E, out,
                               H, rd, rd);
        release_handle();
        MOE_TRY(st);
        if (out != grad_inp) MOE_TRY(cast(grad_inp, inp_dtype, tmp, rd, T * H, s));
    }
    /* grad_weight [E, H] = gᵀ [E, T] · inp [T, H]: column-major [H, E] = inp view [H, T] · gᵀ */
    if (grad_weight) {
        if (T == 0) {
            cudaError_t ce = cudaMemsetAsync(grad_weight, 0, (size_t)(E * H) * moe_dtype_size(weight_dtype), s);
            if (ce != cudaSuccess)
                return moe_fail(MOE_ERR_CUDA, "cudaMemsetAsync(grad_weight) failed: %s",
                                cudaGetErrorString(ce));
        } else {
            const void *a_inp = inp;
            if (p.cast_inp) {
                MOE_TRY(cast(ws + p.off_inp, rd, inp, inp_dtype, T * H, s));
                a_inp = ws + p.off_inp;
            }
            void *out = weight_dtype == rd ? grad_weight : tmp;
            cublasHandle_t h;
            MOE_TRY(acquire_handle(&h, stream, ws, MOE_CUBLAS_WORKSPACE));
            moe_status_t st = gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, H, E, T, a_inp, H, grad_logits, E,
                                   out, H, rd, rd);
            release_handle();
            MOE_TRY(st);
            if (out != grad_weight) MOE_TRY(cast(grad_weight, weight_dtype, tmp, rd, E * H, s));
        }
    }
    /* grad_bias [E] = Σ_t g: the deterministic two-stage column sum, in fp64 */
    if (grad_bias) {
        double *partial = (double *)(ws + p.off_bias);
        MOE_TRY(moe_launch_col_partial(0, partial, grad_logits, rd, NULL, T, E, s));
        moe_gating_bias_grad_kernel<<<1, MOE_BAL_FINAL_THREADS, 0, s>>>(
            grad_bias, weight_dtype, rd, partial, moe_col_chunks(T), E);
        MOE_CHECK_LAUNCH("moe_gating_bias_grad_kernel");
    }
    return MOE_OK;
}
