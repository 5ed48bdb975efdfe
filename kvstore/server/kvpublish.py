"""The store process's KV event publisher (``kvstore serve --kv-events ENDPOINT``): vLLM's
ZMQ protocol, one stream per tenant.  Server side, one thread of its own.

Each stream is what vLLM's ``ZmqEventPublisher`` serves, frame for frame:

* a PUB socket; each message is three frames: the topic, an 8-byte big-endian sequence
  number (0, 1, 2, ... per stream), and a msgpack batch (``kvstore.wire.kv``: vLLM's events,
  plus the restart epoch and removal reasons);
* optionally a ROUTER socket for replay: a request is ``[identity, b"", start_seq]`` (8
  bytes, big-endian), answered with ``[identity, b"", topic, seq, payload]`` for every
  buffered batch from ``start_seq`` on, then the end marker ``[identity, b"", b"", -1, b""]``;
  the last ``buffer`` batches are kept, and no more than ``buffer_bytes`` of them (a batch
  carries its objects' tokens: one tenant churning described objects must not grow the
  process by ``buffer`` large batches); the oldest go first.

**Tenants.**  Each tenant has its own stream (its own sockets, topic and sequence), fed only
with its own objects' events (the recorder routes each key to its tenant by the tenant mark
of its namespace), so one tenant's subscriber never sees another tenant's hashes or tokens.
With several tenants the endpoints must contain ``{tenant}`` (``ipc:///run/kvstore/{tenant}.events``);
a shared stream is refused.  ZMQ authenticates nobody: ``ipc://`` sockets are made 0600, and
TCP beyond loopback needs ``--insecure`` (``ServerConfig``).

**Whose sockets.**  A 0600 socket still lets every process of the store's uid subscribe, so
each tenant's sockets can live in a directory of its own: when ``{tenant}`` is in a directory
part of an ``ipc://`` endpoint (``ipc:///run/kvstore/events/{tenant}/pub``), that directory
is made (0700, no symlink, owned by the store or the tenant) before the bind.  A tenant with a
``uid`` in the tokens file's ``tenants`` section gets the directory and its sockets chowned
to that uid (0700 / 0600): only its processes (and root) can subscribe or ask for a replay.
A ``gid`` (alone or with ``uid``) gives the group that too (0710 / 0660).  Such a tenant's
endpoints must be ``ipc://`` with ``{tenant}`` in a directory part (``ConfigError``
otherwise), and chowning to another uid needs the store to run as root (or as that uid).
docs/exposure.md describes the deployment.

**Epochs.**  A new process starts a new epoch (``kvstore.wire.kv.new_epoch``) carried in
every batch; its first batch on each stream starts with ``AllBlocksCleared``.

The thread owns every socket (ZMQ sockets are not thread-safe): it takes the recorder's
events every ``interval`` seconds, publishes one batch per stream that has any, and answers
replay requests meanwhile.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import ConfigError
from kvstore.store.kvevents import EventRecorder
from kvstore.wire.kv import END_SEQ, EventLayout, KVEvent, encode_batch, new_epoch

if TYPE_CHECKING:
    from kvstore.server.config import ServerConfig
    from kvstore.server.tenants import Tenants

log = logging.getLogger("kvstore.server.events")
HWM = 100_000


@dataclass
class StreamSpec:
    endpoint: str
    replay: str | None = None
    topic: str = ""
    uid: int | None = None  # whose the ipc sockets and their directory are (see the docstring)
    gid: int | None = None
    private_dir: bool = False  # {tenant} named the sockets' directory: made 0700 before the bind


@dataclass
class _Stream:
    spec: StreamSpec
    pub: Any  # a zmq.Socket (pyzmq is imported lazily, and mypy does not follow it)
    replay: Any | None  # likewise, when the stream has a replay socket
    topic: bytes
    buffer: deque = field(default_factory=deque)
    buffered_bytes: int = 0
    seq: int = 0


def _tenant_dir(endpoint: str | None) -> bool:
    """Whether ``{tenant}`` names a directory of this ``ipc://`` endpoint."""
    return endpoint is not None and endpoint.startswith("ipc://") and "{tenant}" in os.path.dirname(endpoint[6:])


