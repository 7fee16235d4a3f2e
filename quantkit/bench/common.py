"""What every benchmark shares: the environment stamp on each result and the median timer."""

from __future__ import annotations

import csv
import datetime
import hashlib
import json
import os
import subprocess
from pathlib import Path

import torch

from quantkit.kernels import launch

_PACKAGE = Path(__file__).resolve().parents[1]  # quantkit/


class CheckFailed(RuntimeError):
    """A kernel's output at a benchmark point is outside its bound: its time is not reported."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def require_within(what: str, err: float, bound: float) -> float:
    """``err`` if it is below ``bound`` (NaN is not), else CheckFailed naming ``what``."""
    if not err < bound:
        raise CheckFailed(f"{what}: relative error {err:.2e} against the reference exceeds {bound:.1e}; "
                          "the kernel is wrong at this point, so no time is reported")
    return err


def require_matplotlib() -> None:
    """Fail before any GPU work when the plots could not be drawn at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("the benchmark plots need matplotlib, which is not installed; "
                         "pip install 'quantkit[bench]' (or matplotlib)") from None


def source_digest(package: Path = _PACKAGE) -> str:
    """The first 12 hex digits of a SHA-256 over the package's .py files (relative paths and
    contents, in path order): which code ran, whatever state the checkout's .git is in."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=_PACKAGE, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def git_commit() -> str:
    """HEAD's short hash, with "+modified" where the package's files differ from it (a checkout
    copied with a stale .git, as on the GPU machine, reads as its old HEAD plus modifications);
    "" outside a git checkout."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no", "--", "."):
        commit += "+modified"
    return commit


def environment_metadata() -> dict:
    """GPU name, versions, commit, source digest and date stamped on every result file."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        # The device machine's copy of the tree may have no .git, or a stale one (a run on
        # 2026-11-22 stamped an old commit; in session 16 bdc63ad for a newer tree): the caller's
        # QUANTKIT_COMMIT wins when set, and "source" names the code that ran either way.
        "commit": os.environ.get("QUANTKIT_COMMIT") or git_commit() or "unknown",
        "source": source_digest(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # Programmatic dependent launch (QUANTKIT_PDL), which changes the decode times.
        "pdl": launch.pdl_name(),
    }


def write_rows(out_dir, name: str, rows: list[dict], meta: dict, extra: dict | None = None,
               lead: tuple = ()) -> tuple[Path, Path]:
    """Every benchmark's result files: ``name.json`` holds ``{"meta": meta, "rows": rows, **extra}``
    (``extra``: e.g. targets and checks) and ``name.csv`` one line per row, the scalar ``meta``
    entries first on every line (nested ones, e.g. the autotuner's picks, stay in the JSON), then
    the rows' fields: ``lead`` in its order, the rest sorted."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{name}.json", out_dir / f"{name}.csv"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows, **(extra or {})}, indent=1, default=str))
    flat_meta = {key: value for key, value in meta.items() if not isinstance(value, (dict, list))}
    fields = {key for row in rows for key in row}
    columns = [key for key in lead if key in fields] + sorted(fields - set(lead))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat_meta) + [key for key in columns if key not in flat_meta])
        writer.writeheader()
        writer.writerows({**flat_meta, **row} for row in rows)
    return json_path, csv_path


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn`` over ~100 ms of repetitions after warm-up (do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
