/*
 * tuning.c: reads the tuning switches (tuning.h) from the environment, once.
 *
 * The first moe_tuning_get() runs the read under C11 call_once, so concurrent first calls read
 * the environment once and all see its result. Each field lives in an atomic int: an op reads a
 * consistent-enough copy (every field is whole) even while a test calls moe_tuning_reload().
 * Unrecognised values mean the default, as an unset variable does.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>

#include "tuning.h"

static once_flag tuning_once = ONCE_FLAG_INIT;

static struct {
    atomic_int cpu_gemm_kernel, pdl, router_lanes, unpermute_slots, gg_split_tail,
        gg_expert_maps, gg_tile, gg_wgrad_bk, expert_copy_rows;
} tuning;

/* 1 when the variable is set and its value starts with `c` */
static int starts_with(const char *name, char c) {
    const char *v = getenv(name);
    return v != NULL && v[0] == c;
}

/* 1 when the variable is set to exactly `value` */
static int equals(const char *name, const char *value) {
    const char *v = getenv(name);
    return v != NULL && strcmp(v, value) == 0;
}

/* the variable's integer value when it is one of a or b, else 0 (the default) */
static int one_of(const char *name, int a, int b) {
    const char *v = getenv(name);
    const int n = v != NULL ? atoi(v) : 0;
    return n == a || n == b ? n : 0;
}

static void tuning_read(void) {
    int gemm = MOE_TUNING_GEMM_AUTO;
    if (equals("MOE_CORE_GEMM_KERNEL", "generic")) gemm = MOE_TUNING_GEMM_GENERIC;
    if (equals("MOE_CORE_GEMM_KERNEL", "avx512")) gemm = MOE_TUNING_GEMM_AVX512;
    int split = MOE_TUNING_SPLIT_AUTO;
    if (equals("MOE_GG_SM90_SPLIT_TAIL", "0")) split = MOE_TUNING_SPLIT_NEVER;
    if (equals("MOE_GG_SM90_SPLIT_TAIL", "1")) split = MOE_TUNING_SPLIT_ALWAYS;
    int copy = MOE_TUNING_COPY_AUTO;
    if (equals("MOE_CORE_EXPERT_COPY_ROWS", "0")) copy = MOE_TUNING_COPY_NEVER;
    if (equals("MOE_CORE_EXPERT_COPY_ROWS", "1")) copy = MOE_TUNING_COPY_ALWAYS;
    const memory_order r = memory_order_relaxed;
    atomic_store_explicit(&tuning.cpu_gemm_kernel, gemm, r);
    atomic_store_explicit(&tuning.pdl, !starts_with("MOE_CORE_PDL", '0'), r);
    atomic_store_explicit(&tuning.router_lanes, !starts_with("MOE_CORE_ROUTER_LANES", '0'), r);
    atomic_store_explicit(&tuning.unpermute_slots, !starts_with("MOE_CORE_UNPERMUTE_SLOTS", '0'),
                          r);
    atomic_store_explicit(&tuning.gg_split_tail, split, r);
    atomic_store_explicit(&tuning.gg_expert_maps, !equals("MOE_GG_SM90_EXPERT_MAPS", "0"), r);
    atomic_store_explicit(&tuning.gg_tile, one_of("MOE_GG_SM90_TILE", 128, 256), r);
    atomic_store_explicit(&tuning.gg_wgrad_bk, one_of("MOE_GG_SM90_WGRAD_BK", 32, 64), r);
    atomic_store_explicit(&tuning.expert_copy_rows, copy, r);
}

moe_tuning_t moe_tuning_get(void) {
    call_once(&tuning_once, tuning_read);
    const memory_order r = memory_order_relaxed;
    moe_tuning_t t;
    t.cpu_gemm_kernel = atomic_load_explicit(&tuning.cpu_gemm_kernel, r);
    t.pdl = atomic_load_explicit(&tuning.pdl, r);
    t.router_lanes = atomic_load_explicit(&tuning.router_lanes, r);
    t.unpermute_slots = atomic_load_explicit(&tuning.unpermute_slots, r);
    t.gg_split_tail = atomic_load_explicit(&tuning.gg_split_tail, r);
    t.gg_expert_maps = atomic_load_explicit(&tuning.gg_expert_maps, r);
    t.gg_tile = atomic_load_explicit(&tuning.gg_tile, r);
    t.gg_wgrad_bk = atomic_load_explicit(&tuning.gg_wgrad_bk, r);
    t.expert_copy_rows = atomic_load_explicit(&tuning.expert_copy_rows, r);
    return t;
}

void moe_tuning_reload(void) {
    call_once(&tuning_once, tuning_read); /* a later first get() must not read over this one */
    tuning_read();
}
