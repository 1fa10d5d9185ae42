"""The benchmarks' goal reports. benchmarks.bench_layer's goals table: the goals checked against a
run's rows (ours fastest for time, leanest for memory, both peers beaten, the memory goal from
the lower peer, the share of the dense ceiling a time goal asks for), and the benchmark's CPU
smoke run printing it. benchmarks.bench_grouped_gemm's per-layer sums of the six expert GEMMs
(set beside the layer's time goal)."""
import math
import os
import subprocess
import sys

import pytest

from benchmarks import bench_grouped_gemm
from helpers.scripts import ROOT


@pytest.fixture(scope="module")
def bench():
    # imported when a test needs it, not at collection: importing it sets PYTORCH_CUDA_ALLOC_CONF
    # (and, through benchmarks.bench_ep, NCCL's multicast switches) for the whole process
    from benchmarks import bench_layer

    return bench_layer


def _row(bench, shape, variant, ms, act_gib):
    """A row of a shape of 10 TFLOP a step on a 1000 TFLOP/s ceiling, holding ``act_gib`` above
    2 GiB of gradients."""
    tflops = 10.0 / (ms / 1e3)
    return bench.Row(shape, variant, ms=ms, tflops=tflops, pct_dense=100.0 * tflops / 1000.0,
                     peak_gib=2.0 + act_gib, grads_gib=2.0)


def test_goals_pick_fastest_and_leanest_and_compare_both_peers(bench):
    goal = bench.GOAL_MS["qwen3_30b_a3b"]
    rows = [_row(bench, "qwen3_30b_a3b", "megatron", 90.0, 2.0),
            _row(bench, "qwen3_30b_a3b", "ours eager", goal + 2.0, 1.0),
            _row(bench, "qwen3_30b_a3b", "ours by index", goal + 1.0, 0.5),
            _row(bench, "qwen3_30b_a3b", "plain compiled", goal + 3.0, 1.0)]
    (g,) = bench.goal_rows(rows)
    assert g.best.variant == "ours by index" and g.leanest.variant == "ours by index"
    assert not g.time_met and g.faster_than_peers == "yes"
    assert g.mem_goal_gib == pytest.approx(bench.MEMORY_GOAL * 1.0)  # the lower peer's 1.0
    assert g.mem_met == ("yes" if 0.5 <= bench.MEMORY_GOAL else "no")
    # 10 TFLOP in the goal's time over a 1000 TFLOP/s ceiling
    assert g.needs_pct == pytest.approx(100.0 * 10.0 / (goal / 1e3) / 1000.0)


def test_goals_met_and_missed_per_shape(bench):
    goal = bench.GOAL_MS["mixtral"]
    rows = [_row(bench, "mixtral", "megatron", goal - 1.0, 1.0),
            _row(bench, "mixtral", "ours eager", goal - 2.0, 0.8),
            _row(bench, "mixtral", "plain compiled", goal + 5.0, 0.9),
            _row(bench, "dsv3_like", "ours eager", 1.0, 0.1),
            _row(bench, "dsv3_like", "megatron", 2.0, 1.0)]
    mix, dsv3 = bench.goal_rows(rows)
    assert mix.time_met and mix.faster_than_peers == "yes"
    assert mix.mem_goal_gib == pytest.approx(bench.MEMORY_GOAL * 0.9)
    assert mix.mem_met == "no"  # 0.8 > 0.7 * 0.9
    # one peer missing: the comparisons that need both read n/a
    assert dsv3.time_met and dsv3.faster_than_peers == "n/a" and dsv3.mem_met == "n/a"
    assert math.isnan(dsv3.mem_goal_gib)
    # a peer faster than ours fails the peers' goal
    rows[0].ms = goal - 3.0
    assert bench.goal_rows(rows)[0].faster_than_peers == "no"


def test_goals_take_the_queued_step_and_the_overhead(bench):
    """Where a step was also measured queued (CUDA), the time goal, the fastest of ours and the
    peers' comparison use the queued time; the overhead goal reads the fastest row's queued time
    over its GEMM kernels' time."""
    goal = bench.GOAL_MS["qwen3_30b_a3b"]
    over_goal = bench.OVERHEAD_GOAL["qwen3_30b_a3b"]
    eager = _row(bench, "qwen3_30b_a3b", "ours eager", goal + 1.0, 1.0)
    eager.queued_ms, eager.gemm_ms = goal - 0.5, (goal - 0.5) / (over_goal + 0.1)
    by_index = _row(bench, "qwen3_30b_a3b", "ours by index", goal - 0.1, 1.0)  # alone: faster
    by_index.queued_ms, by_index.gemm_ms = goal - 0.05, (goal - 0.05) / (over_goal - 0.1)
    megatron = _row(bench, "qwen3_30b_a3b", "megatron", goal, 2.0)
    megatron.queued_ms = goal - 0.2  # queued: faster than ours by index, slower than eager
    plain = _row(bench, "qwen3_30b_a3b", "plain compiled", goal + 3.0, 1.0)
    (g,) = bench.goal_rows([eager, by_index, megatron, plain])
    assert g.best is eager and g.time_met
    assert g.faster_than_peers == "yes"
    assert g.overhead_goal == over_goal and g.overhead_met == "no"
    assert eager.overhead == pytest.approx(over_goal + 0.1)
    eager.gemm_ms = (goal - 0.5) / (over_goal - 0.01)
    assert bench.goal_rows([eager, by_index, megatron, plain])[0].overhead_met == "yes"
    # no profile (the CPU): n/a
    eager.gemm_ms = float("nan")
    assert bench.goal_rows([eager])[0].overhead_met == "n/a"


