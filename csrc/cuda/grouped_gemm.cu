/*
 * grouped_gemm.cu: the experts' GEMMs on CUDA (forward, dgrad, wgrad) over per-expert row ranges
 * whose offsets stay in device memory; the dispatcher, the portable tensor-core path (sm_80+) and
 * the SIMT path (fp32/fp64 operands, unaligned shapes).
 *
 * Work decomposition without a host sync. fwd/dgrad cut each expert's rows into BM-row tiles; the
 * rows past expert_offsets[E] form one more group (the "tail", whose tiles write zeros). A tiny
 * kernel scans the per-group tile counts into the workspace, and the GEMM launches a grid sized by
 * the static bound Σ_g ceil(rows_g / BM) <= ceil(num_rows / BM) + E + 1 row tiles × the column
 * tiles: each CTA finds its group by one parallel compare against that prefix, and CTAs past the
 * real total exit. wgrad has static work (E × output tiles); each CTA sums over all its expert's
 * rows itself, in ascending order, so no partial sums cross CTAs and no atomics exist anywhere.
 *
 * The one clever idea: every product of every layout is the same tile loop over two smem operand
 * tiles, each either K-major ([rows][64 k], fwd's x) or MN-major ([64 k][128 cols], wgrad's
 * operands, trans_w = 0's weight), stored as 16-byte chunks with the chunk index XORed by the row's
 * low three bits. Then one ldmatrix (".trans" for the MN-major tile) yields exactly the mma.sync
 * fragment with no bank conflict in either layout, and the three products × two weight layouts are
 * six instantiations of one kernel, not six kernels.
 *
 * Order inside an expert (both modes): tiles go in bands of GG_BAND row tiles with the row tile
 * fastest, so the CTAs in flight share one weight column tile and one band of rows (kept in L2)
 * instead of streaming the whole expert's weight once per row tile.
 *
 * Also here: fc1 fused with glu_probs (moe_cuda_grouped_gemm_glu_probs_fwd), the grouped GEMM and
 * the glu_probs kernel composed on the stream.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_common.cuh"
#include "grouped_gemm_impl.cuh"
#include <stdlib.h>

#define GG_BAND 16 /* row tiles per band (see the header comment) */

/* tensor-core path: CTA tile 128 × 128 × 64, 4 warps of 64 × 64, 3-stage cp.async pipeline */
#define TC_BM 128
#define TC_BN 128
#define TC_BK 64
#define TC_STAGES 3
#define TC_THREADS 128
#define TC_TILE_ELEMS (TC_BM * TC_BK) /* one operand tile (both layouts hold 8192 elements) */
#define TC_SMEM_BYTES (TC_STAGES * 2 * TC_TILE_ELEMS * 2)

/* SIMT path: 64 × 64 × 16, 256 threads of 4 × 4 outputs */
#define ST_BM 64
#define ST_BN 64
#define ST_BK 16
#define ST_THREADS 256

typedef enum { GG_FWD = 0, GG_DGRAD = 1, GG_WGRAD = 2 } gg_kind_t;

/* One launch's problem. Row mode (fwd/dgrad): A(i, p) = a[(r0 + i)·k + p] (x or dy, K-major),
 * B(p, j) = w_e[j·k + p] (b_kmajor) or w_e[p·n + j], C(i, j) = c[(r0 + i)·n + j], with k the
 * reduction and n the output width. wgrad: A(i, p) = a[(r0 + p)·m + i], B(p, j) = b[(r0 + p)·n + j]
 * (both MN-major: the reduction runs over the expert's rows), C = c + e·m·n, [m, n]. */
typedef struct {
    const void *a, *b;
    void *c;
    const int64_t *offsets;    /* [E + 1], device */
    const int64_t *tile_start; /* [E + 2], workspace: row mode's first row tile of each group */
    int64_t num_rows, num_experts;
    int64_t m, n, k;
    int b_kmajor;
    moe_dtype_t out_dtype;
} gg_args_t;

/* What one CTA computes: output tile (m0, n0) of group e, whose rows start at r0. */
typedef struct {
    int64_t e, r0;
    int64_t m0, n0;
    int64_t m_ext; /* rows of the tile's problem (the expert's rows, or m for wgrad) */
    int64_t kred;  /* reduction length: k, or the expert's rows for wgrad; 0 for the tail */
} gg_job_t;

__device__ __forceinline__ void gg_band_split(int64_t local, int64_t row_tiles, int64_t col_tiles,
                                              int64_t *tm, int64_t *tn) {
    const int64_t band = local / (GG_BAND * col_tiles);
    const int64_t within = local - band * GG_BAND * col_tiles;
    const int64_t left = row_tiles - band * GG_BAND;
    const int64_t bsz = left < GG_BAND ? left : GG_BAND;
    *tn = within / bsz;
    *tm = band * GG_BAND + within % bsz;
}

