"""Configuration of the store process (``kvstore serve``), server side.

``ServerConfig.from_sources(flags, env, config_file)`` merges four layers, highest first:

1. command-line flags (only those given: ``None`` means "not given");
2. ``KVSTORE_SERVE_<KEY>`` environment variables (``KVSTORE_SERVE_HOST_CAPACITY=8GiB``);
3. a YAML file (``--config`` or ``KVSTORE_SERVE_CONFIG``): a mapping of the same keys
   (``host_capacity`` or ``host-capacity``);
4. the defaults below.

The fields are ``kvstore.config.TierSettings`` and ``LeaseSettings`` (shared with the
connector) plus the store process's own; each converts by its type (``kvstore.config.convert``)
and its doc is the ``--help`` of its flag.  Unknown keys, unparsable or impossible values
raise ``ConfigError`` naming the key and where it came from.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import (
    LeaseSettings,
    Seconds,
    Size,
    TierSettings,
    WritePolicy,
    check_seconds,
    from_env,
    from_yaml,
    given,
    load,
    setting,
)
from kvstore.errors import ConfigError
from kvstore.wire.kv import EventLayout

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ENV_PREFIX = "KVSTORE_SERVE_"
STREAM_HEADROOM = 64 * KiB  # a stream frame's protobuf framing stays well inside this


@dataclass(frozen=True, slots=True)
class ServerConfig(LeaseSettings, TierSettings):
    listen: str = setting("127.0.0.1:50051", "HOST:PORT to serve on (port 0: a free port)")
    data_channel: bool = setting(
        True,
        "serve the raw TCP data channel beside gRPC, on the listen host "
        "(clients on other hosts move bytes over it; off: over gRPC streams)",
    )
    data_port: int = setting(0, "port of the data channel (0: a free port; Hello advertises it)")
    data_ticket_ttl: Seconds = setting(10.0, "seconds a data-channel ticket (OpenData) may wait to be used")
    redis: str | None = setting(
        None,
        "URL of the Redis tier, the lowest tier (redis://host:port/db; options as for the connector: docs/redis.md)",
    )
    keys_file: Path | None = setting(
        None,
        "deployment secret of the objects' MACs (`kvstore keys create`); "
        "none: `KVSTORE_KEYS`, else the default file made on first use "
        "(docs/integrity.md)",
    )
    auth_tokens: Path | None = setting(
        None,
        "YAML tokens file; without it every call must carry the default "
        "token (tenant 'default', every permission; see default_token_file)",
    )
    default_token_file: Path | None = setting(
        None,
        "without auth_tokens: the 0600 file of the token every call "
        "must carry, made once if missing (default: $KVSTORE_TOKEN_PATH, "
        "else $XDG_STATE_HOME/kvstore/token, else "
        "~/.local/state/kvstore/token; docs/exposure.md)",
    )
    metrics_tenant_labels: str = setting(
        "name",
        "how /metrics labels tenants: name, hash (sha256 of the name, 12 hex digits) or off (no per-tenant series)",
    )
    tls_cert: Path | None = setting(None, "server certificate (PEM)")
    tls_key: Path | None = setting(None, "server private key (PEM)")
    tls_client_ca: Path | None = setting(None, "require client certificates signed by this CA (PEM)")
    metrics_port: int | None = setting(None, "serve Prometheus /metrics on this port (0: a free port)")
    metrics_host: str | None = setting(
        None,
        "address of /metrics (default: the host of listen); beyond "
        "loopback every scrape needs a token with admin (Authorization: "
        "Bearer), unless insecure",
    )
    max_lease_ttl: Seconds = setting(300.0, "longest lease a client may ask for, seconds")
    put_ttl: Seconds | None = setting(None, "seconds an uncommitted PutStart reservation lives (default: lease_ttl)")
    ready_file: Path | None = setting(None, "write the bound HOST:PORT here once serving")
    max_object_bytes: Size = setting(256 * MiB, "largest object accepted")
    max_keys_per_call: int = setting(4096, "most keys in one Lookup / lease ids in one ReleaseLease")
    max_message_bytes: Size = setting(8 * MiB, "gRPC receive limit (at least frame_bytes + 64KiB)")
    frame_bytes: Size = setting(1 * MiB, "GetStream frame size")
    shutdown_grace: Seconds = setting(10.0, "seconds in-flight calls get at SIGTERM")
    insecure: bool = setting(
        False,
        "serve a non-loopback listen address without TLS or a tokens file, "
        "and /metrics beyond loopback; without a tokens file it also drops the default "
        "token (then anyone who reaches it reads, writes and deletes every object; "
        "a warning is printed)",
    )
    shm_socket: Path | None = setting(
        None,
        "Unix socket handing same-host clients their tenant's shared-memory "
        "pool (default: a fresh private one in the temp directory)",
    )
    stream_min_rate: Size = setting(
        8 * MiB,
        "bytes per second every stream (gRPC or data channel) must "
        "average: moving N bytes is cut after stream_grace + N / stream_min_rate "
        "seconds, and its references and reservations are dropped",
    )
    stream_grace: Seconds = setting(
        5.0, "seconds every stream gets on top of its bytes' share, and the longest a PutStream may wait for a frame"
    )
    request_timeout: Seconds = setting(
        2.0,
        "seconds a gRPC call's request may take to arrive once the call "
        "is open (beyond: DEADLINE_EXCEEDED; calls without a valid token are "
        "refused before, from their metadata)",
    )
    hello_timeout: Seconds = setting(
        2.0,
        "seconds a new data-channel or shared-memory gate connection has to "
        "send its hello (TLS handshake included) before it is cut",
    )
    max_unauthenticated_per_peer: int = setting(
        16,
        "data-channel and gate connections not yet authenticated, "
        "per peer (TCP: source address; gate: uid and pid); beyond: "
        "closed at once",
    )
    max_unauthenticated: int = setting(
        1024,
        "data-channel and gate connections not yet authenticated, in all "
        "(each channel); beyond: closed at once; global slots are taken only "
        "after authentication",
    )
    max_concurrent_rpcs: int = setting(1024, "gRPC calls served at once (beyond: RESOURCE_EXHAUSTED)")
    max_streams_per_connection: int = setting(128, "gRPC calls at once on one client connection")
    idle_timeout: Seconds = setting(300.0, "seconds an idle client connection (gRPC or data channel) is kept")
    kv_events: str | None = setting(
        None,
        "publish the store's KV events in vLLM's format on this ZMQ "
        "endpoint (`tcp://127.0.0.1:5557`, `ipc://PATH`; none: off); with "
        "several tenants it must contain `{tenant}`: each tenant its own stream; "
        "a TCP endpoint beyond loopback needs insecure",
    )
    kv_events_replay: str | None = setting(
        None,
        "ZMQ ROUTER endpoint answering replay requests as vLLM's does (`{tenant}` as for kv_events; none: no replay)",
    )
    kv_events_topic: str = setting(
        "", "topic of every KV event message (`{tenant}` is replaced), e.g. llm-d's `kv@HOST:PORT@MODEL`"
    )
    kv_events_encoding: EventLayout = setting(
        EventLayout.MAP,
        "how each KV event is encoded: `map` (vLLM's "
        "since its PR #42892) or `array` (positional, for decoders "
        "written before maps, e.g. llm-d-kv-cache up to v0.8.1)",
    )
    kv_events_buffer: int = setting(10000, "KV event batches kept for replay, per stream")
    kv_events_buffer_bytes: Size = setting(
        64 * MiB, "bytes of KV event batches kept for replay, per stream (the oldest go first)"
    )
    trace_path: Path | None = setting(
        None, "write a Chrome trace-event JSON of the store's stages here (Perfetto and chrome://tracing open it)"
    )

    def __post_init__(self) -> None:
        TierSettings.__post_init__(self)
        LeaseSettings.__post_init__(self)
        split_listen(self.listen)
        for name in (
            "max_object_bytes",
            "max_keys_per_call",
            "max_message_bytes",
            "frame_bytes",
            "stream_min_rate",
            "max_concurrent_rpcs",
            "max_streams_per_connection",
            "max_unauthenticated_per_peer",
            "max_unauthenticated",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "max_lease_ttl",
            "shutdown_grace",
            "data_ticket_ttl",
            "stream_grace",
            "idle_timeout",
            "request_timeout",
            "hello_timeout",
        ):
            check_seconds(name, getattr(self, name))
        if self.put_ttl is not None:
            check_seconds("put_ttl", self.put_ttl)
        if self.write_policy is WritePolicy.WRITE_BACK:
            raise ConfigError(
                "write_policy write_back: the store process writes through or not at all (write_through or host_only)"
            )
        if self.max_lease_ttl < self.lease_ttl:
            raise ConfigError(f"max_lease_ttl ({self.max_lease_ttl}) is below lease_ttl ({self.lease_ttl})")
        self._check_limits()
        if self.metrics_tenant_labels not in ("name", "hash", "off"):
            raise ConfigError(f"metrics_tenant_labels must be name, hash or off, got {self.metrics_tenant_labels!r}")
        self._check_exposure()
        self._check_events()

    def _check_exposure(self) -> None:
        """A listen address beyond loopback needs TLS and a tokens file, or ``insecure``."""
        if self.insecure or is_loopback(self.listen_host) or (self.tls and self.auth_tokens is not None):
            return
        missing = " and ".join(
            what
            for what, ok in (("TLS (tls_cert, tls_key)", self.tls), ("a tokens file (auth_tokens)", self.auth_tokens))
            if not ok
        )
        raise ConfigError(
            f"listen address {self.listen} is not loopback: serving it needs {missing}; "
            f"insecure (--insecure) serves it without them, to anyone who can reach it"
        )

    def _check_events(self) -> None:
        """ZMQ has no authentication: a TCP endpoint beyond loopback (the events carry token
        ids) needs ``insecure``, as a plaintext listen address does."""
        if self.kv_events_buffer <= 0:
            raise ConfigError(f"kv_events_buffer must be positive, got {self.kv_events_buffer}")
        if self.kv_events_buffer_bytes <= 0:
            raise ConfigError(f"kv_events_buffer_bytes must be positive, got {self.kv_events_buffer_bytes}")
        if self.kv_events_replay and not self.kv_events:
            raise ConfigError("kv_events_replay needs kv_events (replay answers for a stream)")
        for name in ("kv_events", "kv_events_replay"):
            endpoint = getattr(self, name)
            if not endpoint:
                continue
            scheme, sep, rest = endpoint.partition("://")
            if not sep or scheme not in ("tcp", "ipc") or not rest:
                raise ConfigError(f"{name}: expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
            host = rest.rpartition(":")[0] if scheme == "tcp" else "localhost"
            if scheme == "tcp" and not host:
                raise ConfigError(f"{name}: expected tcp://HOST:PORT, got {endpoint!r}")
            if not self.insecure and not is_loopback(host):
                raise ConfigError(
                    f"{name}: {endpoint} is reachable beyond this host and ZMQ authenticates "
                    f"nobody (the events carry token ids): use a loopback or ipc:// "
                    f"endpoint, or insecure (--insecure)"
                )

    def _check_limits(self) -> None:
        if self.max_object_bytes < 256:
            raise ConfigError(f"max_object_bytes must hold at least a 256-byte header, got {self.max_object_bytes}")
        if self.frame_bytes < 4 * KiB:
            raise ConfigError(f"frame_bytes must be at least 4 KiB, got {self.frame_bytes}")
        if self.max_message_bytes < self.frame_bytes + STREAM_HEADROOM:
            raise ConfigError(
                f"max_message_bytes ({self.max_message_bytes}) must be at least "
                f"frame_bytes + 64 KiB ({self.frame_bytes + STREAM_HEADROOM})"
            )
        if not 0 <= self.data_port <= 65535:
            raise ConfigError(f"data_port must lie in [0, 65535], got {self.data_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must lie in [0, 65535], got {self.metrics_port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca needs tls_cert and tls_key (client certificates need TLS)")

    @property
    def put_ttl_s(self) -> float:
        return self.lease_ttl if self.put_ttl is None else self.put_ttl

    def stream_deadline(self, nbytes: int) -> float:
        """Seconds a stream moving ``nbytes`` may take in all (see ``stream_min_rate``)."""
        return self.stream_grace + nbytes / self.stream_min_rate

    @property
    def listen_host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @classmethod
    def from_sources(
        cls,
        flags: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | Path | None = None,
    ) -> ServerConfig:
        """Merge flags > environment > YAML file > defaults (see the module docstring)."""
        env = os.environ if env is None else env
        flags = {k: v for k, v in (flags or {}).items() if v is not None}
        flag = flags.pop("config", None)
        if flag is not None and not isinstance(flag, (str, Path)):
            raise ConfigError(f"config: expected a file path, got {flag!r}")
        config_file = flag or config_file or env.get(ENV_PREFIX + "CONFIG")
        sources = [given(cls, flags, "command line", flag_name), from_env(cls, env, ENV_PREFIX)]
        if config_file:
            sources.append(from_yaml(cls, str(config_file)))
        return load(cls, *sources)


def flag_name(key: str) -> str:
    """The ``kvstore serve`` flag of setting ``key``: ``lease_ttl`` → ``--lease-ttl``."""
    return "--" + key.replace("_", "-")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen or metrics host) is reachable from this host only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def split_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → (host, port); ``ConfigError`` otherwise."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {listen!r} must be HOST:PORT with a port in [0, 65535]")
    if host.startswith("[") != host.endswith("]"):
        raise ConfigError(f"listen address {listen!r}: unbalanced brackets around the IPv6 host")
    return host, int(port)


__all__ = ["ENV_PREFIX", "STREAM_HEADROOM", "ServerConfig", "flag_name", "is_loopback", "split_listen"]
