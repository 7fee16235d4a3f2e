"""Pure-torch twins of the attention, RoPE and normalization kernels.

Each function computes, in float32, exactly what its Triton kernel computes, and casts once to
the input dtype at the end. They are the CPU path and the test oracle; they favour clarity
over speed (attention materializes the full score matrix here, the kernels never do).

Shared conventions:
- Attention is causal. When the keys outnumber the queries (a prefill that continues a cache),
  query ``i`` sits at absolute position ``i + (n_keys - n_queries)`` (bottom-right aligned).
- A sliding window ``w`` lets query position ``p`` see key ``j`` iff ``p - w < j <= p``
  (Gemma-3's local layers, HF's convention); ``window=None`` means unbounded.
- GQA/MQA: query head ``h`` reads key/value head ``h // (n_q_heads // n_kv_heads)``.
- A query that sees no key at all (only possible when keys < queries) gets a zero output.
"""

from __future__ import annotations

import torch

from quantkit.kernels.reference import check_eps, rms_norm_fp32

SUPPORTED_HEAD_DIMS = (64, 128, 256)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """One sequence: q (Hq, Sq, D), k/v (Hkv, Sk, D) -> (Hq, Sq, D) float32."""
    n_q_heads, n_queries, _ = q.shape
    n_kv_heads, n_keys, _ = k.shape
    group = n_q_heads // n_kv_heads
    k = k.float().repeat_interleave(group, dim=0)
    v = v.float().repeat_interleave(group, dim=0)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    query_pos = torch.arange(n_queries, device=q.device)[:, None] + (n_keys - n_queries)
    key_pos = torch.arange(n_keys, device=q.device)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    return probs @ v


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for prefill.

    Batched: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) -> (B, Hq, Sq, D).
    Packed (varlen): q (Tq, Hq, D), k/v (Tk, Hkv, D) with int32 ``cu_seqlens_q``/``cu_seqlens_k``
    of shape (B + 1,) holding each sequence's start offset -> (Tq, Hq, D).
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if cu_seqlens_q is None:
        for b in range(q.shape[0]):
            out[b] = _attend(q[b], k[b], v[b], scale, window)
        return out.to(q.dtype)
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        seq = _attend(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1), scale, window)
        out[q0:q1] = seq.transpose(0, 1)
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One new token per sequence against a static KV cache.

    q (B, Hq, D); k_cache/v_cache (B, Hkv, capacity, D); cache_seqlens (B,) int32, the number
    of valid cache entries per sequence *including* the new token's own key/value (already
    written). The query sits at position ``cache_seqlens[b] - 1``. Returns (B, Hq, D).
    """
    lengths = cache_seqlens.tolist()
    capacity = k_cache.shape[2]
    if lengths and not 0 <= min(lengths) <= max(lengths) <= capacity:
        raise ValueError(
            f"cache_seqlens spans {min(lengths)}..{max(lengths)}; each length must lie in 0..{capacity} (the capacity)"
        )
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        seq = _attend(q[b][:, None, :], k_cache[b, :, :length], v_cache[b, :, :length], scale, window)
        out[b] = seq[:, 0, :]
    return out.to(q.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, rotate-half convention (HF Llama/Gemma).

    q (B, Hq, S, D), k (B, Hkv, S, D), cos/sin (B, S, D) (HF's layout: both halves repeated).
    Returns new (q, k) in their input dtypes, rounded as HF's eager function rounds: each product
    and the sum to the input dtype (each op computed in float32).
    """

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.float()[:, None], sin.float()[:, None]
        xf = x.float()
        # (x * cos) and (rotate_half(x) * sin), each rounded to x.dtype, then summed and rounded.
        return ((xf * c).to(x.dtype).float() + (rotate_half(xf) * s).to(x.dtype).float()).to(x.dtype)

    return rotate(q), rotate(k)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   positions: torch.Tensor) -> None:
    """``k_cache[b, h, positions[s], :D] = k[b, h, s]`` and the same for v, in place: k, v
    (B, Hkv, S, D), caches (B, Hkv, capacity, Dc >= D), positions (S,) int64 slots."""
    k_cache[..., : k.shape[-1]].index_copy_(2, positions, k)
    v_cache[..., : v.shape[-1]].index_copy_(2, positions, v)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y = x / rms(x) * (offset + weight)`` over the last dim, after ``x = x + residual``.

    ``offset=1`` is Gemma's (1 + w). The sum ``x + residual`` is rounded to x.dtype (it is the
    next layer's residual stream and is returned as such); the norm runs in float32 on it.
    Returns (y in x.dtype, new residual in x.dtype, or None when no residual was given).
    """
    normed, new_residual = rms_norm_fp32(x, weight, eps, residual, offset)
    return normed.to(x.dtype), new_residual


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LayerNorm over the last dim (biased variance, as torch), after ``x = x + residual``.

    Returns (y in x.dtype, new residual in x.dtype, or None when no residual was given).
    """
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), (x if residual is not None else None)


