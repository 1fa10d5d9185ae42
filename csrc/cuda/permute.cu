/*
 * permute.cu: tokens → the expert-grouped row layout, on CUDA (the backward, and its chunked
 * accumulate permute_bwd_accumulate, are in permute_bwd.cu).
 *
 * The layout is planned with integers only, then the data moves once. Plan: per chunk of
 * MOE_PERM_CHUNK tokens × expert, the column's routed flags as one 32-bit ballot and their
 * count; a scan over chunks (per expert) and over experts (the block sizes, padded and cut at
 * the row bound) gives each expert's first row and each chunk's first rank inside its expert.
 * A token's rank inside an expert is then its chunk's prefix plus the set bits below it in the
 * ballot: the row order is the CPU's (expert ascending, token ascending) with no sort and no
 * atomics, so the integer outputs are the CPU's bit for bit.
 *
 * The three kernels (count, chunk scan + plan, rank + scatter) are one programmatic-launch chain:
 * each starts while the previous one finishes and first loads what needs only the op's inputs
 * (the scatter its token's first vectors), so the planning costs little more than its latency.
 * With E <= MOE_PERM_PLAN_E the plan moves into the scatter: each block's first warp scans the E
 * block sizes into shared memory (a few shuffles, the counts loaded while the block's other
 * threads load their ballots), which spares the chunk scan its ticket and last block, the serial
 * tail of the chain, which weighs most where the data pass is short (few experts).
 *
 * The one clever idea is the data pass: one thread group per TOKEN computes the token's rows
 * from the ballots, reads the token's row once, 16 bytes per access, and stores each vector to
 * all of its rows, so the tokens are read T·H times, not T·topk·H times, every output row has
 * one writer, and no [T, E] table of rows goes through memory between the plan and the data.
 */
#include "layout_cuda.cuh"

/* Tokens per (chunk, expert) column: one warp, one token per lane, so a column's routed flags
 * are one __ballot_sync and a token's rank inside the column is one __popc. */
#define MOE_PERM_CHUNK 32
/* Warps per block of the count kernel; each takes every 8th column of the block's tile. */
#define MOE_PERM_WARPS 8
/* Experts per tile of the count kernel: a block loads the flags of 32 tokens × 32 experts in
 * whole token rows (coalesced at any E) and its warps read the columns from shared memory. */
#define MOE_PERM_TILE_E 32
/* The per-expert chunk scan: one block per expert, each thread owning MOE_CSCAN_ITEMS
 * consecutive chunks (independent loads, unrolled), so E = 8 still has 8 full blocks. */
#define MOE_CSCAN_THREADS 256
#define MOE_CSCAN_ITEMS 4
/* Experts the scatter plans itself, one warp per block: 8 counts per lane. */
#define MOE_PERM_PLAN_E 256
#define MOE_PERM_PLAN_PER (MOE_PERM_PLAN_E / 32)

__device__ __forceinline__ int64_t d_round_up(int64_t x, int64_t m) {
    return m > 1 ? (x + m - 1) / m * m : x;
}

/* The rows of a block that tokens may take. With drop_and_pad every token has a position in
 * every block and the first real_cap = min(capacity, T) of them get a row; dropless, the block's
 * n rows. The plan (which counts the empty rows), the scatter (which fills rows) and its padding
 * pass (which writes the rest) must agree on these, so they are spelled once. */
__device__ __forceinline__ int64_t perm_real_cap(int dap, int64_t capacity, int64_t T) {
    return dap ? (capacity < T ? capacity : T) : 0;
}
__device__ __forceinline__ int64_t perm_row_limit(int dap, int64_t real_cap, int64_t n) {
    return dap && real_cap < n ? real_cap : n;
}
/* Rows [0, filled) of a block of n rows hold a token: min(tokens with a position, the limit);
 * have = T with drop_and_pad, else the expert's routed count. */
__device__ __forceinline__ int64_t perm_filled(int dap, int64_t have, int64_t real_cap,
                                               int64_t n) {
    const int64_t lim = perm_row_limit(dap, real_cap, n);
    return have < lim ? have : lim;
}

