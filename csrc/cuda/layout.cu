/*
 * layout.cu: the token → rows maps and the gather-sum that the combine (unpermute.cu) and
 * permute's backward (permute_bwd.cu) share, on CUDA (the CPU's are layout.c's).
 *
 * The one idea: every output token is owned by one thread group that adds its own rows in
 * ascending row order. A gather, not a scatter-add: no atomics on data, one writer per element,
 * and the CPU's exact rounding points (each weighted row rounded to the promoted dtype P, a
 * running fp32/fp64 sum, one final rounding), so the output is the CPU's bit for bit. The token →
 * rows maps use integer atomics only, for counts and slot claims, and whatever reads them sorts
 * first, so nothing depends on the atomics' order.
 *
 * Two maps. The forward gathers (the combine, permute's backward without grad_probs) and
 * unpermute's backward without probs use the slots table: one kernel drops each row into its
 * token's next free slot of a [T, MOE_SLOTS] table (a counter per token; rows past the slots go
 * to an overflow list), and the gather's first warp per token reads the count and the slots with
 * one load and ranks them across its lanes. That chain is memset → slots → gather; the CSR's is
 * memset → count → scan → fill → sort → gather, three more short kernels whose latency the
 * gather waits for. A token with more rows than slots (drop-and-pad's filler tokens, topk > 16)
 * collects the rest from the overflow list with the whole block and ranks them in shared
 * memory; one with more than MOE_SLOT_CAP rows scans sorted_indices. The backwards with probs
 * keep the CSR (start, rows, rexp, dots): their grad_probs sums need each (token, expert) entry
 * in order. The kernels after the first are one programmatic-launch chain (cuda_common.cuh), so
 * their launch gaps vanish.
 *
 * Data kernels read and write 16 bytes per access when the row size and the pointers allow it,
 * and issue the loads of up to four rows before adding them, so a token's rows are in flight
 * together.
 */
#include "layout_cuda.cuh"

/* ---- the token → rows map ------------------------------------------------------------------- */

static void token_rows_layout(moe_cuda_token_rows_t *m, void *ws, int64_t T, int64_t R) {
    int64_t *p = (int64_t *)ws;
    m->start = p;
    m->cursor = p + T + 1;
    m->rows = m->cursor + T;
    m->rexp = m->rows + R;
    m->dots = (double *)(m->rexp + R);
}

/* ---- the token → slots table (forward gathers) ------------------------------------------------ */

#define MOE_SLOT_CAP 256 /* rows per token the gather can stage and sort in shared memory */

static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

static size_t token_slots_layout(moe_cuda_token_slots_t *m, void *ws, int64_t T, int64_t R) {
    uint8_t *p = (uint8_t *)ws;
    const size_t a = align16((size_t)(T + 1) * sizeof(int64_t));
    const size_t b = align16((size_t)T * MOE_SLOTS * sizeof(int64_t));
    if (m) {
        m->count = (int64_t *)p;
        m->ovf_n = m->count + T;
        m->slot = (int64_t *)(p + a);
        m->ovf = (longlong2 *)(p + a + b);
    }
    return a + b + (size_t)R * sizeof(longlong2);
}

