"""The shapes every benchmark and tool runs at, defined once.

The reference layers (docs/design.md): bf16 parameters and activations, fp32 router, SwiGLU
experts. ``Shape.router`` holds the extra MoE config fields (Megatron's TransformerConfig names)
that set each layer's routing; :func:`routing_options` turns them into the keyword arguments of
``topk_routing_with_score_function`` (ours and Megatron-Core's), as the op benchmarks call it.

    REFERENCE        mixtral, qwen3_30b_a3b, dsv3_like: what the GPU tables report
    SONIC            SonicMoE's published configurations (and SONIC_PUBLISHED_TFLOPS)
    GOAL_MS          the whole layer's time goal per reference shape (and OVERHEAD_GOAL,
                     MEMORY_GOAL, SONIC_GOAL)
    OP_SHAPES        REFERENCE plus dsv3_T16k (dsv3_like at T = 16384): the routing / layout ops
    EP_SHAPES        REFERENCE plus tiny (a CPU smoke size): bench_ep.py, profile_layer.py
    LAYER_SHAPES     EP_SHAPES plus tiny_dsv3 (dsv3_like's router at a CPU smoke size) and SONIC
    CPU_GEMM_SHAPES  bench_grouped_gemm_cpu.py's small grouped GEMMs
    CPU_LAYER_SHAPES bench_layer_cpu.py's small layers (sequence x batch tokens, dtype)
"""
import dataclasses
from typing import Dict, NamedTuple, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int       # per rank
    hidden: int
    experts: int
    topk: int
    ffn: int          # expert ffn
    router: Tuple[Tuple[str, object], ...] = ()  # extra MoE config fields

    def dims(self) -> Tuple[int, int, int, int, int]:
        """(tokens, hidden, experts, topk, ffn)."""
        return self.tokens, self.hidden, self.experts, self.topk, self.ffn


SOFTMAX = (("moe_router_load_balancing_type", "aux_loss"), ("moe_aux_loss_coeff", 1e-2))
DSV3_ROUTER = (
    ("moe_router_score_function", "sigmoid"), ("moe_router_num_groups", 8),
    ("moe_router_group_topk", 4), ("moe_router_enable_expert_bias", True),
    ("moe_router_topk_scaling_factor", 2.5), ("moe_shared_expert_intermediate_size", 2048),
    ("moe_router_load_balancing_type", "seq_aux_loss"), ("moe_aux_loss_coeff", 1e-4))

SHAPES: Dict[str, Shape] = {
    "mixtral": Shape(8192, 4096, 8, 2, 14336, SOFTMAX),
    "qwen3_30b_a3b": Shape(16384, 2048, 128, 8, 768, SOFTMAX),
    "dsv3_like": Shape(8192, 7168, 256, 8, 2048, DSV3_ROUTER),
    "tiny": Shape(256, 128, 8, 2, 256, SOFTMAX),
}
# SonicMoE's published configurations (arXiv 2512.14080, Fig. 14: T, H, F, E, k; H100 bf16),
# softmax top-k routing; its fwd + bwd TFLOP/s beside (SONIC_PUBLISHED_TFLOPS)
SHAPES.update({
    "sonic_7b": Shape(24576, 1536, 128, 8, 256, SOFTMAX),
    "sonic_7b_g": Shape(24576, 1536, 64, 4, 512, SOFTMAX),
    "sonic_30b": Shape(32768, 4096, 128, 8, 512, SOFTMAX),
    "sonic_120b": Shape(32768, 4096, 128, 8, 1024, SOFTMAX),
})
# the dsv3_like router (sigmoid, groups, expert bias, scaling, shared expert) at a CPU-smoke size
SHAPES["tiny_dsv3"] = Shape(256, 128, 32, 8, 128, tuple(
    (k, 128 if k == "moe_shared_expert_intermediate_size" else v) for k, v in DSV3_ROUTER))
# dsv3_like at twice the tokens: the op benchmarks' largest routing problem
SHAPES["dsv3_T16k"] = dataclasses.replace(SHAPES["dsv3_like"], tokens=16384)

