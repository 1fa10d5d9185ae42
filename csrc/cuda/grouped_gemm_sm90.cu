/*
 * grouped_gemm_sm90.cu: the grouped GEMM on Hopper (sm_90a): wgmma tensor-core products fed by
 * the TMA copy engine, one persistent CTA per SM walking (expert, M tile, N tile) work items.
 *
 * The one clever idea: every product is the same kernel, D[m, n] = sum_r A[m, r] · B[n, r], with
 * each operand either K-major or MN-major in shared memory (the wgmma descriptor's transpose bit
 * reads an MN-major 16-bit tile as it was loaded, no data shuffling). fwd and dgrad group the M
 * dimension by expert (A = the activation rows of the expert, B = its weight, reduction static);
 * wgrad groups the reduction by expert (A and B = the expert's rows of dy and x, both MN-major).
 * The expert row ranges never leave the device: ONE tensor map covers the whole activation buffer
 * [num_rows, cols] and one the whole weight [E, R, C] (3-D, so the weight's own tails are zero-
 * filled by the copy engine), and each CTA reads expert_offsets into shared memory and derives
 * its work list from it. Rows of an M tile past the expert's end are loaded (they belong to the
 * next expert) but never stored. wgrad, whose reduction runs over the expert's rows, reads them
 * through two tensor maps per expert instead, re-pointed and cut to the expert's rows on the
 * device (gg_sm90_expert_maps_kernel), so the copy engine zero-fills the reduction's last block
 * past the expert's end and the rows after it cannot contribute even when they hold NaN.
 *
 * Layout of a CTA: warpgroup 0 is the producer (one thread issues TMA loads into a ring of
 * STAGES shared-memory stages, 128-byte swizzled, guarded by full/empty mbarriers); warpgroups 1
 * and 2 are consumers, each computing 64 rows x BN columns of the 128 x BN tile with
 * m64nBNk16 wgmma (fp32 accumulators in registers, one wgmma group kept in flight). The
 * consumers' wgmma descriptors derive from warp-uniform values only (the warpgroup index and
 * the tile count are broadcast by a shuffle, a stage adds its offset to a base descriptor), so
 * wgrad keeps them in uniform registers: built per thread, each would be moved to a uniform
 * register (R2UR) in front of every wgmma, which wgrad's short tiles pay for most. The plain
 * fwd / dgrad kernels still rebuild them per thread in their k loop (ptxas's choice, with the
 * same uniform inputs) and are at parity with cuBLAS on dense shapes all the same
 * (docs/perf-history.md). A 16-bit output block is handed to
 * the copy engine (gg_store_block_tma: TMA stores from a swizzled staging buffer) so that its
 * writes to global memory overlap the next tile's MMAs: the two consumer warpgroups share one
 * tile, so a store they wait for leaves the tensor cores idle, the more so the shorter the
 * tile's reduction (wgrad's are short). fwd/dgrad blocks cut by the
 * expert's end (the copy engine would write the next expert's rows) and fp32 outputs are stored
 * by the threads with row/column masks (16-bit ones staged through shared memory for 16-byte
 * coalesced stores); rows past offsets[E] are zeroed by a small second kernel.
 * Work order: tiles numbered expert by expert; inside an expert, groups of 16 M tiles with M
 * fastest, so the ~132 concurrent tiles share a few weight column blocks and a few row blocks
 * (both stay in L2). Static round-robin over CTAs; every output element has one writer and a
 * fixed summation order (ascending k blocks): bitwise reproducible. The one exception is fwd /
 * dgrad's split last wave (gg_sched_make): when the tiles leave a partial last wave, its tiles
 * are cut along k into segments run by otherwise idle CTAs, and the last segment to finish sums
 * the fp32 partials in k order (gg_sk_fixup), handed over through the workspace with integer
 * atomics: the same order on every run, so still reproducible.
 *
 * Everything sm_90a-specific is compiled only under __CUDA_ARCH_FEAT_SM90_ALL; in other device
 * passes (sm_80, plain sm_90) the kernels are empty, and the host learns which case it is from
 * cudaFuncGetAttributes (the real kernel has static shared memory, the empty one none).
 */
#include <cuda.h> /* CUtensorMap and the cuTensorMapEncodeTiled enums only: no -lcuda */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_common.cuh"
#include "grouped_gemm_impl.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GG_SM90A 1
#else
#define GG_SM90A 0
#endif

#define GG_BM 128       /* rows of a CTA tile: two consumer warpgroups of 64 */
#define GG_BK 64        /* reduction per stage: 64 16-bit elements = one 128-byte swizzle row */
/* wgrad of short experts: stages of 32 expert rows, twice as many in the same ring bytes. A
 * stage stays held until the wgmma group after the one reading it is issued, so about two stages
 * are never being loaded: halving them doubles the bytes the copy engine has in flight, which
 * pays where each tile's reduction is short (the ring refills at every tile) and costs where it is
 * long (twice the barrier and wgmma-group overhead per flop). The A/B over rows per expert
 * (docs/perf-history.md) puts the cut at 256 (gg_wgrad_bk). */
#define GG_BK_SHORT 32
#define GG_SHORT_ROWS 256
#define GG_THREADS 384  /* producer warpgroup + 2 consumer warpgroups */
#define GG_MAX_E 1024   /* experts whose offsets fit the shared-memory schedule */
#define GG_GROUP_M 16   /* M tiles per raster group inside an expert */
#define GG_BOX_BYTES (64 * 128) /* one 64-row x 128-byte TMA box */

/* Stages of the smem ring: 3 at BN 256 (144 KB of operands), 5 at BN 128 (160 KB), which leaves
 * room in the SM's shared memory for the output staging (GG_W_BYTES per consumer warpgroup) and
 * the static schedule. */
#define GG_STAGES(BN) ((BN) == 256 ? 3 : 5)
/* stages of BK reduction elements fill the same ring (GG_BK / BK times as many) */
#define GG_STAGES_BK(BN, BK) (GG_STAGES(BN) * (GG_BK / (BK)))
#define GG_STAGE_BYTES_BK(BN, BK) ((GG_BM + (BN)) * (BK) * 2)
#define GG_STAGE_BYTES(BN) GG_STAGE_BYTES_BK(BN, GG_BK)
/* the staged epilogue's pitch (gg_store_block_staged): 64 rows x 64 16-bit columns, rows padded
 * to 144 B so the fragment writes (8 rows x 4 column pairs per warp) hit 32 distinct banks */
#define GG_C_PITCH 144
/* the TMA epilogue's staging: per consumer warpgroup its whole 64 x BN block of 16-bit values,
 * as BN / 64 boxes of 64 rows x 128 bytes in the copy engine's 128-byte swizzle */
#define GG_W_BYTES(BN) (64 * (BN) * 2)
#define GG_SMEM_BYTES(BN) (GG_STAGES(BN) * GG_STAGE_BYTES(BN) + 2 * GG_W_BYTES(BN) + 1024)

/* Sizes the kernel needs besides the tensor maps (passed by value). */
typedef struct gg_args {
    void *out;                     /* y / dx [num_rows, n_out] or dW [E, m_static, n_out] */
    const int64_t *offsets;        /* [E + 1], device memory */
    int num_experts;
    int out_dtype;                 /* moe_dtype_t: fp32, fp16 or bf16 */
    int n_out;                     /* output columns */
    int m_static;                  /* wgrad: output rows per expert */
    int red_iters;                 /* fwd/dgrad: ceil(reduction / 64) */
    int n_tiles;                   /* ceil(n_out / BN) */
    int m_tiles_static;            /* wgrad: ceil(m_static / 128) */
    int64_t ld_out;                /* fwd/dgrad: row stride of the output in elements */
    int64_t num_rows;              /* rows of the activation buffers */
    /* the split last wave (fwd/dgrad; sk_sync NULL: off, as the host decides from the
     * reduction's length; see gg_sched_make): per split tile and consumer warpgroup an arrival
     * count (2 * gridDim.x ints, zeroed on the stream before the launch), then per segment and
     * warpgroup a 64 x BN fp32 partial (at most 2 * gridDim.x) */
    int *sk_sync;
    float *sk_part;
    int sk_min_seg;                /* k blocks a segment has at least */
    /* wgrad: per expert two tensor maps, [2e] giving the output rows and [2e + 1] the output
     * columns, over the expert's rows alone (gg_sm90_expert_maps_kernel); NULL: the whole-buffer
     * maps, with the reduction's tail rows zeroed in shared memory */
    const CUtensorMap *ex_maps;
    /* the gathered operand (g_op: GG_GATHER_A or _B, else GG_GATHER_NONE): its row r is row
     * g_idx[r] of g_src ([g_rows, g_cols] 16-bit, rows g_ld bytes apart); an index of -1 (or
     * outside [0, g_rows)) and rows past the reduction's end read as zeros. See gg_gather_box. */
    const uint8_t *g_src;
    const int64_t *g_idx;
    int64_t g_rows, g_ld;
    int g_op, g_cols;
} gg_args_t;

#define GG_GATHER_NONE 0
#define GG_GATHER_A 1 /* the operand giving the output rows (fwd / dgrad: x or dy) */
#define GG_GATHER_B 2 /* wgrad only: the operand giving the output columns */