def stream_specs(
    endpoint: str,
    replay: str | None,
    topic: str,
    tenants: list[str],
    owners: dict[str, tuple[int | None, int | None]] | None = None,
) -> dict[str, StreamSpec]:
    """Each tenant's stream: ``{tenant}`` replaced in the endpoints and the topic.  Several
    tenants on one endpoint are refused (each would see the others' hashes and tokens).
    ``owners``: tenant → (uid, gid) of its sockets, from the tokens file."""
    owners = owners or {}
    for tenant, (uid, gid) in owners.items():
        if (uid is not None or gid is not None) and not all(_tenant_dir(e) for e in (endpoint, replay) if e):
            raise ConfigError(
                f"tenant {tenant!r} has a uid/gid for its KV event sockets: kv_events (and "
                f"kv_events_replay) must be ipc:// endpoints with {{tenant}} in a directory, "
                f"e.g. ipc:///run/kvstore/events/{{tenant}}/pub"
            )
    if len(tenants) > 1 and "{tenant}" not in endpoint:
        raise ConfigError(
            f"kv_events {endpoint}: {len(tenants)} tenants need '{{tenant}}' in the endpoint "
            f"(one stream each: a shared one would show every tenant the others' hashes "
            f"and tokens)"
        )
    if len(tenants) > 1 and replay and "{tenant}" not in replay:
        raise ConfigError(f"kv_events_replay {replay}: {len(tenants)} tenants need '{{tenant}}' in it")
    return {
        t: StreamSpec(
            endpoint.replace("{tenant}", t),
            replay.replace("{tenant}", t) if replay else None,
            topic.replace("{tenant}", t),
            *owners.get(t, (None, None)),
            private_dir=_tenant_dir(endpoint),
        )
        for t in tenants
    }