# ---------------------------------------------------------------------------------------------
# Input validation shared by the kernels' launchers and the twins: every check reads shapes,
# dtypes and Python numbers only, so it runs before any GPU work and never synchronizes.
# ---------------------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; attention takes float16, bfloat16 or float32")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head_dim) axis; call .contiguous() first")


def _check_heads(n_q_heads: int, n_kv_heads: int) -> None:
    if n_kv_heads < 1 or n_q_heads % n_kv_heads != 0:
        raise ValueError(
            f"n_q_heads={n_q_heads} is not a multiple of n_kv_heads={n_kv_heads}; GQA/MQA needs whole groups"
        )


def _check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; the kernels take {SUPPORTED_HEAD_DIMS}")


def _check_window(window: int | None) -> None:
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window={window!r} must be a positive int or None (no window)")


def check_prefill_inputs(q, k, v, window, cu_seqlens_q, cu_seqlens_k) -> None:
    """Raise ValueError on anything the prefill kernel cannot take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v live on different devices ({q.device}, {k.device}, {v.device})")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    _check_window(window)
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k (packed sequences) or neither (batched)")
    if varlen:
        if q.dim() != 3 or k.dim() != 3:
            raise ValueError(
                f"packed attention takes q (Tq, Hq, D), k/v (Tk, Hkv, D); got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
                raise ValueError(f"{name} must be a 1-D int32 tensor of B + 1 offsets; got {cu.dtype} {tuple(cu.shape)}")
            if cu.device != q.device:
                raise ValueError(f"{name} is on {cu.device}, q on {q.device}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q has {cu_seqlens_q.numel()} offsets, cu_seqlens_k {cu_seqlens_k.numel()}; one batch"
            )
        for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
            _check_offsets(name, cu, total)
        _, n_q_heads, head_dim = q.shape
        _, n_kv_heads, k_head_dim = k.shape
    else:
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(
                f"batched attention takes q (B, Hq, S, D), k/v (B, Hkv, S, D); got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
        if k.shape[2] < q.shape[2]:
            raise ValueError(
                f"fewer keys ({k.shape[2]}) than queries ({q.shape[2]}); causal prefill needs Sk >= Sq"
            )
        _, n_q_heads, _, head_dim = q.shape
        _, n_kv_heads, _, k_head_dim = k.shape
    if head_dim != k_head_dim:
        raise ValueError(f"q head_dim {head_dim} != k head_dim {k_head_dim}")
    _check_head_dim(head_dim)
    _check_heads(n_q_heads, n_kv_heads)


def _check_offsets(name: str, cu: torch.Tensor, total: int) -> None:
    """Packed offsets must start at 0, never decrease and end within the packed length. Checked
    where they live on the CPU; on a GPU reading them would synchronize, so there it is the
    caller's contract (the kernels index the packed tensors with them unchecked)."""
    if cu.device.type != "cpu":
        return
    offsets = cu.tolist()
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])) or offsets[-1] > total:
        raise ValueError(
            f"{name}={offsets} must start at 0, never decrease and end at most at the packed length {total}"
        )