#if GG_SM90A
/* ------------------------------------------------------------------------------------------
 * PTX wrappers (sm_90a)
 * ---------------------------------------------------------------------------------------- */

/* Offsets outside [0, num_rows] break the caller's contract; clamped, they cannot make a kernel
 * read or write outside the buffers. */
__device__ __forceinline__ int64_t gg_clamp_offset(int64_t o, int64_t num_rows) {
    return o < 0 ? 0 : (o > num_rows ? num_rows : o);
}

__device__ __forceinline__ uint32_t gg_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void gg_mbar_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(gg_smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void gg_mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(gg_smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void gg_mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(gg_smem_addr(bar)) : "memory");
}

__device__ __forceinline__ uint32_t gg_mbar_try(uint32_t addr, uint32_t parity) {
    uint32_t ok;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(addr), "r"(parity)
        : "memory");
    return ok;
}

/* Waits for the phase of parity `parity` to complete. Built with -DGG_SM90_WATCHDOG (the
 * standalone check does), a wait that never ends traps instead of hanging the device. */
__device__ __forceinline__ void gg_mbar_wait(uint64_t *bar, uint32_t parity) {
    const uint32_t addr = gg_smem_addr(bar);
#ifdef GG_SM90_WATCHDOG
    uint32_t n = 0;
    while (!gg_mbar_try(addr, parity))
        if (++n == (1u << 24)) {
            printf("gg_sm90 watchdog: block %d thread %d parity %u\n", blockIdx.x, threadIdx.x,
                   parity);
            __trap();
        }
#else
    while (!gg_mbar_try(addr, parity)) {
    }
#endif
}

/* 2-D box [c1][c0] of the tensor map into smem, completing on `bar`. */
__device__ __forceinline__ void gg_tma_2d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0,
                                          int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];" ::"r"(gg_smem_addr(dst)),
        "l"((uint64_t)map), "r"(gg_smem_addr(bar)), "r"(c0), "r"(c1)
        : "memory");
}

__device__ __forceinline__ void gg_tma_3d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0,
                                          int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(gg_smem_addr(dst)),
        "l"((uint64_t)map), "r"(gg_smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

/* 16 bytes global -> shared by the generic-proxy async copy; ok = 0 writes zeros (ignore-src:
 * the source is not read at all, so src may point anywhere, past the tensor's end too). */
__device__ __forceinline__ void gg_cp16(uint32_t dst, const void *src, int ok) {
    asm volatile("{\n.reg .pred skip;\nsetp.eq.u32 skip, %2, 0;\n"
                 "cp.async.cg.shared.global [%0], [%1], 16, skip;\n}\n" ::"r"(dst), "l"(src),
                 "r"(ok)
                 : "memory");
}

/* The barrier counts one arrival when every cp.async this thread issued so far has landed
 * (noinc: that arrival is one of the count the barrier was initialised with). */
__device__ __forceinline__ void gg_cp_arrive(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(gg_smem_addr(bar))
                 : "memory");
}

/* The gathered operand's share of one stage, issued by producer thread pt (0..127): the boxes
 * the copy engine would have filled, in its 128-byte swizzle (16-byte chunk c of box row j at
 * j * 128 + ((c ^ (j % 8)) * 16)). Eight threads share a row, thread pt copying chunk pt % 8 of
 * rows pt / 8 + 16 q, so each warp instruction reads four whole 128-byte lines. The issue path
 * is short (it sets the pace: 128 threads issue what one TMA instruction would): a row's address
 * is formed once and its boxes are immediate offsets from it, an invalid row or column skips
 * the read (gg_cp16), and the row indices arrive early in registers or shared memory.
 *   K-major (fwd / dgrad A): 128 tile rows x 64 reduction columns [col0, col0 + 64); rows[j] is
 *     tile row j's source row's byte offset (-1: zeros), set once per tile (gg_tile_rows).
 *   MN-major (wgrad): `boxes` boxes of BK reduction rows x 64 output columns, box b covering
 *     columns col0 + 64 b; src[q] is reduction row pt / 8 + 16 q's index as loaded (anything
 *     outside [0, g_rows): zeros), a stage ahead (gg_stage_rows). */
template <int BK>
__device__ __forceinline__ void gg_gather_mn(uint32_t dst, const gg_args_t &a, int boxes,
                                             int col0, const int64_t (&src)[BK / 16], int pt) {
    const int c = pt & 7, col = col0 + 8 * c;
#pragma unroll
    for (int q = 0; q < BK / 16; ++q) {
        const int j = pt / 8 + 16 * q;
        const uint32_t at = dst + j * 128 + ((c ^ (j & 7)) << 4);
        const int64_t s = src[q];
        const int row_ok = s >= 0 && s < a.g_rows;
        const uint8_t *row = a.g_src + (row_ok ? s : 0) * a.g_ld + (int64_t)col * 2;
#pragma unroll
        for (int b = 0; b < boxes; ++b)
            gg_cp16(at + b * (BK * 128), row + 128 * b, row_ok && col + 64 * b < a.g_cols);
    }
}

/* wgrad: the indices of the stage whose reduction rows start at r0, for gg_gather_mn, as loaded
 * (checked at their use, so nothing waits for the loads here); rows from row_end on: -1. */
template <int BK>
__device__ __forceinline__ void gg_stage_rows(int64_t (&src)[BK / 16], const gg_args_t &a,
                                              int64_t r0, int64_t row_end, int pt) {
#pragma unroll
    for (int q = 0; q < BK / 16; ++q) {
        const int64_t r = r0 + pt / 8 + 16 * q;
        src[q] = r < row_end ? __ldg(a.g_idx + r) : -1;
    }
}

/* fwd / dgrad: tile row pt's source row, as a byte offset into g_src (-1: zeros), into rows[pt]
 * (the 128 producer threads, named barrier 4 on both sides: nobody still reads the previous
 * tile's rows, everybody sees the new ones). */
__device__ __forceinline__ void gg_tile_rows(int64_t *rows, const gg_args_t &a, int64_t r,
                                             int pt) {
    asm volatile("bar.sync 4, 128;" ::: "memory");
    const int64_t s = r < a.num_rows ? __ldg(a.g_idx + r) : -1;
    rows[pt] = s >= 0 && s < a.g_rows ? s * a.g_ld : -1;
    asm volatile("bar.sync 4, 128;" ::: "memory");
}

__device__ __forceinline__ void gg_gather_k(uint32_t dst, const gg_args_t &a,
                                            const int64_t *rows, int col0, int pt) {
    const int c = pt & 7, col = col0 + 8 * c;
    const int col_ok = col < a.g_cols;
    const uint8_t *base = a.g_src + (int64_t)col * 2;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int j = pt / 8 + 16 * q;
        const int64_t off = rows[j];
        gg_cp16(dst + j * 128 + ((c ^ (j & 7)) << 4), base + off, off >= 0 && col_ok);
    }
}

/* wgmma shared-memory descriptor, 128-byte swizzle. K-major: lbo unused, sbo = 1024 (8-row
 * groups). MN-major: lbo = stride between 64-element MN chunks, sbo = 1024 (8-k groups). */
__device__ __forceinline__ uint64_t gg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | ((uint64_t)1 << 62);
}

#define GG_R64                                                                             \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "               \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "     \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "     \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define GG_R128                                                                            \
    GG_R64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, "  \
           "%79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, "    \
           "%94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, " \
           "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, " \
           "%121, %122, %123, %124, %125, %126, %127"
#define GG_D8(i)                                                                           \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),            \
        "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define GG_D64 GG_D8(0), GG_D8(8), GG_D8(16), GG_D8(24), GG_D8(32), GG_D8(40), GG_D8(48), GG_D8(56)
#define GG_D128                                                                            \
    GG_D64, GG_D8(64), GG_D8(72), GG_D8(80), GG_D8(88), GG_D8(96), GG_D8(104), GG_D8(112),  \
        GG_D8(120)
/* d += A · B for one k16 step; scale-d is the constant 1 (accumulators start at zero). */
#define GG_WGMMA_ASM(OP, REGS, NA, NB, NS, NTA, NTB, DOPS)                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" NS ", 0;\n"                          \
                 "wgmma.mma_async.sync.aligned." OP " {" REGS "}, %" NA ", %" NB            \
                 ", p, 1, 1, %" NTA ", %" NTB ";\n}\n"                                      \
                 : DOPS                                                                     \
                 : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB))

template <int BN, bool F16, int TA, int TB>
__device__ __forceinline__ void gg_wgmma(float (&d)[BN / 2], uint64_t da, uint64_t db) {
    if constexpr (BN == 256) {
        if constexpr (F16)
            GG_WGMMA_ASM("m64n256k16.f32.f16.f16", GG_R128, "128", "129", "130", "131", "132",
                         GG_D128);
        else
            GG_WGMMA_ASM("m64n256k16.f32.bf16.bf16", GG_R128, "128", "129", "130", "131", "132",
                         GG_D128);
    } else {
        if constexpr (F16)
            GG_WGMMA_ASM("m64n128k16.f32.f16.f16", GG_R64, "64", "65", "66", "67", "68", GG_D64);
        else
            GG_WGMMA_ASM("m64n128k16.f32.bf16.bf16", GG_R64, "64", "65", "66", "67", "68", GG_D64);
    }
}