/* Every thread of the block calls it (it holds a barrier); false: this CTA has no work. */
template <int BM, int BN, bool WGRAD>
__device__ __forceinline__ bool gg_find_job(const gg_args_t &p, gg_job_t *job) {
    const int64_t id = blockIdx.x, E = p.num_experts;
    const int64_t col_tiles = (p.n + BN - 1) / BN;
    if (WGRAD) {
        const int64_t row_tiles = (p.m + BM - 1) / BM, per = row_tiles * col_tiles;
        const int64_t e = id / per;
        int64_t tm, tn;
        gg_band_split(id - e * per, row_tiles, col_tiles, &tm, &tn);
        job->e = e;
        job->r0 = p.offsets[e];
        int64_t rows = p.offsets[e + 1] - job->r0;
        if (job->r0 < 0 || job->r0 + rows > p.num_rows || rows < 0) rows = 0; /* bad offsets */
        job->kred = rows;
        job->m0 = tm * BM, job->n0 = tn * BN, job->m_ext = p.m;
        return true;
    }
    __shared__ int64_t s_group;
    const int64_t *ts = p.tile_start;
    if (id >= ts[E + 1] * col_tiles) return false; /* uniform: every thread reads the same */
    /* exactly one group g has ts[g]·col_tiles <= id < ts[g + 1]·col_tiles (empty groups have
     * ts[g] = ts[g + 1] and match nothing): one parallel compare, no serial search */
    for (int64_t g = threadIdx.x; g <= E; g += blockDim.x)
        if (ts[g] * col_tiles <= id && id < ts[g + 1] * col_tiles) s_group = g;
    __syncthreads();
    const int64_t g = s_group;
    int64_t tm, tn;
    gg_band_split(id - ts[g] * col_tiles, ts[g + 1] - ts[g], col_tiles, &tm, &tn);
    job->e = g;
    if (g < E) {
        job->r0 = p.offsets[g];
        const int64_t r1 = p.offsets[g + 1];
        job->m_ext = (r1 < p.num_rows ? r1 : p.num_rows) - job->r0; /* bad offsets: no overrun */
        job->kred = p.k;
    } else { /* the tail: rows past the last expert are zeros */
        job->r0 = p.offsets[E];
        job->m_ext = p.num_rows - job->r0;
        job->kred = 0;
    }
    job->m0 = tm * BM, job->n0 = tn * BN;
    return true;
}

/* ts[g] = Σ_{g' < g} ceil(rows_g' / bm) over the E experts and the tail group; ts[E + 1] = total.
 * One block; counts clamped at 0 so that bad offsets cannot make the GEMM grid overrun. */
__global__ void moe_gg_tile_prefix_kernel(int64_t *ts, const int64_t *offsets, int64_t E,
                                          int64_t num_rows, int64_t bm) {
    __shared__ int64_t part[1024];
    const int64_t G = E + 1, per = (G + blockDim.x - 1) / blockDim.x;
    const int64_t g0 = threadIdx.x * per, g1 = g0 + per < G ? g0 + per : G;
    int64_t sum = 0;
    for (int64_t g = g0; g < g1; ++g) {
        int64_t rows = g < E ? offsets[g + 1] - offsets[g] : num_rows - offsets[E];
        rows = rows > 0 ? rows : 0;
        sum += (rows + bm - 1) / bm;
    }
    part[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned s = 1; s < blockDim.x; s <<= 1) { /* inclusive Hillis-Steele scan */
        const int64_t v = threadIdx.x >= s ? part[threadIdx.x - s] : 0;
        __syncthreads();
        part[threadIdx.x] += v;
        __syncthreads();
    }
    int64_t run = part[threadIdx.x] - sum;
    for (int64_t g = g0; g < g1; ++g) {
        ts[g] = run;
        int64_t rows = g < E ? offsets[g + 1] - offsets[g] : num_rows - offsets[E];
        rows = rows > 0 ? rows : 0;
        run += (rows + bm - 1) / bm;
    }
    if (threadIdx.x == blockDim.x - 1) ts[G] = part[threadIdx.x];
}

/* ---- epilogue: one rounding from the fp32 (fp64) accumulator --------------------------------- */

__device__ __forceinline__ void gg_store1(void *c, moe_dtype_t dt, int64_t i, float v) {
    switch (dt) {
    case MOE_DTYPE_BF16: ((__nv_bfloat16 *)c)[i] = __float2bfloat16_rn(v); break;
    case MOE_DTYPE_FP16: ((__half *)c)[i] = __float2half_rn(v); break;
    case MOE_DTYPE_FP64: ((double *)c)[i] = (double)v; break;
    default: ((float *)c)[i] = v; break;
    }
}

/* From the SIMT path's accumulator (an fp32 value held exactly, or fp64): straight to the output
 * type, so fp64 → fp16/bf16 rounds once, not through fp32 (moe_store would round twice). */
__device__ __forceinline__ void gg_store_acc(void *c, moe_dtype_t dt, int64_t i, double v) {
    switch (dt) {
    case MOE_DTYPE_BF16: ((__nv_bfloat16 *)c)[i] = __double2bfloat16(v); break;
    case MOE_DTYPE_FP16: ((__half *)c)[i] = __double2half(v); break;
    case MOE_DTYPE_FP64: ((double *)c)[i] = v; break;
    default: ((float *)c)[i] = (float)v; break;
    }
}

/* Two neighbours (i, i + 1); `pair`: both exist and i is even, so the store is one wide access. */
__device__ __forceinline__ void gg_store2(void *c, moe_dtype_t dt, int64_t i, float v0, float v1,
                                          bool pair) {
    if (!pair) {
        gg_store1(c, dt, i, v0);
        return;
    }
    switch (dt) {
    case MOE_DTYPE_BF16: ((__nv_bfloat162 *)c)[i / 2] = __floats2bfloat162_rn(v0, v1); break;
    case MOE_DTYPE_FP16: ((__half2 *)c)[i / 2] = __floats2half2_rn(v0, v1); break;
    case MOE_DTYPE_FP64: ((double2 *)c)[i / 2] = make_double2(v0, v1); break;
    default: ((float2 *)c)[i / 2] = make_float2(v0, v1); break;
    }
}

/* ---- tensor-core path (sm_80+): cp.async → swizzled smem → ldmatrix → mma.sync ------------- */

