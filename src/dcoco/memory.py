"""This process's memory: its resident size, and handing the heap's free pages back to the system.
Training logs the one and trims after every step (docs/training.md#memory); the context-parallel
memory benchmarks measure peaks above a trimmed baseline."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional


def rss_bytes() -> int:
    """Resident set size in bytes (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resident_gb() -> Optional[float]:
    """`rss_bytes` in GB to 3 decimals, None where /proc is not there."""
    try:
        return round(rss_bytes() / 1e9, 3)
    except OSError:
        return None


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> None:
    """glibc's malloc_trim: freed tensors leave the resident set instead of staying in the heap,
    where shapes that change every step (online features) pile them up. A no-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
