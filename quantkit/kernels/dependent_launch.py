"""The device side of programmatic dependent launch (``launch.PDL``; the host side, triton's
``launch_pdl`` option, is ``launch.pdl_options``).

A kernel launched with ``launch_pdl`` may be scheduled while the kernel before it in the stream
still runs. ``griddepcontrol.wait`` blocks until that kernel has finished and its writes are
visible; ``griddepcontrol.launch_dependents`` lets the kernel after this one be scheduled (a
kernel that never calls it releases its dependent when it exits).
"""

import triton
import triton.language as tl


@triton.jit
def wait_for_the_kernel_before(PDL: tl.constexpr):
    """Called before a kernel's first load and store (nothing when PDL is off): wait for the kernel
    before, then release the next one, whose own wait orders it after all of this kernel.

    Releasing first and waiting second (and a GEMV loading its first weight step before its wait)
    was measured too: 1.02x faster on a GEMV + quantization chain, 1.04x / 1.01x slower (FP8 /
    INT8) on a whole decode step, and a weight written on the GPU could then race the GEMV
    (benchmarks/NOTES-gemm.md, session 45)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
