"""The store process's wire edge: grpc method handlers built from the proto's descriptor.

Server side.  ``method_handlers(servicer)`` makes one handler per RPC of
``kvstore.v1.KVStore`` (taken from the generated descriptor, so a method added to the proto
and missing in the servicer fails at start-up); ``add_to_server`` registers them as
registered methods (matched in grpc's core, as generated stubs call them) and as a generic
handler, like generated code does; ``generic_handler`` is the latter alone.  Two handlers
skip the protobuf object on their bulk path, because protobuf ``bytes`` fields accept only
``bytes`` and every frame would otherwise be copied twice more:

* ``GetStream`` responses may be ``OutFrame``s: encoded straight from a view of the host slot
  into the wire bytes (one copy, which grpc needs anyway).  The encoding is byte-identical to
  ``GetFrame.SerializeToString()`` (tests check it).
* ``PutStream`` requests are decoded into ``InFrame``s whose ``data`` is a view of the
  received message (no copy until the handler writes it into the reserved slot).

Every request deserializer is total: bytes protobuf refuses (e.g. a string field with bad
UTF-8) become a ``Malformed`` value that the handler answers with INVALID_ARGUMENT, instead
of an exception inside grpc.

Calls are guarded before any handler work (``Guard``): a call whose metadata carries no
valid token is refused with UNAUTHENTICATED as soon as it arrives, before its request is
read, and a call whose request does not arrive within ``request_timeout`` seconds is cut
with DEADLINE_EXCEEDED.  For that, every method with a single request is served as a
client-streaming one (the same bytes on the wire: headers, one message, end of stream) whose
first message is awaited under that deadline; grpc would otherwise wait for it without a
bound while the call holds one of ``max_concurrent_rpcs`` slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from kvstore._proto import kvstore_pb2 as pb
from kvstore.wire.proto import read_varint, varint

SERVICE = "kvstore.v1.KVStore"


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request protobuf could not parse."""

    method: str
    reason: str


@dataclass(frozen=True, slots=True)
class OutFrame:
    """One GetStream frame whose ``data`` is a view of the stored object."""

    data: memoryview
    offset: int = 0
    found: bool = True
    total_length: int = 0
    tier: int = 0


@dataclass(frozen=True, slots=True)
class InFrame:
    """One PutStream frame: exactly one of ``start`` and ``data`` is set."""

    start: pb.PutStartRequest | None = None
    data: memoryview | None = None


def encode_get_frame(frame: OutFrame | pb.GetFrame) -> bytes:
    """Wire bytes of a GetFrame (fields in number order, proto3 defaults omitted)."""
    if isinstance(frame, pb.GetFrame):
        return frame.SerializeToString()
    head = bytearray()
    if frame.found:
        head += b"\x08\x01"
    if frame.total_length:
        head += b"\x10" + varint(frame.total_length)
    if frame.offset:
        head += b"\x18" + varint(frame.offset)
    if len(frame.data):
        head += b"\x22" + varint(len(frame.data))
    parts: list[bytes | memoryview] = [bytes(head)]
    if len(frame.data):
        parts.append(frame.data)
    if frame.tier:
        parts.append(b"\x28" + varint(frame.tier))
    return b"".join(parts)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    return read_varint(buf, pos, DecodeError)


def decode_put_frame(raw: bytes) -> InFrame | Malformed:
    """A PutFrame; the common case (one ``data`` field, nothing else) without copying."""
    if raw[:1] == b"\x12":
        try:
            length, pos = _read_varint(raw, 1)
        except DecodeError:
            length, pos = -1, 0
        if pos + length == len(raw):
            return InFrame(data=memoryview(raw)[pos:])
    try:
        msg = pb.PutFrame.FromString(raw)
    except DecodeError as err:
        return Malformed("PutStream", str(err))
    which = msg.WhichOneof("frame")
    if which == "start":
        return InFrame(start=msg.start)
    if which == "data":
        return InFrame(data=memoryview(msg.data))
    return InFrame()


def _parser(cls, method: str):
    def parse(raw: bytes):
        try:
            return cls.FromString(raw)
        except DecodeError as err:
            return Malformed(method, str(err))

    parse.__name__ = f"parse_{cls.__name__}"
    return parse


_SHAPES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True, slots=True)
class Guard:
    """What every call goes through before its handler (see the module docstring):
    ``admit(context)`` refuses a caller (aborting the call) from its metadata alone;
    ``request_timeout``: seconds a single-request call's request may take to arrive;
    ``late(method)`` counts a call cut for that."""

    admit: Callable[[grpc.aio.ServicerContext], Awaitable[None]]
    request_timeout: float
    late: Callable[[str], None] = lambda method: None


def _guarded_stream(fn, guard: Guard):
    """A client-streaming handler: the caller is admitted before anything is read."""

    async def behaviour(requests, context):
        await guard.admit(context)
        return await fn(requests, context)

    return behaviour


def _guarded_single(fn, guard: Guard, method: str):
    """A single-request handler served as client-streaming: admitted first, then its one
    request awaited within ``guard.request_timeout`` before ``fn(request, context)``."""

    async def behaviour(requests, context):
        await guard.admit(context)
        try:
            async with asyncio.timeout(guard.request_timeout):
                request = await anext(aiter(requests))
        except TimeoutError:
            guard.late(method)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: no request within {guard.request_timeout:g} s"
            )
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the call carried no request")
        return await fn(request, context)

    return behaviour


def generic_handler(servicer: object, guard: Guard | None = None) -> grpc.GenericRpcHandler:
    """All KVStore methods of ``servicer`` (one coroutine / async generator per RPC name)."""
    return grpc.method_handlers_generic_handler(SERVICE, method_handlers(servicer, guard))


def add_to_server(servicer: object, server: grpc.aio.Server, guard: Guard | None = None) -> None:
    """Register the KVStore methods of ``servicer`` both ways, as generated code does: as
    *registered* methods (grpc matches them in its core; generated stubs and ``StoreClient``
    call them so) and as a generic handler (for clients that do not register methods)."""
    handlers = method_handlers(servicer, guard)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def method_handlers(servicer: object, guard: Guard | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """One handler per RPC of the proto's KVStore service, bound to ``servicer`` (each
    behind ``guard`` when given)."""
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {}
    for method in service.methods:
        fn = getattr(servicer, method.name, None)
        if fn is None:
            raise RuntimeError(f"servicer {type(servicer).__name__} lacks RPC {method.name}")
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        parse = decode_put_frame if request_cls is pb.PutFrame else _parser(request_cls, method.name)
        serialize = encode_get_frame if response_cls is pb.GetFrame else response_cls.SerializeToString
        if method.client_streaming and method.server_streaming:
            raise RuntimeError(f"no handler shape for bidirectional RPC {method.name}")
        if guard is not None:
            fn = _guarded_stream(fn, guard) if method.client_streaming else _guarded_single(fn, guard, method.name)
        shape = _SHAPES[(method.client_streaming or guard is not None, method.server_streaming)]
        handlers[method.name] = shape(fn, request_deserializer=parse, response_serializer=serialize)
    return handlers


__all__ = [
    "Guard",
    "InFrame",
    "Malformed",
    "OutFrame",
    "SERVICE",
    "add_to_server",
    "decode_put_frame",
    "encode_get_frame",
    "generic_handler",
    "method_handlers",
]
