"""quantkit's attention kernels behind transformers' own extension point, ``AttentionInterface``.

    from quantkit.models.fast_attention import register_quantkit_attention
    name = register_quantkit_attention(backend="triton")      # once, at load time
    model.set_attn_implementation(name)                       # or config._attn_implementation

Any HF model whose attention layers call ``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` (Llama,
Mistral, Qwen2, Gemma-3, ...) then runs its attention through ``attention_ops``; no modeling code
is forked. What the function takes, as HF hands it over after RoPE and the cache update:
query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D), ``scaling``, ``sliding_window`` (Gemma-3's local
layers pass it per layer; others pass none or set ``module.sliding_window``).

- Sq > 1 (prefill, or a chunk continuing a DynamicCache): causal flash attention, bottom-right
  aligned (query i at position i + Sk - Sq), GQA without repeating K/V.
- Sq == 1 (decode over a DynamicCache): split-KV decode attention over all Sk keys.
- Masks: the mask function registered under the same name is transformers' FlashAttention one:
  it returns ``None`` unless the batch is padded. A mask therefore means padding, which these
  kernels do not take: the function raises a ValueError naming the fix instead of silently
  computing something else. A StaticCache gets no mask when unpadded, so the mask function
  refuses it first (more key slots than tokens seen).
- head_dim: the kernels take 64, 128 and 256; a smaller size (16, 32, 80, 96, ...) runs at the next
  one up with q, k and v zero-padded, which leaves the scores and the output's own columns as they
  were (``padded_head_dim``). quantkit.generate's cache is allocated padded, so its decode steps
  copy nothing; a DynamicCache's keys are padded per call. Above 256, ValueError.
- Softcap, dropout or non-causal layers raise ValueError as well.

The backend is resolved once, at registration ("auto" -> Triton on CUDA, else the torch twins).
Registering with ``model=`` (as ``optimize`` and ``generate`` do) also pins it on that model's
attention modules, so models on different backends in one process each keep their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from quantkit.kernels import attention_ops
from quantkit.kernels.ops import resolve_backend
from quantkit.kernels.reference_attention import SUPPORTED_HEAD_DIMS

ATTENTION_NAME = "quantkit"
_ABSENT = object()  # a keyword the caller did not pass
# The backend of one model's attention modules, set by registering with ``model=``: the registered
# function is global (one per name), so two models on different backends must not share its default.
BACKEND_ATTR = "quantkit_attention_backend"


def padded_head_dim(head_dim: int) -> int:
    """The head size the kernels run ``head_dim`` at: itself if they take it, else the next size up."""
    for size in SUPPORTED_HEAD_DIMS:
        if size >= head_dim:
            return size
    raise ValueError(f"head_dim={head_dim} is larger than quantkit's attention kernels take "
                     f"({max(SUPPORTED_HEAD_DIMS)}); use attn_implementation='sdpa' for this model")


def _padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """q, k, v zero-padded on head_dim to the size the kernels run at (k and v may already be:
    quantkit.generate's cache is allocated padded). Zero columns add nothing to q.k, and the
    output's padded columns (weights times v's zeros) are sliced off by the caller."""
    if value.shape[-1] != key.shape[-1]:
        raise ValueError(f"quantkit attention needs values as wide as keys (k head_dim {key.shape[-1]}, v "
                         f"{value.shape[-1]}, as in multi-head latent attention); use attn_implementation='sdpa'")
    size = padded_head_dim(key.shape[-1])

    def pad(t):
        return t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1]))

    return pad(query), pad(key), pad(value)


class _KernelCall:
    """What both attention functions check and prepare before a kernel, and the output after it.

    ``args``: query, key, value zero-padded to the kernels' head size, the softmax scale, the
    sliding window (the call's, else the module's) and the backend (the module's own, else the
    registered default). ``output`` slices the padding off and returns HF's (B, S, H, D) layout.
    """

    def __init__(self, module, query, key, value, backend, scaling, dropout, sliding_window, softcap, is_causal):
        if softcap is not None:
            raise ValueError(f"quantkit attention has no logit softcap (got softcap={softcap}); use 'eager'")
        if dropout:
            raise ValueError(f"quantkit attention is inference-only (got dropout={dropout}); call model.eval()")
        if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
            raise ValueError("quantkit attention is causal-only; this layer is bidirectional")
        self.head_dim = query.shape[-1]
        scale = scaling if scaling is not None else self.head_dim ** -0.5
        # Only an absent keyword falls back to the module's attribute: a layer that passes None
        # (Exaone-4's global layers keep config.sliding_window on the module) has no window.
        window = getattr(module, "sliding_window", None) if sliding_window is _ABSENT else sliding_window
        self.args = (*_padded(query, key, value), scale, window, module.__dict__.get(BACKEND_ATTR, backend))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return out[..., :self.head_dim].transpose(1, 2).contiguous()


def bind_attention_backend(model: torch.nn.Module, backend: str) -> None:
    """Make ``model``'s attention modules run the registered functions on ``backend``."""
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            module.__dict__[BACKEND_ATTR] = backend


