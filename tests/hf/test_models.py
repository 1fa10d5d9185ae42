"""Every tiny random model of helpers/hf_models.py builds, runs forward and backward with finite
values under HF's eager experts, and survives ``copy.deepcopy`` (the other tests copy models)."""
import copy

import pytest
import torch

from helpers.hf_models import ALL_FAMILIES, VOCAB, inputs, run_step, tiny_model


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_tiny_model_builds_and_runs(family):
    model = tiny_model(family)
    logits, grads, _ = run_step(model, inputs())
    assert logits.shape == (2, 7, VOCAB) and torch.isfinite(logits).all()
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    copy.deepcopy(model)  # the tests copy models
