"""Float tolerances derived from the dtype, not tuned per test.

Two rules (docs/design.md, "Tolerances"):
* ``assert_close_ulps``: |ours - ref| <= n_ulps * eps(dtype) * max(|ref|, floor) elementwise, where
  n_ulps is the number of roundings the op does that its reference may do differently.
* ``assert_error_at_most``: our error against an fp64 truth is at most ``factor`` x the error of
  PyTorch's own computation in the same dtype (plus one ulp of slack at the output scale).

``router_prob_ulps`` is the first rule's n_ulps for router_topk's probs (tests/router/test_ops.py,
tests/fuzz/test_fuzz_router.py).
"""
import torch

EPS = {
    torch.float64: 2.0**-52,
    torch.float32: 2.0**-23,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
}


def eps(dtype: torch.dtype) -> float:
    return EPS[dtype]


def assert_close_ulps(ours, ref, n_ulps: float = 2, floor=0.0, dtype=None, msg: str = ""):
    """floor: a number, or a tensor of ref's shape (the magnitude each value is a cancellation of)."""
    dtype = dtype or ref.dtype
    ours64, ref64 = ours.detach().double().cpu(), ref.detach().double().cpu()
    assert ours64.shape == ref64.shape, f"{msg} shape {tuple(ours64.shape)} vs {tuple(ref64.shape)}"
    both_nan = ours64.isnan() & ref64.isnan()
    if isinstance(floor, torch.Tensor):
        scale = torch.maximum(ref64.abs(), floor.detach().double().cpu())
    else:
        scale = ref64.abs().clamp_min(floor)
    tol = n_ulps * eps(dtype) * scale
    diff = (ours64 - ref64).abs()
    bad = ~((diff <= tol) | both_nan)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{msg} {int(bad.sum())} of {bad.numel()} elements differ by more than {n_ulps} ulps "
            f"of {dtype}; first at {i}: ours {ours64[tuple(i)].item()!r} ref {ref64[tuple(i)].item()!r}"
        )


def assert_error_at_most(ours, torch_same_dtype, truth64, factor: float = 2.0, msg: str = ""):
    truth = truth64.double().cpu()
    ours_err = (ours.detach().double().cpu() - truth).abs().max().item()
    torch_err = (torch_same_dtype.detach().double().cpu() - truth).abs().max().item()
    slack = eps(ours.dtype) * truth.abs().max().item()
    assert ours_err <= factor * torch_err + slack, (
        f"{msg} our max error {ours_err:.3e} > {factor} x torch's {torch_err:.3e} + {slack:.3e}"
    )


def router_prob_ulps(dtype: torch.dtype, num_experts: int) -> float:
    """n_ulps for router_topk's probs against a torch reference: softmax-pre probs carry a sum over
    E experts whose rounding order differs from torch's vectorised sum (~sqrt(E) ulps); half dtypes
    are rounded once from a nearly equal fp32 value."""
    return 4 + num_experts**0.5 if dtype in (torch.float32, torch.float64) else 1


def cuda_cpu_fp64_ulps(num_experts: int) -> int:
    """n_ulps between the CUDA and CPU router kernels in fp64 compute: two orders of an E-term
    positive sum each err by at most (E - 1) ulps of the sum; exp/log1p/sqrt differ by at most
    2 ulps between CUDA and glibc, the division rounds once more."""
    return 2 * num_experts + 4