def _attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    backend: str,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window=_ABSENT,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attention_mask is not None:
        raise ValueError(
            "quantkit attention got an attention mask, i.e. a padded batch or a StaticCache longer than its "
            "valid keys; these kernels take unpadded batches over a DynamicCache. Drop the padding (one "
            "sequence, or equal lengths) or use attn_implementation='sdpa' for this call."
        )
    call = _KernelCall(module, query, key, value, backend, scaling, dropout, sliding_window, softcap, is_causal)
    query, key, value, scale, sliding_window, backend = call.args
    if query.shape[2] == 1:
        batch, key_len = key.shape[0], key.shape[2]
        seqlens = torch.full((batch,), key_len, dtype=torch.int32, device=key.device)
        out = attention_ops.decode_attention(
            query[:, :, 0], key, value, seqlens, scale, sliding_window, max_seqlen=key_len, backend=backend
        )[:, :, None]
    else:
        out = attention_ops.flash_attention(query, key, value, scale, sliding_window, backend=backend)
    return call.output(out), None


def _dynamic_cache_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                        **kwargs):
    """transformers' FlashAttention mask, after refusing more key slots than tokens seen.

    That is a StaticCache (HF's ``generate(cache_implementation="static")``): its buffer holds empty
    slots, and without padding HF passes no mask, so the kernels would attend over the empty slots
    and align the queries to the buffer's end. A DynamicCache (or its sliding-window layers) never
    holds more keys than the tokens seen.
    """
    if kv_length > q_offset + q_length:
        raise ValueError(
            f"quantkit attention got {kv_length} key slots for {q_offset + q_length} tokens, i.e. a StaticCache "
            "(e.g. generate(cache_implementation='static')); these kernels take a DynamicCache (generate's "
            "default). Drop the static cache, use quantkit.generate (its own static cache), or "
            "attn_implementation='sdpa'."
        )
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset, **kwargs)


def register_quantkit_attention(backend: str = "auto", device: torch.device | str = "cuda",
                                model: torch.nn.Module | None = None) -> str:
    """Register the "quantkit" attention (+ its mask function) and return the name to select.

    ``backend`` is resolved once here for ``device``; registering again replaces the function's
    default. With ``model``, that model's attention modules keep this backend whatever a later
    registration (another model's) sets as the default.
    """
    resolved = resolve_backend(backend, device if backend == "auto" else "cpu")
    if model is not None:
        bind_attention_backend(model, resolved)

    def quantkit_attention(module, query, key, value, attention_mask, **kwargs):
        return _attention_forward(module, query, key, value, attention_mask, resolved, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, quantkit_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _dynamic_cache_mask)
    return ATTENTION_NAME


# --------------------------------------------------------------------------- static-cache variant

STATIC_ATTENTION_NAME = "quantkit_static"


def _static_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    backend: str,
    quantkit_kv_len: int | None = None,
    quantkit_cache_seqlens: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window=_ABSENT,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if quantkit_kv_len is None:
        raise ValueError(
            f"the {STATIC_ATTENTION_NAME!r} attention runs only inside quantkit.generate (it needs the valid "
            "cache length, quantkit_kv_len); select 'quantkit' for ordinary forward calls"
        )
    call = _KernelCall(module, query, key, value, backend, scaling, dropout, sliding_window, softcap, is_causal)
    query, key, value, scale, sliding_window, backend = call.args
    if query.shape[2] == 1:
        # Decode over the whole static buffer: the valid length of each row is a device tensor
        # (so a captured graph replays it unchanged); quantkit_kv_len is only the host-side bound.
        if quantkit_cache_seqlens is None:
            raise ValueError("decode over a static cache needs quantkit_cache_seqlens, (B,) int32 valid lengths")
        out = attention_ops.decode_attention(
            query[:, :, 0], key, value, quantkit_cache_seqlens, scale, sliding_window,
            max_seqlen=quantkit_kv_len, backend=backend,
        )[:, :, None]
    else:
        # Prefill: the first quantkit_kv_len slots are valid (past + this chunk); the flash kernel
        # aligns queries bottom-right, i.e. query i sits at position i + kv_len - Sq.
        out = attention_ops.flash_attention(
            query, key[:, :, :quantkit_kv_len], value[:, :, :quantkit_kv_len], scale, sliding_window, backend=backend
        )
    return call.output(out), None


def register_static_cache_attention(backend: str = "auto", device: torch.device | str = "cuda",
                                    model: torch.nn.Module | None = None) -> str:
    """Register the attention that ``quantkit.generate`` uses over its own static KV cache.

    No mask function is registered under this name on purpose: transformers then skips building
    masks (which would read the cache and, for a static cache, sync with the GPU inside a CUDA
    graph). The function instead takes the valid lengths as keyword arguments that the model's
    forward passes through to attention: ``quantkit_kv_len`` (host int: exact for prefill, an
    upper bound for decode) and ``quantkit_cache_seqlens`` ((B,) int32 device tensor, decode).
    Only unpadded batches are valid: generate() guarantees it.
    """
    resolved = resolve_backend(backend, device if backend == "auto" else "cpu")
    if model is not None:
        bind_attention_backend(model, resolved)

    def quantkit_static_attention(module, query, key, value, attention_mask, **kwargs):
        return _static_attention_forward(module, query, key, value, resolved, **kwargs)

    AttentionInterface.register(STATIC_ATTENTION_NAME, quantkit_static_attention)
    return STATIC_ATTENTION_NAME
