/*
 * permute.cu: tokens → the expert-grouped row layout, on CUDA (the backward is in unpermute.cu).
 *
 * The layout is planned with integers only, then the data moves once. Plan: per chunk of
 * MOE_PERM_CHUNK tokens × expert, the routed count; a scan over chunks (per expert) and over
 * experts (the block sizes, padded and cut at the row bound) gives each expert's first row and
 * each chunk's first rank inside its expert. One warp per (chunk, expert) column, a token per
 * lane, then knows every token's rank from one ballot (the chunk's prefix + the routed lanes
 * below); a block loads a 32-token × 32-expert tile of the map in whole rows first, so no access
 * strides by E: the row order is the CPU's (expert ascending, token ascending) with no sort and no
 * atomics, so the integer outputs are the CPU's bit for bit. It also records row_of[t, e] (the
 * row of pair (t, e), or -1) and writes the rows no token fills, so every row is written once.
 *
 * The four kernels (count, chunk scan + plan, rank, scatter) are one programmatic-launch chain:
 * each starts while the previous one finishes and first loads what needs only the op's inputs
 * (the rank kernel its map tile, the scatter its token's first vectors), so the planning costs
 * little more than its own latency.
 *
 * The one clever idea is the data pass: one thread group per TOKEN reads the token's row once,
 * 16 bytes per access, and stores each vector to all of the token's rows (row_of), so the
 * tokens are read T·H times, not T·topk·H times, and every output row still has one writer.
 */
#include <type_traits>

#include "layout_cuda.cuh"

/* Tokens per (chunk, expert) column: one warp, one token per lane, so a column's routed flags
 * are one __ballot_sync and a token's rank inside the column is one __popc. */
#define MOE_PERM_CHUNK 32
/* Warps per block of the column kernels; each takes every 8th column of the block's tile. */
#define MOE_PERM_WARPS 8
/* Experts per tile of the column kernels: a block loads the flags of 32 tokens × 32 experts in
 * whole token rows (coalesced at any E) and its warps read the columns from shared memory. */
#define MOE_PERM_TILE_E 32
/* The per-expert chunk scan: one block per expert, each thread owning MOE_CSCAN_ITEMS
 * consecutive chunks (independent loads, unrolled), so E = 8 still has 8 full blocks. */
#define MOE_CSCAN_THREADS 256
#define MOE_CSCAN_ITEMS 4

__device__ __forceinline__ int64_t d_round_up(int64_t x, int64_t m) {
    return m > 1 ? (x + m - 1) / m * m : x;
}

/* Workspace sections (each 16-byte aligned). */
typedef struct {
    int32_t *chunk_rank; /* [E, nchunks]: routed count of the chunk, then its exclusive prefix */
    int64_t *count;      /* [E]: routed tokens of each expert */
    int32_t *row_of;     /* [T, E]: row of pair (t, e), or -1 */
    unsigned *done;      /* [1]: chunk-scan blocks finished (the last one plans) */
} perm_ws_t;

static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

static size_t perm_ws_layout(int64_t T, int64_t E, perm_ws_t *ws, void *base) {
    const int64_t nchunks = (T + MOE_PERM_CHUNK - 1) / MOE_PERM_CHUNK;
    size_t off = 0;
    const size_t a = off;
    off += align16((size_t)(nchunks * E) * sizeof(int32_t));
    const size_t b = off;
    off += align16((size_t)E * sizeof(int64_t));
    const size_t c = off;
    off += align16((size_t)(T * E) * sizeof(int32_t));
    const size_t d = off;
    off += align16(sizeof(unsigned));
    if (ws) {
        ws->chunk_rank = (int32_t *)((char *)base + a);
        ws->count = (int64_t *)((char *)base + b);
        ws->row_of = (int32_t *)((char *)base + c);
        ws->done = (unsigned *)((char *)base + d);
    }
    return off;
}

extern "C" size_t moe_cuda_permute_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                  const moe_permute_params_t *params) {
    (void)params;
    if (num_tokens < 0 || num_experts < 1) return 0;
    return perm_ws_layout(num_tokens, num_experts, NULL, NULL);
}

