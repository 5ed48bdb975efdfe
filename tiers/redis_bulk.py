"""Zero-copy bulk reads for the Redis tier: part replies land straight in the caller's buffer.

Runs on the event loop that owns the tier (``tiers.redis.RedisTier._fetch``).
``BulkReader(cfg, on_down)`` keeps, per Redis server (per node of a cluster), up to
``max_inflight_parts`` dedicated connections, opened lazily with the tier's settings (AUTH
user/password, SELECT db, TLS from ``tls_ca``/``tls_cert``/``tls_key``, ``connect_timeout_s``)
and reused; a connection carries one object read at a time, and a read waits for a free one.
``await get_slots(gets)`` GETs a few keys of unknown length (a manifest and an inline object:
the first, often only, round trip of a read) into ``Slot``s, one pipeline per node.
``await read_into(nodes, keys, manifest, view)`` pipelines a ``GET`` for every part a manifest
names (``max_inflight_parts`` in flight per node, nodes concurrently) and answers an ``Outcome``:

* OK: every part had exactly its manifest length and now sits in ``view`` at its offset;
* LOST: a part is gone (``$-1``); CORRUPT: a part has another length (its bytes are drained
  into a private sink, never into ``view``); the other replies are still read to the end, so
  the connection stays at a reply boundary and is reused;
* FALLBACK: an error reply (MOVED/ASK, NOPERM, LOADING, WRONGTYPE, a refused AUTH) or bytes
  that are not a RESP2 reply: read this object the ordinary way; the server is not down;
* FAILED: a transport failure, or ``op_timeout_s`` without a byte of progress; ``on_down(node,
  err)`` has been called (the tier opens that node's circuit breaker).

How bytes move: each connection is a ``tiers.redis_resp.BulkConnection``, whose RESP2 parser
hands the kernel (or the TLS layer) the caller's buffer while a large payload is due.

Cancellation, timeouts and failures: a read that ends any other way than by its last reply
first detaches the caller's buffer from the connection (``get_buffer`` can then only hand out
scratch or a private sink) and aborts the connection, so no byte lands in ``view`` after
``read_into`` returns or raises and no connection is reused mid-reply.  An idle connection the
server closed meanwhile is retried once on a fresh one (as redis-py does).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict
from collections.abc import Callable, Sequence

from tiers.redis_config import RedisConfig
from tiers.redis_manifest import Manifest
from tiers.redis_resp import BulkConnection, ConnectionClosed, Outcome, ProtocolError, Request, Slot, command, worst


class _Refused(Exception):
    """The server refused AUTH or SELECT on a new bulk connection."""


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
        self._idle: dict[str, list[BulkConnection]] = defaultdict(list)
        self._slots: dict[str, asyncio.Semaphore] = {}  # object reads in flight per server
        self._busy: set[BulkConnection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        self.counters = dict.fromkeys(("reads", "parts", "bytes", "fallbacks", "connects", "dropped", "round_trips"), 0)

    def stats(self) -> dict[str, float]:
        """``bulk_*`` counters: objects whose parts all arrived, their parts and bytes, fallbacks
        to redis-py, connections opened and dropped mid-read, pipelines sent."""
        return {f"bulk_{k}": float(v) for k, v in self.counters.items()}

    async def aclose(self) -> None:
        self._closed = True
        for conn in [*self._busy, *(c for idle in self._idle.values() for c in idle)]:
            conn.close(ConnectionClosed("the redis tier was closed"))
        self._idle.clear()
        self._busy.clear()

    async def read_into(
        self, nodes: Sequence[str], keys: Sequence[str], manifest: Manifest, view: memoryview
    ) -> Outcome:
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
            outcome = worst(t.result() for t in tasks)
        if outcome is Outcome.OK:
            self.counters["reads"] += 1
            self.counters["parts"] += len(keys)
            self.counters["bytes"] += manifest.size
        self.counters["fallbacks"] += outcome is Outcome.FALLBACK
        return outcome

    async def get_slots(self, gets: Sequence[tuple[str, str, Slot]]) -> list[Outcome]:
        """GET each key (``(server, key, slot)``) into its ``Slot``: one pipeline per server,
        servers concurrently.  Each request's outcome is its server's: OK (the slot holds its
        reply's length), FALLBACK or FAILED."""
        groups: dict[str, list[Request]] = defaultdict(list)
        for node, key, slot in gets:
            groups[node].append((slot, command(b"GET", key.encode())))
        if len(groups) == 1:
            node, requests = next(iter(groups.items()))
            outcomes = {node: await self._node_fetch(node, requests)}
        else:
            async with asyncio.TaskGroup() as group:
                tasks = {n: group.create_task(self._node_fetch(n, reqs)) for n, reqs in groups.items()}
            outcomes = {n: t.result() for n, t in tasks.items()}
        self.counters["fallbacks"] += Outcome.FALLBACK in outcomes.values()
        return [outcomes[node] for node, _, _ in gets]

    def counted(self, parts: int, nbytes: int) -> None:
        """Count an object read whole through ``get_slots`` (an inline one)."""
        self.counters["reads"] += 1
        self.counters["parts"] += parts
        self.counters["bytes"] += nbytes

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
        except ConnectionClosed:
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

    async def _lease(self, node: str) -> BulkConnection:
        idle = self._idle[node] = [c for c in self._idle[node] if not c.closed]
        conn = idle.pop() if idle else await self._connect(node)
        self._busy.add(conn)
        return conn

    def _release(self, node: str, conn: BulkConnection) -> None:
        self._busy.discard(conn)
        conn.reused = True
        if self._closed or conn.closed:
            conn.close()
        else:
            self._idle[node].append(conn)

    def _drop(self, conn: BulkConnection) -> None:
        self._busy.discard(conn)
        self.counters["dropped"] += 1
        conn.close()

    async def _connect(self, node: str) -> BulkConnection:
        """A new connection to ``node``, authenticated and on the right database."""
        cfg, loop = self.cfg, asyncio.get_running_loop()
        host, port = self._address(node)
        tls = self._tls_context() if cfg.tls else None
        conn: BulkConnection | None = None
        try:
            async with asyncio.timeout(cfg.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: BulkConnection(loop, cfg.op_timeout_s),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                )
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
        cfg = self.cfg
        out: list[Request] = []
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


__all__ = ["BulkReader", "Outcome", "ProtocolError", "Request", "Slot", "command"]
