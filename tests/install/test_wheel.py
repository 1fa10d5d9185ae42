"""The package as a user gets it: the sdist and the wheel of the CPU build, made from a copy of this
checkout (`python -m build --no-isolation`, which builds the wheel from the sdist, so a source file
the sdist lacks fails the build), then the wheel installed into a fresh virtual environment and
imported outside the source tree, where it runs one op against a torch reference.

The fresh environment sees the outer one's torch through a path entry (nothing is downloaded) but
not the outer one's moe_core: the test checks that the module it imports is the installed one.
The CPU build compiles the C core and the binding once (about a minute on two cores)."""
import email
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# What a copy of the checkout leaves out: build outputs and local environments.
_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.so", "*.o", "*.egg-info",
                                 "__pycache__", ".pytest_cache", "out", ".whl")


def _run(cmd, cwd, env=None):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n"
                                  f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def _has_build() -> bool:
    return subprocess.run([sys.executable, "-m", "build", "--version"],
                          capture_output=True).returncode == 0


def _build(src: Path, dist: Path, env) -> None:
    """sdist, then the wheel from the sdist: with `build` where it is installed, else the same two
    steps by hand (setup.py sdist; pip wheel of the unpacked sdist, no isolation, no download)."""
    if _has_build():
        _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist], src, env)
        return
    _run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", dist], src, env)
    (sdist,) = dist.glob("*.tar.gz")
    unpacked = src.parent / "unpacked"
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (tree,) = unpacked.iterdir()
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
          "-w", dist, tree], unpacked, env)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    src, out = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=_IGNORE)
    env = dict(os.environ, MOE_CORE_CUDA="0")
    _build(src, out, env)
    return out


def test_sdist_holds_the_sources_the_build_compiles(dist):
    (sdist,) = dist.glob("moe_core-0.1.0.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    csrc = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert csrc and csrc <= names, f"missing from the sdist: {sorted(csrc - names)}"
    assert {"LICENSE", "setup.py", "pyproject.toml", "README.md"} <= names
    assert not any(n.endswith(".so") for n in names)


def test_wheel_metadata_names_the_license_and_the_extras(dist):
    (wheel,) = dist.glob("moe_core-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(z.read(meta))
    assert any(n.startswith("moe_core/_C") and n.endswith(".so") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert set(metadata.get_all("Provides-Extra")) == {"demo", "hf", "test"}


def test_wheel_installs_and_runs_in_a_fresh_venv(dist, tmp_path):
    (wheel,) = dist.glob("moe_core-0.1.0-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path)
    py = venv / "bin" / "python"
    # torch from the outer environment, as a plain path (its .pth files, an editable moe_core's
    # among them, are not run from there)
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path)
    torch_site = Path(torch.__file__).resolve().parents[1]
    Path(site.strip(), "outer_torch.pth").write_text(f"{torch_site}\n")
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], tmp_path)
    check = textwrap.dedent(f"""
        import torch, moe_core
        from moe_core import ops
        assert moe_core.__file__.startswith({str(venv)!r}), moe_core.__file__
        logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, -2.0, 0.25, 0.0]])
        probs, routing_map = ops.topk_routing_with_score_function(logits, 2)
        top, idx = logits.topk(2, dim=1)
        want = torch.zeros_like(logits).scatter(1, idx, torch.softmax(top, dim=1))
        torch.testing.assert_close(probs, want, rtol=0, atol=1e-7)
        assert torch.equal(routing_map, want > 0)
        print(moe_core.__file__)
    """)
    printed = _run([py, "-c", check], tmp_path, dict(os.environ, PYTHONPATH=""))
    assert printed.strip().startswith(str(venv))
