/* test_tuning.c: the tuning switches (tuning.h) come from the environment, once, and only on
 * request again: every variable's values, the defaults, and values that mean the default. */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <stdlib.h>

#include "ctest.h"
#include "tuning.h"

static const char *const names[] = {
    "MOE_CORE_GEMM_KERNEL",     "MOE_CORE_PDL",           "MOE_CORE_ROUTER_LANES",
    "MOE_CORE_UNPERMUTE_SLOTS", "MOE_GG_SM90_SPLIT_TAIL", "MOE_GG_SM90_EXPERT_MAPS",
    "MOE_GG_SM90_TILE",         "MOE_GG_SM90_WGRAD_BK",   "MOE_CORE_EXPERT_COPY_ROWS"};
#define NUM_NAMES (sizeof names / sizeof names[0])

static void unset_all(void) {
    for (size_t i = 0; i < NUM_NAMES; ++i) unsetenv(names[i]);
}

static int is_default(moe_tuning_t t) {
    return t.cpu_gemm_kernel == MOE_TUNING_GEMM_AUTO && t.pdl == 1 && t.router_lanes == 1 &&
           t.unpermute_slots == 1 && t.gg_split_tail == MOE_TUNING_SPLIT_AUTO &&
           t.gg_expert_maps == 1 && t.gg_tile == 0 && t.gg_wgrad_bk == 0 &&
           t.expert_copy_rows == MOE_TUNING_COPY_AUTO;
}

static void test_tuning_defaults(void) {
    unset_all();
    moe_tuning_reload();
    CHECK(is_default(moe_tuning_get()), "unset variables must give the defaults");
    CHECK(is_default(moe_tuning_get()), "a second get()");
}

static void test_tuning_every_switch(void) {
    unset_all();
    setenv("MOE_CORE_GEMM_KERNEL", "generic", 1);
    setenv("MOE_CORE_PDL", "0", 1);
    setenv("MOE_CORE_ROUTER_LANES", "0", 1);
    setenv("MOE_CORE_UNPERMUTE_SLOTS", "0", 1);
    setenv("MOE_GG_SM90_SPLIT_TAIL", "0", 1);
    setenv("MOE_GG_SM90_EXPERT_MAPS", "0", 1);
    setenv("MOE_GG_SM90_TILE", "128", 1);
    setenv("MOE_GG_SM90_WGRAD_BK", "32", 1);
    setenv("MOE_CORE_EXPERT_COPY_ROWS", "0", 1);
    moe_tuning_reload();
    moe_tuning_t t = moe_tuning_get();
    CHECK(t.cpu_gemm_kernel == MOE_TUNING_GEMM_GENERIC, "gemm kernel %d", t.cpu_gemm_kernel);
    CHECK(t.pdl == 0 && t.router_lanes == 0 && t.unpermute_slots == 0, "pdl / lanes / slots");
    CHECK(t.gg_split_tail == MOE_TUNING_SPLIT_NEVER, "split tail %d", t.gg_split_tail);
    CHECK(t.gg_expert_maps == 0 && t.gg_tile == 128 && t.gg_wgrad_bk == 32, "maps / tile / bk");
    CHECK(t.expert_copy_rows == MOE_TUNING_COPY_NEVER, "copy rows %d", t.expert_copy_rows);
    setenv("MOE_CORE_GEMM_KERNEL", "avx512", 1);
    setenv("MOE_GG_SM90_SPLIT_TAIL", "1", 1);
    setenv("MOE_GG_SM90_TILE", "256", 1);
    setenv("MOE_GG_SM90_WGRAD_BK", "64", 1);
    setenv("MOE_CORE_EXPERT_COPY_ROWS", "1", 1);
    moe_tuning_reload();
    t = moe_tuning_get();
    CHECK(t.cpu_gemm_kernel == MOE_TUNING_GEMM_AVX512, "gemm kernel %d", t.cpu_gemm_kernel);
    CHECK(t.gg_split_tail == MOE_TUNING_SPLIT_ALWAYS, "split tail %d", t.gg_split_tail);
    CHECK(t.gg_tile == 256 && t.gg_wgrad_bk == 64, "tile %d bk %d", t.gg_tile, t.gg_wgrad_bk);
    CHECK(t.expert_copy_rows == MOE_TUNING_COPY_ALWAYS, "copy rows %d", t.expert_copy_rows);
    unset_all();
    moe_tuning_reload();
}

/* values outside each switch's set mean the default, as before the switches moved here */
static void test_tuning_other_values_mean_default(void) {
    unset_all();
    setenv("MOE_CORE_GEMM_KERNEL", "fast", 1);
    setenv("MOE_CORE_PDL", "1", 1);
    setenv("MOE_CORE_ROUTER_LANES", "yes", 1);
    setenv("MOE_CORE_UNPERMUTE_SLOTS", "", 1);
    setenv("MOE_GG_SM90_SPLIT_TAIL", "01", 1);
    setenv("MOE_GG_SM90_EXPERT_MAPS", "00", 1);
    setenv("MOE_GG_SM90_TILE", "64", 1);
    setenv("MOE_GG_SM90_WGRAD_BK", "48", 1);
    setenv("MOE_CORE_EXPERT_COPY_ROWS", "2", 1);
    moe_tuning_reload();
    CHECK(is_default(moe_tuning_get()), "unrecognised values must give the defaults");
    setenv("MOE_CORE_PDL", "0ff", 1); /* the on / off switches look at the first character */
    moe_tuning_reload();
    CHECK(moe_tuning_get().pdl == 0, "MOE_CORE_PDL=0ff");
    unset_all();
    moe_tuning_reload();
}

/* read once: a change of the environment is not seen until reload() */
static void test_tuning_read_once(void) {
    unset_all();
    moe_tuning_reload();
    setenv("MOE_GG_SM90_TILE", "128", 1);
    CHECK(moe_tuning_get().gg_tile == 0, "the environment was read again without reload()");
    moe_tuning_reload();
    CHECK(moe_tuning_get().gg_tile == 128, "reload() did not read the environment");
    unset_all();
    moe_tuning_reload();
}

void ctest_register_tuning(void) {
    ctest_add("tuning_defaults", test_tuning_defaults);
    ctest_add("tuning_every_switch", test_tuning_every_switch);
    ctest_add("tuning_other_values_mean_default", test_tuning_other_values_mean_default);
    ctest_add("tuning_read_once", test_tuning_read_once);
}
