"""The command line: the happy path, and every bad input as one line, exit code 1, nothing written."""

import json
import os
from pathlib import Path
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quantkit.cli.main import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *fragments):
    assert result.exit_code == 1, result.output
    # transformers may draw a loading progress bar first; the error is one line and the last.
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: "), result.stderr
    assert result.stderr.count("error: ") == 1, result.stderr
    for fragment in fragments:
        assert fragment in message, message
    assert result.exception is None or isinstance(result.exception, SystemExit)


def assert_nothing_written(parent):
    assert not [p for p in parent.iterdir() if p.name.startswith(".")], "staging files left behind"


@pytest.fixture(scope="module")
def checkpoint(llama_dir, text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "ckpt"
    result = invoke("quantize", llama_dir, "-o", out, "--scheme", "int8-static", "--dataset", text_dir,
                    "--num-samples", 4, "--seq-len", 32)
    assert result.exit_code == 0, result.output
    assert "converted 14 Linear layers" in result.stdout
    return out


def copy_checkpoint(checkpoint, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(checkpoint, target)
    return target


def test_eval_prints_table_and_json(checkpoint, llama_dir, text_dir, tmp_path):
    report = tmp_path / "report.json"
    result = invoke("eval", checkpoint, "--baseline", llama_dir, "--dataset", text_dir, "--window", 64,
                    "--max-tokens", 200, "--json", report)
    assert result.exit_code == 0, result.output
    assert "int8-static" in result.stdout
    row = json.loads(report.read_text())["results"][0]
    assert row["scheme"] == "int8-static" and row["tokens"] == 199
    assert row["quantized_ppl"] > 1 and row["baseline_ppl"] > 1


def test_help_on_every_command():
    for command in ([], ["quantize"], ["eval"], ["demo"], ["bench"], ["bench", "gemm"], ["bench", "attention"],
                    ["bench", "model"]):
        result = invoke(*command, "--help")
        assert result.exit_code == 0 and "Usage" in result.output, command


def test_missing_model_path(tmp_path, text_dir):
    result = invoke("quantize", tmp_path / "no-such-model", "-o", tmp_path / "out", "--dataset", text_dir)
    assert_user_error(result, "does not exist")
    assert not (tmp_path / "out").exists()


def test_missing_relative_directory_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_user_error(invoke("quantize", "no_such_dir/", "-o", "out"), "model path 'no_such_dir/' does not exist")


def test_unknown_scheme(llama_dir, tmp_path):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "int4")
    assert_user_error(result, "unknown scheme 'int4'", "fp8")


def test_output_exists(llama_dir, tmp_path, text_dir):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", text_dir)
    assert_user_error(result, "already exists", "--overwrite")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_overwrite_replaces(llama_dir, tmp_path, text_dir):
    (tmp_path / "out").mkdir()
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", text_dir, "--overwrite",
                    "--scheme", "fp8")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert_nothing_written(tmp_path)


def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(llama_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--overwrite", "--scheme", "fp8")
    assert_user_error(result, "not empty and holds no quantized checkpoint", "choose a new directory")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    # Nor is a 16-bit model's directory.
    import shutil

    other_model = tmp_path / "other_model"
    shutil.copytree(llama_dir, other_model)
    result = invoke("quantize", llama_dir, "-o", other_model, "--overwrite", "--scheme", "fp8")
    assert_user_error(result, "holds no quantized checkpoint")
    assert sorted(p.name for p in other_model.iterdir()) == sorted(p.name for p in llama_dir.iterdir())


def test_dataset_without_text(llama_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for i in range(4):
        (empty / f"{i}.txt").write_text("   \n")
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", empty, "--scheme", "int8-static",
                    "--seq-len", 32)
    assert_user_error(result, "yields no text")
    assert not (tmp_path / "out").exists()


def test_dataset_shorter_than_one_block(llama_dir, tmp_path):
    short = tmp_path / "short"
    short.mkdir()
    for i in range(4):
        (short / f"{i}.txt").write_text(f"The river city {i}.")
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", short, "--scheme", "int8-static",
                    "--seq-len", 128)
    assert_user_error(result, "fewer than one block", "--seq-len")
    assert not (tmp_path / "out").exists()


