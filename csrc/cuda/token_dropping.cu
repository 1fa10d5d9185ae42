/*
 * token_dropping.cu: expert capacity (apply_router_token_dropping) on dense routing, on CUDA.
 *
 * Each expert column keeps its first `capacity` tokens in a stable descending order of a key
 * (probs: the prob, NaN first; position: the routing bit), ties to the lower token index, as the
 * CPU op. The one idea: map each key to an unsigned integer whose order is that order (NaNs to
 * the maximum, -0 to +0), then the kept set of a column is {key > K} ∪ {the first few tokens with
 * key == K}, where K, the capacity-th largest key, comes from an exact radix select (8 bits per
 * pass, histograms in shared memory). So no sort and no O(T²) ranking: a few passes over the
 * column (transposed once so each pass reads it contiguously), and the result is exactly the CPU's.
 * The final masks and probs are one coalesced elementwise pass over [T, E].
 */
#include "cuda_common.cuh"
#include "layout_cuda.cuh"

/* Order-preserving unsigned keys (larger key = earlier in the stable descending order). */
__device__ __forceinline__ uint32_t key32(float f) {
    if (f != f) return 0xffffffffu;
    if (f == 0.0f) f = 0.0f; /* -0 ties with +0, as the CPU's comparison */
    const uint32_t u = moe_float_to_bits(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ uint64_t key64(double f) {
    if (f != f) return 0xffffffffffffffffull;
    if (f == 0.0) f = 0.0;
    const uint64_t u = (uint64_t)__double_as_longlong(f);
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}

template <typename K>
__device__ __forceinline__ K drop_key(const void *probs, const uint8_t *map, moe_dtype_t dtype,
                                     int position, int64_t i);
template <>
__device__ __forceinline__ uint32_t drop_key<uint32_t>(const void *probs, const uint8_t *map,
                                                       moe_dtype_t dtype, int position,
                                                       int64_t i) {
    if (position) return map[i] != 0;
    return key32((float)moe_load(probs, dtype, i)); /* exact: the dtype is not fp64 here */
}
template <>
__device__ __forceinline__ uint64_t drop_key<uint64_t>(const void *probs, const uint8_t *map,
                                                       moe_dtype_t dtype, int position,
                                                       int64_t i) {
    if (position) return map[i] != 0;
    return key64(moe_load(probs, dtype, i));
}

static int key_bytes(moe_drop_policy_t policy, moe_dtype_t dtype) {
    return policy == MOE_DROP_PROBS && dtype == MOE_DTYPE_FP64 ? 8 : 4;
}

/* The [E, T] keys, rounded up to 16 bytes: the 8-byte thresholds that follow must stay aligned
 * when T · E is odd and the keys are 4 bytes wide. */
static size_t keys_region_bytes(int64_t n, size_t width) {
    return ((size_t)n * width + 15) & ~(size_t)15;
}

extern "C" size_t moe_cuda_token_dropping_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                         moe_drop_policy_t policy,
                                                         moe_dtype_t dtype) {
    if (num_tokens <= 0 || num_experts < 1) return 0;
    int64_t cells, total = 0;
    if (moe_checked_mul_i64(num_tokens, num_experts, &cells) ||
        moe_checked_section(&total, cells, (int64_t)key_bytes(policy, dtype), 16) ||
        moe_checked_section(&total, num_experts, 2 * (int64_t)sizeof(int64_t), 1))
        return moe_fail_size("moe_cuda_token_dropping_workspace_size: num_tokens=%lld, "
                             "num_experts=%lld overflow int64 bytes", (long long)num_tokens,
                             (long long)num_experts);
    return (size_t)total; /* = keys_region_bytes(T·E, key width) + 2E int64 */
}

/* keys[e, t] = key of (t, e): a 32 × 32 tile transpose through shared memory, so both the read of
 * [T, E] and the write of [E, T] are coalesced. Block (32, 8), grid (ceil(E/32), ceil(T/32)). */
template <typename K>
__global__ void moe_drop_keys_kernel(K *keys, const void *probs, const uint8_t *map,
                                     moe_dtype_t dtype, int position, int64_t T, int64_t E) {
    __shared__ K tile[32][33];
    const int64_t e0 = (int64_t)blockIdx.x * 32, t0 = (int64_t)blockIdx.y * 32;
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        const int64_t t = t0 + j, e = e0 + threadIdx.x;
        if (t < T && e < E) tile[j][threadIdx.x] = drop_key<K>(probs, map, dtype, position, t * E + e);
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        const int64_t e = e0 + j, t = t0 + threadIdx.x;
        if (t < T && e < E) keys[e * T + t] = tile[threadIdx.x][j];
    }
}