extern "C" size_t moe_cuda_unpermute_workspace_size(int64_t num_tokens, int64_t num_rows) {
    if (num_tokens < 0 || num_rows < 0) return 0;
    /* the larger layout, checked: the CSR's (2T + 1 + 3R) words, the slots' three sections */
    int64_t csr_b = 0, slots_b = 0, t2, r3, t1;
    if (moe_checked_mul_i64(num_tokens, 2, &t2) || moe_checked_mul_i64(num_rows, 3, &r3) ||
        moe_checked_add_i64(t2, r3, &csr_b) || moe_checked_add_i64(csr_b, 1, &csr_b) ||
        moe_checked_mul_i64(csr_b, (int64_t)sizeof(int64_t), &csr_b) ||
        moe_checked_add_i64(num_tokens, 1, &t1) ||
        moe_checked_section(&slots_b, t1, (int64_t)sizeof(int64_t), 16) ||
        moe_checked_section(&slots_b, num_tokens, MOE_SLOTS * (int64_t)sizeof(int64_t), 16) ||
        moe_checked_section(&slots_b, num_rows, (int64_t)sizeof(longlong2), 1))
        return moe_fail_size("moe_cuda_unpermute_workspace_size: num_tokens=%lld, num_rows=%lld "
                             "overflow int64 bytes", (long long)num_tokens, (long long)num_rows);
    const size_t csr = (size_t)(2 * num_tokens + 1 + 3 * num_rows) * sizeof(int64_t);
    const size_t slots = token_slots_layout(NULL, NULL, num_tokens, num_rows);
    return csr > slots ? csr : slots;
}

__global__ void moe_token_rows_count_kernel(int64_t *start, const int64_t *sorted_indices,
                                            int64_t T, int64_t R) {
    moe_pdl_trigger();
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= R) return;
    const int64_t t = sorted_indices[r];
    if (t >= 0 && t < T) atomicAdd((unsigned long long *)&start[t + 1], 1ull);
}

/* Tokens per thread per tile of the scan below: T <= MOE_SCAN_THREADS·16 = 16384 is one tile. */
#define MOE_TR_SCAN_ITEMS 16

/*
 * In-place inclusive scan of start[1..T] by one block. Warp w owns a contiguous segment of
 * 32·ITEMS tokens of the tile and reads it as ITEMS coalesced slices (lane = token), all loads
 * in flight together: one memory latency per tile, not one per token. Each slice is scanned
 * across the lanes, the slices are chained by their totals, and one block scan of the warp
 * totals places the segments. S is the lane scan's type: int32 when every partial sum fits
 * (num_rows <= INT32_MAX: a partial sum counts distinct rows), halving the shuffles.
 */
template <typename S>
__global__ void __launch_bounds__(MOE_SCAN_THREADS)
moe_token_rows_scan_kernel(int64_t *start, int64_t T) {
    moe_pdl_trigger();
    moe_pdl_wait();
    int64_t *c = start + 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t run = 0;
    for (int64_t tile = 0; tile < T; tile += (int64_t)MOE_SCAN_THREADS * MOE_TR_SCAN_ITEMS) {
        const int64_t seg = tile + (int64_t)warp * 32 * MOE_TR_SCAN_ITEMS + lane;
        S v[MOE_TR_SCAN_ITEMS];
#pragma unroll
        for (int j = 0; j < MOE_TR_SCAN_ITEMS; ++j) {
            const int64_t i = seg + j * 32;
            v[j] = i < T ? (S)c[i] : (S)0;
        }
#pragma unroll
        for (int d = 1; d < 32; d *= 2)
#pragma unroll
            for (int j = 0; j < MOE_TR_SCAN_ITEMS; ++j) { /* ITEMS independent chains */
                const S y = __shfl_up_sync(0xffffffffu, v[j], d);
                if (lane >= d) v[j] += y;
            }
        S carry = 0; /* the warp's tokens in the slices before j */
#pragma unroll
        for (int j = 0; j < MOE_TR_SCAN_ITEMS; ++j) {
            const S slice = __shfl_sync(0xffffffffu, v[j], 31);
            v[j] += carry;
            carry += slice;
        }
        int64_t total;
        /* lane 31 brings the warp's total, so every lane's exclusive prefix is the warps before */
        const int64_t before =
            run + moe_block_exclusive_scan(lane == 31 ? (int64_t)carry : 0, &total);
#pragma unroll
        for (int j = 0; j < MOE_TR_SCAN_ITEMS; ++j) {
            const int64_t i = seg + j * 32;
            if (i < T) c[i] = before + (int64_t)v[j];
        }
        run += total;
    }
}

