"""Test setup: the suite is a CPU suite, with the kernels under Triton's interpreter.

It runs the same way on every machine, CI's (no GPU) and a GPU host alike: the GPU is hidden, so
that defaults such as "cuda when available" (load_model, the CLI's --device) pick the CPU, and
kernels get CPU tensors, which only the interpreter runs. The GPU checks are the scripts in
benchmarks/ (gemm.py's checks, gpu_pipeline.py, gpu_bundled.py, e2e.py's checks).

Both variables must be set before CUDA initializes and before any @triton.jit function is
defined, so they are set here, before the tests import torch's CUDA state or quantkit's kernels.
"""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

if torch.cuda.is_available():  # CUDA was initialized before this file (a plugin, say): fail loudly
    raise RuntimeError("the tests are CPU tests, but CUDA was initialized before tests/conftest.py "
                       "could hide the GPU; run them without plugins that touch CUDA")


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