/* Workspace sections (each 16-byte aligned). */
typedef struct {
    int32_t *chunk_rank; /* [E, nchunks]: routed count of the chunk, then its exclusive prefix */
    uint32_t *col_bits;  /* [nchunks, E]: chunk c's routed flags of expert e, bit l: token 32c+l */
    int64_t *count;      /* [E]: routed tokens of each expert */
    /* the last two for E > MOE_PERM_PLAN_E only (below, the scatter plans) */
    int64_t *npad;       /* [1]: rows that no token fills (padding, the tail) */
    unsigned *done;      /* [1]: chunk-scan blocks finished (the last one plans) */
} perm_ws_t;

static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

static size_t perm_ws_layout(int64_t T, int64_t E, perm_ws_t *ws, void *base) {
    const int64_t nchunks = T / MOE_PERM_CHUNK + (T % MOE_PERM_CHUNK != 0);
    const size_t sizes[5] = {(size_t)(nchunks * E) * sizeof(int32_t),
                             (size_t)(nchunks * E) * sizeof(uint32_t), (size_t)E * sizeof(int64_t),
                             sizeof(int64_t), sizeof(unsigned)};
    size_t off[5], total = 0;
    for (int i = 0; i < 5; ++i) off[i] = total, total += align16(sizes[i]);
    if (ws) {
        ws->chunk_rank = (int32_t *)((char *)base + off[0]);
        ws->col_bits = (uint32_t *)((char *)base + off[1]);
        ws->count = (int64_t *)((char *)base + off[2]);
        ws->npad = (int64_t *)((char *)base + off[3]);
        ws->done = (unsigned *)((char *)base + off[4]);
    }
    return total;
}

extern "C" size_t moe_cuda_permute_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                  const moe_permute_params_t *params) {
    (void)params;
    if (num_tokens < 0 || num_experts < 1) return 0;
    /* perm_ws_layout's sections, checked: once this total fits, its size_t sums do too */
    const int64_t nchunks = num_tokens / MOE_PERM_CHUNK + (num_tokens % MOE_PERM_CHUNK != 0);
    int64_t cells, total = 0;
    if (moe_checked_mul_i64(nchunks, num_experts, &cells) ||
        moe_checked_section(&total, cells, (int64_t)sizeof(int32_t), 16) ||
        moe_checked_section(&total, cells, (int64_t)sizeof(uint32_t), 16) ||
        moe_checked_section(&total, num_experts, (int64_t)sizeof(int64_t), 16) ||
        moe_checked_section(&total, 1, (int64_t)sizeof(int64_t), 16) ||
        moe_checked_section(&total, 1, (int64_t)sizeof(unsigned), 16))
        return moe_fail_size("moe_cuda_permute_workspace_size: num_tokens=%lld, num_experts=%lld "
                             "overflow int64 bytes", (long long)num_tokens,
                             (long long)num_experts);
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

/* chunk_rank[e, c] = routed tokens of expert e in chunk c, col_bits[c, e] the ballot itself.
 * Block (chunk c, experts e0..e0+31): the tile's flags are loaded coalesced, then each warp
 * ballots its columns. */
__global__ void __launch_bounds__(MOE_PERM_WARPS * 32)
moe_permute_count_kernel(int32_t *chunk_rank, uint32_t *col_bits, unsigned *done,
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
        if (lane == 0) {
            chunk_rank[(e0 + col) * nchunks + c] = __popc(bits);
            col_bits[c * E + e0 + col] = bits;
        }
    }
}

/* The chunk scan's last block: the block sizes (padded, or the capacity), their scan, and the cut
 * at the row bound R: offsets[e + 1] = min(R, Σ_{e' <= e} block_e') (equivalent to the CPU's
 * running "room" cut); and npad, the rows no token fills (R − Σ filled_e), which tells the
 * scatter whether it has padding to write at all. count is read past L1: other blocks of the
 * same grid have just written it. With T = 0 there is no chunk and every count is 0, but the
 * same block plans. */
