"""Saving and loading quantized checkpoints in the compressed-tensors layout.

A checkpoint is a Hugging Face model directory: config.json with a ``quantization_config``,
safetensors shards holding ``*.weight`` (int8 / float8_e4m3fn), ``*.weight_scale`` and, for
static activations, ``*.input_scale``, plus the tokenizer. transformers (with the
compressed-tensors package) and vLLM load it as it is; ``quantkit.load`` rebuilds QuantLinears.

Writes are atomic: everything goes to a hidden staging directory beside the target, which is
renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from accelerate import init_empty_weights
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from quantkit.config import QuantConfig
from quantkit.convert import (build_empty_quantized, format_tensor_names, storage_dtype, storage_tensors,
                              untie_quantized_head)
from quantkit.kernels.ops import resolve_backend
from quantkit.models.loading import (discard_staging, publish_files, resolve_device, resolve_dtype, staging_dir,
                                     stored_dtype, sync_dir)
from quantkit.models.experts import expert_linear_names, expert_modules, stacked_experts, unstack_experts
from quantkit.nn import QuantLinear
from quantkit.nn.linear import QuantizedBuffers

try:  # transformers' load-time weight conversions (5.23 has them; the package needs >= 5.23)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming, apply_converters, apply_renamings,
                                                 dot_natural_key, revert_weight_conversion)
except ImportError:  # an older transformers (a GPU image's): tensors keep the model's own names
    get_model_conversion_mapping = None

    def revert_weight_conversion(model, state):
        return state

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 4 * 1024**3


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or inconsistent; the message says which file."""


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without aliases: tied weights (lm_head = embed_tokens) appear once."""
    seen: set[tuple[int, int]] = set()
    unique = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            unique[name] = tensor
    return unique


def _shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    return shards


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool = False, source: str | None = None) -> None:
    """Raise CheckpointError unless ``save`` may write ``out_dir``: not a file, not the working
    directory or one of its parents, not holding ``source`` (the model's own directory), and new
    unless ``overwrite``, which replaces only an empty directory or a quantized checkpoint (never
    other files). ``save`` checks this itself; call it to fail before a long quantization."""
    out_dir = Path(out_dir)
    resolved = out_dir.resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"output {str(out_dir)!r} is a file; choose a directory path")
    if Path.cwd().resolve().is_relative_to(resolved):
        raise CheckpointError(f"output directory {str(out_dir)!r} is the current directory or one of its parents; "
                              "choose a new directory")
    if source and Path(source).exists() and Path(source).resolve().is_relative_to(resolved):
        raise CheckpointError(f"output directory {str(out_dir)!r} holds the source model {source!r}; "
                              "choose another directory")
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"output directory {str(out_dir)!r} already exists; pass --overwrite to replace it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_quantized_checkpoint(out_dir):
        raise CheckpointError(f"output directory {str(out_dir)!r} is not empty and holds no quantized checkpoint; "
                              "--overwrite replaces only a checkpoint: choose a new directory")


def _swap_in(staging: Path, out_dir: Path) -> None:
    """Move the finished staging directory to ``out_dir``; an existing one is replaced only once
    the new one is in place (it is put back if the move fails)."""
    backup = None
    if out_dir.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, backup / out_dir.name)
    try:
        os.replace(staging, out_dir)
    except BaseException:
        if backup is not None:
            os.replace(backup / out_dir.name, out_dir)
            shutil.rmtree(backup, ignore_errors=True)
        raise
    sync_dir(out_dir.parent)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def save(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None, overwrite: bool = False) -> Path:
    """Write a quantized model (from ``quantkit.quantize``) as a compressed-tensors checkpoint."""
    config: QuantConfig | None = getattr(model, "quantkit_config", None)
    if config is None or not any(isinstance(m, QuantLinear) for m in model.modules()):
        raise CheckpointError("the model is not quantized; run quantkit.quantize(model, config, data) first")
    if getattr(model, "quantkit_fast_path", None) is not None:
        # optimize() stacks q/k/v and gate/up into fused modules: their tensors are not in the
        # compressed-tensors layout (no loader, quantkit's included, would find its projections).
        raise CheckpointError("the model was rewritten by quantkit.optimize (fused q/k/v and gate/up weights); "
                              "save it before optimize(), or save the model quantkit.load returned")
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite, getattr(model.config, "_name_or_path", None))
    get_head = getattr(model, "get_output_embeddings", None)
    if isinstance(get_head() if get_head else None, QuantLinear):
        warnings.warn("the output head (lm_head) is quantized: quantkit.load and transformers load it, but vLLM "
                      "does not load a quantized lm_head for most models (llm-compressor issue #1820); keep it in "
                      "16 bits (the default ignore) for vLLM", stacklevel=2)
    if config.is_static and config.torch_dtype == torch.int8 and any(
            isinstance(m, QuantLinear) for experts in expert_modules(model).values() for m in experts.modules()):
        warnings.warn("the experts are INT8 with static input scales: quantkit.load runs them, but vLLM runs INT8 "
                      "experts only with dynamic per-token activations and refuses this checkpoint; for vLLM use "
                      "int8, fp8-static or fp8, or keep the experts in 16 bits (ignore=['*.experts.*'])", stacklevel=2)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    config_dict = model.config.to_dict()
    # Every Linear still in 16 bits by name: quantkit's ignore globs mean nothing to other loaders.
    # Subclasses too (routers of some MoE models): compressed-tensors' "Linear" target matches the
    # class hierarchy, so an unlisted one would be read as quantized and given random scales.
    kept = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    config_dict["quantization_config"] = config.to_quantization_config(ignore=kept)
    # A float32 model quantized from a 16-bit source (on a CPU) is stored in that dtype; quantize()
    # already rounded those tensors to it, so the cast is exact.
    storage = getattr(model, "quantkit_storage_dtype", None)
    narrowed = storage_tensors(model, storage)
    staging = staging_dir(out_dir.parent, f".{out_dir.name}.staging-")
    try:
        state = {name: (t.to(storage) if name in narrowed else t).detach().cpu()
                 for name, t in _unique_state(model).items()}
        _record_dtype(config_dict, state, format_tensor_names(model))
        # In the source checkpoint's layout, as save_pretrained writes it: transformers 5 fuses some
        # weights when it loads (a mixture of experts' per-expert matrices into one 3-D tensor), and
        # vLLM reads the per-expert names.
        reverted = _source_layout(model, state)
        if reverted is not None:
            state, experts = reverted
            config_dict["quantization_config"]["ignore"] = _checkpoint_module_names(model, kept) + experts
        shards = _shards({name: t.contiguous() for name, t in state.items()})
        if len(shards) == 1:
            save_file(shards[0], str(staging / SAFE_WEIGHTS), metadata={"format": "pt"})
        else:
            weight_map = {}
            for index, shard in enumerate(shards, start=1):
                filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(staging / filename), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, filename))
            total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
            (staging / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (staging / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        publish_files(staging)
        _swap_in(staging, out_dir)
    finally:
        discard_staging(staging)
    return out_dir


def _record_dtype(config_dict: dict, state: dict[str, torch.Tensor], formats: set[str]) -> None:
    """config.json's dtype (and its sub-configs'): that of most of the float tensors written outside
    the quantized formats, which loaders given dtype="auto" (transformers, vLLM) compute in."""
    sizes: dict[torch.dtype, int] = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and name not in formats:
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    if not sizes:
        return
    name = str(max(sizes, key=sizes.get)).removeprefix("torch.")
    config_dict["dtype"] = name
    for value in config_dict.values():
        if isinstance(value, dict) and "dtype" in value:
            value["dtype"] = name


def _shard_files(ckpt: Path) -> list[Path]:
    index = ckpt / SAFE_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from exc
        files = [ckpt / name for name in sorted(set(weight_map.values()))]
    else:
        files = [ckpt / SAFE_WEIGHTS]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"checkpoint shard {str(file)!r} is missing; the checkpoint is incomplete")
    return files


def _source_layout(model: nn.Module, state: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], list[str]] | None:
    """``state`` with transformers' load-time conversions reverted (the source checkpoint's names and
    layout), and the source names of the 2-D weights the converters had stacked (a mixture of
    experts' per-expert matrices, which stay in 16 bits: vLLM takes an expert layer the ignore list
    does not name for quantized). None where reverting would convert a quantized module's tensors:
    some models split a fused projection when they load (HRM's gate_up_proj), and joining int8 codes
    of one half with the other half, or without their scales, would make a checkpoint no loader
    reads right. Such a model is saved with the names it has in transformers (quantkit and
    transformers load it)."""
    if get_model_conversion_mapping is None:
        return None  # no conversion API (an older transformers): the model's names are the checkpoint's
    converters = _reverse_converters(model)
    quantized = {f"{name}." for name, module in model.named_modules() if isinstance(module, QuantizedBuffers)}
    touched = [key for key in state if converters and apply_converters(key, converters)[1] is not None]
    if any(key.startswith(prefix) for key in touched for prefix in quantized):
        warnings.warn(f"{type(model).__name__} converts weights when transformers loads it ({touched[0]} among "
                      "them) and quantized layers take part: the checkpoint keeps transformers' module names, "
                      "not the original checkpoint's layout", stacklevel=3)
        return None
    # Names only: the converters run on meta tensors of the same shapes.
    unstacked = revert_weight_conversion(model, {key: torch.empty_like(state[key], device="meta") for key in touched})
    linears = [key.removesuffix(".weight") for key, tensor in unstacked.items()
               if key.endswith(".weight") and tensor.dim() == 2]
    return revert_weight_conversion(model, state), sorted(linears, key=dot_natural_key)


def _reverse_converters(model: nn.Module) -> list:
    """The converters ``revert_weight_conversion`` runs for this model (reversed), as it picks them."""
    if get_model_conversion_mapping is None:
        return []
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if type(c).__name__ != "PrefixChange"]
    reversed_ = [c.reverse_transform() for c in conversions[::-1]]
    return [c for c in reversed_ if isinstance(c, WeightConverter)]


def _checkpoint_module_names(model: nn.Module, names: list[str]) -> list[str]:
    """Module names as the checkpoint's tensor names spell them (transformers' renamings reverted)."""
    weights = {f"{name}.weight": model.get_submodule(name).weight for name in names}
    return sorted(key.removesuffix(".weight") for key in revert_weight_conversion(model, weights))


@dataclasses.dataclass(frozen=True)
class _Conversions:
    """transformers' load-time transforms for one model: renamings, and converters that fuse
    tensors (none where the installed transformers has no conversion API)."""

    renamings: list
    converters: list

    @classmethod
    def of(cls, model: nn.Module) -> "_Conversions":
        transforms = get_model_conversion_mapping(model) if get_model_conversion_mapping is not None else []
        return cls([t for t in transforms if isinstance(t, WeightRenaming)],
                   [t for t in transforms if isinstance(t, WeightConverter)])

    def rename(self, key: str) -> str:
        return apply_renamings(key, self.renamings) if self.renamings else key


def _read_plan(conversions: _Conversions, keys: dict[str, Path], names: set[str]
               ) -> tuple[dict[str, str], dict[str, list[tuple[str, str]]]]:
    """How each checkpoint tensor reaches the model (whose tensors are ``names``), as
    ``from_pretrained`` would take it: renamed (model name -> checkpoint key), or gathered with
    others by a converter (the converter's first model name -> [(checkpoint key, pattern)]), e.g.
    per-expert matrices stacked into one tensor."""
    renamed, gathered = {}, {}
    for key in keys:
        target, pattern = apply_converters(key, conversions.converters) if conversions.converters else (key, None)
        if pattern is not None and conversions.rename(key) in names:
            pattern = None  # an expert's own Linear (unstacked): read as it is, not stacked
        if pattern is None:
            target = conversions.rename(key)
            # As from_pretrained does: a renaming that leads nowhere while the key names a tensor
            # (a renaming meant for another spelling of it, DeepSeek-V4's `.norm.`) is not applied.
            renamed[key if target not in names and key in names else target] = key
        else:
            gathered.setdefault(target, []).append((key, pattern))
    # Stacked in the experts' order (experts.2 before experts.10), not the header's sorted order.
    return renamed, {target: sorted(sources, key=lambda source: dot_natural_key(source[0]))
                     for target, sources in gathered.items()}


def _model_ignore(conversions: _Conversions, model: nn.Module, config: QuantConfig,
                  extra_modules: set[str] = frozenset()) -> QuantConfig:
    """``config`` with its ignore names as the model spells them: a checkpoint lists them under the
    source checkpoint's names (``_checkpoint_module_names``), which transformers renames on loading.
    ``extra_modules``: names the model will have (its experts' Linears, before they are unstacked)."""
    if not conversions.renamings:
        return config
    modules = {name for name, _ in model.named_modules()} | set(extra_modules)

    def model_name(pattern: str) -> str:
        if pattern in modules or pattern.startswith("re:") or any(c in pattern for c in "*?["):
            return pattern
        renamed = conversions.rename(f"{pattern}.weight").removesuffix(".weight")
        return renamed if renamed in modules else pattern

    return dataclasses.replace(config, ignore=tuple(model_name(pattern) for pattern in config.ignore))


def _gather(conversions: _Conversions, model: nn.Module, target: str, sources: list[tuple[str, str]],
            read) -> dict[str, torch.Tensor]:
    """Run the converter that makes ``target`` on its checkpoint tensors: model name -> tensor."""
    pattern = sources[0][1]
    converter = copy.deepcopy(next(c for c in conversions.converters if pattern in c.source_patterns))
    for key, pattern in sources:
        converter.add_tensor(target, key, pattern, read(key))
    converted = converter.convert(target, model=model, config=model.config)
    return {conversions.rename(name): value[0] if isinstance(value, list) else value
            for name, value in converted.items()}


def _checkpoint_keys(files: list[Path]) -> dict[str, Path]:
    """Each tensor name in the shards' headers and the shard that holds it (no tensor is read)."""
    keys = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                keys.update(dict.fromkeys(handle.keys(), file))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"checkpoint shard {str(file)!r} is truncated or corrupt ({exc})") from exc
    return keys


class _ShardReader:
    """``read(key)``: one checkpoint tensor, read onto ``device`` from the shard that holds it (each
    shard opened once); a damaged shard is a CheckpointError naming it."""

    def __init__(self, keys: dict[str, Path], device: str):
        self.keys, self.device, self.handles = keys, device, {}
        self.stack = contextlib.ExitStack()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.stack.close()

    def __call__(self, key: str) -> torch.Tensor:
        file = self.keys[key]
        try:
            if file not in self.handles:
                self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt", device=self.device))
            return self.handles[file].get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"checkpoint shard {str(file)!r} is truncated or corrupt ({exc})") from exc


