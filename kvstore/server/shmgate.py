"""The store process's shared-memory gate: a Unix socket that hands a local client its
tenant's host pool as a file descriptor.  Server side, on the event loop.

Why: a pool that has a name (a file in /dev/shm) can be opened by any process of the same
uid, token or not, and one pool for all tenants lets each tenant read and rewrite the
others' objects.  Each tenant's pool is an anonymous memfd instead (``tiers.host``), and it
leaves the server only here (format: ``kvstore.wire.shm``):

1. The peer's credentials (``SO_PEERCRED``), checked against the tenant of the token in the
   hello: a tenant with ``uid``/``gid`` in the tokens file admits that uid or primary group
   only, a tenant without them the server's own uid only (root always; docs/tenant-uids.md).
   Other users get nothing, whatever their token.
2. The hello carries a single-use ticket (``OpenData``, bound to the gRPC caller's tenant and
   permissions) and the bearer token, checked as on the data channel; the principal needs
   ``shm``.  The session counts against the tenant's ``connections`` quota.
3. The reply carries the tenant's pool descriptor (``SCM_RIGHTS``): the read-write one for
   a token with ``write``, a fresh read-only one otherwise (a read-only token maps its pool
   read-only; a tenant with no writing ``shm`` token has its pool sealed against every new
   writable mapping, so not even a reopened descriptor maps it writable).
4. The connection stays open for the session's life: the client closes it when it unmaps
   (or dies).  With ``reads`` (``kvstore.server.shmreads.GateReads.lease``) the reply says
   the session takes lease requests, and they are answered there (``serve_requests``);
   without, any byte from the client ends the session.  Then ``on_end(session)`` runs:
   the store frees that session's reservations, fenced ones included
   (``kvstore.server.leases``).

A client that sends no complete hello within ``hello_timeout`` is cut.  Until then it holds
one of its peer's pre-authentication slots (``kvstore.server.peers``: a peer is its (uid, pid)
from ``SO_PEERCRED``; beyond ``max_unauthenticated_per_peer`` or ``max_unauthenticated`` the
connection is closed at once, counted); only an accepted hello takes one of the
``MAX_SESSIONS`` (beyond: RESOURCE_EXHAUSTED).  ``aclose`` closes the
listener and ends every session.  ``session_of`` tells ``PutStart`` whether a session id is
a live one of the caller's tenant.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import stat
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import CapacityError, ConfigError, KVStoreError, PermissionDeniedError
from kvstore.server.auth import Authenticator, Permission, Principal
from kvstore.server.peers import PreAuth
from kvstore.server.shmreads import Answer, serve_requests
from kvstore.server.status import status_of
from kvstore.server.tenants import Tenants
from kvstore.server.tickets import TicketBook
from kvstore.wire import shm as wire
from tiers.host import HostTier

log = logging.getLogger("kvstore.server.shm")
HANDSHAKE_S = 5.0
MAX_SESSIONS = 1024
_UCRED = struct.Struct("3i")  # pid, uid, gid


class PeerRefusedError(PermissionDeniedError):
    """The peer's uid/gid is not one the tenant of its token admits (counted as ``shm_uid``)."""


@dataclass(frozen=True, slots=True)
class Session:
    session_id: int
    tenant: str
    writable: bool
    pid: int
    who: Principal