/* Keeps the compiler from moving accumulator reads/writes across the async wgmma boundary. */
template <int N>
__device__ __forceinline__ void gg_fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/* One work item: the expert, the tile's M and N block, and its row range. */
typedef struct gg_tile {
    int e, m_blk, n_blk, iters;
    int64_t row0, row_end;
} gg_tile_t;

/* Raster order inside an expert: groups of GG_GROUP_M M tiles, M fastest inside a group; a
 * remainder of fewer than GG_GROUP_M / 2 M tiles joins the last whole group. Alone, a remainder
 * of one M tile (an expert of 2049-2176 rows) reads every weight column block for that one
 * tile, so its ~num_n concurrent tiles stream all their weight bytes from HBM instead of sharing
 * them through L2. */
__device__ __forceinline__ void gg_tile_mn(int local, int num_m, int num_n, int *m, int *n) {
    const int full = num_m / GG_GROUP_M, rem = num_m - full * GG_GROUP_M;
    const int whole = (full > 0 && rem < GG_GROUP_M / 2) ? full - 1 : full;
    const int per_group = GG_GROUP_M * num_n;
    const int g = local / per_group;
    if (g < whole) {
        const int r = local - g * per_group;
        *m = g * GG_GROUP_M + r % GG_GROUP_M;
        *n = r / GG_GROUP_M;
    } else {
        const int last = num_m - whole * GG_GROUP_M, r = local - whole * per_group;
        *m = whole * GG_GROUP_M + r % last;
        *n = r / last;
    }
}

template <bool WGRAD, int BK>
__device__ __forceinline__ gg_tile_t gg_decode(int t, const gg_args_t &a, const int64_t *s_off,
                                               const int *s_cum) {
    gg_tile_t tl;
    int local, num_m;
    if constexpr (WGRAD) {
        const int per_e = a.m_tiles_static * a.n_tiles;
        tl.e = t / per_e;
        local = t - tl.e * per_e;
        num_m = a.m_tiles_static;
    } else {
        int lo = 0, hi = a.num_experts; /* last e with s_cum[e] <= t; s_cum[E] > t */
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (s_cum[mid] <= t) lo = mid; else hi = mid;
        }
        tl.e = lo;
        local = t - s_cum[lo];
        const int64_t rows = s_off[lo + 1] - s_off[lo];
        num_m = (int)((rows + GG_BM - 1) / GG_BM);
    }
    gg_tile_mn(local, num_m, a.n_tiles, &tl.m_blk, &tl.n_blk);
    tl.row0 = s_off[tl.e];
    tl.row_end = s_off[tl.e + 1];
    if (tl.row_end < tl.row0) tl.row_end = tl.row0; /* a decreasing offset: caller's bug, no hang */
    if constexpr (WGRAD)
        tl.iters = (int)((tl.row_end - tl.row0 + BK - 1) / BK);
    else
        tl.iters = a.red_iters;
    return tl;
}

/* A CTA's work: tiles t, t + G, ... below sk_t0, then at most one segment of a split tile. */
typedef struct gg_sched {
    int t, sk_t0, iters;
    int seg;   /* this CTA's unit in the split last wave (tile (seg / segs), segment seg % segs) */
    int segs;  /* segments per split tile; 0: nothing split */
} gg_sched_t;

/* fwd/dgrad with a uniform reduction: when the tiles leave a partial last wave of r tiles
 * (G CTAs, r <= G / 2), each of those r tiles is cut along k into segs = G / r equal segments (at
 * most GG_SK_MAX_SEGS, each at least sk_min_seg k blocks), one per CTA, so the last wave takes
 * 1 / segs of a tile's time instead of a whole one (mixtral's fc2 fwd and fc1 dgrad: 16 tiles of
 * 224 / 448 k blocks in a 17th wave). Segment j of every split tile covers the same k blocks and
 * they all start together, so the CTAs sharing a weight block still read it at the same time
 * (through L2); a stream-K split into unaligned ranges lost that sharing, as its CTAs read
 * every k block at a different time, and gained nothing. gg_sk_fixup sums the segments. */
#define GG_SK_MAX_SEGS 16
template <bool WGRAD>
__device__ __forceinline__ gg_sched_t gg_sched_make(const gg_args_t &a, int total) {
    gg_sched_t sc;
    sc.t = blockIdx.x;
    sc.sk_t0 = total;
    sc.iters = a.red_iters;
    sc.seg = -1;
    sc.segs = 0;
    if constexpr (!WGRAD) {
        const int G = gridDim.x, q = total / G, r = total - q * G;
        if (a.sk_sync && r > 0) {
            int segs = G / r;
            if (segs > GG_SK_MAX_SEGS) segs = GG_SK_MAX_SEGS;
            if (segs > a.red_iters / a.sk_min_seg) segs = a.red_iters / a.sk_min_seg;
            if (segs >= 2) {
                sc.sk_t0 = q * G;
                sc.segs = segs;
                if ((int)blockIdx.x < r * segs) sc.seg = blockIdx.x;
            }
        }
    }
    return sc;
}

/* The next unit of work: tile *tile, k blocks [*kb0, *kb1) (*kb1 = -1: the whole tile, its own
 * iters), *seg = its unit in the split wave (-1: not split). Uniform per CTA. */
__device__ __forceinline__ bool gg_sched_next(gg_sched_t &sc, int *tile, int *kb0, int *kb1,
                                              int *seg) {
    if (sc.t < sc.sk_t0) {
        *tile = sc.t, *kb0 = 0, *kb1 = -1, *seg = -1;
        sc.t += gridDim.x;
        return true;
    }
    if (sc.seg < 0) return false;
    const int i = sc.seg / sc.segs, j = sc.seg - i * sc.segs;
    *tile = sc.sk_t0 + i;
    *kb0 = (int)((int64_t)j * sc.iters / sc.segs);
    *kb1 = (int)((int64_t)(j + 1) * sc.iters / sc.segs);
    *seg = sc.seg;
    sc.seg = -1;
    return true;
}

/* One consumer warpgroup's 64 x BN part of a split tile's segment. Every segment parks its
 * partial sums in the workspace, then counts itself in; the last one in (all the others' stores
 * are then visible: fence, then the atomic) sums the partials in k order, segment 0 first: the
 * same additions in the same order whichever segment finishes last, so the bits are
 * reproducible. Nothing waits (no CTA depends on another being resident); integer atomics only.
 * Returns true when this warpgroup holds the tile's sums and stores them. */
template <int BN>
__device__ __forceinline__ bool gg_sk_fixup(const gg_args_t &a, int seg, int segs, int wg,
                                            float (&acc)[BN / 2], int *s_flag, int bar) {
    const int tw = threadIdx.x & 127;
    const int i = seg / segs, j = seg - i * segs;
    int *arrive = a.sk_sync + 2 * i + wg;
    /* slot (i * segs + k) * 2 + wg: segment k of tile i, this warpgroup's half; float4s
     * interleaved by thread, so a warp's stores and loads are 512 contiguous bytes */
    const float4 *part = (const float4 *)a.sk_part + (size_t)(2 * i * segs + wg) * (16 * BN) + tw;
    const size_t seg_stride = (size_t)2 * 16 * BN; /* float4s from one segment's slot to the next */
    float4 *mine = (float4 *)part + j * seg_stride;
#pragma unroll
    for (int q = 0; q < BN / 8; ++q)
        __stcg(mine + 128 * q,
               make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
    __threadfence();
    asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
    if (tw == 0) *s_flag = atomicAdd(arrive, 1);
    asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
    if (*s_flag < segs - 1) return false;
    __threadfence();
#pragma unroll
    for (int q = 0; q < BN / 8; ++q) {
        const float4 v = __ldcg(part + 128 * q);
        acc[4 * q] = v.x, acc[4 * q + 1] = v.y, acc[4 * q + 2] = v.z, acc[4 * q + 3] = v.w;
    }
    for (int k = 1; k < segs; ++k) {
#pragma unroll
        for (int q = 0; q < BN / 8; ++q) {
            const float4 v = __ldcg(part + k * seg_stride + 128 * q);
            acc[4 * q] += v.x, acc[4 * q + 1] += v.y, acc[4 * q + 2] += v.z, acc[4 * q + 3] += v.w;
        }
    }
    return true;
}

template <typename OutT>
__device__ __forceinline__ void gg_store2(OutT *p, float x, float y);
template <>
__device__ __forceinline__ void gg_store2<float>(float *p, float x, float y) {
    *(float2 *)p = make_float2(x, y);
}
template <>
__device__ __forceinline__ void gg_store2<__nv_bfloat16>(__nv_bfloat16 *p, float x, float y) {
    *(__nv_bfloat162 *)p = __floats2bfloat162_rn(x, y);
}
template <>
__device__ __forceinline__ void gg_store2<__half>(__half *p, float x, float y) {
    *(__half2 *)p = __floats2half2_rn(x, y);
}

/* Stores one consumer's 64 x BN accumulator block: thread (warp w, lane l) holds rows
 * 16w + l/4 (+8) and column pairs 8j + 2(l%4) of each n8 block j. base points at (row 0, col
 * n0) of the block; rows >= row_lim and columns >= col_lim are not stored. */
template <int BN, typename OutT>
__device__ __forceinline__ void gg_store_block(OutT *base, int64_t ld, int row_lim, int col_lim,
                                               const float (&d)[BN / 2]) {
    const int w = (threadIdx.x / 32) & 3, l = threadIdx.x & 31;
    const int r0 = 16 * w + l / 4, c0 = 2 * (l & 3);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int c = 8 * j + c0;
        if (c < col_lim) {
            if (r0 < row_lim) gg_store2(base + (int64_t)r0 * ld + c, d[4 * j], d[4 * j + 1]);
            if (r0 + 8 < row_lim)
                gg_store2(base + (int64_t)(r0 + 8) * ld + c, d[4 * j + 2], d[4 * j + 3]);
        }
    }
}

