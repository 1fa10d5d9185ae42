"""examples/finetune_hf_moe.py and benchmarks.bench_hf run on the CPU: the example's four
routes train on the same batches to the same losses, and the benchmark's smoke run prints the
decoder-layer and the sparse-MoE-block parts of each shape for each variant, their input
gradients matching HF's."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str) -> str:
    # the repository root first on the path: this checkout's moe_core for the example
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def _table(out: str) -> list:
    """The rows of the markdown table printed last, as lists of cells."""
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[1:]]


def test_finetune_example_runs_its_four_routes_to_the_same_losses():
    assert "--checkpoint" in _run("examples/finetune_hf_moe.py", "--help")
    out = _run("examples/finetune_hf_moe.py", "--steps", "3", "--batch", "2", "--seq", "32",
               "--hidden", "64", "--ffn", "32", "--experts", "8", "--topk", "2",
               "--corpus-bytes", "100000")
    rows = {r[0]: r for r in _table(out)}
    assert set(rows) == {"eager", "grouped_mm", "moe_core", "moe_core_block"}, out
    for route, (_, first, last, diff, tps) in rows.items():
        assert float(last) < float(first), route  # it trains
        assert float(diff) <= 1e-4, route  # the same losses as HF eager's, step by step
        assert float(tps.replace(",", "")) > 0
    assert "replaced 2 sparse-MoE blocks" in out


def test_finetune_example_raises_no_user_warning():
    # every UserWarning an error: a user's first run should print only the example's own output
    out = _run("-W", "error::UserWarning", "examples/finetune_hf_moe.py", "--routes",
               "moe_core,moe_core_block", "--steps", "2", "--batch", "2", "--seq", "32",
               "--hidden", "64", "--ffn", "32", "--experts", "8", "--topk", "2",
               "--corpus-bytes", "100000")
    assert {r[0] for r in _table(out)} == {"moe_core", "moe_core_block"}, out


def test_bench_hf_smoke_prints_layer_and_block_parts():
    out = _run("-m", "benchmarks.bench_hf", "--smoke")
    rows = _table(out)
    got = {(r[0], r[1], r[2]) for r in rows}
    want = {(s, p, v) for s in ("qwen3_30b_a3b", "mixtral") for p in ("layer", "block")
            for v in ("hf grouped_mm", "moe-core backend", "moe-core block")}
    assert got == want, out
    for r in rows:
        assert float(re.sub(r"[^0-9.]", "", r[3])) > 0
        assert float(r[5]) <= 1e-5, r  # input gradient vs HF grouped_mm's