def _empty_tensors(model: nn.Module) -> dict[str, tuple[list[tuple[nn.Module, str]], torch.Tensor]]:
    """name -> (every (module, attribute) that holds it, tensor) for each persistent parameter and
    buffer, named once, as the state dict first names it (``save`` writes that name). A tied head
    is the embedding's own Parameter: identity, not data_ptr, tells tensors apart on the meta
    device, where every address is 0, and the value read goes to every holder, whichever of them
    the model registers first."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    entries = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        persistent = [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for attr, tensor in [*module._parameters.items(), *persistent]:
            if tensor is None:
                continue
            if id(tensor) not in holders:
                holders[id(tensor)] = []
                entries[prefix + attr] = (holders[id(tensor)], tensor)
            if not any(m is module and a == attr for m, a in holders[id(tensor)]):
                holders[id(tensor)].append((module, attr))
    return entries


def _place(holders: list[tuple[nn.Module, str]], target: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(target, nn.Parameter):
        value = nn.Parameter(value, requires_grad=target.requires_grad)
    for module, attr in holders:
        (module._parameters if isinstance(target, nn.Parameter) else module._buffers)[attr] = value


def read_quant_config(ckpt_dir: str | os.PathLike) -> QuantConfig:
    """The QuantConfig recorded in a checkpoint's config.json."""
    config_file = Path(ckpt_dir) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{str(ckpt_dir)!r} is not a checkpoint directory: config.json is missing")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict) or not raw.get("quantization_config"):
        raise CheckpointError(f"{str(ckpt_dir)!r} has no quantization_config; it is not a quantized checkpoint")
    return QuantConfig.from_quantization_config(raw["quantization_config"])