__global__ void moe_token_rows_fill_kernel(int64_t *rows, int64_t *cursor, const int64_t *start,
                                           const int64_t *sorted_indices, int64_t T, int64_t R) {
    moe_pdl_trigger();
    moe_pdl_wait();
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= R) return;
    const int64_t t = sorted_indices[r];
    if (t < 0 || t >= T) return;
    const int64_t k = (int64_t)atomicAdd((unsigned long long *)&cursor[t], 1ull);
    rows[start[t] + k] = r;
}

/* The expert whose block [offsets[e], offsets[e+1]) holds row r (as layout.h's moe_row_expert). */
__device__ __forceinline__ int64_t d_row_expert(const int64_t *offsets, int64_t E, int64_t r) {
    int64_t lo = 0, hi = E;
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (offsets[mid] <= r) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* One thread per token: insertion sort of its segment (topk entries, typically), making the
 * order independent of the fill's atomics; then each entry's expert. */
__global__ void moe_token_rows_sort_kernel(int64_t *rows, int64_t *rexp, const int64_t *start,
                                           const int64_t *expert_offsets, int64_t T, int64_t E) {
    moe_pdl_trigger();
    moe_pdl_wait();
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int64_t b = start[t], n = start[t + 1] - b;
    int64_t *seg = rows + b;
    for (int64_t i = 1; i < n; ++i) {
        const int64_t v = seg[i];
        int64_t j = i - 1;
        while (j >= 0 && seg[j] > v) {
            seg[j + 1] = seg[j];
            --j;
        }
        seg[j + 1] = v;
    }
    if (expert_offsets)
        for (int64_t i = 0; i < n; ++i) rexp[b + i] = d_row_expert(expert_offsets, E, seg[i]);
}

/* What both maps (CSR, slots) need: the workspace (one size for both) and the indices. */
static moe_status_t check_map_args(const void *workspace, size_t workspace_bytes,
                                   const int64_t *sorted_indices, int64_t T, int64_t R) {
    MOE_CHECK_WORKSPACE(moe_cuda_unpermute_workspace_size, T, R);
    MOE_CHECK(R == 0 || sorted_indices, "sorted_indices must not be NULL");
    return MOE_OK;
}

/* Row r into the next slot of its token; past MOE_SLOTS, into the overflow list. The slot order
 * and the list order follow the atomics, so the gather sorts: only the sets are fixed. */
__global__ void moe_token_slots_kernel(int64_t *count, int64_t *slot, int64_t *ovf_n,
                                       longlong2 *ovf, const int64_t *sorted_indices, int64_t T,
                                       int64_t R) {
    moe_pdl_trigger();
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= R) return;
    const int64_t t = sorted_indices[r];
    if (t < 0 || t >= T) return;
    const int64_t s = (int64_t)atomicAdd((unsigned long long *)&count[t], 1ull);
    if (s < MOE_SLOTS) {
        slot[t * MOE_SLOTS + s] = r;
    } else { /* < R entries: one per row at most */
        const int64_t o = (int64_t)atomicAdd((unsigned long long *)ovf_n, 1ull);
        ovf[o] = make_longlong2(t, r);
    }
}

/* Whether the forward gathers (and unpermute_bwd without probs) take the slots: always, unless
 * the unpermute_slots switch (tuning.h) is off, which keeps them on the CSR, the backwards' map,
 * so the tests can run both. T = 0 has nothing to gather. */
int moe_cuda_use_slots(int64_t T) {
    /* (the copy kernel's grid is T + MOE_OVF_BLOCKS blocks: T just below 2^31 keeps the CSR) */
    return T > 0 && T <= 0x7fffffffLL - 1024 && moe_tuning_get().unpermute_slots;
}