def test_sonic_table_against_the_published_numbers(bench, capsys):
    from benchmarks.shapes import SHAPES

    shape = SHAPES["sonic_30b"]
    row = bench.Row("sonic_30b", "ours eager", ms=10.0, queued_ms=10.0)
    flops = 18.0 * shape.tokens * shape.topk * shape.hidden * shape.ffn
    assert bench.expert_flops(shape) == flops
    published = bench.SONIC_PUBLISHED_TFLOPS["sonic_30b"]
    row.expert_tflops = published * bench.SONIC_GOAL * 1.01
    bench.print_sonic([row, bench.Row("sonic_30b", "megatron", ms=1.0)])
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith("| sonic_30b")]
    assert len(lines) == 1  # ours only
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[3] == f"{row.expert_tflops:.0f}" and cells[4] == f"{published:.0f}"
    assert cells[5] == f"{bench.SONIC_GOAL * 1.01:.2f}x" and cells[6] == "yes"


def test_cpu_smoke_prints_the_goals_table():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # -m from the repository root: the root (this checkout's benchmarks and moe_core) on sys.path
    res = subprocess.run([sys.executable, "-m", "benchmarks.bench_layer", "--shapes", "tiny",
                          "--device", "cpu", "--rounds", "1", "--warmup", "1", "--skip",
                          "compiled"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    head = next(i for i, s in enumerate(lines) if s.startswith("| shape | goal ms"))
    cells = [c.strip() for c in lines[head + 2].strip("|").split("|")]
    # tiny has no time or overhead goal; ours eager is the one variant of ours; the CPU
    # profiles no kernels and measures no memory
    assert cells[0] == "tiny" and cells[1] == "none"
    assert cells[3].endswith("(ours eager)") and float(cells[3].split()[0]) > 0
    assert cells[5:8] == ["none", "n/a", "n/a"]
    assert cells[8] in ("yes", "no") and cells[9] == "n/a"


def test_grouped_gemm_layer_sums_take_the_fastest_per_product():
    nan = float("nan")
    rows = []
    products = [(f, p) for f in ("fc1", "fc2") for p in ("fwd", "dgrad", "wgrad")]
    for i, (fc, prod) in enumerate(products):
        # ours fastest on fc1, the loop on fc2; grouped_mm missing for fc2's wgrad
        ours, loop = (1.0 + i, 2.0 + i) if fc == "fc1" else (3.0 + i, 1.5 + i)
        gmm = nan if (fc, prod) == ("fc2", "wgrad") else ours + 0.25
        rows.append(dict(shape=f"qwen3_30b_a3b.{fc}", prod=prod, ms=ours, gmm_ms=gmm,
                         loop_ms=loop))
    rows.append(dict(shape="mixtral.fc1", prod="fwd", ms=1.0, gmm_ms=1.0, loop_ms=1.0))
    sums = bench_grouped_gemm.layer_sums(rows)
    assert set(sums) == {"qwen3_30b_a3b"}  # mixtral ran one product of six: no sum
    s = sums["qwen3_30b_a3b"]
    assert s["ours"] == pytest.approx(sum(r["ms"] for r in rows[:6]))
    assert s["loop"] == pytest.approx(sum(r["loop_ms"] for r in rows[:6]))
    assert math.isnan(s["gmm"])
    assert s["fastest"] == pytest.approx((1 + 2 + 3) + (1.5 + 3) + (1.5 + 4) + (1.5 + 5))


def test_step_kernels_split_and_busy_time():
    from benchmarks.step_kernels import busy_us, is_gemm

    # overlaps and nesting count once, gaps not at all: [0, 5) + [6, 9) = 8
    assert busy_us([(0, 3, "a"), (1, 5, "b"), (2, 4, "c"), (6, 9, "d")]) == 8
    assert busy_us([]) == 0
    assert is_gemm("void gg_sm90_kernel<256, false, true, false, 64>(CUtensorMap, ...)")
    assert is_gemm("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_NNT")
    assert is_gemm("void cutlass::device_kernel<...GemmUniversal...>")
    assert is_gemm("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")
    for helper in ("gg_sm90_expert_maps_kernel", "moe_gg_tile_prefix_kernel",
                   "void moe_gg_gather_rows_kernel<uint4>(...)", "gg_sm90_zero_tail_kernel",
                   "void glu_probs_kernel<__nv_bfloat16>(...)"):
        assert not is_gemm(helper), helper