/* Flags of tokens [t0, t0 + 32) × experts [e0, e0 + 32) into s[token][expert] (0 outside the
 * map): each warp reads whole token rows, so the loads are coalesced at any E, and the column
 * phase then reads a column from shared memory instead of 32 rows E bytes apart. */
__device__ __forceinline__ void load_flag_tile(uint8_t (*s)[MOE_PERM_TILE_E + 1],
                                               const uint8_t *__restrict__ routing_map,
                                               int64_t t0, int64_t e0, int64_t T, int64_t E) {
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    for (int j = ty; j < MOE_PERM_CHUNK; j += MOE_PERM_WARPS) {
        const int64_t t = t0 + j, e = e0 + tx;
        s[j][tx] = (t < T && e < E) ? (uint8_t)(routing_map[t * E + e] != 0) : (uint8_t)0;
    }
}

/* chunk_rank[e, c] = routed tokens of expert e in chunk c. Block (chunk c, experts e0..e0+31):
 * the tile's flags are loaded coalesced, then each warp ballots its columns. */
__global__ void __launch_bounds__(MOE_PERM_WARPS * 32)
moe_permute_count_kernel(int32_t *chunk_rank, unsigned *done,
                         const uint8_t *__restrict__ routing_map, int64_t T, int64_t E,
                         int64_t nchunks) {
    __shared__ uint8_t s_flag[MOE_PERM_CHUNK][MOE_PERM_TILE_E + 1];
    moe_pdl_trigger();
    const int64_t c = blockIdx.x, e0 = (int64_t)blockIdx.y * MOE_PERM_TILE_E;
    /* the chunk scan, which counts its finished blocks here, starts after this grid ends */
    if (c == 0 && blockIdx.y == 0 && threadIdx.x == 0) *done = 0u;
    load_flag_tile(s_flag, routing_map, c * MOE_PERM_CHUNK, e0, T, E);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int col = threadIdx.x >> 5; col < MOE_PERM_TILE_E && e0 + col < E; col += MOE_PERM_WARPS) {
        const uint32_t bits = __ballot_sync(0xffffffffu, s_flag[lane][col] != 0);
        if (lane == 0) chunk_rank[(e0 + col) * nchunks + c] = __popc(bits);
    }
}

/* The chunk scan's last block: the block sizes (padded, or the capacity), their scan, and the cut
 * at the row bound R: offsets[e + 1] = min(R, Σ_{e' <= e} block_e') (equivalent to the CPU's
 * running "room" cut). count is read past L1: other blocks of the same grid have just written it.
 * With T = 0 there is no chunk and every count is 0, but the same block plans. */
__device__ __forceinline__ void plan_block(int64_t *expert_offsets, int64_t *tokens_per_expert,
                                           const int64_t *count, int64_t E, int64_t R, int dap,
                                           int64_t capacity, int64_t align) {
    /* each thread owns a contiguous run of experts */
    const int64_t per = (E + MOE_CSCAN_THREADS - 1) / MOE_CSCAN_THREADS;
    const int64_t e0 = threadIdx.x * per, e1 = e0 + per < E ? e0 + per : E;
    int64_t local = 0;
    for (int64_t e = e0; e < e1; ++e)
        local += dap ? d_round_up(capacity, align) : d_round_up(__ldcg(count + e), align);
    int64_t total;
    int64_t run = moe_block_exclusive_scan_n<MOE_CSCAN_THREADS>(local, &total);
    if (threadIdx.x == 0) expert_offsets[0] = 0;
    for (int64_t e = e0; e < e1; ++e) {
        const int64_t lo = run < R ? run : R;
        run += dap ? d_round_up(capacity, align) : d_round_up(__ldcg(count + e), align);
        const int64_t hi = run < R ? run : R;
        expert_offsets[e + 1] = hi;
        tokens_per_expert[e] = hi - lo;
    }
}

/* Per expert (one block each): the exclusive scan of chunk_rank[e, :] in place, and the
 * expert's total. Thread i owns chunks [tile + i·ITEMS, +ITEMS): its loads are independent and
 * issued together, so a tile costs one memory latency plus one block scan. The block that
 * finishes last (an integer ticket; which block it is does not change any value) then plans
 * the layout from the totals: no separate launch for E numbers. */
