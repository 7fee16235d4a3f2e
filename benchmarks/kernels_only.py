"""Lets a benchmark script import quantkit's kernels and bench code without quantkit/__init__.py,
whose pipeline dependencies (datasets, transformers, ...) the GPU image lacks: an empty
``quantkit`` package over the source tree. Import it before any quantkit module:

    from kernels_only import ROOT  # noqa: E402

(a script run as ``python benchmarks/x.py`` has this folder on its path).
"""

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root
if "quantkit" not in sys.modules:
    _package = types.ModuleType("quantkit")
    _package.__path__ = [str(ROOT / "quantkit")]
    sys.modules["quantkit"] = _package


def load_module(path, name: str) -> types.ModuleType:
    """The Python file at ``path`` imported as module ``name`` (registered in sys.modules, which
    dataclasses and triton's JIT look their module up in): e.g. an earlier commit's kernel file,
    timed beside the current one."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