def test_missing_dataset_path(llama_dir, tmp_path):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", tmp_path / "nope.txt",
                    "--scheme", "int8-static", "--seq-len", 32)
    assert_user_error(result, "does not exist")


def test_a_bad_dataset_is_named_before_the_model_loads(checkpoint, llama_dir, tmp_path, monkeypatch):
    """A typo in --dataset fails in a second, not after minutes of loading a large model."""
    import quantkit

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset was checked")

    monkeypatch.setattr(quantkit, "load_model", no_load)
    monkeypatch.setattr(quantkit, "load", no_load)
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", tmp_path / "nope.txt",
                    "--scheme", "int8-static")
    assert_user_error(result, "nope.txt", "does not exist")
    result = invoke("eval", checkpoint, "--baseline", llama_dir, "--dataset", tmp_path / "nope")
    assert_user_error(result, "nope", "does not exist")
    few = tmp_path / "few"
    few.mkdir()
    for i in range(3):  # three documents: none can be held out for evaluation
        (few / f"doc{i}.txt").write_text(f"Document number {i} has a sentence or two of its own text.")
    result = invoke("eval", checkpoint, "--baseline", llama_dir, "--dataset", few)
    assert_user_error(result, "yields no text for the evaluation split", "3 distinct")
    (few / "blank.txt").write_text("  \n\t\n")
    for doc in few.glob("doc*.txt"):
        doc.write_text("\n \n")
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", few, "--scheme", "int8-static")
    assert_user_error(result, "yields no text for the calibration split", "0 distinct")


def test_seq_len_beyond_context(llama_dir, tmp_path, text_dir):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", text_dir, "--seq-len", 1000,
                    "--scheme", "fp8-static")
    assert_user_error(result, "seq_len=1000", "context of 256")
    assert not (tmp_path / "out").exists()


def test_checkpoint_missing_shard(checkpoint, llama_dir, tmp_path):
    broken = copy_checkpoint(checkpoint, tmp_path)
    (broken / "model.safetensors").unlink()
    result = invoke("eval", broken, "--baseline", llama_dir)
    assert_user_error(result, "model.safetensors", "missing")


def test_checkpoint_truncated_shard(checkpoint, llama_dir, tmp_path):
    broken = copy_checkpoint(checkpoint, tmp_path)
    shard = broken / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) * 2 // 3])
    result = invoke("eval", broken, "--baseline", llama_dir)
    assert_user_error(result, "truncated or corrupt")


def test_checkpoint_scale_shape_mismatch(checkpoint, llama_dir, tmp_path):
    broken = copy_checkpoint(checkpoint, tmp_path)
    shard = broken / "model.safetensors"
    tensors = load_file(str(shard))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name].reshape(-1)  # (N,) instead of (N, 1)
    save_file(tensors, str(shard))
    result = invoke("eval", broken, "--baseline", llama_dir)
    assert_user_error(result, name, "(64,)", "(64, 1)")


def test_checkpoint_unknown_scheme(checkpoint, llama_dir, tmp_path):
    broken = copy_checkpoint(checkpoint, tmp_path)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (broken / "config.json").write_text(json.dumps(config))
    result = invoke("eval", broken, "--baseline", llama_dir)
    assert_user_error(result, "not one this version of quantkit knows")


def test_not_a_checkpoint(llama_dir):
    result = invoke("eval", llama_dir, "--baseline", llama_dir)
    assert_user_error(result, "no quantization_config")


def test_real_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.cli.main", "quantize", str(tmp_path / "missing"), "-o", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model path")
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def checkpoint_hd64(tmp_path_factory):
    from tests.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("hd64")
    source = save_tiny_model(root / "model", "llama-hd64")
    result = invoke("quantize", source, "-o", root / "ckpt", "--scheme", "fp8")
    assert result.exit_code == 0, result.output
    return root / "ckpt"


