"""Verify's processes keep the memory they free for their next allocations.

The reference and the scenarios allocate and free caches, objects and index grids of tens to
hundreds of MiB per check (DeepSeek-V4's model scenarios: caches of up to 84 M elements, moved
tokens x layers x bytes positions). glibc serves every block over its mmap threshold (at most
32 MiB) with a mapping of its own and unmaps it on free, so the next block of that size
page-faults afresh, one fault and one zeroed page per 4 KiB: measured on a DeepSeek-V4 scenario,
the kernel's time was twice the checks' own (24 s of system time against 12 s of user time).
With mappings off and the heap's top never trimmed, a freed block is reused as it is; a
process holds its peak heap until it exits, which verify's short-lived processes can afford.

ctypes and the process's own C library only: nothing is loaded from a file.
"""

from __future__ import annotations

import ctypes
import sys

#: mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: The trim threshold that turns trimming off (mallopt(3)).
NEVER_TRIM = -1


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve large blocks from the heap and keep freed ones; False where
    the C library has no mallopt (not Linux, or a libc other than glibc), which changes nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already has
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
