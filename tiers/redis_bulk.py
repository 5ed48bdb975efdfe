"""Zero-copy bulk reads for the Redis tier: part replies land straight in the caller's buffer.

Runs on the event loop that owns the tier (``tiers.redis.RedisTier._fetch``).
``BulkReader(cfg, on_down)`` keeps, per Redis server (per node of a cluster), up to
``max_inflight_parts`` dedicated connections, opened lazily with the tier's settings (AUTH
user/password, SELECT db, TLS from ``tls_ca``/``tls_cert``/``tls_key``, ``connect_timeout_s``)
and reused; a connection carries one object read at a time, and a read waits for a free one.
``await fetch(nodes, keys, manifest, view)`` pipelines a ``GET`` for every part a manifest
names (``max_inflight_parts`` in flight per node, nodes concurrently) and answers an ``Outcome``:

* OK: every part had exactly its manifest length and now sits in ``view`` at its offset;
* LOST: a part is gone (``$-1``); CORRUPT: a part has another length (its bytes are drained
  into a private sink, never into ``view``); the other replies are still read to the end, so
  the connection stays at a reply boundary and is reused;
* FALLBACK: an error reply (MOVED/ASK, NOPERM, LOADING, WRONGTYPE, a refused AUTH) or bytes
  that are not a RESP2 reply: read this object the ordinary way; the server is not down;
* FAILED: a transport failure, or ``op_timeout_s`` without a byte of progress; ``on_down(node,
  err)`` has been called (the tier opens that node's circuit breaker).

How bytes move: each connection is an ``asyncio.BufferedProtocol`` with a RESP2 reply parser.
While a payload of a large part is due, ``get_buffer`` hands out ``view[start + got : end]``
and the kernel (or the TLS layer) writes straight into the caller's buffer; otherwise a
scratch buffer no longer than the bytes known to precede the next large payload (headers,
CRLFs, small replies: copied once).

Cancellation, timeouts and failures: a read that ends any other way than by its last reply
first detaches the caller's buffer from the connection (``get_buffer`` can then only hand out
scratch or a private sink) and aborts the connection, so no byte lands in ``view`` after
``fetch`` returns or raises and no connection is reused mid-reply.  An idle connection the
server closed meanwhile is retried once on a fresh one (as redis-py does).
"""
from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from enum import Enum

from tiers.redis_config import RedisConfig
from tiers.redis_manifest import Manifest

_SCRATCH = 64 << 10   # per connection: reply headers, CRLFs, error lines and small replies
_SMALL = 16 << 10     # payloads up to this size travel through scratch, several per read
_TAIL = 4 << 10       # a large payload's last bytes come through scratch with CRLF + next header
_SINK = memoryview(bytearray(256 << 10))  # drained bytes land here; never read back
_LINE_SLACK = 64      # room beyond the expected header while an unexpected line is read

Request = tuple[memoryview | None, bytes]  # (the buffer its bulk reply fills, or None for +OK; command)


class Outcome(Enum):
    OK = "ok"
    LOST = "lost"
    CORRUPT = "corrupt"
    FAILED = "failed"
    FALLBACK = "fallback"


_RANK = {Outcome.CORRUPT: 0, Outcome.LOST: 1, Outcome.FAILED: 2, Outcome.FALLBACK: 3, Outcome.OK: 4}


class ProtocolError(Exception):
    """The server sent bytes that are not the RESP2 reply expected."""


class _Refused(Exception):
    """The server refused AUTH or SELECT on a new bulk connection."""


class _Closed(Exception):
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


