"""Shared pytest fixtures: devices, seeding, poisoned outputs, the router kernel on CUDA.

Code the tests import lives in helpers/; pyproject's ``pythonpath`` puts tests/ (``helpers``)
and the repository root (``benchmarks``, ``tools``, this checkout's ``moe_core``) on sys.path."""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
# A compile cache of this run's own: torch's caches key a compiled backward on the forward graph,
# not on the Python of an op's autograd formula, so a cache kept from an earlier tree would run
# that tree's backward (with a changed op schema, it fails; with changed math, it passes wrongly).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe_core_inductor_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
torch.backends.cuda.matmul.allow_tf32 = False  # parity: keep fp32 GEMMs in fp32 on both sides
torch.backends.cudnn.allow_tf32 = False

import moe_core  # noqa: E402,F401  (registers the ops)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def poison():
    """Outputs start as NaN / the dtype's max (helpers.grouped_gemm.poisoned), so unwritten rows
    show."""
    from helpers.grouped_gemm import poisoned

    with poisoned():
        yield


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def tuning_env():
    """Sets one of the core's tuning switches for a test: ``tuning_env("MOE_GG_SM90_TILE", "128")``
    (``None`` unsets it). The core reads its switches once (csrc/tuning.h), so every change is
    followed by a reload; afterwards the environment and the core's values are as before."""
    with pytest.MonkeyPatch.context() as mp:

        def set_switch(name, value):
            assert name in moe_core.tuning.SWITCHES.values(), f"{name} is no tuning switch"
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
            moe_core.tuning.reload()

        yield set_switch
    moe_core.tuning.reload()


@pytest.fixture(params=["lanes", "strided"])
def router_kernel(request, tuning_env):
    """The fused fp32 router's kernel on CUDA: the lanes kernel (rows of up to 256 experts,
    topk <= 127, groups of whole power-of-two runs of lanes), or the strided kernel (which serves
    the other rows), forced by MOE_CORE_ROUTER_LANES=0."""
    if request.param == "strided":
        tuning_env("MOE_CORE_ROUTER_LANES", "0")
    return request.param
