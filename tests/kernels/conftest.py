"""Fixtures shared by the kernel tests."""

import pytest
import torch

from quantkit.kernels import launch
from tests.kernels.fake_launch import FakeDriver


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty / empty_like returns NaNs: an element a kernel forgets to write shows."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))


@pytest.fixture
def gpu_mode(monkeypatch):
    """launch.CachedLaunch as on a GPU (not interpreted, a fake driver: fake_launch.py)."""
    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_driver", lambda: FakeDriver())
