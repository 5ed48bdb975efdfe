"""``LeasedReader``, the same-host read of a ``StoreClient``: one ``Get``, one copy out of
the server's segment, and the lease released off the critical path.  The ``Get`` goes on the
shared-memory session's own socket when the server takes lease requests there
(``kvstore.client.shmleases``; the same answer, without a gRPC round trip), else on gRPC.

Client side.  The rule (proto/kvstore/v1/kvstore.proto, header): a lease granted by ``Get``
pins the object's slot, so its bytes cannot change while the lease lasts, and the lease
lasts at least until ``t0 + lease_ms`` on this host's monotonic clock, where ``t0`` is read
before ``Get`` is sent (or before the last successful ``RenewLease``).  ``LeaseWindow`` holds
that deadline.  After the copy and its checksum:

* within the window, less a margin (``LeaseWindow.holds``): the copy is good without
  asking.  The lease id goes to a ``ReleaseQueue``, which sends the queued ids as ONE
  ``ReleaseLease`` ~20 ms later (``RELEASE_DELAY_S``; at once when a call's worth is
  queued) and never blocks ``read_into``; its answer is ignored.
* past the window (a slow copy, a paused process): a synchronous ``ReleaseLease``, whose
  ``valid`` flag decides whether the copy counts.
* a renewal the server refused (the lease expired, or its object was deleted): a miss.

``flush_releases`` sends what is queued and waits for it; ``StoreClient`` calls it before
``delete`` and ``stats`` (so the answers reflect this client's finished reads) and in
``close``.  A client killed with queued releases loses nothing: the server's reaper expires
those leases and drops their pins after their TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.dataplane import INLINE_BYTES, Copier, payload_digest
from kvstore.client.info import ClientCounters
from kvstore.client.planes import CODES, Planes
from kvstore.client.rpc import Rpc
from kvstore.client.shmleases import LeaseLine
from kvstore.errors import ConfigError, KVStoreError, TierError
from kvstore.keys import ObjectKey
from kvstore.wire.shm import Leased

log = logging.getLogger("kvstore.client.store_client")
Code = grpc.StatusCode
RELEASE_DELAY_S = 0.02  # queued releases wait this long for company (pins last that much longer)
_MARGIN_S = 0.001  # the window ends this much, plus _MARGIN_FRACTION of the TTL, early
_MARGIN_FRACTION = 0.05


@dataclass(slots=True)
class LeaseWindow:
    """Until when a lease surely holds, on this host's monotonic clock (see the module
    docstring): the server started it, or its last renewal, after ``start``."""

    lease_id: int
    start: float
    ttl_s: float

    @property
    def deadline(self) -> float:
        return self.start + self.ttl_s * (1 - _MARGIN_FRACTION) - _MARGIN_S

    def holds(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.deadline

    def renewed(self, sent_at: float, ttl_ms: int) -> None:
        self.start, self.ttl_s = sent_at, ttl_ms / 1000


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """Where the queue's delay is measured: the running event loop by default, or a test's
    fake clock (same ``call_later`` signature; the callback must run on the loop)."""

    def call_later(self, delay: float, callback: Callable[[], object], /) -> Cancellable: ...


class ReleaseQueue:
    """Lease ids whose copies are already known good, released in the background in
    batches of at most ``limit()`` ids (one ``send`` each).  Event-loop only.

    ``limit`` is read at every ``add`` and send (a client learns it from ``Hello``): a
    call's worth goes at once; fewer ids go together once the first of them has waited
    ``delay_s`` (on ``timers``)."""

    def __init__(
        self,
        send: Callable[[list[int]], Awaitable[object]],
        limit: Callable[[], int],
        delay_s: float = RELEASE_DELAY_S,
        timers: Timers | None = None,
    ) -> None:
        self._send = send
        self._limit = limit
        self._delay_s = delay_s
        self._timers = timers
        self._ids: list[int] = []
        self._timer: Cancellable | None = None
        self._sending: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, lease_id: int) -> None:
        self._ids.append(lease_id)
        if len(self._ids) >= self._limit():
            self._start_sends()
        elif self._timer is None:
            timers = self._timers if self._timers is not None else asyncio.get_running_loop()
            self._timer = timers.call_later(self._delay_s, self._start_sends)

    async def flush(self) -> None:
        """Send everything queued now; return once every send in flight has finished."""
        self._start_sends()
        if self._sending:
            await asyncio.wait(list(self._sending))

    def _start_sends(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        limit = max(1, self._limit()) if self._ids else 1
        while self._ids:
            batch, self._ids = self._ids[:limit], self._ids[limit:]
            task = asyncio.get_running_loop().create_task(self._send_quietly(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_quietly(self, batch: list[int]) -> None:
        try:
            await self._send(batch)
        except KVStoreError as err:  # the server's reaper expires them after their TTL
            log.debug("kvstore: releasing %d leases failed (they expire): %s", len(batch), err)


class LeasedReader:
    """The same-host read under a lease (see the module docstring).  Owns the lease each
    ``Get`` asks for (``lease_ms``; 0 lets the server choose) and the ``ReleaseQueue`` of
    finished reads; uses the client's ``rpc``, ``planes`` (the session's pool), ``counters``
    and ``copier`` by reference.  ``after_copy`` (tests only) is awaited between the copy and
    the lease check."""

    def __init__(
        self,
        rpc: Rpc,
        planes: Planes,
        counters: ClientCounters,
        copier: Copier,
        lease_ms: int,
        release_delay_s: float = RELEASE_DELAY_S,
        after_copy: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._rpc = rpc
        self._planes = planes
        self._counters = counters
        self._copier = copier
        self.lease_ms = lease_ms
        self._after_copy = after_copy
        self.releases = ReleaseQueue(self._send_releases, lambda: rpc.server.max_keys_per_call, release_delay_s)

    async def get(self, key: ObjectKey, dst: np.ndarray) -> tuple[int, bytes | None] | None:
        """Copy ``key``'s bytes out of the pool into ``dst`` under a lease: (their length,
        the payload checksum of the copy, None from a sealed pool), or None on a miss or a
        lease that did not hold.  The caller checks the copy against the key (``Fetcher``)."""
        session = self._planes.session
        assert session is not None
        segment = session.array  # held: a concurrent remap cannot unmap it under us
        t0 = time.monotonic()
        resp = await self._ask(session.leases, key)
        if not resp.found:
            return None
        n, off = resp.length, resp.offset
        if n > len(dst) or off + n > len(segment):
            await self.release(resp.lease_id)
            if n > len(dst):
                raise ConfigError(f"read buffer of {len(dst)} bytes cannot hold {n}")
            raise TierError(
                f"store {self._rpc.target}: Get answered bytes [{off}, {off + n}) outside "
                f"its {len(segment)}-byte segment"
            )
        window = LeaseWindow(resp.lease_id, t0, (resp.lease_ms or self._rpc.server.lease_ms) / 1000)
        try:
            held, digest = await self._copy_leased(dst[:n], segment[off : off + n], window, not session.sealed)
            if self._after_copy is not None:
                await self._after_copy()
        except BaseException:
            self.releases.add(resp.lease_id)  # nobody uses this copy: release it later
            raise
        if held and window.holds():
            self.releases.add(resp.lease_id)  # the copy is good: the release can wait
            self._counters.releases_deferred += 1
        elif held:
            held = await self.release(resp.lease_id)  # late: only the server can tell
        if not held:
            self._counters.lease_expired += 1
            return None
        return n, digest

    async def _ask(self, line: LeaseLine | None, key: ObjectKey) -> pb.GetResponse | Leased:
        """The object's place and a lease on it: on the session's socket when the server takes
        lease requests there (``LeaseLine``), else a ``Get``."""
        if line is None:
            return await self._rpc.unary(
                "Get", pb.GetRequest(namespace=key[:32], chunk_hash=key[32:64], tag=key.tag, lease_ms=self.lease_ms)
            )
        self._take_orphans(line)
        answer = await line.lease(bytes(key), self.lease_ms, self._rpc.timeout_s)
        if answer.code:
            raise self._rpc.status_error("Get", CODES.get(answer.code, Code.UNKNOWN), answer.message)
        return answer

    async def _copy_leased(
        self, dst: np.ndarray, src: np.ndarray, window: LeaseWindow, verify: bool = True
    ) -> tuple[bool, bytes | None]:
        """Copy under the lease, renewing it every half TTL; (whether the lease was held
        throughout, the payload checksum, or None without ``verify``), returned only once
        nothing touches ``dst`` any more.  ``verify`` False: the pool is sealed
        (``ShmSession.sealed``), so its objects are the ones the store verified when they
        entered it, and the copy is not checksummed again.  Large objects: the checksum
        thread hashes the pinned source while the copy thread copies it
        (``Copier.copy_digest``); the source cannot change under a lease that held, and a
        lease that did not is a miss, so that checksum is the copy's."""
        if len(dst) <= INLINE_BYTES:
            np.copyto(dst, src)
            return True, payload_digest(memoryview(dst)) if verify else None
        fut = self._copier.copy_digest(dst, src) if verify else self._copier.copy(dst, src)
        ttl_ms = max(1, round(window.ttl_s * 1000))
        held = True
        try:
            aw = asyncio.wrap_future(fut)
            while True:
                done, _ = await asyncio.wait({aw}, timeout=max(ttl_ms, 2) / 2000)
                if done:
                    return held, aw.result()
                if held:
                    sent_at = time.monotonic()
                    granted = await self.renew(window.lease_id, ttl_ms)
                    held = granted is not None
                    if granted is not None:
                        window.renewed(sent_at, granted)
        finally:
            Copier.wait_done(fut)  # cancelled or failed: still never return while it copies

    async def renew(self, lease_id: int, ttl_ms: int) -> int | None:
        """The TTL granted (ms), or None when the server no longer holds the lease."""
        r = await self._rpc.unary(
            "RenewLease", pb.RenewLeaseRequest(lease_id=lease_id, lease_ms=ttl_ms), answers=frozenset({Code.NOT_FOUND})
        )
        self._counters.renewals += 1
        return None if isinstance(r, Code) else r.lease_ms

    async def release(self, lease_id: int) -> bool:
        """Synchronous release of one lease: whether a copy made under it is good."""
        resp = await self._send_releases([lease_id])
        return len(resp.valid) == 1 and resp.valid[0]

    async def _send_releases(self, lease_ids: list[int]) -> pb.ReleaseLeaseResponse:
        resp = await self._rpc.unary("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=lease_ids))
        self._counters.release_calls += 1
        return resp

    async def flush_releases(self) -> None:
        """Send the queued lease releases now, the session's orphans with them
        (``LeaseLine.orphans``), and wait for them (and those in flight)."""
        self._take_orphans(self._planes.session.leases if self._planes.session is not None else None)
        await self.releases.flush()

    def _take_orphans(self, line: LeaseLine | None) -> None:
        """Queue the leases granted to requests that gave up, for release."""
        if line is not None:
            for lease_id in line.take_orphans():
                self.releases.add(lease_id)


__all__ = ["LeaseWindow", "LeasedReader", "RELEASE_DELAY_S", "ReleaseQueue", "Timers"]
