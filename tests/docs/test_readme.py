"""README.md's Python recipes run as written.

Convention (README.md states it too, in a comment above its first recipe):

* every ```python fenced block is executed, in file order, on the CPU;
* a block runs in a fresh namespace, unless its first line is ``# (continues the block above)``:
  then it runs in the namespace of the block before it (a recipe split by prose);
* blocks fenced as ```bash, ```text or without a language (commands, layouts) are not executed;
* a block that calls ``dist.init_process_group`` runs as ``torchrun --nproc-per-node 1`` would
  start it: the rendezvous variables name a world of one on this host, and the group is destroyed
  after the block, whether it passed or not.

A block that raises fails its test, which names the block's first line in the README.
"""
import re
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
import torch.distributed as dist

README = Path(__file__).resolve().parents[2] / "README.md"
CONTINUES = "# (continues the block above)"
_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def readme_recipes() -> List[Tuple[int, List[str]]]:
    """The README's Python blocks, continuations joined to the block they continue: a list of
    ``(line of the first block, [source of each block in the chain])``."""
    text = README.read_text()
    recipes: List[Tuple[int, List[str]]] = []
    for m in _FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        line = text.count("\n", 0, m.start()) + 1
        source = m.group(2)
        if source.lstrip().startswith(CONTINUES):
            if not recipes:
                raise AssertionError(f"README.md:{line}: a continuation with no block before it")
            recipes[-1][1].append(source)
        else:
            recipes.append((line, [source]))
    return recipes


RECIPES = readme_recipes()


def test_the_readme_has_recipes():
    """The extraction finds the README's recipes (a broken fence pattern would find none and
    every test below would vanish)."""
    assert len(RECIPES) >= 4
    assert sum(len(blocks) for _, blocks in RECIPES) > len(RECIPES)  # a continuation was joined


@pytest.fixture
def torchrun_world_of_one(monkeypatch):
    """The variables ``torchrun --nproc-per-node 1`` sets, on a free local port; the process group
    a recipe made is destroyed afterwards."""
    from helpers.dist import free_port

    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                            LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("line, blocks", RECIPES, ids=[f"README.md:{line}" for line, _ in RECIPES])
def test_recipe_runs(line, blocks, torchrun_world_of_one):
    namespace = {"__name__": f"readme_line_{line}"}
    threads = torch.get_num_threads()
    try:
        for i, source in enumerate(blocks):
            code = compile(source, f"README.md:{line} (block {i + 1} of {len(blocks)})", "exec")
            exec(code, namespace)
    finally:
        torch.set_num_threads(threads)  # a recipe may set the thread count for its process
