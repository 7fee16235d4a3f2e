"""What every benchmark shares: the environment stamp on each result and the median timer."""

from __future__ import annotations

import datetime
import os
import subprocess

import torch


def environment_metadata() -> dict:
    """GPU name, versions, commit and date stamped on every result file."""
    import triton

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        # The device machine's copy of the tree may have no .git, or a stale one (a run on
        # 2026-11-22 stamped an old commit): the caller's QUANTKIT_COMMIT wins when set.
        "commit": os.environ.get("QUANTKIT_COMMIT") or commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn`` over ~100 ms of repetitions after warm-up (do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