__device__ __forceinline__ uint32_t gg_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global → shared; zero-filled (nothing read) when !valid. */
__device__ __forceinline__ void gg_cp_async16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void gg_cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void gg_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void gg_ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void gg_ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void gg_mma(float d[4], const uint32_t a[4], const uint32_t b[2]);
template <>
__device__ __forceinline__ void gg_mma<__nv_bfloat16>(float d[4], const uint32_t a[4],
                                                      const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void gg_mma<__half>(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* One operand tile into smem. K-major: [128 rows][64 k] (8 chunks a row); MN-major: [64 k][128
 * cols] (16 chunks a row). `src` is the tile's element (0, 0) with row stride `ld` elements;
 * `rows_ok` / `cols_ok`: how many rows / columns (elements) of the tile exist. K and N are
 * multiples of 8 on this path, so a 16-byte chunk is wholly in or wholly out. Chunk c of row r
 * lands at chunk c ^ (r & 7): the 8 rows one ldmatrix phase reads hit 8 different bank groups. */
template <bool KMAJOR>
__device__ __forceinline__ void gg_load_tile(uint16_t *dst, const uint16_t *src, int64_t ld,
                                             int64_t rows_ok, int64_t cols_ok,
                                             const uint16_t *fallback) {
    constexpr int COLS = KMAJOR ? TC_BK : TC_BN, CPR = COLS / 8;
#pragma unroll
    for (int i = 0; i < TC_TILE_ELEMS / 8 / TC_THREADS; ++i) {
        const int idx = threadIdx.x + i * TC_THREADS, r = idx / CPR, c = idx % CPR;
        const bool ok = r < rows_ok && c * 8 < cols_ok;
        const uint16_t *g = ok ? src + (int64_t)r * ld + c * 8 : fallback;
        gg_cp_async16(gg_smem_addr(dst + r * COLS + ((c ^ (r & 7)) << 3)), g, ok);
    }
}

/* Fragments of one k16 step, lane l, q = l / 8 (which 8×8 matrix this lane addresses), r = l % 8.
 * A K-major, m16 tile at row m: matrices (m+0..7, k0..7) (m+8..15, k0..7) (m+0..7, k8..15)
 * (m+8..15, k8..15) = a0..a3. A MN-major (.trans): the same four blocks read from [k][m] rows.
 * B, an n16 pair at column n: (k0..7, n0..7) (k8..15, n0..7) (k0..7, n8..15) (k8..15, n8..15) =
 * b0, b1 of n8 tile 0, then of n8 tile 1. */
template <bool KMAJOR>
__device__ __forceinline__ void gg_frag_a(uint32_t r[4], const uint16_t *tile, int m, int kk) {
    const int l = threadIdx.x & 31, q = l >> 3, lr = l & 7;
    if (KMAJOR) {
        const int row = m + lr + 8 * (q & 1), ch = kk * 2 + (q >> 1);
        gg_ldmatrix_x4(r, gg_smem_addr(tile + row * TC_BK + ((ch ^ lr) << 3)));
    } else {
        const int k = kk * 16 + lr + 8 * (q >> 1), ch = m / 8 + (q & 1);
        gg_ldmatrix_x4_trans(r, gg_smem_addr(tile + k * TC_BM + ((ch ^ lr) << 3)));
    }
}

template <bool KMAJOR>
__device__ __forceinline__ void gg_frag_b(uint32_t r[4], const uint16_t *tile, int n, int kk) {
    const int l = threadIdx.x & 31, q = l >> 3, lr = l & 7;
    if (KMAJOR) {
        const int row = n + lr + 8 * (q >> 1), ch = kk * 2 + (q & 1);
        gg_ldmatrix_x4(r, gg_smem_addr(tile + row * TC_BK + ((ch ^ lr) << 3)));
    } else {
        const int k = kk * 16 + lr + 8 * (q & 1), ch = n / 8 + (q >> 1);
        gg_ldmatrix_x4_trans(r, gg_smem_addr(tile + k * TC_BN + ((ch ^ lr) << 3)));
    }
}

/* T: __nv_bfloat16 or __half. A_K / B_K: operand K-major (else MN-major). WGRAD: reduction over
 * the expert's rows (else over k, rows from the expert's range). */
template <typename T, bool A_K, bool B_K, bool WGRAD>
__global__ void __launch_bounds__(TC_THREADS) moe_gg_mma_kernel(gg_args_t p) {
    gg_job_t job;
    if (!gg_find_job<TC_BM, TC_BN, WGRAD>(p, &job)) return;
    extern __shared__ __align__(128) uint16_t gg_smem[];
    uint16_t *sa = gg_smem, *sb = gg_smem + TC_STAGES * TC_TILE_ELEMS;

    const uint16_t *a = (const uint16_t *)p.a, *b = (const uint16_t *)p.b;
    const int64_t kred = job.kred, m_left = job.m_ext - job.m0, n_left = p.n - job.n0;
    /* element (0, 0) of this CTA's A and B at k = 0, and their row strides */
    const uint16_t *a0, *b0;
    int64_t lda, ldb;
    if (WGRAD) {
        a0 = a + job.r0 * p.m + job.m0, lda = p.m;
        b0 = b + job.r0 * p.n + job.n0, ldb = p.n;
    } else {
        a0 = a + (job.r0 + job.m0) * p.k, lda = p.k;
        const uint16_t *we = b + job.e * p.k * p.n;
        if (B_K) b0 = we + job.n0 * p.k, ldb = p.k;
        else b0 = we + job.n0, ldb = p.n;
    }
    const int64_t kt_count = (kred + TC_BK - 1) / TC_BK;

    auto load_stage = [&](int stage, int64_t kt) {
        const int64_t k0 = kt * TC_BK, k_left = kred - k0;
        uint16_t *ta = sa + stage * TC_TILE_ELEMS, *tb = sb + stage * TC_TILE_ELEMS;
        if (A_K) gg_load_tile<true>(ta, a0 + k0, lda, m_left, k_left, a);
        else gg_load_tile<false>(ta, a0 + k0 * lda, lda, k_left, m_left, a);
        if (B_K) gg_load_tile<true>(tb, b0 + k0, ldb, n_left, k_left, b);
        else gg_load_tile<false>(tb, b0 + k0 * ldb, ldb, k_left, n_left, b);
    };

    const int warp = threadIdx.x >> 5, wm = (warp >> 1) * 64, wn = (warp & 1) * 64;
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) {
        if (s < kt_count) load_stage(s, s);
        gg_cp_async_commit();
    }
    for (int64_t kt = 0; kt < kt_count; ++kt) {
        gg_cp_async_wait<TC_STAGES - 2>();
        __syncthreads(); /* stage kt landed for all; stage kt - 1 is free again */
        const int64_t next = kt + TC_STAGES - 1;
        if (next < kt_count) load_stage((int)(next % TC_STAGES), next);
        gg_cp_async_commit();
        const int stage = (int)(kt % TC_STAGES);
        const uint16_t *ta = sa + stage * TC_TILE_ELEMS, *tb = sb + stage * TC_TILE_ELEMS;
#pragma unroll
        for (int kk = 0; kk < TC_BK / 16; ++kk) {
            uint32_t af[4][4], bf[8][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) gg_frag_a<A_K>(af[i], ta, wm + i * 16, kk);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                uint32_t r[4];
                gg_frag_b<B_K>(r, tb, wn + j * 16, kk);
                bf[2 * j][0] = r[0], bf[2 * j][1] = r[1];
                bf[2 * j + 1][0] = r[2], bf[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) gg_mma<T>(acc[i][j], af[i], bf[j]);
        }
    }
    gg_cp_async_wait<0>();

    /* c0, c1 at (row g, cols 2t, 2t + 1) of each m16 × n8 tile; c2, c3 at row g + 8 */
    char *cbase = (char *)p.c;
    const int64_t osize = p.out_dtype == MOE_DTYPE_FP32 ? 4 : p.out_dtype == MOE_DTYPE_FP64 ? 8 : 2;
    const int64_t crow0 = WGRAD ? job.e * p.m + job.m0 : job.r0 + job.m0;
    void *c = cbase + (crow0 * p.n + job.n0) * osize;
    const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = wm + i * 16 + g + 8 * h;
            if (row >= m_left) continue;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int col = wn + j * 8 + 2 * t;
                if (col >= n_left) continue;
                gg_store2(c, p.out_dtype, (int64_t)row * p.n + col, acc[i][j][2 * h],
                          acc[i][j][2 * h + 1], col + 1 < n_left);
            }
        }
    }
}

