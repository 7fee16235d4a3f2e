"""Lets a benchmark script import quantkit's kernels and bench code without quantkit/__init__.py,
whose pipeline dependencies (datasets, transformers, ...) the GPU image lacks: an empty
``quantkit`` package over the source tree. Import it before any quantkit module:

    from kernels_only import ROOT  # noqa: E402

(a script run as ``python benchmarks/x.py`` has this folder on its path).
"""

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root
if "quantkit" not in sys.modules:
    _package = types.ModuleType("quantkit")
    _package.__path__ = [str(ROOT / "quantkit")]
    sys.modules["quantkit"] = _package
