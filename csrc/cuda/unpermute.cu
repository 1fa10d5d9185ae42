/*
 * unpermute.cu: the combine (rows of the expert-grouped layout → tokens) and its backward, plus
 * permute's backward (the same gather-sum without weights), on CUDA.
 *
 * The one idea: invert sorted_indices into a token → rows map (CSR) once, then every output token
 * is owned by one thread group that adds its own rows in ascending row order. A gather, not a
 * scatter-add: no atomics on data, one writer per element, and the CPU's exact rounding points
 * (each weighted row rounded to the promoted dtype P, a running fp32/fp64 sum, one final
 * rounding), so the output is the CPU's bit for bit. The CSR build uses integer atomics only for
 * counts and slot claims; each token's short segment is then sorted, so nothing depends on
 * their order. The kernels after the first are one programmatic-launch chain (cuda_common.cuh),
 * so their launch gaps vanish.
 *
 * Data kernels read and write 16 bytes per access when the row size and the pointers allow it,
 * and issue the loads of up to four rows before adding them, so a token's rows are in flight
 * together.
 */
#include "layout_cuda.cuh"

/* ---- the token → rows map ------------------------------------------------------------------- */

typedef struct {
    int64_t *start;  /* [T + 1]: token t owns entries [start[t], start[t + 1]) */
    int64_t *cursor; /* [T]: fill cursors */
    int64_t *rows;   /* [R]: rows, ascending within each token */
    int64_t *rexp;   /* [R]: the expert of each entry's row (when expert_offsets are given) */
    double *dots;    /* [R]: per-entry fp64 scratch (unpermute_bwd's grad_probs terms) */
} token_rows_t;

static void token_rows_layout(token_rows_t *m, void *ws, int64_t T, int64_t R) {
    int64_t *p = (int64_t *)ws;
    m->start = p;
    m->cursor = p + T + 1;
    m->rows = m->cursor + T;
    m->rexp = m->rows + R;
    m->dots = (double *)(m->rexp + R);
}

