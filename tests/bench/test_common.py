"""The environment stamp every benchmark result carries."""

import os
import shutil
import subprocess

import pytest

from quantkit.bench import common


def test_metadata_names_versions_commit_and_source():
    meta = common.environment_metadata()
    for key in ("gpu", "torch", "triton", "cuda", "commit", "source", "date"):
        assert key in meta
    if not os.environ.get("QUANTKIT_PDL"):
        assert meta["pdl"] == "off"  # programmatic dependent launch: off without a GPU (and interpreted)
    assert meta["source"] == common.source_digest()
    assert len(meta["source"]) == 12 and int(meta["source"], 16) >= 0


def test_source_digest_follows_the_package_files(tmp_path):
    package = tmp_path / "quantkit"
    shutil.copytree(common._PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    before = common.source_digest(package)
    assert before == common.source_digest(common._PACKAGE)  # the same files, the same digest
    kernel = package / "kernels" / "gemm.py"
    kernel.write_text(kernel.read_text() + "\n# one more line\n")
    assert common.source_digest(package) != before
    edited = common.source_digest(package)
    kernel.rename(package / "kernels" / "gemm_renamed.py")  # the same contents under another name
    assert common.source_digest(package) not in (before, edited)


def test_git_commit_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("no git here")
    package = tmp_path / "quantkit"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "one"]):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, env={**os.environ, **env})
    monkeypatch.setattr(common, "_PACKAGE", package)
    clean = common.git_commit()
    assert clean and not clean.endswith("+modified")
    (package / "a.py").write_text("x = 2\n")  # a newer tree under the old .git
    assert common.git_commit() == clean + "+modified"


def test_result_files_hold_meta_rows_and_extras_and_a_csv_line_per_row(tmp_path):
    import csv
    import json

    meta = {"gpu": "H200", "commit": "abc1234", "autotune": {"picks": [1, 2]}}
    rows = [{"op": "fp8", "M": 13, "ms": 0.25, "note": "a,b"}, {"op": "int8", "M": 257, "speedup": 1.5}]
    json_path, csv_path = common.write_rows(tmp_path / "new", "bench", rows, meta,
                                            extra={"targets": [{"met": True}]}, lead=("op", "M"))
    assert json.loads(json_path.read_text()) == {"meta": meta, "rows": rows, "targets": [{"met": True}]}
    with csv_path.open(newline="") as f:
        lines = list(csv.reader(f))
    # scalar meta first (the nested tuner record only in the JSON), then the lead fields, then the rest sorted
    assert lines[0] == ["gpu", "commit", "op", "M", "ms", "note", "speedup"]
    assert lines[1:] == [["H200", "abc1234", "fp8", "13", "0.25", "a,b", ""],
                         ["H200", "abc1234", "int8", "257", "", "", "1.5"]]
