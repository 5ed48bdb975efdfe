"""The eviction choice the tiers share: chain tails before parents, in the order of the
candidates (least recently used first; the host tier passes objects used once before
reused ones, ``tiers.host_slots``).

Pure and tiny on purpose: each tier decides what is protected (referenced, leased, being
read) and what "has a child present" means, and passes only its unprotected objects."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

K = TypeVar("K")


def pick_victim(candidates: Iterable[tuple[K, bool]]) -> K | None:
    """The first chain tail among ``(key, has_children)`` candidates, else the first key;
    None when there are none.  Candidates come oldest first and are consumed lazily, so a
    tail near the LRU end ends the scan early."""
    fallback = None
    for key, has_children in candidates:
        if not has_children:
            return key
        if fallback is None:
            fallback = key
    return fallback
