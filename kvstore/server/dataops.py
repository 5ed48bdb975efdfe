"""The data channel's bookkeeping half: what a data-channel request does to the store.
Server side, on the event loop that owns ``ServerStore`` (the connection threads of
``kvstore.server.dataconn`` call in through ``Bridge``).

The same rules as the gRPC servicer, through the same pieces: keys are checked and scoped to
the connection's tenant by the servicer's ``Scoper``, gets hold a host buffer reference
(``ServerStore.acquire``; a lower-tier object is promoted first) until ``release``, puts
reserve a host slot (``PutPath.reserve``, owned by the connection: no TTL) that exactly one
of ``finish`` (verify, rekey, publish) and ``abort`` resolves.  Permissions are checked per
request: read for gets, write for puts.  Counters use path "tcp".

Quotas (``kvstore.server.tenants``): an open connection is one of its tenant's
``connections`` (``open`` takes it, ``closed`` gives it back), a request in flight one of its
``streams`` (``get``/``reserve`` take it; ``release``, ``finish``, ``abort``, or the refusal
itself give it back).

``Bridge`` runs a coroutine on the loop from a connection thread and waits for it without a
deadline of its own while the loop runs, so an answer (a buffer reference, a reservation)
is never abandoned on the loop; ``soon`` schedules a plain call (a release, an abort) and
never blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvstore.keys import ObjectKey
from kvstore.server.auth import Authenticator, Permission, Principal
from kvstore.server.core import ServerStore
from kvstore.server.leases import PendingPut
from kvstore.server.scoping import Scoper
from tiers.base import PutResult

T = TypeVar("T")
PATH = "tcp"


class LoopGone(Exception):
    """The event loop stopped while a connection thread waited for it."""


class Bridge:
    """Calls from a connection thread into the event loop (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError as err:  # the loop is closed
            coro.close()
            raise LoopGone(str(err)) from err
        while True:
            try:
                return fut.result(timeout=1.0)
            except cf.TimeoutError:
                if self.loop.is_closed():
                    raise LoopGone("the event loop closed under a data-channel request") from None

    def soon(self, fn: Callable[..., object], *args: object) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the store went with it
            pass


class DataOps:
    """Loop-side operations of data-channel requests (see the module docstring)."""

    def __init__(self, store: ServerStore, auth: Authenticator, scope: Scoper) -> None:
        self.store, self.auth, self.scope = store, auth, scope

    async def open(self, ticket: bytes, token: str) -> Principal:
        """The principal of a new connection: its token checked, its ticket redeemed, one of
        its tenant's connections taken (``closed`` gives it back)."""
        self.store.check_open()
        who = self.auth.authenticate([("authorization", f"Bearer {token}")] if token else [])
        who = self.store.tickets.redeem(ticket, who)
        self.store.tenants.take(who.tenant, "connections")
        return who

    def closed(self, who: Principal) -> None:
        self.store.tenants.give(who.tenant, "connections")

    async def get(self, who: Principal, raw_key: bytes) -> tuple[ObjectKey, memoryview, str] | None:
        """The object under a buffer reference (``release`` ends it), or None: a miss."""
        self.store.check_open()
        who.require(Permission.READ)
        _, key = self.scope.keys_of(who, raw_key)
        self.store.tenants.take(who.tenant, "streams")
        opened = None
        try:
            opened = await self.store.acquire(key, PATH)
        finally:
            if opened is None:
                self.store.tenants.give(who.tenant, "streams")
        return None if opened is None else (key, *opened)

    def release(self, who: Principal, key: ObjectKey, sent: int, seconds: float) -> None:
        self.store.release(key, sent)
        self.store.tenants.give(who.tenant, "streams")
        self.store.metrics.observe("get_tcp", seconds)

    async def reserve(self, who: Principal, raw_key: bytes, size: int, parent: bytes) -> PutResult | PendingPut:
        """A host slot for a put (final outcomes EXISTS / NO_ROOM are counted here)."""
        self.store.check_open()
        who.require(Permission.WRITE)
        client_key, key = self.scope.keys_of(who, raw_key)
        self.store.tenants.take(who.tenant, "streams")
        result = None
        try:
            result = await self.store.puts.reserve(
                who.tenant, client_key, key, size, self.scope.parent_of(key, parent), streamed=True
            )
        finally:
            if not isinstance(result, PendingPut):
                self.store.tenants.give(who.tenant, "streams")
        if isinstance(result, PutResult):
            self.store.puts.count_final(PATH, result)
        return result

    async def finish(self, pending: PendingPut, seconds: float) -> PutResult:
        self.store.metrics.observe("put_tcp", seconds)
        try:
            return await self.store.puts.finish(pending, PATH)
        finally:
            self.store.tenants.give(pending.tenant, "streams")

    def abort(self, pending: PendingPut) -> None:
        self.store.puts.abort(pending)
        self.store.tenants.give(pending.tenant, "streams")
        self.store.puts.count_final(PATH, PutResult.FAILED)

    def cut(self, who: Principal | None) -> None:
        """A request ran past its deadline (the connection is being closed)."""
        self.refused("deadline")
        if who is not None:
            self.store.tenants.refuse(who.tenant, "stream_deadline")

    def refused(self, reason: str) -> None:
        self.store.metrics.counters.fail(f"data_{reason}")


__all__ = ["Bridge", "DataOps", "LoopGone", "PATH"]
