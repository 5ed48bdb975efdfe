"""What the store core counts, and the hooks it calls as things happen.

Runs wherever the core runs (the connector's I/O loop, the store process's loop, an
embedded caller's loop).  ``StoreCounters`` is the core's own record (``TieredStore.stats``);
a ``StoreObserver`` lets the owner of a core feed its own metrics (the store process's
Prometheus counters, the connector's hit statistics).  The default observer does nothing.

Hooks are called on the core's event loop, never under a lock; they must be quick and must
not call back into the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiers.base import PutResult, Tier


class StoreObserver:
    """Override what you need; every hook defaults to nothing."""

    def tier_failed(self, tier: Tier, op: str, err: BaseException) -> None:
        """``tier`` raised ``err`` during ``op`` (lookup, contains, promote, delete): the
        core treated it as a miss (or a failed delete)."""

    def promoted(self, tier: Tier, size: int, seconds: float) -> None:
        """An object of ``size`` bytes was read from ``tier`` into a host slot."""

    def forged(self, tier: Tier, err: BaseException) -> None:
        """An object read from ``tier`` failed its MAC (``kvstore.integrity``): a miss, and
        the object was removed from that tier."""

    def promote_no_room(self) -> None:
        """A promotion found no room in the host pool (a miss)."""

    def written(self, tier: Tier, result: PutResult, size: int, err: BaseException | None) -> None:
        """One write-down of an object to ``tier`` ended with ``result`` (``err``: why it
        raised; the result is then FAILED)."""

    def write_down_done(self, seconds: float) -> None:
        """One object's copy to every lower tier took ``seconds``."""

    def write_down_dropped(self) -> None:
        """A write-through found its queue full and was dropped (a future lower-tier miss)."""


@dataclass(slots=True)
class StoreCounters:
    """The core's counters; each dict maps a tier name (or ``tier:what``) to a count."""

    lookups: int = 0
    keys_looked_up: int = 0
    keys_hit: dict[str, int] = field(default_factory=dict)
    gets: dict[str, int] = field(default_factory=dict)
    get_misses: int = 0
    bytes_read: dict[str, int] = field(default_factory=dict)
    read_seconds: dict[str, float] = field(default_factory=dict)
    promotions: int = 0
    promote_no_room: int = 0
    puts: dict[str, int] = field(default_factory=dict)
    put_failures: dict[str, int] = field(default_factory=dict)
    tier_errors: dict[str, int] = field(default_factory=dict)  # "tier:op" -> errors
    write_down: dict[str, int] = field(default_factory=dict)  # "tier:result" -> objects
    write_down_dropped: int = 0
    write_down_abandoned: int = 0  # still queued or dirty when a close timed out
    write_down_corrupt: int = 0  # failed the check before the copy (``verify``): not written
    forged: dict[str, int] = field(default_factory=dict)  # tier -> objects refused by their MAC, removed
    forged_reread: dict[str, int] = field(default_factory=dict)  # tier -> refused, but a second read verified: kept
    sealed: int = 0  # objects sealed with a MAC at commit
    encrypted: int = 0  # encrypted copies written down (encryption at rest)
    decrypted: int = 0  # encrypted objects read back and decrypted

    def add(self, table: str, label: str, n: float = 1) -> None:
        d = getattr(self, table)
        d[label] = d.get(label, 0) + n

    def count_put(self, tier: str, result: PutResult) -> None:
        if result is PutResult.STORED:
            self.add("puts", tier)
        elif result in (PutResult.NO_ROOM, PutResult.FAILED):
            self.add("put_failures", tier)


__all__ = ["StoreCounters", "StoreObserver"]
