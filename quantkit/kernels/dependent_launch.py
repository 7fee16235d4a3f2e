"""The device side of programmatic dependent launch (``launch.PDL``; the host side, triton's
``launch_pdl`` option, is ``launch.pdl_options``).

A kernel launched with ``launch_pdl`` may be scheduled while the kernel before it in the stream
still runs. ``griddepcontrol.wait`` blocks until that kernel has finished and its writes are
visible; ``griddepcontrol.launch_dependents`` lets the kernel after this one be scheduled. A
kernel that never calls it releases its dependent when it exits. ``PDL`` is a kernel's constexpr:
``launch.PDL_OFF`` (0, no instruction), ``PDL_ORDERED`` (1) or ``PDL_EARLY`` (2).
"""

import triton
import triton.language as tl


@triton.jit
def wait_for_the_kernel_before(PDL: tl.constexpr):
    """Called before a kernel's first load. PDL_ORDERED: wait for the kernel before, then release
    the next one (whose own wait then orders it after this whole kernel). PDL_EARLY: release the
    next one first, then wait."""
    if PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    elif PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
