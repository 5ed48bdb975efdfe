"""Lookups across the tiers of the store core: which tier holds each key, and how large it is.

Runs on the core's event loop (``kvstore.store.tiered``).  Keys may be ``ObjectKey``s or
their canonical bytes (the store process's fast path: the host index compares bytes, and an
``ObjectKey`` is made, by the trusted constructor, only for a key a lower tier is asked about).

* The host pool answers the whole batch under one lock (``HostTier.sizes_sync``); when it
  holds every key, no other tier is asked.
* Each lower tier, fastest first, is asked once, in a batch, about the keys no faster tier
  holds: ``present`` (per key), except the lowest tier of a contiguous lookup, which is
  asked ``lookup`` (the prefix of those keys): nothing below it could fill a gap, so keys
  past its first miss cannot count, and a tier that answers prefixes (the store process)
  answers that in one round trip.
* Sizes are asked only for the lower-tier hits inside the contiguous prefix, one batch per
  tier, tiers concurrently; an object gone meanwhile ends the prefix.
* A tier that raises ``TierError`` holds nothing; ``failed(tier, "lookup", err)`` counts it.
"""

from __future__ import annotations

import asyncio
import functools
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import not_

from kvstore.errors import TierError
from kvstore.keys import ObjectKey
from tiers.base import Tier
from tiers.host import HostTier

Failed = Callable[[Tier, str, BaseException], None]

trusted_key = functools.partial(bytes.__new__, ObjectKey)
"""``ObjectKey`` from canonical bytes whose parts were already validated (no checks: ~5x
faster than ``ObjectKey(namespace, hash, tag)``)."""


def as_keys(keys: Sequence[bytes]) -> list[ObjectKey]:
    """``keys`` as ``ObjectKey``s (canonical bytes through the trusted constructor)."""
    if all(type(k) is ObjectKey for k in keys):
        return list(keys)  # type: ignore[arg-type]
    return list(map(trusted_key, keys))


def prefix(found: list) -> int:
    """Length of the run before the first None (one C-level scan)."""
    try:
        return found.index(None)
    except ValueError:
        return len(found)


@dataclass(slots=True)
class Found:
    """The keys one lower tier was found to hold: indices (ascending) and the keys."""

    tier: Tier
    index: list[int]
    keys: list[ObjectKey]


async def sized_lookup(
    host: HostTier, lower: Sequence[Tier], keys: Sequence[bytes], sized: bool, failed: Failed
) -> tuple[list[str], list[int | None]]:
    """Tier name and object size of each key of the contiguous hit (parallel lists).  With
    ``sized`` false, lower tiers are not asked for sizes (their hits' sizes are None)."""
    sizes = host.sizes_sync(keys)
    n = prefix(sizes)
    if n == len(keys) or not lower:
        return [host.name] * n, sizes[:n]
    names: list[str | None] = [None if size is None else host.name for size in sizes]
    found = await locate(lower, keys, names, failed, contiguous=True)
    n = prefix(names)
    if sized:
        n = await fill_sizes(found, sizes, n, failed)
    return names[:n], sizes[:n]  # type: ignore[return-value]


async def present_many(host: HostTier, lower: Sequence[Tier], keys: Sequence[bytes], failed: Failed) -> list[bool]:
    """Whether each key is held by some tier (per key, not a prefix)."""
    names: list[str | None] = [None if size is None else host.name for size in host.sizes_sync(keys)]
    if lower and None in names:
        await locate(lower, keys, names, failed, contiguous=False)
    return [name is not None for name in names]


async def locate(
    lower: Sequence[Tier], keys: Sequence[bytes], names: list[str | None], failed: Failed, contiguous: bool
) -> list[Found]:
    """Fill ``names`` (None: no faster tier holds the key) with the fastest lower tier of
    each key; what each tier was found to hold.  With ``contiguous``, the lowest tier is
    asked for a prefix (see the module docstring)."""
    todo = [i for i, name in enumerate(names) if name is None]
    asked = as_keys([keys[i] for i in todo])
    out = []
    for t, tier in enumerate(lower):
        if not todo:
            break
        flags = await _ask(tier, asked, contiguous and t == len(lower) - 1, failed)
        hit = list(compress(todo, flags))
        for i in hit:
            names[i] = tier.name
        out.append(Found(tier, hit, list(compress(asked, flags))))
        missed = list(map(not_, flags))
        todo, asked = list(compress(todo, missed)), list(compress(asked, missed))
    return out


async def _ask(tier: Tier, keys: list[ObjectKey], contiguous: bool, failed: Failed) -> list[bool]:
    try:
        if contiguous:
            n = await tier.lookup(keys)
            return [True] * n + [False] * (len(keys) - n)
        return list(await tier.present(keys))
    except TierError as err:
        failed(tier, "lookup", err)
        return [False] * len(keys)


async def fill_sizes(found: list[Found], sizes: list[int | None], n: int, failed: Failed) -> int:
    """Ask each lower tier, in one batch, the sizes of its hits among the first ``n`` keys
    (tiers concurrently); the prefix that survives (an object gone meanwhile ends it)."""

    async def ask(f: Found, m: int) -> None:
        try:
            got = await f.tier.sizes(f.keys[:m])
        except TierError as err:
            failed(f.tier, "lookup", err)
            got = [None] * m
        for i, size in zip(f.index, got):
            sizes[i] = size

    asks = [ask(f, m) for f in found if (m := bisect_left(f.index, n))]
    if len(asks) == 1:
        await asks[0]
    elif asks:
        await asyncio.gather(*asks)
    return prefix(sizes[:n])


__all__ = ["Found", "as_keys", "fill_sizes", "locate", "prefix", "present_many", "sized_lookup", "trusted_key"]