def test_generate_from_checkpoint_fast_equals_plain(checkpoint_hd64):
    checkpoint = checkpoint_hd64
    fast = invoke("generate", checkpoint, "--prompt", "The river city", "--max-new-tokens", 6, "--device", "cpu")
    plain = invoke("generate", checkpoint, "--prompt", "The river city", "--max-new-tokens", 6, "--device", "cpu",
                   "--plain")
    assert fast.exit_code == 0 and plain.exit_code == 0, fast.output + plain.output
    assert fast.stdout == plain.stdout
    assert "5 decode steps" in fast.stderr  # the first new token comes from the prefill


def test_generate_samples_reproducibly_with_a_seed(checkpoint_hd64):
    args = ("generate", checkpoint_hd64, "--prompt", "The river city", "--max-new-tokens", 8, "--device", "cpu")
    greedy = invoke(*args)
    runs = [invoke(*args, "--temperature", 4.0, "--top-p", 0.99, "--seed", seed) for seed in (11, 11, 12)]
    assert all(run.exit_code == 0 for run in runs), [run.output for run in runs]
    assert runs[0].stdout == runs[1].stdout != runs[2].stdout
    assert "seed 11" in runs[0].stderr and "seed" not in greedy.stderr
    # One token kept: sampling is greedy decoding.
    assert invoke(*args, "--temperature", 1.0, "--top-k", 1).stdout == greedy.stdout
    unseeded = invoke(*args, "--temperature", 1.0)
    assert unseeded.exit_code == 0 and "seed " in unseeded.stderr, unseeded.output


@pytest.mark.parametrize("options, fragments", [
    (("--top-k", 5), ("--top-k 5 only applies when sampling", "--temperature > 0")),
    (("--seed", 3, "--top-p", 0.5), ("--top-p 0.5, --seed 3 only applies when sampling",)),
    (("--temperature", -1), ("--temperature -1.0 must be >= 0",)),
    (("--temperature", 1, "--top-k", 0), ("--top-k 0 must be >= 1",)),
    (("--temperature", 1, "--top-p", 1.5), ("--top-p 1.5 must lie in (0, 1]",)),
    (("--temperature", 1, "--seed", 2**70), ("--seed 1180591620717411303424 must lie in [0, 2**63)",)),
    (("--repetition-penalty", 0), ("--repetition-penalty 0.0 must be a finite number > 0",)),
    (("--repetition-penalty", "inf"), ("--repetition-penalty inf must be a finite number > 0",)),
])
def test_generate_sampling_options_are_checked(checkpoint_hd64, options, fragments):
    assert_user_error(invoke("generate", checkpoint_hd64, "--prompt", "a", "--device", "cpu", *options), *fragments)


def test_generate_with_a_repetition_penalty(checkpoint_hd64):
    """--repetition-penalty reaches generate: 1 is the default's output, a strong penalty another."""
    args = ("generate", checkpoint_hd64, "--prompt", "The river city", "--max-new-tokens", 12, "--device", "cpu")
    default, off, strong = invoke(*args), invoke(*args, "--repetition-penalty", 1), \
        invoke(*args, "--repetition-penalty", 50)
    assert default.exit_code == off.exit_code == strong.exit_code == 0, strong.output
    assert default.stdout == off.stdout != strong.stdout


def test_generate_passes_min_new_tokens(checkpoint_hd64, monkeypatch):
    """--min-new-tokens reaches generate_tokens (its effect is generate's own test)."""
    import quantkit

    seen = {}
    real = quantkit.generate_tokens

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(quantkit, "generate_tokens", spy)
    result = invoke("generate", checkpoint_hd64, "--prompt", "The river city", "--max-new-tokens", 4, "--device", "cpu",
                    "--min-new-tokens", 3)
    assert result.exit_code == 0, result.output
    assert seen["min_new_tokens"] == 3


def test_generate_beyond_context(checkpoint_hd64):
    checkpoint = checkpoint_hd64
    result = invoke("generate", checkpoint, "--prompt", "The river city", "--max-new-tokens", 1000, "--device", "cpu")
    assert_user_error(result, "max_new_tokens (1000)", "exceeds the model's context of 256")