class _Conn(asyncio.BufferedProtocol):
    """One dedicated connection and its reply parser; ``run`` sends a pipeline and resolves
    with its worst ``Outcome`` once every reply is complete."""

    def __init__(self, loop: asyncio.AbstractEventLoop, op_timeout_s: float) -> None:
        self._loop, self._timeout = loop, op_timeout_s
        self._raw = bytearray(_SCRATCH)
        self._scratch = memoryview(self._raw)
        self._start = self._end = 0    # unparsed bytes: _raw[_start:_end]
        self._sent: deque[memoryview | None] = deque()   # requests whose header is due
        self._unsent: deque[Request] = deque()
        self._dest: memoryview | None = None   # the payload being received; None: drained
        self._need = 0                 # payload bytes still due for the current reply
        self._crlf = 0                 # CRLF bytes still due after the current payload
        self._direct = False           # the last buffer handed out was not scratch
        self._left = 0                 # replies of this run not yet complete
        self._owed = 0                 # GETs to send once the bytes at hand are parsed
        self._fut: asyncio.Future[Outcome] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._active = 0.0             # loop time of the last byte received
        self.transport: asyncio.Transport | None = None
        self.closed = self.reused = False
        self.received = 0              # bytes received during the current run
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
            return self._dest[len(self._dest) - self._need:]
        self._direct = False
        if self._start:
            n = self._end - self._start
            self._raw[:n] = self._raw[self._start:self._end]
            self._start, self._end = 0, n
        want = self._want()
        stop = min(len(self._raw), want if want > self._end else self._end + _LINE_SLACK)
        return self._scratch[self._end:stop]

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
                due += 5                               # +OK\r\n
                continue
            due += len(str(len(dest))) + 3             # $<n>\r\n
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
                    self._dest[at:at + k] = self._scratch[self._start:self._start + k]
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
                line = bytes(raw[self._start:eol])
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
            self._fut.set_exception(err or _Closed("bulk connection closed"))
        if self.transport is not None:
            self.transport.abort()


