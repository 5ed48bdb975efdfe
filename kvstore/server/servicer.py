"""The gRPC servicer of the store process (``kvstore.v1.KVStore``), server side.

Thin: each handler authenticates, converts the request at the edge (bytes → typed,
tenant-scoped keys), delegates to ``ServerStore`` and converts the answer back.  Domain
errors become status codes in ONE place (``_STATUS`` via the ``rpc`` decorator):

    UnauthenticatedError → UNAUTHENTICATED     PermissionDeniedError → PERMISSION_DENIED
    ConfigError          → INVALID_ARGUMENT    CapacityError         → RESOURCE_EXHAUSTED
    LeaseError           → NOT_FOUND           ObjectFormatError     → FAILED_PRECONDITION
    TierError            → UNAVAILABLE         TimeoutError          → DEADLINE_EXCEEDED
    anything else        → INTERNAL (logged with its traceback)

A refused ``PutStream`` (PERMISSION_DENIED, INVALID_ARGUMENT, ...: ``_DRAIN_FIRST``) is
answered only after the client's frames are read (at most one object's worth), so the
client sees that status rather than a failed write.

Every handler runs under the call's deadline (``asyncio.timeout``).  Tenant binding
(``kvstore.server.scoping``, shared with the data channel): the client's (namespace N, hash
H, tag T) is stored as ``ObjectKey(N.scoped(tenant), H, T)``; a wrong-tenant read is a plain
miss.  ``OpenData`` mints a data-channel ticket (``kvstore.server.tickets``); the channel
itself is ``kvstore.server.dataserver``, and ``Hello`` advertises its port.  Lease and put ids are bound to the tenant that got them.
The lifecycle (ports, TLS, health, signals) lives in ``kvstore.server.main``.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from kvstore import __version__
from kvstore._proto import kvstore_pb2 as pb
from kvstore.server.auth import Authenticator, Permission, PermissionDeniedError, Principal, UnauthenticatedError
from kvstore.errors import (CapacityError, ConfigError, KVStoreError, LeaseError, ObjectFormatError,
                            TierError, TierUnavailableError)
from kvstore.keys import ObjectKey
from kvstore.server.core import ServerStore
from kvstore.server.scoping import Scoper, scoped_keys
from kvstore.server.wire import InFrame, Malformed, OutFrame
from tiers.base import PutResult

log = logging.getLogger("kvstore.server.servicer")
READ, WRITE, SHM = Permission.READ, Permission.WRITE, Permission.SHM
TIER_CODES = {"host": pb.TIER_HOST, "ssd": pb.TIER_SSD, "redis": pb.TIER_REDIS}
OUTCOMES = {PutResult.STORED: pb.PUT_OUTCOME_STORED, PutResult.EXISTS: pb.PUT_OUTCOME_EXISTS,
            PutResult.NO_ROOM: pb.PUT_OUTCOME_NO_ROOM, PutResult.FAILED: pb.PUT_OUTCOME_FAILED}

# The one table of domain error → status code (first match wins: subclasses first).
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LeaseError, grpc.StatusCode.NOT_FOUND),
    (ObjectFormatError, grpc.StatusCode.FAILED_PRECONDITION),
    (TierError, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


# Refusals of a client stream (PutStream) answered only once the client has sent it all:
# a status sent while the client still writes reaches grpc.aio clients as "INTERNAL: Internal
# error from Core" from their next write.  Not for strangers (UNAUTHENTICATED: their bytes
# are not read) nor when the server is going away (UNAVAILABLE) or out of time.
_DRAIN_FIRST = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
                          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                          grpc.StatusCode.FAILED_PRECONDITION})


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    for kind, code in _STATUS:
        if isinstance(err, kind):
            return code, str(err) or type(err).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__} (see the server log)"


@dataclass(frozen=True, slots=True)
class Segment:
    """What ``Hello`` tells a client with the shm permission about the shared pool."""

    path: str
    size: int
    inode: int
    boot_id: str


Handler = Callable[..., Awaitable[object]]


def rpc(*needed: Permission) -> Callable[[Handler], Handler]:
    """Authenticate, check ``needed``, apply the deadline, map errors to status codes."""

    def wrap(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def handler(self: "KVStoreServicer", request, context: grpc.aio.ServicerContext):
            try:
                who = self.admit(request, context, needed, fn.__name__)
                remaining = context.time_remaining()
                async with asyncio.timeout(None if remaining is None else max(0.0, remaining)):
                    return await fn(self, request, context, who)
            except grpc.aio.AbortError:
                raise
            except Exception as err:  # CancelledError is a BaseException: it passes
                code, message = status_of(err)
                if code is grpc.StatusCode.INTERNAL:
                    log.exception("%s failed", fn.__name__)
                if code in _DRAIN_FIRST and hasattr(request, "__aiter__"):
                    await self._drain_refused(request)
                await context.abort(code, message)

        return handler

    return wrap


def _tier_codes(tiers: list[str]) -> list[int]:
    """Wire codes of tier names (a run of one tier, the common answer, in one step)."""
    if tiers and tiers.count(tiers[0]) == len(tiers):
        return [TIER_CODES.get(tiers[0], 0)] * len(tiers)
    return [TIER_CODES.get(t, 0) for t in tiers]


class KVStoreServicer:
    """One instance per server; handlers are named after the RPCs."""

    def __init__(self, store: ServerStore, auth: Authenticator, segment: Segment) -> None:
        self.store = store
        self.auth = auth
        self.segment = segment
        self.cfg = store.cfg
        self.scope = Scoper()          # shared with the data channel (one event loop)
        self.data_port = 0             # set by kvstore.server.main once the data channel listens

    def admit(self, request, context, needed: tuple[Permission, ...], method: str) -> Principal:
        self.store.check_open()
        who = self.auth.authenticate(context.invocation_metadata())
        who.require(*needed)
        if isinstance(request, Malformed):
            raise ConfigError(f"{method}: malformed request ({request.reason})")
        return who

    def _keys(self, who: Principal, namespace: bytes, chunk_hash: bytes, tag: str) -> tuple[ObjectKey, ObjectKey]:
        return self.scope.keys(who, namespace, chunk_hash, tag)

    # --- RPCs ---------------------------------------------------------------------------

    @rpc()
    async def Hello(self, request, context, who: Principal) -> pb.HelloResponse:
        reply = pb.HelloResponse(
            tenant=who.tenant, permissions=who.permission_names,
            max_object_bytes=self.cfg.max_object_bytes, max_keys_per_call=self.cfg.max_keys_per_call,
            lease_ms=_ms(self.cfg.lease_ttl), frame_bytes=self.cfg.frame_bytes,
            server_version=__version__, data_port=self.data_port)
        if who.allows(SHM):
            reply.segment_path = self.segment.path
            reply.segment_size = self.segment.size
            reply.segment_inode = self.segment.inode
            reply.boot_id = self.segment.boot_id
        return reply

    @rpc(READ)
    async def Lookup(self, request, context, who: Principal) -> pb.LookupResponse:
        hashes = request.chunk_hashes
        if len(hashes) > self.cfg.max_keys_per_call:
            raise CapacityError(f"{len(hashes)} keys exceed max_keys_per_call {self.cfg.max_keys_per_call}")
        scoped, tag = self.scope.namespace(who, request.namespace), self.scope.tag(request.tag)
        tiers, sizes = await self.store.lookup(scoped_keys(scoped, hashes, tag))
        return pb.LookupResponse(hits=len(tiers), tiers=_tier_codes(tiers), sizes=sizes)

    @rpc(READ, SHM)
    async def Get(self, request, context, who: Principal) -> pb.GetResponse:
        _, key = self._keys(who, request.namespace, request.chunk_hash, request.tag)
        granted = await self.store.lease(key, who.tenant, self.store.lease_ttl(request.lease_ms))
        if granted is None:
            return pb.GetResponse(found=False)
        return pb.GetResponse(found=True, offset=granted.offset, length=granted.length,
                              lease_id=granted.lease_id, lease_ms=_ms(granted.ttl),
                              tier=TIER_CODES.get(granted.tier, 0))

    @rpc(READ)
    async def GetStream(self, request, context, who: Principal) -> None:
        _, key = self._keys(who, request.namespace, request.chunk_hash, request.tag)
        opened = await self.store.acquire(key)
        if opened is None:
            await context.write(pb.GetFrame(found=False))
            return
        view, tier = opened
        step, total, sent = self.cfg.frame_bytes, len(view), 0
        try:
            with self.store.metrics.timer("get_stream"):
                for off in range(0, total, step):
                    first = off == 0
                    await context.write(OutFrame(view[off:off + step], off, first,
                                                 total if first else 0,
                                                 TIER_CODES.get(tier, 0) if first else 0))
                    sent += min(step, total - off)
        finally:
            self.store.release(key, sent)

    @rpc(WRITE, SHM)
    async def PutStart(self, request, context, who: Principal) -> pb.PutStartResponse:
        result = await self._reserve(who, request, streamed=False)
        if isinstance(result, PutResult):
            self.store.puts.count_final("shm", result)
            return pb.PutStartResponse(outcome=OUTCOMES[result])
        return pb.PutStartResponse(put_id=result.put_id, offset=result.handle.offset,
                                   length=result.handle.size, ttl_ms=_ms(self.cfg.put_ttl_s))

    async def _reserve(self, who: Principal, req: pb.PutStartRequest, streamed: bool):
        client_key, key = self._keys(who, req.namespace, req.chunk_hash, req.tag)
        parent = self.scope.parent_of(key, req.parent_hash)
        return await self.store.puts.reserve(who.tenant, client_key, key, req.size, parent, streamed)

    @rpc(WRITE)
    async def PutCommit(self, request, context, who: Principal) -> pb.PutCommitResponse:
        pending = self.store.puts.claim(request.put_id, who.tenant)
        if request.abort:
            self.store.puts.abort(pending)
            self.store.puts.count_final("shm", PutResult.FAILED)
            return pb.PutCommitResponse(outcome=pb.PUT_OUTCOME_FAILED)
        return pb.PutCommitResponse(outcome=OUTCOMES[await self.store.puts.finish(pending, "shm")])

    @rpc(WRITE)
    async def PutStream(self, frames: AsyncIterator[InFrame], context, who: Principal) -> pb.PutCommitResponse:
        frames = frames.__aiter__()
        first = await self._next_frame(frames)
        if first is None or first.start is None:
            raise ConfigError("PutStream: the first frame must be 'start'" +
                              (" (the stream was empty)" if first is None else ", got data"))
        with self.store.metrics.timer("put_stream"):
            result = await self._reserve(who, first.start, streamed=True)
            if isinstance(result, PutResult):
                await self._drain(frames)
                self.store.puts.count_final("stream", result)
                return pb.PutCommitResponse(outcome=OUTCOMES[result])
            ok = False
            try:
                await self._fill(frames, result.handle.buffer, result.handle.size)
                ok = True
            finally:
                if not ok:
                    self.store.puts.abort(result)
            outcome = await self.store.puts.finish(result, "stream")
        return pb.PutCommitResponse(outcome=OUTCOMES[outcome])

    async def _next_frame(self, frames: AsyncIterator[InFrame]) -> InFrame | None:
        """The next frame, None at the end; a client silent for ``put_ttl`` is cut off."""
        try:
            async with asyncio.timeout(self.cfg.put_ttl_s):
                frame = await anext(frames)
        except StopAsyncIteration:
            return None
        except TimeoutError as err:
            raise TimeoutError(f"PutStream: no frame for {self.cfg.put_ttl_s:g} s") from err
        if isinstance(frame, Malformed):
            raise ConfigError(f"PutStream: malformed frame ({frame.reason})")
        return frame

    async def _fill(self, frames: AsyncIterator[InFrame], buf: memoryview, size: int) -> None:
        pos = 0
        while (frame := await self._next_frame(frames)) is not None:
            if frame.data is None:
                raise ConfigError("PutStream: a second 'start' frame" if frame.start is not None
                                  else "PutStream: a frame with neither start nor data")
            n = len(frame.data)
            if pos + n > size:
                raise ConfigError(f"PutStream: more than the {size} bytes announced in start")
            buf[pos:pos + n] = frame.data
            pos += n
        if pos != size:
            raise ConfigError(f"PutStream: {pos} bytes sent, start announced {size}")

    async def _drain(self, frames: AsyncIterator[InFrame]) -> None:
        """Read and drop the rest of a stream whose answer is already known (at most one
        object's worth; a client sending more is simply answered)."""
        budget = self.cfg.max_object_bytes
        while budget > 0 and (frame := await self._next_frame(frames)) is not None:
            budget -= len(frame.data) if frame.data is not None else 1

    async def _drain_refused(self, frames: AsyncIterator[InFrame]) -> None:
        """``_drain`` before a refusal (``_DRAIN_FIRST``); a stream that misbehaves while
        drained (malformed, silent for ``put_ttl``, broken) is simply answered."""
        try:
            await self._drain(frames.__aiter__())
        except (KVStoreError, TimeoutError, grpc.RpcError, StopAsyncIteration):
            pass

    @rpc(WRITE)
    async def Delete(self, request, context, who: Principal) -> pb.DeleteResponse:
        _, key = self._keys(who, request.namespace, request.chunk_hash, request.tag)
        return pb.DeleteResponse(deleted=await self.store.delete(key))

    @rpc(READ)
    async def RenewLease(self, request, context, who: Principal) -> pb.RenewLeaseResponse:
        ttl = self.store.renew_lease(request.lease_id, who.tenant, self.store.lease_ttl(request.lease_ms))
        return pb.RenewLeaseResponse(lease_ms=_ms(ttl))

    @rpc(READ)
    async def ReleaseLease(self, request, context, who: Principal) -> pb.ReleaseLeaseResponse:
        if len(request.lease_ids) > self.cfg.max_keys_per_call:
            raise CapacityError(f"{len(request.lease_ids)} lease ids exceed max_keys_per_call "
                                f"{self.cfg.max_keys_per_call}")
        return pb.ReleaseLeaseResponse(valid=self.store.release_leases(request.lease_ids, who.tenant))

    @rpc()
    async def OpenData(self, request, context, who: Principal) -> pb.OpenDataResponse:
        if not self.data_port:
            raise TierUnavailableError("this store serves no data channel (data_channel off)")
        ticket = self.store.tickets.mint(who)
        return pb.OpenDataResponse(ticket=ticket, ttl_ms=_ms(self.store.tickets.ttl_s),
                                   data_port=self.data_port)

    @rpc(READ)
    async def Stats(self, request, context, who: Principal) -> pb.StatsResponse:
        doc = self.store.stats_doc()
        return pb.StatsResponse(json=json.dumps(doc, default=str), counters=flat_counters(doc))


def _ms(seconds: float) -> int:
    """Seconds as a uint32 millisecond field."""
    return min(int(seconds * 1000), 2**32 - 1)


def flat_counters(doc: dict) -> dict[str, float]:
    """Numeric leaves of the stats document as ``dotted.names`` (``leases_held``,
    ``puts_in_flight``, ``host.bytes_used``, ``store.lookup_hits.ssd``, ...)."""
    out: dict[str, float] = {
        "leases_held": doc["leases"]["held"], "leases_expired": doc["leases"]["expired"],
        "puts_in_flight": doc["puts_in_flight"],
        "data_tickets_refused": doc["data_tickets"]["refused"],
        "write_throughs_in_flight": doc["write_throughs_in_flight"],
    }

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, bool):
            out[prefix] = float(value)
        elif isinstance(value, (int, float)):
            out[prefix] = float(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    for name, stats in doc["tiers"].items():
        walk(name, stats)
    walk("store", doc["store"])
    return out


__all__ = ["KVStoreServicer", "Segment", "flat_counters", "rpc", "status_of"]