def test_quantize_with_calibration_recipe_writes_report(llama_dir, text_dir, tmp_path):
    report = tmp_path / "calibration.json"
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "int8-static", "--dataset", text_dir,
                    "--num-samples", 4, "--seq-len", 32, "--smoothquant", 0.5, "--weight-observer", "mse",
                    "--activation-observer", "percentile", "--report", report)
    assert result.exit_code == 0, result.output
    payload = json.loads(report.read_text())
    assert payload["smoothquant"] and payload["recipe"]["smoothquant_alpha"] == 0.5


def test_quantize_offload_streams_blocks_and_saves(llama_dir, text_dir, tmp_path):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "int8", "--dataset", text_dir,
                    "--num-samples", 3, "--seq-len", 32, "--gptq", "--offload", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "config.json").exists() and "converted" in result.output


def test_bad_smoothquant_alpha(llama_dir, tmp_path):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "int8", "--smoothquant", 1.5)
    assert_user_error(result, "smoothquant_alpha=1.5")


def test_accurate_recipe_is_recorded_and_flags_override_it(llama_dir, text_dir, tmp_path):
    out = tmp_path / "acc"
    result = invoke("quantize", llama_dir, "-o", out, "--scheme", "int8", "--recipe", "accurate", "--dataset", text_dir,
                    "--num-samples", 2, "--keep-sensitive", 2)
    assert result.exit_code == 0, result.output
    recipe = json.loads((out / "config.json").read_text())["quantization_config"]["quantkit"]
    # The recipe's choices, except keep_sensitive, which the flag overrode (the recipe says 4).
    assert recipe["smoothquant_alpha"] == 0.75 and recipe["gptq"] is True
    assert recipe["keep_sensitive"] == 2
    # The 2 most sensitive layers, each with the layers that read its input (q/k/v, gate/up), of 14.
    converted, kept = (int(word) for word in re.findall(r"converted (\d+) Linear layers, kept (\d+) in 16 bits",
                                                         result.stdout)[0])
    assert converted + kept == 15 and 2 <= kept - 1 <= 6  # 14 projections, and lm_head kept by default
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    for layer in range(2):
        for parent, group in (("self_attn", ("q", "k", "v")), ("mlp", ("gate", "up"))):
            kept_parts = {f"model.layers.{layer}.{parent}.{part}_proj" in ignore for part in group}
            assert len(kept_parts) == 1, ignore  # a group is kept whole or not at all


def test_unknown_recipe(llama_dir, tmp_path, text_dir):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", text_dir, "--recipe", "best")
    assert_user_error(result, "unknown recipe 'best'", "accurate")
    assert not (tmp_path / "out").exists()


def test_bad_percentile(llama_dir, tmp_path, text_dir):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", text_dir,
                    "--weight-observer", "percentile", "--percentile", 120)
    assert_user_error(result, "percentile=120", "(0, 100]")
    assert not (tmp_path / "out").exists()


def test_output_that_is_the_working_directory_is_refused(llama_dir, tmp_path, monkeypatch, text_dir):
    """`-o . --overwrite` once deleted the working directory (the source model with it)."""
    import shutil

    shutil.copytree(llama_dir, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    result = invoke("quantize", "model", "-o", ".", "--overwrite", "--dataset", text_dir)
    assert_user_error(result, "current directory")
    assert (tmp_path / "model" / "config.json").is_file()


def test_output_holding_the_source_model_is_refused(llama_dir, tmp_path, text_dir):
    import shutil

    shutil.copytree(llama_dir, tmp_path / "model")
    result = invoke("quantize", tmp_path / "model", "-o", tmp_path, "--overwrite", "--dataset", text_dir)
    assert_user_error(result, "holds the source model")
    assert (tmp_path / "model" / "config.json").is_file()


def test_output_or_report_under_a_file_is_refused_before_any_work(llama_dir, tmp_path, text_dir):
    (tmp_path / "afile").write_text("mine")
    result = invoke("quantize", llama_dir, "-o", tmp_path / "afile", "--overwrite", "--dataset", text_dir)
    assert_user_error(result, "afile", "is a file")
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--report", tmp_path / "afile" / "r.json",
                    "--dataset", text_dir)
    assert_user_error(result, "--report", "which is a file")
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "afile").read_text() == "mine"