/* 16-bit outputs: the block goes through shared memory 64 columns at a time, so that global
 * stores are 16 bytes per thread and whole 128-byte lines per 8 threads (direct fragment stores
 * are 4 bytes, 8 rows per instruction: several times the L2 transactions, and they dominated the
 * tile time when K is short). cbuf: this warpgroup's staging, at least 64 x GG_C_PITCH bytes;
 * bar: its named barrier. */
template <int BN, typename OutT>
__device__ __forceinline__ void gg_store_block_staged(OutT *base, int64_t ld, int row_lim,
                                                      int col_lim, const float (&d)[BN / 2],
                                                      uint8_t *cbuf, int bar) {
    const int tw = threadIdx.x & 127, w = tw / 32, l = tw & 31;
    const int r0 = 16 * w + l / 4, c0 = 2 * (l & 3);
#pragma unroll
    for (int q = 0; q < BN / 64; ++q) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            const int j = 8 * q + jj, c = 8 * jj + c0;
            OutT lo2[2], hi2[2];
            gg_store2(lo2, d[4 * j], d[4 * j + 1]);
            gg_store2(hi2, d[4 * j + 2], d[4 * j + 3]);
            *(uint32_t *)(cbuf + r0 * GG_C_PITCH + c * 2) = *(const uint32_t *)lo2;
            *(uint32_t *)(cbuf + (r0 + 8) * GG_C_PITCH + c * 2) = *(const uint32_t *)hi2;
        }
        asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tw + 128 * i, row = idx / 8, ch = idx % 8, col = 64 * q + 8 * ch;
            if (row < row_lim && col < col_lim)
                *(uint4 *)(base + (int64_t)row * ld + col) =
                    *(const uint4 *)(cbuf + row * GG_C_PITCH + ch * 16);
        }
        asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
    }
}

/* 16-bit output, the TMA epilogue: the block is written into shared memory whole, in the copy
 * engine's 128-byte swizzle (16-byte chunk q of row r at chunk q ^ (r % 8): a warp's fragment
 * writes, 8 rows x 4 column pairs, hit 32 distinct banks), and one thread hands it to the copy
 * engine as BN / 64 TMA stores of 64 x 64. The consumers go straight on to the next tile's k loop
 * while the copy engine writes, so the tile's store overlaps the next tile's MMAs instead of
 * following them. Rows and columns past the map's bounds are clipped by the copy engine: map_c
 * is dW as [E, m_static, n_out] in wgrad, the output as [1, num_rows, n_out] in fwd/dgrad (whose
 * blocks cut by the expert's end never come here). Before the block is written, the previous
 * tile's stores must have read it (bulk wait_group.read 0). cbuf: this warpgroup's GG_W_BYTES,
 * 1024-aligned; bar: its named barrier; (col0, row0, e): the block's first column, its first row
 * (inside the expert in wgrad, of the whole output in fwd/dgrad), the expert (wgrad) or 0. */
template <int BN, typename OutT>
__device__ __forceinline__ void gg_store_block_tma(const CUtensorMap *map_c, int col0, int row0,
                                                   int e, const float (&d)[BN / 2],
                                                   uint8_t *cbuf, int bar) {
    const int tw = threadIdx.x & 127, w = tw / 32, l = tw & 31;
    const int r0 = 16 * w + l / 4, c0 = 2 * (l & 3);
    const uint32_t base = gg_smem_addr(cbuf);
    if (tw == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        /* column 8j + c0: box j / 8, chunk j % 8, byte 2 * c0 inside the chunk */
        const uint32_t box = base + (j / 8) * GG_BOX_BYTES + 2 * c0;
        OutT lo2[2], hi2[2];
        gg_store2(lo2, d[4 * j], d[4 * j + 1]);
        gg_store2(hi2, d[4 * j + 2], d[4 * j + 3]);
        const uint32_t lo_at = box + r0 * 128 + (((j % 8) ^ (r0 % 8)) << 4);
        const uint32_t hi_at = box + (r0 + 8) * 128 + (((j % 8) ^ ((r0 + 8) % 8)) << 4);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(lo_at), "r"(*(const uint32_t *)lo2)
                     : "memory");
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(hi_at), "r"(*(const uint32_t *)hi2)
                     : "memory");
    }
    /* the generic-proxy writes, visible to the copy engine's reads */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
    if (tw == 0) {
#pragma unroll
        for (int b = 0; b < BN / 64; ++b)
            asm volatile(
                "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
                ::"l"((uint64_t)map_c), "r"(base + b * GG_BOX_BYTES), "r"(col0 + 64 * b),
                "r"(row0), "r"(e)
                : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
}
#endif /* GG_SM90A */

/*
 * The persistent grouped GEMM. Template: BN (tile columns), F16 (fp16 operands, else bf16),
 * B_MN (B tile is MN-major: loaded as 64-wide column chunks), WGRAD (reduction over the expert's
 * rows: A and B both MN-major, output [E, m_static, n_out]), BK (reduction elements per stage:
 * GG_BK, or GG_BK_SHORT in wgrad).
 *   fwd/dgrad: map_a = activation [num_rows, R] (box 64 x 128), map_b = weight [E, *, *] 3-D.
 *   wgrad:     map_a = activation giving the output rows [num_rows, m_static] (box 64 x 64),
 *              map_b = activation giving the output columns, as 3-D [1, num_rows, n_out].
 */
template <int BN, bool F16, bool B_MN, bool WGRAD, int BK = GG_BK>
__global__ void __launch_bounds__(GG_THREADS, 1)
    gg_sm90_kernel(const __grid_constant__ CUtensorMap map_a,
                   const __grid_constant__ CUtensorMap map_b,
                   const __grid_constant__ CUtensorMap map_c, const gg_args_t args) {
    static_assert(BK == GG_BK || (WGRAD && BK == GG_BK_SHORT), "short stages: wgrad only");
#if GG_SM90A
    constexpr int STAGES = GG_STAGES_BK(BN, BK);
    constexpr int A_BYTES = GG_BM * BK * 2;
    constexpr int STAGE_BYTES = GG_STAGE_BYTES_BK(BN, BK);
    /* one MN-major box: BK reduction rows x 128 bytes (64 columns) */
    constexpr int MN_BOX = BK * 128;
    /* the host sizes shared memory without knowing BK (GG_SMEM_BYTES) */
    static_assert(STAGES * STAGE_BYTES == GG_STAGES(BN) * GG_STAGE_BYTES(BN),
                  "every stage depth fills the same ring");
    constexpr int TA = WGRAD ? 1 : 0, TB = B_MN ? 1 : 0;
    __shared__ __align__(8) uint64_t full_bar[STAGES], empty_bar[STAGES];
    __shared__ int64_t s_off[GG_MAX_E + 1];
    __shared__ int s_cum[GG_MAX_E + 1];
    __shared__ int s_sk_flag[2]; /* gg_sk_fixup's arrival order, per consumer warpgroup */
    __shared__ int64_t s_rows[GG_BM]; /* fwd / dgrad gathered: the tile's rows (gg_tile_rows) */
    extern __shared__ uint8_t gg_smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)gg_smem_raw + 1023) & ~(uintptr_t)1023);

    const int E = args.num_experts;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i <= E; i += GG_THREADS)
        s_off[i] = gg_clamp_offset(args.offsets[i], args.num_rows);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            /* gathered: the TMA thread's expect_tx plus one cp.async arrival per producer thread */
            gg_mbar_init(&full_bar[s], args.g_op != GG_GATHER_NONE ? 1 + 128 : 1);
            gg_mbar_init(&empty_bar[s], 8); /* one arrival per consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    int total;
    if constexpr (WGRAD) {
        total = E * args.m_tiles_static * args.n_tiles;
    } else {
        /* tiles of expert e: ceil(rows_e / 128) * n_tiles; one warp scans them 32 at a time */
        if (warp == 0) {
            int carry = 0;
            for (int base = 0; base < E; base += 32) {
                const int e = base + lane;
                int v = 0;
                if (e < E) {
                    int64_t rows = s_off[e + 1] - s_off[e];
                    if (rows < 0) rows = 0;
                    v = (int)((rows + GG_BM - 1) / GG_BM) * args.n_tiles;
                }
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const int y = __shfl_up_sync(0xffffffffu, v, o);
                    if (lane >= o) v += y;
                }
                if (e < E) s_cum[e + 1] = carry + v;
                carry += __shfl_sync(0xffffffffu, v, 31);
            }
            if (lane == 0) s_cum[0] = 0;
        }
        __syncthreads();
        /* broadcast: read from shared memory, total is not known to be warp-uniform, and nor
         * then is the schedule that derives from it, so the consumers would build their wgmma
         * descriptors per thread (and move them to uniform registers before every wgmma) */
        total = __shfl_sync(0xffffffffu, s_cum[E], 0);
    }

    if (warp < 4) {
        /* ---- producer warpgroup: one thread feeds the ring (the copy engine); with a gathered
         * operand all 128 copy its rows, the one thread still issuing the TMA loads ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        const int pt = threadIdx.x, g_op = args.g_op;
        if (pt == 0 || g_op != GG_GATHER_NONE) {
            if (pt == 0) {
                asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_a) : "memory");
                asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_b) : "memory");
            }
            /* the bytes the copy engine brings per stage: all, or the operand not gathered */
            const uint32_t tx = g_op == GG_GATHER_NONE ? STAGE_BYTES
                                : g_op == GG_GATHER_A  ? STAGE_BYTES - A_BYTES
                                                       : A_BYTES;
            int stage = 0, last_e = -1;
            uint32_t phase = 0;
            gg_sched_t sc = gg_sched_make<WGRAD>(args, total);
            int t, kb0, kb1, seg;
            while (gg_sched_next(sc, &t, &kb0, &kb1, &seg)) {
                const gg_tile_t tl = gg_decode<WGRAD, BK>(t, args, s_off, s_cum);
                const int m0 = tl.m_blk * GG_BM, n0 = tl.n_blk * BN;
                const int k_end = kb1 < 0 ? tl.iters : kb1;
                /* wgrad: the expert's own maps, row coordinates inside the expert */
                const CUtensorMap *ma = &map_a, *mb = &map_b;
                int64_t r0 = tl.row0;
                if (WGRAD && args.ex_maps) {
                    ma = args.ex_maps + 2 * tl.e, mb = ma + 1, r0 = 0;
                    if (pt == 0 && tl.e != last_e && k_end > kb0) {
                        /* written by the generic proxy (the maps kernel): acquired by the
                         * tensormap proxy before the copy engine reads them */
                        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;"
                                     ::"l"((uint64_t)ma) : "memory");
                        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;"
                                     ::"l"((uint64_t)mb) : "memory");
                        last_e = tl.e;
                    }
                }
                /* gathered: fwd / dgrad, the tile's source rows; wgrad, the first stage's
                 * indices (each stage then loads the next one's after its copies, so the loads
                 * are in flight while it waits for the next free stage) */
                int64_t src[BK / 16];
