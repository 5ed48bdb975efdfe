"""``Planes``: which data plane a ``StoreClient`` uses, chosen again on every ``Hello``.

Client side.  The planes, fastest first, and when each is taken:

* **shm** (same host): the transport allows it (``auto``/``shm``), ``ServerInfo.shm_refusal``
  finds nothing against it (the token has ``shm``, same boot, the gate's socket is here),
  and the gate hands over the tenant's pool (``kvstore.client.shmsession``: a ticket from
  ``OpenData``, the token, a descriptor back; read-only for a token without ``write``).
  The pool is mapped once and prefaulted; a session the server no longer holds (it
  restarted) is opened again.  ``transport="shm"`` without it is a ``ConfigError``.
* **tcp** (any host): the raw TCP data channel (``kvstore.client.datachannel``) when shm is
  not in use and the transport allows it (``auto``/``tcp``), the server advertises a data
  port, and one connection opens with a ticket (``OpenData``), the token and, when the gRPC
  channel uses TLS, TLS.  That first connection is opened at once, so ``transport="tcp"``
  fails at connect time (``TierUnavailableError``, or the refusal's status) and ``auto`` falls
  back to streams, saying why (``tcp_refusal``), e.g. when a firewall lets gRPC through but
  not the data port.
* **stream**: gRPC streams of ``frame_bytes`` frames, always possible (``transport="stream"``
  forces it).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable

import grpc

from kvstore.client.datachannel import DataChannel, RefusedError, Reply
from kvstore.client.dataplane import prefault
from kvstore.client.info import ServerInfo, Transport, local_boot_id
from kvstore.client.shmsession import GateRefusedError, ShmSession
from kvstore.errors import ConfigError, TierError

log = logging.getLogger("kvstore.client.store_client")
CODES = {code.value[0]: code for code in grpc.StatusCode}


class Planes:
    """Owns the data planes of one client: the shared-memory session (``session``, its pool
    ``segment``), the TCP data channel (``data``), and why each is not used
    (``shm_refusal``, ``tcp_refusal``: "" when it is).  ``ticket`` mints an ``OpenData``
    ticket; ``status_error`` turns a refusal's status into the domain error (both the
    client's ``Rpc``)."""

    def __init__(
        self,
        target: str,
        transport: Transport,
        timeout_s: float,
        token: str | None,
        tls: ssl.SSLContext | None,
        server_name: str | None,
        ticket: Callable[[], Awaitable[bytes]],
        status_error: Callable[[str, grpc.StatusCode, str | None], Exception],
    ) -> None:
        self.target = target
        self.transport = transport
        self.timeout_s = timeout_s
        self._token = token
        self._tls = tls
        self._server_name = server_name
        self._ticket = ticket
        self._status_error = status_error
        self.session: ShmSession | None = None  # the shared-memory session
        self.data: DataChannel | None = None  # the TCP data channel
        self.shm_refusal = ""  # why the shared-memory data plane is not used ("" when it is)
        self.tcp_refusal = ""  # why the TCP data channel is not used ("" when it is)

    @property
    def segment(self):
        """The mapped pool of the session (None without one)."""
        return None if self.session is None else self.session.pool

    @property
    def segment_id(self) -> int | None:
        """Which session the mapping belongs to (changes when the server is a new one)."""
        return None if self.session is None else self.session.session_id

    @property
    def uses_shm(self) -> bool:
        return self.session is not None

    @property
    def uses_tcp(self) -> bool:
        return self.data is not None

    async def choose(self, info: ServerInfo) -> None:
        """Choose the planes again for what ``Hello`` said (see the module docstring)."""
        await self._use_segment(info)
        await self._use_data(info)

    # --- shared memory ------------------------------------------------------------------------

    async def _use_segment(self, info: ServerInfo) -> None:
        if self.transport in (Transport.STREAM, Transport.TCP):
            self.shm_refusal = f"transport is {self.transport.value}"
            return
        refusal = info.shm_refusal(local_boot_id())
        session = self.session
        if not refusal and (session is None or session.path != info.shm_socket or not session.alive()):
            self.drop_segment()
            try:
                ticket = await self._ticket()
                session = await asyncio.to_thread(ShmSession.open, info.shm_socket, ticket, self._token, self.timeout_s)
                self.session = session
                prefault(session.array)
            except GateRefusedError as err:
                refusal = f"the store refused shared memory: {err}"
            except (ConfigError, TierError) as err:
                refusal = str(err)
        if refusal:
            self.drop_segment()
            if self.transport is Transport.SHM:
                raise ConfigError(f"store {self.target}: shared memory refused: {refusal}")
            if refusal != self.shm_refusal:
                log.info("kvstore: store %s: no shared memory (%s)", self.target, refusal)
        self.shm_refusal = refusal

    def drop_segment(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()  # unmapped now (or when the last in-flight view goes), then ended

    # --- the TCP data channel -----------------------------------------------------------------

    async def _use_data(self, info: ServerInfo) -> None:
        if self.transport not in (Transport.TCP, Transport.AUTO) or self.session is not None:
            await self.drop_data(
                "shared memory is used" if self.session is not None else f"transport is {self.transport.value}"
            )
            return
        if not info.data_port:
            await self.drop_data("the server offers no data channel")
            if self.transport is Transport.TCP:
                raise ConfigError(f"store {self.target}: transport tcp, but {self.tcp_refusal}")
            return
        if self.data is not None and self.data.port == info.data_port:
            return
        await self.drop_data("")
        channel = DataChannel(
            self.target.rpartition(":")[0],
            info.data_port,
            mint=self._ticket,
            token=self._token,
            tls=self._tls,
            server_name=self._server_name,
            timeout_s=self.timeout_s,
        )
        try:
            await channel.warm()
        except TierError as err:
            await channel.aclose()
            failure = (
                self._status_error(
                    "data channel", CODES.get(err.reply.code, grpc.StatusCode.UNKNOWN), err.reply.message
                )
                if isinstance(err, RefusedError)
                else err
            )
            if self.transport is Transport.TCP:
                raise failure from err
            self.tcp_refusal = str(failure)
            log.info("kvstore: store %s: streaming over gRPC (%s)", self.target, failure)
            return
        self.data, self.tcp_refusal = channel, ""

    async def data_request(self, name: str, request: Awaitable[Reply]) -> Reply:
        """A data-channel request; a connection the server refused (its hello) raises the
        refusal's status as the gRPC calls do."""
        try:
            return await request
        except RefusedError as err:
            raise self._status_error(
                name, CODES.get(err.reply.code, grpc.StatusCode.UNKNOWN), err.reply.message
            ) from err

    async def drop_data(self, why: str) -> None:
        channel, self.data = self.data, None
        self.tcp_refusal = why
        if channel is not None:
            await channel.aclose()


__all__ = ["CODES", "Planes"]