class ShmGate:
    """The Unix socket and the sessions it opened (see the module docstring)."""

    def __init__(
        self,
        host: HostTier,
        auth: Authenticator,
        tickets: TicketBook,
        tenants: Tenants,
        on_end: Callable[[int], object],
        path: Path | None = None,
        *,
        hello_timeout: float = HANDSHAKE_S,
        preauth: PreAuth | None = None,
        on_refused: Callable[[str], object] = lambda reason: None,
        reads: Answer | None = None,
    ) -> None:
        self.host, self.auth, self.tickets, self.tenants = host, auth, tickets, tenants
        self.on_end = on_end
        self.hello_timeout = hello_timeout
        self.preauth = preauth if preauth is not None else PreAuth(16, MAX_SESSIONS)
        self.on_refused = on_refused
        self.reads = reads
        self._own_dir = path is None
        self.path = path if path is not None else Path(tempfile.mkdtemp(prefix="kvstore-shm-")) / "shm.sock"
        self.sessions: dict[int, Session] = {}
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self.refused = 0

    async def start(self) -> str:
        """Listen (mode 0600, or 0666 when tenants name uids: the gate checks them); the socket's path."""
        _remove_stale(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, 0o666 if self._tenant_uids() else 0o600)  # SO_PEERCRED decides: _admit
            if self._own_dir and self._tenant_uids():
                os.chmod(self.path.parent, 0o711)
        except OSError as err:
            listener.close()
            raise ConfigError(f"cannot serve the shared-memory socket {self.path}: {err.strerror or err}") from err
        listener.listen(socket.SOMAXCONN)  # a burst of strangers' connects must not fill it (issue 23)
        listener.setblocking(False)
        self._listener = listener
        self._spawn(self._accept_forever(listener))
        return str(self.path)

    def session_of(self, session_id: int, tenant: str) -> Session | None:
        session = self.sessions.get(session_id)
        return session if session is not None and session.tenant == tenant else None

    # --- sessions -------------------------------------------------------------------------

    async def _accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as err:
                log.warning("shm gate: accept failed: %s", err)
                await asyncio.sleep(0.1)
                continue
            try:
                pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            except OSError:
                conn.close()
                continue
            reason = self.preauth.enter((uid, pid))
            if reason is not None:
                self._refuse(f"unauthenticated_{reason}")
                conn.close()
                continue
            self._spawn(self._serve(conn, (uid, pid)))

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        self.on_refused(reason)

    async def _serve(self, conn: socket.socket, peer: tuple[int, int]) -> None:
        session: Session | None = None
        try:
            try:
                session = await self._open(conn)
            finally:
                self.preauth.leave(peer)
            if session is not None and self.reads is not None:
                await serve_requests(conn, session.who, self.reads, self._refuse)
            elif session is not None:
                await _until_closed(conn)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            conn.close()
            if session is not None:
                self._end(session)

    async def _open(self, conn: socket.socket) -> Session | None:
        pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        try:
            who = await asyncio.wait_for(self._hello(conn), self.hello_timeout)
            who.require(Permission.SHM)
            self._admit(who.tenant, uid, gid)
            if len(self.sessions) >= MAX_SESSIONS:
                raise CapacityError(f"the gate serves its most sessions ({MAX_SESSIONS}) at once")
            self.tenants.take(who.tenant, "connections")
        except (KVStoreError, TimeoutError, UnicodeDecodeError) as err:
            self._refuse("uid" if isinstance(err, PeerRefusedError) else "hello")
            _reply_error(conn, err)
            return None
        session = Session(secrets.randbits(63) | 1, who.tenant, who.allows(Permission.WRITE), pid, who)
        try:
            self._send_pool(conn, session)
        except BaseException:
            self.tenants.give(who.tenant, "connections")
            raise
        self.sessions[session.session_id] = session
        return session

    def _admit(self, tenant: str, uid: int, gid: int) -> None:
        """Refuse a peer whose uid/gid the tenant of its token does not name (docs/tenant-uids.md).

        Root is admitted always.  A tenant with ``uid``/``gid`` in the tokens file admits a peer of
        that uid or of that (primary) group, and not the store's own uid; a tenant without them admits
        the store's own uid only."""
        limits = self.tenants.limits.get(tenant)
        named = (limits.uid, limits.gid) if limits is not None else (None, None)
        if uid == 0:
            return
        if named == (None, None):
            if uid != os.getuid():
                raise PeerRefusedError(
                    f"uid {uid} may not map tenant {tenant!r}'s memory "
                    f"(only uid {os.getuid()}: the tenant names no uid/gid)"
                )
            return
        if uid != named[0] and (named[1] is None or gid != named[1]):
            raise PeerRefusedError(
                f"uid {uid} (gid {gid}) may not map tenant {tenant!r}'s memory (only uid {named[0]} / gid {named[1]})"
            )

    def _tenant_uids(self) -> bool:
        """Whether some tenant names a uid or gid of its own (then other uids must reach the socket)."""
        return any(lim.uid is not None or lim.gid is not None for lim in self.tenants.limits.values())

    async def _hello(self, conn: socket.socket) -> Principal:
        ticket, token_len = wire.decode_hello(await _recv(conn, wire.HELLO.size))
        token = (await _recv(conn, token_len)).decode() if token_len else ""
        who = self.auth.authenticate([("authorization", f"Bearer {token}")] if token else [])
        return self.tickets.redeem(ticket, who)

    def _send_pool(self, conn: socket.socket, session: Session) -> None:
        memfd = self.host.pool_memfd(session.tenant)
        fd = memfd.fd if session.writable else memfd.readonly_fd()
        try:
            features = wire.FEATURE_LEASES if self.reads is not None else 0
            reply = wire.encode_reply(0, session.writable, session.session_id, memfd.size, features=features)
            socket.send_fds(conn, [reply], [fd])  # a few bytes on a fresh socket: never blocks
        finally:
            if fd != memfd.fd:
                os.close(fd)

    def _end(self, session: Session) -> None:
        if self.sessions.pop(session.session_id, None) is None:
            return
        self.tenants.give(session.tenant, "connections")
        try:
            self.on_end(session.session_id)
        except Exception:  # noqa: BLE001 - a bookkeeping bug must not stop the gate
            log.exception("shm gate: ending session %d failed", session.session_id)

    # --- lifecycle ------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Stop listening and end every session.  Idempotent."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            _remove_stale(self.path)
            if self._own_dir:
                try:
                    self.path.parent.rmdir()
                except OSError:
                    pass


async def _recv(conn: socket.socket, n: int) -> bytes:
    loop, buf = asyncio.get_running_loop(), bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(conn, n - len(buf))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(buf), n)
        buf += chunk
    return bytes(buf)


async def _until_closed(conn: socket.socket) -> None:
    """Wait for the client to close (it sends nothing after its hello; bytes end the session)."""
    await asyncio.get_running_loop().sock_recv(conn, 1)


def _reply_error(conn: socket.socket, err: BaseException) -> None:
    code, message = status_of(
        err if not isinstance(err, TimeoutError) else TimeoutError("no hello within the handshake time")
    )
    try:
        conn.send(wire.encode_reply(code.value[0], message=message))
    except OSError:
        pass


def _remove_stale(path: Path) -> None:
    """Remove a socket left at ``path`` by a dead server; a live one, or anything that is
    not a socket, is a ``ConfigError``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"shm_socket {path} exists and is not a socket: refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        os.unlink(path)  # nobody listens: a dead server's
    else:
        raise ConfigError(f"shm_socket {path} is in use by a running server")
    finally:
        probe.close()


__all__ = ["HANDSHAKE_S", "Session", "ShmGate"]