def is_quantized_checkpoint(ckpt_dir: str | os.PathLike) -> bool:
    """Whether a model directory's config.json carries a quantization_config."""
    config_file = Path(ckpt_dir) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and bool(raw.get("quantization_config"))


def load_tokenizer(ckpt_dir: str | os.PathLike):
    """The tokenizer saved beside a checkpoint."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(ckpt_dir))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{str(ckpt_dir)!r} has no usable tokenizer ({str(exc).splitlines()[0]}); "
                              "save the checkpoint with its tokenizer (quantkit.save(..., tokenizer=...))") from exc


def _checked(name: str, tensor: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor checked against the model's (meta) tensor and cast to its dtype; the
    quantized weights and their fp32 scales must already be in the scheme's dtypes."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(
            f"{name} has shape {tuple(tensor.shape)} in the checkpoint but the model needs {tuple(target.shape)}"
        )
    quantized = target.dtype in (torch.int8, torch.float8_e4m3fn)
    if quantized and tensor.dtype != target.dtype:
        raise CheckpointError(f"{name} is {tensor.dtype} in the checkpoint but the scheme needs {target.dtype}")
    if name.endswith(("weight_scale", "input_scale")) and not bool((torch.isfinite(tensor) & (tensor > 0)).all()):
        raise CheckpointError(f"{name} holds a non-finite or non-positive scale; the checkpoint is corrupt")
    return tensor.to(target.dtype)


@torch.no_grad()
def load(
    ckpt_dir: str | os.PathLike,
    device: torch.device | str | None = None,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> nn.Module:
    """Rebuild a quantized model from a checkpoint written by ``save`` (or any compatible writer).

    device: default CUDA when available, else CPU. backend: "auto" picks the Triton kernels on
    CUDA and the torch reference elsewhere. The model is built without weights (on the meta
    device) and each checkpoint tensor is read straight onto ``device`` and checked against the
    model's shape and dtype there: the host never holds a second copy of the model. progress: a
    progress bar over the tensors.
    """
    ckpt = Path(ckpt_dir)
    config = read_quant_config(ckpt)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    backend = resolve_backend(backend, device)
    files = _shard_files(ckpt)
    hf_config = AutoConfig.from_pretrained(str(ckpt))
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config  # quantkit builds the quantized modules itself
    checkpoint_dtype = stored_dtype(hf_config)  # before from_config sets the dtype asked for
    # Parameters on the meta device (no memory, no random init); buffers computed in __init__
    # (RoPE's inv_freq, Gemma's embedding scale) are real. Each checkpoint tensor then becomes its
    # parameter, read straight onto ``device``: one copy of the model, never two.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    conversions = _Conversions.of(model)
    keys = _checkpoint_keys(files)
    # A mixture of experts is unstacked into one Linear per expert (as quantize() did) where the
    # checkpoint quantized its experts; one that keeps them all in 16 bits, or holds them stacked
    # (quantkit before 0.1), stays as transformers builds it.
    experts = {name: names for name, module in stacked_experts(model).items()
               if (names := expert_linear_names(model, name, module)) is not None}
    # The ignore names as the model spells them (the checkpoint's config keeps the source's).
    model_config = _model_ignore(conversions, model, config, extra_modules={
        f"{name}.{index}.{child}" for name, names in experts.items() for index, parts in enumerate(names)
        for _, child in parts})
    checkpoint_names = {conversions.rename(key) for key in keys}
    stacked = tuple(f"{name}." for name in experts
                    if any(f"{name}.{param}" in checkpoint_names for param in ("gate_up_proj", "up_proj")))
    unstack_experts(model, keep=lambda linear: model_config.is_ignored(linear) or linear.startswith(stacked))
    build_empty_quantized(model, model_config, backend, dtype)
    if not untie_quantized_head(model):
        model.tie_weights()  # a tied head is then the embedding's Parameter, not a tensor to read
    state = _empty_tensors(model)
    renamed, gathered = _read_plan(conversions, keys, set(state))
    unexpected = sorted(set(renamed) - set(state))
    if unexpected:
        hint = "" if get_model_conversion_mapping is not None else (
            " (this transformers has no weight-conversion API: a checkpoint in the source layout, such as per-expert "
            "MoE tensors, needs transformers >= 5.23)")
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not match its config: unexpected "
                              f"{[renamed[name] for name in unexpected[:3]]}{hint}")
    missing = sorted(set(state) - set(renamed) - set(gathered))
    if missing and not gathered:  # a converter may make more than its first name: checked after reading
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not match its config: missing {missing[:3]}")
    read_device = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}" \
        if device.type == "cuda" else "cpu"
    filled = set()
    with tqdm(total=len(keys), desc="loading checkpoint", unit="tensor", disable=not progress, leave=False) as bar, \
            _ShardReader(keys, read_device) as read:
        for name, key in renamed.items():
            holders, target = state[name]
            _place(holders, target, _checked(name, read(key), target))
            filled.add(name)
            bar.update()
        for first, sources in gathered.items():
            for name, tensor in _gather(conversions, model, first, sources, read).items():
                if name not in state:
                    raise CheckpointError(f"checkpoint {str(ckpt)!r} does not match its config: its "
                                          f"{sources[0][0]} and others make {name}, which the model does not have")
                holders, target = state[name]
                _place(holders, target, _checked(name, tensor, target))
                filled.add(name)
            bar.update(len(sources))
    missing = sorted(set(state) - filled)
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not match its config: missing {missing[:3]}")
    if (ckpt / "generation_config.json").is_file():
        # from_config rebuilds the generation config from config.json alone: extra eos ids (an
        # instruct model's end-of-turn token), the pad id and sampling defaults live only here.
        model.generation_config = GenerationConfig.from_pretrained(str(ckpt))
    model.quantkit_config = config
    # Loaded in float32 from 16-bit tensors (a CPU's default): saved again, it keeps their dtype.
    model.quantkit_source_dtype = checkpoint_dtype
    model.quantkit_storage_dtype = storage_dtype(model)
    return model.to(device).eval()
