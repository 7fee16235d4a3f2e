"""Test setup: kernels run under Triton's interpreter when no GPU is present.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here,
before the tests import quantkit's kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
