"""Test setup: kernels run under Triton's interpreter when no GPU is present.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here,
before the tests import quantkit's kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

from tests.tiny import save_tiny_model, write_text_dir  # noqa: E402


@pytest.fixture(scope="session", params=["llama", "gemma3"])
def tiny_model_dir(request, tmp_path_factory):
    """A saved tiny random model (+ tokenizer) of each architecture."""
    return save_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-only"), "llama")


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    """A folder of English-like .txt documents (calibration and evaluation splits come from it)."""
    return write_text_dir(tmp_path_factory.mktemp("text"))
