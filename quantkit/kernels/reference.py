"""Pure-torch twins of quantkit's kernels.

Every Triton kernel in this package has a function here that computes the same thing, written
for clarity rather than speed. They are the CPU path of the library and the oracle of the tests.

Conventions shared with the kernels:
- INT8 is symmetric: scales are amax / 127, weights lie in [-127, 127]. Activations saturate to
  [-128, 127], as compressed-tensors and vLLM quantize them at run time: only a value past a
  static scale's range reaches -128. FP8 is e4m3fn, max 448.
- Scales are float32 and multiply the quantized value back: ``x ~= q * scale``. Static scales are
  checked finite and positive where they are made (calibration, checkpoint loading); what a NaN or
  inf activation quantizes to is not specified (here NaN gives INT8 0, the kernels may differ).
- INT8 products accumulate exactly in int32; FP8 products accumulate in float32.
- The epilogue runs in float32: ``act(acc * a_scale[:, None] * w_scale[None, :] + bias)``,
  then casts once to the output dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

INT8_MAX = 127.0
INT8_MIN = -128.0  # activations' saturation floor (scales are still amax / INT8_MAX)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# A scale is never smaller than this: an all-zero row quantizes to zeros instead of NaN.
MIN_SCALE = 1e-12

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
ACTIVATIONS = ("none", "relu", "silu", "gelu", "gelu_tanh")


def qmax_of(dtype: torch.dtype) -> float:
    """Largest representable magnitude of a quantized dtype."""
    if dtype == torch.int8:
        return INT8_MAX
    if dtype == torch.float8_e4m3fn:
        return FP8_MAX
    raise ValueError(f"quantized dtype {dtype} is not supported; use torch.int8 or torch.float8_e4m3fn")


def activation_qmin(dtype: torch.dtype) -> float:
    """Where activations saturate below: -128 for INT8 (the weights' symmetric grid stops at -127),
    -448 for FP8."""
    return INT8_MIN if dtype == torch.int8 else -qmax_of(dtype)


def _qmax_tensor(dtype: torch.dtype, device) -> torch.Tensor:
    # Divide by a tensor, not a Python float: on CUDA, torch turns division by a Python scalar
    # into multiplication by its reciprocal, which differs from true division in the last bit
    # and would make this twin disagree with itself (and the kernels) between CPU and GPU.
    return torch.tensor(qmax_of(dtype), dtype=torch.float32, device=device)


def cast_to_quantized(x_scaled: torch.Tensor, dtype: torch.dtype, activation: bool = False) -> torch.Tensor:
    """Round an already-scaled float tensor onto the quantized grid, saturating to [-qmax, qmax]
    (weights) or, with ``activation``, to [activation_qmin, qmax]. int8 has no NaN: a NaN is code 0
    (torch's own cast of NaN to int8 is the platform's); float8_e4m3fn keeps it."""
    qmax = qmax_of(dtype)
    x_scaled = x_scaled.float().clamp(activation_qmin(dtype) if activation else -qmax, qmax)
    if dtype == torch.int8:
        return torch.round(x_scaled).nan_to_num(nan=0.0).to(torch.int8)
    return x_scaled.to(torch.float8_e4m3fn)


def _finite_number(value) -> float | None:
    """``value`` as a float if it is a finite real number (not a bool or a string), else None."""
    try:
        number = None if isinstance(value, (bool, str)) else float(value)
    except (TypeError, ValueError):
        return None
    return number if number is not None and math.isfinite(number) else None


def check_eps(eps: float) -> None:
    """A norm's epsilon must be a finite number >= 0 (a negative one makes rsqrt NaN for flat rows)."""
    number = _finite_number(eps)
    if number is None or number < 0.0:
        raise ValueError(f"eps={eps!r} must be a finite number >= 0 (models use about 1e-6)")


def check_offset(offset: float) -> None:
    """An RMSNorm weight offset (Gemma's 1 + w: 1.0; else 0.0) must be a finite number."""
    if _finite_number(offset) is None:
        raise ValueError(f"offset={offset!r} must be a finite number (1.0 for Gemma's (1 + w) weights, else 0.0)")


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 scale that maps a clipping magnitude onto the format's largest value."""
    amax = amax.float()
    return (amax / _qmax_tensor(dtype, amax.device)).clamp_min(MIN_SCALE)


def quantize_per_channel(
    weight: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of an (N, K) weight -> (q (N, K), scale (N,) fp32).

    amax: per-row clipping magnitudes (N,), e.g. from a clipping search; default the row absmax.
    """
    if amax is None:
        amax = weight.detach().float().abs().amax(dim=1)
    scale = scale_from_amax(amax.to(weight.device), dtype)
    return cast_to_quantized(weight.float() / scale[:, None], dtype), scale


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-row quantization of an (M, K) activation -> (q (M, K), scale (M,) fp32)."""
    if x.shape[-1] == 0:  # empty rows: amax 0, so the smallest scale (as the kernels give)
        amax = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    else:
        amax = x.float().abs().amax(dim=-1)
    scale = scale_from_amax(amax, dtype)
    return cast_to_quantized(x.float() / scale[:, None], dtype, activation=True), scale


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Static quantization with one precomputed scale (a 1-element fp32 tensor)."""
    return cast_to_quantized(x.float() / scale.float().reshape(()), dtype, activation=True)


def apply_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "none":
        return x
    if activation == "relu":
        return torch.relu(x)
    if activation == "silu":
        return F.silu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"activation={activation!r} is not supported; choose one of {ACTIVATIONS}")


# float32 represents every integer below 2**24 exactly, so an int8 dot product over at most
# 2**24 / 128**2 = 1024 terms is exact in float32 whatever the summation order.
EXACT_FP32_CHUNK = 1024


def int8_matmul_exact(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(M, K) int8 @ (N, K)^T int8 -> (M, N) int32, exactly.

    K is cut into chunks of 1024 whose float32 products are exact integers, then summed in int32;
    float32 matmuls are several times faster than integer or float64 ones on CPUs.
    """
    K = a.shape[-1]
    if K * INT8_MIN * INT8_MIN >= 2**31:
        raise ValueError(f"K={K} overflows an int32 accumulator; split the reduction")
    acc = None
    for start in range(0, K, EXACT_FP32_CHUNK):
        chunk = slice(start, start + EXACT_FP32_CHUNK)
        part = (a[:, chunk].float() @ w[:, chunk].float().t()).to(torch.int32)
        acc = part if acc is None else acc + part
    return acc


def scaled_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``act((a @ w.T) * a_scale[:, None] * w_scale[None, :] + bias)`` in float32, cast to out_dtype.

    a: (M, K) int8 or float8_e4m3fn; w: (N, K) same dtype; a_scale: (M,) or (1,)/() fp32;
    w_scale: (N,) or (1,)/() fp32; bias: (N,) or None.
    """
    if a.dtype == torch.int8:
        acc = int8_matmul_exact(a, w).float()
    else:
        acc = a.float() @ w.float().t()
    out = acc * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return apply_activation(out, activation).to(out_dtype)


def gated_scaled_mm(
    a: torch.Tensor,
    w_gate_up: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    activation: str = "silu",
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Gated MLP front half: ``act(a @ gate.T) * (a @ up.T)`` with [gate; up] stacked along N.

    w_gate_up: (2 * N, K), rows [0, N) the gate and [N, 2N) the up projection; w_scale: (2 * N,).
    Returns (M, N).
    """
    full = scaled_mm(a, w_gate_up, a_scale, w_scale, None, "none", torch.float32)
    gate, up = full.chunk(2, dim=-1)
    return (apply_activation(gate, activation) * up).to(out_dtype)


def grouped_scaled_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    experts: torch.Tensor,
    row_div: int = 1,
    activation: str = "none",
    gated: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixture of experts' GEMMs, one (token, slot) pair per output row, in pair order.

    a: (R, K) quantized rows; pair p reads row ``p // row_div`` (the first GEMM of an MLP reads a
    token once for its k slots: row_div = k; the second reads its own row: 1). w: (E, N, K), one
    weight per expert; w_scale: (E, N); a_scale: (R,) or a single element; experts: (P,), the
    expert of each pair, P = R * row_div (values >= E: no expert, a row of zeros). Row p is
    ``scaled_mm(a[p // row_div], w[experts[p]])`` with ``activation``, or with ``gated`` the
    ``gated_scaled_mm`` of the expert's [gate; up] rows: (P, N) or (P, N / 2); with ``row_scale``
    (P,) each row times its entry (a routing weight) in float32 before the one cast.
    """
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    out = torch.zeros(experts.numel(), n_out, dtype=out_dtype, device=a.device)
    per_row = a_scale.numel() > 1
    for expert in range(w.shape[0]):
        pairs = (experts == expert).nonzero().flatten()
        if pairs.numel():
            rows = pairs // row_div
            scale = a_scale.reshape(-1)[rows] if per_row else a_scale
            if gated:
                rows_out = gated_scaled_mm(a[rows], w[expert], scale, w_scale[expert], activation, torch.float32)
            else:
                rows_out = scaled_mm(a[rows], w[expert], scale, w_scale[expert], None, activation, torch.float32)
            if row_scale is not None:
                rows_out = rows_out * row_scale[pairs, None]
            out[pairs] = rows_out.to(out_dtype)
    return out


def gather_slots(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    rows: torch.Tensor,
    block_expert: torch.Tensor,
    used: int,
    block_m: int,
    row_div: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' rows in slot order (the plan of ``moe.route_plan``: ``rows`` (C,) the
    pair of each slot, -1 for padding; ``block_expert`` each block's expert, num_experts for the
    pairs of none; the first ``used`` slots filled). Slot s of a routed pair p: row p // row_div of
    ``a`` and its scale (``a_scale`` per row or one value); other slots zeros. Returns
    (a_slots (C, K), scales (C,) float32); slots from ``used`` on are zeros."""
    slots = torch.arange(rows.numel(), device=rows.device)
    routed = (rows >= 0) & (block_expert[slots // block_m] < num_experts) & (slots < used)
    src = torch.where(routed, rows, 0).long() // row_div
    out = torch.zeros(rows.numel(), a.shape[1], dtype=a.dtype, device=a.device)
    out[routed] = a[src[routed]]
    scale = a_scale.reshape(-1)[src] if a_scale.numel() > 1 else a_scale.reshape(-1).expand(rows.numel())
    return out, torch.where(routed, scale.float(), 0.0)


def grouped_slot_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    block_expert: torch.Tensor,
    used: int,
    block_m: int,
    activation: str = "none",
    gated: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """A mixture of experts' GEMM in slot order: each block of ``block_m`` rows of ``a`` (C, K)
    below ``used`` times its expert's weight (``block_expert``; the run of no expert as the last
    expert), ``scaled_mm`` / ``gated_scaled_mm`` arithmetic with ``a_scale`` (C,) per row. Rows
    from ``used`` on are zeros."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    out = torch.zeros(a.shape[0], n_out, dtype=out_dtype, device=a.device)
    for block in range(used // block_m):
        rows = slice(block * block_m, (block + 1) * block_m)
        expert = min(int(block_expert[block]), w.shape[0] - 1)
        if gated:
            out[rows] = gated_scaled_mm(a[rows], w[expert], a_scale[rows], w_scale[expert], activation, out_dtype)
        else:
            out[rows] = scaled_mm(a[rows], w[expert], a_scale[rows], w_scale[expert], None, activation, out_dtype)
    return out


def combine(y: torch.Tensor, slots: torch.Tensor, tokens: int, k: int, weights: torch.Tensor | None = None
            ) -> torch.Tensor:
    """(tokens, H): token t's rows ``y[slots[t * k + j]]``, j = 0 .. k-1, each in float32 times the
    pair's ``weights[t * k + j]`` if given, summed in that order, cast once to y's dtype."""
    rows = y[slots.long()].float()
    if weights is not None:
        rows = rows * weights.reshape(-1, 1).float()
    rows = rows.view(tokens, k, -1)
    total = rows[:, 0].clone()
    for j in range(1, k):
        total += rows[:, j]
    return total.to(y.dtype)


def rms_norm_fp32(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm kept in float32, after an optional residual add; ``offset=1`` is Gemma's (1 + w).

    The sum ``x + residual`` is rounded to x.dtype first: it is the next layer's residual stream.
    Returns (normed float32, new residual in x.dtype, or None without residual).
    """
    new_residual = None
    if residual is not None:
        x = new_residual = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float()), new_residual


def sqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """float32 square root rounded to nearest (IEEE), on any device.

    torch's vectorized CPU float32 sqrt is not always correctly rounded (it can be one ulp off);
    the kernels' ``sqrt_rn`` is. The float64 root rounded to float32 is: float64 carries more
    than 2 * 24 + 2 bits, so rounding twice cannot land on the wrong side of a float32 midpoint.
    """
    return torch.sqrt(t.double()).float()


def rms_norm_quant_per_token(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm (+ residual) followed by per-token quantization of the normed rows.

    Quantizes the float32 normed values directly (the fused kernel never rounds them to 16 bits).
    The norm is rounded as the kernels round it, which differs from ``rms_norm_fp32`` (the
    order HF's modules use, kept there for exact module matches): ``normed = (x * (offset + w))
    * rstd`` with ``rstd = 1 / sqrt(sum(x**2) / K + eps)`` in IEEE division and square root
    (not torch.rsqrt, which is approximate on CUDA). Multiplying by rstd last lets the kernel
    find the row's scale in the same pass as the sum of squares: rstd > 0 and rounding is
    monotone, so ``max|normed| == max|x * (offset + w)| * rstd`` exactly. Kernel and twin then
    agree bit for bit whenever their sums of squares agree (always, when the sum is exact in
    float32, e.g. few-bit inputs; otherwise the summation order may move rstd by an ulp).
    Returns (q (M, K), scale (M,) fp32, new residual or None).
    """
    new_residual = None
    if residual is not None:
        x = new_residual = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    # Divide by tensors: torch turns division by a Python scalar into a multiplication on CUDA.
    row_length = torch.tensor(float(xf.shape[-1]), dtype=torch.float32, device=xf.device)
    rstd = torch.ones((), device=xf.device) / sqrt_rn(xf.pow(2).sum(-1, keepdim=True) / row_length + eps)
    normed = (xf * (offset + weight.float())) * rstd
    q, scale = quantize_per_token(normed, dtype)
    return q, scale, new_residual


def fp64_scaled_mm(a, w, a_scale, w_scale, bias=None, activation="none") -> torch.Tensor:
    """The same quantized math as ``scaled_mm`` carried out in float64: the tests' ground truth."""
    out = a.double() @ w.double().t()
    out = out * a_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return apply_activation(out, activation)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (higher is better)."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise)