#pragma unroll
                for (int q = 0; q < BK / 16; ++q) src[q] = -1;
                if (!WGRAD && g_op == GG_GATHER_A)
                    gg_tile_rows(s_rows, args, tl.row0 + m0 + pt, pt);
                if (WGRAD && g_op != GG_GATHER_NONE && kb0 < k_end)
                    gg_stage_rows<BK>(src, args, tl.row0 + (int64_t)kb0 * BK, tl.row_end, pt);
                for (int kb = kb0; kb < k_end; ++kb) {
                    gg_mbar_wait(&empty_bar[stage], phase ^ 1);
                    uint8_t *sa = smem + stage * STAGE_BYTES, *sb = sa + A_BYTES;
                    uint64_t *fb = &full_bar[stage];
                    if (pt == 0) {
                        gg_mbar_expect_tx(fb, tx);
                        if constexpr (WGRAD) {
                            const int r = (int)(r0 + (int64_t)kb * BK);
                            if (g_op != GG_GATHER_A) {
                                gg_tma_2d(sa, ma, fb, m0, r);
                                gg_tma_2d(sa + MN_BOX, ma, fb, m0 + 64, r);
                            }
                            if (g_op != GG_GATHER_B) {
#pragma unroll
                                for (int i = 0; i < BN / 64; ++i)
                                    gg_tma_3d(sb + i * MN_BOX, mb, fb, n0 + 64 * i, r, 0);
                            }
                        } else {
                            if (g_op == GG_GATHER_NONE)
                                gg_tma_2d(sa, &map_a, fb, kb * GG_BK, (int)(tl.row0 + m0));
                            if constexpr (B_MN) {
#pragma unroll
                                for (int i = 0; i < BN / 64; ++i)
                                    gg_tma_3d(sb + i * GG_BOX_BYTES, &map_b, fb, n0 + 64 * i,
                                              kb * GG_BK, tl.e);
                            } else {
                                gg_tma_3d(sb, &map_b, fb, kb * GG_BK, n0, tl.e);
                            }
                        }
                    }
                    if (g_op != GG_GATHER_NONE) {
                        if constexpr (WGRAD) {
                            if (g_op == GG_GATHER_A)
                                gg_gather_mn<BK>(gg_smem_addr(sa), args, 2, m0, src, pt);
                            else
                                gg_gather_mn<BK>(gg_smem_addr(sb), args, BN / 64, n0, src, pt);
                            if (kb + 1 < k_end)
                                gg_stage_rows<BK>(src, args, tl.row0 + (int64_t)(kb + 1) * BK,
                                                  tl.row_end, pt);
                        } else {
                            gg_gather_k(gg_smem_addr(sa), args, s_rows, kb * GG_BK, pt);
                        }
                        gg_cp_arrive(fb);
                    }
                    if (++stage == STAGES) stage = 0, phase ^= 1;
                }
            }
        }
    } else {
        /* ---- consumer warpgroups: 64 rows each of the 128 x BN tile ---- */
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        /* broadcast from lane 0: the compiler then knows wg is the same across the warp, so
         * the wgmma descriptors below stay in uniform registers */
        const int wg = __shfl_sync(0xffffffffu, (warp - 4) / 4, 0);
        /* the descriptors of stage 0's first k16 step; a stage and a k16 step add their byte
         * offsets / 16 (the ring lies below 256 KB, so the 14-bit address field cannot carry) */
        const uint32_t ring = gg_smem_addr(smem);
        const uint64_t da0 = WGRAD ? gg_desc(ring + wg * MN_BOX, MN_BOX, 1024)
                                   : gg_desc(ring + wg * GG_BOX_BYTES, 16, 1024);
        const uint64_t db0 = B_MN ? gg_desc(ring + A_BYTES, MN_BOX, 1024)
                                  : gg_desc(ring + A_BYTES, 16, 1024);
        int stage = 0, prev_stage = 0;
        uint32_t phase = 0;
        float acc[BN / 2];
        uint8_t *cbuf = smem + STAGES * STAGE_BYTES + wg * GG_W_BYTES(BN);
        gg_sched_t sc = gg_sched_make<WGRAD>(args, total);
        int t, kb0, kb1, seg;
        while (gg_sched_next(sc, &t, &kb0, &kb1, &seg)) {
            const gg_tile_t tl = gg_decode<WGRAD, BK>(t, args, s_off, s_cum);
            const int m0 = tl.m_blk * GG_BM + wg * 64, n0 = tl.n_blk * BN;
            const int k_end = kb1 < 0 ? tl.iters : kb1;
            const int col_lim = args.n_out - n0;
            int64_t ld, off;
            int row_lim;
            if constexpr (WGRAD) {
                ld = args.n_out;
                off = ((int64_t)tl.e * args.m_static + m0) * ld + n0;
                row_lim = args.m_static - m0;
            } else {
                ld = args.ld_out;
                off = (tl.row0 + m0) * ld + n0;
                const int64_t lim = tl.row_end - tl.row0 - m0;
                row_lim = lim > 64 ? 64 : (int)lim;
            }
            /* A half tile wholly past the expert's end still issues its wgmma: skipping it lets
             * the CTAs that share a weight tile run at different speeds and drift apart, so
             * where experts are short (and such half tiles common) the weight, streamed from
             * DRAM, is no longer shared through L2, which costs more than the MMAs saved. */
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
            for (int kb = kb0; kb < k_end; ++kb) {
                gg_mbar_wait(&full_bar[stage], phase);
                /* rows written by cp.async (the generic proxy), read by wgmma (the async proxy) */
                if (args.g_op != GG_GATHER_NONE)
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                if constexpr (WGRAD) {
                    uint8_t *sa = smem + stage * STAGE_BYTES;
                    /* reduction tail: rows past the expert's end must not contribute (with the
                     * expert's own maps the copy engine has zero-filled them) */
                    const int64_t valid64 = tl.row_end - tl.row0 - (int64_t)kb * BK;
                    if (valid64 < BK && !args.ex_maps) {
                        const int valid = (int)valid64, per_box = (BK - valid) * 8;
                        const int n_chunks = (2 + BN / 64) * per_box;
                        for (int i = threadIdx.x - 128; i < n_chunks; i += 256) {
                            const int box = i / per_box, rem = i - box * per_box;
                            *(uint4 *)(sa + box * MN_BOX + valid * 128 + rem * 16) =
                                make_uint4(0, 0, 0, 0);
                        }
                        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                        asm volatile("bar.sync 1, 256;" ::: "memory");
                    }
                }
                gg_fence_acc(acc);
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
                const uint32_t st16 = (uint32_t)(stage * STAGE_BYTES) >> 4;
#pragma unroll
                for (int s = 0; s < BK / 16; ++s) {
                    /* K-major: +32 bytes per k16 inside the swizzled row; MN-major: +16 rows */
                    const uint64_t da = da0 + st16 + (WGRAD ? s * 2048 : s * 32) / 16;
                    const uint64_t db = db0 + st16 + (B_MN ? s * 2048 : s * 32) / 16;
                    gg_wgmma<BN, F16, TA, TB>(acc, da, db);
                }
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                /* one group stays in flight: the previous k block's is done, free its stage */
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                if (kb > kb0 && lane == 0) gg_mbar_arrive(&empty_bar[prev_stage]);
                prev_stage = stage;
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            gg_fence_acc(acc);
            if (k_end > kb0 && lane == 0) gg_mbar_arrive(&empty_bar[prev_stage]);
            if (row_lim <= 0) continue;
            if constexpr (!WGRAD) {
                /* a segment of a split tile: the last to finish sums them and stores the tile */
                if (seg >= 0 &&
                    !gg_sk_fixup<BN>(args, seg, sc.segs, wg, acc, &s_sk_flag[wg], 2 + wg))
                    continue;
            }
            /* epilogue: one rounding to out_dtype, masked stores */
            if (args.out_dtype != MOE_DTYPE_FP32 && (WGRAD || row_lim == 64)) {
                /* wgrad: dW as [E, m_static, n_out]; fwd / dgrad: the output as [1, rows, n_out] */
                const int crow = WGRAD ? m0 : (int)(tl.row0 + m0), ce = WGRAD ? tl.e : 0;
                if (args.out_dtype == MOE_DTYPE_BF16)
                    gg_store_block_tma<BN, __nv_bfloat16>(&map_c, n0, crow, ce, acc, cbuf, 2 + wg);
                else
                    gg_store_block_tma<BN, __half>(&map_c, n0, crow, ce, acc, cbuf, 2 + wg);
                continue;
            }
            if (args.out_dtype != MOE_DTYPE_FP32) {
                /* a block cut by the expert's end: the staged stores, once the copy engine has
                 * read the previous block out of the buffer they reuse */
                if ((threadIdx.x & 127) == 0)
                    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");
            }
            if (args.out_dtype == MOE_DTYPE_BF16)
                gg_store_block_staged<BN>((__nv_bfloat16 *)args.out + off, ld, row_lim, col_lim,
                                          acc, cbuf, 2 + wg);
            else if (args.out_dtype == MOE_DTYPE_FP16)
                gg_store_block_staged<BN>((__half *)args.out + off, ld, row_lim, col_lim, acc,
                                          cbuf, 2 + wg);
            else
                gg_store_block<BN>((float *)args.out + off, ld, row_lim, col_lim, acc);
        }
        /* the last TMA stores must be done before the CTA's shared memory goes away */
        if ((threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
#endif /* GG_SM90A */
}

/* wgrad's expert maps: for each expert e, copies of the whole-buffer maps (tmpl_a: the
 * activation giving the output rows, 2-D; tmpl_b: the one giving the columns, 3-D) re-pointed at
 * the expert's first row and cut to its row count, so the copy engine zero-fills the reduction's
 * tail block past the expert's end. That replaced zeroing it in shared memory, whose generic-
 * proxy writes, proxy fence and barrier between the consumer warpgroups sat between two k blocks
 * of every tile.
 * Offsets are clamped as the GEMM clamps them; an empty expert gets one row (a map's dimensions
 * are at least 1), which its tiles never load.
 * maps: [2E] CUtensorMap, 128-byte aligned; pitch_a / pitch_b: the row strides in bytes. */
__global__ void gg_sm90_expert_maps_kernel(CUtensorMap *maps,
                                           const __grid_constant__ CUtensorMap tmpl_a,
                                           const __grid_constant__ CUtensorMap tmpl_b,
                                           const int64_t *offsets, int num_experts,
                                           int64_t num_rows, const uint8_t *base_a,
                                           int64_t pitch_a, const uint8_t *base_b,
                                           int64_t pitch_b) {
#if GG_SM90A
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= num_experts) return;
    const int64_t lo = gg_clamp_offset(offsets[e], num_rows);
    const int64_t hi = gg_clamp_offset(offsets[e + 1], num_rows);
    const uint32_t rows = hi > lo ? (uint32_t)(hi - lo) : 1u;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        CUtensorMap *m = maps + 2 * e + i;
        *m = i ? tmpl_b : tmpl_a;
        const uint64_t at = (uint64_t)__cvta_generic_to_global(m);
        const uint64_t addr = (uint64_t)(i ? base_b + lo * pitch_b : base_a + lo * pitch_a);
        asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;"
                     ::"l"(at), "l"(addr) : "memory");
        asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], 1, %1;"
                     ::"l"(at), "r"(rows) : "memory");
    }
    asm volatile("fence.proxy.tensormap::generic.release.gpu;" ::: "memory");
