"""How every benchmark and tool times and measures: CUDA events on a GPU, the wall clock on the CPU.

    sync(dev)                               wait for the device (no-op on the CPU)
    time_call(fn, dev)                      ms of one call, events waited for
    median_ms(fn, dev, iters, warmup)       median of time_call over iters calls, after a warm-up
    time_queued(fn, warmup, reps)           median ms of reps calls queued back to back (CUDA)
    time_sustained(fn, seconds, ...)        the same over at least `seconds` of calls, with the
                                            SM clock and the power sampled meanwhile
    time_graph_replay(step, ...)            median ms of a CUDA graph of one call, replayed
    host_issue_ms(fn, ...)                  the host's own time to issue one call (GPU kept busy)
    GpuSampler                              SM clock and board power, sampled (nvidia-smi)
    round_times(variants, dev, ...)         ms of every call of each variant, interleaved rounds
                                            (one call of each a round)
    time_interleaved(variants, dev, ...)    their medians, max over the ranks
    paired_times(fn_a, fn_b, iters)         best and median seconds of two, called alternately
    time_round_robin(fns, rounds, preheat)  the same after a pre-heat, no clean-up (CUDA)
    time_turns(fns, rounds, switch)         round-robin, each call behind a sleep kernel that
                                            hides the host's launch work (CUDA A/B tools)
    peak_bytes(run, cleanup, dev)           peak allocated during run above what was there before
    held_after_forward(forward, ...)        allocated right after a forward above the base
    copy_bandwidth(dev, iters)              device-to-device copy bytes/s
    dense_ceiling(dev, reps, ...)           TFLOP/s of a square bf16 torch.mm (a burst)
    sustained_ceiling(seconds)              the same queued for as long as a layer's
                                            measurement, with its clock and power

Method (docs/design.md): warm-up first; variants that are compared run in turns
(the clock drifts under load, so timing one after another favours whichever ran first); every
timed call is waited for before the next; medians.
"""
import math
import shutil
import statistics
import subprocess
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch


def sync(dev) -> None:
    """Waits for ``dev`` (a torch.device or "cuda" / "cpu"); nothing on the CPU."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def time_call(fn: Callable[[], None], dev) -> float:
    """ms of one call: CUDA events (waited for), or the wall clock on the CPU."""
    if torch.device(dev).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn: Callable[[int], None], dev, iters: int, warmup: int = 0) -> float:
    """Median ms of ``fn(i)`` for i in range(iters), each call timed alone (:func:`time_call`),
    after ``warmup`` calls ``fn(0), fn(1), ...``."""
    for i in range(warmup):
        fn(i)
    sync(dev)
    return statistics.median(time_call(lambda: fn(i), dev) for i in range(iters))


def time_queued(fn: Callable[[], None], warmup: int, reps: int) -> float:
    """Median ms of ``reps`` CUDA calls queued back to back, each between its own events, one
    wait at the end (the host never stalls the queue)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


