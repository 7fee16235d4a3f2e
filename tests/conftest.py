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
import triton  # noqa: E402

from tests.tiny import save_tiny_model, write_text_dir  # noqa: E402

# The kernel tests need triton 3.9's interpreter. On triton 3.6 (what torch 2.11 pins) 434 of them fail
# inside the interpreter ("only 0-dimensional arrays can be converted to Python scalars"; the GPU
# machine, session 18), so an older triton stops the run with the fix instead.
MIN_TRITON = (3, 9)


def pytest_configure(config):
    found = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if found < MIN_TRITON:
        raise pytest.UsageError(
            f"the tests need triton >= {'.'.join(map(str, MIN_TRITON))} for its CPU interpreter, found "
            f"{triton.__version__}; install the pinned test environment: "
            "pip install -c constraints-cpu.txt -e '.[test]' (README, 'Two commands')")


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
