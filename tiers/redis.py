"""Redis tier: objects shared across engines and hosts, on one Redis or a Redis Cluster.

Implements ``tiers.base.Tier`` on ``redis.asyncio`` (hiredis parser); it runs wherever the
store runs and is used from the event loop that opened it.  ``RedisTier.open(cfg)`` connects
and checks limits (``tiers.redis_config.connect``); ``sizes(keys)`` is the batch lookup (one MGET
of the manifests), and ``TierBase`` answers ``present`` and ``lookup`` over it.

Layout (``tiers.redis_manifest``): parts first, the manifest LAST, so a reader never sees half
an object; it reads the manifest, then the parts it names, pipelined straight into the caller's
buffer by ``tiers.redis_bulk`` (or, after an error reply there, by redis-py GETs), at most
``max_inflight_parts`` at a time, and verifies the whole object with ``codec.verify``.  A part
gone (evicted, lost with a node) is a miss counted in ``lost``; bad bytes or a bad manifest a
miss counted in ``corrupt``; both are cleaned up (the manifest is deleted only while it still
holds what the reader saw).  Parts are at most ``part_size`` bytes: no large reply allocation.

Puts: ``put_write`` SETs memoryview slices (no copies) as parts with ``PX orphan_ttl_s``, so an
abandoned put vanishes by itself; ``put_commit`` SETs the manifest (NX: content addressing
makes an existing one a success), then gives the parts the object's TTL (PERSIST when
``ttl_s`` is 0).  A part found missing then withdraws the manifest.  The data of a write is
only ever published under the manifest that names it, whose checksum a reader verifies.

Failures: an error *reply* (OOM under noeviction, READONLY, CLUSTERDOWN, ...) fails that put
or read only.  A *transport* failure (connection refused/reset, timeout) opens the circuit
breaker of that server (each cluster node has its own): while open, lookups answer misses,
reads return None and puts fail at once without touching the network, and a PING probe
closes it when the server is back.  Read and lookup paths never raise on Redis failures.

Concurrency: commands go out through a semaphore of ``pool_size`` (the pools hold two spare
connections for breaker probes), so the pool never runs dry.  Part transfers run as tasks
in an ``asyncio.TaskGroup``: a cancelled ``read_into`` or ``put_write`` waits for them, so no
task touches the caller's buffer after it returns or raises.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from contextlib import suppress
from enum import Enum
from typing import Any

from redis import exceptions as rx

from kvstore import codec
from kvstore.errors import CapacityError, ConfigError, ObjectFormatError, TierUnavailableError
from kvstore.keys import ObjectKey
from tiers.base import PutHandle, TierBase, TierStats
from tiers.redis_bulk import BulkReader, Outcome
from tiers.redis_config import RedisConfig, connect
from tiers.redis_manifest import (
    DELETE_IF_SAME, NONCE_SIZE, Manifest, covered, manifest_key, parse, part_keys, pieces,
)
from tiers.redis_nodes import CLUSTER, DOWN, Down, RedisNodes, gather_all


class _Fetch(Enum):
    OK = "ok"
    LOST = "lost"          # a part is gone: the object is dead, clean it up
    CORRUPT = "corrupt"    # a part has the wrong length or the object fails verification
    FAILED = "failed"      # no answer or an error reply: a miss, the object may be fine


@dataclasses.dataclass(slots=True)
class _Put:
    """Tier-private state of one put (``PutHandle.token``)."""

    manifest: Manifest
    keys: list[str]
    filled: list[int]     # bytes written into each part
    failed: str = ""      # why this put can no longer be published


class RedisTier(RedisNodes, TierBase):
    """The Redis tier (see the module docstring).  Build with ``await RedisTier.open(cfg)``."""

    name = "redis"

    def __init__(self, cfg: RedisConfig, client: Any, bulk_limit: int) -> None:
        super().__init__(cfg, client)
        self.bulk_limit = bulk_limit
        self._stats = TierStats(self.name)
        self._lost = 0
        self._puts: dict[int, _Put] = {}  # puts between put_start and put_commit
        self._ttl_ms = int(cfg.ttl_s * 1000) or None
        self._orphan_ms = int(cfg.orphan_ttl_s * 1000)
        self._bulk = BulkReader(cfg, lambda node, err: self._breaker(node).failure(err))

    # --- lifecycle ----------------------------------------------------------------------

    @classmethod
    async def open(cls, cfg: RedisConfig) -> "RedisTier":
        """Connect, PING and check limits (``tiers.redis_config.connect``)."""
        client, bulk_limit = await connect(cfg)
        return cls(cfg, client, bulk_limit)

    async def __aenter__(self) -> "RedisTier":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

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
        extra: dict[str, float] = {"lost": self._lost, **self.breaker_stats(), **bulk,
                                   "round_trips": self._round_trips + bulk["bulk_round_trips"]}
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
        return size

    async def _read(self, key: ObjectKey, view: memoryview) -> int | None:
        found = await self._manifest(key)
        if found is None:
            return None
        raw, manifest = found
        if len(view) < manifest.size:
            raise ConfigError(f"buffer of {len(view)} bytes cannot hold {key!r} ({manifest.size} bytes)")
        outcome = await self._fetch(part_keys(self.cfg.key_prefix, key, manifest), manifest, view)
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
        return None

    async def _fetch(self, keys: list[str], manifest: Manifest, view: memoryview) -> _Fetch:
        """Every part into ``view`` at its offset: ``tiers.redis_bulk``, or redis-py on FALLBACK."""
        nodes = [self._node(k) for k in keys]
        if not all([self._allow(n) for n in set(nodes)]):
            return _Fetch.FAILED
        bulk = CLUSTER not in nodes  # else: no node known for some key, let redis-py find it
        outcome = await self._bulk.read_into(nodes, keys, manifest, view) if bulk else Outcome.FALLBACK
        if outcome is not Outcome.FALLBACK:
            return _Fetch(outcome.value)
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

        await gather_all([worker() for _ in range(min(self.cfg.max_inflight_parts, len(keys)))])
        return state[0]

    async def _drop(self, key: ObjectKey, raw: bytes, manifest: Manifest | None) -> None:
        """Remove a dead object: its manifest if it still is ``raw``, then its parts."""
        mkey = manifest_key(self.cfg.key_prefix, key)
        node = self._node(mkey)
        with suppress(Down, rx.RedisError):
            if self._allow(node):
                await self._call(node, self._client.eval, DELETE_IF_SAME, 1, mkey, raw)
        if manifest is not None:
            await self._per_node(part_keys(self.cfg.key_prefix, key, manifest), "UNLINK")

    async def delete(self, key: ObjectKey) -> bool:
        found = await self._manifest(key)
        if found is None:
            return False
        await self._drop(key, *found)
        return True

    # --- two-phase put -------------------------------------------------------------------

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        if size < codec.HEADER_SIZE:
            raise ConfigError(f"object size {size} is smaller than the {codec.HEADER_SIZE}-byte header")
        if size > self.cfg.max_object_bytes:
            raise CapacityError(f"object of {size} bytes exceeds max_object_bytes "
                                f"{self.cfg.max_object_bytes} of the redis tier {self.cfg.redacted_url}")
        if not self._allow(self._node(manifest_key(self.cfg.key_prefix, key))):
            self._stats.put_failures += 1
            return None
        manifest = Manifest(size, self.cfg.part_size, os.urandom(NONCE_SIZE))
        state = _Put(manifest, part_keys(self.cfg.key_prefix, key, manifest), [0] * manifest.count)
        self._puts[id(state)] = state
        return PutHandle(key, size, parent, None, state)

    def _live(self, handle: PutHandle, claim: bool = False) -> _Put:
        state = handle.token
        if not isinstance(state, _Put) or self._puts.get(id(state)) is not state:
            raise RuntimeError(f"put of {handle.key!r} is not in progress on the redis tier")
        if claim:
            del self._puts[id(state)]
        return state

    async def put_write(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        """Send ``data`` as parts (whole parts by SET, pieces by SETRANGE); a failure is
        remembered and fails the commit.  Returns once Redis holds every byte."""
        state = self._live(handle)
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > handle.size:
            raise ConfigError(f"write [{offset}, {offset + len(view)}) outside a {handle.size}-byte object")
        todo = iter(pieces(state.manifest, offset, len(view)))

        async def worker() -> None:
            for i, at, lo, hi in todo:
                if state.failed:
                    return
                state.failed = await self._write_piece(state, i, at, view[lo:hi])

        n = min(self.cfg.max_inflight_parts, state.manifest.count)
        await gather_all([worker() for _ in range(n)])

    async def _write_piece(self, state: _Put, i: int, at: int, piece: memoryview) -> str:
        """Write ``piece`` at ``at`` inside part ``i``; why it failed, or ""."""
        key, node = state.keys[i], self._node(state.keys[i])
        if not self._allow(node):
            return f"{node} is unavailable"
        start, end = state.manifest.part_range(i)
        try:
            if at == 0 and len(piece) == end - start:
                await self._call(node, self._client.set, key, piece, px=self._orphan_ms)
            else:
                pipe = self._pipeline()
                pipe.setrange(key, at, piece).pexpire(key, self._orphan_ms)
                await self._call(node, pipe.execute)
        except Down:
            return f"{node} is unavailable"
        except rx.RedisError as err:
            return f"{node} refused a part: {err}"
        state.filled[i] += len(piece)
        return ""

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        state = self._live(handle, claim=True)
        visible = False
        try:
            if ok and not state.failed and covered(state.manifest, state.filled):
                visible = await self._publish(handle.key, state)
        finally:
            if not visible or state.failed:
                with suppress(TierUnavailableError):
                    await self._per_node(state.keys, "UNLINK")
            self._stats.puts += visible  # also when another writer's identical object won
            self._stats.put_failures += not visible
            self._stats.bytes_written += handle.size if visible and not state.failed else 0
        return visible

    async def _publish(self, key: ObjectKey, state: _Put) -> bool:
        """SET the manifest (NX), then give the parts their final TTL; True when visible.
        ``state.failed`` is set when our parts are not part of what is visible."""
        mkey, raw = manifest_key(self.cfg.key_prefix, key), state.manifest.pack()
        node = self._node(mkey)
        if not self._allow(node):
            return False
        try:
            if not await self._call(node, self._client.set, mkey, raw, nx=True, px=self._ttl_ms):
                state.failed = "exists"  # another writer published this key first: a success
                return True
        except (Down, rx.RedisError):
            return False
        if self._ttl_ms:
            replies = await self._per_node(state.keys, "PEXPIRE", self._ttl_ms)
        else:
            replies = await self._per_node(state.keys, "PERSIST")
        if all(r == 1 for r in replies):
            return True
        await self._drop(key, raw, None)  # a part vanished (eviction): withdraw the manifest
        return False


__all__ = ["RedisTier", "RedisConfig"]
