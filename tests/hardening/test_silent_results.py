"""Inputs that used to give a result without a word: each now gives the right result or a clear
error.

* ``accumulate_tokens_per_expert`` with a routing map on another device than its buffer (a meta
  map: torch's in-place add of a meta tensor into a real one does nothing).
* the Hugging Face experts backend, a token whose top-k names the same expert twice: HF's eager
  loop runs that expert once per slot and sums both weighted outputs; the backend now weighs the
  expert's one row by the sum of both weights (fp64: equal to HF's eager within 1e-12).
* ``replace_moe_blocks`` on a MoE model whose blocks moe-core has no rule for and whose experts
  HF does not dispatch (DBRX, JetMoE): UnsupportedMoEBlockError naming the declared experts.
"""
import pytest
import torch

from moe_core import ops


def test_accumulate_tokens_per_expert_refuses_a_map_on_another_device():
    counts = torch.zeros(4)
    meta_map = torch.ones(3, 4, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"routing_map is on meta but local_tokens_per_expert "
                                         r"on cpu: the counts would not be added"):
        ops.accumulate_tokens_per_expert(counts, meta_map)
    with pytest.raises(ValueError, match=r"local_tokens_per_expert must be \[num_experts\] for "
                                         r"routing_map \[num_tokens, num_experts\], got \(4,\) "
                                         r"and \(3, 5\)"):
        ops.accumulate_tokens_per_expert(counts, torch.ones(3, 5, dtype=torch.bool))
    # shapes only on meta, both sides: nothing to count, no error
    meta_counts = torch.zeros(4, device="meta")
    assert ops.accumulate_tokens_per_expert(meta_counts, meta_map) is meta_counts
    # the real case still counts
    rmap = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert ops.accumulate_tokens_per_expert(counts, rmap).tolist() == [2.0, 1.0, 1.0, 0.0]


def test_experts_backend_sums_a_repeated_expert_like_hf_eager():
    pytest.importorskip("transformers")
    from helpers.hf_models import tiny_model

    import moe_core.hf as mh
    from moe_core.hf.backend import routing_tensors

    mh.register_experts_backend()
    idx = torch.tensor([[1, 1], [0, 2], [3, 3]])
    w = torch.tensor([[0.25, 0.5], [0.75, 0.125], [0.5, 0.5]], dtype=torch.float64,
                     requires_grad=True)
    rmap, probs = routing_tensors(idx, w, 4)
    assert rmap.tolist() == [[False, True, False, False], [True, False, True, False],
                             [False, False, False, True]]
    assert probs.tolist() == [[0.0, 0.75, 0.0, 0.0], [0.75, 0.0, 0.125, 0.0],
                              [0.0, 0.0, 0.0, 1.0]]

    model = tiny_model("mixtral", torch.float64)
    experts = next(m for m in model.modules() if type(m).__name__ == "MixtralExperts")
    E = experts.num_experts
    g = torch.Generator().manual_seed(0)
    T, H = 5, experts.gate_up_proj.shape[-1]
    x = torch.randn(T, H, dtype=torch.float64, generator=g)
    top = torch.tensor([[0, 0], [1, 2], [E - 1, E - 1], [2, 1], [3, 3]])
    weights = torch.rand(T, 2, dtype=torch.float64, generator=g)
    outs, grads = [], []
    for impl in ("eager", "moe_core"):
        model.set_experts_implementation(impl)
        xi, wi = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = experts(xi, top, wi)
        out.sum().backward()
        outs.append(out.detach())
        grads.append((xi.grad, wi.grad))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-12, atol=1e-12)


def _dbrx():
    from transformers import DbrxConfig, DbrxForCausalLM

    cfg = DbrxConfig(d_model=16, n_heads=2, n_layers=1, max_seq_len=8, vocab_size=32,
                     attn_config=dict(kv_n_heads=1, rope_theta=10000.0),
                     ffn_config=dict(ffn_hidden_size=8, moe_num_experts=4, moe_top_k=2))
    return DbrxForCausalLM(cfg), "ffn_config.moe_num_experts", 4


def _jetmoe():
    from transformers import JetMoeConfig, JetMoeForCausalLM

    cfg = JetMoeConfig(hidden_size=16, num_hidden_layers=1, num_key_value_heads=2, kv_channels=4,
                       intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                       vocab_size=32)
    return JetMoeForCausalLM(cfg), "num_local_experts", 4


@pytest.mark.parametrize("build", [_dbrx, _jetmoe], ids=["dbrx", "jetmoe"])
def test_replace_moe_blocks_refuses_moe_models_it_cannot_swap(build):
    pytest.importorskip("transformers")
    from moe_core.hf import UnsupportedMoEBlockError, replace_moe_blocks

    model, field, n = build()
    with pytest.raises(UnsupportedMoEBlockError,
                       match=rf"declares {n} experts \({field}\) but holds none of the sparse-MoE "
                             rf"blocks moe-core swaps"):
        replace_moe_blocks(model)