/* ---- SIMT path: any dtype, any alignment; fp64 operands accumulate in fp64 ----------------- */

__device__ __forceinline__ float gg_widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float gg_widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float gg_widen(float v) { return v; }
__device__ __forceinline__ double gg_widen(double v) { return v; }

/* Each output element: one thread's sum in ascending reduction order, in blocks of ST_BK. */
template <typename T, typename ACC, bool WGRAD>
__global__ void __launch_bounds__(ST_THREADS) moe_gg_simt_kernel(gg_args_t p) {
    gg_job_t job;
    if (!gg_find_job<ST_BM, ST_BN, WGRAD>(p, &job)) return;
    __shared__ ACC sa[ST_BK][ST_BM + 1], sb[ST_BK][ST_BN + 1];
    const T *a = (const T *)p.a, *b = (const T *)p.b;
    const int64_t m_left = job.m_ext - job.m0, n_left = p.n - job.n0;
    /* A(i, p), B(p, j) of this tile as (base, row stride, column stride) */
    const T *a0, *b0;
    int64_t a_rs, a_cs, b_rs, b_cs;
    if (WGRAD) {
        a0 = a + job.r0 * p.m + job.m0, a_rs = 1, a_cs = p.m;
        b0 = b + job.r0 * p.n + job.n0, b_rs = p.n, b_cs = 1;
    } else {
        a0 = a + (job.r0 + job.m0) * p.k, a_rs = p.k, a_cs = 1;
        const T *we = b + job.e * p.k * p.n;
        if (p.b_kmajor) b0 = we + job.n0 * p.k, b_rs = 1, b_cs = p.k;
        else b0 = we + job.n0, b_rs = p.n, b_cs = 1;
    }
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    ACC acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0;
    for (int64_t k0 = 0; k0 < job.kred; k0 += ST_BK) {
        const int64_t k_left = job.kred - k0;
        /* the contiguous index runs fastest across threads, so loads coalesce either way */
        for (int idx = threadIdx.x; idx < ST_BK * ST_BM; idx += ST_THREADS) {
            const int kk = a_cs == 1 ? idx % ST_BK : idx / ST_BM;
            const int ii = a_cs == 1 ? idx / ST_BK : idx % ST_BM;
            sa[kk][ii] = ii < m_left && kk < k_left ? (ACC)gg_widen(a0[ii * a_rs + (k0 + kk) * a_cs])
                                                    : (ACC)0;
        }
        for (int idx = threadIdx.x; idx < ST_BK * ST_BN; idx += ST_THREADS) {
            const int kk = b_rs == 1 ? idx % ST_BK : idx / ST_BN;
            const int jj = b_rs == 1 ? idx / ST_BK : idx % ST_BN;
            sb[kk][jj] = jj < n_left && kk < k_left ? (ACC)gg_widen(b0[(k0 + kk) * b_rs + jj * b_cs])
                                                    : (ACC)0;
        }
        __syncthreads();
        /* a block's 16 products are summed apart, then added to the running sum: two levels
         * of short sums, not one long one (as a tensor-core k-step does; several times smaller
         * rounding error over thousands of rows, same fixed order every run) */
        ACC part[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) part[i][j] = 0;
#pragma unroll
        for (int kk = 0; kk < ST_BK; ++kk) {
            ACC av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = sa[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) bv[j] = sb[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) part[i][j] += av[i] * bv[j];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] += part[i][j];
        __syncthreads();
    }
    const int64_t crow0 = WGRAD ? job.e * p.m + job.m0 : job.r0 + job.m0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = ty + 16 * i;
        if (row >= m_left) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = tx + 16 * j;
            if (col < n_left)
                gg_store_acc(p.c, p.out_dtype, (crow0 + row) * p.n + job.n0 + col,
                             (double)acc[i][j]);
        }
    }
}