REFERENCE = ("mixtral", "qwen3_30b_a3b", "dsv3_like")
SONIC = ("sonic_7b", "sonic_7b_g", "sonic_30b", "sonic_120b")
# The layer's goals (targets live in the benchmarks, not in tests), on one GPU, bench_layer.py
# checks them:
# * GOAL_MS: forward + backward of the whole layer queued (steps back to back, as in training),
#   ms; mixtral's is its time before the fused expert work: not slower than that;
# * OVERHEAD_GOAL: the queued step over its GEMM kernels' time (1.0: nothing but GEMMs);
# * at every shape faster than Megatron's layer and the compiled plain layer, with activation
#   memory (bench_layer's "peak - grads") at most MEMORY_GOAL times the lower of theirs;
# * SONIC_GOAL times SonicMoE's published fwd + bwd TFLOP/s at its configurations (expert GEMM
#   FLOPs, 18·T·k·H·F, over our queued step).
# bench_grouped_gemm.py sets the time goals beside the six expert GEMMs alone.
GOAL_MS: Dict[str, float] = {"mixtral": 28.0, "qwen3_30b_a3b": 6.8, "dsv3_like": 34.0}
OVERHEAD_GOAL: Dict[str, float] = {"mixtral": 1.05, "qwen3_30b_a3b": 1.15, "dsv3_like": 1.10}
MEMORY_GOAL = 0.7
SONIC_PUBLISHED_TFLOPS: Dict[str, float] = {"sonic_7b": 390.0, "sonic_7b_g": 437.0,
                                            "sonic_30b": 508.0, "sonic_120b": 565.0}
SONIC_GOAL = 1.05
OP_SHAPES = REFERENCE + ("dsv3_T16k",)
EP_SHAPES = REFERENCE + ("tiny",)
LAYER_SHAPES = EP_SHAPES + ("tiny_dsv3",) + SONIC
# names that stand for several shapes on the command line
SHAPE_GROUPS: Dict[str, Tuple[str, ...]] = {"reference": REFERENCE, "sonic": SONIC}


def select(names) -> Dict[str, Shape]:
    """The named shapes, in the order given."""
    return {n: SHAPES[n] for n in names}


def routing_options(shape: Shape) -> dict:
    """The routing keyword arguments of ``topk_routing_with_score_function`` for ``shape``
    (besides topk and the expert bias tensor): score_function, and for a grouped router
    num_groups, group_topk, scaling_factor; ``bias=True`` where the router has an expert bias."""
    r = dict(shape.router)
    opts = dict(score_function=r.get("moe_router_score_function", "softmax"))
    if r.get("moe_router_num_groups"):
        opts.update(num_groups=r["moe_router_num_groups"], group_topk=r["moe_router_group_topk"])
    if r.get("moe_router_topk_scaling_factor"):
        opts["scaling_factor"] = r["moe_router_topk_scaling_factor"]
    if r.get("moe_router_enable_expert_bias"):
        opts["bias"] = True
    return opts


# ---- the CPU benchmarks' small shapes ---------------------------------------------------------
class GemmShape(NamedTuple):
    name: str
    tokens: int
    hidden: int
    experts: int
    topk: int
    ffn: int


CPU_GEMM_SHAPES = (
    GemmShape("demo_tiny", 2048, 128, 8, 2, 256),   # the demo's shape
    GemmShape("small", 4096, 512, 8, 2, 1024),
    GemmShape("many_small_experts", 4096, 512, 32, 4, 256),
)


class CpuLayerShape(NamedTuple):
    name: str
    seq: int
    batch: int
    hidden: int
    experts: int
    topk: int
    ffn: int
    dtype: torch.dtype


CPU_LAYER_SHAPES = (
    CpuLayerShape("tiny_demo", 128, 16, 128, 8, 2, 256, torch.float32),
    CpuLayerShape("small_bf16", 256, 8, 512, 16, 4, 512, torch.bfloat16),
    # bench_layer_cpu.py gives 64 experts and more dsv3's router (sigmoid, 8 groups, top-4, 2.5)
    CpuLayerShape("dsv3_mini_bf16", 256, 8, 512, 64, 8, 256, torch.bfloat16),
)