def test_os_errors_are_one_line(llama_dir, tmp_path, monkeypatch, text_dir):
    import quantkit

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "out"))

    monkeypatch.setattr(quantkit, "save", denied)
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "fp8", "--dataset", text_dir)
    assert_user_error(result, "Permission denied", "out", "permissions")


def test_unknown_device(llama_dir, tmp_path):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--device", "tpu")
    assert_user_error(result, "--device 'tpu' is not supported", "'cpu', 'cuda'")
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--device", "cuda:1")
    assert_user_error(result, "--device 'cuda:1' was asked for but no CUDA GPU is available", "--device 'cpu'")


@pytest.mark.parametrize("args", [("--stride", 0), ("--max-tokens", -5), ("--window", 1)])
def test_eval_refuses_out_of_range_numbers(checkpoint, llama_dir, args):
    result = invoke("eval", checkpoint, "--baseline", llama_dir, *args)
    assert result.exit_code == 2, result.output  # typer's own range check: a usage error
    assert "Invalid value" in result.output


def test_demo_without_schemes():
    assert_user_error(invoke("demo", "--schemes", " , "), "--schemes", "names no scheme")


def test_generate_scheme_checks(checkpoint_hd64):
    assert_user_error(invoke("generate", checkpoint_hd64, "--prompt", "a", "--scheme", "int4"), "unknown scheme 'int4'")
    assert_user_error(invoke("generate", checkpoint_hd64, "--prompt", "a", "--scheme", "int8-static"),
                      "needs calibration data", "quantkit quantize")
    assert_user_error(invoke("generate", checkpoint_hd64, "--prompt", "a", "--scheme", "int8", "--device", "cpu"),
                      "already a quantized checkpoint (fp8)", "drop --scheme")


