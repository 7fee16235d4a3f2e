"""Run a quantkit command or script with the bundled dataset's token blocks read from a file.

The GPU machine cannot tokenize the bundled Wikipedia excerpt. It has no gensim, and `datasets`
carried there as wheels (``pip install --target``, outside the interpreter's prefix) fails to fingerprint a
table: dill pickles modules outside ``sys.prefix`` by value and trips over pyarrow (session 18; an
installed environment keeps them under its prefix and is not affected). This tool makes the same calls
on the CPU, saves their results, and replays them on the GPU. The token blocks are the same tensors that
``quantkit.prepare_calibration_data`` / ``prepare_evaluation_tokens`` return.

    # CPU (with gensim): the calls the GPU checks make
    python benchmarks/pretokenized.py save tokens.pt
    # GPU: any script or the CLI, with those calls answered from the file
    python benchmarks/pretokenized.py run tokens.pt benchmarks/gpu_pipeline.py OUT.json
    python benchmarks/pretokenized.py run tokens.pt -m quantkit demo --device cuda
    python benchmarks/pretokenized.py run tokens.pt benchmarks/calibration_sweep.py --device cuda --eval-all
"""

from __future__ import annotations

import runpy
import sys

import torch

import quantkit

# (kind, arguments): every call that `quantkit demo`, gpu_pipeline.py, gpu_bundled.py and the
# calibration sweep (--eval-all, 64 x 512 or 16 x 2048 calibration) make.
CALLS = [
    ("evaluation", None),
    ("evaluation", 4096),
    ("calibration", (16, 512)),
    ("calibration", (64, 512)),
    ("calibration", (16, 2048)),
]


def _key(kind: str, args) -> str:
    return f"{kind}:{args}"


def save(path: str) -> None:
    _, tokenizer = quantkit.load_model(quantkit.BUNDLED_MODEL, device="cpu")
    saved = {}
    for kind, args in CALLS:
        if kind == "evaluation":
            saved[_key(kind, args)] = quantkit.prepare_evaluation_tokens(tokenizer, quantkit.BUNDLED_DATASET, args)
        else:
            saved[_key(kind, args)] = quantkit.prepare_calibration_data(tokenizer, quantkit.BUNDLED_DATASET, *args)
        print(_key(kind, args), tuple(saved[_key(kind, args)].shape))
    torch.save(saved, path)


def install(path: str) -> None:
    saved = torch.load(path)

    def lookup(kind, dataset, args):
        if dataset != quantkit.BUNDLED_DATASET or _key(kind, args) not in saved:
            raise KeyError(f"{path} has no {kind} tokens for {dataset!r} {args}; saved: {sorted(saved)}")
        return saved[_key(kind, args)].clone()

    def prepare_calibration_data(tokenizer, dataset, num_samples=64, seq_len=512, model=None):
        return lookup("calibration", dataset, (num_samples, seq_len))

    def prepare_evaluation_tokens(tokenizer, dataset, max_tokens=None):
        return lookup("evaluation", dataset, max_tokens)

    quantkit.prepare_calibration_data = prepare_calibration_data
    quantkit.prepare_evaluation_tokens = prepare_evaluation_tokens


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ("save", "run"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "save":
        save(sys.argv[2])
        return
    install(sys.argv[2])
    target = sys.argv[3:]
    if target[:2] == ["-m", "quantkit"]:
        from quantkit.cli.main import main as cli

        sys.argv = ["quantkit", *target[2:]]
        cli()
    else:
        sys.argv = target
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
