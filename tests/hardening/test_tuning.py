"""The core's tuning switches (csrc/tuning.h, moe_core.tuning): each environment variable is read
into its field, once, and again only on reload(); each switch reaches the kernel it names; no
workspace size depends on them."""
import ctypes
import os
import re

import pytest
import torch

import moe_core
from helpers.grouped_gemm import offsets_of
from moe_core import ops, tuning

# (variable, value, field, the field's value)
READS = [
    ("MOE_CORE_GEMM_KERNEL", "generic", "cpu_gemm_kernel", 1),
    ("MOE_CORE_GEMM_KERNEL", "avx512", "cpu_gemm_kernel", 2),
    ("MOE_CORE_GEMM_KERNEL", "fast", "cpu_gemm_kernel", 0),
    ("MOE_CORE_PDL", "0", "pdl", 0),
    ("MOE_CORE_PDL", "1", "pdl", 1),
    ("MOE_CORE_ROUTER_LANES", "0", "router_lanes", 0),
    ("MOE_CORE_UNPERMUTE_SLOTS", "0", "unpermute_slots", 0),
    ("MOE_GG_SM90_SPLIT_TAIL", "0", "gg_split_tail", 0),
    ("MOE_GG_SM90_SPLIT_TAIL", "1", "gg_split_tail", 2),
    ("MOE_GG_SM90_SPLIT_TAIL", "2", "gg_split_tail", 1),
    ("MOE_GG_SM90_EXPERT_MAPS", "0", "gg_expert_maps", 0),
    ("MOE_GG_SM90_TILE", "128", "gg_tile", 128),
    ("MOE_GG_SM90_TILE", "256", "gg_tile", 256),
    ("MOE_GG_SM90_TILE", "64", "gg_tile", 0),
    ("MOE_GG_SM90_WGRAD_BK", "32", "gg_wgrad_bk", 32),
    ("MOE_GG_SM90_WGRAD_BK", "64", "gg_wgrad_bk", 64),
    ("MOE_GG_SM90_WGRAD_BK", "16", "gg_wgrad_bk", 0),
    ("MOE_CORE_EXPERT_COPY_ROWS", "0", "expert_copy_rows", 0),
    ("MOE_CORE_EXPERT_COPY_ROWS", "1", "expert_copy_rows", 2),
    ("MOE_CORE_EXPERT_COPY_ROWS", "2", "expert_copy_rows", 1),
]


def test_every_field_has_a_variable_and_a_default():
    assert set(tuning.SWITCHES) == set(tuning.DEFAULTS)
    assert set(tuning.current()) == set(tuning.SWITCHES)


# (field, the field's value, its name) for every value the core holds
NAMES = [("cpu_gemm_kernel", 0, "auto"), ("cpu_gemm_kernel", 1, "generic"),
         ("cpu_gemm_kernel", 2, "avx512"), ("pdl", 0, "off"), ("pdl", 1, "on"),
         ("router_lanes", 0, "off"), ("router_lanes", 1, "on"), ("unpermute_slots", 0, "off"),
         ("unpermute_slots", 1, "on"), ("gg_expert_maps", 0, "off"),
         ("gg_split_tail", 0, "never"), ("gg_split_tail", 1, "auto"), ("gg_split_tail", 2, "always"),
         ("gg_expert_maps", 1, "on"), ("gg_tile", 0, "auto"), ("gg_tile", 128, "width_128"),
         ("gg_tile", 256, "width_256"), ("gg_wgrad_bk", 0, "auto"), ("gg_wgrad_bk", 32, "rows_32"),
         ("gg_wgrad_bk", 64, "rows_64"), ("expert_copy_rows", 0, "never"),
         ("expert_copy_rows", 1, "auto"), ("expert_copy_rows", 2, "always")]


def test_values_are_named_and_equal_their_numbers():
    assert set(tuning.SETTINGS) == set(tuning.SWITCHES)
    for field, number, name in NAMES:
        value = tuning.SETTINGS[field](number)
        assert str(value) == name and value == number and isinstance(value, int), field
    held = tuning.current()
    assert all(isinstance(v, tuning.SETTINGS[f]) for f, v in held.items()), held
    # a numeric field reads as its name, in the dict's repr too
    assert "CopyRows." in repr(held) and str(held["expert_copy_rows"]) in ("never", "auto",
                                                                          "always")