#endif
}

/* Rows [offsets[E], num_rows) of a fwd/dgrad output belong to no expert: zero them, 16 bytes per
 * thread (row_bytes is a multiple of 16 and the output 16-byte aligned, checked on the host). */
__global__ void gg_sm90_zero_tail_kernel(uint4 *out, const int64_t *offsets, int num_experts,
                                         int64_t num_rows, int64_t row_chunks) {
    int64_t end = offsets[num_experts];
    if (end < 0) end = 0;
    for (int64_t i = end * row_chunks + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
         i < num_rows * row_chunks; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = make_uint4(0, 0, 0, 0);
}

/* ------------------------------------------------------------------------------------------
 * Host side
 * ---------------------------------------------------------------------------------------- */

typedef CUresult (*gg_encode_fn_t)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                   const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                   const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda link). */
static gg_encode_fn_t gg_encode_fn(void) {
    static gg_encode_fn_t fn = NULL;
    if (!fn) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                             cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (gg_encode_fn_t)p;
        else
            (void)cudaGetLastError();
    }
    return fn;
}

/* cuTensorMapEncodeTiled is a driver call and needs a current context. The runtime makes the
 * device's primary context current on a thread only at that thread's first call that needs one
 * (a launch, an allocation, cudaSetDevice), so on a thread whose first CUDA work is this GEMM
 * (autograd's device thread when a backward starts with a gathered GEMM) the encode would fail
 * and the call be declined. cudaSetDevice makes the context current; once per thread and device,
 * since the current device is all that can change it for a runtime user. 1 when done. */
