"""A device-to-device copy on the SMs: the ceiling the memory-bound kernels are measured against.

torch's ``dst.copy_(src)`` is a memcpy. Captured in a CUDA graph it becomes a memcpy node, and
on an H200 that node moved some sizes at 4.1-4.3 TB/s and others a few KB apart at 2.7 TB/s, in
every repetition and either order (``benchmarks/gpu_checks_s43.py``, session 43,
results/gpu_checks_s43_h200.json): a ceiling that depends on the size's bits is no ceiling.
This kernel copies with 16-byte accesses from every SM, like the quantization kernels read and
write, and ``quantkit.bench.quant`` takes the best of it and the memcpy as the copy bandwidth.
Its twin is ``dst.copy_(src)``.

``device_read`` is the read-only ceiling for kernels that stream bytes in and write almost
nothing (the decode GEMV reads an (N, K) weight and writes N values): every program reads
``BLOCK`` int32 words with 16-byte loads and writes one wrapped int32 sum. Its twin is
``read_sums_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.launch import check_runnable

# Elements per program (int32 when the size allows it: 16 KB per program, 16 bytes per access).
BLOCK = 4096


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(src_ptr + offsets, mask=mask, eviction_policy="evict_first")
    tl.store(dst_ptr + offsets, values, mask=mask, eviction_policy="evict_first")


def device_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy the bytes of contiguous ``src`` into contiguous ``dst`` (same byte size, same device)."""
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous tensor; call .contiguous() first")
    n_bytes = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() != n_bytes or dst.device != src.device:
        raise ValueError(f"dst holds {dst.numel() * dst.element_size()} bytes on {dst.device}, src {n_bytes} on "
                         f"{src.device}; give both the same size and device")
    if n_bytes == 0:
        return dst
    check_runnable(src, "src")
    word = torch.int32 if n_bytes % 4 == 0 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0 else torch.uint8
    src_words, dst_words = src.view(-1).view(torch.uint8).view(word), dst.view(-1).view(torch.uint8).view(word)
    n = src_words.numel()
    _copy_kernel[(triton.cdiv(n, BLOCK),)](src_words, dst_words, n, BLOCK=BLOCK, num_warps=8)
    return dst


@triton.jit
def _read_kernel(src_ptr, sums_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(src_ptr + offsets, mask=offsets < n, other=0, eviction_policy="evict_first")
    tl.store(sums_ptr + pid, tl.sum(values, axis=0))


def _words(src: torch.Tensor) -> torch.Tensor:
    if not isinstance(src, torch.Tensor) or not src.is_contiguous():
        raise ValueError("src must be a contiguous tensor; call .contiguous() first")
    n_bytes = src.numel() * src.element_size()
    if n_bytes % 4 or src.data_ptr() % 4:
        raise ValueError(f"src holds {n_bytes} bytes at offset {src.data_ptr() % 4} from a 4-byte boundary; "
                         "device_read takes whole, aligned int32 words")
    return src.view(-1).view(torch.uint8).view(torch.int32)


def device_read(src: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """Read every byte of contiguous ``src`` once; returns one int32 per ``BLOCK`` words: the
    wrapped (mod 2**32) sum of its words. ``sums`` (int32, that many elements) may be given to
    keep the call allocation-free under a CUDA graph."""
    words = _words(src)
    programs = max(1, triton.cdiv(words.numel(), BLOCK))
    if sums is None:
        sums = torch.empty(programs, dtype=torch.int32, device=src.device)
    elif sums.dtype != torch.int32 or sums.numel() != programs or sums.device != src.device:
        raise ValueError(f"sums must be {programs} int32 values on {src.device}; got {sums.numel()} "
                         f"{sums.dtype} on {sums.device}")
    check_runnable(src, "src")
    _read_kernel[(programs,)](words, sums, words.numel(), BLOCK=BLOCK, num_warps=8)
    return sums


def read_sums_reference(src: torch.Tensor) -> torch.Tensor:
    """``device_read``'s twin: the per-block int32 word sums, wrapped to int32."""
    words = _words(src).long()
    programs = max(1, triton.cdiv(words.numel(), BLOCK))
    padded = torch.zeros(programs * BLOCK, dtype=torch.int64, device=words.device)
    padded[:words.numel()] = words
    sums = padded.view(programs, BLOCK).sum(1) & 0xFFFFFFFF
    return torch.where(sums >= 2**31, sums - 2**32, sums).to(torch.int32)