/* ---- the gathered operand: rows copied into the workspace ------------------------------------
 *
 * The sm90 kernels read a gathered operand's rows by index themselves. A gathered call they do not
 * take (another GPU, sizes or alignment they decline) copies the operand's rows,
 * src[gather_index[r]] or zeros, into the front of the workspace and runs the plain op on that
 * copy with the rest of the workspace. Running the plain op (the sm90 path where it applies, else
 * the portable one) rather than always the portable kernels is what makes the result the
 * materialised op's bits on every GPU: the two paths' sums need not agree bit for bit.
 *
 * Index values outside [0, gather_rows) read a zero row, as the layout kernels skip a
 * sorted_indices value outside [-1, num_tokens): the device cannot report them without a host
 * sync, so they are the caller's contract (the CPU entry points reject them), and a bad one never
 * reads out of bounds. */

/* One W-byte vector per thread-iteration: row r of dst is row idx[r] of src, zeros when idx[r]
 * is outside [0, gather_rows). */
template <typename V>
__global__ void moe_gg_gather_rows_kernel(V *__restrict__ dst, const V *__restrict__ src,
                                          const int64_t *__restrict__ idx, int64_t num_rows,
                                          int64_t gather_rows, int64_t row_vecs) {
    const int64_t total = num_rows * row_vecs;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / row_vecs, v = i - r * row_vecs;
        const int64_t g = idx[r];
        V val;
        if (g >= 0 && g < gather_rows) val = src[g * row_vecs + v];
        else memset(&val, 0, sizeof val);
        dst[i] = val;
    }
}

/* The gathered operand's columns: K for x, N for grad_y. */
static int64_t gather_cols(const moe_grouped_gemm_params_t *p) {
    return p->gather_operand == MOE_GG_GATHER_X ? p->in_features : p->out_features;
}

/* Bytes of the gathered copy at the front of the workspace (a multiple of 256, so the rest of the
 * workspace keeps the alignment the plain op needs), or MOE_SIZE_OVERFLOW. */
static size_t gather_copy_bytes(const moe_grouped_gemm_params_t *p) {
    int64_t row_bytes, bytes = 0;
    if (moe_checked_mul_i64(gather_cols(p), (int64_t)moe_dtype_size(p->dtype), &row_bytes) ||
        moe_checked_section(&bytes, p->num_rows, row_bytes, 256))
        return MOE_SIZE_OVERFLOW;
    return (size_t)bytes;
}

static moe_status_t launch_gather_rows(void *dst, const void *src,
                                       const moe_grouped_gemm_params_t *p, cudaStream_t stream) {
    const int64_t R = p->num_rows, row_bytes = gather_cols(p) * (int64_t)moe_dtype_size(p->dtype);
    if (R == 0 || row_bytes == 0) return MOE_OK;
    /* the widest vector that divides a row and the source's alignment (dst is 256-aligned) */
    int w = 16;
    while (w > 2 && (row_bytes % w != 0 || ((uintptr_t)src & (uintptr_t)(w - 1)) != 0)) w /= 2;
    const int64_t row_vecs = row_bytes / w, total = R * row_vecs;
    const int threads = 256;
    const int64_t want = (total + threads - 1) / threads;
    const unsigned blocks = (unsigned)(want < 65536 ? want : 65536); /* grid-stride past that */
    const int64_t *idx = p->gather_index;
    const int64_t S = p->gather_rows;
    switch (w) {
    case 16:
        moe_gg_gather_rows_kernel<uint4><<<blocks, threads, 0, stream>>>(
            (uint4 *)dst, (const uint4 *)src, idx, R, S, row_vecs);
        break;
    case 8:
        moe_gg_gather_rows_kernel<uint2><<<blocks, threads, 0, stream>>>(
            (uint2 *)dst, (const uint2 *)src, idx, R, S, row_vecs);
        break;
    case 4:
        moe_gg_gather_rows_kernel<uint32_t><<<blocks, threads, 0, stream>>>(
            (uint32_t *)dst, (const uint32_t *)src, idx, R, S, row_vecs);
        break;
    default:
        moe_gg_gather_rows_kernel<uint16_t><<<blocks, threads, 0, stream>>>(
            (uint16_t *)dst, (const uint16_t *)src, idx, R, S, row_vecs);
        break;
    }
    MOE_CHECK_LAUNCH("moe_gg_gather_rows_kernel");
    return MOE_OK;
}

/* ---- host side -------------------------------------------------------------------------------- */

static size_t portable_workspace(const moe_grouped_gemm_params_t *p) {
    return ((size_t)(p->num_experts + 2) * sizeof(int64_t) + 255) / 256 * 256;
}

/* params with the gather removed: the plain op on the gathered copy */
static moe_grouped_gemm_params_t plain_params(const moe_grouped_gemm_params_t *p) {
    moe_grouped_gemm_params_t q = *p;
    q.gather_operand = MOE_GG_GATHER_NONE, q.gather_index = NULL, q.gather_rows = 0;
    return q;
}

