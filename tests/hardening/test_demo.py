"""The demo (examples/train_tiny_moe.py), end to end on the CPU at a small size: it trains (the
training loss falls, every recorded value is finite), writes a readable PNG figure and a
checkpoint that loads into a fresh model and reproduces the run's last validation loss."""
import argparse
import math
import os

import pytest
import torch

from helpers.scripts import load_script


def _demo_module():
    return load_script(os.path.join("examples", "train_tiny_moe.py"))


@pytest.fixture(scope="module")
def demo():
    return _demo_module()


@pytest.fixture(scope="module")
def run(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    steps, layers, experts = 40, 2, 4
    metrics = demo.main(["--steps", str(steps), "--batch", "8", "--seq-len", "64",
                         "--hidden", "64", "--layers", str(layers), "--experts", str(experts),
                         "--eval-every", "10", "--val-seqs", "8", "--device", "cpu",
                         "--out", str(out)])
    return dict(metrics=metrics, out=out, steps=steps, layers=layers, experts=experts)


def test_outputs_written(run):
    assert os.path.isfile(os.path.join(run["out"], "tiny_moe.pt"))
    assert os.path.isfile(os.path.join(run["out"], "training.png"))
    assert run["metrics"]["checkpoint"] == os.path.join(run["out"], "tiny_moe.pt")
    assert run["metrics"]["figure"] == os.path.join(run["out"], "training.png")


def test_figure_is_a_sensible_png(run):
    import matplotlib.image

    path = run["metrics"]["figure"]
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    h, w = image.shape[:2]
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert 600 <= w <= 3000 and 400 <= h <= 3000, (h, w)
    assert w > h  # landscape: the curves on top, a heat map per layer below
    rgb = image[..., :3]
    assert float(rgb.std()) > 0.05  # not blank
    # the heat maps' diverging colour map: strongly red and strongly blue pixels are both there
    red = (rgb[..., 0] > 0.6) & (rgb[..., 2] < 0.3)
    blue = (rgb[..., 2] > 0.4) & (rgb[..., 0] < 0.2)
    assert red.sum() > 100 and blue.sum() > 100


def test_recorded_metrics(run):
    m, steps = run["metrics"], run["steps"]
    assert m["step"] == list(range(1, steps + 1))
    assert len(m["train_loss"]) == steps
    assert m["val_step"] == [0, 10, 20, 30, 40]
    assert len(m["val_loss"]) == len(m["val_step"])
    assert len(m["aux_loss"]) == steps and all(len(a) == run["layers"] for a in m["aux_loss"])
    loads = torch.tensor(m["load"])
    assert loads.shape == (steps, run["layers"], run["experts"])
    values = m["train_loss"] + m["val_loss"] + [a for row in m["aux_loss"] for a in row]
    assert all(math.isfinite(v) for v in values)
    assert torch.isfinite(loads).all() and (loads >= 0).all()
    torch.testing.assert_close(loads.sum(-1), torch.ones(steps, run["layers"]))
    assert m["tokens_per_s"] > 0
    # it learns: the loss starts near a uniform guess over 256 bytes and falls
    first, last = m["train_loss"][:5], m["train_loss"][-5:]
    assert abs(sum(first) / 5 - math.log(256)) < 1.0
    assert sum(last) / 5 < sum(first) / 5 - 1.0
    assert m["val_loss"][-1] < m["val_loss"][0] - 1.0


def test_checkpoint_loads_into_a_fresh_model(demo, run):
    model, ckpt = demo.load_checkpoint(run["metrics"]["checkpoint"])
    assert ckpt["args"]["steps"] == run["steps"]
    assert ckpt["metrics"]["train_loss"] == run["metrics"]["train_loss"]
    assert len(demo.moe_core.moe_layers(model)) == run["layers"]
    # a fresh model with the saved weights gives the run's last validation loss
    _, val_data = demo.corpus_split()
    x, y = demo.validation_batch(val_data, ckpt["args"]["seq_len"], ckpt["args"]["val_seqs"])
    assert demo.evaluate(model, x, y) == pytest.approx(run["metrics"]["val_loss"][-1], abs=1e-5)
    # and differs from an untrained model's (the weights did load)
    args = argparse.Namespace(**ckpt["args"])
    untrained = demo.TinyMoELM(demo.build_config(args), args.layers, heads=4, seq_len=args.seq_len)
    assert demo.evaluate(untrained, x, y) > run["metrics"]["val_loss"][-1] + 1.0


def test_bad_eval_every_is_a_usage_error(demo):
    with pytest.raises(SystemExit):
        demo.parse_args(["--eval-every", "0"])