@pytest.mark.parametrize("name,value,field,expected", READS)
def test_each_variable_is_read_into_a_named_value(name, value, field, expected):
    unset = {n: None for n in tuning.SWITCHES.values()}
    with tuning.environment(**dict(unset, **{name: value})) as values:
        held = values[field]
        assert held is tuning.SETTINGS[field](expected), f"{name}={value}: {held!r}"
        assert (field, expected, str(held)) in NAMES


def test_unset_means_the_defaults():
    with tuning.environment(**{name: None for name in tuning.SWITCHES.values()}) as values:
        assert values == tuning.DEFAULTS
        assert tuning.current() == tuning.DEFAULTS


@pytest.mark.parametrize("name,value,field,expected", READS)
def test_each_variable_is_read_into_its_field(name, value, field, expected):
    unset = {n: None for n in tuning.SWITCHES.values()}
    with tuning.environment(**dict(unset, **{name: value})) as values:
        assert values[field] == expected, f"{name}={value}"
        others = {f: v for f, v in values.items() if f != field}
        assert others == {f: v for f, v in tuning.DEFAULTS.items() if f != field}


def test_read_once_until_reload(monkeypatch):
    before = tuning.current()
    try:
        monkeypatch.setenv("MOE_GG_SM90_TILE", "128" if before["gg_tile"] != 128 else "256")
        assert tuning.current() == before, "the core read its environment again on its own"
        assert tuning.reload()["gg_tile"] in (128, 256)
    finally:
        monkeypatch.undo()
        assert tuning.reload() == before


def test_environment_restores_the_variables_and_the_values():
    before, env = tuning.current(), os.environ.get("MOE_GG_SM90_WGRAD_BK")
    with tuning.environment(MOE_GG_SM90_WGRAD_BK="32"):
        assert os.environ["MOE_GG_SM90_WGRAD_BK"] == "32"
    assert os.environ.get("MOE_GG_SM90_WGRAD_BK") == env
    assert tuning.current() == before


def test_environment_rejects_an_unknown_variable():
    with pytest.raises(ValueError, match="MOE_GG_SM90_TILES"):
        with tuning.environment(MOE_GG_SM90_TILES="128"):
            pass


def test_environment_rejects_a_value_that_is_not_a_string():
    with pytest.raises(TypeError, match="MOE_GG_SM90_TILE=128"):
        with tuning.environment(MOE_GG_SM90_TILE=128):
            pass


def cpu_has_avx512f():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not cpu_has_avx512f(), reason="the default is the portable loop here too")
def test_cpu_gemm_kernel_takes_effect(tuning_env):
    """fp32 on an AVX-512 CPU: the default FMA kernel and the portable loop (a multiply and an
    add) round differently somewhere over 40 x 130 sums of 130 terms."""
    counts = [5, 0, 140]
    x = torch.randn(sum(counts), 130)
    w = torch.randn(3, 130, 40)
    off = offsets_of(counts)
    fma = ops.grouped_gemm(x, w, off)
    tuning_env("MOE_CORE_GEMM_KERNEL", "generic")
    assert not torch.equal(ops.grouped_gemm(x, w, off), fma)


# ---- CUDA: each switch reaches the kernel it names --------------------------------------------

