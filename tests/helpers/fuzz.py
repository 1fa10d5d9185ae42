"""Shared pieces of the property-based (hypothesis) fuzz tier, tests/fuzz/: the settings profiles,
tensor builders and comparisons. Importing this module registers the profiles and loads one.

Profiles (pick one with MOE_CORE_FUZZ_PROFILE; the default is "ci"):
* ci        a bounded number of examples per property, derandomized (the same examples on every
            run, so CI is reproducible), no deadline (the sanitizer build is slow), no database.
* thorough  many more examples, random each run, for local bug hunting; a failure prints the
            `@reproduce_failure` blob to replay it.

Inputs are built by torch from a seed that hypothesis draws (with the shapes, dtypes, options and
the rates of ties and special values), so large tensors stay cheap and still shrink to small ones.
"""
import math
import os

import torch
from hypothesis import HealthCheck, settings

from helpers.tolerances import assert_close_ulps

settings.register_profile(
    "ci", max_examples=40, derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "thorough", max_examples=1000, derandomize=False, deadline=None, database=None,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("MOE_CORE_FUZZ_PROFILE", "ci"))

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SPECIALS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grid(shape, g, lo=-64, hi=64, step=0.125, dtype=torch.float32):
    """Values k * step, k an integer in [lo, hi]: exact in every float dtype (|k| <= 256 at step
    1/8), with exact ties whenever the range is narrow and no near-ties (distinct values are a
    whole step apart)."""
    k = torch.randint(lo, hi + 1, tuple(shape), generator=g, dtype=torch.int64)
    return (k.to(torch.float64) * step).to(dtype)


def sprinkle(x, g, rate: float, kinds):
    """x with a fraction `rate` of its elements replaced by special values drawn from kinds."""
    if rate <= 0 or x.numel() == 0 or not kinds:
        return x
    x = x.clone()
    hit = torch.rand(x.shape, generator=g) < rate
    pick = torch.randint(0, len(kinds), x.shape, generator=g)
    for i, kind in enumerate(kinds):
        x[hit & (pick == i)] = SPECIALS[kind]
    return x


def assert_bitwise(ours, ref, msg=""):
    """Same dtype, shape and bits (NaN matches NaN of any sign or payload)."""
    assert ours.dtype == ref.dtype, f"{msg}: dtype {ours.dtype} vs {ref.dtype}"
    assert ours.shape == ref.shape, f"{msg}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    if ours.is_floating_point():
        same = (ours == ref) | (ours.isnan() & ref.isnan())
    else:
        same = ours == ref
    if not bool(same.all()):
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{msg}: {int((~same).sum())} of {ours.numel()} differ; first at {i}: "
                             f"ours {ours[tuple(i)].item()!r} ref {ref[tuple(i)].item()!r}")


def assert_close_or_same_special(ours, ref, n_ulps, dtype=None, floor=1e-30, msg=""):
    """Where the reference is NaN or infinite, ours must be the same special value; elsewhere
    within n_ulps (tests/helpers/tolerances.py's rule)."""
    assert ours.shape == ref.shape, f"{msg}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    o, r = ours.detach().double(), ref.detach().double()
    special = ~torch.isfinite(r)
    assert_bitwise(o[special], r[special], f"{msg} (special values)")
    assert_close_ulps(o[~special], r[~special], n_ulps=n_ulps, floor=floor,
                      dtype=dtype or ref.dtype, msg=msg)
