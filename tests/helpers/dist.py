"""Multi-process test harness: N ranks over gloo on the CPU, one thread each, or over NCCL, one
GPU each.

``run_ranks(fn, world, *args)`` spawns ``world`` processes (a free port on 127.0.0.1), runs
``fn(rank, world, *args)`` in each after ``init_process_group("gloo")`` and returns the ranks'
results in rank order. ``backend="nccl"`` gives rank r GPU r (``torch.cuda.set_device(r)``, the
group bound to it); ``env`` is set in every rank before its process group starts (switches NCCL
or NVSHMEM read when they start). Every collective has a timeout (``COLLECTIVE_TIMEOUT``), the
parent waits at most ``timeout`` seconds for all results, and a rank that fails or is still
running when another has failed is killed and reported: no test leaves a rank waiting in a
collective, nor in a device-side wait that has no timeout of its own (NVSHMEM's exchanges).
"""
import datetime
import os
import queue
import socket
import traceback
import warnings
from typing import Dict, Optional

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, results, args, backend, env, collective_timeout):
    try:
        warnings.simplefilter("ignore")
        os.environ.update(env)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        timeout = datetime.timedelta(seconds=collective_timeout)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                    device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        try:
            out = fn(rank, world, *args)
        finally:
            pass
        results.put((rank, "ok", out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported to the parent, whatever it is)
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 300.0, backend: str = "gloo",
              env: Optional[Dict[str, str]] = None,
              collective_timeout: float = COLLECTIVE_TIMEOUT):
    """Results of ``fn(rank, world, *args)`` on ``world`` ranks, in rank order: gloo ranks on
    the CPU, or with ``backend="nccl"`` one GPU per rank (rank r on GPU r). ``env``: variables
    set in every rank before its process group starts. ``collective_timeout``: seconds a
    collective of the default group waits for the others before it raises (tests of failures
    shorten it, so a rank left in a collective shows within seconds).

    Raises AssertionError with the failing rank's traceback if any rank raised, and names the
    ranks that were still running (left in a collective) when the first failure arrived."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: run_ranks runs 'gloo' or 'nccl'")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args, backend,
                                              dict(env or {}), collective_timeout),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got, errors = {}, {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(got) + len(errors) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got) - set(errors))} "
                                     f"did not finish within {timeout} s")
            try:
                rank, status, value = results.get(timeout=min(left, 5.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in got and r not in errors]
                if dead:
                    raise AssertionError(f"ranks {dead} died (exit codes "
                                         f"{[procs[r].exitcode for r in dead]})")
                continue
            if status == "ok":
                got[rank] = value
            else:
                errors[rank] = value
                break
        if errors:
            rank, tb = next(iter(errors.items()))
            stuck = [r for r in range(world) if r not in got and r != rank]
            raise AssertionError(f"rank {rank} failed (ranks {stuck} were still running and are "
                                 f"stopped):\n{tb}")
        for p in procs:
            p.join(timeout=COLLECTIVE_TIMEOUT)
        return [got[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