extern "C" size_t moe_cuda_unpermute_workspace_size(int64_t num_tokens, int64_t num_rows) {
    if (num_tokens < 0 || num_rows < 0) return 0;
    return (size_t)(2 * num_tokens + 1 + 3 * num_rows) * sizeof(int64_t);
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

static moe_status_t build_token_rows(token_rows_t *m, void *workspace, size_t workspace_bytes,
                                     const int64_t *sorted_indices,
                                     const int64_t *expert_offsets, int64_t T, int64_t E,
                                     int64_t R, cudaStream_t st) {
    const size_t need = moe_cuda_unpermute_workspace_size(T, R);
    MOE_CHECK(workspace_bytes >= need && (need == 0 || workspace),
              "workspace too small: %zu bytes, need at least %zu "
              "(moe_cuda_unpermute_workspace_size)",
              workspace_bytes, need);
    MOE_CHECK(R == 0 || sorted_indices, "sorted_indices must not be NULL");
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

/* ---- vector packs ---------------------------------------------------------------------------- */

/* VE elements of type T moved as one access of VE·sizeof(T) bytes. */
template <typename T, int VE>
union moe_pack {
    typename moe_vec_t<sizeof(T) * VE>::type raw;
    T v[VE];
};

/* Rows whose metadata (row index, weight) a thread group stages in shared memory; a token with
 * more rows reads the rest from global memory. */
#define MOE_GATHER_CAP 32
#define MOE_GATHER_THREADS 256

/* ---- forward gather-sum (unpermute, and permute_bwd without weights) ------------------------- */

/*
 * out[t] = narrow_ET(Σ_i v_i) over the token's rows in ascending order, the sum in C (fp32, or
 * fp64 when P is fp64), v_i = round_P(row_i · w_i) with probs, row_i without.
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
    const P *src = (const P *)rows_base;
    P *dst = (P *)out + t * nvec;
    /* Two vectors per thread (v and v + X) × two rows per step: four 16-byte loads in flight
     * whatever the row count (mixtral's 2 rows had 2 with one vector × four rows), in about the
     * same registers. Each element's sum keeps its ascending row order. */
    const int64_t X = blockDim.x;
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
                    const int64_t r = i < MOE_GATHER_CAP ? s_row[y][i] : rows[b + i];
                    w[j] = i < MOE_GATHER_CAP ? s_w[y][i]
                           : probs ? (C)moe_load(probs, probs_dtype, t * E + rexp[b + i])
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

/* ---- unpermute backward ---------------------------------------------------------------------- */

#define MOE_BWD_GROUP 8

/*
 * One block per token (X threads). For each of the token's rows: grad_x[r] = narrow(round_P(g · w))
 * (a raw copy of g without probs); with want_dots also the dot g · x[r], each product rounded to
 * P and summed in C: per thread in its fixed vector order, then a fixed xor tree in the warp, then
 * the warps in order. dots[entry] = round_P(dot). Rows go in groups of MOE_BWD_GROUP so the
 * partial dots stay in registers.
 */
template <typename ET, typename C, int RP, int VE>
__global__ void __launch_bounds__(MOE_GATHER_THREADS)
moe_unpermute_bwd_kernel(void *__restrict__ grad_x, double *__restrict__ dots,
                         const void *__restrict__ grad_output, const void *__restrict__ x_rows,
                         const int64_t *__restrict__ start, const int64_t *__restrict__ rows,
                         const int64_t *__restrict__ rexp, const void *__restrict__ probs,
                         moe_dtype_t probs_dtype, int64_t E, int64_t nvec, int want_dots) {
    typedef moe_pack<ET, VE> P;
    __shared__ C s_red[MOE_GATHER_THREADS / 32][MOE_BWD_GROUP];
    moe_pdl_trigger();
    moe_pdl_wait();
    const int x = threadIdx.x, lane = x & 31, warp = x >> 5, nwarps = blockDim.x >> 5;
    const int64_t t = blockIdx.x;
    const int64_t b = start[t], n = start[t + 1] - b;
    const P *g_row = (const P *)grad_output + t * nvec;
    P *gx = (P *)grad_x;
    const P *xs = (const P *)x_rows;
    for (int64_t i0 = 0; i0 < n; i0 += MOE_BWD_GROUP) {
        int64_t r[MOE_BWD_GROUP];
        C w[MOE_BWD_GROUP], part[MOE_BWD_GROUP];
#pragma unroll
        for (int j = 0; j < MOE_BWD_GROUP; ++j) {
            const int64_t i = i0 + j;
            r[j] = i < n ? rows[b + i] : -1;
            w[j] = (i < n && probs) ? (C)moe_load(probs, probs_dtype, t * E + rexp[b + i]) : (C)1;
            part[j] = (C)0;
        }
        for (int64_t v = x; v < nvec; v += blockDim.x) {
            const P g = g_row[v];
            C gc[VE];
#pragma unroll
            for (int k = 0; k < VE; ++k) gc[k] = (C)moe_widen(g.v[k]);
#pragma unroll
            for (int j = 0; j < MOE_BWD_GROUP; ++j) {
                if (r[j] < 0) continue;
                if (probs) {
                    P o;
#pragma unroll
                    for (int k = 0; k < VE; ++k)
                        o.v[k] = moe_narrow<ET>(moe_round_p<RP>(moe_mul_rn(gc[k], w[j])));
                    gx[r[j] * nvec + v] = o;
                } else {
                    gx[r[j] * nvec + v] = g;
                }
                if (want_dots) {
                    const P xv = xs[r[j] * nvec + v];
#pragma unroll
                    for (int k = 0; k < VE; ++k)
                        part[j] = moe_add_rn(
                            part[j], moe_round_p<RP>(moe_mul_rn(gc[k], (C)moe_widen(xv.v[k]))));
                }
            }
        }
        if (want_dots) { /* uniform across the block: n and want_dots are per block */
#pragma unroll
            for (int j = 0; j < MOE_BWD_GROUP; ++j) {
                C s = part[j];
#pragma unroll
                for (int d = 16; d >= 1; d /= 2) s = moe_add_rn(s, __shfl_xor_sync(0xffffffffu, s, d));
                if (lane == 0) s_red[warp][j] = s;
            }
            __syncthreads();
            if (x == 0)
                for (int j = 0; j < MOE_BWD_GROUP && i0 + j < n; ++j) {
                    C s = s_red[0][j];
                    for (int k = 1; k < nwarps; ++k) s = moe_add_rn(s, s_red[k][j]);
                    dots[b + i0 + j] = (double)moe_round_p<RP>(s);
                }
            __syncthreads();
        }
    }
}

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

/* ---- dispatch -------------------------------------------------------------------------------- */

/* Compute type and product rounding for a token dtype and (optional) probs dtype. */
typedef struct {
    int compute_fp64; /* C = double */
    int rp;           /* MOE_RP_* */
} math_t;

static moe_dtype_t promote(moe_dtype_t a, moe_dtype_t b) {
    if (a == b) return a;
    if (a == MOE_DTYPE_FP64 || b == MOE_DTYPE_FP64) return MOE_DTYPE_FP64;
    return MOE_DTYPE_FP32;
}

static math_t math_for(moe_dtype_t dtype, const void *probs, moe_dtype_t probs_dtype) {
    const moe_dtype_t p = probs ? promote(dtype, probs_dtype) : dtype;
    math_t m;
    m.compute_fp64 = p == MOE_DTYPE_FP64;
    m.rp = !probs ? MOE_RP_NONE
           : p == MOE_DTYPE_BF16 ? MOE_RP_BF16
           : p == MOE_DTYPE_FP16 ? MOE_RP_FP16 : MOE_RP_NONE;
    return m;
}

typedef struct {
    void *dst;             /* gather: output [T, H]; bwd: grad_x [R, H] */
    double *dots;          /* bwd only */
    const void *src;       /* gather: rows [R, H]; bwd: grad_output [T, H] */
    const void *x_rows;    /* bwd only: permuted_tokens, or NULL */
    const token_rows_t *m;
    const void *probs;
    moe_dtype_t probs_dtype;
    int64_t T, E, hidden;
    int backward;
    cudaStream_t st;
} data_args_t;

template <typename ET, typename C, int RP, int VE>
static moe_status_t launch_data_ve(const data_args_t *a) {
    const int64_t nvec = a->hidden / VE;
    const int X = moe_pow2_clamp(nvec, 32, MOE_GATHER_THREADS);
    if (!a->backward) {
        /* the gather-sum covers two vectors per thread: half the threads per token */
        const int XG = moe_pow2_clamp((nvec + 1) / 2, 32, MOE_GATHER_THREADS);
        const int Y = MOE_GATHER_THREADS / XG;
        void (*gather)(void *, const void *, const int64_t *, const int64_t *, const int64_t *,
                       const void *, moe_dtype_t, int64_t, int64_t, int64_t) =
            moe_gather_sum_kernel<ET, C, RP, VE>;
        MOE_LAUNCH_CHAINED(gather, dim3(moe_blocks_for(a->T, Y)), dim3(XG, Y), 0, a->st, a->dst,
                           a->src, a->m->start, a->m->rows, a->m->rexp, a->probs, a->probs_dtype,
                           a->T, a->E, nvec);
        MOE_CHECK_LAUNCH("moe_gather_sum_kernel");
    } else {
        void (*bwd)(void *, double *, const void *, const void *, const int64_t *,
                    const int64_t *, const int64_t *, const void *, moe_dtype_t, int64_t, int64_t,
                    int) = moe_unpermute_bwd_kernel<ET, C, RP, VE>;
        MOE_LAUNCH_CHAINED(bwd, dim3((unsigned)a->T), dim3(X), 0, a->st, a->dst, a->dots, a->src,
                           a->x_rows, a->m->start, a->m->rows, a->m->rexp, a->probs,
                           a->probs_dtype, a->E, nvec, a->x_rows != NULL);
        MOE_CHECK_LAUNCH("moe_unpermute_bwd_kernel");
    }
    return MOE_OK;
}

template <typename ET, typename C, int RP>
static moe_status_t launch_data_t(const data_args_t *a) {
    const int w = moe_vec_bytes((size_t)a->hidden * sizeof(ET), a->dst, a->src, a->x_rows);
    if (w == 16) return launch_data_ve<ET, C, RP, 16 / sizeof(ET)>(a);
    return launch_data_ve<ET, C, RP, 1>(a);
}

static moe_status_t launch_data(const data_args_t *a, moe_dtype_t dtype, math_t mt) {
    if (a->T == 0) return MOE_OK;
    switch (dtype) {
    case MOE_DTYPE_FP32:
        return mt.compute_fp64 ? launch_data_t<float, double, MOE_RP_NONE>(a)
                               : launch_data_t<float, float, MOE_RP_NONE>(a);
    case MOE_DTYPE_FP64: return launch_data_t<double, double, MOE_RP_NONE>(a);
    case MOE_DTYPE_BF16:
        if (mt.compute_fp64) return launch_data_t<moe_bf16_s, double, MOE_RP_NONE>(a);
        return mt.rp == MOE_RP_BF16 ? launch_data_t<moe_bf16_s, float, MOE_RP_BF16>(a)
                                    : launch_data_t<moe_bf16_s, float, MOE_RP_NONE>(a);
    case MOE_DTYPE_FP16:
        if (mt.compute_fp64) return launch_data_t<moe_fp16_s, double, MOE_RP_NONE>(a);
        return mt.rp == MOE_RP_FP16 ? launch_data_t<moe_fp16_s, float, MOE_RP_FP16>(a)
                                    : launch_data_t<moe_fp16_s, float, MOE_RP_NONE>(a);
    default: return moe_fail(MOE_ERR_INTERNAL, "unpermute: unexpected dtype %d", (int)dtype);
    }
}

static moe_status_t launch_zero_pad(void *rows_base, const int64_t *sorted_indices, int64_t R,
                                    int64_t T, size_t row_bytes, cudaStream_t st) {
    if (R == 0) return MOE_OK;
    const dim3 grid(moe_blocks_for(R, 256)); /* one thread per row, a warp per 32 rows */
    void (*pad)(void *, const int64_t *, int64_t, int64_t, int64_t);
    int64_t nvec;
    switch (moe_vec_bytes(row_bytes, rows_base, NULL, NULL)) {
    case 16: pad = moe_zero_pad_rows_kernel<16>, nvec = (int64_t)(row_bytes / 16); break;
    case 8: pad = moe_zero_pad_rows_kernel<8>, nvec = (int64_t)(row_bytes / 8); break;
    case 4: pad = moe_zero_pad_rows_kernel<4>, nvec = (int64_t)(row_bytes / 4); break;
    case 2: pad = moe_zero_pad_rows_kernel<2>, nvec = (int64_t)(row_bytes / 2); break;
    default: pad = moe_zero_pad_rows_kernel<1>, nvec = (int64_t)row_bytes; break;
    }
    MOE_LAUNCH_CHAINED(pad, grid, dim3(256), 0, st, rows_base, sorted_indices, R, T, nvec);
    MOE_CHECK_LAUNCH("moe_zero_pad_rows_kernel");
    return MOE_OK;
}

static moe_status_t check_common(int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                 int64_t num_rows, moe_dtype_t dtype, const char *what) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(hidden >= 1, "hidden must be >= 1, got %lld", (long long)hidden);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(num_rows >= 0, "num_rows must be >= 0, got %lld", (long long)num_rows);
    MOE_CHECK(moe_is_float_dtype(dtype), "%s must be a float dtype, got %s", what,
              moe_dtype_name(dtype));
    MOE_CHECK(num_tokens <= 0x7fffffffLL, "num_tokens=%lld; the CUDA kernels take at most 2^31-1",
              (long long)num_tokens);
    return MOE_OK;
}

/* ---- entry points ---------------------------------------------------------------------------- */

extern "C" moe_status_t moe_cuda_unpermute_fwd(void *output, const void *permuted_tokens,
                                               const int64_t *sorted_indices, const void *probs,
                                               const int64_t *expert_offsets, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               int64_t num_rows, moe_dtype_t dtype,
                                               moe_dtype_t probs_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, hidden, num_experts, num_rows, dtype, "permuted_tokens"));
    MOE_CHECK(!probs || moe_is_float_dtype(probs_dtype), "probs must be a float dtype, got %s",
              moe_dtype_name(probs_dtype));
    MOE_CHECK(!probs || expert_offsets, "expert_offsets must not be NULL when probs are given");
    MOE_CHECK(num_tokens == 0 || output, "output must not be NULL");
    MOE_CHECK(num_rows == 0 || permuted_tokens, "permuted_tokens must not be NULL");
    cudaStream_t st = (cudaStream_t)stream;
    token_rows_t m;
    MOE_TRY(build_token_rows(&m, workspace, workspace_bytes, sorted_indices,
                             probs ? expert_offsets : NULL, num_tokens, num_experts, num_rows, st));
    data_args_t a = {output, NULL, permuted_tokens, NULL, &m, probs, probs_dtype,
                     num_tokens, num_experts, hidden, 0, st};
    return launch_data(&a, dtype, math_for(dtype, probs, probs_dtype));
}