/* One block per column e (1 <= capacity < T): K = the capacity-th largest key by radix select,
 * need = how many tokens with key == K are kept, tie_end[e] = 1 + the token index of the need-th
 * such token in ascending order. Kept: key > K, or key == K and t < tie_end. */
template <typename K>
__global__ void __launch_bounds__(MOE_SCAN_THREADS)
moe_drop_select_kernel(uint64_t *thr, int64_t *tie_end, const K *keys, int64_t T,
                       int64_t capacity) {
    __shared__ unsigned hist[256];
    __shared__ int64_t s_need;
    __shared__ unsigned s_digit;
    __shared__ int64_t s_end;
    const int64_t e = blockIdx.x;
    const K *col = keys + e * T;
    K prefix = 0, mask = 0;
    int64_t need = capacity;
    for (int shift = (int)sizeof(K) * 8 - 8; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
            const K k = col[t];
            if ((k & mask) == prefix) atomicAdd(&hist[(unsigned)(k >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int64_t above = 0;
            unsigned d = 255;
            for (;; --d) {
                if (above + hist[d] >= need || d == 0) break;
                above += hist[d];
            }
            s_digit = d;
            s_need = need - above;
        }
        __syncthreads();
        prefix |= (K)s_digit << shift;
        mask |= (K)255 << shift;
        need = s_need;
        __syncthreads(); /* s_digit / s_need are rewritten next pass */
    }
    /* the need-th token (ascending) with key == prefix */
    if (threadIdx.x == 0) s_end = T;
    __syncthreads();
    int64_t seen = 0;
    for (int64_t t0 = 0; t0 < T && seen < need; t0 += blockDim.x) {
        const int64_t t = t0 + threadIdx.x;
        const int64_t flag = t < T && col[t] == prefix;
        int64_t total;
        const int64_t before = moe_block_exclusive_scan(flag, &total);
        if (flag && seen + before + 1 == need) s_end = t + 1;
        seen += total; /* uniform: every thread leaves the loop together */
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        thr[e] = (uint64_t)prefix;
        tie_end[e] = s_end;
    }
}

/* dst[i] = src[i] · m for one element, with the bits the CPU's double product gives on x86: a kept
 * number is copied; a dropped one becomes a zero of its sign; a NaN comes back quieted (fp16:
 * the canonical NaN of its sign, as moe_store makes it); ±inf · 0 is the default NaN. */
__device__ __forceinline__ void masked_store(void *dst, const void *src, moe_dtype_t dt, int64_t i,
                                             int keep) {
    switch (dt) {
    case MOE_DTYPE_FP32: {
        const uint32_t u = ((const uint32_t *)src)[i], a = u & 0x7fffffffu;
        ((uint32_t *)dst)[i] = a > 0x7f800000u ? (u | 0x00400000u)
                               : keep ? u
                               : a == 0x7f800000u ? 0xffc00000u : (u & 0x80000000u);
        break;
    }
    case MOE_DTYPE_FP64: {
        const uint64_t u = ((const uint64_t *)src)[i], a = u & 0x7fffffffffffffffull;
        ((uint64_t *)dst)[i] = a > 0x7ff0000000000000ull ? (u | 0x0008000000000000ull)
                               : keep ? u
                               : a == 0x7ff0000000000000ull ? 0xfff8000000000000ull
                                                            : (u & 0x8000000000000000ull);
        break;
    }
    case MOE_DTYPE_BF16: {
        const uint16_t u = ((const uint16_t *)src)[i], a = u & 0x7fffu;
        ((uint16_t *)dst)[i] = a > 0x7f80u ? (uint16_t)(u | 0x40u)
                               : keep ? u
                               : a == 0x7f80u ? (uint16_t)0xffc0u : (uint16_t)(u & 0x8000u);
        break;
    }
    case MOE_DTYPE_FP16: {
        const uint16_t u = ((const uint16_t *)src)[i], a = u & 0x7fffu;
        ((uint16_t *)dst)[i] = a > 0x7c00u ? (uint16_t)((u & 0x8000u) | 0x7e00u)
                               : keep ? u
                               : a == 0x7c00u ? (uint16_t)0xfe00u : (uint16_t)(u & 0x8000u);
        break;
    }
    default: break;
    }
}

/* mode 0: keep all (capacity >= T); 1: keep none (capacity == 0); 2: by thr / tie_end. */
template <typename K>
__global__ void moe_drop_apply_kernel(void *final_probs, uint8_t *final_map, const void *probs,
                                      const uint8_t *map, const uint64_t *thr,
                                      const int64_t *tie_end, moe_dtype_t dtype, int position,
                                      int mode, int pad_to_capacity, int64_t T, int64_t E) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * E) return;
    int mask = mode == 0;
    if (mode == 2) {
        const int64_t t = i / E, e = i % E;
        const K k = drop_key<K>(probs, map, dtype, position, i), K0 = (K)thr[e];
        mask = k > K0 || (k == K0 && t < tie_end[e]);
    }
    const int m = pad_to_capacity ? mask : (mask && map[i]);
    final_map[i] = (uint8_t)m;
    masked_store(final_probs, probs, dtype, i, m);
}

