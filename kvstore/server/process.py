"""Process-wide settings of the store process: glibc's heap thresholds and non-dumpability.

Server side; ``kvstore.server.main.run`` applies both before the event loop starts.  Each
returns whether it took effect (False off glibc or off Linux) and never raises.
"""

from __future__ import annotations


def tune_malloc() -> bool:
    """Keep freed message buffers in the heap instead of unmapping them (glibc only).

    Every 1 MiB stream frame is a fresh ``bytes`` (grpc needs one per message); above glibc's
    mmap threshold each is a new mapping whose pages fault in one by one, which caps copies
    near 2 GB/s (docs/limits.md#fresh-allocations).  Raising the mmap and trim thresholds lets the heap reuse the
    same pages: GetStream went from 0.78 to 0.96 GB/s here.  The cost is that the heap keeps
    its peak size (bounded by frames in flight)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def harden_process() -> bool:
    """``prctl(PR_SET_DUMPABLE, 0)``: no ptrace, no ``/proc/<pid>/fd`` or ``mem`` for other
    processes of our uid (root excepted), no core dumps of tenants' bytes.  Linux only."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        return False


__all__ = ["harden_process", "tune_malloc"]