def test_generate_from_a_checkpoint_without_tokenizer(checkpoint_hd64, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(checkpoint_hd64, bare)
    for file in bare.iterdir():
        if "token" in file.name:
            file.unlink()
    result = invoke("generate", bare, "--prompt", "a", "--device", "cpu")
    assert_user_error(result, "has no usable tokenizer", "tokenizer=")


def test_overwrite_keeps_the_old_checkpoint_if_the_swap_fails(checkpoint, tmp_path, monkeypatch):
    """The old checkpoint is moved aside, not deleted, until the new one is in place."""
    import os

    import quantkit
    import quantkit.checkpoint as ckpt_module

    target = copy_checkpoint(checkpoint, tmp_path)
    before = sorted(p.name for p in target.iterdir())
    model = quantkit.load(target, device="cpu")
    real_replace = os.replace

    def failing_replace(src, dst):
        if ".staging-" in str(src):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt_module.os, "replace", failing_replace)
    model.config._name_or_path = ""  # loaded from `target` itself, which save refuses to replace
    with pytest.raises(KeyboardInterrupt):
        quantkit.save(model, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "backup or staging left behind"


@pytest.mark.skipif(os.name != "posix", reason="leftovers are recognized by their free lock (flock) on POSIX only")
def test_a_killed_saves_staging_is_removed_by_the_next_save(checkpoint, tmp_path, caplog):
    """A save killed mid-write (SIGKILL) leaves its hidden staging directory, whose lock the kernel
    has released; the next save of that name removes it. A running save's (lock held), a directory
    without the lock file, names that only look alike, and symlinks stay."""
    import fcntl

    import quantkit
    from quantkit.models import loading

    def staging(name, lock=True):
        path = tmp_path / name
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half-written")
        if lock:
            (path / loading.STAGING_LOCK).write_bytes(b"")
        return path

    killed = staging(".ckpt.staging-k1ll3d_x")
    running = staging(".ckpt.staging-runn1ng0")
    held = os.open(running / loading.STAGING_LOCK, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # another open file description: conflicts as another process would
    kept = [running, staging(".ckpt.staging-n0l0ck00", lock=False), staging(".ckpt.staging-toolong123"),
            staging(".ckpt.staging-abcdefgh.staging-12345678"), staging(".other.staging-k1ll3d_y")]
    (tmp_path / ".ckpt.staging-symlink0").symlink_to(staging("elsewhere"), target_is_directory=True)
    try:
        model = quantkit.load(checkpoint, device="cpu")
        with caplog.at_level("WARNING", logger="quantkit.models.loading"):
            quantkit.save(model, tmp_path / "ckpt")
    finally:
        os.close(held)
    assert not killed.exists() and all(path.is_dir() for path in kept)
    assert (tmp_path / "elsewhere" / loading.STAGING_LOCK).exists()
    assert f"removed {killed}, left by an interrupted save" in caplog.text
    assert quantkit.is_quantized_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / loading.STAGING_LOCK).exists()


@pytest.mark.skipif(os.name != "posix", reason="flock")
def test_a_staging_directory_is_locked_until_released(tmp_path):
    from quantkit.models import loading

    path = loading.staging_dir(tmp_path, ".x.staging-")
    assert (path / loading.STAGING_LOCK).exists()
    assert loading.remove_leftovers(tmp_path, ".x.staging-") == [] and path.is_dir()  # its writer holds the lock
    loading.release_staging(path)
    loading.release_staging(path)  # a no-op the second time
    assert not (path / loading.STAGING_LOCK).exists()
    assert loading.remove_leftovers(tmp_path, ".x.staging-") == [] and path.is_dir()  # no lock file: not a leftover


def test_checkpoint_directory_follows_the_umask(checkpoint):
    import os

    mask = os.umask(0)
    os.umask(mask)
    assert checkpoint.stat().st_mode & 0o777 == 0o777 & ~mask


@pytest.mark.parametrize("name, value", [("model.layers.1.mlp.down_proj.weight_scale", float("nan")),
                                         ("model.layers.0.self_attn.q_proj.input_scale", 0.0)])
def test_checkpoint_with_a_bad_scale_value(checkpoint, llama_dir, tmp_path, name, value):
    broken = copy_checkpoint(checkpoint, tmp_path)
    shard = broken / "model.safetensors"
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(shard))
    result = invoke("eval", broken, "--baseline", llama_dir)
    assert_user_error(result, name, "non-finite or non-positive scale")


def test_eval_refuses_a_baseline_the_checkpoint_was_not_made_from(checkpoint, text_dir, tmp_path):
    from tests.tiny import make_model, make_tokenizer, save_tiny_model

    # Another architecture: refused by its config. The same one with other weights: by its embeddings.
    gemma = save_tiny_model(tmp_path / "gemma", "gemma3")
    result = invoke("eval", checkpoint, "--baseline", gemma, "--dataset", text_dir, "--window", 64, "--max-tokens", 100)
    assert_user_error(result, "model_type='llama'", "model_type='gemma3_text'", "made from")
    tokenizer = make_tokenizer()
    make_model("llama", len(tokenizer), seed=1).save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    result = invoke("eval", checkpoint, "--baseline", tmp_path / "other", "--dataset", text_dir, "--window", 64,
                    "--max-tokens", 100)
    assert_user_error(result, "input embeddings differ", "made from")


def test_quantized_checkpoint_is_refused_where_a_16_bit_model_is_needed(checkpoint, text_dir, tmp_path):
    result = invoke("quantize", checkpoint, "-o", tmp_path / "again", "--scheme", "fp8")
    assert_user_error(result, "is already quantized", "16-bit original")
    assert not (tmp_path / "again").exists()
    result = invoke("eval", checkpoint, "--baseline", checkpoint, "--dataset", text_dir, "--window", 64)
    assert_user_error(result, "is already quantized")


