"""Fixtures of the Hugging Face integration tests (the models and comparison helpers they share
are in helpers/hf_models.py)."""
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread while a module of these tests runs (restored after). The models are
    tiny, so threads buy nothing, and on a loaded 2-core machine spinning OpenMP workers made the
    set 10-20x slower (70-130 s of CPU instead of ~8 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
