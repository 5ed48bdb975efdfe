"""The two-phase put of the Redis tier (mixed into ``tiers.redis.RedisTier``).

Runs on the event loop that owns the tier.  Layout: ``tiers.redis_manifest``; the data of a
write is only ever published under the manifest that names it, written LAST.

* **Parts** (objects larger than ``part_size``): ``put_write`` SETs memoryview slices (no
  copies) as parts with ``PX orphan_ttl_s``, so an abandoned put vanishes by itself, and
  returns once Redis holds every byte (pieces that are not whole parts by SETRANGE).
* **Inline** (objects up to ``part_size``): the whole object is ONE value, ``SET NX PX
  orphan_ttl_s`` in one command, so it is never half there; written straight from the
  caller's memory when ``put_write`` hands it whole, else staged in a private buffer until
  every byte has come (one ``part_size`` copy at most) and sent then.  NX: the first
  complete copy of a key stays.  When one is already there (a published object, or another
  writer's, alive or dead), this put adopts it: the manifest names only a size, and the
  reader verifies the value against it and the object's own checksum.  ``own`` records
  whether the value is this put's.
* ``put_commit`` SETs the manifest (NX: content addressing makes an existing one a success),
  then gives the data its final TTL (PEXPIRE, or PERSIST when ``ttl_s`` is 0); a value or
  part found missing then withdraws the manifest.  Cleanup of a put that is not published:
  its parts are unlinked; its inline value only when it is its own and no manifest
  appeared meanwhile (another writer may have published it), else it keeps its orphan TTL.
  A put that met an existing manifest with an inline value of its own keeps that value
  (with the final TTL) when the manifest is inline, as it may be what that manifest serves.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from redis import exceptions as rx

from kvstore import codec
from kvstore.errors import CapacityError, ConfigError, TierUnavailableError
from kvstore.keys import ObjectKey
from tiers.base import PutHandle, TierStats
from tiers.redis_manifest import NONCE_SIZE, Manifest, covered, data_keys, manifest_key, parse, pieces
from tiers.redis_nodes import Down, gather_all

if TYPE_CHECKING:
    from tiers.redis_config import RedisConfig


@dataclasses.dataclass(slots=True)
class _Put:
    """Tier-private state of one put (``PutHandle.token``)."""

    manifest: Manifest
    keys: list[str]
    filled: list[int]  # bytes written into each part
    failed: str = ""  # why this put can no longer be published
    staged: bytearray | None = None  # an inline object written in pieces, until complete
    own: bool = False  # the inline value in Redis is this put's (SET NX won)
    reserved: bool = False  # this put made the key's budget reservation (tiers.redis_budget)


class RedisPuts:
    """Needs from its host class (``RedisTier``): ``cfg``, ``_stats``, ``_puts``, ``_ttl_ms``,
    ``_orphan_ms``, ``_client``, ``_node``, ``_allow``, ``_call``, ``_pipeline``,
    ``_per_node``, ``_drop``, ``_reserve``/``_release`` (``tiers.redis_budget``) and ``_stored``
    (``TierBase``: the residency listener)."""

    if TYPE_CHECKING:  # what the host class provides, declared for the type checker only
        cfg: RedisConfig
        _stats: TierStats
        _puts: dict[int, object]
        _ttl_ms: int | None
        _orphan_ms: int
        _client: Any

        def _node(self, key: str) -> str: ...
        def _allow(self, node: str) -> bool: ...
        async def _call(self, node: str, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any: ...
        def _pipeline(self) -> Any: ...
        async def _per_node(self, keys: Sequence[str], command: str, *args: Any) -> list[Any]: ...
        async def _drop(self, key: ObjectKey, raw: bytes, manifest: Manifest | None, release: bool = True) -> None: ...
        async def _reserve(self, key: ObjectKey, size: int) -> bool | None: ...
        async def _release(self, key: ObjectKey, older_than_s: int | None = None) -> bool: ...
        def _stored(self, key: ObjectKey) -> None: ...

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        if size < codec.HEADER_SIZE:
            raise ConfigError(f"object size {size} is smaller than the {codec.HEADER_SIZE}-byte header")
        if size > self.cfg.max_object_bytes:
            raise CapacityError(
                f"object of {size} bytes exceeds max_object_bytes "
                f"{self.cfg.max_object_bytes} of the redis tier {self.cfg.redacted_url}"
            )
        if not self._allow(self._node(manifest_key(self.cfg.key_prefix, key))):
            self._stats.put_failures += 1
            return None
        reserved = False
        if self.cfg.budget_bytes:  # room within the prefix's budget first (CapacityError: never fits)
            made = await self._reserve(key, size)
            if made is None:
                self._stats.put_failures += 1
                return None
            reserved = made
        manifest = Manifest(size, self.cfg.part_size, os.urandom(NONCE_SIZE), inline=size <= self.cfg.part_size)
        state = _Put(manifest, data_keys(self.cfg.key_prefix, key, manifest), [0] * manifest.count, reserved=reserved)
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
        """Send ``data`` (see the module docstring); a failure is remembered and fails the
        commit.  The caller may reuse ``data`` once this returns."""
        state = self._live(handle)
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > handle.size:
            raise ConfigError(f"write [{offset}, {offset + len(view)}) outside a {handle.size}-byte object")
        if state.manifest.inline:
            await self._write_inline(state, offset, view)
            return
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

    async def _write_inline(self, state: _Put, offset: int, view: memoryview) -> None:
        size = state.manifest.size
        if state.failed or state.filled[0] >= size:
            return
        if offset == 0 and len(view) == size:
            whole = view
        else:
            if state.staged is None:
                state.staged = bytearray(size)
            state.staged[offset : offset + len(view)] = view
            state.filled[0] += len(view)
            if state.filled[0] < size:
                return
            whole = memoryview(state.staged)
        key, node = state.keys[0], self._node(state.keys[0])
        if not self._allow(node):
            state.failed = f"{node} is unavailable"
            return
        try:
            state.own = bool(await self._call(node, self._client.set, key, whole, nx=True, px=self._orphan_ms))
        except Down:
            state.failed = f"{node} is unavailable"
            return
        except rx.RedisError as err:
            state.failed = f"{node} refused the object: {err}"
            return
        state.filled[0], state.staged = size, None

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        state = self._live(handle, claim=True)
        visible = False
        try:
            if ok and not state.failed and covered(state.manifest, state.filled):
                visible = await self._publish(handle.key, state)
        finally:
            with suppress(TierUnavailableError):
                await self._clean_up(handle.key, state, visible)
                await self._settle_budget(handle, state, visible)
            self._stats.puts += visible  # also when another writer's identical object won
            self._stats.put_failures += not visible
            self._stats.bytes_written += handle.size if visible and not state.failed else 0
        if visible:
            self._stored(handle.key)
        return visible

    async def _settle_budget(self, handle: PutHandle, state: _Put, visible: bool) -> None:
        """Give back the reservation of a put not published; confirm a published one (it is
        reserved again when another writer's eviction took it out of the index meanwhile)."""
        if not self.cfg.budget_bytes:
            return
        if not visible:
            if state.reserved:
                await self._release(handle.key)
            return
        with suppress(CapacityError):
            await self._reserve(handle.key, handle.size)

    async def _publish(self, key: ObjectKey, state: _Put) -> bool:
        """SET the manifest (NX), then give the data its final TTL; True when visible.
        ``state.failed`` is set when our data is not part of what is visible."""
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
        if all(r == 1 for r in await self._finalize(state.keys)):
            return True
        await self._drop(key, raw, None)  # its data vanished (eviction): withdraw the manifest
        return False

    async def _finalize(self, keys: list[str]) -> list[Any]:
        """Give ``keys`` the object's TTL (or none): each reply, 1 when the key exists."""
        if self._ttl_ms:
            return await self._per_node(keys, "PEXPIRE", self._ttl_ms)
        return await self._per_node(keys, "PERSIST")

    async def _clean_up(self, key: ObjectKey, state: _Put, visible: bool) -> None:
        """Remove what a put leaves behind (see the module docstring)."""
        if not state.manifest.inline:
            if not visible or state.failed:
                await self._per_node(state.keys, "UNLINK")
            return
        if not state.own or (visible and not state.failed):
            return
        current = await self._current_manifest(key)
        if current is None and not visible:
            await self._per_node(state.keys, "UNLINK")
        elif visible and current is not None and current.inline:
            await self._finalize(state.keys)  # it may be what that manifest serves
        elif visible:
            await self._per_node(state.keys, "UNLINK")

    async def _current_manifest(self, key: ObjectKey) -> Manifest | None:
        """The manifest now published for ``key`` (None: none, or unreadable)."""
        mkey = manifest_key(self.cfg.key_prefix, key)
        node = self._node(mkey)
        if not self._allow(node):
            return None
        try:
            raw = await self._call(node, self._client.get, mkey)
        except (Down, rx.RedisError):
            return None
        return parse(raw) if isinstance(raw, bytes) else None


__all__ = ["RedisPuts"]