moe_status_t moe_cuda_token_slots_build(moe_cuda_token_slots_t *m, void *workspace,
                                       size_t workspace_bytes, const int64_t *sorted_indices,
                                       int64_t T, int64_t R, cudaStream_t st) {
    MOE_TRY(check_map_args(workspace, workspace_bytes, sorted_indices, T, R));
    token_slots_layout(m, workspace, T, R);
    cudaError_t err = cudaMemsetAsync(m->count, 0, (size_t)(T + 1) * sizeof(int64_t), st);
    if (err != cudaSuccess)
        return moe_fail(MOE_ERR_CUDA, "token slots: cudaMemsetAsync failed: %s",
                        cudaGetErrorString(err));
    if (R > 0) {
        moe_token_slots_kernel<<<moe_blocks_for(R, 256), 256, 0, st>>>(
            m->count, m->slot, m->ovf_n, m->ovf, sorted_indices, T, R);
        MOE_CHECK_LAUNCH("moe_token_slots_kernel");
    }
    return MOE_OK;
}

moe_status_t moe_cuda_token_rows_build(moe_cuda_token_rows_t *m, void *workspace,
                                      size_t workspace_bytes, const int64_t *sorted_indices,
                                      const int64_t *expert_offsets, int64_t T, int64_t E,
                                      int64_t R, cudaStream_t st) {
    MOE_TRY(check_map_args(workspace, workspace_bytes, sorted_indices, T, R));
    token_rows_layout(m, workspace, T, R);
    /* memset, count (ordinary launches), then the chained scan, fill and sort */
    cudaError_t err = cudaMemsetAsync(m->start, 0, (size_t)(2 * T + 1) * sizeof(int64_t), st);
    if (err != cudaSuccess)
        return moe_fail(MOE_ERR_CUDA, "token rows: cudaMemsetAsync failed: %s",
                        cudaGetErrorString(err));
    if (R > 0) {
        moe_token_rows_count_kernel<<<moe_blocks_for(R, 256), 256, 0, st>>>(m->start,
                                                                            sorted_indices, T, R);
        MOE_CHECK_LAUNCH("moe_token_rows_count_kernel");
    }
    if (T == 0) return MOE_OK;
    if (R <= INT32_MAX)
        MOE_LAUNCH_CHAINED(moe_token_rows_scan_kernel<int32_t>, dim3(1), dim3(MOE_SCAN_THREADS),
                           0, st, m->start, T);
    else
        MOE_LAUNCH_CHAINED(moe_token_rows_scan_kernel<int64_t>, dim3(1), dim3(MOE_SCAN_THREADS),
                           0, st, m->start, T);
    MOE_CHECK_LAUNCH("moe_token_rows_scan_kernel");
    if (R > 0) {
        MOE_LAUNCH_CHAINED(moe_token_rows_fill_kernel, dim3(moe_blocks_for(R, 256)), dim3(256),
                           0, st, m->rows, m->cursor, m->start, sorted_indices, T, R);
        MOE_CHECK_LAUNCH("moe_token_rows_fill_kernel");
    }
    MOE_LAUNCH_CHAINED(moe_token_rows_sort_kernel, dim3(moe_blocks_for(T, 128)), dim3(128), 0,
                       st, m->rows, m->rexp, m->start, expert_offsets, T, E);
    MOE_CHECK_LAUNCH("moe_token_rows_sort_kernel");
    return MOE_OK;
}

/* Rows whose metadata (row index, weight) a thread group stages in shared memory; a token with
 * more rows reads the rest from global memory. */
#define MOE_GATHER_CAP 32

/* ---- forward gather-sum (unpermute, and permute_bwd without weights) ------------------------- */

/*
 * One token's gather-sum: dst = narrow_ET(Σ_i v_i) over its n rows in ascending order, the sum in
 * C (fp32, or fp64 when P is fp64), v_i = round_P(row_i · w_i) with probs, row_i without. Entry i
 * comes from shared memory (s_row, s_w) when i < MOE_GATHER_CAP or !SPILL, else from the CSR in
 * global memory (rows_g, rexp_g: the token's segment). The token's X threads start at x.
 */
