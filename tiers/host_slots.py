"""Slots of the host DRAM tier (``tiers.host``): their states and legal transitions, the
per-slot record, and the one buffer they are carved from.

Pure bookkeeping types: ``HostTier`` owns every instance and guards them with its lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvstore.errors import ConfigError


class SlotState(Enum):
    PENDING = "pending"  # reserved and being written: invisible, never evicted
    LIVE = "live"        # complete and in the index
    DOOMED = "doomed"    # deleted while referenced: invisible, freed at the last release
    FREED = "freed"


LEGAL = {
    SlotState.PENDING: frozenset({SlotState.LIVE, SlotState.FREED}),
    SlotState.LIVE: frozenset({SlotState.DOOMED, SlotState.FREED}),
    SlotState.DOOMED: frozenset({SlotState.FREED}),
    SlotState.FREED: frozenset(),
}


@dataclass(slots=True)
class Entry:
    """One slot.  Its requested size lives in the allocator (keeps this object small)."""

    offset: int
    state: SlotState = SlotState.PENDING
    refs: int = 0
    children: int = 0                 # LIVE objects naming this one as parent
    parent: Entry | None = None      # the parent's entry when it was LIVE at our commit


def allocate(capacity: int, pin: bool | None) -> tuple[np.ndarray, object]:
    """The tier's one buffer: pinned (resident) with CUDA, else prefaulted numpy memory."""
    if pin is not False:
        import torch  # lazily: only the CUDA probe and the pinned path need it

        if torch.cuda.is_available():
            tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            return tensor.numpy(), tensor
        if pin:
            raise ConfigError("pin=True needs CUDA: pinned host memory is a CUDA-only path")
    array = np.empty(capacity, dtype=np.uint8)
    array.fill(0)  # fault every page in now, so later copies run at memcpy speed
    return array, None


def transition(entry: Entry, dst: SlotState) -> None:
    """Move ``entry`` to ``dst``; an illegal transition is a broken invariant."""
    if dst not in LEGAL[entry.state]:
        raise RuntimeError(f"slot at {entry.offset}: illegal {entry.state.name} -> {dst.name}")
    entry.state = dst