__device__ __forceinline__ void plan_block(int64_t *expert_offsets, int64_t *tokens_per_expert,
                                           int64_t *npad, const int64_t *count, int64_t T,
                                           int64_t E, int64_t R, int dap, int64_t capacity,
                                           int64_t align) {
    /* each thread owns a contiguous run of experts */
    const int64_t per = (E + MOE_CSCAN_THREADS - 1) / MOE_CSCAN_THREADS;
    const int64_t e0 = threadIdx.x * per, e1 = e0 + per < E ? e0 + per : E;
    const int64_t real_cap = perm_real_cap(dap, capacity, T);
    int64_t local = 0;
    for (int64_t e = e0; e < e1; ++e)
        local += dap ? d_round_up(capacity, align) : d_round_up(__ldcg(count + e), align);
    int64_t total;
    int64_t run = moe_block_exclusive_scan_n<MOE_CSCAN_THREADS>(local, &total);
    if (threadIdx.x == 0) expert_offsets[0] = 0;
    int64_t filled = 0;
    for (int64_t e = e0; e < e1; ++e) {
        const int64_t lo = run < R ? run : R;
        const int64_t count_e = __ldcg(count + e);
        run += dap ? d_round_up(capacity, align) : d_round_up(count_e, align);
        const int64_t hi = run < R ? run : R;
        expert_offsets[e + 1] = hi;
        tokens_per_expert[e] = hi - lo;
        filled += perm_filled(dap, dap ? T : count_e, real_cap, hi - lo);
    }
    moe_block_exclusive_scan_n<MOE_CSCAN_THREADS>(filled, &total);
    if (threadIdx.x == 0) *npad = R - total;
}

/* Per expert (one block each): the exclusive scan of chunk_rank[e, :] in place, and the
 * expert's total. Thread i owns chunks [tile + i·ITEMS, +ITEMS): its loads are independent and
 * issued together, so a tile costs one memory latency plus one block scan. The block that
 * finishes last (an integer ticket; which block it is does not change any value) then plans
 * the layout from the totals: no separate launch for E numbers. plan_here (E <=
 * MOE_PERM_PLAN_E): the scatter plans instead (perm_plan_warp), so the blocks only write their
 * totals. */
