"""``StoreClient``: the store process's client (grpc.aio), used by ``kvstore.client.tier``.

Runs in the engine's processes.  The contract (proto/kvstore/v1/kvstore.proto, docs/architecture.md#the-store-process):

* Composed of collaborators built in the constructor, each owning its part: ``rpc``
  (``kvstore.client.rpc.Rpc``: the gRPC channel and stubs, the metadata, what ``Hello``
  said), ``planes`` (``kvstore.client.planes.Planes``: the shared-memory session and the
  TCP data channel), ``reader`` (``kvstore.client.leases.LeasedReader``: same-host reads
  under a lease, their release queue), ``fetcher`` (``kvstore.client.get.Fetcher``: every
  read, checked and rekeyed) and ``writer`` (``kvstore.client.put.Writer``).  The
  client owns the counters and the copy threads and passes them, and ``rpc`` and
  ``planes``, to the others by reference; it checks and rekeys what any plane read.
* ``connect`` calls ``Hello`` and picks the data plane (``kvstore.client.planes``): shared
  memory on the same host (the tenant's pool, through a session with the server's gate),
  else the raw TCP data channel, else gRPC streams, as the transport allows (``auto``: the
  fastest that works; ``shm``, ``tcp``, ``stream``: that one or an error at connect).
  ``refresh()`` (another ``Hello``) opens a new session, or reopens the data channel, when
  the server came back without the old one.
* Keys are the caller's own ``ObjectKey``; the server scopes them to the token's tenant.
  Objects arrive carrying the scoped key: they are checked against it (header, length,
  key, payload checksum) and rekeyed to the caller's key before ``read_into`` returns.  A
  miss, an expired lease or a damaged object is ``None`` and counted; a damaged object is
  also deleted on the server (after a ``refresh`` rules out a remapped segment).
* Reads land in the caller's buffer: one copy from the segment (on a copy thread for
  large objects, checksummed on a second thread meanwhile), the data channel's bytes
  received straight into it, or one copy per received gRPC frame.
  A buffer is never written after ``read_into`` returns or raises.  A same-host read is one
  round trip: the lease is released later, in batches (``kvstore.client.leases``), unless the copy
  outran the lease's window, when the server is asked whether it still held.
* Every RPC carries a deadline (``timeout_s``, plus time for the bytes on streams) and the
  ``authorization: Bearer <token>`` metadata; ``connect`` given no token uses this user's
  default token file, if there is one (``kvstore.localtoken``; docs/exposure.md).  Status
  codes become domain errors in one place (``Rpc.status_error``): transport failures
  (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED) raise ``TierUnavailableError``; a put the
  server refuses (PERMISSION_DENIED, FAILED_PRECONDITION, NOT_FOUND) is
  ``PutResult.FAILED``, not an exception.
* ``_after_copy`` (tests only; ``LeasedReader``'s ``after_copy``): an awaitable factory
  awaited between the copy out of the segment and the lease check, so a test can let a
  short lease expire mid-read.
* ``close`` sends the queued lease releases first (so do ``delete`` and ``stats``).

One client belongs to one event loop.
"""

from __future__ import annotations

import functools
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence

import grpc
import grpc.aio

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.dataplane import Copier, lookup_requests
from kvstore.client.get import Fetcher
from kvstore.client.info import (
    TIER_NAMES,
    ClientCounters,
    RemoteLookup,
    Reservation,
    ServerInfo,
    Transport,
    data_tls,
    open_channel,
)
from kvstore.client.leases import RELEASE_DELAY_S, LeasedReader
from kvstore.client.planes import Planes
from kvstore.client.put import Writer
from kvstore.client.rpc import Rpc
from kvstore.errors import ConfigError, TierError
from kvstore.keys import ROOT, ChunkHash, ObjectKey
from kvstore.localtoken import local_token
from tiers.base import PutResult

log = logging.getLogger("kvstore.client.store_client")
Code = grpc.StatusCode


