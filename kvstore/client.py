"""``StoreClient``: the store process's client (grpc.aio), used by ``tiers.remote``.

Runs in the engine's processes.  The contract (proto/kvstore/v1/kvstore.proto, DESIGN §7):

* ``connect`` calls ``Hello`` and picks the data plane: shared memory when the transport
  allows it (``auto``/``shm``), the token has ``shm``, the segment path opens, its size and
  inode match and the server runs on this boot (``boot_id``); streamed frames otherwise
  (``transport="shm"`` then raises ``ConfigError`` saying why).  The client maps the
  segment once (``attach_shared``) and keeps the mapping for its lifetime; ``refresh()``
  (another ``Hello``) remaps it when the server came back with a new segment.
* Keys are the caller's own ``ObjectKey``; the server scopes them to the token's tenant.
  Objects arrive carrying the scoped key: they are checked against it (header, length,
  key, payload checksum) and rekeyed to the caller's key before ``get_into`` returns.  A
  miss, an expired lease or a damaged object is ``None`` and counted; a damaged object is
  also deleted on the server (after a ``refresh`` rules out a remapped segment).
* Reads land in the caller's buffer: one copy from the segment (on a copy thread for
  large objects, checksummed on a second thread meanwhile) or one copy per received frame.
  A buffer is never written after ``get_into`` returns or raises.
* Every RPC carries a deadline (``timeout_s``, plus time for the bytes on streams) and the
  ``authorization: Bearer <token>`` metadata.  Status codes become domain errors in one
  place (``_error``): transport failures (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED) raise
  ``TierUnavailableError``; a put the server refuses (PERMISSION_DENIED,
  FAILED_PRECONDITION, NOT_FOUND) is ``PutResult.FAILED``, not an exception.
* ``_after_copy`` (tests only): an awaitable factory awaited between the copy out of the
  segment and the lease release, so a test can let a short lease expire mid-read.

One client belongs to one event loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import suppress

import grpc
import grpc.aio
import numpy as np
import xxhash

from kvstore import codec
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client_info import (TIER_NAMES, ClientCounters, RemoteLookup, ServerInfo, Transport,
                                 local_boot_id, open_channel)
from kvstore.client_io import (INLINE_BYTES, Copier, check_object, decode_get_frame, payload_digest,
                               prefault)
from kvstore.client_put import PutMixin
from kvstore.errors import (CapacityError, ConfigError, LeaseError, ObjectFormatError, TierError,
                            TierUnavailableError)
from kvstore.keys import ChunkHash, Namespace, ObjectKey
from tiers.host_shm import SharedPoolView, attach_shared

log = logging.getLogger("kvstore.client")
Code = grpc.StatusCode
_TRANSPORT_CODES = frozenset({Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED})
_STREAM_BYTES_PER_S = 100e6   # deadline allowance for streamed bytes (far below the real rate)


class StoreClient(PutMixin):
    """A connection to one store process (see the module docstring)."""

    def __init__(self, channel: grpc.aio.Channel, target: str, token: str | None, timeout_s: float,
                 transport: Transport, after_copy: Callable[[], Awaitable[object]] | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.transport = transport
        self.counters = ClientCounters()
        self.info: ServerInfo | None = None
        self._channel = channel
        self._stub = pb_grpc.KVStoreStub(channel)
        # Hand-coded frames on the two streams (see client_io): requests and replies are bytes.
        self._get_stream = channel.unary_stream("/kvstore.v1.KVStore/GetStream",
                                                request_serializer=pb.GetRequest.SerializeToString)
        self._put_stream = channel.stream_unary("/kvstore.v1.KVStore/PutStream",
                                                response_deserializer=pb.PutCommitResponse.FromString)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._after_copy = after_copy
        self._segment: SharedPoolView | None = None
        self._segment_id: tuple[str, int, int] | None = None
        self._copier = Copier()
        self._scoped: dict[bytes, Namespace] = {}
        self.shm_refusal = ""   # why the shared-memory data plane is not used ("" when it is)

    # --- lifecycle -------------------------------------------------------------------

    @classmethod
    async def connect(cls, target: str, *, token: str | None = None, tls_ca: str | None = None,
                      tls_cert: str | None = None, tls_key: str | None = None,
                      tls_server_name: str | None = None, transport: Transport | str = "auto",
                      timeout_s: float = 2.0,
                      _after_copy: Callable[[], Awaitable[object]] | None = None) -> StoreClient:
        """Open a channel, ``Hello`` (waiting up to ``timeout_s`` for the server), choose
        the data plane.  ``TierUnavailableError`` when the store cannot be reached."""
        mode = Transport.parse(transport)
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if not target or ":" not in target:
            raise ConfigError(f"store target must be HOST:PORT, got {target!r}")
        channel = open_channel(target, tls_ca, tls_cert, tls_key, tls_server_name)
        client = cls(channel, target, token, timeout_s, mode, _after_copy)
        try:
            await client.refresh(wait_for_ready=True)
        except BaseException:
            await client.close()
            raise
        return client

    async def refresh(self, *, wait_for_ready: bool = False) -> ServerInfo:
        """``Hello`` again; remap the segment if the server has a new one (a restart)."""
        resp = await self._unary("Hello", pb.HelloRequest(), wait_for_ready=wait_for_ready)
        info = ServerInfo.from_pb(resp)
        self._use_segment(info)
        self.info = info
        return info

    @property
    def uses_shm(self) -> bool:
        return self._segment is not None

    async def close(self) -> None:
        """Close the channel, stop the copy threads (after any copy in flight), unmap."""
        await self._channel.close()
        self._copier.close()
        self._drop_segment()

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- lookups -----------------------------------------------------------------------

    async def lookup(self, keys: Sequence[ObjectKey]) -> RemoteLookup:
        """Contiguous prefix of ``keys`` present in the store: one ``Lookup`` per run of keys
        sharing namespace and tag (at most ``max_keys_per_call`` each), stopping at a miss."""
        tiers: list[str] = []
        sizes: list[int] = []
        for batch in self._batches(keys):
            resp = await self._unary("Lookup", pb.LookupRequest(
                namespace=batch[0][:32], chunk_hashes=[k[32:64] for k in batch], tag=batch[0].tag))
            if not resp.hits <= len(batch) or len(resp.tiers) != resp.hits or len(resp.sizes) != resp.hits:
                raise TierError(f"store {self.target}: malformed Lookup reply ({resp.hits} hits for "
                                f"{len(batch)} keys, {len(resp.tiers)} tiers, {len(resp.sizes)} sizes)")
            tiers += [TIER_NAMES.get(t, "unknown") for t in resp.tiers]
            sizes += resp.sizes
            if resp.hits < len(batch):
                break
        c = self.counters
        c.lookups += 1
        c.keys_looked_up += len(keys)
        c.keys_hit += len(tiers)
        return RemoteLookup(len(tiers), tuple(tiers), tuple(sizes))

    def _batches(self, keys: Sequence[ObjectKey]) -> Iterator[Sequence[ObjectKey]]:
        limit, start, n = max(1, self._info.max_keys_per_call), 0, len(keys)
        while start < n:
            first = keys[start]
            ns, tag, size = first[:32], first[64:], len(first)
            end, stop = start + 1, min(n, start + limit)
            while end < stop and len(k := keys[end]) == size and k.startswith(ns) and k.endswith(tag):
                end += 1
            yield keys[start:end]
            start = end

    # --- reads -------------------------------------------------------------------------

    async def get_into(self, key: ObjectKey, buf) -> int | None:
        """Copy the verified object into ``buf`` (rekeyed to ``key``); its length or None."""
        dst = _writable(buf)
        self.counters.gets += 1
        n = await (self._get_shm(key, dst) if self._segment is not None else self._get_streamed(key, dst))
        if n is None:
            self.counters.misses += 1
        else:
            codec.rekey(memoryview(dst)[:n], key)
            self.counters.hits += 1
            self.counters.bytes_read += n
        return n

    async def _get_shm(self, key: ObjectKey, dst: np.ndarray, retry: bool = True) -> int | None:
        segment = self._segment.array  # held: a concurrent remap cannot unmap it under us
        resp = await self._unary("Get", pb.GetRequest(namespace=key[:32], chunk_hash=key[32:64], tag=key.tag))
        if not resp.found:
            return None
        n, off = resp.length, resp.offset
        if n > len(dst) or off + n > len(segment):
            await self._release(resp.lease_id)
            if n > len(dst):
                raise ConfigError(f"read buffer of {len(dst)} bytes cannot hold {n}")
            raise TierError(f"store {self.target}: Get answered bytes [{off}, {off + n}) outside "
                            f"its {len(segment)}-byte segment")
        release: asyncio.Future | None = None
        try:
            held, digest = await self._copy_leased(dst[:n], segment[off : off + n], resp)
            if self._after_copy is not None:
                await self._after_copy()
            release = asyncio.ensure_future(self._release(resp.lease_id))
            if not isinstance(digest, bytes):
                digest = await asyncio.wrap_future(digest)
            valid = await release
        finally:
            if release is None or not release.done():  # failed before the release finished
                await self._release_quietly(release, resp.lease_id)
        if not (held and valid):
            self.counters.lease_expired += 1
            return None
        return await self._checked(key, dst, n, digest, retry, shm=True)

    async def _release_quietly(self, release: asyncio.Future | None, lease_id: int) -> None:
        """Best effort on an error path: an unreleased lease expires by its TTL anyway."""
        try:
            await (release if release is not None else self._release(lease_id))
        except (TierError, asyncio.CancelledError):
            pass

    async def _copy_leased(self, dst: np.ndarray, src: np.ndarray, resp: pb.GetResponse):
        """Copy under the lease, renewing it every half TTL.  Returns (whether the lease was
        held throughout, the payload checksum or its future) only once the copy has stopped
        touching ``dst``.  Large objects: the checksum thread hashes the leased source while
        the copy thread copies it (measured ~30% faster than hashing the copy afterwards on
        two cores); the source cannot change under a lease that held, and a lost lease is a
        miss, so that checksum is the copy's."""
        if len(dst) <= INLINE_BYTES:
            np.copyto(dst, src)
            return True, payload_digest(memoryview(dst))
        digest = self._copier.digest(memoryview(src))
        fut = self._copier.copy(dst, src)
        ttl_ms = resp.lease_ms or self._info.lease_ms
        held = True
        try:
            aw = asyncio.wrap_future(fut)
            while True:
                done, _ = await asyncio.wait({aw}, timeout=max(ttl_ms, 2) / 2000)
                if done:
                    aw.result()
                    return held, digest
                if held:
                    held = await self._renew(resp.lease_id, ttl_ms)
        finally:
            Copier.wait_done(fut)  # cancelled or failed: still never return while it copies

    async def _renew(self, lease_id: int, ttl_ms: int) -> bool:
        r = await self._unary("RenewLease", pb.RenewLeaseRequest(lease_id=lease_id, lease_ms=ttl_ms),
                              answers=frozenset({Code.NOT_FOUND}))
        self.counters.renewals += 1
        return not isinstance(r, Code)

    async def _release(self, lease_id: int) -> bool:
        resp = await self._unary("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[lease_id]))
        return len(resp.valid) == 1 and resp.valid[0]

    async def _get_streamed(self, key: ObjectKey, dst: np.ndarray) -> int | None:
        req = pb.GetRequest(namespace=key[:32], chunk_hash=key[32:64], tag=key.tag)
        call = self._get_stream(req, timeout=self._deadline(len(dst)), metadata=self._metadata)
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
                    hasher.update(view[max(got, codec.HEADER_SIZE):end])
                got = end
                frame = await self._read_frame(call)
        finally:
            if not call.done():
                call.cancel()
        return await self._checked(key, dst, total, hasher.digest() if got == total else b"", False, shm=False)

    async def _read_frame(self, call):
        try:
            raw = await call.read()
        except grpc.aio.AioRpcError as err:
            raise self._error("GetStream", err) from err
        return None if raw is grpc.aio.EOF else decode_get_frame(raw)

    async def _checked(self, key: ObjectKey, dst: np.ndarray, n: int, digest: bytes, retry: bool,
                       *, shm: bool) -> int | None:
        """``n`` when the copy is the object (scoped key, checksum); else None, after
        deleting the damaged object, or a retry when the server changed its segment."""
        try:
            check_object(memoryview(dst)[:n], self._scoped_key(key), digest)
            return n
        except ObjectFormatError as err:
            if shm and retry and await self._segment_changed():
                return await self._get_shm(key, dst, retry=False) if self._segment is not None \
                    else await self._get_streamed(key, dst)
            self.counters.corrupt += 1
            log.warning("kvstore: damaged object %r from store %s (%s): deleting it", key, self.target, err)
            with suppress(TierError):  # best effort: it is a miss either way
                await self.delete(key, quiet=True)
            return None

    async def _segment_changed(self) -> bool:
        before = self._segment_id
        await self.refresh()
        return self._segment_id != before

    # --- the rest ----------------------------------------------------------------------

    async def delete(self, key: ObjectKey, *, quiet: bool = False) -> bool:
        """Delete ``key`` from every tier of the store (``quiet``: refusals answer False)."""
        answers = frozenset({Code.PERMISSION_DENIED}) if quiet else frozenset()
        req = pb.DeleteRequest(namespace=key[:32], chunk_hash=key[32:64], tag=key.tag)
        r = await self._unary("Delete", req, answers=answers)
        return not isinstance(r, Code) and r.deleted

    async def stats(self) -> dict[str, object]:
        """The server's stats document and flat counters, and this client's counters."""
        resp = await self._unary("Stats", pb.StatsRequest())
        try:
            doc = json.loads(resp.json) if resp.json else {}
        except ValueError as err:
            raise TierError(f"store {self.target}: Stats returned invalid JSON: {err}") from err
        return {"server": doc, "server_counters": dict(resp.counters), "client": self.counters.as_dict()}

    # --- plumbing ----------------------------------------------------------------------

    @property
    def _info(self) -> ServerInfo:
        if self.info is None:
            raise TierUnavailableError(f"store {self.target}: not connected (no Hello yet)")
        return self.info

    def _scoped_key(self, key: ObjectKey) -> ObjectKey:
        ns = key[:32]
        scoped = self._scoped.get(ns)
        if scoped is None:
            if len(self._scoped) > 4096:
                self._scoped.clear()
            scoped = self._scoped[ns] = Namespace(ns).scoped(self._info.tenant)
        return ObjectKey(scoped, ChunkHash(key[32:64]), key.tag)

    def _deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / _STREAM_BYTES_PER_S

    async def _unary(self, name: str, request, *, answers: frozenset = frozenset(),
                     wait_for_ready: bool | None = None):
        """The reply, or its status code when that is one of ``answers``."""
        try:
            return await getattr(self._stub, name)(request, timeout=self.timeout_s, metadata=self._metadata,
                                                   wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as err:
            if err.code() in answers:
                return err.code()
            raise self._error(name, err) from err
        except grpc.aio.UsageError as err:
            raise TierUnavailableError(f"store {self.target}: client is closed") from err

    def _error(self, name: str, err: grpc.aio.AioRpcError) -> Exception:
        """The one place status codes become domain errors."""
        code = err.code()
        text = f"store {self.target}: {name} failed: {code.name}: {err.details()}"
        if code in _TRANSPORT_CODES:
            self.counters.transport_errors += 1
            return TierUnavailableError(text)
        self.counters.errors += 1
        if code in (Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE):
            return ConfigError(text)
        if code is Code.RESOURCE_EXHAUSTED:
            return CapacityError(text)
        if code is Code.NOT_FOUND:
            return LeaseError(text)
        return TierError(text)

    def _use_segment(self, info: ServerInfo) -> None:
        if self.transport is Transport.STREAM:
            self.shm_refusal = "transport is stream"
            return
        refusal = info.shm_refusal(local_boot_id())
        ident = info.segment_id
        if not refusal and ident != self._segment_id:
            self._drop_segment()
            try:
                self._segment = attach_shared(info.segment_path, info.segment_size, pin=False)
                self._segment_id = ident
                prefault(self._segment.array)
            except ConfigError as err:
                refusal = str(err)
        if refusal:
            self._drop_segment()
            if self.transport is Transport.SHM:
                raise ConfigError(f"store {self.target}: shared memory refused: {refusal}")
            if refusal != self.shm_refusal:
                log.info("kvstore: store %s: streaming (%s)", self.target, refusal)
        self.shm_refusal = refusal

    def _drop_segment(self) -> None:
        segment, self._segment, self._segment_id = self._segment, None, None
        if segment is not None:
            segment.close()  # unmapped now, or when the last in-flight view goes


def _writable(buf) -> np.ndarray:
    view = memoryview(buf)
    if view.readonly:
        raise ConfigError("get_into needs a writable buffer")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, np.uint8)


__all__ = ["RemoteLookup", "StoreClient", "Transport"]
