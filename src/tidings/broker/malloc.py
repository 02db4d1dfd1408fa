"""Keep glibc from returning chunk-sized memory to the kernel after every message.

Content moves in 256 KiB chunks. glibc serves allocations that large with mmap (or trims the
heap top with brk) and hands them back on free, so every chunk costs fresh, zeroed pages: on
this kind of machine a third of a broker's CPU went to those page faults during a large append
(`bench/append.py`, single 1 GiB append at R=3: 78-86 MB/s before, 106-144 MB/s after).
Raising the mmap and trim thresholds lets freed chunks be reused. Memory still stays flat: it is
the same few chunks over and over, not growth. A no-op where glibc's `mallopt` is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # the largest value glibc accepts on 64-bit
TRIM_THRESHOLD = 256 * 1024 * 1024


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where not supported."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("malloc thresholds raised: %s", ok)
    return ok
