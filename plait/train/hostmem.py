"""Host memory: keep freed blocks in the process instead of handing them back to the kernel.

glibc serves every block over 32 MiB with its own mmap and unmaps it on free, and trims the
heap's free top beyond a threshold. A training step allocates and frees the same big tensors
every micro-batch (embedding gradients, logits, activations), so each one is page-faulted in
and zeroed by the kernel again, page by page, which on a CPU is a sizeable share of a training
step (the `fill_` and `add` that first touch fresh gradient buffers). With big blocks served
from the heap and no trimming, a freed block is reused as it is.

The cost: the process's RSS stays at its peak instead of shrinking between phases (the peak
itself does not grow). The settings are process-wide; `retained_host_memory` puts glibc's
defaults back when the run ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys


# mallopt parameters (malloc.h) and glibc's defaults
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has no such symbol)
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def retained_host_memory(enabled: bool = True):
    """Inside, freed host memory stays in the process for reuse (where glibc allows it): big
    blocks come from the heap and the heap is never trimmed. Yields whether that took effect;
    glibc's defaults are back on exit and the free memory is returned to the kernel."""
    libc = glibc() if enabled else None
    active = bool(libc) and libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    try:
        yield active
    finally:
        if active:
            libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
            libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
            libc.malloc_trim(0)
