"""Where a step's GPU time goes, from the profiler: GEMM kernels, the other kernels, and the time
the GPU sits idle inside the step.

    cuda_kernels(prof)                   the (start, end, name) of every GPU activity (us)
    busy_us(intervals)                   the union of the intervals' lengths
    is_gemm(name)                        a matrix-multiply kernel, ours or a library's
    profile_steps(step, cleanup, reps)   StepKernels per step, over reps steps queued back to back

The overhead ratio the layer's goals use is a step's queued time over its GEMM kernels' time:
1.0 would be a layer that is nothing but its GEMMs.
"""
import re
from typing import Callable, List, NamedTuple, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

# our grouped GEMMs (the Hopper kernel, the portable tensor-core and SIMT ones) and the
# libraries' (cuBLAS's xmma / nvjet kernels, CUTLASS's, which torch._grouped_mm runs); the
# GEMMs' helper kernels (tile prefix, tensor maps, zero tails, row gathers) are "other"
_GEMM = re.compile(r"gg_sm90_kernel|moe_gg_mma_kernel|moe_gg_simt_kernel|gemm|nvjet|cutlass"
                   r"|xmma|wgmma", re.IGNORECASE)


def is_gemm(name: str) -> bool:
    """Whether a kernel is a matrix multiply (by its name)."""
    return bool(_GEMM.search(name))


def cuda_kernels(prof) -> List[Tuple[float, float, str]]:
    """(start, end, name), in us, of every GPU activity (kernels, copies, fills) a profile saw,
    in start order."""
    return sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CUDA)


def busy_us(intervals) -> float:
    """The length of the union of ``(start, end, ...)`` intervals, sorted by start."""
    busy, end = 0.0, None
    for a, b, *_ in intervals:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy


class StepKernels(NamedTuple):
    """One step's GPU time, ms, the mean over the profiled steps."""
    gemm_ms: float   # GEMM kernels, summed
    other_ms: float  # every other kernel, copy and fill, summed
    idle_ms: float   # the span from the first activity to the last with nothing running
    span_ms: float   # first activity's start to the last one's end


def profile_steps(step: Callable[[], None], cleanup: Callable[[], None], reps: int) -> StepKernels:
    """:class:`StepKernels` of ``step`` over ``reps`` steps queued back to back (``cleanup()``
    after each, host work only), after one warm-up step: the GPU's view of a training loop. The
    profiler's own host cost (CUPTI callbacks at each launch) can add idle time where the host is
    the bottleneck; the kernel times are exact."""
    step()
    cleanup()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
            cleanup()
        torch.cuda.synchronize()
    acts = cuda_kernels(prof)
    if not acts:
        return StepKernels(*(float("nan"),) * 4)
    gemm = sum(b - a for a, b, name in acts if is_gemm(name))
    total = sum(b - a for a, b, _ in acts)
    span = max(b for _, b, _ in acts) - acts[0][0]
    idle = span - busy_us(acts)
    return StepKernels(gemm / reps / 1e3, (total - gemm) / reps / 1e3, idle / reps / 1e3,
                       span / reps / 1e3)