class EventPublisher:
    """Publishes a recorder's events on one stream per tenant (see the module docstring)."""

    def __init__(
        self,
        recorder: EventRecorder,
        streams: dict[str, StreamSpec],
        *,
        buffer: int = 10_000,
        buffer_bytes: int = 64 << 20,
        interval: float = 0.02,
        epoch: int | None = None,
        layout: EventLayout = EventLayout.MAP,
    ) -> None:
        import zmq  # lazily: only a store with --kv-events needs pyzmq

        self._zmq = zmq
        self.recorder = recorder
        self.epoch = new_epoch() if epoch is None else epoch
        self.interval, self.layout = interval, layout
        self._ctx = zmq.Context()
        self._streams: dict[str, _Stream] = {}
        self._buffer, self._buffer_bytes = buffer, buffer_bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = {"batches": 0, "events": 0, "replays": 0}  # written by the thread only
        try:
            for tenant, spec in streams.items():
                self._streams[tenant] = self._open(spec)
        except BaseException:
            self._close_sockets()
            raise
        # Tenant → (bound endpoint, replay endpoint): a ``tcp://…:0`` endpoint shows its port.
        last = zmq.LAST_ENDPOINT
        self.endpoints = {
            t: (s.pub.getsockopt_string(last), s.replay.getsockopt_string(last) if s.replay is not None else None)
            for t, s in self._streams.items()
        }

    def _open(self, spec: StreamSpec) -> _Stream:
        zmq = self._zmq
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(HWM)
        pub.setsockopt(zmq.LINGER, 0)
        stream = _Stream(spec, pub, None, spec.topic.encode(), deque())
        _bind(pub, spec.endpoint, spec)
        if spec.replay:
            stream.replay = self._ctx.socket(zmq.ROUTER)
            stream.replay.setsockopt(zmq.LINGER, 0)
            _bind(stream.replay, spec.replay, spec)
        return stream

    def start(self) -> None:
        """Begin the epoch (``AllBlocksCleared`` first on every stream) and the thread."""
        self.recorder.clear(self._streams)
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is pending, then close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in self._streams.values():
            s.pub.close(0)
            if s.replay is not None:
                s.replay.close(0)
        self._ctx.term()

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        replays = {s.replay: s for s in self._streams.values() if s.replay is not None}
        for sock in replays:
            poller.register(sock, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            try:
                self._publish(self.recorder.take())
                ready = dict(poller.poll(0 if stopping else self.interval * 1000)) if replays else {}
                if not replays and not stopping:
                    time.sleep(self.interval)
                for sock in ready:
                    self._serve_replay(replays[sock])
            except Exception:  # noqa: BLE001 - a broken batch must not end the stream
                log.exception("kv events: publishing failed")
                time.sleep(self.interval)
            if stopping:
                return

    def _publish(self, events: list[KVEvent]) -> None:
        by_stream: dict[str | None, list[KVEvent]] = {}
        for e in events:
            by_stream.setdefault(e.stream, []).append(e)
        now = time.time()
        for tenant, batch in by_stream.items():
            stream = None if tenant is None else self._streams.get(tenant)
            if stream is None:
                continue  # a tenant no stream serves (not configured)
            payload = encode_batch(batch, now, self.epoch, layout=self.layout)
            seq = stream.seq.to_bytes(8, "big")
            stream.pub.send_multipart((stream.topic, seq, payload))
            stream.buffer.append((stream.seq, payload))
            stream.buffered_bytes += len(payload)
            while len(stream.buffer) > self._buffer or stream.buffered_bytes > self._buffer_bytes:
                stream.buffered_bytes -= len(stream.buffer.popleft()[1])
            stream.seq += 1
            self.published["batches"] += 1
            self.published["events"] += len(batch)

    def _serve_replay(self, stream: _Stream) -> None:
        replay = stream.replay
        if replay is None:  # polled only when it has one
            raise LookupError("kv events: a replay request on a stream without a replay socket")
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(stream.buffer):
            if seq >= first:
                replay.send_multipart((client, b"", stream.topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self.published["replays"] += 1


def _private_dir(path: str, spec: StreamSpec) -> None:
    """The tenant's socket directory: made 0700 if missing; a symlink, a non-directory or a
    directory of a uid that is neither the store's nor the tenant's is refused."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as err:
        raise ConfigError(f"KV event directory {path}: {err.strerror or err}") from err
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"KV event directory {path} is not a plain directory (a symlink?): refused")
    if st.st_uid not in (os.geteuid(), spec.uid):
        raise ConfigError(
            f"KV event directory {path} belongs to uid {st.st_uid}, neither the store's nor its tenant's: refused"
        )
    if st.st_uid == os.geteuid():
        os.chmod(path, 0o700)  # closed while the sockets are made; opened to the tenant after


def _give(path: str, spec: StreamSpec, directory: bool) -> None:
    """Hand ``path`` to the tenant's uid/gid, with the mode that lets them (and no one else) in."""
    mode = (0o700 if directory else 0o600) | (0o010 if directory else 0o060) * (spec.gid is not None)
    try:
        if spec.uid is not None or spec.gid is not None:
            os.chown(
                path, -1 if spec.uid is None else spec.uid, -1 if spec.gid is None else spec.gid, follow_symlinks=False
            )
        os.chmod(path, mode)
    except OSError as err:
        raise ConfigError(
            f"KV event socket {path}: cannot give it to uid {spec.uid}, gid {spec.gid}: "
            f"{err.strerror or err} (chowning to another uid needs the store to run as root "
            f"or as that uid; a group, to be a member of it)"
        ) from err


def _bind(sock, endpoint: str, spec: StreamSpec | None = None) -> None:
    ipc = endpoint.startswith("ipc://")
    if ipc and spec is not None and spec.private_dir:
        _private_dir(os.path.dirname(endpoint[len("ipc://") :]), spec)
    try:
        sock.bind(endpoint)
    except Exception as err:  # zmq.ZMQError: address in use, bad endpoint
        raise ConfigError(f"cannot publish KV events on {endpoint}: {err}") from err
    if ipc:
        path = endpoint[len("ipc://") :]
        if spec is None:
            os.chmod(path, 0o600)  # this uid only, as the shm socket
            return
        _give(path, spec, directory=False)
        if spec.private_dir:
            _give(os.path.dirname(path), spec, directory=True)


def start_publisher(cfg: ServerConfig, recorder: EventRecorder, tenants: Tenants) -> EventPublisher:
    """The store process's publisher of ``recorder``'s KV events, on ``cfg.kv_events`` (one
    stream per tenant, each owned by the tenant's ``uid``/``gid`` when set), started."""
    if cfg.kv_events is None:
        raise ConfigError("kv_events: no endpoint to publish KV events on")
    owners = {t: (lim.uid, lim.gid) for t, lim in tenants.limits.items()}
    specs = stream_specs(cfg.kv_events, cfg.kv_events_replay, cfg.kv_events_topic, tenants.names, owners)
    publisher = EventPublisher(
        recorder,
        specs,
        buffer=cfg.kv_events_buffer,
        buffer_bytes=cfg.kv_events_buffer_bytes,
        layout=cfg.kv_events_encoding,
    )
    publisher.start()
    return publisher


__all__ = ["EventPublisher", "StreamSpec", "start_publisher", "stream_specs"]
