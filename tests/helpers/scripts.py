"""The examples (examples/) imported as modules, by path: they are standalone files a user
runs or copies (``python examples/train_tiny_moe.py``), not a package, so the tests load them
from where they lie. benchmarks/ and tools/ are packages and import by name."""
import importlib.util
import os
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script(relpath: str) -> ModuleType:
    """The script at ``relpath`` (from the repository root) executed as a fresh module named
    after its file."""
    name = os.path.splitext(os.path.basename(relpath))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
