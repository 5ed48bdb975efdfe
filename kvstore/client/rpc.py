"""``Rpc``: a ``StoreClient``'s gRPC control channel, shared by reference with its planes,
leased reader and writer.

Client side.  Every call carries a deadline (``timeout_s``, plus time for the bytes on
streams: ``deadline``) and the ``authorization: Bearer <token>`` metadata.  Status codes
become domain errors in one place (``status_error``): transport failures (UNAVAILABLE,
DEADLINE_EXCEEDED, CANCELLED) raise ``TierUnavailableError`` and count as
``transport_errors``; INVALID_ARGUMENT / OUT_OF_RANGE are ``ConfigError``,
RESOURCE_EXHAUSTED ``CapacityError``, NOT_FOUND ``LeaseError``, the rest ``TierError``, each
counted as ``errors``.  ``hello`` keeps what the last ``Hello`` said (``info``): the one
copy every collaborator reads.

Calls in flight are bounded (``gate``): at most half of what the server says it takes at
once on one connection (``max_calls``; ``DEFAULT_MAX_CALLS`` before the first ``Hello`` or
when it says nothing).  A caller with many requests at once (a framework's batch of 128
pages, many store jobs) waits here instead of having streams refused by the server
(HTTP/2 REFUSED_STREAM, seen as UNAVAILABLE, which would trip the tier's breaker).
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.info import ClientCounters, ServerInfo
from kvstore.errors import CapacityError, ConfigError, LeaseError, TierError, TierUnavailableError

Code = grpc.StatusCode
_TRANSPORT_CODES = frozenset({Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED})
_STREAM_BYTES_PER_S = 100e6  # deadline allowance for streamed bytes (far below the real rate)
DEFAULT_MAX_CALLS = 32  # calls in flight before the server says its limit (module docstring)


class Rpc:
    """Owns the gRPC channel, its stub and hand-coded multicallables, the call metadata, and
    the server's answer to the last ``Hello`` (``info``); counts failures in ``counters``
    (the client's, by reference)."""

    def __init__(
        self, channel: grpc.aio.Channel, target: str, token: str | None, timeout_s: float, counters: ClientCounters
    ) -> None:
        self.channel = channel
        self.target = target
        self.timeout_s = timeout_s
        self.counters = counters
        self.info: ServerInfo | None = None
        self.stub = pb_grpc.KVStoreStub(channel)
        # Hand-coded messages (see kvstore.client.dataplane): the streams' frames and Lookup requests are bytes.
        self.get_stream = channel.unary_stream(
            "/kvstore.v1.KVStore/GetStream", request_serializer=pb.GetRequest.SerializeToString, _registered_method=True
        )
        self.put_stream = channel.stream_unary(
            "/kvstore.v1.KVStore/PutStream",
            response_deserializer=pb.PutCommitResponse.FromString,
            _registered_method=True,
        )
        self.lookup_call = channel.unary_unary(
            "/kvstore.v1.KVStore/Lookup", response_deserializer=pb.LookupResponse.FromString, _registered_method=True
        )
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.max_calls = DEFAULT_MAX_CALLS
        self.gate = asyncio.Semaphore(DEFAULT_MAX_CALLS)  # calls in flight (module docstring)

    @property
    def server(self) -> ServerInfo:
        """What the last ``Hello`` said; ``TierUnavailableError`` before the first."""
        if self.info is None:
            raise TierUnavailableError(f"store {self.target}: not connected (no Hello yet)")
        return self.info

    async def hello(self, *, wait_for_ready: bool = False) -> ServerInfo:
        """``Hello``; its answer becomes ``info``."""
        resp = await self.unary("Hello", pb.HelloRequest(), wait_for_ready=wait_for_ready)
        self.info = ServerInfo.from_pb(resp)
        limit = max(1, self.info.max_calls // 2) if self.info.max_calls else DEFAULT_MAX_CALLS
        if limit != self.max_calls:  # calls holding the old gate release it; new ones take this one
            self.max_calls, self.gate = limit, asyncio.Semaphore(limit)
        return self.info

    async def ticket(self) -> bytes:
        """A data ticket (``OpenData``) for the gate or the data channel."""
        return (await self.unary("OpenData", pb.OpenDataRequest())).ticket

    def deadline(self, nbytes: int) -> float:
        """The deadline of a call moving ``nbytes``."""
        return self.timeout_s + nbytes / _STREAM_BYTES_PER_S

    async def unary(
        self, name: str, request, *, answers: frozenset = frozenset(), wait_for_ready: bool | None = None, call=None
    ):
        """The reply, or its status code when that is one of ``answers`` (``call``: a
        multicallable of ``name`` other than the stub's, e.g. one taking encoded bytes)."""
        try:
            async with self.gate:
                return await (call or getattr(self.stub, name))(
                    request, timeout=self.timeout_s, metadata=self.metadata, wait_for_ready=wait_for_ready
                )
        except grpc.aio.AioRpcError as err:
            if err.code() in answers:
                return err.code()
            raise self.error(name, err) from err
        except grpc.aio.UsageError as err:
            raise TierUnavailableError(f"store {self.target}: client is closed") from err

    def error(self, name: str, err: grpc.aio.AioRpcError) -> Exception:
        """The domain error of a failed gRPC call."""
        return self.status_error(name, err.code(), err.details())

    def status_error(self, name: str, code: grpc.StatusCode, details: str | None) -> Exception:
        """The one place status codes (of gRPC calls and data-channel replies) become
        domain errors."""
        text = f"store {self.target}: {name} failed: {code.name}: {details}"
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

    async def close(self) -> None:
        await self.channel.close()


__all__ = ["Rpc"]
