"""Configuration of the store process (``kvstore serve``), server side.

``ServerConfig.from_sources(flags, env, file)`` merges four layers, highest first:

1. command-line flags (only those given: ``None`` means "not given");
2. ``KVSTORE_SERVE_<KEY>`` environment variables (``KVSTORE_SERVE_HOST_CAPACITY=8GiB``);
3. a YAML file (``--config`` or ``KVSTORE_SERVE_CONFIG``): a mapping of the same keys
   (``host_capacity`` or ``host-capacity``);
4. the defaults below.

Sizes go through ``kvstore.config.parse_size`` (``512MiB``, ``8GiB``, ``4096``).  Unknown keys,
unparsable or impossible values raise ``ConfigError`` naming the key and where it came from.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from kvstore.config import WritePolicy, parse_size
from kvstore.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ENV_PREFIX = "KVSTORE_SERVE_"
STREAM_HEADROOM = 64 * KiB  # a stream frame's protobuf framing stays well inside this


@dataclass(frozen=True, slots=True)
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    host_capacity: int = 1 * GiB
    ssd_dir: Path | None = None
    ssd_capacity: int = 16 * GiB
    redis: str | None = None                # URL of the Redis tier (lowest tier)
    auth_tokens: Path | None = None         # YAML tokens file; None: no auth (tenant "default")
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None       # require client certificates signed by this CA
    metrics_port: int | None = None         # Prometheus /metrics; 0 picks a free port
    metrics_host: str | None = None         # default: the host of ``listen``
    lease_ttl: float = 30.0                 # default lease TTL, seconds
    max_lease_ttl: float = 300.0            # longest lease a client may ask for
    put_ttl: float | None = None            # uncommitted PutStart lifetime; default lease_ttl
    ready_file: Path | None = None
    max_object_bytes: int = 256 * MiB
    max_keys_per_call: int = 4096
    max_message_bytes: int = 8 * MiB        # grpc receive limit (≥ frame_bytes + 64 KiB)
    frame_bytes: int = 1 * MiB              # GetStream frame size
    shutdown_grace: float = 10.0            # seconds in-flight calls get at SIGTERM
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH  # how committed puts reach the lower tiers

    def __post_init__(self) -> None:
        split_listen(self.listen)
        for name in ("host_capacity", "ssd_capacity", "max_object_bytes", "max_keys_per_call",
                     "max_message_bytes", "frame_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lease_ttl", "max_lease_ttl", "shutdown_grace"):
            if not 0 < getattr(self, name) < 1e7:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.put_ttl is not None and not 0 < self.put_ttl < 1e7:
            raise ConfigError(f"put_ttl must be a positive number of seconds, got {self.put_ttl}")
        if self.write_policy is WritePolicy.WRITE_BACK:
            raise ConfigError("write_policy write_back: the store process writes through or not at all "
                              "(write_through or host_only)")
        if self.max_lease_ttl < self.lease_ttl:
            raise ConfigError(f"max_lease_ttl ({self.max_lease_ttl}) is below lease_ttl ({self.lease_ttl})")
        if self.max_object_bytes < 256:
            raise ConfigError(f"max_object_bytes must hold at least a 256-byte header, got {self.max_object_bytes}")
        if self.frame_bytes < 4 * KiB:
            raise ConfigError(f"frame_bytes must be at least 4 KiB, got {self.frame_bytes}")
        if self.max_message_bytes < self.frame_bytes + STREAM_HEADROOM:
            raise ConfigError(f"max_message_bytes ({self.max_message_bytes}) must be at least "
                              f"frame_bytes + 64 KiB ({self.frame_bytes + STREAM_HEADROOM})")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must lie in [0, 65535], got {self.metrics_port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca needs tls_cert and tls_key (client certificates need TLS)")

    @property
    def put_ttl_s(self) -> float:
        return self.lease_ttl if self.put_ttl is None else self.put_ttl

    @property
    def listen_host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @classmethod
    def from_sources(cls, flags: Mapping[str, object] | None = None,
                     env: Mapping[str, str] | None = None,
                     config_file: str | Path | None = None) -> "ServerConfig":
        """Merge flags > environment > YAML file > defaults (see the module docstring)."""
        env = os.environ if env is None else env
        flags = {k: v for k, v in (flags or {}).items() if v is not None}
        config_file = flags.pop("config", None) or config_file or env.get(ENV_PREFIX + "CONFIG")
        merged: dict[str, tuple[object, str]] = {}
        if config_file:
            for key, value in _read_yaml(Path(str(config_file))).items():
                merged[key] = (value, f"{config_file}: {key}")
        for name in _FIELD_NAMES:
            var = ENV_PREFIX + name.upper()
            if var in env:
                merged[name] = (env[var], var)
        for key, value in flags.items():
            _check_known(key, "command line")
            merged[key] = (value, "--" + key.replace("_", "-"))
        return cls(**{k: _convert(k, v, where) for k, (v, where) in merged.items()})


_FIELD_NAMES = tuple(f.name for f in fields(ServerConfig))
_SIZES = {"host_capacity", "ssd_capacity", "max_object_bytes", "max_message_bytes", "frame_bytes"}
_PATHS = {"ssd_dir", "auth_tokens", "tls_cert", "tls_key", "tls_client_ca", "ready_file"}
_FLOATS = {"lease_ttl", "max_lease_ttl", "put_ttl", "shutdown_grace"}
_INTS = {"metrics_port", "max_keys_per_call"}
_STRINGS = {"listen", "redis", "metrics_host"}
_POLICIES = {"write_policy"}
assert set(_FIELD_NAMES) == _SIZES | _PATHS | _FLOATS | _INTS | _STRINGS | _POLICIES


def _check_known(key: str, where: str) -> None:
    if key not in _FIELD_NAMES:
        raise ConfigError(f"{where}: unknown key {key!r}; known: {', '.join(_FIELD_NAMES)}")


def _read_yaml(path: Path) -> dict[str, object]:
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError as err:
        raise ConfigError(f"config file {path} does not exist") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} is not readable: {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, got {type(doc).__name__}")
    out = {}
    for key, value in doc.items():
        name = str(key).replace("-", "_")
        _check_known(name, f"config file {path}")
        out[name] = value
    return out


def _convert(key: str, value: object, where: str) -> object:
    """The typed value of one setting; ``ConfigError`` naming ``where`` otherwise."""
    if key in _SIZES:
        return parse_size(value, where)  # type: ignore[arg-type]
    if key in _PATHS:
        return None if value in (None, "") else Path(str(value))
    if key in _STRINGS:
        if value in (None, "") and key != "listen":
            return None
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if key in _POLICIES:
        try:
            return value if isinstance(value, WritePolicy) else WritePolicy(str(value))
        except ValueError as err:
            raise ConfigError(f"{where}: {value!r} is not one of "
                              f"{', '.join(p.value for p in WritePolicy)}") from err
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        if key in _INTS:
            return value if isinstance(value, int) else int(str(value), 10)
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        kind = "an integer" if key in _INTS else "a number of seconds"
        raise ConfigError(f"{where}: expected {kind}, got {value!r}") from err


def split_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → (host, port); ``ConfigError`` otherwise."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {listen!r} must be HOST:PORT with a port in [0, 65535]")
    if host.startswith("[") != host.endswith("]"):
        raise ConfigError(f"listen address {listen!r}: unbalanced brackets around the IPv6 host")
    return host, int(port)


__all__ = ["ENV_PREFIX", "STREAM_HEADROOM", "ServerConfig", "split_listen"]