class BulkReader:
    """Dedicated connections per Redis server and the pipelined part reads over them."""

    def __init__(self, cfg: RedisConfig, on_down: Callable[[str, BaseException], None]) -> None:
        self.cfg = cfg
        # GETs in flight per connection.  Measured, 32 MiB in 1 MiB parts: all 32 at once
        # ~0.75-1.05 GB/s (Redis copies each reply into output buffers: 32 MiB of them), 2-8
        # ~1.0-1.6.  16 KiB parts gain from more (4: 0.44 GB/s, 16: 0.95), but replies queued
        # in Redis count against maxmemory and evict under allkeys-lru: stay at the old path's.
        self.window = cfg.max_inflight_parts
        self._on_down = on_down
        self._idle: dict[str, list[_Conn]] = defaultdict(list)
        self._slots: dict[str, asyncio.Semaphore] = {}  # object reads in flight per server
        self._busy: set[_Conn] = set()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        self.counters = dict.fromkeys(("reads", "parts", "bytes", "fallbacks", "connects",
                                       "dropped", "round_trips"), 0)

    def stats(self) -> dict[str, float]:
        """``bulk_*`` counters: objects whose parts all arrived, their parts and bytes, fallbacks
        to redis-py, connections opened and dropped mid-read, pipelines sent."""
        return {f"bulk_{k}": float(v) for k, v in self.counters.items()}

    async def aclose(self) -> None:
        self._closed = True
        for conn in [*self._busy, *(c for idle in self._idle.values() for c in idle)]:
            conn.close(_Closed("the redis tier was closed"))
        self._idle.clear()
        self._busy.clear()

    async def fetch(self, nodes: Sequence[str], keys: Sequence[str], manifest: Manifest,
                    view: memoryview) -> Outcome:
        """Read part ``i`` (``keys[i]`` on server ``nodes[i]``) into ``view`` at its offset."""
        groups: dict[str, list[Request]] = defaultdict(list)
        for i, (node, key) in enumerate(zip(nodes, keys)):
            start, end = manifest.part_range(i)
            groups[node].append((view[start:end], command(b"GET", key.encode())))
        if len(groups) == 1:
            outcome = await self._node_fetch(*next(iter(groups.items())))
        else:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._node_fetch(n, reqs)) for n, reqs in groups.items()]
            outcome = min((t.result() for t in tasks), key=_RANK.__getitem__)
        if outcome is Outcome.OK:
            self.counters["reads"] += 1
            self.counters["parts"] += len(keys)
            self.counters["bytes"] += manifest.size
        self.counters["fallbacks"] += outcome is Outcome.FALLBACK
        return outcome

    async def _node_fetch(self, node: str, requests: list[Request]) -> Outcome:
        slots = self._slots.get(node)
        if slots is None:
            slots = self._slots[node] = asyncio.Semaphore(self.cfg.max_inflight_parts)
        async with slots:  # no timeout: every read holding a slot has its own op timeout
            outcome = await self._attempt(node, requests, retry=True)
            # None: an idle connection the server had closed meanwhile; once more, fresh
            return outcome or await self._attempt(node, requests, retry=False) or Outcome.FAILED

    async def _attempt(self, node: str, requests: list[Request], retry: bool) -> Outcome | None:
        """One try on one connection; None: retry (only when ``retry``)."""
        if self._closed:
            return Outcome.FAILED
        try:
            conn = await self._lease(node)
        except (_Refused, ProtocolError):
            return Outcome.FALLBACK
        except OSError as err:  # refused, reset, TLS failure, connect timeout
            self._on_down(node, err)
            return Outcome.FAILED
        try:
            self.counters["round_trips"] += 1
            outcome = await conn.run(requests, self.window)
        except _Closed:
            return Outcome.FAILED
        except OSError as err:
            self._drop(conn)
            if retry and conn.reused and conn.received == 0 and isinstance(err, ConnectionError):
                return None
            self._on_down(node, err)
            return Outcome.FAILED
        except ProtocolError:
            self._drop(conn)
            return Outcome.FALLBACK
        except BaseException:
            self._drop(conn)  # cancelled mid-reply: never reused
            raise
        self._release(node, conn)
        return outcome

    # --- connections ---------------------------------------------------------------------------

    async def _lease(self, node: str) -> _Conn:
        idle = self._idle[node] = [c for c in self._idle[node] if not c.closed]
        conn = idle.pop() if idle else await self._connect(node)
        self._busy.add(conn)
        return conn

    def _release(self, node: str, conn: _Conn) -> None:
        self._busy.discard(conn)
        conn.reused = True
        if self._closed or conn.closed:
            conn.close()
        else:
            self._idle[node].append(conn)

    def _drop(self, conn: _Conn) -> None:
        self._busy.discard(conn)
        self.counters["dropped"] += 1
        conn.close()

    async def _connect(self, node: str) -> _Conn:
        """A new connection to ``node``, authenticated and on the right database."""
        cfg, loop = self.cfg, asyncio.get_running_loop()
        host, port = self._address(node)
        tls = self._tls_context() if cfg.tls else None
        conn: _Conn | None = None
        try:
            async with asyncio.timeout(cfg.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, cfg.op_timeout_s), host, port, ssl=tls,
                    server_hostname=host if tls else None)
                self.counters["connects"] += 1
                hello = self._hello()
                if hello and await conn.run(hello, 0) is not Outcome.OK:
                    raise _Refused(conn.detail)
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        return conn

    def _hello(self) -> list[Request]:
        cfg, out = self.cfg, []
        if cfg.password is not None:
            user = [cfg.username.encode()] if cfg.username else []
            out.append((None, command(b"AUTH", *user, cfg.password.encode())))
        if cfg.db and not cfg.cluster:
            out.append((None, command(b"SELECT", str(cfg.db).encode())))
        return out

    def _address(self, node: str) -> tuple[str, int]:
        if not self.cfg.cluster:
            return self.cfg.host, self.cfg.port
        host, _, port = node.rpartition(":")  # redis-py names cluster nodes "host:port"
        return host.strip("[]"), int(port)

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            ctx = ssl.create_default_context(cafile=self.cfg.tls_ca)
            if self.cfg.tls_cert:
                ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
            self._ssl = ctx
        return self._ssl


__all__ = ["BulkReader", "Outcome", "ProtocolError", "Request", "command"]