class GpuSampler:
    """SM clock (MHz) and board power (W) of GPU ``index``, sampled every ``period_s`` by a
    background thread while the ``with`` block runs (``nvidia-smi``; nothing where it is
    missing). Under sustained load a card sits at its power limit and lowers its clock, so a
    time means little without the clock it ran at."""

    def __init__(self, index: int = 0, period_s: float = 0.05):
        self.index, self.period_s = index, period_s
        self.clocks: List[float] = []
        self.watts: List[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._smi = shutil.which("nvidia-smi")

    def _sample(self) -> None:
        cmd = [self._smi, "-i", str(self.index), "--query-gpu=clocks.sm,power.draw",
               "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
                mhz, watts = (float(v) for v in out.strip().split(","))
                self.clocks.append(mhz)
                self.watts.append(watts)
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self._stop.wait(self.period_s)

    def __enter__(self) -> "GpuSampler":
        if self._smi:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def mhz(self) -> float:
        """Median SM clock of the samples (nan: none)."""
        return statistics.median(self.clocks) if self.clocks else float("nan")

    @property
    def power_w(self) -> float:
        """Median board power of the samples (nan: none)."""
        return statistics.median(self.watts) if self.watts else float("nan")


class Sustained(NamedTuple):
    ms: float       # median ms of one call
    calls: int      # calls timed
    mhz: float      # median SM clock meanwhile
    power_w: float  # median board power meanwhile


def time_sustained(fn: Callable[[], None], seconds: float, min_reps: int = 5,
                   warmup: int = 1) -> Sustained:
    """:func:`time_queued` over enough calls to keep the GPU busy for about ``seconds`` (at least
    ``min_reps``), the clock and power sampled meanwhile (:class:`GpuSampler`): a step's time in
    a training loop, where the card runs at the clock its power limit allows, not at the clock of
    a short burst."""
    for _ in range(warmup):
        fn()
    one = time_queued(fn, 0, 2)
    reps = max(min_reps, math.ceil(seconds * 1e3 / max(one, 1e-3)))
    with GpuSampler(torch.cuda.current_device()) as smp:
        ms = time_queued(fn, 0, reps)
    return Sustained(ms, reps, smp.mhz, smp.power_w)


def time_graph_replay(step: Callable[[], None], cleanup: Callable[[], None], warmup: int,
                      reps: int) -> float:
    """Median ms of one ``step`` captured in a CUDA graph and replayed back to back
    (:func:`time_queued` of the replays): the step with no host work at all. ``step`` is warmed
    up on a side stream first (lazy initialisation, allocator pools, autotuning), ``cleanup()``
    runs before the capture (e.g. to set parameter gradients to None, so that the captured
    backward allocates them in the graph's pool) and after the replays; the graph and its pool
    are freed before returning. A step that cannot be captured (a host sync) raises."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 2)):
            step()
            cleanup()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
        return time_queued(graph.replay, 1, reps)
    finally:
        torch.cuda.synchronize()
        cleanup()
        del graph
        torch.cuda.empty_cache()


def host_issue_ms(fn: Callable[[], None], cleanup: Callable[[], None], reps: int,
                  busy_ms: float = 200.0) -> Tuple[float, bool]:
    """(median ms, waited) of the host's own time to issue one ``fn()``: each call made while a
    sleep kernel of about ``busy_ms`` keeps the GPU busy, so the host never waits for a free
    launch queue slot nor for the device, and the wall clock measures Python, autograd, the
    binding and the launches alone. ``waited``: some call took longer than the sleep (a host
    sync inside waited for the device: the time is not the host's own then). ``cleanup()`` runs
    after each call, outside the time."""
    fn()
    cleanup()
    torch.cuda.synchronize()
    # the sleep kernel counts clock cycles: calibrate cycles per ms once, at the current clock
    calib = 10_000_000
    cycles = int(busy_ms * calib / max(time_call(lambda: torch.cuda._sleep(calib), "cuda"), 1e-3))
    times = []
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        cleanup()
        torch.cuda.synchronize()
    return statistics.median(times), max(times) >= 0.9 * busy_ms


Variant = Tuple[Callable[[int], None], Callable[[], None]]  # (run(round), cleanup)


def _nothing() -> None:
    pass


def round_times(variants: Dict[str, Variant], dev, warmup: int,
                rounds: int) -> Dict[str, List[float]]:
    """ms of every call of each variant over ``rounds`` interleaved rounds (one call of each per
    round, ``run(round)`` timed alone, its ``cleanup()`` after it, outside the timed region),
    after ``warmup`` rounds."""
    for i in range(warmup):
        for run, cleanup in variants.values():
            run(i)
            cleanup()
    sync(dev)
    times: Dict[str, List[float]] = {k: [] for k in variants}
    for i in range(rounds):
        for name, (run, cleanup) in variants.items():
            times[name].append(time_call(lambda: run(i), dev))
            cleanup()
    return times


def time_interleaved(variants: Dict[str, Variant], dev, warmup: int,
                     rounds: int) -> Dict[str, float]:
    """Median ms of each variant over ``rounds`` interleaved rounds (:func:`round_times`) after
    ``warmup`` rounds; under torch.distributed the maximum over the ranks of each median."""
    times = round_times(variants, dev, warmup, rounds)
    med = torch.tensor([statistics.median(times[k]) for k in variants], dtype=torch.float64,
                       device=dev)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return dict(zip(variants, med.tolist()))


def paired_times(fn_a: Callable[[], object], fn_b: Callable[[], object], iters: int,
                 dev="cpu") -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """(best, median) seconds of two functions called alternately, after 2 warm-up rounds, so
    that load from other processes on a shared machine hits both alike; the best is the less
    noisy there."""
    t = round_times({"a": (lambda i: fn_a(), _nothing), "b": (lambda i: fn_b(), _nothing)}, dev,
                    2, iters)
    return tuple((min(v) / 1e3, statistics.median(v) / 1e3) for v in (t["a"], t["b"]))


def time_round_robin(fns: Dict[str, Callable[[], object]], rounds: int = 20,
                     preheat_s: float = 0.5) -> Dict[str, float]:
    """Median ms of each CUDA callable, timed round-robin (one call of each per round), after a
    pre-heat of about ``preheat_s`` seconds of the first: the card's clock drifts down under
    sustained load, and timing variants one after another would favour whichever ran first."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    first = next(iter(fns.values()))
    one = time_call(first, "cuda")
    for _ in range(max(1, int(preheat_s * 1e3 / max(one, 1e-3)))):
        first()
    ts = round_times({k: (lambda i, fn=fn: fn(), _nothing) for k, fn in fns.items()}, "cuda", 0,
                     rounds)
    return {k: statistics.median(v) for k, v in ts.items()}


def time_turns(fns: Dict[str, Tuple[bool, Callable[[], object]]], rounds: int,
               switch: Optional[Callable[[bool], None]] = None) -> Dict[str, float]:
    """fns: name -> (option on?, callable); median ms of each CUDA callable, in turns, each call
    behind a sleep kernel so its launch is queued before the GPU gets to it (the host's work,
    e.g. reading an environment option, is hidden). ``switch(on)`` sets the option before each
    call (None: no option, the flags are ignored); it is left off at the end."""
    def set_option(on: bool) -> None:
        if switch is not None:
            switch(on)

    for on, fn in fns.values():
        set_option(on)
        fn()
    torch.cuda.synchronize()
    ts: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, (on, fn) in fns.items():
            set_option(on)
            torch.cuda._sleep(1_000_000)  # the launch below is queued before the GPU gets to it
            ts[k].append(time_call(fn, "cuda"))
    set_option(False)
    return {k: statistics.median(v) for k, v in ts.items()}


# ---- memory -----------------------------------------------------------------------------------
def peak_bytes(run: Callable[[], None], cleanup: Callable[[], None], dev) -> float:
    """Peak allocated bytes during ``run`` above what was allocated before (CUDA only; nan on the
    CPU); ``cleanup`` runs after the measurement."""
    if torch.device(dev).type != "cuda":
        return float("nan")
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run()
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    cleanup()
    return float(peak)


def held_after_forward(forward: Callable[[], Tuple[torch.Tensor, torch.Tensor]],
                       grad: torch.Tensor, cleanup: Callable[[], None], dev) -> float:
    """Bytes allocated right after one forward (``forward()`` returns (output, input)) above what
    was allocated before it (CUDA only; nan on the CPU); the backward then runs with ``grad`` and
    ``cleanup`` frees the gradients."""
    if torch.device(dev).type != "cuda":
        return float("nan")
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    out, x = forward()
    sync(dev)
    held = torch.cuda.memory_allocated(dev) - base
    out.backward(grad)
    del out, x
    cleanup()
    return float(held)


# ---- ceilings ---------------------------------------------------------------------------------
def copy_bandwidth(dev, iters: int) -> float:
    """Bytes/s of a device-to-device copy (read + write) of 1 GiB of fp32 (64 MiB on the CPU),
    median of ``iters`` after 3 warm-up copies."""
    n = 1 << 28 if torch.device(dev).type == "cuda" else 1 << 24
    a = torch.randn(n, device=dev)
    b = torch.empty_like(a)
    ms = median_ms(lambda i: b.copy_(a), dev, iters, warmup=3)
    return 2 * a.numel() * 4 / (ms / 1e3)


def dense_ceiling(dev, reps: int, n: Optional[int] = None, queued: bool = False) -> float:
    """TFLOP/s of a square bf16 ``torch.mm`` (n = 8192 on CUDA, 512 on the CPU by default).
    Default: random fp32 made bf16 (seeded), 10 warm-up calls, median of ``reps`` calls timed
    alone. ``queued``: bf16 drawn directly, 3 warm-up calls, ``reps`` calls queued back to back
    (:func:`time_queued`, CUDA only)."""
    cuda = torch.device(dev).type == "cuda"
    n = n or (8192 if cuda else 512)
    if queued:
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        ms = time_queued(lambda: torch.mm(a, b), 3, reps)
    else:
        gen = torch.Generator(device=dev).manual_seed(7)
        a = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
        ms = median_ms(lambda i: torch.mm(a, b), dev, reps, warmup=10)
    return 2.0 * n**3 / ms / 1e9


def sustained_ceiling(seconds: float, n: int = 8192) -> Sustained:
    """A square bf16 ``torch.mm`` (n x n) queued for about ``seconds`` with the clock and power
    sampled (:func:`time_sustained`); ``.ms`` is the median call. A layer's measurement keeps the
    card as busy as this, so its % of this ceiling compares like with like; the burst ceiling
    (:func:`dense_ceiling`) is what a card reaches before it heats up."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return time_sustained(lambda: torch.mm(a, b), seconds, warmup=3)


def sustained_tflops(res: Sustained, n: int = 8192) -> float:
    """TFLOP/s of :func:`sustained_ceiling`'s result."""
    return 2.0 * n**3 / res.ms / 1e9
