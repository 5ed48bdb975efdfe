"""Connector configuration: vLLM's ``kv_connector_extra_config`` plus ``KVSTORE_*`` env vars.

Keys (each also read from ``KVSTORE_<KEY>`` when absent from the mapping):

  host_capacity   bytes or "512MiB"; the host DRAM pool (shared by scheduler and worker)
  ssd_dir         a directory for the SSD tier; "" or absent = no SSD tier
  ssd_capacity    bytes or "16GiB"
  chunk_size      tokens per chunk object; a multiple of the engine block size
  device          auto | host | cuda | emulated-cuda: the copy engine on the worker.
                  emulated-cuda gives CUDA's side-stream semantics on the CPU (writes land
                  later, nothing calls back); options emulated-cuda:delay=S,fail_every=N.
                  Tests also use faulty:fail_every=N,delay=S to inject copy failures
  verify_loads    true/false: checksum every object before it reaches the engine
  prefill_tokens_per_s  seed of the cost model's recompute rate (refined online)
  load_timeout_s  how long a layer waits for its load before the load counts as failed
  stats_path      a JSON file the scheduler keeps updated with hit rates and bytes
  lease_ttl       seconds a lease protects an object chosen for loading
  redis_url       a Redis (or Redis Cluster) tier below host DRAM: redis://, rediss://,
                  redis+cluster://...; tier options as URL query parameters (key_prefix,
                  ttl_s, part_size, tls_ca, ...; see tiers/redis_config.py); "" = none
  store_target    HOST:PORT of a `kvstore serve` store process shared by the engines on a
                  host (a tier below host DRAM); "" = none
  store_token     bearer token for the store process (its tenant and permissions)
  store_tls_ca    CA certificate file when the store process serves TLS
  store_transport auto | shm | stream: how bytes move to and from the store process
  write_policy    write_through (lower tiers get each chunk when it is saved),
                  write_back (chunks stay in host DRAM only and go down in LRU order when
                  unflushed chunks exceed half the pool, and at shutdown) or host_only
                  (lower tiers are read and promoted from, never written)
  lower_tiers_required  true/false: whether an unreachable Redis or store process at engine
                  start is an error (true) or starts the tier as down (false: misses and a
                  background retry, see the circuit breaker)

Unknown keys, impossible sizes and unwritable directories fail at engine start with a
``ConfigError`` naming the key.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from connector.device import check_device_spec
from kvstore.config import StoreConfig, WritePolicy, merge_settings, parse_size
from kvstore.errors import ConfigError
from kvstore.layout import validate_chunk_size

_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
TRANSPORTS = ("auto", "shm", "stream")
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    host_capacity: int = 1 << 30
    ssd_dir: Path | None = None
    ssd_capacity: int = 16 << 30
    chunk_size: int = 256
    device: str = "auto"
    verify_loads: bool = True
    prefill_tokens_per_s: float = 5000.0
    load_timeout_s: float = 30.0
    stats_path: Path | None = None
    lease_ttl: float = 60.0
    redis_url: str = ""
    store_target: str = ""
    store_token: str = ""
    store_tls_ca: Path | None = None
    store_transport: str = "auto"
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    lower_tiers_required: bool = True

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        for name in ("prefill_tokens_per_s", "load_timeout_s", "lease_ttl"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        validate_chunk_size(self.chunk_size, 1)
        if self.store_transport not in TRANSPORTS:
            raise ConfigError(f"store_transport: {self.store_transport!r} is not one of {', '.join(TRANSPORTS)}")
        if not isinstance(self.write_policy, WritePolicy):
            raise ConfigError(f"write_policy: {self.write_policy!r} is not a WritePolicy")
        if self.store_target and not _HOSTPORT.match(self.store_target):
            raise ConfigError(f"store_target: expected HOST:PORT, got {self.store_target!r}")

    @property
    def has_lower_tiers(self) -> bool:
        return bool(self.ssd_dir or self.redis_url or self.store_target)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None,
                          env: Mapping[str, str] | None = None) -> "ConnectorConfig":
        merged = merge_settings(cls, dict(extra or {}), env, "kv_connector_extra_config")
        return cls(**{k: _convert(k, v) for k, v in merged.items()})

    def check_block_size(self, block_size: int) -> None:
        """The chunk must cover whole engine blocks."""
        validate_chunk_size(self.chunk_size, block_size)

    def store_config(self) -> StoreConfig:
        return StoreConfig(host_capacity=self.host_capacity, ssd_dir=self.ssd_dir,
                           ssd_capacity=self.ssd_capacity, chunk_size=self.chunk_size,
                           lease_ttl=self.lease_ttl)


def _write_policy(value: object) -> WritePolicy:
    try:
        return value if isinstance(value, WritePolicy) else WritePolicy(str(value))
    except ValueError as err:
        choices = ", ".join(p.value for p in WritePolicy)
        raise ConfigError(f"write_policy: {value!r} is not one of {choices}") from err


def _convert(key: str, value: object) -> object:
    try:
        if key in ("host_capacity", "ssd_capacity"):
            return parse_size(value, key)  # type: ignore[arg-type]
        if key in ("ssd_dir", "stats_path", "store_tls_ca"):
            return None if value in (None, "") else Path(str(value))
        if key == "chunk_size":
            return value if isinstance(value, int) and not isinstance(value, bool) else int(str(value), 10)
        if key in ("verify_loads", "lower_tiers_required"):
            return value if isinstance(value, bool) else _BOOL[str(value).lower()]
        if key in ("prefill_tokens_per_s", "load_timeout_s", "lease_ttl"):
            return float(value)  # type: ignore[arg-type]
        if key == "write_policy":
            return _write_policy(value)
        return str(value)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"kv_connector_extra_config: bad value {value!r} for {key}") from err