static int gg_bind_context(int dev) {
    static thread_local int bound = -1;
    if (bound == dev) return 1;
    if (cudaSetDevice(dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    bound = dev;
    return 1;
}

/* 16-bit tensor [dim2][dim1][dim0] (dim0 contiguous) with a box [box2=1][box1][64], 128-byte
 * swizzle, out-of-bounds elements zero-filled. rank 2 drops dim2. */
static int gg_make_map(CUtensorMap *map, const void *ptr, moe_dtype_t dt, int rank, uint64_t dim0,
                       uint64_t dim1, uint64_t dim2, uint32_t box1) {
    gg_encode_fn_t enc = gg_encode_fn();
    if (!enc) return 0;
    const cuuint64_t dims[3] = {dim0, dim1, dim2};
    const cuuint64_t strides[2] = {dim0 * 2, dim0 * dim1 * 2};
    const cuuint32_t box[3] = {64, box1, 1};
    const cuuint32_t estr[3] = {1, 1, 1};
    const CUtensorMapDataType t =
        dt == MOE_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return enc(map, t, (cuuint32_t)rank, (void *)ptr, dims, strides, box, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
           CUDA_SUCCESS;
}

typedef void (*gg_kernel_t)(CUtensorMap, CUtensorMap, CUtensorMap, gg_args_t);

/* 1 when `k` holds sm_90a code for the current device: the real kernel reports sm_90 binary
 * code and static shared memory (its barriers and schedule); the empty fallback has none. -1 when
 * the runtime could not say. */
static int gg_kernel_real(const void *k) {
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, k) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return attr.binaryVersion == 90 && attr.sharedSizeBytes > 0;
}

/* Every instantiation is compiled under the same flags, so one kernel answers for all of them,
 * once per device (moe_device_flag): a GEMM call asks several times (sizes, workspace,
 * dispatch), and each cudaFuncGetAttributes costs microseconds of host time. */
static int gg_ask_compiled(int dev) {
    (void)dev; /* the current device, which cudaFuncGetAttributes answers for */
    return gg_kernel_real((const void *)gg_sm90_kernel<256, false, false, false>);
}

extern "C" int moe_cuda_gg_sm90_compiled(void) {
    static int by_device[MOE_MAX_DEVICES];
    return moe_device_flag(by_device, gg_ask_compiled);
}

/* The split last wave (gg_sched_make): reductions of at least GG_SK_MIN_ITERS k blocks (shorter
 * tiles make a short last wave), segments of at least GG_SK_MIN_SEG. The gg_split_tail switch
 * (tuning.h) turns it off, or on at every length with segments down to one k block (tests). */
#define GG_SK_MIN_ITERS 64
#define GG_SK_MIN_SEG 16
static void gg_sk_options(int split_tail, int *min_iters, int *min_seg) {
    *min_iters = GG_SK_MIN_ITERS, *min_seg = GG_SK_MIN_SEG;
    if (split_tail == MOE_TUNING_SPLIT_NEVER) *min_iters = -1;
    if (split_tail == MOE_TUNING_SPLIT_ALWAYS) *min_iters = 1, *min_seg = 1;
}

/* 1 when a fwd/dgrad over `red` reduction elements may split its last wave (into >= 2 segments)
 * under the split_tail setting */
static int gg_sk_may_split(int split_tail, int64_t red) {
    int min_iters, min_seg;
    gg_sk_options(split_tail, &min_iters, &min_seg);
    const int64_t iters = (red + GG_BK - 1) / GG_BK;
    return min_iters >= 0 && iters >= min_iters && iters / min_seg >= 2;
}

/* The split wave's workspace for a grid of G CTAs: 2G ints (per split tile and consumer
 * warpgroup an arrival count), then 2G partials of 64 x bn fp32. */
static size_t gg_sk_sync_bytes(int64_t G) { return ((size_t)G * 2 * sizeof(int) + 255) / 256 * 256; }
static size_t gg_sk_bytes(int64_t G, int bn) {
    return gg_sk_sync_bytes(G) + (size_t)G * 2 * 64 * bn * sizeof(float);
}

/* wgrad's expert maps (gg_sm90_expert_maps_kernel): two per expert, 128-byte aligned inside the
 * workspace. The gg_expert_maps switch (tuning.h) turns them off (tests, benchmarks). */
static size_t gg_xmap_bytes(int64_t E) { return (size_t)E * 2 * sizeof(CUtensorMap) + 128; }

extern "C" size_t moe_cuda_gg_sm90_workspace_size(const moe_grouped_gemm_params_t *p) {
    if (!p || (p->dtype != MOE_DTYPE_BF16 && p->dtype != MOE_DTYPE_FP16)) return 0;
    if (!moe_cuda_gg_sm90_compiled()) return 0;
    int dev = 0, major = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (major != 9) return 0;
    /* fwd reduces over K, dgrad over N; wgrad takes the expert maps. The split wave's room is
     * there whenever some setting of the switch could split (MOE_TUNING_SPLIT_ALWAYS, the widest),
     * so the size does not depend on the environment. */
    const size_t x = gg_xmap_bytes(p->num_experts);
    if (!gg_sk_may_split(MOE_TUNING_SPLIT_ALWAYS, p->in_features) &&
        !gg_sk_may_split(MOE_TUNING_SPLIT_ALWAYS, p->out_features))
        return x;
    const size_t sk = gg_sk_bytes(sms, 256);
    return sk > x ? sk : x;
}

typedef enum { GG_FWD = 0, GG_DGRAD = 1, GG_WGRAD = 2 } gg_op_t;

template <int BN, bool F16>
static gg_kernel_t gg_pick(int b_mn, int wgrad, int bk) {
    if (wgrad)
        return bk == GG_BK_SHORT ? gg_sm90_kernel<BN, F16, true, true, GG_BK_SHORT>
                                 : gg_sm90_kernel<BN, F16, true, true>;
    return b_mn ? gg_sm90_kernel<BN, F16, true, false> : gg_sm90_kernel<BN, F16, false, false>;
}

/* Tile width BN: 128 x 256 tiles, since m64n256 wgmmas move the fewest operand bytes per flop
 * through shared memory (narrower tiles pay that back and more; docs/perf-history.md,
 * tools/gg_sm90_check.py); 128 x 128 when the output is narrow or 256-wide tiles would leave SMs
 * idle. The gg_tile switch (tuning.h) forces one (tests, benchmarks). */
static int gg_choose_bn(int forced, int64_t n_out, int64_t tiles_256, int sms) {
    if (forced == 128 || forced == 256) return forced;
    if (n_out <= 128) return 128;
    if (tiles_256 < sms) return 128;
    return 256;
}

/* wgrad's reduction per stage: 32 rows when the experts average at most GG_SHORT_ROWS rows (the
 * mean, num_rows / E, is known on the host; the offsets are not read), else 64. The gg_wgrad_bk
 * switch (tuning.h) forces one (tests, benchmarks). */
static int gg_wgrad_bk(int forced, int64_t rows, int64_t E) {
    if (forced == GG_BK_SHORT || forced == GG_BK) return forced;
    return rows <= GG_SHORT_ROWS * E ? GG_BK_SHORT : GG_BK;
}

/* 1 when the sizes and dtypes of a call are ones the sm90 kernels take (TMA: 16-byte row strides;
 * int32 coordinates; the schedule fits shared memory; a gathered operand's source of fewer than
 * 2^31 rows): everything but the pointers' alignment, which only the call knows. */
static int gg_sm90_sizes_ok(const moe_grouped_gemm_params_t *p) {
    const moe_dtype_t dt = p->dtype, odt = p->out_dtype;
    if (dt != MOE_DTYPE_BF16 && dt != MOE_DTYPE_FP16) return 0;
    if (odt != MOE_DTYPE_BF16 && odt != MOE_DTYPE_FP16 && odt != MOE_DTYPE_FP32) return 0;
    const int64_t rows = p->num_rows, E = p->num_experts, K = p->in_features,
                  N = p->out_features;
    if (rows <= 0 || K <= 0 || N <= 0 || E < 1 || E > GG_MAX_E) return 0;
    if (K % 8 || N % 8) return 0;
    if (rows >= ((int64_t)1 << 31) - 4096 || E * N >= ((int64_t)1 << 31) ||
        E * K >= ((int64_t)1 << 31) || K >= ((int64_t)1 << 30) || N >= ((int64_t)1 << 30))
        return 0;
    if (p->gather_operand != MOE_GG_GATHER_NONE &&
        (p->gather_rows < 1 || p->gather_rows >= ((int64_t)1 << 31)))
        return 0;
    return 1;
}

extern "C" int moe_cuda_gg_sm90_takes(const moe_grouped_gemm_params_t *p) {
    if (!p || !gg_sm90_sizes_ok(p) || !moe_cuda_gg_sm90_compiled()) return 0;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return major == 9;
}

static moe_status_t gg_sm90_run(gg_op_t op, void *out, const void *act_a, const void *other,
                                const int64_t *offsets, const moe_grouped_gemm_params_t *p,
                                void *workspace, size_t workspace_bytes, void *stream) {
    moe_clear_error();
    if (!p || !gg_sm90_sizes_ok(p)) return MOE_ERR_UNSUPPORTED;
    const moe_tuning_t tune = moe_tuning_get();
    const moe_dtype_t dt = p->dtype, odt = p->out_dtype;
    const int64_t rows = p->num_rows, E = p->num_experts, K = p->in_features,
                  N = p->out_features;
    const int tw = p->trans_w != 0;
    if (((uintptr_t)out | (uintptr_t)act_a | (uintptr_t)other) & 15) return MOE_ERR_UNSUPPORTED;
    if (!offsets) return MOE_ERR_UNSUPPORTED;
    if (!moe_cuda_gg_sm90_compiled()) return MOE_ERR_UNSUPPORTED;

    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        !gg_bind_context(dev)) {
        (void)cudaGetLastError();
        return MOE_ERR_UNSUPPORTED;
    }

    /* The product as D[m, n] = sum_r A[m, r] B[n, r]:
     *   fwd   tw=1: A = x [rows, K], B = W_e [N, K] (K-major)     out [rows, N]
     *         tw=0: A = x,           B = W_e [K, N] (MN-major)    out [rows, N]
     *   dgrad tw=1: A = dy [rows, N], B = W_e [N, K] (MN-major)   out [rows, K]
     *         tw=0: A = dy,           B = W_e [K, N] (K-major)    out [rows, K]
     *   wgrad tw=1: A = dy_e^T, B = x_e^T (both MN-major)         out [E, N, K]
     *         tw=0: A = x_e^T,  B = dy_e^T                        out [E, K, N] */
    int64_t n_out, red = 0, m_static = 0, a_cols;
    int b_mn = 0;
    const void *a_ptr = act_a, *b_ptr = other;
    if (op == GG_FWD) {
        n_out = N, red = K, a_cols = K, b_mn = !tw;
    } else if (op == GG_DGRAD) {
        n_out = K, red = N, a_cols = N, b_mn = tw;
    } else {
        /* act_a = x, other = dy: output rows come from dy (tw=1) or x (tw=0) */
        a_ptr = tw ? other : act_a;
        b_ptr = tw ? act_a : other;
        m_static = tw ? N : K;
        n_out = tw ? K : N;
        a_cols = m_static;
        b_mn = 1;
    }

    const int64_t n_tiles_256 = (n_out + 255) / 256;
    int64_t tiles_256;
    if (op == GG_WGRAD)
        tiles_256 = E * ((m_static + GG_BM - 1) / GG_BM) * n_tiles_256;
    else
        tiles_256 = (rows / GG_BM + E) * n_tiles_256; /* upper bound */
    const int bn = gg_choose_bn(tune.gg_tile, n_out, tiles_256, sms);
    const int64_t n_tiles = (n_out + bn - 1) / bn;
    const int64_t m_tiles_static = (m_static + GG_BM - 1) / GG_BM;
    const int64_t tiles_bound =
        op == GG_WGRAD ? E * m_tiles_static * n_tiles : (rows / GG_BM + E) * n_tiles;
    if (tiles_bound >= ((int64_t)1 << 31) - 65536) return MOE_ERR_UNSUPPORTED;

    /* The gathered operand (see gg_gather_k / gg_gather_mn): x is A in fwd and in wgrad with
     * tw = 0, B in wgrad with tw = 1; dy is A in dgrad and in wgrad with tw = 1. Its tensor map
     * spans the source's rows; the copy engine never loads through it. */
    int g_op = GG_GATHER_NONE;
    if (p->gather_operand != MOE_GG_GATHER_NONE) {
        const int gx = p->gather_operand == MOE_GG_GATHER_X;
        if (op == GG_FWD) g_op = gx ? GG_GATHER_A : -1;
        else if (op == GG_DGRAD) g_op = gx ? -1 : GG_GATHER_A;
        else g_op = (gx == tw) ? GG_GATHER_B : GG_GATHER_A;
        if (g_op < 0 || !p->gather_index || ((uintptr_t)p->gather_index & 7))
            return MOE_ERR_UNSUPPORTED;
    }
    const uint64_t rows_a = g_op == GG_GATHER_A ? (uint64_t)p->gather_rows : (uint64_t)rows;
    const uint64_t rows_b = g_op == GG_GATHER_B ? (uint64_t)p->gather_rows : (uint64_t)rows;

    const int bk = op == GG_WGRAD ? gg_wgrad_bk(tune.gg_wgrad_bk, rows, E) : GG_BK;
    CUtensorMap map_a, map_b;
    int ok;
    if (op == GG_WGRAD) {
        /* both MN-major: boxes of bk expert rows x 64 columns */
        ok = gg_make_map(&map_a, a_ptr, dt, 2, (uint64_t)a_cols, rows_a, 1, bk) &&
             gg_make_map(&map_b, b_ptr, dt, 3, (uint64_t)n_out, rows_b, 1, bk);
    } else {
        ok = gg_make_map(&map_a, a_ptr, dt, 2, (uint64_t)a_cols, rows_a, 1, GG_BM);
        /* weight as [E, R, C]: tw=1 [E, N, K], tw=0 [E, K, N] */
        const uint64_t wc = tw ? K : N, wr = tw ? N : K;
        const uint32_t box_b = b_mn ? 64 : bn;
        ok = ok && gg_make_map(&map_b, b_ptr, dt, 3, wc, wr, (uint64_t)E, box_b);
    }
    /* A 16-bit output: the epilogue's TMA stores write through map_c, dW as [E, m_static, n_out]
     * in wgrad (the copy engine clips each box at the expert's m_static rows), y / dx as
     * [1, rows, n_out] in fwd/dgrad; for fp32 outputs map_c is not read */
    CUtensorMap map_c = map_a;
    if (ok && odt != MOE_DTYPE_FP32) {
        const int wg = op == GG_WGRAD;
        ok = gg_make_map(&map_c, out, odt, 3, (uint64_t)n_out, (uint64_t)(wg ? m_static : rows),
                         (uint64_t)(wg ? E : 1), 64);
    }
    if (!ok) return MOE_ERR_UNSUPPORTED;

    gg_args_t args;
    args.out = out;
    args.offsets = offsets;
    args.num_experts = (int)E;
    args.out_dtype = (int)odt;
    args.n_out = (int)n_out;
    args.m_static = (int)m_static;
    args.red_iters = (int)((red + GG_BK - 1) / GG_BK);
    args.n_tiles = (int)n_tiles;
    args.m_tiles_static = (int)m_tiles_static;
    args.ld_out = n_out;
    args.num_rows = rows;
    args.g_op = g_op;
    args.g_src = (const uint8_t *)(g_op == GG_GATHER_A ? a_ptr : b_ptr);
    args.g_idx = p->gather_index;
    args.g_rows = p->gather_rows;
    args.g_cols = (int)(g_op == GG_GATHER_A ? a_cols : n_out);
    args.g_ld = (int64_t)args.g_cols * 2;

    const int wgrad = op == GG_WGRAD, f16 = dt == MOE_DTYPE_FP16;
    gg_kernel_t k;
    if (bn == 256)
        k = f16 ? gg_pick<256, true>(b_mn, wgrad, bk) : gg_pick<256, false>(b_mn, wgrad, bk);
    else
        k = f16 ? gg_pick<128, true>(b_mn, wgrad, bk) : gg_pick<128, false>(b_mn, wgrad, bk);
    const int smem = GG_SMEM_BYTES(bn);
    if (cudaFuncSetAttribute((const void *)k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem) != cudaSuccess) {
        (void)cudaGetLastError();
        return MOE_ERR_UNSUPPORTED;
    }
    /* the split last wave (fwd/dgrad): a CTA per SM, since with fewer tiles than SMs the idle
     * ones take segments too */
    const int sk_ok = op != GG_WGRAD && gg_sk_may_split(tune.gg_split_tail, red) && workspace &&
                      workspace_bytes >= gg_sk_bytes(sms, bn);
    const int grid = sk_ok ? sms : (int)(tiles_bound < sms ? tiles_bound : sms);
    cudaStream_t s = (cudaStream_t)stream;
    args.sk_sync = NULL;
    args.sk_part = NULL;
    args.ex_maps = NULL;
    if (op == GG_WGRAD && grid > 0 && workspace && workspace_bytes >= gg_xmap_bytes(E) &&
        tune.gg_expert_maps) {
        CUtensorMap *maps = (CUtensorMap *)(((uintptr_t)workspace + 127) & ~(uintptr_t)127);
        gg_sm90_expert_maps_kernel<<<(unsigned)((E + 127) / 128), 128, 0, s>>>(
            maps, map_a, map_b, offsets, (int)E, rows, (const uint8_t *)a_ptr, a_cols * 2,
            (const uint8_t *)b_ptr, n_out * 2);
        MOE_CHECK_LAUNCH("gg_sm90_expert_maps_kernel");
        args.ex_maps = maps;
    }
    int sk_min_iters;
    gg_sk_options(tune.gg_split_tail, &sk_min_iters, &args.sk_min_seg);
    if (sk_ok) {
        args.sk_sync = (int *)workspace;
        args.sk_part = (float *)((char *)workspace + gg_sk_sync_bytes(grid));
        if (cudaMemsetAsync(workspace, 0, (size_t)grid * 2 * sizeof(int), s) != cudaSuccess)
            return moe_fail(MOE_ERR_CUDA, "grouped_gemm: cudaMemsetAsync of the split "
                            "wave's counters failed: %s", cudaGetErrorString(cudaGetLastError()));
    }
    if (grid > 0) {
        k<<<grid, GG_THREADS, smem, s>>>(map_a, map_b, map_c, args);
        MOE_CHECK_LAUNCH("gg_sm90_kernel");
    }
    if (op != GG_WGRAD) {
        const int esize = odt == MOE_DTYPE_FP32 ? 4 : 2;
        const int64_t row_chunks = n_out * esize / 16;
        const int64_t chunks = rows * row_chunks;
        int64_t blocks = (chunks + 255) / 256;
        if (blocks > 2 * (int64_t)sms) blocks = 2 * (int64_t)sms;
        gg_sm90_zero_tail_kernel<<<(unsigned)blocks, 256, 0, s>>>((uint4 *)out, offsets, (int)E,
                                                                  rows, row_chunks);
        MOE_CHECK_LAUNCH("gg_sm90_zero_tail_kernel");
    }
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_gg_sm90_fwd(void *y, const void *x, const void *weight,
                                             const int64_t *expert_offsets,
                                             const moe_grouped_gemm_params_t *params,
                                             void *workspace, size_t workspace_bytes,
                                             void *stream) {
    return gg_sm90_run(GG_FWD, y, x, weight, expert_offsets, params, workspace, workspace_bytes,
                       stream);
}

extern "C" moe_status_t moe_cuda_gg_sm90_dgrad(void *grad_x, const void *grad_y,
                                               const void *weight, const int64_t *expert_offsets,
                                               const moe_grouped_gemm_params_t *params,
                                               void *workspace, size_t workspace_bytes,
                                               void *stream) {
    return gg_sm90_run(GG_DGRAD, grad_x, grad_y, weight, expert_offsets, params, workspace,
                       workspace_bytes, stream);
}

extern "C" moe_status_t moe_cuda_gg_sm90_wgrad(void *grad_weight, const void *x,
                                               const void *grad_y, const int64_t *expert_offsets,
                                               const moe_grouped_gemm_params_t *params,
                                               void *workspace, size_t workspace_bytes,
                                               void *stream) {
    return gg_sm90_run(GG_WGRAD, grad_weight, x, grad_y, expert_offsets, params, workspace,
                       workspace_bytes, stream);
}