/* The plain op's need: the max of the two paths'. */
static size_t plain_workspace(const moe_grouped_gemm_params_t *p) {
    const size_t a = portable_workspace(p), b = moe_cuda_gg_sm90_workspace_size(p);
    if (a == MOE_SIZE_OVERFLOW || b == MOE_SIZE_OVERFLOW) return MOE_SIZE_OVERFLOW;
    return a > b ? a : b;
}

extern "C" size_t moe_cuda_grouped_gemm_workspace_size(const moe_grouped_gemm_params_t *params) {
    if (params == NULL || params->num_experts < 1) return 0;
    /* both layouts grow by at most 256 bytes per expert (the Hopper wgrad's two tensor maps)
     * over a fixed part: bound that with checked arithmetic before the size_t sums */
    int64_t bound = 0;
    if (moe_checked_section(&bound, params->num_experts, 256, 256) ||
        moe_checked_add_i64(bound, 1024, &bound))
        return moe_fail_size("moe_cuda_grouped_gemm_workspace_size: num_experts=%lld overflows "
                             "int64 bytes", (long long)params->num_experts);
    if (params->gather_operand == MOE_GG_GATHER_NONE) return plain_workspace(params);
    /* gathered: the copy of the rows, then the plain op's workspace (the fallback, whose need
     * covers the sm90 path's own, since that path may still decline a call) */
    const moe_grouped_gemm_params_t q = plain_params(params);
    const size_t copy = gather_copy_bytes(params), rest = plain_workspace(&q);
    if (copy == MOE_SIZE_OVERFLOW || rest == MOE_SIZE_OVERFLOW || copy > SIZE_MAX / 2 - rest)
        return moe_fail_size("moe_cuda_grouped_gemm_workspace_size: num_rows=%lld x %lld "
                             "gathered columns overflow the workspace bytes",
                             (long long)params->num_rows, (long long)gather_cols(params));
    /* the sm90 path reads the rows by index: no copy, the whole point of the gathered operand
     * (run_gathered refuses a call it then declines, for a misaligned pointer) */
    if (moe_cuda_gg_sm90_takes(params))
        return plain_workspace(params);
    return copy + rest;
}

static int is_half(moe_dtype_t dt) { return dt == MOE_DTYPE_BF16 || dt == MOE_DTYPE_FP16; }

static int aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

/* 1 when the current device is compute capability 9.x and the sm90 kernels are in the binary. */
static moe_status_t sm90_available(int *yes) {
    *yes = 0;
    if (!moe_cuda_gg_sm90_compiled()) return MOE_OK;
    int dev = 0, major = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err != cudaSuccess)
        return moe_fail(MOE_ERR_CUDA, "grouped_gemm: cannot query the device: %s",
                        cudaGetErrorString(err));
    *yes = major == 9;
    return MOE_OK;
}

template <typename T, bool A_K, bool B_K, bool WGRAD>
static moe_status_t launch_mma(const gg_args_t &a, int64_t grid, cudaStream_t stream) {
    cudaError_t err = cudaFuncSetAttribute(moe_gg_mma_kernel<T, A_K, B_K, WGRAD>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           TC_SMEM_BYTES);
    if (err != cudaSuccess)
        return moe_fail(MOE_ERR_CUDA, "moe_gg_mma_kernel: %d bytes of shared memory: %s",
                        TC_SMEM_BYTES, cudaGetErrorString(err));
    moe_gg_mma_kernel<T, A_K, B_K, WGRAD><<<(unsigned)grid, TC_THREADS, TC_SMEM_BYTES, stream>>>(a);
    MOE_CHECK_LAUNCH("moe_gg_mma_kernel");
    return MOE_OK;
}

template <typename T>
static moe_status_t launch_mma_kind(gg_kind_t kind, const gg_args_t &a, int64_t grid,
                                    cudaStream_t stream) {
    if (kind == GG_WGRAD) return launch_mma<T, false, false, true>(a, grid, stream);
    if (a.b_kmajor) return launch_mma<T, true, true, false>(a, grid, stream);
    return launch_mma<T, true, false, false>(a, grid, stream);
}

template <typename T, typename ACC>
static moe_status_t launch_simt(gg_kind_t kind, const gg_args_t &a, int64_t grid,
                                cudaStream_t stream) {
    if (kind == GG_WGRAD) moe_gg_simt_kernel<T, ACC, true><<<(unsigned)grid, ST_THREADS, 0, stream>>>(a);
    else moe_gg_simt_kernel<T, ACC, false><<<(unsigned)grid, ST_THREADS, 0, stream>>>(a);
    MOE_CHECK_LAUNCH("moe_gg_simt_kernel");
    return MOE_OK;
}

