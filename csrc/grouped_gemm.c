/*
 * grouped_gemm.c: the experts' GEMMs on the CPU (forward, dgrad, wgrad) over per-expert row ranges.
 *
 * All three products of every expert are one strided problem, C[m, n] = Σ_p A(i, p) · B(p, j)
 * with A(i, p) = a[i·a_rs + p·a_cs] and B(p, j) = b[p·b_rs + j·b_cs]: the transposes of dgrad,
 * wgrad and the two weight layouts are just stride choices. That problem is cut into output tiles
 * of MC × NC, spread over threads by (expert, tile) so that every output element has one writer.
 *
 * The one clever idea is where the dtype goes: operand blocks are *packed*, once per block, from
 * bf16 / fp16 / fp32 (any strides) into contiguous fp32 micro-panels, and the output is narrowed
 * once from an fp32 tile buffer. So the dtype switch and the transposes live only in the O(n²)
 * packing and store loops, and the O(n³) micro-kernel is a single dtype-free, stride-free fp32 loop
 * (AVX-512 FMA where the CPU has it, picked at run time, so the build needs no -march flag).
 * bf16 on a CPU with AVX512_BF16 goes one step further: pairs stay bf16 and the dot-product
 * instruction does the widening, in an order chosen to give the FMA kernel's exact bits.
 *
 * Summation order: each output element is one running fp32 sum in ascending p (the C tile keeps
 * the partial sum between K blocks), so neither the blocking nor the thread count changes a bit.
 */
#include <stdlib.h>

#include "common.h"
#include "glu_probs_math.h" /* moe_gp_check_args: glu_probs' own check */
#include "tuning.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOE_GG_X86 1
#include <immintrin.h>
#endif

/* Micro-tile MR × NR (16 zmm accumulators on AVX-512). One B micro-panel (KC × NR fp32 = 16 KiB)
 * stays in L1; the packed A and B blocks (128 KiB each) and the fp32 C tile (256 KiB) share a
 * 1 MiB L2. Large MC/NC matter more than cache tightness: every (MC × NC) tile repacks its A and
 * B blocks, so bigger tiles convert fewer elements per multiply-add. */
#define MR 8
#define NR 32
#define MC 256
#define NC 256
#define KC 128

/* Floats of one thread's scratch: packed A, packed B, the fp32 C tile; a multiple of 16 floats
 * (64 bytes), so every thread's slice starts on its own cache line. */
#define THREAD_FLOATS ((int64_t)MC * KC + (int64_t)KC * NC + (int64_t)MC * NC)
#define ALIGN_BYTES 64

typedef enum { GG_FWD = 0, GG_DGRAD = 1, GG_WGRAD = 2 } gg_kind_t;

/* One expert's product, pointers already at its first row / its weight. A gathered operand
 * (params->gather_operand) instead points at its source tensor's base, and its rows are read
 * through gidx (already at the expert's first row; -1 a zero row): for A either along i (fwd /
 * dgrad: A's rows are the gathered rows, a_rs the source row stride, a_cs = 1) or along p (wgrad,
 * where the reduction runs over rows: a_cs the source row stride, a_rs = 1); for B only along p
 * (wgrad: b_rs the source row stride, b_cs = 1). */
typedef struct {
    const char *a;
    int64_t a_rs, a_cs;
    const char *b;
    int64_t b_rs, b_cs;
    char *c;
    int64_t ldc;
    int64_t m, n, k;
    const int64_t *a_gidx; /* NULL: A is plain strided */
    int a_gather_p;        /* 1: a_gidx maps p (wgrad); 0: it maps i (fwd / dgrad) */
    const int64_t *b_gidx; /* NULL: B is plain strided; else it maps p (wgrad) */
} gg_problem_t;

typedef void (*gg_kernel_fn)(int64_t kc, const float *a, const float *b, float *c);
/* bf16 pairs: kp = ceil(kc / 2) packed words, each two consecutive p of one row / column */
typedef void (*gg_pair_kernel_fn)(int64_t kp, const uint32_t *a, const uint32_t *b, float *c);

typedef struct {
    gg_kernel_fn f32;        /* fp32 panels: every dtype */
    gg_pair_kernel_fn bf16;  /* bf16 pair panels, or NULL where the CPU has no AVX512_BF16 */
} gg_kernels_t;

/* ---- packing: dtype conversion and transposition happen here, and only here ---------------- */

static inline float ld_fp32(float v) { return v; }
static inline float ld_bf16(uint16_t v) { return moe_bf16_to_float(v); }
/* Exact fp16 → fp32 without branches (moe_fp16_to_float branches on the exponent, which keeps
 * the packing loop scalar, so fp16 would pack far slower than bf16): rebias the exponent; for
 * inf/NaN rebias once more; for zeros/subnormals make a normal number 2^-14 too large and
 * subtract 2^-14 (exact: the result is a normal fp32). Masks, not branches, so the loop
 * vectorises. */
static inline float ld_fp16(uint16_t v) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = (uint32_t)(v & 0x7fffu) << 13;
    const uint32_t exp = o & shifted_exp;
    const uint32_t is_special = 0u - (uint32_t)(exp == shifted_exp); /* all ones or zero */
    const uint32_t is_small = 0u - (uint32_t)(exp == 0);
    o += ((uint32_t)(127 - 15) << 23) + (is_special & (112u << 23)) + (is_small & (1u << 23));
    const float f = moe_bits_to_float(o) - moe_bits_to_float(is_small & 0x38800000u); /* 2^-14 */
    return moe_bits_to_float(moe_float_to_bits(f) | ((uint32_t)(v & 0x8000u) << 16));
}

/* A block (mc × kc at a) → MR-row micro-panels, p-major: dst[r·kc + p·MR + ii]; rows past mc are
 * zero so the kernel never needs a tail case. The loop order follows whichever stride is 1. */
