"""One dedicated Redis connection that reads RESP2 replies straight into a caller's buffer.

Runs on the event loop that owns the Redis tier; ``tiers.redis_bulk.BulkReader`` opens these
connections, pools them and turns their outcomes into a tier read.
``BulkConnection.run(requests, window)`` sends a pipeline (``window`` commands in flight) and
resolves with the worst ``Outcome`` of its replies once every reply is complete; a request
names the buffer its bulk reply fills exactly, a ``Slot`` (a reply of any length: it lands
in the slot's buffer when it fits, and the slot records its length; a nil reply is not
LOST there), or ``None`` (a ``+OK`` status reply is due).

How bytes move: the connection is an ``asyncio.BufferedProtocol`` with a RESP2 reply parser.
While a payload of a large part is due, ``get_buffer`` hands out ``view[start + got : end]``
and the kernel (or the TLS layer) writes straight into the caller's buffer; otherwise a
scratch buffer no longer than the bytes known to precede the next large payload (headers,
CRLFs, small replies: copied once).  A part of another length than its buffer is drained
into a private sink, never into the caller's buffer.

``close(err)`` first detaches every caller buffer (``get_buffer`` can then only hand out
scratch or the sink), fails the run in flight and aborts the transport, so no byte lands in
a caller's buffer after that and a connection is never reused mid-reply.  A run that
receives no byte for ``op_timeout_s`` closes its connection with ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Sequence
from enum import Enum

_SCRATCH = 64 << 10  # per connection: reply headers, CRLFs, error lines and small replies
_SMALL = 16 << 10  # payloads up to this size travel through scratch, several per read
_TAIL = 4 << 10  # a large payload's last bytes come through scratch with CRLF + next header
_SINK = memoryview(bytearray(256 << 10))  # drained bytes land here; never read back
_LINE_SLACK = 64  # room beyond the expected header while an unexpected line is read


class Slot:
    """Where a bulk reply of a length not known in advance lands: ``buf[:length]`` when it
    fits.  After the run, ``length`` is the reply's length, -1 for a nil reply, more than
    ``len(buf)`` when it did not fit (its bytes were drained, never written to ``buf``),
    or -2 when no reply was parsed."""

    __slots__ = ("buf", "length")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.length = -2


# (the buffer its bulk reply fills exactly, a Slot, or None for a +OK status reply; command)
Request = tuple[memoryview | Slot | None, bytes]


class Outcome(Enum):
    """How a pipeline of part reads ended (see ``tiers.redis_bulk`` for what each means)."""

    OK = "ok"
    LOST = "lost"
    CORRUPT = "corrupt"
    FAILED = "failed"
    FALLBACK = "fallback"


_RANK = {Outcome.CORRUPT: 0, Outcome.LOST: 1, Outcome.FAILED: 2, Outcome.FALLBACK: 3, Outcome.OK: 4}


class ProtocolError(Exception):
    """The server sent bytes that are not the RESP2 reply expected."""


class ConnectionClosed(Exception):
    """The connection was closed under a read (the reader closed, or the read abandoned)."""


def command(*args: bytes) -> bytes:
    """One RESP2 command (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(out)


def _bulk_length(line: bytes) -> int:
    """``n`` of a ``$<n>`` header line (-1: a nil reply); ``ProtocolError`` otherwise."""
    try:
        n = int(line[1:]) if line[:1] == b"$" else -2
    except ValueError:
        n = -2
    if n < -1:
        raise ProtocolError(f"expected a bulk string reply, got {line[:60]!r}")
    return n


class BulkConnection(asyncio.BufferedProtocol):
    """One dedicated connection and its reply parser; ``run`` sends a pipeline and resolves
    with its worst ``Outcome`` once every reply is complete."""

    def __init__(self, loop: asyncio.AbstractEventLoop, op_timeout_s: float) -> None:
        self._loop, self._timeout = loop, op_timeout_s
        self._raw = bytearray(_SCRATCH)
        self._scratch = memoryview(self._raw)
        self._start = self._end = 0  # unparsed bytes: _raw[_start:_end]
        self._sent: deque[memoryview | Slot | None] = deque()  # requests whose header is due
        self._unsent: deque[Request] = deque()
        self._dest: memoryview | None = None  # the payload being received; None: drained
        self._need = 0  # payload bytes still due for the current reply
        self._crlf = 0  # CRLF bytes still due after the current payload
        self._direct = False  # the last buffer handed out was not scratch
        self._left = 0  # replies of this run not yet complete
        self._owed = 0  # GETs to send once the bytes at hand are parsed
        self._fut: asyncio.Future[Outcome] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._active = 0.0  # loop time of the last byte received
        self.transport: asyncio.Transport | None = None
        self.closed = self.reused = False
        self.received = 0  # bytes received during the current run
        self.outcome, self.detail = Outcome.OK, ""

    # --- asyncio protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(ConnectionError(f"redis closed the bulk connection ({exc or 'EOF'})"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._need > _TAIL and self._fut is not None and not self._fut.done():
            self._direct = True
            if self._dest is None:
                return _SINK[: min(self._need, len(_SINK))]
            return self._dest[len(self._dest) - self._need :]
        self._direct = False
        if self._start:
            n = self._end - self._start
            self._raw[:n] = self._raw[self._start : self._end]
            self._start, self._end = 0, n
        want = self._want()
        stop = min(len(self._raw), want if want > self._end else self._end + _LINE_SLACK)
        return self._scratch[self._end : stop]

    def buffer_updated(self, nbytes: int) -> None:
        if self._fut is None or self._fut.done():  # no read in flight: these bytes are not ours
            self.close(ProtocolError(f"{nbytes} bytes arrived outside a read"))
            return
        self._active = self._loop.time()
        self.received += nbytes
        if self._direct:
            self._need -= nbytes
            if self._need == 0:
                self._dest, self._crlf = None, 2
            return
        self._end += nbytes
        try:
            self._parse()
        except ProtocolError as err:
            self.close(err)
        if self._owed:  # one write for all the GETs the replies just parsed made room for
            self._send(self._owed)

    # --- parsing -----------------------------------------------------------------------------

    def _want(self) -> int:
        """Bytes known to arrive before the next large payload (counted from ``_start``)."""
        due = self._need + self._crlf
        for dest in self._sent:
            if dest is None:
                due += 5  # +OK\r\n
                continue
            if isinstance(dest, Slot):  # its length is unknown: stop at its header
                due += len(str(len(dest.buf))) + 3
                break
            due += len(str(len(dest))) + 3  # $<n>\r\n
            if len(dest) > _SMALL or due >= len(self._raw):
                break
            due += len(dest) + 2
        return due

    def _parse(self) -> None:
        raw = self._raw
        while self._start < self._end:
            if self._need:
                k = min(self._need, self._end - self._start)
                if self._dest is not None:
                    at = len(self._dest) - self._need
                    self._dest[at : at + k] = self._scratch[self._start : self._start + k]
                self._start += k
                self._need -= k
                if self._need == 0:
                    self._dest, self._crlf = None, 2
            elif self._crlf:
                if raw[self._start] != b"\r\n"[2 - self._crlf]:
                    raise ProtocolError("a bulk reply does not end with CRLF")
                self._start += 1
                self._crlf -= 1
                if self._crlf == 0:
                    self._reply_done()
            else:
                eol = raw.find(b"\r\n", self._start, self._end)
                if eol < 0:
                    if self._start == 0 and self._end == len(raw):
                        raise ProtocolError(f"a reply line longer than {len(raw)} bytes")
                    return
                line = bytes(raw[self._start : eol])
                self._start = eol + 2
                self._header(line)
        self._start = self._end = 0

    def _header(self, line: bytes) -> None:
        if not self._sent:
            raise ProtocolError(f"unexpected reply {line[:60]!r}")
        dest, kind = self._sent.popleft(), line[:1]
        if kind == b"-":
            self._note(Outcome.FALLBACK, line[1:].decode(errors="replace"))
            return self._reply_done()
        if dest is None:
            if kind != b"+":
                raise ProtocolError(f"expected a status reply, got {line[:60]!r}")
            return self._reply_done()
        n = _bulk_length(line)
        if isinstance(dest, Slot):
            dest.length = n
            if n == -1:
                return self._reply_done()
            dest = dest.buf[:n] if n <= len(dest.buf) else memoryview(b"")  # too long: drained
            self._dest, self._need = (dest if n == len(dest) else None), n
            if n == 0:
                self._dest, self._crlf = None, 2
            return
        if n == -1:
            self._note(Outcome.LOST, "a part is missing")
            return self._reply_done()
        if n != len(dest):
            self._note(Outcome.CORRUPT, f"a part of {n} bytes where the manifest says {len(dest)}")
        self._dest, self._need = (dest if n == len(dest) else None), n
        if n == 0:
            self._dest, self._crlf = None, 2

    def _note(self, outcome: Outcome, detail: str) -> None:
        if _RANK[outcome] < _RANK[self.outcome]:
            self.outcome, self.detail = outcome, detail

    def _reply_done(self) -> None:
        self._left -= 1
        if self._unsent:
            self._owed += 1
        elif self._left == 0 and self._fut is not None and not self._fut.done():
            self._stop_timer()
            self._fut.set_result(self.outcome)

    # --- running a pipeline ------------------------------------------------------------------

    def run(self, requests: Sequence[Request], window: int) -> asyncio.Future[Outcome]:
        """Send ``requests``, ``window`` in flight (0: all at once); resolves with the worst
        outcome once every reply is complete, or fails with the transport's error."""
        if self._fut is not None and not self._fut.done():
            raise RuntimeError("bulk connection is busy")
        self.outcome, self.detail, self.received = Outcome.OK, "", 0
        self._fut = self._loop.create_future()
        if self.closed:  # lost before its first command (the server hung up at once)
            self._fut.set_exception(ConnectionError("redis closed the bulk connection"))
            return self._fut
        self._left = len(requests)
        self._unsent = deque(requests)
        self._active = self._loop.time()
        self._timer = self._loop.call_later(self._timeout, self._watch)
        self._send(window or len(requests))
        return self._fut

    def _send(self, n: int) -> None:
        self._owed, out = 0, []
        while n > 0 and self._unsent:
            dest, cmd = self._unsent.popleft()
            self._sent.append(dest)
            out.append(cmd)
            n -= 1
        assert self.transport is not None
        self.transport.write(b"".join(out))

    def _watch(self) -> None:
        idle = self._loop.time() - self._active
        if idle >= self._timeout:
            self.close(TimeoutError(f"no reply bytes from redis for {self._timeout:g} s"))
        else:
            self._timer = self._loop.call_later(self._timeout - idle, self._watch)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self, err: BaseException | None = None) -> None:
        """Detach every caller buffer (``get_buffer`` can no longer hand one out), fail the run
        in flight with ``err`` and drop the connection at once."""
        self.closed = True
        self._sent.clear()
        self._unsent.clear()
        self._dest, self._need, self._crlf, self._owed = None, 0, 0, 0
        self._stop_timer()
        if self._fut is not None and not self._fut.done():
            self._fut.set_exception(err or ConnectionClosed("bulk connection closed"))
        if self.transport is not None:
            self.transport.abort()


def worst(outcomes: Iterable[Outcome]) -> Outcome:
    """The outcome that decides a read made of several pipelines (CORRUPT first, OK last)."""
    return min(outcomes, key=_RANK.__getitem__)


__all__ = ["BulkConnection", "ConnectionClosed", "Outcome", "ProtocolError", "Request", "Slot", "command", "worst"]