/* The portable path of all three products. in0/in1: fwd x, weight; dgrad dy, weight; wgrad x, dy. */
static moe_status_t run_portable(gg_kind_t kind, void *out, const void *in0, const void *in1,
                                 const int64_t *offsets, const moe_grouped_gemm_params_t *p,
                                 void *workspace, cudaStream_t stream) {
    const int64_t E = p->num_experts, K = p->in_features, N = p->out_features, R = p->num_rows;
    gg_args_t a;
    a.offsets = offsets;
    a.tile_start = (const int64_t *)workspace;
    a.num_rows = R, a.num_experts = E;
    a.c = out;
    a.out_dtype = p->out_dtype;
    a.b_kmajor = 0;
    if (kind == GG_WGRAD) { /* [K, N] = xᵀ · dy, or [N, K] = dyᵀ · x */
        a.a = p->trans_w ? in1 : in0, a.b = p->trans_w ? in0 : in1;
        a.m = p->trans_w ? N : K, a.n = p->trans_w ? K : N, a.k = 0;
    } else { /* row problems: reduction k, output width n; B(p, j) from W's layout */
        a.a = in0, a.b = in1, a.m = 0;
        a.n = kind == GG_FWD ? N : K, a.k = kind == GG_FWD ? K : N;
        /* fwd: B = W(K, N), K-major when W is [N, K]; dgrad: B = Wᵀ, K-major when W is [K, N] */
        a.b_kmajor = kind == GG_FWD ? p->trans_w : !p->trans_w;
    }
    /* tensor cores need bf16/fp16, 16-byte rows and 16-byte aligned bases */
    const int tc = is_half(p->dtype) && K % 8 == 0 && N % 8 == 0 && aligned16(in0) &&
                   aligned16(in1) && aligned16(out);
    const int64_t bm = tc ? TC_BM : ST_BM, bn = tc ? TC_BN : ST_BN;
    int64_t grid;
    if (kind == GG_WGRAD) {
        grid = E * ((a.m + bm - 1) / bm) * ((a.n + bn - 1) / bn);
    } else {
        moe_gg_tile_prefix_kernel<<<1, 1024, 0, stream>>>((int64_t *)workspace, offsets, E, R, bm);
        MOE_CHECK_LAUNCH("moe_gg_tile_prefix_kernel");
        grid = ((R + bm - 1) / bm + E + 1) * ((a.n + bn - 1) / bn);
    }
    if (grid == 0) return MOE_OK;
    if (grid > 0x7fffffffLL)
        return moe_fail(MOE_ERR_UNSUPPORTED, "grouped_gemm: %lld tiles exceed one grid",
                        (long long)grid);
    if (tc) {
        if (p->dtype == MOE_DTYPE_BF16) return launch_mma_kind<__nv_bfloat16>(kind, a, grid, stream);
        return launch_mma_kind<__half>(kind, a, grid, stream);
    }
    switch (p->dtype) {
    case MOE_DTYPE_BF16: return launch_simt<__nv_bfloat16, float>(kind, a, grid, stream);
    case MOE_DTYPE_FP16: return launch_simt<__half, float>(kind, a, grid, stream);
    case MOE_DTYPE_FP32: return launch_simt<float, float>(kind, a, grid, stream);
    default: return launch_simt<double, double>(kind, a, grid, stream);
    }
}

/* Checks shared by the three products (the offsets are the caller's contract on the device, as
 * are the gather index's values). */
static moe_status_t check_common(const int64_t *offsets, const moe_grouped_gemm_params_t *p,
                                 moe_gg_op_t op, void *workspace, size_t workspace_bytes) {
    MOE_TRY(moe_grouped_gemm_check_params(p, op));
    MOE_CHECK(offsets != NULL, "expert_offsets must not be NULL");
    MOE_CHECK_WORKSPACE(moe_cuda_grouped_gemm_workspace_size, p);
    MOE_CHECK(aligned16(workspace), "workspace must be 16-byte aligned");
    return MOE_OK;
}

/* The Hopper kernels take the problem when they can; MOE_ERR_UNSUPPORTED means "not this one". */
#define GG_TRY_SM90(fn, ...)                                                  \
    do {                                                                      \
        int sm90_ = 0;                                                        \
        if (is_half(params->dtype)) MOE_TRY(sm90_available(&sm90_));          \
        if (sm90_) {                                                          \
            const moe_status_t st_ = fn(__VA_ARGS__);                         \
            if (st_ != MOE_ERR_UNSUPPORTED) return st_;                       \
            moe_clear_error();                                                \
        }                                                                     \
    } while (0)

/* Whether the source of the operand `operand` may be NULL: it is the gathered one, and empty. */
static int operand_ok(const void *ptr, int operand, const moe_grouped_gemm_params_t *p) {
    return ptr != NULL || (p->gather_operand == operand && p->gather_rows == 0);
}

/* A gathered call the sm90 path did not take: the rows copied to the workspace's front, then the
 * plain op (entry point `fn`) on the copy with the rest of the workspace. in0/in1 as the entry
 * points take them (fwd x, weight; dgrad grad_y, weight; wgrad x, grad_y). */
using gg_entry_fn = moe_status_t (*)(void *, const void *, const void *, const int64_t *,
                                     const moe_grouped_gemm_params_t *, void *, size_t, void *);
static moe_status_t run_gathered(gg_entry_fn fn, gg_kind_t kind, void *out, const void *in0,
                                 const void *in1, const int64_t *offsets,
                                 const moe_grouped_gemm_params_t *p, void *workspace,
                                 size_t workspace_bytes, void *stream) {
    const moe_grouped_gemm_params_t q = plain_params(p);
    const size_t copy = gather_copy_bytes(p), rest = plain_workspace(&q);
    MOE_CHECK(copy != MOE_SIZE_OVERFLOW && rest != MOE_SIZE_OVERFLOW &&
                  workspace_bytes >= copy && workspace_bytes - copy >= rest,
              "grouped_gemm: the gathered operand's rows need %zu workspace bytes for their copy, "
              "got %zu (the Hopper kernels, sized for, read them by index but take only 16-byte "
              "aligned operands)", copy + rest, workspace_bytes);
    /* wgrad's second operand is grad_y; elsewhere the gathered one is always in0 */
    const int second = kind == GG_WGRAD && p->gather_operand == MOE_GG_GATHER_DY;
    MOE_TRY(launch_gather_rows(workspace, second ? in1 : in0, p, (cudaStream_t)stream));
    const void *rows = workspace;
    return fn(out, second ? in0 : rows, second ? rows : in1, offsets, &q,
              (char *)workspace + copy, workspace_bytes - copy, stream);
}