__global__ void __launch_bounds__(MOE_CSCAN_THREADS)
moe_permute_chunk_scan_kernel(int32_t *chunk_rank, int64_t *count, unsigned *done,
                              int64_t *expert_offsets, int64_t *tokens_per_expert, int64_t *npad,
                              int64_t T, int64_t nchunks, int64_t E, int64_t R, int dap,
                              int64_t capacity, int64_t align, int plan_here) {
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
    if (plan_here) { /* the scatter plans (perm_plan_warp): no ticket, no last block */
        if (threadIdx.x == 0) count[blockIdx.x] = run;
        return;
    }
    if (threadIdx.x == 0) {
        count[blockIdx.x] = run;
        __threadfence(); /* the total is visible before the ticket that counts it */
        s_last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    plan_block(expert_offsets, tokens_per_expert, npad, count, T, E, R, dap, capacity, align);
}

/* The rank and data pass. Arguments in one struct: the kernel has five width instantiations, and
 * a long argument list would be spelled out at each of them and at the launch. */
typedef struct {
    void *permuted_tokens;             /* [R, hidden] */
    void *permuted_probs;              /* [R], probs_dtype, or NULL */
    int64_t *sorted_indices;           /* [R] */
    const void *tokens;                /* [T, hidden] */
    const void *probs;                 /* [T, E], probs_dtype */
    const uint32_t *col_bits;          /* [nchunks, E]: the count kernel's column ballots */
    const int32_t *chunk_rank;         /* [E, nchunks]: exclusive prefix over chunks */
    const int64_t *count;              /* [E] */
    int64_t *expert_offsets;           /* [E + 1]: written by block 0 when plan_here */
    int64_t *tokens_per_expert;        /* [E]: written by block 0 when plan_here */
    const int64_t *npad;               /* [1]: rows no token fills */
    int64_t T, E, nchunks, R, capacity;
    int64_t nvec; /* W-byte vectors per row; 0: the layout only (hidden = 0), no row is touched */
    int dap;
    int pf_probs; /* probs rows of <= 64 bytes: the scatter loads a prob before its wait */
    int plan_here; /* E <= MOE_PERM_PLAN_E: every block plans in a warp (perm_plan_warp) */
    int64_t align;
    moe_dtype_t probs_dtype;
} perm_scatter_args_t;

/* Loads the compiler keeps where they are written: ptxas sinks a weak load into the branch that
 * uses its value (even from a volatile asm), which spread the scatter's plan loads over three
 * dependent round trips; a strong load stays put. CTA scope, so it may still hit L1; the earlier
 * grids' writes are visible after moe_pdl_wait, to these loads as to weak ones. */
__device__ __forceinline__ uint32_t perm_ld_u32(const void *p) {
    uint32_t v;
    asm volatile("ld.relaxed.cta.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int64_t perm_ld_s64(const void *p) {
    int64_t v;
    asm volatile("ld.relaxed.cta.global.s64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

/* Rows [r0, r0 + 32) that no token fills, one warp: index -1, prob 0, zero data. A row's expert
 * is the last e with offsets[e] <= r (a binary search; empty experts share their successor's
 * start, so the last one is the real block); it is padding past the block's filled part or past
 * offsets[E]. Computed from the plan, not read back from sorted_indices, because the rows of
 * this grid's other blocks are being written now. */
template <int W>
__device__ __forceinline__ void permute_pad_warp(const perm_scatter_args_t &a, int64_t r0,
                                                 int64_t real_cap, const int64_t *offsets,
                                                 const int64_t *tpe, const int64_t *count) {
    const int lane = (int)(threadIdx.x & 31); /* blockDim.x is a multiple of 32 */
    const int64_t r = r0 + lane;
    bool pad = false;
    if (r < a.R) {
        if (r >= offsets[a.E]) {
            pad = true;
        } else {
            int64_t lo = 0, hi = a.E - 1;
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) >> 1;
                if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
            }
            const int64_t n = tpe[lo];
            const int64_t have = a.dap ? a.T : count[lo];
            pad = r - offsets[lo] >= perm_filled(a.dap, have, real_cap, n);
        }
    }
    if (pad) {
        a.sorted_indices[r] = -1;
        if (a.permuted_probs) moe_store(a.permuted_probs, a.probs_dtype, r, 0.0);
    }
    if (a.nvec > 0) /* uniform: the layout only (nvec = 0) has no rows to zero */
        moe_zero_rows_warp<W>(a.permuted_tokens, __ballot_sync(0xffffffffu, pad), r0, a.nvec);
}

/* The block's plan in shared memory, E <= MOE_PERM_PLAN_E, one warp: the same values as
 * plan_block (block sizes, their scan cut at R, the filled rows) with lane l owning the
 * contiguous experts [l·per, l·per + per), per = ceil(E / 32): its counts are independent loads
 * issued together, then one warp scan. plan: [3E + 2] int64 = offsets [E + 1], block sizes [E],
 * counts [E], npad [1]. Block 0 also writes the op's expert_offsets and tokens_per_expert. */
__device__ __forceinline__ void perm_plan_warp(const perm_scatter_args_t &a, int lane,
                                               int64_t real_cap, int64_t *plan) {
    const int64_t E = a.E, per = (E + 31) >> 5, e0 = lane * per;
    int64_t *s_off = plan, *s_tpe = plan + E + 1, *s_cnt = plan + 2 * E + 1;
    int64_t cnt[MOE_PERM_PLAN_PER], local = 0;
#pragma unroll
    for (int j = 0; j < MOE_PERM_PLAN_PER; ++j) {
        const bool has = j < per && e0 + j < E;
        cnt[j] = has ? perm_ld_s64(a.count + e0 + j) : 0;
    }
    /* the counts go to shared memory at once and the passes below read them back there (each
     * lane its own entries, no barrier), so they hold no registers while the row vectors do;
     * the loops stay rolled: one 64-bit division site, not eight */
#pragma unroll
    for (int j = 0; j < MOE_PERM_PLAN_PER; ++j)
        if (j < per && e0 + j < E) s_cnt[e0 + j] = cnt[j];
    const int64_t e1 = e0 + per < E ? e0 + per : E;
#pragma unroll 1
    for (int64_t e = e0; e < e1; ++e) { /* s_tpe holds the block size until the pass below */
        s_tpe[e] = d_round_up(a.dap ? a.capacity : s_cnt[e], a.align);
        local += s_tpe[e];
    }
    int64_t incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int64_t v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    int64_t run = incl - local, filled = 0;
    const bool out = blockIdx.x == 0;
    if (lane == 0) s_off[0] = 0;
    if (out && lane == 0) a.expert_offsets[0] = 0;
#pragma unroll 1
    for (int64_t e = e0; e < e1; ++e) {
        const int64_t cnt_e = s_cnt[e];
        const int64_t lo = run < a.R ? run : a.R;
        run += s_tpe[e];
        const int64_t hi = run < a.R ? run : a.R;
        s_off[e + 1] = hi, s_tpe[e] = hi - lo;
        if (out) a.expert_offsets[e + 1] = hi, a.tokens_per_expert[e] = hi - lo;
        filled += perm_filled(a.dap, a.dap ? a.T : cnt_e, real_cap, hi - lo);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) filled += __shfl_xor_sync(0xffffffffu, filled, o);
    if (lane == 0) plan[3 * E + 1] = a.R - filled;
}

/* Token t in expert e: routed (its ballot bit) or, with drop_and_pad, at count + (t − routed
 * tokens before it); before = the routed tokens of e ahead of t. A position below the block's
 * row limit gets row off + pos: its index and prob are stored and the row joins the token's list
 * in shared memory. have_p0: p0 is this thread's prob of e, loaded before the grid wait. */
__device__ __forceinline__ void perm_rank_one(const perm_scatter_args_t &a, int64_t t, int64_t e,
                                              uint32_t routed, int64_t before, int64_t n,
                                              int64_t off, int64_t cnt, int64_t real_cap,
                                              bool have_p0, double p0, int32_t *dst, int *s_n) {
    if (!routed && !a.dap) return;
    const int64_t pos = routed ? before : cnt + (t - before);
    if (pos >= perm_row_limit(a.dap, real_cap, n)) return;
    const int64_t r = off + pos;
    dst[atomicAdd(s_n, 1)] = (int32_t)r; /* R <= INT32_MAX */
    a.sorted_indices[r] = t;
    if (a.permuted_probs)
        moe_store(a.permuted_probs, a.probs_dtype, r,
                  have_p0 ? p0 : moe_load(a.probs, a.probs_dtype, t * a.E + e));
}

/*
 * The rank and data pass. blockDim = (X, Y), X a multiple of 32: Y tokens per block, X threads
 * per token. Each thread group loads its token's first vectors (the op's input, before the
 * wait), then finds the token's rows from the plan: for token t = 32c + l and expert e, the
 * column ballot b = col_bits[c, e] says whether t is routed (bit l), and its position inside
 * expert e is chunk_rank[e, c] + popc(b below l): routed tokens ascending, the CPU's order, with
 * no sort and no atomics on the output. With drop_and_pad an unrouted token takes
 * count_e + (t − routed before t), the stable descending sort of the column. Positions below
 * the block's real length get a row: the thread stores its index and prob and adds it to the
 * token's list in shared memory (the list's order does not matter: each row has one writer).
 * Then the token's row streams once, each vector stored to every row of the list. The rows no
 * token fills are written by the same grid (npad, from the plan, says whether there are any),
 * so every output row is written exactly once and no launch follows.
 */
template <int W>
__global__ void __launch_bounds__(256) moe_permute_scatter_kernel(const perm_scatter_args_t a) {
    typedef typename moe_vec_t<W>::type V;
    /* plan_here: the block's plan, [3E + 2] int64 (perm_plan_warp), then the row lists */
    extern __shared__ int64_t s_dyn[];
    __shared__ int s_n[32];
    moe_pdl_trigger();
    const int y = threadIdx.y, x = threadIdx.x;
    const int64_t X = blockDim.x, nvec = a.nvec, E = a.E;
    const int64_t t = (int64_t)blockIdx.x * blockDim.y + y;
    const bool live = t < a.T;
    const V *src = (const V *)a.tokens + t * nvec;
    /* four independent 16-byte loads in flight per thread before their stores */
    V val[4];
    int64_t v0 = x;
    if (live)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (v0 + j * X < nvec) val[j] = src[v0 + j * X];
    /* the probs are an input too: with short rows (a.pf_probs) the thread's first expert's prob
     * is loaded before the wait, so that after it the plan's loads are all that remain */
    double p0 = 0.0;
    if (live && a.pf_probs && x < E) p0 = moe_load(a.probs, a.probs_dtype, t * E + x);
    moe_pdl_wait(); /* the ballots, ranks, counts and offsets are the earlier kernels' */
    int64_t *plan = s_dyn; /* plan_here only; the row lists follow it */
    int32_t *dst = (int32_t *)(s_dyn + (a.plan_here ? 3 * E + 2 : 0)) + (int64_t)y * E;
    if (x == 0) s_n[y] = 0;
    const int64_t real_cap = perm_real_cap(a.dap, a.capacity, a.T);
    const int64_t c = t >> 5;
    const int l = (int)(t & 31);
    const uint32_t below = (1u << l) - 1u;
    if (a.plan_here) {
        /* launch_data gives X >= E whenever the scatter plans (E <= MOE_PERM_PLAN_E), so the
         * thread ranks one expert, x: its ballot and chunk prefix load while the first warp
         * loads the counts and plans, one round trip for the block */
        const bool has = live && x < E;
        const uint32_t bits = has ? perm_ld_u32(a.col_bits + c * E + x) : 0u;
        const int32_t rank0 = has ? (int32_t)perm_ld_u32(a.chunk_rank + x * a.nchunks + c) : 0;
        if (y == 0 && x < 32) perm_plan_warp(a, x, real_cap, plan);
        __syncthreads();
        if (has)
            perm_rank_one(a, t, x, bits >> l & 1u, rank0 + __popc(bits & below), plan[E + 1 + x],
                          plan[x], plan[2 * E + 1 + x], real_cap, a.pf_probs, p0, dst, &s_n[y]);
    } else {
        __syncthreads();
        if (live)
            for (int64_t e = x; e < E; e += X) {
                /* every load of the plan issued together, before the branch on the ballot: one
                 * L2 round trip while the block's other threads wait at the barrier below */
                const uint32_t b = perm_ld_u32(a.col_bits + c * E + e);
                const int64_t rank0 = (int32_t)perm_ld_u32(a.chunk_rank + e * a.nchunks + c);
                const int64_t n = perm_ld_s64(a.tokens_per_expert + e);
                const int64_t off = perm_ld_s64(a.expert_offsets + e);
                const int64_t cnt = perm_ld_s64(a.count + e);
                perm_rank_one(a, t, e, b >> l & 1u, rank0 + __popc(b & below), n, off, cnt,
                              real_cap, a.pf_probs && e == x, p0, dst, &s_n[y]);
            }
    }
    __syncthreads();
    V *out = (V *)a.permuted_tokens;
    if (live && nvec > 0) { /* nvec = 0: the layout only, no row to store (nor was one loaded) */
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
    /* the dropless layout without alignment: every row is a token's */
    if ((a.plan_here ? plan[3 * E + 1] : *a.npad) == 0) return;
    const int64_t wpb = X * blockDim.y / 32; /* warps per block */
    const int64_t tid = (int64_t)y * X + x, nwarps = (int64_t)gridDim.x * wpb;
    for (int64_t r0 = ((int64_t)blockIdx.x * wpb + tid / 32) * 32; r0 < a.R; r0 += nwarps * 32)
        permute_pad_warp<W>(a, r0, real_cap, a.plan_here ? plan : a.expert_offsets,
                            a.plan_here ? plan + E + 1 : a.tokens_per_expert,
                            a.plan_here ? plan + 2 * E + 1 : a.count);
}

template <int W>
static moe_status_t launch_data(perm_scatter_args_t a, size_t row_bytes, cudaStream_t stream) {
    a.nvec = (int64_t)(row_bytes / W);
    /* a quarter of the row's vectors per thread group: every thread then has four 16-byte loads
     * in flight (a thread per vector would leave narrow rows, 4 KB say, one load per thread); but
     * at least a thread per expert (up to 256), so the planning scatter ranks one expert per
     * thread in one pass; more tokens per block only while their row lists fit 48 KB of shared
     * memory */
    int X = moe_pow2_clamp((a.nvec + 3) / 4, 32, 256);
    const int x_experts = moe_pow2_clamp(a.E, 32, 256);
    if (X < x_experts) X = x_experts;
    int Y = 256 / X;
    while (Y > 1 && (size_t)Y * (size_t)a.E * sizeof(int32_t) > 48 * 1024) X *= 2, Y /= 2;
    /* the planning scatter ranks exactly one expert per thread */
    if (a.plan_here && X < a.E)
        return moe_fail(MOE_ERR_INTERNAL, "permute: %d threads a token for %lld experts", X,
                        (long long)a.E);
    /* the block's plan (plan_here), then its row lists */
    const size_t smem = (a.plan_here ? (size_t)(3 * a.E + 2) * sizeof(int64_t) : 0) +
                        (size_t)Y * (size_t)a.E * sizeof(int32_t);
    void (*scatter)(const perm_scatter_args_t) = moe_permute_scatter_kernel<W>;
    /* without an opt-in, dynamic and static shared memory together stop at 48 KB */
    cudaFuncAttributes fa;
    if (smem > 40 * 1024 && (cudaFuncGetAttributes(&fa, scatter) != cudaSuccess ||
                             smem + fa.sharedSizeBytes > 48 * 1024)) {
        cudaError_t err = cudaFuncSetAttribute(scatter, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem);
        if (err != cudaSuccess)
            return moe_fail(MOE_ERR_UNSUPPORTED,
                            "permute: num_experts=%lld needs %zu bytes of shared memory: %s",
                            (long long)a.E, smem, cudaGetErrorString(err));
    }
    /* a block per Y tokens; with few tokens (T = 0 under drop_and_pad) enough warps for the
     * rows no token fills, 32 per warp */
    int64_t grid = (a.T + Y - 1) / Y;
    const int64_t pad_grid = (a.R + 255) / 256;
    if (grid < pad_grid) grid = pad_grid < 1024 ? pad_grid : 1024;
    if (grid < 1) grid = 1;
    MOE_LAUNCH_CHAINED(scatter, dim3((unsigned)grid), dim3(X, Y), smem, stream, a);
    MOE_CHECK_LAUNCH("moe_permute_scatter_kernel");
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
    int64_t R;
    MOE_TRY(moe_permute_fwd_check(permuted_tokens, permuted_probs, sorted_indices, expert_offsets,
                                  tokens_per_expert, tokens, routing_map, probs, num_tokens,
                                  hidden, num_experts, dtype, probs_dtype, params, &R));
    const int64_t T = num_tokens, E = num_experts;
    const size_t esize = moe_dtype_size(dtype);
    /* the per-chunk ranks and the scatter's row lists are int32 */
    MOE_CHECK(T <= INT32_MAX, "num_tokens=%lld; the CUDA kernel supports at most %d",
              (long long)T, INT32_MAX);
    MOE_CHECK(R <= INT32_MAX, "the permuted buffer has %lld rows; the CUDA kernel supports at "
              "most %d", (long long)R, INT32_MAX);
    MOE_CHECK_WORKSPACE(moe_cuda_permute_workspace_size, T, E, params);
    perm_ws_t ws;
    perm_ws_layout(T, E, &ws, workspace);
    cudaStream_t st = (cudaStream_t)stream;
    const int dap = params->drop_and_pad != 0;
    const int64_t align = params->align_size > 1 ? params->align_size : 1;
    const int64_t capacity = dap ? params->num_out_tokens / E : 0;
    const int64_t nchunks = (T + MOE_PERM_CHUNK - 1) / MOE_PERM_CHUNK;
    /* count kernel: grid (chunks, tiles of 32 experts) */
    const int64_t etiles = (E + MOE_PERM_TILE_E - 1) / MOE_PERM_TILE_E;
    MOE_CHECK(etiles <= 65535, "num_experts=%lld; the CUDA kernel supports at most %d",
              (long long)E, 65535 * MOE_PERM_TILE_E);

    /* count → chunk scan (+ plan) → rank and scatter: the first launch is ordinary, the rest
     * are chained (cuda_common.cuh) */
    if (nchunks > 0) {
        moe_permute_count_kernel<<<dim3((unsigned)nchunks, (unsigned)etiles),
                                   MOE_PERM_WARPS * 32, 0, st>>>(ws.chunk_rank, ws.col_bits,
                                                                ws.done, routing_map, T, E,
                                                                nchunks);
        MOE_CHECK_LAUNCH("moe_permute_count_kernel");
    } else { /* T = 0: no chunk to count; the scan below only writes zero counts and plans */
        MOE_CHECK(cudaMemsetAsync(ws.done, 0, sizeof(unsigned), st) == cudaSuccess,
                  "permute: cudaMemsetAsync of the chunk-scan ticket failed");
    }
    /* E <= MOE_PERM_PLAN_E with rows to fill: the scatter's blocks plan (perm_plan_warp) */
    const int plan_here = E <= MOE_PERM_PLAN_E && R > 0;
    MOE_LAUNCH_CHAINED(moe_permute_chunk_scan_kernel, dim3((unsigned)E), dim3(MOE_CSCAN_THREADS),
                       0, st, ws.chunk_rank, ws.count, ws.done, expert_offsets, tokens_per_expert,
                       ws.npad, T, nchunks, E, R, dap, capacity, align, plan_here);
    MOE_CHECK_LAUNCH("moe_permute_chunk_scan_kernel");
    if (R == 0) return MOE_OK; /* no row to fill */
    perm_scatter_args_t a;
    a.permuted_tokens = permuted_tokens;
    a.permuted_probs = permuted_probs;
    a.sorted_indices = sorted_indices;
    a.tokens = tokens;
    a.probs = probs;
    a.col_bits = ws.col_bits;
    a.chunk_rank = ws.chunk_rank;
    a.count = ws.count;
    a.expert_offsets = expert_offsets;
    a.tokens_per_expert = tokens_per_expert;
    a.npad = ws.npad;
    a.T = T, a.E = E, a.nchunks = nchunks, a.R = R, a.capacity = capacity, a.nvec = 0;
    a.dap = dap;
    a.plan_here = plan_here;
    a.align = align;
    a.probs_dtype = probs_dtype;
    /* two sectors or less: what the routed entries of a row read anyway, so loading each
     * thread's first entry whether routed or not costs no extra traffic */
    a.pf_probs = permuted_probs && (size_t)E * moe_dtype_size(probs_dtype) <= 64;
    /* the layout only (hidden = 0, no row buffers): the same plan and scatter with rows of no
     * vectors, so the indices and probs are the full mode's and no row is read or written */
    if (hidden == 0) return launch_data<16>(a, 0, st);
    const size_t row_bytes = (size_t)hidden * esize;
    switch (moe_vec_bytes(row_bytes, permuted_tokens, tokens, NULL)) {
    case 16: return launch_data<16>(a, row_bytes, st);
    case 8: return launch_data<8>(a, row_bytes, st);
    case 4: return launch_data<4>(a, row_bytes, st);
    case 2: return launch_data<2>(a, row_bytes, st);
    default: return launch_data<1>(a, row_bytes, st);
    }
}