def test_recipe_parts_set_back_to_their_defaults_override_the_recipe(llama_dir, text_dir, tmp_path):
    out = tmp_path / "acc"
    result = invoke("quantize", llama_dir, "-o", out, "--scheme", "int8-static", "--recipe", "accurate",
                    "--dataset", text_dir, "--num-samples", 2, "--seq-len", 32, "--keep-sensitive", 0, "--no-gptq",
                    "--activation-observer", "absmax")
    assert result.exit_code == 0, result.output
    recipe = json.loads((out / "config.json").read_text())["quantization_config"]["quantkit"]
    assert recipe["keep_sensitive"] == 0 and recipe["gptq"] is False and recipe["activation_observer"] == "absmax"
    assert recipe["smoothquant_alpha"] == 0.75  # the recipe's, not overridden
    assert "converted 14 Linear layers" in result.stdout


def test_static_only_flags_on_a_dynamic_scheme(llama_dir, text_dir, tmp_path):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "int8", "--activation-observer", "mse")
    assert_user_error(result, "--activation-observer mse", "int8-static")
    assert not (tmp_path / "out").exists()
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "fp8", "--dataset", text_dir)
    assert result.exit_code == 0, result.output
    assert "note: --dataset is not used" in result.stderr


def test_fewer_calibration_blocks_than_asked_are_reported(llama_dir, text_dir, tmp_path):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "int8-static", "--dataset", text_dir,
                    "--num-samples", 10000, "--seq-len", 32)
    assert result.exit_code == 0, result.output
    note = next(line for line in result.stderr.splitlines() if line.startswith("note: the calibration text holds"))
    used = int(note.split(" holds ")[1].split()[0])
    assert 1 <= used < 10000 and f"calibrating on {used}" in note


@pytest.mark.parametrize("output, report", [("out", "out"), ("out/ckpt", "out")], ids=["output", "above-output"])
def test_report_that_is_the_output_directory_is_refused_before_any_work(llama_dir, tmp_path, output, report):
    result = invoke("quantize", llama_dir, "-o", tmp_path / output, "--scheme", "fp8", "--report", tmp_path / report)
    assert_user_error(result, "--report", "is the --output directory or one above it")
    assert sorted(tmp_path.iterdir()) == []


def test_dataset_file_that_is_not_utf8(llama_dir, tmp_path):
    bad = tmp_path / "texts"
    bad.mkdir()
    (bad / "latin1.txt").write_bytes("Caf\xe9 au bord de la rivi\xe8re.".encode("latin-1"))
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "int8-static", "--dataset", bad,
                    "--seq-len", 32)
    assert_user_error(result, "latin1.txt", "is not UTF-8 text", "convert it to UTF-8")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the umask from /proc")
def test_the_umask_is_read_without_changing_it(monkeypatch):
    """os.umask reads the mask only by setting it: a thread creating a file in between got 0666."""
    import os

    from quantkit.models import loading

    previous = os.umask(0o027)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(os, "umask", lambda mask: pytest.fail("os.umask was called"))
            assert loading._umask() == 0o027
    finally:
        os.umask(previous)


def test_written_files_follow_the_umask(checkpoint, llama_dir, text_dir, tmp_path):
    import os

    mask = os.umask(0)
    os.umask(mask)
    for path in checkpoint.iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path
    report = tmp_path / "report.json"
    result = invoke("eval", checkpoint, "--baseline", llama_dir, "--dataset", text_dir, "--window", 64,
                    "--max-tokens", 100, "--json", report)
    assert result.exit_code == 0, result.output
    assert report.stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_truncated_source_model_is_one_line(llama_dir, tmp_path):
    import shutil

    broken = tmp_path / "trunc"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = invoke("quantize", broken, "-o", tmp_path / "o", "--scheme", "fp8")
    assert_user_error(result, "truncated or corrupt", "copy or download the model again")
    (broken / "tokenizer.json").unlink()
    shutil.copy(llama_dir / "model.safetensors", weights)
    result = invoke("quantize", broken, "-o", tmp_path / "o", "--scheme", "fp8")
    assert_user_error(result, "has no usable tokenizer")
    assert not (tmp_path / "o").exists()