extern "C" moe_status_t moe_cuda_grouped_gemm_fwd(void *y, const void *x, const void *weight,
                                                  const int64_t *expert_offsets,
                                                  const moe_grouped_gemm_params_t *params,
                                                  void *workspace, size_t workspace_bytes,
                                                  void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(expert_offsets, params, MOE_GG_OP_FWD, workspace, workspace_bytes));
    if (params->num_rows == 0 || params->out_features == 0) return MOE_OK;
    MOE_CHECK(y != NULL, "y must not be NULL");
    MOE_CHECK(params->in_features == 0 || (operand_ok(x, MOE_GG_GATHER_X, params) && weight),
              "x and weight must not be NULL");
    GG_TRY_SM90(moe_cuda_gg_sm90_fwd, y, x, weight, expert_offsets, params, workspace,
                workspace_bytes, stream);
    if (params->gather_operand != MOE_GG_GATHER_NONE) /* not taken by the sm90 path */
        return run_gathered(moe_cuda_grouped_gemm_fwd, GG_FWD, y, x, weight,
                            expert_offsets, params, workspace, workspace_bytes, stream);
    return run_portable(GG_FWD, y, x, weight, expert_offsets, params, workspace,
                        (cudaStream_t)stream);
}

extern "C" moe_status_t moe_cuda_grouped_gemm_dgrad(void *grad_x, const void *grad_y,
                                                    const void *weight,
                                                    const int64_t *expert_offsets,
                                                    const moe_grouped_gemm_params_t *params,
                                                    void *workspace, size_t workspace_bytes,
                                                    void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(expert_offsets, params, MOE_GG_OP_DGRAD, workspace, workspace_bytes));
    if (params->num_rows == 0 || params->in_features == 0) return MOE_OK;
    MOE_CHECK(grad_x != NULL, "grad_x must not be NULL");
    MOE_CHECK(params->out_features == 0 ||
                  (operand_ok(grad_y, MOE_GG_GATHER_DY, params) && weight),
              "grad_y and weight must not be NULL");
    GG_TRY_SM90(moe_cuda_gg_sm90_dgrad, grad_x, grad_y, weight, expert_offsets, params, workspace,
                workspace_bytes, stream);
    if (params->gather_operand != MOE_GG_GATHER_NONE) /* not taken by the sm90 path */
        return run_gathered(moe_cuda_grouped_gemm_dgrad, GG_DGRAD, grad_x, grad_y, weight,
                            expert_offsets, params, workspace, workspace_bytes, stream);
    return run_portable(GG_DGRAD, grad_x, grad_y, weight, expert_offsets, params, workspace,
                        (cudaStream_t)stream);
}

extern "C" moe_status_t moe_cuda_grouped_gemm_wgrad(void *grad_weight, const void *x,
                                                    const void *grad_y,
                                                    const int64_t *expert_offsets,
                                                    const moe_grouped_gemm_params_t *params,
                                                    void *workspace, size_t workspace_bytes,
                                                    void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(expert_offsets, params, MOE_GG_OP_WGRAD, workspace, workspace_bytes));
    if (params->in_features == 0 || params->out_features == 0) return MOE_OK;
    MOE_CHECK(grad_weight != NULL, "grad_weight must not be NULL");
    MOE_CHECK(params->num_rows == 0 || (operand_ok(x, MOE_GG_GATHER_X, params) &&
                                        operand_ok(grad_y, MOE_GG_GATHER_DY, params)),
              "x and grad_y must not be NULL");
    GG_TRY_SM90(moe_cuda_gg_sm90_wgrad, grad_weight, x, grad_y, expert_offsets, params,
                workspace, workspace_bytes, stream);
    if (params->gather_operand != MOE_GG_GATHER_NONE) /* not taken by the sm90 path */
        return run_gathered(moe_cuda_grouped_gemm_wgrad, GG_WGRAD, grad_weight, x, grad_y,
                            expert_offsets, params, workspace, workspace_bytes, stream);
    return run_portable(GG_WGRAD, grad_weight, x, grad_y, expert_offsets, params, workspace,
                        (cudaStream_t)stream);
}

/* fc1 fused with glu_probs: the two kernels back to back on the stream, so every device has the
 * op and it gives the composition's bits (a gathered x goes to fc1 with the params). (Computing
 * h in the Hopper GEMM's epilogue instead saves a write and a re-read of a, but runs slower: the
 * activation's fp64 element math then holds up the tensor cores, where the glu_probs pass spreads
 * it over every SM.) */
extern "C" moe_status_t moe_cuda_grouped_gemm_glu_probs_fwd(
    void *h, void *a, const void *x, const void *weight, const int64_t *expert_offsets,
    const void *probs, moe_dtype_t probs_dtype, const moe_grouped_gemm_params_t *params,
    const moe_glu_probs_params_t *glu, void *workspace, size_t workspace_bytes, void *stream) {
    moe_clear_error();
    int64_t ffn = 0;
    MOE_TRY(moe_grouped_gemm_glu_probs_fwd_check(h, a, probs, probs_dtype, params, glu,
                                                  &ffn));
    MOE_TRY(check_common(expert_offsets, params, MOE_GG_OP_GLU_PROBS_FWD, workspace,
                         workspace_bytes));
    if (params->num_rows == 0) return MOE_OK;
    MOE_CHECK(params->in_features == 0 || (operand_ok(x, MOE_GG_GATHER_X, params) && weight),
              "x and weight must not be NULL");
    MOE_TRY(moe_cuda_grouped_gemm_fwd(a, x, weight, expert_offsets, params, workspace,
                                      workspace_bytes, stream));
    return moe_cuda_glu_probs_fwd(h, a, probs, params->num_rows, ffn, params->dtype, probs_dtype,
                                  glu, NULL, 0, stream);
}
