"""Reading the frames of a ``PutStream`` call (one object, client to server), server side.

``KVStoreServicer.PutStream`` reads the ``start`` frame, then either fills the reserved buffer
from the data frames (``PutFrames.fill``) or, when its answer is already known (a put not
stored, a refusal in ``DRAIN_FIRST``), reads and drops the rest (``drain``, ``drain_refused``)
so that the client sees the answer rather than a failed write.  Every wait for a frame is
bounded by ``stream_grace`` (``next_frame``); a malformed frame is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvstore.errors import ConfigError, KVStoreError
from kvstore.server.config import ServerConfig
from kvstore.server.wire import InFrame, Malformed


class PutFrames:
    """The frame reading of every ``PutStream`` of one server (its ``ServerConfig``)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg

    async def next_frame(self, frames: AsyncIterator[InFrame]) -> InFrame | None:
        """The next frame, None at the end; a client silent for ``stream_grace`` is cut off."""
        try:
            async with asyncio.timeout(self.cfg.stream_grace):
                frame = await anext(frames)
        except StopAsyncIteration:
            return None
        except TimeoutError as err:
            raise TimeoutError(f"PutStream: no frame for {self.cfg.stream_grace:g} s") from err
        if isinstance(frame, Malformed):
            raise ConfigError(f"PutStream: malformed frame ({frame.reason})")
        return frame

    async def fill(self, frames: AsyncIterator[InFrame], buf: memoryview, size: int) -> None:
        """Exactly ``size`` bytes of data frames into ``buf`` (a reservation), to the stream's end."""
        pos = 0
        while (frame := await self.next_frame(frames)) is not None:
            if frame.data is None:
                raise ConfigError(
                    "PutStream: a second 'start' frame"
                    if frame.start is not None
                    else "PutStream: a frame with neither start nor data"
                )
            n = len(frame.data)
            if pos + n > size:
                raise ConfigError(f"PutStream: more than the {size} bytes announced in start")
            buf[pos : pos + n] = frame.data
            pos += n
        if pos != size:
            raise ConfigError(f"PutStream: {pos} bytes sent, start announced {size}")

    async def drain(self, frames: AsyncIterator[InFrame]) -> None:
        """Read and drop the rest of a stream whose answer is already known (at most one
        object's worth; a client sending more is simply answered)."""
        budget = self.cfg.max_object_bytes
        while budget > 0 and (frame := await self.next_frame(frames)) is not None:
            budget -= len(frame.data) if frame.data is not None else 1

    async def drain_refused(self, frames: AsyncIterator[InFrame]) -> None:
        """``drain`` before a refusal (``DRAIN_FIRST``); a stream that misbehaves while
        drained (malformed, silent for ``stream_grace``, slower than the deadline of one
        object of ``max_object_bytes``, broken) is simply answered."""
        try:
            async with asyncio.timeout(self.cfg.stream_deadline(self.cfg.max_object_bytes)):
                await self.drain(frames.__aiter__())
        except (KVStoreError, TimeoutError, grpc.RpcError, StopAsyncIteration):
            pass


__all__ = ["PutFrames"]