def check_decode_inputs(q, k_cache, v_cache, cache_seqlens, window, max_seqlen) -> None:
    """Raise ValueError on anything the decode kernel cannot take.

    ``max_seqlen`` is the caller's host-side bound on ``cache_seqlens`` (it knows prompt length
    plus steps); checking it against the capacity catches a cache overflow without reading the
    lengths off the GPU. The kernel additionally clamps lengths to the capacity.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float(name, t)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ ({q.dtype}, {k_cache.dtype}, {v_cache.dtype})")
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"decode takes q (B, Hq, D), caches (B, Hkv, capacity, D); got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {tuple(k_cache.shape)} != v_cache shape {tuple(v_cache.shape)}")
    batch, n_q_heads, head_dim = q.shape
    if k_cache.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, cache {k_cache.shape[0]}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    _check_head_dim(head_dim)
    _check_heads(n_q_heads, k_cache.shape[1])
    _check_window(window)
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(
            f"cache_seqlens must be int32 of shape ({batch},); got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    if cache_seqlens.device != q.device or k_cache.device != q.device:
        raise ValueError("q, caches and cache_seqlens must live on one device")
    capacity = k_cache.shape[2]
    if max_seqlen is not None and not 1 <= max_seqlen <= capacity:
        raise ValueError(
            f"max_seqlen={max_seqlen} does not fit the static cache of capacity {capacity}; "
            "allocate a larger cache or generate fewer tokens"
        )


ROPE_FLOAT_DTYPES = FLOAT_DTYPES
NORM_DTYPES = FLOAT_DTYPES
MAX_HIDDEN = 65536


def check_rope_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise ValueError on anything the RoPE kernel cannot take (shapes and dtypes only)."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"RoPE takes q (B, Hq, S, D) and k (B, Hkv, S, D); got {tuple(q.shape)}, {tuple(k.shape)}")
    batch, _, seqlen, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seqlen, head_dim):
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch, seq or head_dim")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two for the RoPE kernel")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"q has {q.shape[1]} heads and k {k.shape[1]}; RoPE needs at least one head in each")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, batch) or tuple(t.shape[1:]) != (seqlen, head_dim):
            raise ValueError(f"{name} must be (B or 1, S, D) = (.., {seqlen}, {head_dim}); got {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype not in ROPE_FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; RoPE takes float16, bfloat16 or float32")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last axis; call .contiguous() first")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def check_kv_cache_write_inputs(k, v, k_cache, v_cache, positions) -> None:
    """Raise ValueError on anything the KV-cache write cannot take (shapes, dtypes, devices; the
    positions' values stay on the device: the kernel skips a slot outside the cache)."""
    if k.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"the KV-cache write takes k, v (B, Hkv, S, D) and caches (B, Hkv, capacity, D); got k "
                         f"{tuple(k.shape)}, k_cache {tuple(k_cache.shape)}")
    if v.shape != k.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"v {tuple(v.shape)} / v_cache {tuple(v_cache.shape)} must match k {tuple(k.shape)} / "
                         f"k_cache {tuple(k_cache.shape)}")
    if k.shape[:2] != k_cache.shape[:2] or k.shape[3] > k_cache.shape[3]:
        raise ValueError(f"k {tuple(k.shape)} does not fit k_cache {tuple(k_cache.shape)} (batch, heads, head_dim)")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"k, v and the caches must share a dtype; got {k.dtype}, {v.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (k.shape[2],):
        raise ValueError(f"positions must be int64 of shape ({k.shape[2]},); got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("positions", positions)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k on {k.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last axis")


def check_norm_inputs(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """Raise ValueError on anything the norm kernels cannot take (shapes, dtypes, eps)."""
    check_eps(eps)
    if x.dtype not in NORM_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; the norm kernels take float16, bfloat16 or float32")
    if x.dim() < 1 or x.shape[-1] < 1 or x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1] if x.dim() else None} is outside 1..{MAX_HIDDEN}")
    hidden = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (tuple(t.shape) != (hidden,) or t.device != x.device):
            raise ValueError(f"{name} must be ({hidden},) on {x.device}; got {tuple(t.shape)} on {t.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
            )