__global__ void moe_drop_bwd_kernel(void *grad_routing_probs, const void *grad_final_probs,
                                    const uint8_t *final_map, moe_dtype_t dtype, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) masked_store(grad_routing_probs, grad_final_probs, dtype, i, final_map[i] != 0);
}

template <typename K>
static moe_status_t drop_fwd(void *final_probs, uint8_t *final_map, const void *probs,
                             const uint8_t *map, int64_t T, int64_t E, int64_t capacity,
                             int position, int pad, moe_dtype_t dtype, void *workspace,
                             cudaStream_t st) {
    const int mode = capacity >= T ? 0 : capacity == 0 ? 1 : 2;
    K *keys = (K *)workspace;
    uint64_t *thr = (uint64_t *)((char *)workspace + keys_region_bytes(T * E, sizeof(K)));
    int64_t *tie_end = (int64_t *)(thr + E);
    if (mode == 2) {
        const dim3 tgrid(moe_blocks_for(E, 32), moe_blocks_for(T, 32));
        moe_drop_keys_kernel<K><<<tgrid, dim3(32, 8), 0, st>>>(keys, probs, map, dtype, position, T, E);
        MOE_CHECK_LAUNCH("moe_drop_keys_kernel");
        moe_drop_select_kernel<K><<<(unsigned)E, MOE_SCAN_THREADS, 0, st>>>(thr, tie_end, keys, T,
                                                                           capacity);
        MOE_CHECK_LAUNCH("moe_drop_select_kernel");
    }
    moe_drop_apply_kernel<K><<<moe_blocks_for(T * E, 256), 256, 0, st>>>(
        final_probs, final_map, probs, map, thr, tie_end, dtype, position, mode, pad, T, E);
    MOE_CHECK_LAUNCH("moe_drop_apply_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_token_dropping_fwd(void *final_probs, uint8_t *final_map,
                                                    const void *routing_probs,
                                                    const uint8_t *routing_map,
                                                    int64_t num_tokens, int64_t num_experts,
                                                    int64_t capacity, moe_drop_policy_t policy,
                                                    int pad_to_capacity, moe_dtype_t dtype,
                                                    void *workspace, size_t workspace_bytes,
                                                    void *stream) {
    moe_clear_error();
    MOE_TRY(moe_token_dropping_fwd_check(final_probs, final_map, routing_probs, routing_map,
                                         num_tokens, num_experts, capacity, policy, dtype));
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK_WORKSPACE(moe_cuda_token_dropping_workspace_size, num_tokens, num_experts, policy,
                        dtype);
    const int position = policy == MOE_DROP_POSITION;
    cudaStream_t st = (cudaStream_t)stream;
    if (key_bytes(policy, dtype) == 8)
        return drop_fwd<uint64_t>(final_probs, final_map, routing_probs, routing_map, num_tokens,
                                  num_experts, capacity, position, pad_to_capacity != 0, dtype,
                                  workspace, st);
    return drop_fwd<uint32_t>(final_probs, final_map, routing_probs, routing_map, num_tokens,
                              num_experts, capacity, position, pad_to_capacity != 0, dtype,
                              workspace, st);
}

extern "C" moe_status_t moe_cuda_token_dropping_bwd(void *grad_routing_probs,
                                                    const void *grad_final_probs,
                                                    const uint8_t *final_map, int64_t num_tokens,
                                                    int64_t num_experts, moe_dtype_t dtype,
                                                    void *workspace, size_t workspace_bytes,
                                                    void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_token_dropping_bwd_check(grad_routing_probs, grad_final_probs, final_map,
                                         num_tokens, num_experts, dtype));
    if (num_tokens == 0) return MOE_OK;
    const int64_t n = num_tokens * num_experts;
    moe_drop_bwd_kernel<<<moe_blocks_for(n, 256), 256, 0, (cudaStream_t)stream>>>(
        grad_routing_probs, grad_final_probs, final_map, dtype, n);
    MOE_CHECK_LAUNCH("moe_drop_bwd_kernel");
    return MOE_OK;
}
