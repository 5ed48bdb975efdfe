"""The gRPC servicer of the store process (``kvstore.v1.KVStore``), server side.

Thin: each handler authenticates, converts the request at the edge (bytes → typed,
tenant-scoped keys), delegates to ``ServerStore`` and converts the answer back.  Domain
errors become status codes in one place, the ``rpc`` decorator of ``kvstore.server.status``.

A refused ``PutStream`` (PERMISSION_DENIED, INVALID_ARGUMENT, ...: ``DRAIN_FIRST``) is
answered only after the client's frames are read (at most one object's worth), so the
client sees that status rather than a failed write, but only while it holds one of its
tenant's ``streams``: a tenant's refused streams never hold more call slots
(``max_concurrent_rpcs``) than its ``streams`` quota.  Without a free stream (the quota
reached, counted as ``streams``; or no ``write`` at the quota, counted as ``permission``) it
ends at once, and a call without a valid token is refused before anything is read
(``kvstore.server.wire.Guard``).

Every handler runs under the call's deadline (``asyncio.timeout``).  Streams also run under
the server's own: ``GetStream`` and ``PutStream`` must move their object at
``stream_min_rate`` on average after ``stream_grace`` (``ServerConfig.stream_deadline``), and
a ``PutStream`` silent for ``stream_grace`` is cut; a cut stream's reference or reservation
is given back on the way out.  Each stream counts against its tenant's ``streams`` quota.  A
``PutStream``'s frames are read by ``kvstore.server.putframes``.

Tenant binding (``kvstore.server.scoping``, shared with the data channel): the client's
(namespace N, hash H, tag T) is stored as ``ObjectKey(N.scoped(tenant), H, T)``; a
wrong-tenant read is a plain miss.  ``OpenData`` mints a single-use ticket
(``kvstore.server.tickets``) that opens a data-channel connection
(``kvstore.server.dataserver``, whose port ``Hello`` advertises) or a shared-memory session
(``kvstore.server.shmgate``, whose socket ``Hello`` names).  ``PutStart`` must name a live
session of the caller's tenant.  Lease and put ids are bound to the tenant that got them.
``Stats`` answers the caller's tenant only, unless its token has ``admin``.  ``Describe``
(``write``) gives the store an object's tokens for its KV events, under the caller's tenant.  The lifecycle
(ports, TLS, health, signals) lives in ``kvstore.server.main``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

import grpc

from kvstore import __version__
from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import CapacityError, ConfigError, TierUnavailableError
from kvstore.keys import ObjectKey
from kvstore.server.auth import Authenticator, Permission, PermissionDeniedError, Principal, UnauthenticatedError
from kvstore.server.core import ServerStore
from kvstore.server.putframes import PutFrames
from kvstore.server.scoping import Scoper, scoped_keys
from kvstore.server.statsdoc import flat_counters, flat_tenant
from kvstore.server.status import DRAIN_FIRST, OUTCOMES, TIER_CODES, rpc, status_of
from kvstore.server.wire import Guard, InFrame, Malformed, OutFrame
from tiers.base import PutResult

log = logging.getLogger("kvstore.server.servicer")
READ, WRITE, SHM, ADMIN = Permission.READ, Permission.WRITE, Permission.SHM, Permission.ADMIN
MAX_DESCRIBED_TOKENS = 1 << 16  # tokens of one described object (a chunk holds a few hundred)


def _tier_codes(tiers: list[str]) -> list[pb.Tier]:
    """Wire codes of tier names (a run of one tier, the common answer, in one step)."""
    if tiers and tiers.count(tiers[0]) == len(tiers):
        return [TIER_CODES.get(tiers[0], pb.TIER_UNSPECIFIED)] * len(tiers)
    return [TIER_CODES.get(t, pb.TIER_UNSPECIFIED) for t in tiers]


class Gate(Protocol):
    """What the servicer needs of the shared-memory gate (``kvstore.server.shmgate.ShmGate``,
    which imports this module): its socket's path, and a tenant's session by id."""

    path: Path

    def session_of(self, session_id: int, tenant: str) -> Any: ...


class KVStoreServicer:
    """One instance per server; handlers are named after the RPCs."""

    def __init__(
        self,
        store: ServerStore,
        auth: Authenticator,
        boot_id: str = "",
        *,
        scope: Scoper | None = None,
        gate: Gate | None = None,
        data_port: int = 0,
    ) -> None:
        """``scope``: shared with the data channel (one event loop); ``gate``: the shared-memory
        gate, listening (None: no shared memory); ``data_port``: the data channel's, listening
        (0: none)."""
        self.store, self.auth, self.boot_id, self.cfg = store, auth, boot_id, store.cfg
        self.scope = scope if scope is not None else Scoper()
        self.gate, self.data_port = gate, data_port
        self.frames = PutFrames(store.cfg)

    def guard(self) -> Guard:
        """What every call goes through before its handler (``kvstore.server.wire.Guard``):
        its token, from the metadata alone, and ``request_timeout`` for its request."""
        return Guard(
            self._preauth,
            self.cfg.request_timeout,
            lambda method: self.store.metrics.counters.fail("grpc_request_timeout"),
        )

    async def _preauth(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse a caller without a valid token before anything is read (counted in
        ``failures{reason="grpc_unauthenticated"}``: it has no tenant)."""
        try:
            self.auth.authenticate(context.invocation_metadata())
        except UnauthenticatedError as err:
            self.store.metrics.counters.fail("grpc_unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))

    def admit(self, request, context, needed: tuple[Permission, ...], method: str) -> Principal:
        self.store.check_open()
        who = self.auth.authenticate(context.invocation_metadata())
        denied = self._denied(who, needed)
        if denied is not None:
            raise denied
        if isinstance(request, Malformed):
            raise ConfigError(f"{method}: malformed request ({request.reason})")
        return who

    def _denied(self, who: Principal, needed: tuple[Permission, ...]) -> PermissionDeniedError | None:
        """The refusal (counted as the tenant's ``permission``) when ``who`` lacks ``needed``."""
        try:
            who.require(*needed)
        except PermissionDeniedError as err:
            self.store.tenants.refuse(who.tenant, "permission")
            return err
        return None

    def _keys(self, who: Principal, namespace: bytes, chunk_hash: bytes, tag: str) -> tuple[ObjectKey, ObjectKey]:
        return self.scope.keys(who, namespace, chunk_hash, tag)

    # --- RPCs ---------------------------------------------------------------------------

    @rpc()
    async def Hello(self, request, context, who: Principal) -> pb.HelloResponse:
        reply = pb.HelloResponse(
            tenant=who.tenant,
            permissions=who.permission_names,
            max_object_bytes=self.cfg.max_object_bytes,
            max_keys_per_call=self.cfg.max_keys_per_call,
            lease_ms=_ms(self.cfg.lease_ttl),
            frame_bytes=self.cfg.frame_bytes,
            server_version=__version__,
            data_port=self.data_port,
            kv_events=self.store.events is not None,
            max_calls=self.cfg.max_streams_per_connection,
        )
        if who.allows(SHM) and self.gate is not None and who.tenant in self.store.host.pools:
            reply.shm_socket = str(self.gate.path)
            reply.segment_size = self.store.host.pool_stats(who.tenant)["capacity_bytes"]
            reply.boot_id = self.boot_id
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
        return pb.GetResponse(
            found=True,
            offset=granted.offset,
            length=granted.length,
            lease_id=granted.lease_id,
            lease_ms=_ms(granted.ttl),
            tier=TIER_CODES.get(granted.tier, pb.TIER_UNSPECIFIED),
        )

    @rpc(READ)
    async def GetStream(self, request, context, who: Principal) -> None:
        _, key = self._keys(who, request.namespace, request.chunk_hash, request.tag)
        with self._stream(who):
            opened = await self.store.acquire(key)
            if opened is None:
                await context.write(pb.GetFrame(found=False))
                return
            view, tier = opened
            step, total, sent = self.cfg.frame_bytes, len(view), 0
            try:
                with self.store.metrics.timer("get_stream"):
                    async with self._deadline(who, total):
                        for off in range(0, total, step):
                            first = off == 0
                            await context.write(
                                OutFrame(
                                    view[off : off + step],
                                    off,
                                    first,
                                    total if first else 0,
                                    TIER_CODES.get(tier, 0) if first else 0,
                                )
                            )
                            sent += min(step, total - off)
            finally:
                self.store.release(key, sent)

    @contextlib.contextmanager
    def _stream(self, who: Principal) -> Iterator[None]:
        """One of the tenant's ``streams`` for the block (RESOURCE_EXHAUSTED at its quota)."""
        self.store.tenants.take(who.tenant, "streams")
        try:
            yield
        finally:
            self.store.tenants.give(who.tenant, "streams")

    @contextlib.asynccontextmanager
    async def _deadline(self, who: Principal, nbytes: int) -> AsyncIterator[None]:
        """The stream's own deadline (see the module docstring); counted when it cuts."""
        seconds = self.cfg.stream_deadline(nbytes)
        try:
            async with asyncio.timeout(seconds):
                yield
        except TimeoutError as err:
            self.store.tenants.refuse(who.tenant, "stream_deadline")
            raise TimeoutError(
                f"stream of {nbytes} bytes cut after {seconds:g} s (slower than stream_min_rate)"
            ) from err

    @rpc(WRITE, SHM)
    async def PutStart(self, request, context, who: Principal) -> pb.PutStartResponse:
        session = self.gate.session_of(request.session, who.tenant) if self.gate is not None else None
        if session is None or not session.writable:
            raise PermissionDeniedError(
                "PutStart needs a writable shared-memory session of the caller's "
                "tenant (connect to Hello.shm_socket; name it in 'session')"
            )
        result = await self._reserve(who, request, streamed=False, session=session.session_id)
        if isinstance(result, PutResult):
            self.store.puts.count_final("shm", result)
            return pb.PutStartResponse(outcome=OUTCOMES[result])
        return pb.PutStartResponse(
            put_id=result.put_id, offset=result.handle.offset, length=result.handle.size, ttl_ms=_ms(self.cfg.put_ttl_s)
        )

    async def _reserve(self, who: Principal, req: pb.PutStartRequest, streamed: bool, session: int | None = None):
        client_key, key = self._keys(who, req.namespace, req.chunk_hash, req.tag)
        parent = self.scope.parent_of(key, req.parent_hash)
        return await self.store.puts.reserve(who.tenant, client_key, key, req.size, parent, streamed, session)

    @rpc(WRITE)
    async def PutCommit(self, request, context, who: Principal) -> pb.PutCommitResponse:
        pending = self.store.puts.claim(request.put_id, who.tenant)
        if request.abort:
            self.store.puts.abort(pending)
            self.store.puts.count_final("shm", PutResult.FAILED)
            return pb.PutCommitResponse(outcome=pb.PUT_OUTCOME_FAILED)
        return pb.PutCommitResponse(outcome=OUTCOMES[await self.store.puts.finish(pending, "shm")])

    @rpc()
    async def PutStream(self, frames: AsyncIterator[InFrame], context, who: Principal) -> pb.PutCommitResponse:
        frames = frames.__aiter__()
        denied = self._denied(who, (WRITE,))
        held, quota = self.store.tenants.held_and_quota(who.tenant, "streams")
        if denied is not None and held >= quota:
            raise denied  # no stream to drain it under: answered at once
        with self._stream(who):  # refused here (quota): answered at once, nothing drained
            try:
                if denied is not None:
                    raise denied
                first = await self.frames.next_frame(frames)
                if first is None or first.start is None:
                    raise ConfigError(
                        "PutStream: the first frame must be 'start'"
                        + (" (the stream was empty)" if first is None else ", got data")
                    )
                async with self._deadline(who, first.start.size):
                    return await self._put_stream(who, first.start, frames)
            except Exception as err:
                if status_of(err)[0] in DRAIN_FIRST:
                    await self.frames.drain_refused(frames)  # still one of the tenant's streams
                raise

    async def _put_stream(
        self, who: Principal, start: pb.PutStartRequest, frames: AsyncIterator[InFrame]
    ) -> pb.PutCommitResponse:
        with self.store.metrics.timer("put_stream"):
            result = await self._reserve(who, start, streamed=True)
            if isinstance(result, PutResult):
                await self.frames.drain(frames)
                self.store.puts.count_final("stream", result)
                return pb.PutCommitResponse(outcome=OUTCOMES[result])
            ok = False
            try:
                await self.frames.fill(frames, result.handle.buffer, result.handle.size)
                ok = True
            finally:
                if not ok:
                    self.store.puts.abort(result)
            outcome = await self.store.puts.finish(result, "stream")
        return pb.PutCommitResponse(outcome=OUTCOMES[outcome])

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
            raise CapacityError(
                f"{len(request.lease_ids)} lease ids exceed max_keys_per_call {self.cfg.max_keys_per_call}"
            )
        return pb.ReleaseLeaseResponse(valid=self.store.release_leases(request.lease_ids, who.tenant))

    @rpc()
    async def OpenData(self, request, context, who: Principal) -> pb.OpenDataResponse:
        if not self.data_port and self.gate is None:
            raise TierUnavailableError("this store serves neither a data channel nor shared memory")
        ticket = self.store.tickets.mint(who)
        return pb.OpenDataResponse(ticket=ticket, ttl_ms=_ms(self.store.tickets.ttl_s), data_port=self.data_port)

    @rpc(WRITE)
    async def Describe(self, request, context, who: Principal) -> pb.DescribeResponse:
        objects = request.objects
        if len(objects) > self.cfg.max_keys_per_call:
            raise CapacityError(f"{len(objects)} objects exceed max_keys_per_call {self.cfg.max_keys_per_call}")
        described = 0
        for obj in objects:
            if len(obj.token_ids) > MAX_DESCRIBED_TOKENS:
                raise ConfigError(f"{len(obj.token_ids)} token ids exceed {MAX_DESCRIBED_TOKENS} per object")
            _, key = self._keys(who, request.namespace, obj.chunk_hash, request.tag)
            parent = self.scope.chunk_hash(obj.parent_hash, "parent_hash") if obj.parent_hash else None
            described += self.store.describe(key, parent, obj.token_ids, obj.lora_name, who.tenant)
        return pb.DescribeResponse(described=described)

    @rpc(READ)
    async def Stats(self, request, context, who: Principal) -> pb.StatsResponse:
        if not who.allows(ADMIN):
            doc = self.store.tenant_doc(who.tenant)
            return pb.StatsResponse(json=json.dumps(doc, default=str), counters=flat_tenant(doc))
        doc = self.store.stats_doc()
        return pb.StatsResponse(json=json.dumps(doc, default=str), counters=flat_counters(doc))


def _ms(seconds: float) -> int:
    """Seconds as a uint32 millisecond field."""
    return min(int(seconds * 1000), 2**32 - 1)


__all__ = ["KVStoreServicer", "rpc", "status_of"]
