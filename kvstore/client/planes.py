"""Which data plane a ``StoreClient`` uses, chosen again on every ``Hello`` (mixed into it).

Client side.  The planes, fastest first, and when each is taken:

* **shm** (same host): the transport allows it (``auto``/``shm``) and ``ServerInfo.shm_refusal``
  finds nothing against it (the token has ``shm``, same boot, the segment opens with the
  announced size and inode).  The segment is mapped once and prefaulted; a server that came
  back with a new segment is remapped.  ``transport="shm"`` without it is a ``ConfigError``.
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

import logging
from collections.abc import Awaitable

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.datachannel import DataChannel, RefusedError, Reply
from kvstore.client.dataplane import prefault
from kvstore.client.info import ServerInfo, Transport, local_boot_id
from kvstore.errors import ConfigError, TierError
from tiers.host_shm import attach_shared

log = logging.getLogger("kvstore.client.store_client")
CODES = {code.value[0]: code for code in grpc.StatusCode}


class PlanesMixin:
    """Needs from its host class: ``target``, ``transport``, ``timeout_s``, ``_token``,
    ``_tls``, ``_server_name``, ``_segment``, ``_segment_id``, ``_data``, ``shm_refusal``,
    ``tcp_refusal``, ``_unary`` and ``_status_error`` (all defined by ``StoreClient``)."""

    @property
    def uses_shm(self) -> bool:
        return self._segment is not None

    @property
    def uses_tcp(self) -> bool:
        return self._data is not None

    async def _choose_planes(self, info: ServerInfo) -> None:
        self._use_segment(info)
        await self._use_data(info)

    # --- shared memory ------------------------------------------------------------------------

    def _use_segment(self, info: ServerInfo) -> None:
        if self.transport in (Transport.STREAM, Transport.TCP):
            self.shm_refusal = f"transport is {self.transport.value}"
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
                log.info("kvstore: store %s: no shared memory (%s)", self.target, refusal)
        self.shm_refusal = refusal

    def _drop_segment(self) -> None:
        segment, self._segment, self._segment_id = self._segment, None, None
        if segment is not None:
            segment.close()  # unmapped now, or when the last in-flight view goes

    # --- the TCP data channel -----------------------------------------------------------------

    async def _use_data(self, info: ServerInfo) -> None:
        if self.transport not in (Transport.TCP, Transport.AUTO) or self._segment is not None:
            await self._drop_data("shared memory is used" if self._segment is not None
                                  else f"transport is {self.transport.value}")
            return
        if not info.data_port:
            await self._drop_data("the server offers no data channel")
            if self.transport is Transport.TCP:
                raise ConfigError(f"store {self.target}: transport tcp, but {self.tcp_refusal}")
            return
        if self._data is not None and self._data.port == info.data_port:
            return
        await self._drop_data("")
        channel = DataChannel(self.target.rpartition(":")[0], info.data_port, mint=self._ticket,
                              token=self._token, tls=self._tls, server_name=self._server_name,
                              timeout_s=self.timeout_s)
        try:
            await channel.warm()
        except TierError as err:
            await channel.aclose()
            failure = (self._status_error("data channel", CODES.get(err.reply.code, grpc.StatusCode.UNKNOWN),
                                          err.reply.message) if isinstance(err, RefusedError) else err)
            if self.transport is Transport.TCP:
                raise failure from err
            self.tcp_refusal = str(failure)
            log.info("kvstore: store %s: streaming over gRPC (%s)", self.target, failure)
            return
        self._data, self.tcp_refusal = channel, ""

    async def _data_request(self, name: str, request: Awaitable[Reply]) -> Reply:
        """A data-channel request; a connection the server refused (its hello) raises the
        refusal's status as the gRPC calls do."""
        try:
            return await request
        except RefusedError as err:
            raise self._status_error(name, CODES.get(err.reply.code, grpc.StatusCode.UNKNOWN),
                                     err.reply.message) from err

    async def _ticket(self) -> bytes:
        return (await self._unary("OpenData", pb.OpenDataRequest())).ticket

    async def _drop_data(self, why: str) -> None:
        channel, self._data = self._data, None
        self.tcp_refusal = why
        if channel is not None:
            await channel.aclose()


__all__ = ["CODES", "PlanesMixin"]
