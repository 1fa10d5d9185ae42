/*
 * tuning.h: every run-time tuning switch of moe-core, in one struct read once from the
 * environment.
 *
 * A switch picks between kernels or launch shapes that compute the same results (bit for bit
 * unless a field says otherwise); none changes what an op means, and none changes a workspace
 * size (a size function covers every setting). The defaults are the measured best; the other
 * settings exist so that tests reach every path on one machine and A/B tools can time one
 * against another (tools/, benchmarks/bench_grouped_gemm.py --variant; the measurements are in
 * docs/perf-history.md).
 *
 * The one idea: the environment is read once, on the first call of moe_tuning_get() from any
 * thread (C11 call_once), and never again by an op; moe_tuning_reload() reads it again on request,
 * for tests and tools that change a switch inside one process. Each field is stored atomically,
 * so a reload is never a data race, but an op already running may still see the old values.
 *
 * The README's "Tuning switches" table lists the same switches for users.
 */
#ifndef MOE_CORE_TUNING_H_
#define MOE_CORE_TUNING_H_

#ifdef __cplusplus
extern "C" {
#endif

/* cpu_gemm_kernel */
#define MOE_TUNING_GEMM_AUTO 0    /* by the CPU's features (default) */
#define MOE_TUNING_GEMM_GENERIC 1 /* MOE_CORE_GEMM_KERNEL=generic */
#define MOE_TUNING_GEMM_AVX512 2  /* MOE_CORE_GEMM_KERNEL=avx512 */

/* gg_split_tail */
#define MOE_TUNING_SPLIT_NEVER 0  /* MOE_GG_SM90_SPLIT_TAIL=0 */
#define MOE_TUNING_SPLIT_AUTO 1   /* unset or any other value (default) */
#define MOE_TUNING_SPLIT_ALWAYS 2 /* MOE_GG_SM90_SPLIT_TAIL=1 */

/* expert_copy_rows */
#define MOE_TUNING_COPY_NEVER 0  /* MOE_CORE_EXPERT_COPY_ROWS=0 */
#define MOE_TUNING_COPY_AUTO 1   /* unset or any other value (default) */
#define MOE_TUNING_COPY_ALWAYS 2 /* MOE_CORE_EXPERT_COPY_ROWS=1 */

/** The switches, one field each: the environment variable, its values, the default, the trade. */
typedef struct moe_tuning {
    /** MOE_CORE_GEMM_KERNEL: the CPU grouped GEMM's micro-kernel (csrc/grouped_gemm.c).
     * MOE_TUNING_GEMM_AUTO (default): AVX-512 FMA where the CPU has it, and bf16 pairs through
     * AVX512_BF16's dot product where it has that too (the FMA kernel's bits on normal numbers;
     * bf16 subnormal inputs flushed), else the portable fp32 loop. "generic" forces the portable
     * loop (a multiply and an add where the others fuse them: other bits, within the same bound),
     * "avx512" the fp32 AVX-512 kernel for every dtype. The switch lets the tests cover each
     * kernel on one machine. */
    int cpu_gemm_kernel;
    /** MOE_CORE_PDL: programmatic dependent launch between the kernels of one op on sm_90+
     * (csrc/cuda/cuda_common.cuh). 1 (default): a kernel's blocks start while the previous
     * kernel finishes and do their input-only work early, which hides the launch gaps. 0 (any
     * value starting with 0): ordinary launches, as before sm_90; slower, but a profiler's
     * timeline then shows each kernel's own time. Same bits. */
    int pdl;
    /** MOE_CORE_ROUTER_LANES: the fused fp32 router kernel for rows of 33-256 experts
     * (csrc/cuda/router_topk_lanes.cu). 1 (default): the lanes kernel (a lane holds neighbouring
     * experts, a group is a run of lanes, the top-k a threshold), fewer instructions per token
     * than the strided kernel at those widths. 0 (a value starting with 0): the strided kernel,
     * which also serves every row the lanes kernel does not take (up to 32 experts, odd group
     * shapes, topk > 127, 257-1024 experts), so the tests run both on every width. Same bits. */
    int router_lanes;
    /** MOE_CORE_UNPERMUTE_SLOTS: the token → rows map of unpermute's forward gathers (the
     * combine, permute's backward without probs, unpermute's backward without probs;
     * csrc/cuda/layout.cu). 1 (default): a [tokens, 16] slots table, one short kernel to
     * build. 0 (a value starting with 0): the CSR that the backwards with probs use (five short
     * kernels to build); the tests run both. Same bits. */
    int unpermute_slots;
    /** MOE_GG_SM90_SPLIT_TAIL: the split of a partial last wave of output tiles along the
     * reduction in the sm90 fwd / dgrad (csrc/cuda/grouped_gemm_sm90.cu, gg_sched_make).
     * MOE_TUNING_SPLIT_AUTO (default): split when the last wave holds at most half the SMs'
     * tiles, the reduction is at least 64 k blocks long and each segment at least 16, so the
     * otherwise idle SMs share the last tiles. NEVER (=0): never split. ALWAYS (=1): split at
     * every reduction length, segments down to one k block (tests). A split tile sums its
     * segments' fp32 partials in k order: reproducible, but not the unsplit tile's bits. */
    int gg_split_tail;
    /** MOE_GG_SM90_EXPERT_MAPS: how the sm90 wgrad stops each expert's reduction at its last
     * row. 1 (default): per-expert tensor maps built on the device from the offsets, so the copy
     * engine zero-fills the rows past the expert's end. 0 (exactly "0"): whole-buffer maps, the
     * consumers zero those rows in shared memory (what a call without workspace does anyway);
     * slower by the zeroing's barrier in every tile. Same bits. */
    int gg_expert_maps;
    /** MOE_GG_SM90_TILE: the sm90 output tile width (gg_choose_bn). 0 (default): 128 x 256,
     * or 128 x 128 when the output is at most 128 wide or 256-wide tiles would leave SMs idle.
     * 128 or 256 forces one. Each width has its own bits. */
    int gg_tile;
    /** MOE_GG_SM90_WGRAD_BK: the expert rows per pipeline stage in the sm90 wgrad (gg_wgrad_bk).
     * 0 (default): 32 when the experts average at most 256 rows (twice the stages in flight for
     * short reductions), else 64 (half the barrier and wgmma-group overhead per flop). 32 or 64
     * forces one. Same bits. */
    int gg_wgrad_bk;
    /** MOE_CORE_EXPERT_COPY_ROWS: expert_mlp with the rows read by index (moe_core/ops/
     * expert_mlp.py, the one reader of this field). Where the rows would be a GEMM's gathered
     * operand (fc1's input, fc2's output gradient in its dgrad, fc1's input in dW1), copy them
     * first into a transient buffer (unpermute's row-copy kernel) and run the GEMM on it, but only
     * where that buffer stays below the step's own peak (the weight gradients the backward makes).
     * MOE_TUNING_COPY_AUTO (default): on CUDA, for GEMMs at least 2048 outputs wide, where the
     * copy costs less than the Hopper producer threads' gathered loads; never on the CPU, whose
     * GEMM gathers at no cost. NEVER (=0): always gather. ALWAYS (=1): copy wherever it fits, on
     * every device (tests). Same bits (the copied rows are the gathered ones). */
    int expert_copy_rows;
} moe_tuning_t;

/** The switches as read from the environment at the first call in the process (or the last
 * moe_tuning_reload()). Thread-safe; cheap enough to call at every op. */
moe_tuning_t moe_tuning_get(void);

/** Reads the environment again (moe_tuning_get() then returns the new values). For tests and A/B
 * tools that change a switch between calls; an op running on another thread at the same time may
 * see either value. */
void moe_tuning_reload(void);

#ifdef __cplusplus
}
#endif

#endif /* MOE_CORE_TUNING_H_ */
