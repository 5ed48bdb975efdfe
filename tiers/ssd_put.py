"""One SSD put in progress (``tiers.ssd.SSDTier``): ``PutState``, the tier-private state a
``PutHandle`` carries (its temp file and descriptor, the first write error, the capacity it
holds), and the two steps that run in worker threads on it: ``write_part`` (one ``pwrite``,
its error remembered) and ``discard`` (close and unlink the temp file).

Runs wherever an SSD tier is (inside the engine's store core, or in the store process).
"""

from __future__ import annotations

import os
from contextlib import suppress
from dataclasses import dataclass

from tiers.ssd_files import pwrite_all, unlink_quiet
from tiers.ssd_index import Entry


@dataclass(slots=True)
class PutState:
    """Tier-private state of one put (``PutHandle.token``)."""

    path: str  # the temp file
    fd: int = -1
    error: Exception | None = None  # first failure; later writes are skipped
    entry: Entry | None = None  # set once renamed into place and indexed
    reserved: int = 0  # capacity held for this put until published or failed


def write_part(state: PutState, view: memoryview, offset: int, flush_early: bool) -> None:
    """``pwrite_all`` in a worker thread.  An error (e.g. ENOSPC) is remembered in the state
    even if the caller was cancelled meanwhile: the commit fails and cleans up."""
    try:
        pwrite_all(state.fd, view, offset, flush_early)
    except OSError as err:
        state.error = err


def discard(state: PutState) -> None:
    """Close the temp file (if still open) and unlink it: the put leaves no trace."""
    fd, state.fd = state.fd, -1
    if fd >= 0:
        with suppress(OSError):  # a broken fd (the write error being cleaned up)
            os.close(fd)
    unlink_quiet(state.path)


__all__ = ["PutState", "discard", "write_part"]
