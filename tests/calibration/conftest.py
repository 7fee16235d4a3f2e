"""Fixtures shared by the calibration tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors and models: OpenMP spin-up costs more than the work when cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