class StoreClient:
    """A connection to one store process (see the module docstring).  Owns its collaborators
    (``rpc``, ``planes``, ``reader``, ``fetcher``, ``writer``), the ``counters`` and the copy
    threads."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        target: str,
        token: str | None,
        timeout_s: float,
        transport: Transport,
        after_copy: Callable[[], Awaitable[object]] | None = None,
        release_delay_s: float = RELEASE_DELAY_S,
        lease_ttl_s: float | None = None,
        *,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.transport = transport
        self.counters = ClientCounters()
        self.rpc = Rpc(channel, target, token, timeout_s, self.counters)
        self.planes = Planes(
            target,
            transport,
            timeout_s,
            token,
            tls,
            server_name,
            ticket=self.rpc.ticket,
            status_error=self.rpc.status_error,
        )
        self._copier = Copier()
        # Leases asked for on Get: 0 lets the server choose (its lease_ttl, capped at max_lease_ttl).
        lease_ms = 0 if lease_ttl_s is None else max(1, round(lease_ttl_s * 1000))
        self.reader = LeasedReader(
            self.rpc, self.planes, self.counters, self._copier, lease_ms, release_delay_s, after_copy
        )
        self.writer = Writer(self.rpc, self.planes, self.counters, self._copier, self._segment_changed)
        self.fetcher = Fetcher(
            self.rpc,
            self.planes,
            self.counters,
            self.reader,
            self._segment_changed,
            functools.partial(self.delete, quiet=True),
        )

    # --- what the collaborators own --------------------------------------------------

    @property
    def info(self) -> ServerInfo | None:
        """What the last ``Hello`` said (None before it)."""
        return self.rpc.info

    @property
    def lease_ms(self) -> int:
        """The lease each Get asks for (0: the server's default)."""
        return self.reader.lease_ms

    @property
    def uses_shm(self) -> bool:
        return self.planes.uses_shm

    @property
    def uses_tcp(self) -> bool:
        return self.planes.uses_tcp

    @property
    def shm_refusal(self) -> str:
        """Why the shared-memory data plane is not used ("" when it is)."""
        return self.planes.shm_refusal

    @property
    def tcp_refusal(self) -> str:
        """Why the TCP data channel is not used ("" when it is)."""
        return self.planes.tcp_refusal

    # --- lifecycle -------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        target: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        transport: Transport | str = "auto",
        timeout_s: float = 2.0,
        release_delay_s: float = RELEASE_DELAY_S,
        lease_ttl_s: float | None = None,
        _after_copy: Callable[[], Awaitable[object]] | None = None,
    ) -> StoreClient:
        """Open a channel, ``Hello`` (waiting up to ``timeout_s`` for the server), choose
        the data plane.  ``TierUnavailableError`` when the store cannot be reached.
        ``release_delay_s``: how long finished reads' lease releases wait to be batched.
        ``lease_ttl_s``: the lease each Get asks for (None: the server's default; the server
        caps it at its ``max_lease_ttl``)."""
        mode = Transport.parse(transport)
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if not 0 <= release_delay_s <= 60:
            raise ConfigError(f"release_delay_s must lie in [0, 60] seconds, got {release_delay_s}")
        if lease_ttl_s is not None and not 0 < lease_ttl_s < 1e7:
            raise ConfigError(f"lease_ttl_s must be a positive number of seconds, got {lease_ttl_s}")
        if not target or ":" not in target:
            raise ConfigError(f"store target must be HOST:PORT, got {target!r}")
        if not token:  # none given: the store's default token of this user, if any (kvstore.localtoken)
            token = local_token()
        channel = open_channel(target, tls_ca, tls_cert, tls_key, tls_server_name)
        tls = data_tls(tls_ca, tls_cert, tls_key)
        client = cls(
            channel,
            target,
            token,
            timeout_s,
            mode,
            _after_copy,
            release_delay_s,
            lease_ttl_s,
            tls=tls,
            server_name=tls_server_name,
        )
        try:
            await client.refresh(wait_for_ready=True)
        except BaseException:
            await client.close()
            raise
        return client

    async def refresh(self, *, wait_for_ready: bool = False) -> ServerInfo:
        """``Hello`` again; remap the segment if the server has a new one (a restart)."""
        info = await self.rpc.hello(wait_for_ready=wait_for_ready)
        await self.planes.choose(info)
        return info

    async def close(self) -> None:
        """Send queued lease releases, close the data channel and the gRPC channel, stop
        the copy threads (after any copy in flight), unmap."""
        await self.flush_releases()
        await self.planes.drop_data("closed")
        await self.rpc.close()
        self._copier.close()
        self.planes.drop_segment()

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- lookups -----------------------------------------------------------------------

    async def lookup(self, keys: Sequence[ObjectKey]) -> RemoteLookup:
        """Contiguous prefix of ``keys`` present in the store: one ``Lookup`` per run of keys
        sharing namespace and tag (at most ``max_keys_per_call`` each), stopping at a miss."""
        tiers: list[str] = []
        sizes: list[int] = []
        for request, asked in lookup_requests(keys, max(1, self.rpc.server.max_keys_per_call)):
            resp = await self.rpc.unary("Lookup", request, call=self.rpc.lookup_call)
            codes, found, hits = resp.tiers[:], resp.sizes[:], resp.hits  # [:]: lists, fastest
            if not hits <= asked or len(codes) != hits or len(found) != hits:
                raise TierError(
                    f"store {self.target}: malformed Lookup reply ({hits} hits for "
                    f"{asked} keys, {len(codes)} tiers, {len(found)} sizes)"
                )
            if hits and codes.count(codes[0]) == hits:  # the usual answer: one tier
                tiers += [TIER_NAMES.get(codes[0], "unknown")] * hits
            else:
                tiers += [TIER_NAMES.get(t, "unknown") for t in codes]
            sizes += found
            if hits < asked:
                break
        c = self.counters
        c.lookups += 1
        c.keys_looked_up += len(keys)
        c.keys_hit += len(tiers)
        return RemoteLookup(len(tiers), tuple(tiers), tuple(sizes))

    # --- reads -------------------------------------------------------------------------

    async def read_into(self, key: ObjectKey, buf) -> int | None:
        """Copy the verified object into ``buf`` (rekeyed to ``key``); its length or None
        (``Fetcher.read_into``)."""
        return await self.fetcher.read_into(key, buf)

    async def _segment_changed(self) -> bool:
        before = self.planes.segment_id
        await self.refresh()
        return self.planes.segment_id != before

    async def flush_releases(self) -> None:
        """Send the queued lease releases now and wait for them (and those in flight)."""
        await self.reader.flush_releases()

    # --- writes (``Writer``) -------------------------------------------------------------

    async def put(self, key: ObjectKey, obj, parent_hash: ChunkHash | None = None, *, retry: bool = True) -> PutResult:
        """Publish a complete object (``Writer.put``)."""
        return await self.writer.put(key, obj, parent_hash, retry=retry)

    async def reserve(self, key: ObjectKey, size: int, parent_hash: ChunkHash | None = None) -> Reservation | PutResult:
        """``PutStart``: a region of the segment, or the final outcome (``Writer.reserve``)."""
        return await self.writer.reserve(key, size, parent_hash)

    async def commit(self, res: Reservation, ok: bool = True) -> PutResult:
        """``PutCommit``, or abort when not ``ok`` (``Writer.commit``)."""
        return await self.writer.commit(res, ok)

    async def put_parts(
        self, key: ObjectKey, parts: Sequence[memoryview], size: int, parent_hash: ChunkHash | None = None
    ) -> PutResult:
        """Send ``parts`` (``size`` bytes in all) as one object (``Writer.put_parts``)."""
        return await self.writer.put_parts(key, parts, size, parent_hash)

    def check_size(self, size: int) -> None:
        """``ConfigError`` below a header's size, ``CapacityError`` above the store's limit."""
        self.writer.check_size(size)

    # --- the rest ----------------------------------------------------------------------

    async def delete(self, key: ObjectKey, *, quiet: bool = False) -> bool:
        """Delete ``key`` from every tier of the store (``quiet``: refusals answer False)."""
        answers = frozenset({Code.PERMISSION_DENIED}) if quiet else frozenset()
        await self.flush_releases()  # our own pins would keep a deleted slot taken a while
        req = pb.DeleteRequest(namespace=key[:32], chunk_hash=key[32:64], tag=key.tag)
        r = await self.rpc.unary("Delete", req, answers=answers)
        return not isinstance(r, Code) and r.deleted

    @property
    def publishes_events(self) -> bool:
        """Whether the store publishes KV events (``Hello``): then it wants ``describe``."""
        return self.info is not None and self.info.kv_events

    async def describe(
        self, key: ObjectKey, parent_hash: ChunkHash | None, tokens: Sequence[int], lora: str | None = None
    ) -> bool:
        """Tell the store the tokens of ``key`` (for its KV events); False when it publishes
        none (then nothing is sent)."""
        if not self.rpc.server.kv_events:
            return False
        parent = b"" if parent_hash is None or parent_hash == ROOT else bytes(parent_hash)
        obj = pb.ObjectDescription(chunk_hash=key[32:64], parent_hash=parent, token_ids=tokens, lora_name=lora or "")
        r = await self.rpc.unary("Describe", pb.DescribeRequest(namespace=key[:32], tag=key.tag, objects=[obj]))
        return r.described > 0

    async def stats(self) -> dict[str, object]:
        """The server's stats document and flat counters, and this client's counters."""
        await self.flush_releases()  # the answer then reflects every read this client finished
        resp = await self.rpc.unary("Stats", pb.StatsRequest())
        try:
            doc = json.loads(resp.json) if resp.json else {}
        except ValueError as err:
            raise TierError(f"store {self.target}: Stats returned invalid JSON: {err}") from err
        return {"server": doc, "server_counters": dict(resp.counters), "client": self.counters.as_dict()}


__all__ = ["RemoteLookup", "StoreClient", "Transport"]
