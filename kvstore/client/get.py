"""``Fetcher``, the read half of a ``StoreClient``: ``read_into`` through the plane the
client chose, each copy checked and rekeyed.

Client side.  Same host: a leased read out of the tenant's pool (``LeasedReader.get``, one
copy, checksummed meanwhile unless the pool is sealed: then nobody but the store writes
it); else one request on the TCP data channel, whose bytes land in the caller's buffer;
else a ``GetStream``, one copy per received frame, hashed as it lands.
The object arrives carrying the tenant-scoped key: it is checked against it (header,
length, key, payload checksum) and rekeyed to the caller's key.  A miss or a damaged object
is ``None`` and counted; a damaged one is deleted on the server (``delete_quietly``), unless
a pool read failed because the server changed its segment (``segment_changed``): then the
read is tried once more, as it is when the store closed the session's socket
(``SessionLostError``: a restarted store).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress

import grpc
import grpc.aio
import numpy as np
import xxhash

from kvstore import codec
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.dataplane import check_object, decode_get_frame
from kvstore.client.info import ClientCounters
from kvstore.client.leases import LeasedReader
from kvstore.client.planes import CODES, Planes
from kvstore.client.rpc import Rpc
from kvstore.client.shmleases import SessionLostError
from kvstore.errors import ConfigError, ObjectFormatError, TierError
from kvstore.keys import ChunkHash, Namespace, ObjectKey
from kvstore.wire import data as wire

log = logging.getLogger("kvstore.client.store_client")
Code = grpc.StatusCode


class Fetcher:
    """The reads of one client (see the module docstring).  It uses the client's ``rpc``,
    ``planes``, ``counters`` and ``reader`` by reference; it owns only the cache of the
    namespaces scoped to the token's tenant."""

    def __init__(
        self,
        rpc: Rpc,
        planes: Planes,
        counters: ClientCounters,
        reader: LeasedReader,
        segment_changed: Callable[[], Awaitable[bool]],
        delete_quietly: Callable[[ObjectKey], Awaitable[bool]],
    ) -> None:
        self.rpc, self.planes, self.counters, self.reader = rpc, planes, counters, reader
        self.target = rpc.target
        self._segment_changed = segment_changed
        self._delete_quietly = delete_quietly
        self._scoped: dict[bytes, Namespace] = {}

    async def read_into(self, key: ObjectKey, buf) -> int | None:
        """Copy the verified object into ``buf`` (rekeyed to ``key``); its length or None."""
        dst = _writable(buf)
        self.counters.gets += 1
        if self.planes.segment is not None:
            n = await self._get_shm(key, dst)
        elif self.planes.data is not None:
            n = await self._get_tcp(key, dst)
        else:
            n = await self._get_streamed(key, dst)
        if n is None:
            self.counters.misses += 1
        else:
            codec.rekey(memoryview(dst)[:n], key, clear_mac=True)
            self.counters.hits += 1
            self.counters.bytes_read += n
        return n

    async def _get_shm(self, key: ObjectKey, dst: np.ndarray, retry: bool = True) -> int | None:
        """A leased read out of the pool (``LeasedReader.get``), checked here; once more on
        a new session when the store closed this one (it restarted)."""
        try:
            got = await self.reader.get(key, dst)
        except SessionLostError:
            if not (retry and await self._segment_changed()):
                raise
            return (
                await self._get_shm(key, dst, retry=False)
                if self.planes.segment is not None
                else await self._get_streamed(key, dst)
            )
        return None if got is None else await self._checked(key, dst, *got, retry, shm=True)

    async def _get_tcp(self, key: ObjectKey, dst: np.ndarray) -> int | None:
        """One round trip on the data channel; the bytes land in ``dst``."""
        data = self.planes.data
        assert data is not None
        reply = await self.planes.data_request(
            "data get", data.get(wire.encode_request(wire.Op.GET, key), memoryview(dst), self.rpc.deadline(len(dst)))
        )
        if reply.code:
            raise self.rpc.status_error("data get", CODES.get(reply.code, Code.UNKNOWN), reply.message)
        if not reply.flag:
            return None
        return await self._checked(key, dst, reply.length, reply.digest, False, shm=False)

    async def _get_streamed(self, key: ObjectKey, dst: np.ndarray) -> int | None:
        async with self.rpc.gate:  # the stream's slot, released before the check (which may call again)
            got = await self._stream_into(key, dst)
        return None if got is None else await self._checked(key, dst, *got, False, shm=False)

    async def _stream_into(self, key: ObjectKey, dst: np.ndarray) -> tuple[int, bytes] | None:
        """A ``GetStream`` into ``dst``: (the object's length, the payload checksum of what
        landed, empty when not all of it did), or None on a miss."""
        req = pb.GetRequest(namespace=key[:32], chunk_hash=key[32:64], tag=key.tag, lease_ms=self.reader.lease_ms)
        call = self.rpc.get_stream(req, timeout=self.rpc.deadline(len(dst)), metadata=self.rpc.metadata)
        view = memoryview(dst)
        try:
            first = await self._read_frame(call)
            if first is None or not first.found:
                return None
            total, got, hasher = first.total_length, 0, xxhash.xxh3_128()
            if total > len(dst):
                raise ConfigError(f"read buffer of {len(dst)} bytes cannot hold {total}")
            frame = first
            while frame is not None:
                end = got + len(frame.data)
                if frame.offset != got or end > total:
                    break  # out of order or too long: damaged, checked below
                view[got:end] = frame.data
                if end > codec.HEADER_SIZE:
                    hasher.update(view[max(got, codec.HEADER_SIZE) : end])
                got = end
                frame = await self._read_frame(call)
        finally:
            if not call.done():
                call.cancel()
        return total, hasher.digest() if got == total else b""

    async def _read_frame(self, call):
        try:
            raw = await call.read()
        except grpc.aio.AioRpcError as err:
            raise self.rpc.error("GetStream", err) from err
        return None if raw is grpc.aio.EOF else decode_get_frame(raw)

    async def _checked(
        self, key: ObjectKey, dst: np.ndarray, n: int, digest: bytes | None, retry: bool, *, shm: bool
    ) -> int | None:
        """``n`` when the copy is the object (scoped key, checksum); else None, after
        deleting the damaged object, or a retry when the server changed its segment."""
        try:
            check_object(memoryview(dst)[:n], self._scoped_key(key), digest)
            return n
        except ObjectFormatError as err:
            if shm and retry and await self._segment_changed():
                return (
                    await self._get_shm(key, dst, retry=False)
                    if self.planes.segment is not None
                    else await self._get_streamed(key, dst)
                )
            self.counters.corrupt += 1
            log.warning("kvstore: damaged object %r from store %s (%s): deleting it", key, self.target, err)
            with suppress(TierError):  # best effort: it is a miss either way
                await self._delete_quietly(key)
            return None

    def _scoped_key(self, key: ObjectKey) -> ObjectKey:
        ns = key[:32]
        scoped = self._scoped.get(ns)
        if scoped is None:
            if len(self._scoped) > 4096:
                self._scoped.clear()
            scoped = self._scoped[ns] = Namespace(ns).scoped(self.rpc.server.tenant)
        return ObjectKey(scoped, ChunkHash(key[32:64]), key.tag)


def _writable(buf) -> np.ndarray:
    view = memoryview(buf)
    if view.readonly:
        raise ConfigError("read_into needs a writable buffer")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, np.uint8)


__all__ = ["Fetcher"]