extern "C" moe_status_t moe_cuda_permute_bwd(void *grad_tokens, void *grad_probs,
                                             const void *grad_permuted_tokens,
                                             const void *grad_permuted_probs,
                                             const int64_t *sorted_indices,
                                             const int64_t *expert_offsets, int64_t num_tokens,
                                             int64_t hidden, int64_t num_experts,
                                             int64_t num_rows, moe_dtype_t dtype,
                                             moe_dtype_t probs_dtype, void *workspace,
                                             size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, hidden, num_experts, num_rows, dtype,
                         "grad_permuted_tokens"));
    MOE_CHECK(!grad_probs || moe_is_float_dtype(probs_dtype),
              "grad_permuted_probs must be a float dtype, got %s", moe_dtype_name(probs_dtype));
    MOE_CHECK(!grad_probs || num_rows == 0 || grad_permuted_probs,
              "grad_permuted_probs must not be NULL when grad_probs is requested");
    MOE_CHECK(!grad_probs || expert_offsets,
              "expert_offsets must not be NULL when grad_probs is requested");
    MOE_CHECK(num_tokens == 0 || grad_tokens, "grad_tokens must not be NULL");
    MOE_CHECK(num_rows == 0 || grad_permuted_tokens, "grad_permuted_tokens must not be NULL");
    cudaStream_t st = (cudaStream_t)stream;
    token_rows_t m;
    MOE_TRY(build_token_rows(&m, workspace, workspace_bytes, sorted_indices,
                             grad_probs ? expert_offsets : NULL, num_tokens, num_experts,
                             num_rows, st));
    data_args_t a = {grad_tokens, NULL, grad_permuted_tokens, NULL, &m, NULL, probs_dtype,
                     num_tokens, num_experts, hidden, 0, st};
    MOE_TRY(launch_data(&a, dtype, math_for(dtype, NULL, probs_dtype)));
    if (grad_probs && num_tokens > 0) {
        MOE_LAUNCH_CHAINED(moe_token_expert_sum_kernel,
                           dim3(moe_blocks_for(num_tokens * num_experts, 256)), dim3(256), 0, st,
                           grad_probs, (const double *)NULL, grad_permuted_probs, m.start, m.rows,
                           m.rexp, num_tokens, num_experts, probs_dtype);
        MOE_CHECK_LAUNCH("moe_token_expert_sum_kernel");
    }
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_unpermute_bwd(void *grad_permuted_tokens, void *grad_probs,
                                               const void *grad_output,
                                               const void *permuted_tokens,
                                               const int64_t *sorted_indices, const void *probs,
                                               const int64_t *expert_offsets, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               int64_t num_rows, moe_dtype_t dtype,
                                               moe_dtype_t probs_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, hidden, num_experts, num_rows, dtype, "permuted_tokens"));
    MOE_CHECK(!probs || moe_is_float_dtype(probs_dtype), "probs must be a float dtype, got %s",
              moe_dtype_name(probs_dtype));
    MOE_CHECK(!probs || expert_offsets, "expert_offsets must not be NULL when probs are given");
    MOE_CHECK(!grad_probs || probs, "grad_probs needs probs (the forward had none)");
    MOE_CHECK(num_rows == 0 || grad_permuted_tokens, "grad_permuted_tokens must not be NULL");
    MOE_CHECK(num_tokens == 0 || grad_output, "grad_output must not be NULL");
    MOE_CHECK(!grad_probs || num_rows == 0 || permuted_tokens,
              "permuted_tokens must not be NULL when grad_probs is requested");
    cudaStream_t st = (cudaStream_t)stream;
    token_rows_t m;
    MOE_TRY(build_token_rows(&m, workspace, workspace_bytes, sorted_indices,
                             probs ? expert_offsets : NULL, num_tokens, num_experts, num_rows, st));
    const size_t esize = moe_dtype_size(dtype);
    MOE_TRY(launch_zero_pad(grad_permuted_tokens, sorted_indices, num_rows, num_tokens,
                            (size_t)hidden * esize, st));
    data_args_t a = {grad_permuted_tokens, m.dots, grad_output,
                     grad_probs ? permuted_tokens : NULL, &m, probs, probs_dtype,
                     num_tokens, num_experts, hidden, 1, st};
    MOE_TRY(launch_data(&a, dtype, math_for(dtype, probs, probs_dtype)));
    if (grad_probs && num_tokens > 0) {
        MOE_LAUNCH_CHAINED(moe_token_expert_sum_kernel,
                           dim3(moe_blocks_for(num_tokens * num_experts, 256)), dim3(256), 0, st,
                           grad_probs, m.dots, (const void *)NULL, m.start, m.rows, m.rexp,
                           num_tokens, num_experts, probs_dtype);
        MOE_CHECK_LAUNCH("moe_token_expert_sum_kernel");
    }
    return MOE_OK;
}
