"""The named options (router score functions, expert activations) are one list: the C core's
option table (an X-macro in its header) and moe_core.ops' tuple name the same options in the same
order, and the built ops accept exactly those names, refusing any other with a message that names
the argument, the bad value and the list."""
import pathlib
import re

import pytest
import torch

from moe_core import ops

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
OPS = torch.ops.moe_core

# (header, X-macro, the Python list)
TABLES = {
    "score_functions": ("moe_types.h", "MOE_SCORE_FUNCTIONS", ops.SCORE_FUNCTIONS),
    "activations": ("moe_experts.h", "MOE_ACTIVATIONS", ops.ACTIVATIONS),
}


def c_table(header: str, macro: str):
    """The (enumerator, value, name) rows of the X-macro table `macro` in csrc/`header`."""
    text = (CSRC / header).read_text()
    match = re.search(rf"^#define {macro}\(X\)((?:.*\\\n)*.*)$", text, re.MULTILINE)
    assert match, f"{macro} not found in csrc/{header}"
    body = match.group(1).replace("\\\n", " ")
    rows = re.findall(r'X\(\s*(\w+)\s*,\s*(\d+)\s*,\s*"([^"]*)"\s*\)', body)
    assert rows and len(rows) == body.count("X("), f"unparsed rows in {macro}: {body}"
    return [(enumerator, int(value), name) for enumerator, value, name in rows]


@pytest.mark.parametrize("table", TABLES)
def test_c_table_is_the_python_list(table):
    header, macro, names = TABLES[table]
    rows = c_table(header, macro)
    assert tuple(name for _, _, name in rows) == names
    # the enum's values are the positions in the list, so the list is the ABI's order too
    assert [value for _, value, _ in rows] == list(range(len(rows)))


def refusal(argument: str, names) -> str:
    """The binding's message for the made-up name 'tanh2', as a regex."""
    return re.escape(f"{argument} must be one of {tuple(names)}, got 'tanh2'")


X = torch.randn(5, 8)
IDX = torch.arange(2).repeat(5, 1)


def score_function_calls(score_function: str):
    """Every op taking a score function, called with it directly (no Python-side check)."""
    return [
        lambda: OPS.router_topk(X, 2, False, 0, 0, 0.0, score_function, None),
        lambda: OPS.router_topk_dense(X, 2, False, 0, 0, 0.0, score_function, None),
        lambda: OPS.router_topk_fused(X, 2, False, 0, 0, 0.0, score_function, None, None, True,
                                      False),
        lambda: OPS.router_topk_bwd(torch.ones(5, 2), X, IDX, 2, False, 0, 0, 0.0, score_function),
        lambda: OPS.router_topk_dense_bwd(torch.ones(5, 8), X, IDX, 2, False, 0, 0, 0.0,
                                          score_function),
        lambda: OPS.aux_loss_scores(X, 2, score_function, None),
        lambda: OPS.aux_loss_scores_bwd(torch.ones(5, 8), X, score_function, None),
    ]


A = torch.randn(6, 8)
PROBS = torch.rand(6)


def activation_calls(activation: str):
    """Every op taking an activation, called with it directly."""
    return [
        lambda: OPS.glu_probs(A, PROBS, activation, True),
        lambda: OPS.glu_probs_bwd(torch.ones(6, 4), A, PROBS, activation, True),
        lambda: OPS.glu_probs_bwd_(torch.ones(6, 4), A.clone(), torch.empty_like(A), PROBS,
                                   activation, True),
        lambda: OPS.grouped_gemm_glu_probs(torch.randn(6, 3), torch.randn(2, 8, 3),
                                           torch.tensor([0, 4, 6]), PROBS, activation, True),
    ]


def first_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("name", ops.SCORE_FUNCTIONS)
def test_every_score_function_is_accepted(name):
    for call in score_function_calls(name):
        out = first_output(call())
        assert out.shape[0] == 5 and bool(out.isfinite().all())


@pytest.mark.parametrize("name", ops.ACTIVATIONS)
def test_every_activation_is_accepted(name):
    for call in activation_calls(name):
        out = first_output(call())
        assert out.shape[0] == 6 and bool(out.isfinite().all())


def refusal(argument: str, names) -> str:
    """The binding's message for the made-up name 'tanh2', as a regex."""
    return re.escape(f"{argument} must be one of {tuple(names)}, got 'tanh2'")


@pytest.mark.parametrize("argument,calls,names", [
    ("score_function", score_function_calls, ops.SCORE_FUNCTIONS),
    ("activation", activation_calls, ops.ACTIVATIONS)], ids=["score_function", "activation"])
def test_unknown_name_is_refused(argument, calls, names):
    for call in calls("tanh2"):
        with pytest.raises(ValueError, match=refusal(argument, names)):
            call()
