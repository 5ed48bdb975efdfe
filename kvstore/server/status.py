"""Domain errors to gRPC status codes, and the ``rpc`` decorator every handler of the store
process's servicer goes through (server side).  The one table (first match wins):

    UnauthenticatedError → UNAUTHENTICATED     PermissionDeniedError → PERMISSION_DENIED
    ConfigError          → INVALID_ARGUMENT    CapacityError         → RESOURCE_EXHAUSTED
    LeaseError           → NOT_FOUND           ObjectFormatError     → FAILED_PRECONDITION
    TierError            → UNAVAILABLE         TimeoutError          → DEADLINE_EXCEEDED
    anything else        → INTERNAL (logged with its traceback)

The data channel (``kvstore.server.dataconn``) and the shared-memory gate
(``kvstore.server.shmgate``) answer with the same codes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import CapacityError, ConfigError, LeaseError, ObjectFormatError, TierError
from kvstore.server.auth import Permission, PermissionDeniedError, UnauthenticatedError
from tiers.base import PutResult

log = logging.getLogger("kvstore.server.servicer")
TIER_CODES: dict[str, pb.Tier] = {"host": pb.TIER_HOST, "ssd": pb.TIER_SSD, "redis": pb.TIER_REDIS}
OUTCOMES = {
    PutResult.STORED: pb.PUT_OUTCOME_STORED,
    PutResult.EXISTS: pb.PUT_OUTCOME_EXISTS,
    PutResult.NO_ROOM: pb.PUT_OUTCOME_NO_ROOM,
    PutResult.FAILED: pb.PUT_OUTCOME_FAILED,
}

# The one table of domain error → status code (first match wins: subclasses first).
STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
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
DRAIN_FIRST = frozenset(
    {
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    for kind, code in STATUS:
        if isinstance(err, kind):
            return code, str(err) or type(err).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__} (see the server log)"


Handler = Callable[..., Awaitable[object]]


def rpc(*needed: Permission) -> Callable[[Handler], Handler]:
    """Authenticate, check ``needed``, apply the deadline, map errors to status codes."""

    def wrap(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def handler(self: Any, request, context: grpc.aio.ServicerContext):
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
                # The status is set, not raised with context.abort: grpc.aio keeps the AbortError on
                # the call's state, in a cycle the collector cannot see, so every aborted call leaked
                # its frames and request (a refused 65,536-token Describe: ~250 KiB each; issue 23).
                context.set_code(code)
                context.set_details(message)
                return None

        return handler

    return wrap


__all__ = ["DRAIN_FIRST", "OUTCOMES", "STATUS", "TIER_CODES", "rpc", "status_of"]
