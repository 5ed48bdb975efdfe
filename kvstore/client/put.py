"""``Writer``, the write half of a ``StoreClient``: two-phase puts through the shared
segment, over the TCP data channel, and streamed puts.

Client side.  Through the segment: ``reserve`` (``PutStart``) hands out a region that the
caller (or ``put``) fills in place, then ``commit`` (``PutCommit``) lets the server verify
and publish it, or aborts it.  Elsewhere ``put_parts`` sends the caller's buffers as they
are: on the data channel, one request followed by the bytes (``sendall`` from the caller's
memory; the server receives them into the slot it reserved, verifies and publishes, one
round trip); over gRPC, the start frame and then ``frame_bytes`` slices, each serialized
once straight from them.
A put the server refuses (PERMISSION_DENIED, FAILED_PRECONDITION, NOT_FOUND: a read-only
token, a damaged object, an expired reservation) is ``PutResult.FAILED`` and counted, never
an exception; transport failures raise ``TierUnavailableError`` (``kvstore.client.rpc.Rpc.status_error``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
import grpc.aio
import numpy as np

from kvstore import codec
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.dataplane import INLINE_BYTES, Copier, encode_data_frame
from kvstore.client.info import ClientCounters, Reservation
from kvstore.client.planes import CODES, Planes
from kvstore.client.rpc import Rpc
from kvstore.errors import CapacityError, ConfigError, TierError, TierUnavailableError
from kvstore.keys import ROOT, ChunkHash, ObjectKey
from kvstore.wire import data as wire
from tiers.base import PutResult

log = logging.getLogger("kvstore.client.store_client")
Code = grpc.StatusCode
_REFUSED_PUT = frozenset({Code.PERMISSION_DENIED, Code.FAILED_PRECONDITION, Code.NOT_FOUND})
_OUTCOMES: dict[int, PutResult] = {
    pb.PUT_OUTCOME_STORED: PutResult.STORED,
    pb.PUT_OUTCOME_EXISTS: PutResult.EXISTS,
    pb.PUT_OUTCOME_NO_ROOM: PutResult.NO_ROOM,
}


class Writer:
    """The puts of one client (see the module docstring).  Owns no state: it uses the
    client's ``rpc``, ``planes`` (the session's pool, the data channel), ``counters`` and
    ``copier`` by reference.  ``segment_changed`` (the client's: a
    ``Hello`` that tells whether the server has another session now) decides the one retry
    of a refused ``put`` through the pool."""

    def __init__(
        self,
        rpc: Rpc,
        planes: Planes,
        counters: ClientCounters,
        copier: Copier,
        segment_changed: Callable[[], Awaitable[bool]],
    ) -> None:
        self._rpc = rpc
        self._planes = planes
        self._counters = counters
        self._copier = copier
        self._segment_changed = segment_changed

    async def put(self, key: ObjectKey, obj, parent_hash: ChunkHash | None = None, *, retry: bool = True) -> PutResult:
        """Publish a complete object (its header names ``key``): through the segment
        (``PutStart``, one copy, ``PutCommit``) or a ``PutStream``.  A put refused because
        the server came back without our session is retried once, in a new one."""
        src = np.frombuffer(memoryview(obj).cast("B"), np.uint8)
        session = self._planes.session
        if session is None:
            return await self.put_parts(key, [memoryview(src)], len(src), parent_hash)
        if not self._may_write(key) or not session.writable:
            return self._put_done(PutResult.FAILED, len(src))  # refused here: nothing to retry
        res = await self.reserve(key, len(src), parent_hash)
        if isinstance(res, PutResult):
            result = res
        else:
            ok = False
            try:
                await self._copy_out(res.array, src)
                ok = True
            finally:
                result = await self.commit(res, ok)
        if result is PutResult.FAILED and retry and await self._segment_changed():
            self._counters.put_failures -= 1  # the retry counts instead
            return await self.put(key, obj, parent_hash, retry=False)
        return result

    async def reserve(self, key: ObjectKey, size: int, parent_hash: ChunkHash | None = None) -> Reservation | PutResult:
        """``PutStart``: a region of the segment to write ``size`` bytes into, or the final
        outcome (EXISTS, NO_ROOM, FAILED when the server refuses)."""
        self.check_size(size)
        session = self._planes.session
        if session is None:
            raise ConfigError(f"reserve needs the shared-memory data plane ({self._planes.shm_refusal})")
        if not self._may_write(key) or not session.writable:
            return self._put_done(PutResult.FAILED, size)
        segment = session.array  # held: a concurrent remap cannot unmap it under us
        start = _put_start(key, size, parent_hash)
        start.session = session.session_id
        r = await self._rpc.unary("PutStart", start, answers=_REFUSED_PUT)
        if isinstance(r, Code) or r.outcome != pb.PUT_OUTCOME_UNSPECIFIED:
            return self._put_done(PutResult.FAILED if isinstance(r, Code) else _outcome(r.outcome), size)
        if r.length != size or r.offset + size > len(segment):
            await self._rpc.unary("PutCommit", pb.PutCommitRequest(put_id=r.put_id, abort=True), answers=_REFUSED_PUT)
            raise TierError(f"store {self._rpc.target}: PutStart answered [{r.offset}, +{r.length}) for {size} bytes")
        return Reservation(key, size, r.put_id, r.offset, r.ttl_ms, segment[r.offset : r.offset + size])

    async def commit(self, res: Reservation, ok: bool = True) -> PutResult:
        """``PutCommit`` (or abort when not ``ok``); the server verifies and publishes."""
        r = await self._rpc.unary(
            "PutCommit", pb.PutCommitRequest(put_id=res.put_id, abort=not ok), answers=_REFUSED_PUT
        )
        result = PutResult.FAILED if isinstance(r, Code) or not ok else _outcome(r.outcome)
        if isinstance(r, Code):
            log.warning("kvstore: store %s refused commit of %r: %s", self._rpc.target, res.key, r.name)
        return self._put_done(result, res.size)

    async def put_parts(
        self, key: ObjectKey, parts: Sequence[memoryview], size: int, parent_hash: ChunkHash | None = None
    ) -> PutResult:
        """``PutStream`` of ``parts`` (in order, ``size`` bytes in all), framed straight from
        the caller's memory."""
        self.check_size(size)
        if sum(len(p) for p in parts) != size:
            raise ConfigError(f"put of {key!r}: parts hold {sum(len(p) for p in parts)} bytes, not {size}")
        if not self._may_write(key):
            return self._put_done(PutResult.FAILED, size)
        if self._planes.data is not None:
            return await self._put_tcp(key, parts, size, parent_hash)
        async with self._rpc.gate:  # the stream's slot (``Rpc``: calls in flight are bounded)
            call = self._rpc.put_stream(timeout=self._rpc.deadline(size), metadata=self._rpc.metadata)
            try:
                await self._write_frames(call, pb.PutFrame(start=_put_start(key, size, parent_hash)), parts)
                resp = await call
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code not in _REFUSED_PUT:
                    raise self._rpc.error("PutStream", err) from err
                log.warning("kvstore: store %s refused put of %r: %s", self._rpc.target, key, code.name)
                return self._put_done(PutResult.FAILED, size)
            finally:
                if not call.done():
                    call.cancel()
        return self._put_done(_outcome(resp.outcome), size)

    async def _put_tcp(
        self, key: ObjectKey, parts: Sequence[memoryview], size: int, parent_hash: ChunkHash | None
    ) -> PutResult:
        parent = b"" if parent_hash is None or parent_hash == ROOT else bytes(parent_hash)
        request = wire.encode_request(wire.Op.PUT, key, size, parent)
        parts = [memoryview(p).cast("B") for p in parts]
        channel = self._planes.data
        if channel is None:
            raise TierUnavailableError(f"store {self._rpc.target}: no data channel ({self._planes.tcp_refusal})")
        reply = await self._planes.data_request("data put", channel.put(request, parts, self._rpc.deadline(size)))
        if reply.code:
            code = CODES.get(reply.code, Code.UNKNOWN)
            if code not in _REFUSED_PUT:
                raise self._rpc.status_error("data put", code, reply.message)
            log.warning("kvstore: store %s refused put of %r: %s", self._rpc.target, key, code.name)
            return self._put_done(PutResult.FAILED, size)
        return self._put_done(_outcome(reply.flag), size)

    async def _write_frames(self, call, start: pb.PutFrame, parts: Sequence[memoryview]) -> None:
        """The start frame, then ``frame_bytes`` slices of ``parts``; stops early when the
        server has already answered (EXISTS, NO_ROOM, an error)."""
        frame = self._rpc.server.frame_bytes or (1 << 20)
        try:
            await call.write(start.SerializeToString())
            for part in parts:
                part = memoryview(part).cast("B")
                for lo in range(0, len(part), frame):
                    await call.write(encode_data_frame(part[lo : lo + frame]))
            await call.done_writing()
        except asyncio.InvalidStateError:
            return  # the call finished first: its reply (or status) tells the outcome

    def _put_done(self, result: PutResult, size: int) -> PutResult:
        c = self._counters
        if result is PutResult.STORED:
            c.puts += 1
            c.bytes_written += size
        elif result is PutResult.EXISTS:
            c.put_exists += 1
        else:
            c.put_failures += 1
        return result

    def _may_write(self, key: ObjectKey) -> bool:
        """Whether ``Hello`` granted "write": a put the token may not make is refused here,
        without a round trip (the server would answer PERMISSION_DENIED, once it has read
        the stream)."""
        if "write" in self._rpc.server.permissions:
            return True
        if self._counters.put_failures == 0:  # once per client: a read-only client puts often
            log.warning(
                "kvstore: puts to store %s fail: the token lacks the write permission (first: %r)",
                self._rpc.target,
                key,
            )
        return False

    def check_size(self, size: int) -> None:
        """``ConfigError`` below a header's size, ``CapacityError`` above the store's limit."""
        if size < codec.HEADER_SIZE:
            raise ConfigError(f"object of {size} bytes is smaller than its {codec.HEADER_SIZE}-byte header")
        if self._rpc.server.max_object_bytes and size > self._rpc.server.max_object_bytes:
            raise CapacityError(
                f"object of {size} bytes exceeds the store's limit of {self._rpc.server.max_object_bytes} bytes"
            )

    async def _copy_out(self, dst: np.ndarray, src: np.ndarray) -> None:
        if len(src) <= INLINE_BYTES:
            np.copyto(dst, src)
            return
        fut = self._copier.copy(dst, src)
        try:
            await asyncio.wrap_future(fut)
        finally:
            Copier.wait_done(fut)


def _put_start(key: ObjectKey, size: int, parent_hash: ChunkHash | None) -> pb.PutStartRequest:
    parent = b"" if parent_hash is None or parent_hash == ROOT else bytes(parent_hash)
    return pb.PutStartRequest(namespace=key[:32], chunk_hash=key[32:64], tag=key.tag, size=size, parent_hash=parent)


def _outcome(value: int) -> PutResult:
    return _OUTCOMES.get(value, PutResult.FAILED)


__all__ = ["Writer"]
