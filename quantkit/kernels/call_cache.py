"""``SignatureCache``: what a launcher derived from one validated call, kept by the call's signature.

Kept free of triton imports: the model-level dispatchers (``models/fast_rope.py``) use it too,
and quantkit's torch backend must import without triton.
"""

from __future__ import annotations


class SignatureCache(dict):
    """What a launcher derived from one validated call, by the call's signature; bounded.

    An eager forward repeats a handful of call signatures hundreds of times; validating the
    arguments and re-deriving grids, strides and keys from them cost ~10-15 of RoPE's and flash
    attention's ~20-30 us of launcher Python and ~2-4 of a quantization's ~10-14 us (CPU,
    benchmarks/NOTES-e2e.md, session 6); building a signature and looking it up costs ~1 us.
    A launcher keys this cache on everything its validation reads (each tensor's shape,
    strides, dtype and device, the flags), so a call that differs in any of them misses, is
    validated in full and raises as before. Per-call facts (pointer alignment, the outputs'
    addresses) stay outside the cache. A dict, so a lookup is one ``get``; cleared when it
    holds ``max_entries`` (e.g. a server seeing many prompt lengths).
    """

    def __init__(self, max_entries: int = 256) -> None:
        super().__init__()
        self.max_entries = max_entries

    def get(self, signature, default=None):
        try:
            return dict.get(self, signature, default)
        except TypeError:  # an unhashable argument (window=[4], say): no entry; validation names it
            return default

    def add(self, signature, entry):
        """Keep ``entry`` under ``signature`` (not when it is unhashable); returns ``entry``."""
        if len(self) >= self.max_entries:
            self.clear()
        try:
            self[signature] = entry
        except TypeError:
            pass
        return entry


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (what ``torch.empty(shape).stride()`` gives):
    launchers take their outputs' strides from it when caching a call, before allocating them."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