#define DEFINE_PACK_A(NAME, T)                                                                   \
    static void pack_a_##NAME(float *restrict dst, const T *restrict a, int64_t rs, int64_t cs, \
                              int64_t mc, int64_t kc) {                                         \
        for (int64_t r = 0; r < mc; r += MR) {                                                   \
            const int64_t mr = mc - r < MR ? mc - r : MR;                                        \
            float *d = dst + r * kc;                                                             \
            if (cs == 1) {                                                                       \
                for (int64_t ii = 0; ii < mr; ++ii) {                                            \
                    const T *src = a + (r + ii) * rs;                                            \
                    for (int64_t p = 0; p < kc; ++p) d[p * MR + ii] = ld_##NAME(src[p]);         \
                }                                                                                \
                for (int64_t ii = mr; ii < MR; ++ii)                                             \
                    for (int64_t p = 0; p < kc; ++p) d[p * MR + ii] = 0.0f;                      \
            } else {                                                                             \
                for (int64_t p = 0; p < kc; ++p) {                                               \
                    const T *src = a + p * cs + r * rs;                                          \
                    for (int64_t ii = 0; ii < mr; ++ii) d[p * MR + ii] = ld_##NAME(src[ii * rs]); \
                    for (int64_t ii = mr; ii < MR; ++ii) d[p * MR + ii] = 0.0f;                  \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

/* B block (kc × nc at b) → NR-column micro-panels: dst[jr·kc + p·NR + jj], zero past nc. */
#define DEFINE_PACK_B(NAME, T)                                                                   \
    static void pack_b_##NAME(float *restrict dst, const T *restrict b, int64_t rs, int64_t cs, \
                              int64_t kc, int64_t nc) {                                         \
        for (int64_t jr = 0; jr < nc; jr += NR) {                                                \
            const int64_t nr = nc - jr < NR ? nc - jr : NR;                                      \
            float *d = dst + jr * kc;                                                            \
            if (cs == 1) {                                                                       \
                for (int64_t p = 0; p < kc; ++p) {                                               \
                    const T *src = b + p * rs + jr;                                              \
                    for (int64_t jj = 0; jj < nr; ++jj) d[p * NR + jj] = ld_##NAME(src[jj]);     \
                    for (int64_t jj = nr; jj < NR; ++jj) d[p * NR + jj] = 0.0f;                  \
                }                                                                                \
            } else {                                                                             \
                for (int64_t jj = 0; jj < nr; ++jj) {                                            \
                    const T *src = b + (jr + jj) * cs;                                           \
                    for (int64_t p = 0; p < kc; ++p) d[p * NR + jj] = ld_##NAME(src[p * rs]);    \
                }                                                                                \
                for (int64_t jj = nr; jj < NR; ++jj)                                             \
                    for (int64_t p = 0; p < kc; ++p) d[p * NR + jj] = 0.0f;                      \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_PACK_A(fp32, float)
DEFINE_PACK_A(bf16, uint16_t)
DEFINE_PACK_A(fp16, uint16_t)
DEFINE_PACK_B(fp32, float)
DEFINE_PACK_B(bf16, uint16_t)
DEFINE_PACK_B(fp16, uint16_t)

/* Gathered blocks: the same panels as pack_a / pack_b, each source row found through the index
 * (idx already at the block's first gathered row), a -1 row packed as zeros, which is what
 * packing a materialised zero row gives (every ld_* maps 0 to +0.0f). Separate functions, so the
 * plain packers above keep their loops. The source rows are contiguous (stride 1 within a row). */

/* A's rows gathered (fwd / dgrad): block row i is source row idx[i], from column p0. */
#define DEFINE_PACK_A_GI(NAME, T)                                                                \
    static void pack_a_gi_##NAME(float *restrict dst, const T *restrict src,                     \
                                 const int64_t *idx, int64_t rs, int64_t p0, int64_t mc,         \
                                 int64_t kc) {                                                   \
        for (int64_t r = 0; r < mc; r += MR) {                                                   \
            const int64_t mr = mc - r < MR ? mc - r : MR;                                        \
            float *d = dst + r * kc;                                                             \
            for (int64_t ii = 0; ii < mr; ++ii) {                                                \
                const int64_t g = idx[r + ii];                                                   \
                if (g < 0) {                                                                     \
                    for (int64_t p = 0; p < kc; ++p) d[p * MR + ii] = 0.0f;                      \
                    continue;                                                                    \
                }                                                                                \
                const T *row = src + g * rs + p0;                                                \
                for (int64_t p = 0; p < kc; ++p) d[p * MR + ii] = ld_##NAME(row[p]);             \
            }                                                                                    \
            for (int64_t ii = mr; ii < MR; ++ii)                                                 \
                for (int64_t p = 0; p < kc; ++p) d[p * MR + ii] = 0.0f;                          \
        }                                                                                        \
    }

/* The reduction index gathered (wgrad, where the reduction runs over rows): a block of n columns
 * of panels W wide (MR for A, a source's transpose; NR for B), its reduction index p being source
 * row idx[p], from column c0. A and B panels differ only in W. */
#define DEFINE_PACK_GP(NAME, T)                                                                  \
    static void pack_gp_##NAME(float *restrict dst, const T *restrict src, const int64_t *idx,   \
                               int64_t stride, int64_t c0, int64_t n, int64_t kc, int64_t w) {   \
        for (int64_t r = 0; r < n; r += w) {                                                     \
            const int64_t nr = n - r < w ? n - r : w;                                            \
            float *d = dst + r * kc;                                                             \
            for (int64_t p = 0; p < kc; ++p) {                                                   \
                const int64_t g = idx[p];                                                        \
                int64_t ii = 0;                                                                  \
                if (g >= 0) {                                                                    \
                    const T *row = src + g * stride + c0 + r;                                    \
                    for (; ii < nr; ++ii) d[p * w + ii] = ld_##NAME(row[ii]);                    \
                }                                                                                \
                for (; ii < w; ++ii) d[p * w + ii] = 0.0f;                                       \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_PACK_A_GI(fp32, float)
DEFINE_PACK_A_GI(bf16, uint16_t)
DEFINE_PACK_A_GI(fp16, uint16_t)
DEFINE_PACK_GP(fp32, float)
DEFINE_PACK_GP(bf16, uint16_t)
DEFINE_PACK_GP(fp16, uint16_t)

static void pack_gp(float *dst, moe_dtype_t dt, const void *src, const int64_t *idx,
                    int64_t stride, int64_t c0, int64_t n, int64_t kc, int64_t w) {
    if (dt == MOE_DTYPE_FP32) pack_gp_fp32(dst, (const float *)src, idx, stride, c0, n, kc, w);
    else if (dt == MOE_DTYPE_BF16)
        pack_gp_bf16(dst, (const uint16_t *)src, idx, stride, c0, n, kc, w);
    else pack_gp_fp16(dst, (const uint16_t *)src, idx, stride, c0, n, kc, w);
}

/* `a`/`b` point at element (0, 0) of the problem; (i0, p0) / (p0, j0) select the block. */
static void pack_a(float *dst, moe_dtype_t dt, const gg_problem_t *pr, int64_t i0, int64_t p0,
                   int64_t mc, int64_t kc) {
    if (pr->a_gidx && pr->a_gather_p) {
        pack_gp(dst, dt, pr->a, pr->a_gidx + p0, pr->a_cs, i0, mc, kc, MR);
        return;
    }
    if (pr->a_gidx) {
        const int64_t *idx = pr->a_gidx + i0;
        if (dt == MOE_DTYPE_FP32)
            pack_a_gi_fp32(dst, (const float *)pr->a, idx, pr->a_rs, p0, mc, kc);
        else if (dt == MOE_DTYPE_BF16)
            pack_a_gi_bf16(dst, (const uint16_t *)pr->a, idx, pr->a_rs, p0, mc, kc);
        else
            pack_a_gi_fp16(dst, (const uint16_t *)pr->a, idx, pr->a_rs, p0, mc, kc);
        return;
    }
    const int64_t off = i0 * pr->a_rs + p0 * pr->a_cs;
    switch (dt) {
    case MOE_DTYPE_FP32:
        pack_a_fp32(dst, (const float *)pr->a + off, pr->a_rs, pr->a_cs, mc, kc);
        break;
    case MOE_DTYPE_BF16:
        pack_a_bf16(dst, (const uint16_t *)pr->a + off, pr->a_rs, pr->a_cs, mc, kc);
        break;
    default:
        pack_a_fp16(dst, (const uint16_t *)pr->a + off, pr->a_rs, pr->a_cs, mc, kc);
        break;
    }
}

static void pack_b(float *dst, moe_dtype_t dt, const gg_problem_t *pr, int64_t p0, int64_t j0,
                   int64_t kc, int64_t nc) {
    if (pr->b_gidx) {
        pack_gp(dst, dt, pr->b, pr->b_gidx + p0, pr->b_rs, j0, nc, kc, NR);
        return;
    }
    const int64_t off = p0 * pr->b_rs + j0 * pr->b_cs;
    switch (dt) {
    case MOE_DTYPE_FP32:
        pack_b_fp32(dst, (const float *)pr->b + off, pr->b_rs, pr->b_cs, kc, nc);
        break;
    case MOE_DTYPE_BF16:
        pack_b_bf16(dst, (const uint16_t *)pr->b + off, pr->b_rs, pr->b_cs, kc, nc);
        break;
    default:
        pack_b_fp16(dst, (const uint16_t *)pr->b + off, pr->b_rs, pr->b_cs, kc, nc);
        break;
    }
}

/* fp32 → fp16, round to nearest even, bit-identical to moe_float_to_fp16 but with selects instead
 * of branches (the store runs once per output element, which for small K is not negligible):
 * the three candidates are computed and one is picked. Subnormals round through a float add of
 * 0.5 (whose ulp is 2^-24, the fp16 subnormal step), inf/NaN map to 0x7c00/0x7e00. */
static inline uint16_t st_fp16(float f) {
    uint32_t u = moe_float_to_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    const uint32_t big = 0x7c00u | ((0u - (uint32_t)(u > 0x7f800000u)) & 0x0200u);
    const uint32_t sub = moe_float_to_bits(moe_bits_to_float(u & 0x3fffffffu) + 0.5f) - 0x3f000000u;
    const uint32_t nrm = (u - (112u << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
    const uint32_t is_big = 0u - (uint32_t)(u >= 0x47800000u);
    const uint32_t is_sub = 0u - (uint32_t)(u < 0x38800000u);
    const uint32_t o = (big & is_big) | (sub & is_sub) | (nrm & ~(is_big | is_sub));
    return (uint16_t)(o | sign);
}

/* The fp32 tile (row stride NC) narrowed once into the output. */
static void store_c(const gg_problem_t *pr, moe_dtype_t dt, const float *restrict cb, int64_t i0,
                    int64_t j0, int64_t mc, int64_t nc) {
    for (int64_t i = 0; i < mc; ++i) {
        const float *s = cb + i * NC;
        const int64_t o = (i0 + i) * pr->ldc + j0;
        switch (dt) {
        case MOE_DTYPE_FP32: {
            float *d = (float *)pr->c + o;
            for (int64_t j = 0; j < nc; ++j) d[j] = s[j];
        } break;
        case MOE_DTYPE_FP64: {
            double *d = (double *)pr->c + o;
            for (int64_t j = 0; j < nc; ++j) d[j] = (double)s[j];
        } break;
        case MOE_DTYPE_BF16: {
            uint16_t *d = (uint16_t *)pr->c + o;
            for (int64_t j = 0; j < nc; ++j) d[j] = moe_float_to_bf16(s[j]);
        } break;
        default: {
            uint16_t *d = (uint16_t *)pr->c + o;
            for (int64_t j = 0; j < nc; ++j) d[j] = st_fp16(s[j]);
        } break;
        }
    }
}

/* ---- micro-kernels: c[MR × NR] (row stride NC) += a-panel · b-panel, fp32 ------------------ */

/* Portable: fixed trip counts, so the compiler vectorises the j loop for its baseline ISA. */
static void kernel_generic(int64_t kc, const float *restrict a, const float *restrict b,
                           float *restrict c) {
    float acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = c[i * NC + j];
    for (int64_t p = 0; p < kc; ++p) {
        const float *bp = b + p * NR;
        for (int i = 0; i < MR; ++i) {
            const float ai = a[p * MR + i];
            for (int j = 0; j < NR; ++j) acc[i][j] += ai * bp[j];
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) c[i * NC + j] = acc[i][j];
}

#ifdef MOE_GG_X86
/* AVX-512: 8 rows × 2 zmm of accumulators stay in registers for the whole kc loop. */
__attribute__((target("avx512f"))) static void kernel_avx512(int64_t kc, const float *restrict a,
                                                              const float *restrict b,
                                                              float *restrict c) {
#define GG_LOAD_ROW(i)                              \
    __m512 c##i##0 = _mm512_loadu_ps(c + (i) * NC); \
    __m512 c##i##1 = _mm512_loadu_ps(c + (i) * NC + 16);
    GG_LOAD_ROW(0) GG_LOAD_ROW(1) GG_LOAD_ROW(2) GG_LOAD_ROW(3)
    GG_LOAD_ROW(4) GG_LOAD_ROW(5) GG_LOAD_ROW(6) GG_LOAD_ROW(7)
#undef GG_LOAD_ROW
    for (int64_t p = 0; p < kc; ++p) {
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
#define GG_FMA_ROW(i)                                 \
    {                                                 \
        const __m512 ai = _mm512_set1_ps(a[i]);       \
        c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);   \
        c##i##1 = _mm512_fmadd_ps(ai, b1, c##i##1);   \
    }
        GG_FMA_ROW(0) GG_FMA_ROW(1) GG_FMA_ROW(2) GG_FMA_ROW(3)
        GG_FMA_ROW(4) GG_FMA_ROW(5) GG_FMA_ROW(6) GG_FMA_ROW(7)
#undef GG_FMA_ROW
        a += MR;
        b += NR;
    }
#define GG_STORE_ROW(i)                        \
    _mm512_storeu_ps(c + (i) * NC, c##i##0);   \
    _mm512_storeu_ps(c + (i) * NC + 16, c##i##1);
    GG_STORE_ROW(0) GG_STORE_ROW(1) GG_STORE_ROW(2) GG_STORE_ROW(3)
    GG_STORE_ROW(4) GG_STORE_ROW(5) GG_STORE_ROW(6) GG_STORE_ROW(7)
#undef GG_STORE_ROW
}
#endif

/* ---- bf16 without widening: AVX512_BF16's dot product of pairs -------------------------------
 *
 * VDPBF16PS does acc += a[2j+1]·b[2j+1], then acc += a[2j]·b[2j], each product exact in fp32
 * and each sum rounded once (so each step is an FMA), with bf16 subnormal inputs and fp32
 * subnormal results flushed to zero. Packing element p into the high half and p + 1 into the low
 * half makes it add p first: the same sums in the same order as the fp32 FMA kernel, bit for bit
 * (tested), at twice the multiply-adds per instruction and half the packed bytes. */

/* A(i, p) << 16 | A(i, p + 1), zero past kc. */
static inline uint32_t pair_of(const uint16_t *src, int64_t p, int64_t stride, int64_t kc) {
    const uint32_t lo = p + 1 < kc ? src[(p + 1) * stride] : 0u;
    return (uint32_t)src[p * stride] << 16 | lo;
}

static void pack_a_pairs(uint32_t *restrict dst, const uint16_t *restrict a, int64_t rs,
                         int64_t cs, int64_t mc, int64_t kc) {
    const int64_t kp = (kc + 1) / 2;
    for (int64_t r = 0; r < mc; r += MR) {
        const int64_t mr = mc - r < MR ? mc - r : MR;
        uint32_t *d = dst + r * kp;
        if (cs == 1) {
            for (int64_t ii = 0; ii < mr; ++ii)
                for (int64_t q = 0; q < kp; ++q)
                    d[q * MR + ii] = pair_of(a + (r + ii) * rs, 2 * q, 1, kc);
        } else {
            for (int64_t q = 0; q < kp; ++q)
                for (int64_t ii = 0; ii < mr; ++ii)
                    d[q * MR + ii] = pair_of(a + (r + ii) * rs, 2 * q, cs, kc);
        }
        for (int64_t ii = mr; ii < MR; ++ii)
            for (int64_t q = 0; q < kp; ++q) d[q * MR + ii] = 0u;
    }
}

static void pack_b_pairs(uint32_t *restrict dst, const uint16_t *restrict b, int64_t rs,
                         int64_t cs, int64_t kc, int64_t nc) {
    const int64_t kp = (kc + 1) / 2;
    for (int64_t jr = 0; jr < nc; jr += NR) {
        const int64_t nr = nc - jr < NR ? nc - jr : NR;
        uint32_t *d = dst + jr * kp;
        if (cs == 1) {
            for (int64_t q = 0; q < kp; ++q) {
                const uint16_t *r0 = b + 2 * q * rs + jr;
                if (2 * q + 1 < kc) {
                    for (int64_t jj = 0; jj < nr; ++jj)
                        d[q * NR + jj] = (uint32_t)r0[jj] << 16 | r0[rs + jj];
                } else {
                    for (int64_t jj = 0; jj < nr; ++jj) d[q * NR + jj] = (uint32_t)r0[jj] << 16;
                }
            }
        } else {
            for (int64_t jj = 0; jj < nr; ++jj)
                for (int64_t q = 0; q < kp; ++q)
                    d[q * NR + jj] = pair_of(b + (jr + jj) * cs, 2 * q, rs, kc);
        }
        for (int64_t q = 0; q < kp; ++q)
            for (int64_t jj = nr; jj < NR; ++jj) d[q * NR + jj] = 0u;
    }
}

/* Gathered pair panels (the pair packers' layout; see the gathered fp32 packers above). */

/* A's rows gathered (fwd / dgrad): block row i is source row idx[i], from column p0. */
static void pack_a_pairs_gi(uint32_t *restrict dst, const uint16_t *restrict src,
                            const int64_t *idx, int64_t rs, int64_t p0, int64_t mc, int64_t kc) {
    const int64_t kp = (kc + 1) / 2;
    for (int64_t r = 0; r < mc; r += MR) {
        const int64_t mr = mc - r < MR ? mc - r : MR;
        uint32_t *d = dst + r * kp;
        for (int64_t ii = 0; ii < mr; ++ii) {
            const int64_t g = idx[r + ii];
            if (g < 0) {
                for (int64_t q = 0; q < kp; ++q) d[q * MR + ii] = 0u;
                continue;
            }
            const uint16_t *row = src + g * rs + p0;
            for (int64_t q = 0; q < kp; ++q) d[q * MR + ii] = pair_of(row, 2 * q, 1, kc);
        }
        for (int64_t ii = mr; ii < MR; ++ii)
            for (int64_t q = 0; q < kp; ++q) d[q * MR + ii] = 0u;
    }
}

/* Source rows idx[2q] and idx[2q + 1] of a pair (NULL for a zero row or past kc). */
static inline void pair_rows(const uint16_t *src, const int64_t *idx, int64_t stride, int64_t q,
                             int64_t kc, const uint16_t **hi, const uint16_t **lo) {
    const int64_t g0 = idx[2 * q], g1 = 2 * q + 1 < kc ? idx[2 * q + 1] : -1;
    *hi = g0 < 0 ? NULL : src + g0 * stride;
    *lo = g1 < 0 ? NULL : src + g1 * stride;
}

/* The reduction index gathered (wgrad): pair panels W wide (MR for A, NR for B) over n columns,
 * reduction index p being source row idx[p], from column c0 (as pack_gp). */
static void pack_pairs_gp(uint32_t *restrict dst, const uint16_t *restrict src, const int64_t *idx,
                          int64_t stride, int64_t c0, int64_t n, int64_t kc, int64_t w) {
    const int64_t kp = (kc + 1) / 2;
    for (int64_t r = 0; r < n; r += w) {
        const int64_t nr = n - r < w ? n - r : w;
        uint32_t *d = dst + r * kp;
        for (int64_t q = 0; q < kp; ++q) {
            const uint16_t *hi, *lo;
            pair_rows(src, idx, stride, q, kc, &hi, &lo);
            for (int64_t ii = 0; ii < nr; ++ii)
                d[q * w + ii] = (uint32_t)(hi ? hi[c0 + r + ii] : 0u) << 16 |
                                (lo ? lo[c0 + r + ii] : 0u);
            for (int64_t ii = nr; ii < w; ++ii) d[q * w + ii] = 0u;
        }
    }
}

/* The pair panels of a block, plain or gathered (as pack_a / pack_b for fp32 panels). */
static void pack_a_pairs_of(uint32_t *dst, const gg_problem_t *pr, int64_t i0, int64_t p0,
                            int64_t mc, int64_t kc) {
    const uint16_t *a = (const uint16_t *)pr->a;
    if (pr->a_gidx && pr->a_gather_p)
        pack_pairs_gp(dst, a, pr->a_gidx + p0, pr->a_cs, i0, mc, kc, MR);
    else if (pr->a_gidx)
        pack_a_pairs_gi(dst, a, pr->a_gidx + i0, pr->a_rs, p0, mc, kc);
    else
        pack_a_pairs(dst, a + i0 * pr->a_rs + p0 * pr->a_cs, pr->a_rs, pr->a_cs, mc, kc);
}

static void pack_b_pairs_of(uint32_t *dst, const gg_problem_t *pr, int64_t p0, int64_t j0,
                            int64_t kc, int64_t nc) {
    const uint16_t *b = (const uint16_t *)pr->b;
    if (pr->b_gidx) pack_pairs_gp(dst, b, pr->b_gidx + p0, pr->b_rs, j0, nc, kc, NR);
    else pack_b_pairs(dst, b + p0 * pr->b_rs + j0 * pr->b_cs, pr->b_rs, pr->b_cs, kc, nc);
}

#ifdef MOE_GG_X86
__attribute__((target("avx512f,avx512bf16"))) static void kernel_bf16_avx512(
    int64_t kp, const uint32_t *restrict a, const uint32_t *restrict b, float *restrict c) {
#define GG_LOAD_ROW(i)                              \
    __m512 c##i##0 = _mm512_loadu_ps(c + (i) * NC); \
    __m512 c##i##1 = _mm512_loadu_ps(c + (i) * NC + 16);
    GG_LOAD_ROW(0) GG_LOAD_ROW(1) GG_LOAD_ROW(2) GG_LOAD_ROW(3)
    GG_LOAD_ROW(4) GG_LOAD_ROW(5) GG_LOAD_ROW(6) GG_LOAD_ROW(7)
#undef GG_LOAD_ROW
    for (int64_t q = 0; q < kp; ++q) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 16);
#define GG_DP_ROW(i)                                                   \
    {                                                                  \
        const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i]);    \
        c##i##0 = _mm512_dpbf16_ps(c##i##0, ai, b0);                   \
        c##i##1 = _mm512_dpbf16_ps(c##i##1, ai, b1);                   \
    }
        GG_DP_ROW(0) GG_DP_ROW(1) GG_DP_ROW(2) GG_DP_ROW(3)
        GG_DP_ROW(4) GG_DP_ROW(5) GG_DP_ROW(6) GG_DP_ROW(7)
#undef GG_DP_ROW
        a += MR;
        b += NR;
    }
#define GG_STORE_ROW(i)                        \
    _mm512_storeu_ps(c + (i) * NC, c##i##0);   \
    _mm512_storeu_ps(c + (i) * NC + 16, c##i##1);
    GG_STORE_ROW(0) GG_STORE_ROW(1) GG_STORE_ROW(2) GG_STORE_ROW(3)
    GG_STORE_ROW(4) GG_STORE_ROW(5) GG_STORE_ROW(6) GG_STORE_ROW(7)
#undef GG_STORE_ROW
}
#endif

/* By the CPU's features, unless the cpu_gemm_kernel switch (tuning.h) forces the portable fp32
 * kernel, or the fp32 AVX-512 one for every dtype, so tests cover each path on one machine. */
static gg_kernels_t pick_kernels(void) {
    const int force = moe_tuning_get().cpu_gemm_kernel;
    gg_kernels_t k = {kernel_generic, NULL};
    if (force == MOE_TUNING_GEMM_GENERIC) return k;
#ifdef MOE_GG_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) k.f32 = kernel_avx512;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") &&
        force != MOE_TUNING_GEMM_AVX512)
        k.bf16 = kernel_bf16_avx512;
#endif
    return k;
}

/* ---- one output tile ------------------------------------------------------------------------ */

static void tile_fp32(const gg_problem_t *pr, moe_dtype_t dt, moe_dtype_t out_dt,
                      const gg_kernels_t *kernels, float *scratch, int64_t i0, int64_t j0) {
    float *ap = scratch, *bp = ap + (int64_t)MC * KC, *cb = bp + (int64_t)KC * NC;
    const int64_t mc = pr->m - i0 < MC ? pr->m - i0 : MC;
    const int64_t nc = pr->n - j0 < NC ? pr->n - j0 : NC;
    const int64_t mc_pad = (mc + MR - 1) / MR * MR, nc_pad = (nc + NR - 1) / NR * NR;
    const int pairs = dt == MOE_DTYPE_BF16 && kernels->bf16 != NULL;
    /* a pair word holds two elements, so the same buffers take twice the depth in bf16 pairs */
    const int64_t kc_max = pairs ? 2 * KC : KC;
    /* only the padded tile: zeroing all MC × NC for a 5-row expert cost more than its math */
    for (int64_t i = 0; i < mc_pad; ++i) memset(cb + i * NC, 0, sizeof(float) * (size_t)nc_pad);
    for (int64_t p0 = 0; p0 < pr->k; p0 += kc_max) {
        const int64_t kc = pr->k - p0 < kc_max ? pr->k - p0 : kc_max;
        if (pairs) {
            const int64_t kp = (kc + 1) / 2;
            uint32_t *ap2 = (uint32_t *)ap, *bp2 = (uint32_t *)bp;
            pack_a_pairs_of(ap2, pr, i0, p0, mc, kc);
            pack_b_pairs_of(bp2, pr, p0, j0, kc, nc);
            for (int64_t jr = 0; jr < nc_pad; jr += NR)
                for (int64_t ir = 0; ir < mc_pad; ir += MR)
                    kernels->bf16(kp, ap2 + ir * kp, bp2 + jr * kp, cb + ir * NC + jr);
            continue;
        }
        pack_a(ap, dt, pr, i0, p0, mc, kc);
        pack_b(bp, dt, pr, p0, j0, kc, nc);
        /* jr outer: one B micro-panel stays in L1 while the A panels stream from L2 */
        for (int64_t jr = 0; jr < nc_pad; jr += NR)
            for (int64_t ir = 0; ir < mc_pad; ir += MR)
                kernels->f32(kc, ap + ir * kc, bp + jr * kc, cb + ir * NC + jr);
    }
    store_c(pr, out_dt, cb, i0, j0, mc, nc);
}

/* A(i, p) and B(p, j) of an fp64 problem, gathered or not (a -1 row reads 0.0, which the sum
 * still multiplies, as it would a materialised zero row). */
static inline double a_fp64(const gg_problem_t *pr, const double *a, int64_t i, int64_t p) {
    if (!pr->a_gidx) return a[i * pr->a_rs + p * pr->a_cs];
    if (pr->a_gather_p) {
        const int64_t g = pr->a_gidx[p];
        return g < 0 ? 0.0 : a[i * pr->a_rs + g * pr->a_cs];
    }
    const int64_t g = pr->a_gidx[i];
    return g < 0 ? 0.0 : a[g * pr->a_rs + p * pr->a_cs];
}

static inline double b_fp64(const gg_problem_t *pr, const double *b, int64_t p, int64_t j) {
    if (!pr->b_gidx) return b[p * pr->b_rs + j * pr->b_cs];
    const int64_t g = pr->b_gidx[p];
    return g < 0 ? 0.0 : b[g * pr->b_rs + j * pr->b_cs];
}

/* fp64 operands (gradcheck, references): plain fixed-order fp64 sums, no packing. */
static void tile_fp64(const gg_problem_t *pr, moe_dtype_t out_dt, int64_t i0, int64_t j0) {
    const double *a = (const double *)pr->a, *b = (const double *)pr->b;
    const int64_t mc = pr->m - i0 < MC ? pr->m - i0 : MC;
    const int64_t nc = pr->n - j0 < NC ? pr->n - j0 : NC;
    for (int64_t i = i0; i < i0 + mc; ++i) {
        for (int64_t j = j0; j < j0 + nc; ++j) {
            double acc = 0.0;
            for (int64_t p = 0; p < pr->k; ++p) acc += a_fp64(pr, a, i, p) * b_fp64(pr, b, p, j);
            moe_store(pr->c, out_dt, i * pr->ldc + j, acc);
        }
    }
}

/* ---- the three products as strided problems ------------------------------------------------- */

typedef struct {
    gg_kind_t kind;
    const moe_grouped_gemm_params_t *p;
    const char *in0, *in1; /* fwd: x, weight; dgrad: grad_y, weight; wgrad: x, grad_y */
    char *out;
    const int64_t *offsets;
} gg_call_t;

static gg_problem_t expert_problem(const gg_call_t *call, int64_t e) {
    const moe_grouped_gemm_params_t *p = call->p;
    const int64_t K = p->in_features, N = p->out_features, es = (int64_t)moe_dtype_size(p->dtype);
    const int64_t os = (int64_t)moe_dtype_size(p->out_dtype);
    const int64_t r0 = call->offsets[e], rows = call->offsets[e + 1] - r0;
    const int t = p->trans_w;
    gg_problem_t pr;
    pr.a_gidx = pr.b_gidx = NULL;
    pr.a_gather_p = 0;
    switch (call->kind) {
    case GG_FWD: /* y_e[rows, N] = x_e[rows, K] · W(K, N) */
        pr.a = call->in0 + r0 * K * es, pr.a_rs = K, pr.a_cs = 1;
        pr.b = call->in1 + e * K * N * es, pr.b_rs = t ? 1 : N, pr.b_cs = t ? K : 1;
        pr.c = call->out + r0 * N * os, pr.ldc = N;
        pr.m = rows, pr.n = N, pr.k = K;
        break;
    case GG_DGRAD: /* dx_e[rows, K] = dy_e[rows, N] · W(K, N)ᵀ */
        pr.a = call->in0 + r0 * N * es, pr.a_rs = N, pr.a_cs = 1;
        pr.b = call->in1 + e * K * N * es, pr.b_rs = t ? K : 1, pr.b_cs = t ? 1 : N;
        pr.c = call->out + r0 * K * os, pr.ldc = K;
        pr.m = rows, pr.n = K, pr.k = N;
        break;
    default: /* wgrad: [K, N] = x_eᵀ · dy_e, or [N, K] = dy_eᵀ · x_e; reduction over rows */
        if (!t) {
            pr.a = call->in0 + r0 * K * es, pr.a_rs = 1, pr.a_cs = K;
            pr.b = call->in1 + r0 * N * es, pr.b_rs = N, pr.b_cs = 1;
            pr.m = K, pr.n = N, pr.ldc = N;
        } else {
            pr.a = call->in1 + r0 * N * es, pr.a_rs = 1, pr.a_cs = N;
            pr.b = call->in0 + r0 * K * es, pr.b_rs = K, pr.b_cs = 1;
            pr.m = N, pr.n = K, pr.ldc = K;
        }
        pr.c = call->out + e * K * N * os;
        pr.k = rows;
        break;
    }
    if (p->gather_operand == MOE_GG_GATHER_NONE) return pr;
    /* the gathered operand: its source's base, its rows through the index (see gg_problem_t) */
    const int64_t *gidx = p->gather_index + r0;
    const int gx = p->gather_operand == MOE_GG_GATHER_X;
    if (call->kind != GG_WGRAD) { /* fwd gathers x, dgrad grad_y: A's rows, in0 */
        pr.a = call->in0, pr.a_gidx = gidx;
    } else if (gx != t) { /* x with trans_w = 0, grad_y with 1: A = the source's transpose */
        pr.a = gx ? call->in0 : call->in1, pr.a_gidx = gidx, pr.a_gather_p = 1;
    } else { /* B = the source */
        pr.b = gx ? call->in0 : call->in1, pr.b_gidx = gidx;
    }
    return pr;
}

/* ---- validation ------------------------------------------------------------------------------ */

static int is_operand_dtype(moe_dtype_t dt) {
    return dt == MOE_DTYPE_FP32 || dt == MOE_DTYPE_FP16 || dt == MOE_DTYPE_BF16 ||
           dt == MOE_DTYPE_FP64;
}

static const char *const gg_op_names[] = {"moe_grouped_gemm_fwd", "moe_grouped_gemm_dgrad",
                                           "moe_grouped_gemm_wgrad",
                                           "moe_grouped_gemm_glu_probs_fwd"};

/* The operands an op may gather (moe_experts.h): fwd and fc1 read x, dgrad grad_y, wgrad both. */
static int gather_allowed(int operand, moe_gg_op_t op) {
    if (operand == MOE_GG_GATHER_NONE) return 1;
    switch (op) {
    case MOE_GG_OP_FWD:
    case MOE_GG_OP_GLU_PROBS_FWD: return operand == MOE_GG_GATHER_X;
    case MOE_GG_OP_DGRAD: return operand == MOE_GG_GATHER_DY;
    default: return operand == MOE_GG_GATHER_X || operand == MOE_GG_GATHER_DY;
    }
}

/* Shared with the CUDA entry points (grouped_gemm.cu), so both give the same messages. The index
 * values are not read here: only the CPU can read them without a sync (check_gather_index). */
moe_status_t moe_grouped_gemm_check_params(const moe_grouped_gemm_params_t *p, moe_gg_op_t op) {
    MOE_CHECK(p != NULL, "params must not be NULL");
    MOE_CHECK(gather_allowed(p->gather_operand, op),
              "gather_operand=%d is not allowed for %s (allowed: 0 = none, %s)", p->gather_operand,
              gg_op_names[op],
              op == MOE_GG_OP_DGRAD ? "2 = grad_y"
                                    : (op == MOE_GG_OP_WGRAD ? "1 = x, 2 = grad_y" : "1 = x"));
    if (p->gather_operand != MOE_GG_GATHER_NONE) {
        MOE_CHECK(p->gather_rows >= 0, "gather_rows must be >= 0, got %lld",
                  (long long)p->gather_rows);
        MOE_CHECK(p->num_rows <= 0 || p->gather_index != NULL,
                  "gather_index must not be NULL when gather_operand=%d and num_rows=%lld > 0",
                  p->gather_operand, (long long)p->num_rows);
    }
    MOE_CHECK(p->num_rows >= 0, "num_rows must be >= 0, got %lld", (long long)p->num_rows);
    MOE_CHECK(p->num_experts >= 1, "num_experts must be >= 1, got %lld",
              (long long)p->num_experts);
    MOE_CHECK(p->in_features >= 0, "in_features must be >= 0, got %lld",
              (long long)p->in_features);
    MOE_CHECK(p->out_features >= 0, "out_features must be >= 0, got %lld",
              (long long)p->out_features);
    MOE_CHECK(p->trans_w == 0 || p->trans_w == 1, "trans_w must be 0 or 1, got %d", p->trans_w);
    MOE_CHECK(is_operand_dtype(p->dtype),
              "dtype must be float32, float16, bfloat16 or float64, got %s",
              moe_dtype_name(p->dtype));
    MOE_CHECK(is_operand_dtype(p->out_dtype),
              "out_dtype must be float32, float16, bfloat16 or float64, got %s",
              moe_dtype_name(p->out_dtype));
    /* x [rows, K], y [rows, N], weight [E, K, N]: each element count must fit in int64 */
    int64_t kn;
    MOE_TRY(moe_check_mul(p->num_rows, "num_rows", p->in_features, "in_features"));
    MOE_TRY(moe_check_mul(p->num_rows, "num_rows", p->out_features, "out_features"));
    MOE_TRY(moe_check_mul(p->in_features, "in_features", p->out_features, "out_features"));
    (void)moe_checked_mul_i64(p->in_features, p->out_features, &kn);
    MOE_TRY(moe_check_mul(p->num_experts, "num_experts", kn, "in_features * out_features"));
    if (p->gather_operand != MOE_GG_GATHER_NONE) /* the gathered source [gather_rows, cols] */
        MOE_TRY(moe_check_mul(p->gather_rows, "gather_rows",
                              p->gather_operand == MOE_GG_GATHER_X ? p->in_features
                                                                   : p->out_features,
                              p->gather_operand == MOE_GG_GATHER_X ? "in_features"
                                                                   : "out_features"));
    return MOE_OK;
}

/* CPU only: the index values (host memory) in [-1, gather_rows). */
static moe_status_t check_gather_index(const moe_grouped_gemm_params_t *p) {
    if (p->gather_operand == MOE_GG_GATHER_NONE) return MOE_OK;
    for (int64_t r = 0; r < p->num_rows; ++r)
        MOE_CHECK(p->gather_index[r] >= -1 && p->gather_index[r] < p->gather_rows,
                  "gather_index[%lld] = %lld is outside [-1, gather_rows=%lld)", (long long)r,
                  (long long)p->gather_index[r], (long long)p->gather_rows);
    return MOE_OK;
}

/* The operand pointer the call reads for `operand` (x or grad_y): when it is the gathered one,
 * its source may be empty (gather_rows = 0, every index -1), and then NULL. */
static int operand_ok(const void *ptr, int operand, const moe_grouped_gemm_params_t *p) {
    return ptr != NULL || (p->gather_operand == operand && p->gather_rows == 0);
}

static moe_status_t check_offsets(const int64_t *off, const moe_grouped_gemm_params_t *p) {
    MOE_CHECK(off != NULL, "expert_offsets must not be NULL");
    MOE_CHECK(off[0] == 0, "expert_offsets[0] must be 0, got %lld", (long long)off[0]);
    for (int64_t e = 1; e <= p->num_experts; ++e)
        MOE_CHECK(off[e] >= off[e - 1],
                  "expert_offsets must be non-decreasing, got expert_offsets[%lld]=%lld < "
                  "expert_offsets[%lld]=%lld",
                  (long long)e, (long long)off[e], (long long)(e - 1), (long long)off[e - 1]);
    MOE_CHECK(off[p->num_experts] <= p->num_rows,
              "expert_offsets[num_experts=%lld] must be <= num_rows=%lld, got %lld",
              (long long)p->num_experts, (long long)p->num_rows,
              (long long)off[p->num_experts]);
    return MOE_OK;
}

/* Rows past the last expert (a buffer sized by a static bound, with the kept count on the
 * device) belong to no expert: their fwd/dgrad output is zero. */
static void zero_tail(void *out, const int64_t *off, const moe_grouped_gemm_params_t *p,
                      int64_t row_elems) {
    const int64_t first = off[p->num_experts];
    const size_t esize = moe_dtype_size(p->out_dtype);
    if (first < p->num_rows)
        memset((char *)out + (size_t)first * (size_t)row_elems * esize, 0,
               (size_t)(p->num_rows - first) * (size_t)row_elems * esize);
}

size_t moe_grouped_gemm_workspace_size(const moe_grouped_gemm_params_t *params) {
    (void)params;
    int64_t floats, bytes;
    if (moe_checked_mul_i64(moe_max_threads(), THREAD_FLOATS, &floats) ||
        moe_checked_mul_i64(floats, (int64_t)sizeof(float), &bytes) ||
        moe_checked_add_i64(bytes, ALIGN_BYTES, &bytes))
        return moe_fail_size("moe_grouped_gemm_workspace_size: %d threads' packing buffers "
                             "overflow int64 bytes", moe_max_threads());
    return (size_t)bytes;
}

static int64_t tiles_of(gg_problem_t pr) {
    return (pr.m + MC - 1) / MC * ((pr.n + NC - 1) / NC);
}

/* ---- driver ---------------------------------------------------------------------------------- */

static moe_status_t run(const gg_call_t *call, void *workspace, size_t workspace_bytes) {
    const moe_grouped_gemm_params_t *p = call->p;
    const int64_t E = p->num_experts;
    const size_t thread_bytes = (size_t)THREAD_FLOATS * sizeof(float);
    MOE_CHECK(workspace != NULL && workspace_bytes >= thread_bytes + ALIGN_BYTES,
              "workspace too small: %zu bytes, need at least %zu "
              "(moe_grouped_gemm_workspace_size)",
              workspace_bytes, thread_bytes + ALIGN_BYTES);
    int64_t nthreads = (int64_t)((workspace_bytes - ALIGN_BYTES) / thread_bytes);
    if (nthreads > moe_max_threads()) nthreads = moe_max_threads();
    /* Waking a team costs microseconds (far more on a loaded machine); below ~2^18 multiply-adds
     * one thread is faster. Safe for determinism: results never depend on the thread count. */
    int64_t macs;
    const int overflow = moe_checked_add_i64(p->num_rows, E, &macs) ||
                         moe_checked_mul_i64(macs, p->in_features, &macs) ||
                         moe_checked_mul_i64(macs, p->out_features, &macs);
    if (!overflow && macs < ((int64_t)1 << 18)) nthreads = 1;
    const uintptr_t align_mask = (uintptr_t)(ALIGN_BYTES - 1);
    float *base = (float *)(((uintptr_t)workspace + align_mask) & ~align_mask);
    const gg_kernels_t kernels = pick_kernels();
    const int fp64 = p->dtype == MOE_DTYPE_FP64;

    /* Tiles, enumerated (expert, row tile, column tile), are handed out dynamically: results do
     * not depend on which thread computes a tile (each tile is one thread's fixed-order work),
     * and on a shared machine a static split waits for the thread whose core is busy, which can
     * make a team slower than one thread. */
    int64_t num_tiles = 0;
    for (int64_t e = 0; e < E; ++e) num_tiles += tiles_of(expert_problem(call, e));
#pragma omp parallel num_threads((int)nthreads)
    {
        float *scratch = base + (int64_t)moe_thread_id() * THREAD_FLOATS;
        /* a dynamic loop hands each thread increasing t, so a cursor only moves forward */
        int64_t e = 0, e_first = 0;
        gg_problem_t pr = expert_problem(call, 0);
        int64_t e_tiles = tiles_of(pr);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tiles; ++t) {
            while (t >= e_first + e_tiles) {
                e_first += e_tiles;
                pr = expert_problem(call, ++e);
                e_tiles = tiles_of(pr);
            }
            const int64_t col_tiles = (pr.n + NC - 1) / NC, local = t - e_first;
            const int64_t i0 = local / col_tiles * MC, j0 = local % col_tiles * NC;
            if (fp64) tile_fp64(&pr, p->out_dtype, i0, j0);
            else tile_fp32(&pr, p->dtype, p->out_dtype, &kernels, scratch, i0, j0);
        }
    }
    return MOE_OK;
}

moe_status_t moe_grouped_gemm_fwd(void *y, const void *x, const void *weight,
                                  const int64_t *expert_offsets,
                                  const moe_grouped_gemm_params_t *params, void *workspace,
                                  size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_grouped_gemm_check_params(params, MOE_GG_OP_FWD));
    MOE_TRY(check_offsets(expert_offsets, params));
    MOE_TRY(check_gather_index(params));
    if (params->num_rows == 0 || params->out_features == 0) return MOE_OK;
    MOE_CHECK(y != NULL, "y must not be NULL");
    MOE_CHECK(params->in_features == 0 || (operand_ok(x, MOE_GG_GATHER_X, params) && weight),
              "x and weight must not be NULL");
    const gg_call_t call = {GG_FWD, params, (const char *)x, (const char *)weight, (char *)y,
                            expert_offsets};
    zero_tail(y, expert_offsets, params, params->out_features);
    return run(&call, workspace, workspace_bytes);
}

moe_status_t moe_grouped_gemm_dgrad(void *grad_x, const void *grad_y, const void *weight,
                                    const int64_t *expert_offsets,
                                    const moe_grouped_gemm_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_grouped_gemm_check_params(params, MOE_GG_OP_DGRAD));
    MOE_TRY(check_offsets(expert_offsets, params));
    MOE_TRY(check_gather_index(params));
    if (params->num_rows == 0 || params->in_features == 0) return MOE_OK;
    MOE_CHECK(grad_x != NULL, "grad_x must not be NULL");
    MOE_CHECK(params->out_features == 0 ||
                  (operand_ok(grad_y, MOE_GG_GATHER_DY, params) && weight),
              "grad_y and weight must not be NULL");
    const gg_call_t call = {GG_DGRAD, params, (const char *)grad_y, (const char *)weight,
                            (char *)grad_x, expert_offsets};
    zero_tail(grad_x, expert_offsets, params, params->in_features);
    return run(&call, workspace, workspace_bytes);
}

moe_status_t moe_grouped_gemm_wgrad(void *grad_weight, const void *x, const void *grad_y,
                                    const int64_t *expert_offsets,
                                    const moe_grouped_gemm_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_grouped_gemm_check_params(params, MOE_GG_OP_WGRAD));
    MOE_TRY(check_offsets(expert_offsets, params));
    MOE_TRY(check_gather_index(params));
    if (params->in_features == 0 || params->out_features == 0) return MOE_OK;
    MOE_CHECK(grad_weight != NULL, "grad_weight must not be NULL");
    MOE_CHECK(params->num_rows == 0 || (operand_ok(x, MOE_GG_GATHER_X, params) &&
                                        operand_ok(grad_y, MOE_GG_GATHER_DY, params)),
              "x and grad_y must not be NULL");
    const gg_call_t call = {GG_WGRAD, params, (const char *)x, (const char *)grad_y,
                            (char *)grad_weight, expert_offsets};
    return run(&call, workspace, workspace_bytes);
}

/* Shared with the CUDA entry point (grouped_gemm.cu): the GEMM's params, then glu_probs' own
 * check (glu_probs_math.h) of a = fc1's output [num_rows, out_features]. */
moe_status_t moe_grouped_gemm_glu_probs_fwd_check(const void *h, const void *a, const void *probs,
                                                  moe_dtype_t probs_dtype,
                                                  const moe_grouped_gemm_params_t *gemm,
                                                  const moe_glu_probs_params_t *glu,
                                                  int64_t *ffn) {
    MOE_TRY(moe_grouped_gemm_check_params(gemm, MOE_GG_OP_GLU_PROBS_FWD));
    MOE_CHECK(gemm->out_dtype == gemm->dtype,
              "out_dtype must equal dtype (%s): a is both fc1's output and the activation's input, "
              "got %s", moe_dtype_name(gemm->dtype), moe_dtype_name(gemm->out_dtype));
    MOE_CHECK(glu != NULL, "glu params must not be NULL");
    const int64_t n = gemm->out_features;
    if (glu->gated_linear_unit)
        MOE_CHECK(n >= 2 && n % 2 == 0,
                  "out_features must be 2F (even, >= 2) with gated_linear_unit, got %lld",
                  (long long)n);
    else
        MOE_CHECK(n >= 1, "out_features must be F >= 1, got %lld", (long long)n);
    *ffn = glu->gated_linear_unit ? n / 2 : n;
    return moe_gp_check_args(h, a, gemm->num_rows, *ffn, gemm->dtype, probs, probs_dtype, glu);
}

/* fc1 with glu_probs: on the CPU the op is the composition itself (a must be written anyway, the
 * backward needs it), so its bits are those of the two ops called apart by construction. A
 * gathered x goes to fc1 with the params (glu_probs reads a: num_rows rows either way). */
moe_status_t moe_grouped_gemm_glu_probs_fwd(void *h, void *a, const void *x, const void *weight,
                                            const int64_t *expert_offsets, const void *probs,
                                            moe_dtype_t probs_dtype,
                                            const moe_grouped_gemm_params_t *gemm,
                                            const moe_glu_probs_params_t *glu, void *workspace,
                                            size_t workspace_bytes, void *stream) {
    moe_clear_error();
    int64_t ffn = 0;
    MOE_TRY(moe_grouped_gemm_glu_probs_fwd_check(h, a, probs, probs_dtype, gemm, glu, &ffn));
    MOE_TRY(moe_grouped_gemm_fwd(a, x, weight, expert_offsets, gemm, workspace, workspace_bytes,
                                 stream));
    return moe_glu_probs_fwd(h, a, probs, gemm->num_rows, ffn, gemm->dtype, probs_dtype, glu, NULL,
                             0, stream);
}
