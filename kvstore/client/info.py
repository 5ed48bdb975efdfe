"""Value objects and settings of ``kvstore.client.store_client``: the transport choice, what ``Hello``
said, lookup answers, a put reservation, counters, and the channels' options (gRPC and the
data channel's TLS).

Client side.  ``ServerInfo.shm_refusal`` holds the one rule deciding whether this process
may try the server's shared memory: the token has ``shm``, the server named its gate's
socket, it runs on this boot of this host (``boot_id``), and the socket is there.  The
gate itself then decides (``kvstore.client.shmsession``).
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import asdict, dataclass
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import grpc
import grpc.aio
import numpy as np

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import ConfigError
from kvstore.keys import ObjectKey

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
MAX_MESSAGE = 64 << 20  # receive/send limit of the channel (stream frames are ~1 MiB)
TIER_NAMES = {pb.TIER_HOST: "host", pb.TIER_SSD: "ssd", pb.TIER_REDIS: "redis"}


class Transport(Enum):
    """How a client moves bytes (control is always gRPC)."""

    AUTO = "auto"  # the fastest allowed: shared memory, else the TCP data channel, else gRPC streams
    SHM = "shm"  # the server's shared-memory segment (same host), or ConfigError
    TCP = "tcp"  # the raw TCP data channel beside gRPC (any host), or an error at connect
    STREAM = "stream"  # gRPC streams of ~1 MiB frames (any host; the slowest)

    @classmethod
    def parse(cls, value: Transport | str) -> Transport:
        try:
            return value if isinstance(value, Transport) else Transport(value)
        except ValueError as err:
            raise ConfigError(f"transport must be auto, shm, tcp or stream, got {value!r}") from err


class RemoteLookup(NamedTuple):
    hits: int  # contiguous prefix present in some tier of the store
    tiers: tuple[str, ...]  # tier of each hit ("host", "ssd", "redis")
    sizes: tuple[int, ...]  # object bytes of each hit


@lru_cache(maxsize=1)
def local_boot_id() -> str:
    """This host's boot id ("" when the kernel does not expose one)."""
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class ServerInfo:
    tenant: str
    permissions: frozenset[str]
    shm_socket: str
    segment_size: int
    boot_id: str
    max_object_bytes: int
    max_keys_per_call: int
    lease_ms: int
    frame_bytes: int
    server_version: str
    data_port: int = 0  # the raw TCP data channel (0: none)
    kv_events: bool = False  # the store publishes KV events: clients Describe what they put
    max_calls: int = 0  # gRPC calls the server takes at once on one connection (0: not said)

    @classmethod
    def from_pb(cls, r: pb.HelloResponse) -> ServerInfo:
        return cls(
            r.tenant,
            frozenset(r.permissions),
            r.shm_socket,
            r.segment_size,
            r.boot_id,
            r.max_object_bytes,
            r.max_keys_per_call,
            r.lease_ms,
            r.frame_bytes,
            r.server_version,
            r.data_port,
            r.kv_events,
            r.max_calls,
        )

    def shm_refusal(self, boot_id: str) -> str:
        """Why this process cannot try the shared memory ("" when it can)."""
        if "shm" not in self.permissions:
            return "the token lacks the shm permission"
        if not self.shm_socket:
            return "the server offers no shared memory"
        if not boot_id or self.boot_id != boot_id:
            return f"the server runs on another host or boot (boot_id {self.boot_id!r})"
        if not stat.S_ISSOCK(_mode(self.shm_socket)):
            return f"no shared-memory socket at {self.shm_socket} on this host"
        return ""


def _mode(path: str) -> int:
    try:
        return os.stat(path).st_mode
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class Reservation:
    """A region of the server's segment reserved by ``PutStart``: write the object into
    ``array`` (a view of the mapped segment), then ``StoreClient.commit``."""

    key: ObjectKey
    size: int
    put_id: int
    offset: int
    ttl_ms: int
    array: np.ndarray

    @property
    def buffer(self) -> memoryview:
        return memoryview(self.array)


@dataclass(slots=True)
class ClientCounters:
    """``gets`` = hits + misses; ``misses`` include expired leases and damaged objects."""

    lookups: int = 0
    keys_looked_up: int = 0
    keys_hit: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    lease_expired: int = 0
    corrupt: int = 0
    renewals: int = 0
    releases_deferred: int = 0  # leases released in the background (copy known good in time)
    release_calls: int = 0  # ReleaseLease calls sent (background batches and late copies)
    bytes_read: int = 0
    puts: int = 0
    put_exists: int = 0
    put_failures: int = 0
    bytes_written: int = 0
    transport_errors: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from err


def data_tls(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The data channel's TLS context: TLS exactly when the gRPC channel uses it, with the
    same CA (system roots without one) and client certificate (``open_channel``'s rule)."""
    if ca is None and cert is None:
        return None
    try:
        ctx = ssl.create_default_context(cafile=ca)
        if cert is not None:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"data channel TLS: cannot load {ca or cert}: {err}") from err
    return ctx


def open_channel(
    target: str, ca: str | None, cert: str | None, key: str | None, server_name: str | None
) -> grpc.aio.Channel:
    """An insecure channel, or TLS when ``ca`` or a client certificate is given; reconnects
    quickly (a store that restarts is back within a second)."""
    options: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.enable_http_proxy", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if (cert is None) != (key is None):
        raise ConfigError("tls_cert and tls_key go together (a client certificate and its key)")
    if ca is None and cert is None:
        if server_name is not None:
            raise ConfigError("tls_server_name needs TLS (tls_ca)")
        return grpc.aio.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(_read(ca, "tls_ca"), _read(key, "tls_key"), _read(cert, "tls_cert"))
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(target, creds, options=options)


__all__ = [
    "BOOT_ID_PATH",
    "ClientCounters",
    "RemoteLookup",
    "Reservation",
    "ServerInfo",
    "TIER_NAMES",
    "Transport",
    "data_tls",
    "local_boot_id",
    "open_channel",
]