def test_reports_may_not_land_in_a_model_directory(checkpoint, llama_dir, tmp_path):
    ckpt = copy_checkpoint(checkpoint, tmp_path)
    config_before = (ckpt / "config.json").read_text()
    result = invoke("eval", ckpt, "--baseline", llama_dir, "--json", ckpt / "config.json")
    assert_user_error(result, "--json", "is inside the checkpoint directory")
    result = invoke("eval", ckpt, "--baseline", llama_dir, "--json", llama_dir / "report.json")
    assert_user_error(result, "is inside the baseline directory")
    assert (ckpt / "config.json").read_text() == config_before
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--scheme", "fp8", "--report",
                    tmp_path / "out" / "config.json")
    assert_user_error(result, "--report", "is inside the --output directory")


def test_eval_checks_the_stride_before_loading(checkpoint, llama_dir):
    result = invoke("eval", checkpoint, "--baseline", "/nonexistent/model", "--window", 64, "--stride", 100)
    assert_user_error(result, "--stride 100 is larger than --window 64")


def test_eval_json_is_strict_and_records_the_windows(checkpoint, llama_dir, text_dir, tmp_path):
    out = tmp_path / "eval.json"
    result = invoke("eval", checkpoint, "--baseline", llama_dir, "--dataset", text_dir, "--window", 32, "--stride", 16,
                    "--max-tokens", 200, "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert (report["window"], report["stride"], report["max_tokens"]) == (32, 16, 200)


def test_home_relative_checkpoint_paths(checkpoint, llama_dir, tmp_path, monkeypatch):
    ckpt = copy_checkpoint(checkpoint, tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    result = invoke("generate", "~/copy", "--prompt", "The river", "--max-new-tokens", 2, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert ckpt.name == "copy"


def test_write_json_is_atomic_readable_and_strict(tmp_path, monkeypatch):
    """Reports: the umask's permissions (not mkstemp's 0600), NaN/inf as null, no temporary left,
    and the calibration report goes through the same writer."""
    import json
    import math
    import os

    import quantkit
    from quantkit.calibration.report import write_report

    old = os.umask(0o022)
    try:
        out = quantkit.write_json(tmp_path / "r" / "report.json", {"a": math.nan, "b": [1.5, math.inf], "c": "x"})
        second = write_report({"d": 2}, tmp_path / "r" / "calibration.json")
    finally:
        os.umask(old)
    assert json.loads(out.read_text()) == {"a": None, "b": [1.5, None], "c": "x"}
    assert json.loads(second.read_text()) == {"d": 2}
    assert (out.stat().st_mode & 0o777) == (second.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["calibration.json", "report.json"]


def test_bench_without_gpu_is_one_line(tmp_path):
    # conftest hides any CUDA GPU from the tests: each runner must stop before any work, writing nothing.
    for kind in ("gemm", "attention", "model"):
        result = invoke("bench", kind, "--out-dir", tmp_path / kind)
        assert_user_error(result, "benchmarks need a CUDA GPU")
        assert not (tmp_path / kind).exists()


def test_bench_check_failure_is_one_line(monkeypatch, tmp_path):
    import quantkit.bench
    from quantkit.bench import CheckFailed

    def failing(out_dir):
        raise CheckFailed("quantkit_fp8 at M=13: relative error 1e-1 exceeds 4e-3\nsecond line")

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(quantkit.bench, "run_gemm_benchmark", failing)
    result = invoke("bench", "gemm", "--out-dir", tmp_path)
    assert_user_error(result, "quantkit_fp8 at M=13", "exceeds 4e-3")
    assert "second line" not in result.stderr


def test_sequential_gptq_without_gptq_is_refused(llama_dir, tmp_path, text_dir):
    result = invoke("quantize", llama_dir, "-o", tmp_path / "out", "--dataset", text_dir, "--gptq-sequential")
    assert_user_error(result, "--gptq-sequential says how GPTQ gathers its statistics; add --gptq")
    assert not (tmp_path / "out").exists()
