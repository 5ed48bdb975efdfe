"""Redis tier: objects shared across engines and hosts, on one Redis or a Redis Cluster.

Implements ``tiers.base.Tier`` on ``redis.asyncio`` (hiredis parser); it runs wherever the
store runs and is used from the event loop that opened it.  ``RedisTier.open(cfg)`` connects
and checks limits (``tiers.redis_connect.connect``); ``sizes(keys)`` is the batch lookup (one MGET
of the manifests), and ``TierBase`` answers ``present`` and ``lookup`` over it.

Layout (``tiers.redis_manifest``): the data first, the manifest LAST, so a reader never sees
half an object.  A read is ONE round trip for an object up to ``part_size`` (the manifest and
the inline value GET together, pipelined on the bulk connections of ``tiers.redis_bulk``, the
value landing straight in the caller's buffer); a larger object then has the parts its
manifest names pipelined into the buffer, at most ``max_inflight_parts`` at a time.  After an
error reply on the bulk path (MOVED, NOPERM, ...) the object is read through redis-py.  The
whole object is verified (``codec.verify``).  Data gone (evicted, lost with a node) is a miss
counted in ``lost``; bad bytes or a bad manifest a miss counted in ``corrupt``; both are
cleaned up (the manifest is deleted only while it still holds what the reader saw).  No
reply is larger than ``part_size``: no large reply allocation.

Puts (``tiers.redis_put``): the data goes first with ``PX orphan_ttl_s``, so an abandoned put
vanishes by itself (parts as memoryview slices, an inline object as one SET NX, never half
there); ``put_commit`` SETs the manifest (NX: content addressing makes an existing one a
success), then gives the data the object's TTL (PERSIST when ``ttl_s`` is 0).  Data found
missing then withdraws the manifest.  The data of a write is only ever published under the
manifest that names it, and a reader verifies it.

Failures: an error *reply* (OOM under noeviction, READONLY, CLUSTERDOWN, ...) fails that put
or read only.  A *transport* failure (connection refused/reset, timeout) opens the circuit
breaker of that server (each cluster node has its own): while open, lookups answer misses,
reads return None and puts fail at once without touching the network, and a PING probe
closes it when the server is back.  Read and lookup paths never raise on Redis failures.

Concurrency: commands go out through a semaphore of ``pool_size`` (the pools hold two spare
connections for breaker probes), so the pool never runs dry.  Transfers run as tasks
in an ``asyncio.TaskGroup``: a cancelled ``read_into`` or ``put_write`` waits for them, so no
task touches the caller's buffer after it returns or raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import suppress
from enum import Enum
from typing import Any

from redis import exceptions as rx

from kvstore import codec
from kvstore.errors import ConfigError, ObjectFormatError
from kvstore.keys import ObjectKey
from tiers.base import Removal, TierBase, TierStats
from tiers.redis_budget import RedisBudget
from tiers.redis_bulk import BulkReader, Outcome, Slot
from tiers.redis_config import RedisConfig
from tiers.redis_connect import connect
from tiers.redis_manifest import (
    DELETE_IF_SAME,
    MANIFEST_SIZE,
    Manifest,
    data_keys,
    inline_key,
    manifest_key,
    parse,
    part_keys,
)
from tiers.redis_nodes import CLUSTER, DOWN, Down, RedisNodes, gather_all
from tiers.redis_put import RedisPuts


class _Fetch(Enum):
    OK = "ok"
    LOST = "lost"  # a part is gone: the object is dead, clean it up
    CORRUPT = "corrupt"  # a part has the wrong length or the object fails verification
    FAILED = "failed"  # no answer or an error reply: a miss, the object may be fine


class RedisTier(RedisPuts, RedisBudget, RedisNodes, TierBase):
    """The Redis tier (see the module docstring).  Build with ``await RedisTier.open(cfg)``."""

    name = "redis"

    def __init__(self, cfg: RedisConfig, client: Any, bulk_limit: int) -> None:
        super().__init__(cfg, client)
        self.bulk_limit = bulk_limit
        self._stats = TierStats(self.name)
        self._lost = 0
        self._budget_counts = {"budget_evicted": 0, "budget_refused": 0}  # tiers.redis_budget
        self._puts: dict[int, object] = {}  # puts between put_start and put_commit (tiers.redis_put)
        self._ttl_ms = int(cfg.ttl_s * 1000) or None
        self._orphan_ms = int(cfg.orphan_ttl_s * 1000)
        self._bulk = BulkReader(cfg, lambda node, err: self._breaker(node).failure(err))

    # --- lifecycle ----------------------------------------------------------------------

    @classmethod
    async def open(cls, cfg: RedisConfig) -> RedisTier:
        """Connect, PING and check limits (``tiers.redis_connect.connect``)."""
        client, bulk_limit = await connect(cfg)
        return cls(cfg, client, bulk_limit)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._bulk.aclose()
        await self._close_breakers()
        with suppress(Exception):
            await self._client.aclose()

    def stats(self) -> TierStats:
        """Counters; ``extra``: lost, round_trips and the breakers' counters summed over
        servers (``breaker_open`` = how many are open now), and the bulk reader's ``bulk_*``."""
        bulk = self._bulk.stats()
        extra: dict[str, float] = {
            "lost": self._lost,
            **self.breaker_stats(),
            **bulk,
            **self._budget_counts,
            "round_trips": self._round_trips + bulk["bulk_round_trips"],
        }
        return dataclasses.replace(self._stats, extra=extra)

    # --- lookups --------------------------------------------------------------------------

    async def sizes(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        """The size in each key's sound published manifest (None: absent, unreachable or
        unparsable): one round trip per server (MGET, or a pipeline per cluster node)."""
        if not keys:
            return []
        mkeys = [manifest_key(self.cfg.key_prefix, k) for k in keys]
        replies: list[Any] = [DOWN] * len(mkeys)
        if self.cfg.cluster:
            replies = await self._per_node(mkeys, "GET")
        elif self._allow(self.cfg.address):
            with suppress(Down, rx.RedisError):
                replies = await self._call(self.cfg.address, self._client.mget, mkeys)
        manifests = [parse(r) if isinstance(r, bytes) else None for r in replies]
        return [None if m is None else m.size for m in manifests]

    async def size_of(self, key: ObjectKey) -> int | None:
        found = await self._manifest(key)
        return None if found is None else found[1].size

    async def _manifest(self, key: ObjectKey) -> tuple[bytes, Manifest] | None:
        """The raw and parsed manifest of ``key``; None when absent, unreachable or corrupt
        (a corrupt one is deleted and counted)."""
        mkey = manifest_key(self.cfg.key_prefix, key)
        node = self._node(mkey)
        if not self._allow(node):
            return None
        try:
            raw = await self._call(node, self._client.get, mkey)
        except (Down, rx.RedisError):
            return None
        if raw is None:
            return None
        manifest = parse(raw)
        if manifest is None:
            self._stats.corrupt += 1
            await self._drop(key, raw, None)
            return None
        return raw, manifest

    # --- read -----------------------------------------------------------------------------

    async def read_into(self, key: ObjectKey, buf: memoryview) -> int | None:
        view = memoryview(buf).cast("B")
        size = await self._read(key, view)
        if size is None:
            self._stats.misses += 1
        else:
            self._stats.hits += 1
            self._stats.bytes_read += size
            if self.cfg.budget_bytes:
                await self._touch(key)
        return size

    async def _read(self, key: ObjectKey, view: memoryview, again: bool = True) -> int | None:
        """One round trip (manifest and inline value, pipelined on the bulk connections),
        then, for an object of parts, the parts it names.  In a cluster, an error reply
        (most likely MOVED: slots migrated) refreshes the slot map and reads ``again``."""
        prefix = self.cfg.key_prefix
        mkey, ikey = manifest_key(prefix, key), inline_key(prefix, key)
        mnode, inode = self._node(mkey), self._node(ikey)
        if CLUSTER in (mnode, inode):  # no node known for a key: let redis-py find it
            return await self._read_slow(key, view)
        if not self._allow(mnode):
            return None
        head, body = Slot(memoryview(bytearray(MANIFEST_SIZE))), Slot(view)
        gets = [(mnode, mkey, head)] + ([(inode, ikey, body)] if self._allow(inode) else [])
        outcomes = await self._bulk.get_slots(gets)
        if outcomes[0] is Outcome.FAILED:
            return None
        if Outcome.FALLBACK in outcomes:
            if again and self.cfg.cluster:
                await self._refresh_slots()
                return await self._read(key, view, again=False)
            return await self._read_slow(key, view)
        if head.length == -1:
            return None
        manifest = parse(bytes(head.buf)) if head.length == MANIFEST_SIZE else None
        if manifest is None:  # damaged: the slow path reads it again, counts it and cleans up
            return await self._read_slow(key, view)
        raw = bytes(head.buf)
        self._check_room(key, view, manifest)
        if not manifest.inline:
            outcome = await self._fetch(part_keys(prefix, key, manifest), manifest, view)
        elif len(outcomes) < 2 or outcomes[1] is Outcome.FAILED:
            return None
        else:
            outcome = _inline_outcome(body.length, manifest)
            if outcome is _Fetch.OK:
                self._bulk.counted(1, manifest.size)
        return await self._settle(key, view, raw, manifest, outcome)

    async def _read_slow(self, key: ObjectKey, view: memoryview) -> int | None:
        """The read through redis-py (after an error reply on the bulk path, or in a cluster
        whose slot map lacks a key): the manifest, then its bytes."""
        found = await self._manifest(key)
        if found is None:
            return None
        raw, manifest = found
        self._check_room(key, view, manifest)
        keys = data_keys(self.cfg.key_prefix, key, manifest)
        if manifest.inline:
            outcome = await self._fetch_inline(keys[0], manifest, view)
        else:
            outcome = await self._fetch(keys, manifest, view, bulk=False)
        return await self._settle(key, view, raw, manifest, outcome)

    @staticmethod
    def _check_room(key: ObjectKey, view: memoryview, manifest: Manifest) -> None:
        if len(view) < manifest.size:
            raise ConfigError(f"buffer of {len(view)} bytes cannot hold {key!r} ({manifest.size} bytes)")

    async def _settle(
        self, key: ObjectKey, view: memoryview, raw: bytes, manifest: Manifest, outcome: _Fetch
    ) -> int | None:
        """The object's size once verified; else count the miss and clean up a dead object."""
        if outcome is _Fetch.OK:
            try:
                codec.verify(view[: manifest.size], key, manifest.size)
                return manifest.size
            except ObjectFormatError:
                outcome = _Fetch.CORRUPT
        if outcome is _Fetch.LOST:
            self._lost += 1
        elif outcome is _Fetch.CORRUPT:
            self._stats.corrupt += 1
        if outcome is not _Fetch.FAILED:
            await self._drop(key, raw, manifest)
            # A part gone means Redis dropped it: its TTL (``ttl_s``) or its maxmemory policy.
            lost = Removal.EXPIRED if self._ttl_ms else Removal.EVICTED
            self._removed(key, lost if outcome is _Fetch.LOST else Removal.CORRUPT)
        return None

    async def _fetch_inline(self, ikey: str, manifest: Manifest, view: memoryview) -> _Fetch:
        node = self._node(ikey)
        if not self._allow(node):
            return _Fetch.FAILED
        try:
            data = await self._call(node, self._client.get, ikey)
        except (Down, rx.RedisError):
            return _Fetch.FAILED
        outcome = _inline_outcome(-1 if data is None else len(data), manifest)
        if outcome is _Fetch.OK:
            view[: manifest.size] = data
        return outcome

    async def _fetch(self, keys: list[str], manifest: Manifest, view: memoryview, bulk: bool = True) -> _Fetch:
        """Every part into ``view`` at its offset: ``tiers.redis_bulk``, or redis-py on FALLBACK
        (or when ``bulk`` is off: the bulk path just fell back for this read).  In a cluster a
        FALLBACK is most likely a MOVED slot: the slot map is refreshed and the bulk path tried
        once more first."""
        nodes = [self._node(k) for k in keys]
        if not all([self._allow(n) for n in set(nodes)]):
            return _Fetch.FAILED
        for attempt in range(2 if bulk and self.cfg.cluster else 1 if bulk else 0):
            if CLUSTER in nodes:  # no node known for some key: let redis-py find it
                break
            outcome = await self._bulk.read_into(nodes, keys, manifest, view)
            if outcome is not Outcome.FALLBACK:
                return _Fetch(outcome.value)
            if attempt == 0 and self.cfg.cluster:
                await self._refresh_slots()
                nodes = [self._node(k) for k in keys]
                if not all([self._allow(n) for n in set(nodes)]):
                    return _Fetch.FAILED
        return await self._fetch_slow(keys, nodes, manifest, view)

    async def _fetch_slow(self, keys: list[str], nodes: list[str], manifest: Manifest, view: memoryview) -> _Fetch:
        """The parts through redis-py: ``max_inflight_parts`` at a time on one server, one at a
        time in a cluster (redis-py's cluster client closes every connection when a MOVED
        makes it rebuild its slot map, which cuts the commands of concurrent readers)."""
        todo = iter(range(len(keys)))
        state = [_Fetch.OK]

        async def worker() -> None:
            for i in todo:
                if state[0] is not _Fetch.OK:
                    return
                try:
                    data = await self._call(nodes[i], self._client.get, keys[i])
                except (Down, rx.RedisError):
                    state[0] = _Fetch.FAILED
                    return
                start, end = manifest.part_range(i)
                if data is None or len(data) != end - start:
                    state[0] = _Fetch.LOST if data is None else _Fetch.CORRUPT
                    return
                view[start:end] = data

        workers = 1 if self.cfg.cluster else min(self.cfg.max_inflight_parts, len(keys))
        await gather_all([worker() for _ in range(workers)])
        return state[0]

    async def _drop(self, key: ObjectKey, raw: bytes, manifest: Manifest | None, release: bool = True) -> None:
        """Remove a dead object: its manifest if it still is ``raw``, then its parts; then its
        budget reservation (``release``: not when the budget itself evicted it)."""
        mkey = manifest_key(self.cfg.key_prefix, key)
        node = self._node(mkey)
        with suppress(Down, rx.RedisError):
            if self._allow(node):
                await self._call(node, self._client.eval, DELETE_IF_SAME, 1, mkey, raw)
        if manifest is not None:
            await self._per_node(data_keys(self.cfg.key_prefix, key, manifest), "UNLINK")
        if release and self.cfg.budget_bytes:
            await self._release(key)

    async def delete(self, key: ObjectKey) -> bool:
        found = await self._manifest(key)
        if found is None:
            return False
        await self._drop(key, *found)
        self._removed(key, Removal.DELETED)
        return True


def _inline_outcome(length: int, manifest: Manifest) -> _Fetch:
    """What an inline value of ``length`` bytes (-1: none) means for ``manifest``'s object."""
    if length == manifest.size:
        return _Fetch.OK
    return _Fetch.LOST if length == -1 else _Fetch.CORRUPT


__all__ = ["RedisTier", "RedisConfig"]