template <typename ET, typename C, int RP, int VE, bool SPILL>
__device__ __forceinline__ void gather_token(moe_pack<ET, VE> *__restrict__ dst,
                                             const moe_pack<ET, VE> *__restrict__ src,
                                             const int64_t *s_row, const C *s_w, int64_t n,
                                             const int64_t *__restrict__ rows_g,
                                             const int64_t *__restrict__ rexp_g,
                                             const void *__restrict__ probs,
                                             moe_dtype_t probs_dtype, int64_t prow, int x,
                                             int64_t X, int64_t nvec) {
    typedef moe_pack<ET, VE> P;
    /* Two vectors per thread (v and v + X) × two rows per step: four 16-byte loads in flight
     * whatever the row count (one vector × four rows would leave a token of two rows two), in
     * about the same registers. Each element's sum keeps its ascending row order. */
    for (int64_t v0 = x; v0 < nvec; v0 += 2 * X) {
        const bool second = v0 + X < nvec;
        C acc[2][VE];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int k = 0; k < VE; ++k) acc[u][k] = (C)0;
        for (int64_t i0 = 0; i0 < n; i0 += 2) {
            P in[2][2];
            C w[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int64_t i = i0 + j;
                if (i < n) {
                    const bool staged = !SPILL || i < MOE_GATHER_CAP;
                    const int64_t r = staged ? s_row[i] : rows_g[i];
                    w[j] = staged ? s_w[i]
                           : probs ? (C)moe_load(probs, probs_dtype, prow + rexp_g[i])
                                   : (C)1;
                    in[0][j] = src[r * nvec + v0];
                    if (second) in[1][j] = src[r * nvec + v0 + X];
                }
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if (i0 + j < n) {
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        if (u == 1 && !second) continue;
#pragma unroll
                        for (int k = 0; k < VE; ++k) {
                            const C xv = (C)moe_widen(in[u][j].v[k]);
                            const C term = probs ? moe_round_p<RP>(moe_mul_rn(xv, w[j])) : xv;
                            acc[u][k] = moe_add_rn(acc[u][k], term);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (u == 1 && !second) continue;
            P o;
#pragma unroll
            for (int k = 0; k < VE; ++k) o.v[k] = moe_narrow<ET>(acc[u][k]);
            dst[v0 + u * X] = o;
        }
    }
}

/*
 * out[t] = the gather-sum of token t's rows, from the CSR map (start, rows, rexp).
 * blockDim = (X, Y): Y tokens per block, X threads per token.
 */
template <typename ET, typename C, int RP, int VE>
__global__ void __launch_bounds__(MOE_GATHER_THREADS)
moe_gather_sum_kernel(void *__restrict__ out, const void *__restrict__ rows_base,
                      const int64_t *__restrict__ start, const int64_t *__restrict__ rows,
                      const int64_t *__restrict__ rexp, const void *__restrict__ probs,
                      moe_dtype_t probs_dtype, int64_t T, int64_t E, int64_t nvec) {
    typedef moe_pack<ET, VE> P;
    __shared__ int64_t s_row[MOE_GATHER_THREADS / 32][MOE_GATHER_CAP];
    __shared__ C s_w[MOE_GATHER_THREADS / 32][MOE_GATHER_CAP];
    moe_pdl_trigger();
    moe_pdl_wait(); /* the token → rows map is the previous kernel's */
    const int y = threadIdx.y, x = threadIdx.x;
    const int64_t t = (int64_t)blockIdx.x * blockDim.y + y;
    int64_t b = 0, n = 0;
    if (t < T) {
        b = start[t];
        n = start[t + 1] - b;
        for (int64_t i = x; i < n && i < MOE_GATHER_CAP; i += blockDim.x) {
            s_row[y][i] = rows[b + i];
            s_w[y][i] = probs ? (C)moe_load(probs, probs_dtype, t * E + rexp[b + i]) : (C)1;
        }
    }
    __syncthreads();
    if (t >= T) return;
    gather_token<ET, C, RP, VE, true>((P *)out + t * nvec, (const P *)rows_base, s_row[y],
                                      s_w[y], n, rows + b, rexp + b, probs, probs_dtype, t * E, x,
                                      blockDim.x, nvec);
}

/*
 * A token with more than MOE_SLOT_CAP rows (only a malformed map or drop-and-pad over more than
 * 256 experts gets there): its rows found by scanning all of sorted_indices, ascending, as the
 * CPU lists them. O(R) per such token; out of line so that it costs the common path no registers.
 */
template <typename ET, typename C, int RP, int VE>
__device__ __noinline__ void gather_token_scan(moe_pack<ET, VE> *__restrict__ dst,
                                               const moe_pack<ET, VE> *__restrict__ src,
                                               const int64_t *__restrict__ sorted_indices,
                                               const int64_t *__restrict__ expert_offsets,
                                               const void *__restrict__ probs,
                                               moe_dtype_t probs_dtype, int64_t t, int64_t E,
                                               int64_t R, int x, int64_t X, int64_t nvec) {
    typedef moe_pack<ET, VE> P;
    for (int64_t v = x; v < nvec; v += X) {
        C acc[VE];
#pragma unroll
        for (int k = 0; k < VE; ++k) acc[k] = (C)0;
        for (int64_t r = 0; r < R; ++r) {
            if (sorted_indices[r] != t) continue;
            const P in = src[r * nvec + v];
            const C w = probs ? (C)moe_load(probs, probs_dtype,
                                            t * E + d_row_expert(expert_offsets, E, r))
                              : (C)1;
#pragma unroll
            for (int k = 0; k < VE; ++k) {
                const C xv = (C)moe_widen(in.v[k]);
                acc[k] = moe_add_rn(acc[k], probs ? moe_round_p<RP>(moe_mul_rn(xv, w)) : xv);
            }
        }
        P o;
#pragma unroll
        for (int k = 0; k < VE; ++k) o.v[k] = moe_narrow<ET>(acc[k]);
        dst[v] = o;
    }
}

/*
 * out[t] = the gather-sum of token t's rows, from the slots table. blockDim = (X, Y), X >= 32 a
 * multiple of 32. The token's first warp loads its count and its MOE_SLOTS slots together (one
 * memory latency) and, when they hold every row, places each at its rank among them (a shuffle
 * loop: rows are distinct, so ranks are too). Tokens with more rows go after, one at a time: the
 * whole block gathers the token's overflow entries into shared memory, ranks them there, and the
 * token's own threads sum them.
 */
template <typename ET, typename C, int RP, int VE>
__global__ void __launch_bounds__(MOE_GATHER_THREADS)
moe_gather_sum_slots_kernel(void *__restrict__ out, const void *__restrict__ rows_base,
                            moe_cuda_token_slots_t m,
                            const int64_t *__restrict__ sorted_indices,
                            const int64_t *__restrict__ expert_offsets,
                            const void *__restrict__ probs, moe_dtype_t probs_dtype, int64_t T,
                            int64_t E, int64_t R, int64_t nvec) {
    typedef moe_pack<ET, VE> P;
    __shared__ int64_t s_row[MOE_GATHER_THREADS / 32][MOE_SLOTS];
    __shared__ C s_w[MOE_GATHER_THREADS / 32][MOE_SLOTS];
    __shared__ int64_t s_n[MOE_GATHER_THREADS / 32];
    __shared__ int64_t s_big[MOE_SLOT_CAP]; /* an overflowing token's rows, unordered */
    __shared__ int64_t s_sorted[MOE_SLOT_CAP];
    __shared__ C s_bigw[MOE_SLOT_CAP];
    __shared__ int s_fill;
    moe_pdl_trigger();
    const int y = threadIdx.y, x = threadIdx.x, Y = blockDim.y;
    const int64_t X = blockDim.x;
    const int64_t t = (int64_t)blockIdx.x * Y + y;
    moe_pdl_wait(); /* the slots are the previous kernel's */
    if (t < T && x < 32) {
        /* both loads at once: slots past the count hold stale values, never used below */
        const int64_t n = m.count[t];
        const int64_t r = x < MOE_SLOTS ? m.slot[t * MOE_SLOTS + x] : 0;
        if (n <= MOE_SLOTS) {
            int rank = 0;
#pragma unroll
            for (int j = 0; j < MOE_SLOTS; ++j) {
                const int64_t o = __shfl_sync(0xffffffffu, (long long)r, j);
                rank += j < n && o < r;
            }
            if (x < n) {
                s_row[y][rank] = r;
                s_w[y][rank] = probs ? (C)moe_load(probs, probs_dtype,
                                                   t * E + d_row_expert(expert_offsets, E, r))
                                     : (C)1;
            }
        }
        if (x == 0) s_n[y] = n;
    }
    __syncthreads();
    if (t < T && s_n[y] <= MOE_SLOTS)
        gather_token<ET, C, RP, VE, false>((P *)out + t * nvec, (const P *)rows_base, s_row[y],
                                           s_w[y], s_n[y], NULL, NULL, probs, probs_dtype, t * E,
                                           x, X, nvec);
    /* block-uniform from here: s_n and ovf_n are the same for every thread */
    const int tid = y * (int)X + x, nt = Y * (int)X;
    for (int yy = 0; yy < Y; ++yy) {
        const int64_t tt = (int64_t)blockIdx.x * Y + yy;
        if (tt >= T) break;
        const int64_t n = s_n[yy];
        if (n <= MOE_SLOTS) continue;
        if (n > MOE_SLOT_CAP) {
            if (y == yy)
                gather_token_scan<ET, C, RP, VE>((P *)out + tt * nvec, (const P *)rows_base,
                                                 sorted_indices, expert_offsets, probs,
                                                 probs_dtype, tt, E, R, x, X, nvec);
            continue;
        }
        if (tid < MOE_SLOTS) s_big[tid] = m.slot[tt * MOE_SLOTS + tid];
        if (tid == 0) s_fill = MOE_SLOTS;
        __syncthreads();
        const int64_t L = *m.ovf_n;
        for (int64_t i = tid; i < L; i += nt) {
            const longlong2 o = m.ovf[i];
            if (o.x == tt) s_big[atomicAdd(&s_fill, 1)] = o.y;
        }
        __syncthreads();
        for (int i = tid; i < (int)n; i += nt) { /* rank among the token's n distinct rows */
            const int64_t r = s_big[i];
            int rank = 0;
            for (int j = 0; j < n; ++j) rank += s_big[j] < r;
            s_sorted[rank] = r;
            s_bigw[rank] = probs ? (C)moe_load(probs, probs_dtype,
                                               tt * E + d_row_expert(expert_offsets, E, r))
                                 : (C)1;
        }
        __syncthreads();
        if (y == yy)
            gather_token<ET, C, RP, VE, false>((P *)out + tt * nvec, (const P *)rows_base,
                                               s_sorted, s_bigw, n, NULL, NULL, probs,
                                               probs_dtype, tt * E, x, X, nvec);
        __syncthreads(); /* s_big is the next overflowing token's */
    }
}

/* ---- per (token, expert) sums: the backwards' grad_probs ------------------------------------- */

/*
 * grad_probs[t, e] = Σ over the token's entries of expert e, in ascending row order, of
 * val(entry), each partial sum rounded to the probs dtype (the CPU's load-add-store). val is
 * dots[entry] when dots is given, else grad_permuted_probs[row]. One thread per (t, e).
 */
__global__ void moe_token_expert_sum_kernel(void *grad_probs, const double *dots,
                                            const void *grad_permuted_probs,
                                            const int64_t *start, const int64_t *rows,
                                            const int64_t *rexp, int64_t T, int64_t E,
                                            moe_dtype_t probs_dtype) {
    moe_pdl_trigger();
    moe_pdl_wait();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * E) return;
    const int64_t t = i / E, e = i % E;
    double v = 0.0;
    for (int64_t k = start[t]; k < start[t + 1]; ++k)
        if (rexp[k] == e)
            v = moe_round_to(probs_dtype,
                             v + (dots ? dots[k] : moe_load(grad_permuted_probs, probs_dtype, rows[k])));
    moe_store(grad_probs, probs_dtype, i, v);
}

moe_status_t moe_cuda_token_expert_sum(void *grad_probs, const double *dots,
                                       const void *grad_permuted_probs,
                                       const moe_cuda_token_rows_t *m, int64_t T, int64_t E,
                                       moe_dtype_t probs_dtype, cudaStream_t st) {
    if (T == 0) return MOE_OK;
    MOE_LAUNCH_CHAINED(moe_token_expert_sum_kernel, dim3(moe_blocks_for(T * E, 256)), dim3(256),
                       0, st, grad_probs, dots, grad_permuted_probs, (const int64_t *)m->start,
                       (const int64_t *)m->rows, (const int64_t *)m->rexp, T, E, probs_dtype);
    MOE_CHECK_LAUNCH("moe_token_expert_sum_kernel");
    return MOE_OK;
}

/* ---- the gather-sum's launch ----------------------------------------------------------------- */

/* The gather-sum's launch for one element type, math and vector width (moe_cuda_launch_rows). */
template <typename ET, typename C, int RP, int VE>
struct gather_launch {
    static moe_status_t launch(const moe_cuda_rows_args_t *a) {
        const int64_t nvec = a->hidden / VE;
        /* the gather-sum covers two vectors per thread: half the threads per token */
        const int XG = moe_pow2_clamp((nvec + 1) / 2, 32, MOE_GATHER_THREADS);
        const int Y = MOE_GATHER_THREADS / XG;
        if (a->sl) {
            void (*slots)(void *, const void *, moe_cuda_token_slots_t, const int64_t *,
                          const int64_t *, const void *, moe_dtype_t, int64_t, int64_t, int64_t,
                          int64_t) = moe_gather_sum_slots_kernel<ET, C, RP, VE>;
            MOE_LAUNCH_CHAINED(slots, dim3(moe_blocks_for(a->T, Y)), dim3(XG, Y), 0, a->st,
                               a->dst, a->src, *a->sl, a->sorted_indices, a->expert_offsets,
                               a->probs, a->probs_dtype, a->T, a->E, a->num_rows, nvec);
            MOE_CHECK_LAUNCH("moe_gather_sum_slots_kernel");
            return MOE_OK;
        }
        void (*gather)(void *, const void *, const int64_t *, const int64_t *, const int64_t *,
                       const void *, moe_dtype_t, int64_t, int64_t, int64_t) =
            moe_gather_sum_kernel<ET, C, RP, VE>;
        MOE_LAUNCH_CHAINED(gather, dim3(moe_blocks_for(a->T, Y)), dim3(XG, Y), 0, a->st, a->dst,
                           a->src, a->m->start, a->m->rows, a->m->rexp, a->probs, a->probs_dtype,
                           a->T, a->E, nvec);
        MOE_CHECK_LAUNCH("moe_gather_sum_kernel");
        return MOE_OK;
    }
};

moe_status_t moe_cuda_gather_sum(const moe_cuda_rows_args_t *a, moe_dtype_t dtype,
                                 moe_cuda_math_t mt) {
    return moe_cuda_launch_rows<gather_launch>(a, dtype, mt);
}