__global__ void __launch_bounds__(MOE_CSCAN_THREADS)
moe_permute_chunk_scan_kernel(int32_t *chunk_rank, int64_t *count, unsigned *done,
                              int64_t *expert_offsets, int64_t *tokens_per_expert,
                              int64_t nchunks, int64_t E, int64_t R, int dap, int64_t capacity,
                              int64_t align) {
    __shared__ int s_last;
    moe_pdl_trigger();
    moe_pdl_wait();
    int32_t *col = chunk_rank + (int64_t)blockIdx.x * nchunks;
    int64_t run = 0;
    for (int64_t tile = 0; tile < nchunks; tile += MOE_CSCAN_THREADS * MOE_CSCAN_ITEMS) {
        const int64_t c0 = tile + (int64_t)threadIdx.x * MOE_CSCAN_ITEMS;
        int32_t v[MOE_CSCAN_ITEMS];
        int64_t local = 0;
#pragma unroll
        for (int j = 0; j < MOE_CSCAN_ITEMS; ++j) {
            v[j] = c0 + j < nchunks ? col[c0 + j] : 0;
            local += v[j];
        }
        int64_t total;
        int64_t pre = run + moe_block_exclusive_scan_n<MOE_CSCAN_THREADS>(local, &total);
#pragma unroll
        for (int j = 0; j < MOE_CSCAN_ITEMS; ++j)
            if (c0 + j < nchunks) {
                col[c0 + j] = (int32_t)pre; /* < T <= INT32_MAX */
                pre += v[j];
            }
        run += total;
    }
    if (threadIdx.x == 0) {
        count[blockIdx.x] = run;
        __threadfence(); /* the total is visible before the ticket that counts it */
        s_last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    plan_block(expert_offsets, tokens_per_expert, count, E, R, dap, capacity, align);
}

/* A row with no token: index -1, prob 0. */
__device__ __forceinline__ void d_pad_row(int64_t *sorted_indices, void *permuted_probs,
                                          int64_t r, moe_dtype_t probs_dtype) {
    sorted_indices[r] = -1;
    if (permuted_probs) moe_store(permuted_probs, probs_dtype, r, 0.0);
}

/*
 * The rank kernel. Block (RG chunks of 32 tokens, experts e0..e0+31): the tile's flags (and
 * probs) are loaded coalesced into shared memory; then each warp takes whole columns (expert e),
 * and for each chunk of the group lane = token t = 32c + lane. The column's routed flags are one
 * ballot; a routed token's position inside its expert is the chunk's prefix plus the routed lanes
 * below it; with drop_and_pad an unrouted token t takes count_e + (t − routed before t), which is
 * the stable descending sort of the column. Positions below the block's real length get a row;
 * every lane stores its own; row_of goes back through shared memory so that it too is written in
 * whole token rows.
 *
 * The same launch writes the rows that no token fills (index -1, prob 0), so each row of
 * sorted_indices / permuted_probs is written exactly once: expert e's padding
 * [base + filled_e, offsets[e + 1]) is shared by its ncols column warps, the tail
 * [offsets[E], R) by all warps. ncols = max(nchunks, 1): with T = 0 the one column has no token
 * but still writes the padding.
 *
 * Groups of chunks because a column's setup (its count, offsets, block length) is then done once
 * per group instead of once per chunk, and the probs are loaded by code specialised to their dtype
 * (PDT: a moe_dtype_t, or -1 without probs) and staged as float (double for fp64), where a
 * generic load spent about 25 instructions per element on moe_load's switch. (ncu at qwen3, the
 * one-chunk kernel: instruction-bound, 7549 warp instructions per 32 x 32 block, 31% in the tile
 * loads and 55% in the column loop; with groups, qwen3's permute went 0.197 → 0.188 ms, same run,
 * 2026-12-03.) Grid (ceil(ncols / RG), E tiles).
 */
#define MOE_RG_CHUNKS(PDT) ((PDT) == MOE_DTYPE_FP64 ? 2 : 4)

template <int PDT>
__global__ void __launch_bounds__(MOE_PERM_WARPS * 32)
moe_permute_rank_groups_kernel(int64_t *sorted_indices, void *permuted_probs, int32_t *row_of,
                               const int32_t *chunk_rank, const int64_t *count,
                               const int64_t *expert_offsets, const int64_t *tokens_per_expert,
                               const uint8_t *__restrict__ routing_map,
                               const void *__restrict__ probs, int64_t T, int64_t E,
                               int64_t nchunks, int64_t ncols, int64_t R, int dap,
                               int64_t capacity) {
    constexpr int RG = MOE_RG_CHUNKS(PDT);
    constexpr int TOK = RG * MOE_PERM_CHUNK; /* tokens of the block */
    typedef typename std::conditional<PDT == MOE_DTYPE_FP64, double, float>::type PD;
    __shared__ uint8_t s_flag[TOK][MOE_PERM_TILE_E + 1];
    __shared__ PD s_prob[PDT >= 0 ? TOK : 1][MOE_PERM_TILE_E + 1];
    __shared__ int32_t s_row[TOK][MOE_PERM_TILE_E + 1];
    const int64_t c0 = (int64_t)blockIdx.x * RG, e0 = (int64_t)blockIdx.y * MOE_PERM_TILE_E;
    const int64_t t0 = c0 * MOE_PERM_CHUNK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    moe_pdl_trigger();
    /* the op's inputs, loaded while the chunk scan may still run: whole token rows, coalesced */
    for (int j = warp; j < TOK; j += MOE_PERM_WARPS) {
        const int64_t t = t0 + j, e = e0 + lane;
        const bool in = t < T && e < E;
        s_flag[j][lane] = in ? (uint8_t)(routing_map[t * E + e] != 0) : (uint8_t)0;
        if (PDT >= 0 && in) s_prob[j][lane] = (PD)moe_load(probs, (moe_dtype_t)PDT, t * E + e);
    }
    moe_pdl_wait(); /* the chunk ranks, counts and offsets are the chunk scan's */
    __syncthreads();
    const int64_t real_cap = dap ? (capacity < T ? capacity : T) : 0;
    for (int col = warp; col < MOE_PERM_TILE_E && e0 + col < E; col += MOE_PERM_WARPS) {
        const int64_t e = e0 + col;
        const int64_t n = tokens_per_expert[e], base = expert_offsets[e], count_e = count[e];
        const int64_t real = dap ? real_cap : n;
        const int64_t lim = real < n ? real : n;
        const int64_t have = dap ? T : count_e;
        const int64_t filled = have < lim ? have : lim;
        const int32_t *ranks = chunk_rank + e * nchunks;
        for (int k = 0; k < RG; ++k) {
            const int64_t c = c0 + k;
            if (c >= ncols) break; /* warp-uniform */
            if (c < nchunks) {
                const int j = k * MOE_PERM_CHUNK + lane;
                const int64_t t = t0 + j;
                const bool in = t < T;
                const bool routed = s_flag[j][col] != 0;
                const uint32_t bits = __ballot_sync(0xffffffffu, routed);
                const int64_t before = (int64_t)ranks[c] + __popc(bits & ((1u << lane) - 1u));
                const int64_t pos = routed ? before : (dap && in) ? count_e + (t - before) : -1;
                int32_t row = -1;
                if (in && pos >= 0 && pos < lim) {
                    row = (int32_t)(base + pos);
                    sorted_indices[row] = t;
                    if (PDT >= 0 && permuted_probs)
                        moe_store(permuted_probs, (moe_dtype_t)PDT, row, (double)s_prob[j][col]);
                }
                s_row[j][col] = row;
            }
            /* rows [base + filled, base + n): no token; shared by the ncols column warps */
            for (int64_t r = base + filled + c * 32 + lane; r < base + n; r += ncols * 32)
                d_pad_row(sorted_indices, permuted_probs, r, (moe_dtype_t)(PDT >= 0 ? PDT : 0));
        }
    }
    __syncthreads();
    for (int j = warp; j < TOK; j += MOE_PERM_WARPS) {
        const int64_t t = t0 + j, e = e0 + lane;
        if (t < T && e < E) row_of[t * E + e] = s_row[j][lane];
    }
    const int64_t nwarps = (int64_t)gridDim.x * gridDim.y * MOE_PERM_WARPS;
    const int64_t g = ((int64_t)blockIdx.y * gridDim.x + blockIdx.x) * MOE_PERM_WARPS + warp;
    for (int64_t r = expert_offsets[E] + g * 32 + lane; r < R; r += nwarps * 32)
        d_pad_row(sorted_indices, permuted_probs, r, (moe_dtype_t)(PDT >= 0 ? PDT : 0));
}

/* The data pass. blockDim = (X, Y), X a multiple of 32: Y tokens per block, X threads per token.
 * Each thread group loads its token's first vectors (the op's input, before the wait), gathers
 * the token's destination rows into shared memory (their order does not matter: each row has one
 * writer), then streams the token's row once, storing each vector to every row. The rows that no
 * token fills (padding, the tail after offsets[E]) are zeroed by the same grid, 32 per warp, so
 * no further launch follows. */
template <int W>
__global__ void __launch_bounds__(256)
moe_permute_scatter_kernel(void *__restrict__ permuted_tokens, const void *__restrict__ tokens,
                           const int32_t *__restrict__ row_of,
                           const int64_t *__restrict__ sorted_indices, int64_t T, int64_t E,
                           int64_t R, int64_t nvec) {
    typedef typename moe_vec_t<W>::type V;
    extern __shared__ int32_t s_dst[]; /* [Y, E] */
    __shared__ int s_n[32];
    moe_pdl_trigger();
    const int y = threadIdx.y, x = threadIdx.x;
    const int64_t X = blockDim.x;
    const int64_t t = (int64_t)blockIdx.x * blockDim.y + y;
    const bool live = t < T;
    const V *src = (const V *)tokens + t * nvec;
    /* four independent 16-byte loads in flight per thread before their stores */
    V val[4];
    int64_t v0 = x;
    if (live)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (v0 + j * X < nvec) val[j] = src[v0 + j * X];
    moe_pdl_wait(); /* row_of and sorted_indices are the rank kernel's */
    int32_t *dst = s_dst + (int64_t)y * E;
    if (x == 0) s_n[y] = 0;
    __syncthreads();
    if (live)
        for (int64_t e = x; e < E; e += X) {
            const int32_t r = row_of[t * E + e];
            if (r >= 0) dst[atomicAdd(&s_n[y], 1)] = r;
        }
    __syncthreads();
    V *out = (V *)permuted_tokens;
    if (live) {
        const int n = s_n[y];
        for (;;) {
            for (int k = 0; k < n; ++k) {
                V *row = out + (int64_t)dst[k] * nvec;
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (v0 + j * X < nvec) row[v0 + j * X] = val[j];
            }
            v0 += 4 * X;
            if (v0 >= nvec) break;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (v0 + j * X < nvec) val[j] = src[v0 + j * X];
        }
    }
    const int64_t wpb = X * blockDim.y / 32; /* warps per block */
    const int64_t tid = (int64_t)y * X + x, nwarps = (int64_t)gridDim.x * wpb;
    for (int64_t r0 = ((int64_t)blockIdx.x * wpb + tid / 32) * 32; r0 < R; r0 += nwarps * 32)
        moe_zero_pad_warp<W>(permuted_tokens, sorted_indices, r0, R, T, nvec);
}

template <int W>
static moe_status_t launch_data(void *permuted_tokens, const void *tokens, const int32_t *row_of,
                                const int64_t *sorted_indices, int64_t T, int64_t E, int64_t R,
                                size_t row_bytes, cudaStream_t stream) {
    const int64_t nvec = (int64_t)(row_bytes / W);
    if (T > 0) {
        /* a quarter of the row's vectors per thread group: every thread then has four 16-byte
         * loads in flight (narrow rows, like qwen3's 4 KB, otherwise had one per thread); more
         * tokens per block only while their destination lists fit 48 KB of shared memory */
        int X = moe_pow2_clamp((nvec + 3) / 4, 32, 256), Y = 256 / X;
        while (Y > 1 && (size_t)Y * (size_t)E * sizeof(int32_t) > 48 * 1024) X *= 2, Y /= 2;
        const size_t smem = (size_t)Y * (size_t)E * sizeof(int32_t);
        void (*scatter)(void *, const void *, const int32_t *, const int64_t *, int64_t, int64_t,
                        int64_t, int64_t) = moe_permute_scatter_kernel<W>;
        if (smem > 48 * 1024) {
            cudaError_t err = cudaFuncSetAttribute(scatter,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   (int)smem);
            if (err != cudaSuccess)
                return moe_fail(MOE_ERR_UNSUPPORTED,
                                "permute: num_experts=%lld needs %zu bytes of shared memory: %s",
                                (long long)E, smem, cudaGetErrorString(err));
        }
        MOE_LAUNCH_CHAINED(scatter, dim3(moe_blocks_for(T, Y)), dim3(X, Y), smem, stream,
                           permuted_tokens, tokens, row_of, sorted_indices, T, E, R, nvec);
        MOE_CHECK_LAUNCH("moe_permute_scatter_kernel");
    } else if (R > 0) {
        void (*pad)(void *, const int64_t *, int64_t, int64_t, int64_t) =
            moe_zero_pad_rows_kernel<W>;
        MOE_LAUNCH_CHAINED(pad, dim3(moe_blocks_for(R, 256)), dim3(256), 0, stream,
                           permuted_tokens, sorted_indices, R, T, nvec);
        MOE_CHECK_LAUNCH("moe_zero_pad_rows_kernel");
    }
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_permute_fwd(void *permuted_tokens, void *permuted_probs,
                                             int64_t *sorted_indices, int64_t *expert_offsets,
                                             int64_t *tokens_per_expert, const void *tokens,
                                             const uint8_t *routing_map, const void *probs,
                                             int64_t num_tokens, int64_t hidden,
                                             int64_t num_experts, moe_dtype_t dtype,
                                             moe_dtype_t probs_dtype,
                                             const moe_permute_params_t *params, void *workspace,
                                             size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_CHECK(params != NULL, "params must not be NULL");
    const int64_t T = num_tokens, E = num_experts;
    MOE_CHECK(T >= 0, "num_tokens must be >= 0, got %lld", (long long)T);
    MOE_CHECK(hidden >= 1, "hidden must be >= 1, got %lld", (long long)hidden);
    MOE_CHECK(E >= 1, "num_experts must be >= 1, got %lld", (long long)E);
    MOE_CHECK(params->num_out_tokens >= 0, "num_out_tokens must be >= 0, got %lld",
              (long long)params->num_out_tokens);
    MOE_CHECK(params->align_size >= 0, "align_size must be >= 0, got %lld",
              (long long)params->align_size);
    const size_t esize = moe_dtype_size(dtype);
    MOE_CHECK(esize > 0, "tokens has an unknown dtype (%d)", (int)dtype);
    MOE_CHECK(!permuted_probs || moe_is_float_dtype(probs_dtype),
              "probs must be a float dtype, got %s", moe_dtype_name(probs_dtype));
    MOE_CHECK(!permuted_probs || T == 0 || probs,
              "probs must not be NULL when permuted_probs is requested");
    MOE_CHECK(expert_offsets && tokens_per_expert,
              "expert_offsets and tokens_per_expert must not be NULL");
    const int64_t R = moe_permute_num_rows(T, E, params);
    MOE_CHECK(R == 0 || (permuted_tokens && sorted_indices),
              "permuted_tokens and sorted_indices must not be NULL");
    MOE_CHECK(T == 0 || (tokens && routing_map), "tokens and routing_map must not be NULL");
    /* row_of and the per-chunk ranks are int32 */
    MOE_CHECK(T <= INT32_MAX, "num_tokens=%lld; the CUDA kernel supports at most %d",
              (long long)T, INT32_MAX);
    MOE_CHECK(R <= INT32_MAX, "the permuted buffer has %lld rows; the CUDA kernel supports at "
              "most %d", (long long)R, INT32_MAX);
    const size_t need = moe_cuda_permute_workspace_size(T, E, params);
    MOE_CHECK(workspace_bytes >= need && (need == 0 || workspace),
              "workspace too small: %zu bytes, need at least %zu "
              "(moe_cuda_permute_workspace_size)", workspace_bytes, need);
    perm_ws_t ws;
    perm_ws_layout(T, E, &ws, workspace);
    cudaStream_t st = (cudaStream_t)stream;
    const int dap = params->drop_and_pad != 0;
    const int64_t align = params->align_size > 1 ? params->align_size : 1;
    const int64_t capacity = dap ? params->num_out_tokens / E : 0;
    const int64_t nchunks = (T + MOE_PERM_CHUNK - 1) / MOE_PERM_CHUNK;
    const int64_t ncols = nchunks > 0 ? nchunks : 1;
    /* column kernels: grid (chunks, tiles of 32 experts) */
    const int64_t etiles = (E + MOE_PERM_TILE_E - 1) / MOE_PERM_TILE_E;
    MOE_CHECK(etiles <= 65535, "num_experts=%lld; the CUDA kernel supports at most %d",
              (long long)E, 65535 * MOE_PERM_TILE_E);

    /* count → chunk scan (+ plan) → rank → scatter: the first launch is ordinary, the rest
     * are chained (cuda_common.cuh) */
    if (nchunks > 0) {
        moe_permute_count_kernel<<<dim3((unsigned)nchunks, (unsigned)etiles),
                                   MOE_PERM_WARPS * 32, 0, st>>>(ws.chunk_rank, ws.done,
                                                                routing_map, T, E, nchunks);
        MOE_CHECK_LAUNCH("moe_permute_count_kernel");
    } else { /* T = 0: no chunk to count; the scan below only writes zero counts and plans */
        MOE_CHECK(cudaMemsetAsync(ws.done, 0, sizeof(unsigned), st) == cudaSuccess,
                  "permute: cudaMemsetAsync of the chunk-scan ticket failed");
    }
    MOE_LAUNCH_CHAINED(moe_permute_chunk_scan_kernel, dim3((unsigned)E), dim3(MOE_CSCAN_THREADS),
                       0, st, ws.chunk_rank, ws.count, ws.done, expert_offsets, tokens_per_expert,
                       nchunks, E, R, dap, capacity, align);
    MOE_CHECK_LAUNCH("moe_permute_chunk_scan_kernel");
    if (R == 0) return MOE_OK; /* no row to fill (row_of is only read by the scatter) */
    typedef void (*rank_fn)(int64_t *, void *, int32_t *, const int32_t *, const int64_t *,
                            const int64_t *, const int64_t *, const uint8_t *, const void *,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int, int64_t);
    rank_fn rank;
    switch (permuted_probs ? (int)probs_dtype : -1) {
    case MOE_DTYPE_FP32: rank = moe_permute_rank_groups_kernel<MOE_DTYPE_FP32>; break;
    case MOE_DTYPE_FP64: rank = moe_permute_rank_groups_kernel<MOE_DTYPE_FP64>; break;
    case MOE_DTYPE_FP16: rank = moe_permute_rank_groups_kernel<MOE_DTYPE_FP16>; break;
    case MOE_DTYPE_BF16: rank = moe_permute_rank_groups_kernel<MOE_DTYPE_BF16>; break;
    default: rank = moe_permute_rank_groups_kernel<-1>; break;
    }
    const int rg = permuted_probs && probs_dtype == MOE_DTYPE_FP64 ? MOE_RG_CHUNKS(MOE_DTYPE_FP64)
                                                                   : MOE_RG_CHUNKS(MOE_DTYPE_FP32);
    MOE_LAUNCH_CHAINED(rank, dim3((unsigned)((ncols + rg - 1) / rg), (unsigned)etiles),
                       dim3(MOE_PERM_WARPS * 32), 0, st, sorted_indices, permuted_probs,
                       ws.row_of, ws.chunk_rank, ws.count, expert_offsets, tokens_per_expert,
                       routing_map, probs, T, E, nchunks, ncols, R, dap, capacity);
    MOE_CHECK_LAUNCH("moe_permute_rank_groups_kernel");

    const size_t row_bytes = (size_t)hidden * esize;
    switch (moe_vec_bytes(row_bytes, permuted_tokens, tokens, NULL)) {
    case 16: return launch_data<16>(permuted_tokens, tokens, ws.row_of, sorted_indices, T, E, R, row_bytes, st);
    case 8: return launch_data<8>(permuted_tokens, tokens, ws.row_of, sorted_indices, T, E, R, row_bytes, st);
    case 4: return launch_data<4>(permuted_tokens, tokens, ws.row_of, sorted_indices, T, E, R, row_bytes, st);
    case 2: return launch_data<2>(permuted_tokens, tokens, ws.row_of, sorted_indices, T, E, R, row_bytes, st);
    default: return launch_data<1>(permuted_tokens, tokens, ws.row_of, sorted_indices, T, E, R, row_bytes, st);
    }
}
