"""Fixtures shared by the kernel tests."""

import pytest
import torch


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