def is_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def kernels(fn):
    """Names of the CUDA kernels fn launches (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


def has(names, pattern):
    return any(re.search(pattern, n) for n in names)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_router_lanes_switch_picks_the_kernel(tuning_env):
    logits = torch.randn(64, 128, device="cuda")
    names = kernels(lambda: ops.router_topk(logits, 8))
    assert has(names, "lanes_kernel") and not has(names, "warp32_kernel"), names
    tuning_env("MOE_CORE_ROUTER_LANES", "0")
    names = kernels(lambda: ops.router_topk(logits, 8))
    assert has(names, "warp32_kernel") and not has(names, "lanes_kernel"), names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_unpermute_slots_switch_picks_the_map(tuning_env):
    T, E, k, H = 64, 8, 2, 32
    m = torch.zeros(T, E, dtype=torch.bool)
    m.scatter_(1, torch.rand(T, E).argsort(dim=1)[:, :k], True)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    rows, _, idx, _, _ = torch.ops.moe_core.permute(x, m.cuda(), None, T * k, False, 0)
    names = kernels(lambda: torch.ops.moe_core.unpermute(rows, idx, T, None, None))
    assert has(names, "moe_token_slots_kernel") and not has(names, "token_rows"), names
    tuning_env("MOE_CORE_UNPERMUTE_SLOTS", "0")
    names = kernels(lambda: torch.ops.moe_core.unpermute(rows, idx, T, None, None))
    assert has(names, "moe_token_rows_count_kernel") and not has(names, "token_slots"), names


def gg_inputs(counts, K, N):
    x = torch.randn(sum(counts), K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(counts), N, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(counts), N, device="cuda", dtype=torch.bfloat16)
    return x, w, dy, offsets_of(counts, "cuda")


@pytest.mark.skipif(not is_hopper(), reason="the sm_90a kernel's switches")
def test_grouped_gemm_switches_pick_the_kernels(tuning_env):
    """MOE_GG_SM90_TILE picks the tile width, MOE_GG_SM90_WGRAD_BK wgrad's stage depth (the last
    template argument), MOE_GG_SM90_EXPERT_MAPS=0 skips the expert maps' kernel."""
    x, w, dy, off = gg_inputs([300, 0, 129, 40], 256, 512)
    for tile in ("128", "256"):
        tuning_env("MOE_GG_SM90_TILE", tile)
        names = kernels(lambda: ops.grouped_gemm(x, w, off, True))
        assert has(names, rf"gg_sm90_kernel<\s*{tile}\s*,"), names
    tuning_env("MOE_GG_SM90_TILE", None)
    for bk in ("32", "64"):
        tuning_env("MOE_GG_SM90_WGRAD_BK", bk)
        names = kernels(lambda: ops.grouped_gemm_wgrad(x, dy, off, True))
        assert has(names, rf"gg_sm90_kernel<[^>]*,\s*{bk}\s*>"), names
    names = kernels(lambda: ops.grouped_gemm_wgrad(x, dy, off, True))
    assert has(names, "gg_sm90_expert_maps_kernel"), names
    tuning_env("MOE_GG_SM90_EXPERT_MAPS", "0")
    names = kernels(lambda: ops.grouped_gemm_wgrad(x, dy, off, True))
    assert has(names, "gg_sm90_kernel") and not has(names, "expert_maps"), names


class GGParams(ctypes.Structure):
    """moe_grouped_gemm_params_t."""

    _fields_ = [("num_rows", ctypes.c_int64), ("num_experts", ctypes.c_int64),
                ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("trans_w", ctypes.c_int), ("dtype", ctypes.c_int), ("out_dtype", ctypes.c_int),
                ("gather_operand", ctypes.c_int), ("gather_index", ctypes.c_void_p),
                ("gather_rows", ctypes.c_int64)]


SETTINGS = [{}, {"MOE_GG_SM90_SPLIT_TAIL": "0"}, {"MOE_GG_SM90_SPLIT_TAIL": "1"},
            {"MOE_GG_SM90_TILE": "128", "MOE_GG_SM90_EXPERT_MAPS": "0", "MOE_GG_SM90_WGRAD_BK": "32"}]


@pytest.mark.skipif(not is_hopper(), reason="the sm_90a kernel's workspace")
def test_grouped_gemm_workspace_size_ignores_the_switches():
    """The workspace covers every setting: the same bytes under each, and room for the split wave
    at K = N = 512 (8 k blocks), which only the forced split (MOE_GG_SM90_SPLIT_TAIL=1) cuts."""
    lib = ctypes.CDLL(moe_core._C.__file__)
    size = lib.moe_cuda_grouped_gemm_workspace_size
    size.restype, size.argtypes = ctypes.c_size_t, [ctypes.POINTER(GGParams)]
    for K, N in ((512, 512), (4096, 512), (64, 64)):
        p = GGParams(1000, 8, K, N, 1, 3, 3)  # bf16 in and out
        sizes = []
        for setting in SETTINGS:
            with tuning.environment(**setting):
                sizes.append(size(ctypes.byref(p)))
        assert len(set(sizes)) == 1, (K, N, sizes)
        if K == 64:
            assert sizes[0] < 1 << 20, "no split can happen at one k block: the maps' bytes only"
        else:
            assert sizes[0] >= 1 << 20, f"K={K} N={N}: no room for the split wave"
