"""Connector configuration: vLLM's ``kv_connector_extra_config`` plus ``KVSTORE_*`` env vars.

Keys (each also read from ``KVSTORE_<KEY>`` when absent from the mapping):

  host_capacity   bytes or "512MiB"; the host DRAM pool (shared by scheduler and worker)
  ssd_dir         a directory for the SSD tier; "" or absent = no SSD tier
  ssd_capacity    bytes or "16GiB"
  chunk_size      tokens per chunk object; a multiple of the engine block size
  device          auto | host | cuda: the copy engine on the worker (tests also use
                  faulty:fail_every=N,delay=S to inject copy failures)
  verify_loads    true/false: checksum every object before it reaches the engine
  prefill_tokens_per_s  seed of the cost model's recompute rate (refined online)
  load_timeout_s  how long a layer waits for its load before the load counts as failed
  stats_path      a JSON file the scheduler keeps updated with hit rates and bytes
  lease_ttl       seconds a lease protects an object chosen for loading

Unknown keys, impossible sizes and unwritable directories fail at engine start with a
``ConfigError`` naming the key.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import StoreConfig, merge_settings, parse_size
from kvstore.errors import ConfigError
from kvstore.layout import validate_chunk_size

_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
DEVICES = ("auto", "host", "cuda")


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

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not self.device.startswith("faulty:"):
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        for name in ("prefill_tokens_per_s", "load_timeout_s", "lease_ttl"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        validate_chunk_size(self.chunk_size, 1)

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


def _convert(key: str, value: object) -> object:
    try:
        if key in ("host_capacity", "ssd_capacity"):
            return parse_size(value, key)  # type: ignore[arg-type]
        if key in ("ssd_dir", "stats_path"):
            return None if value in (None, "") else Path(str(value))
        if key == "chunk_size":
            return value if isinstance(value, int) and not isinstance(value, bool) else int(str(value), 10)
        if key == "verify_loads":
            return value if isinstance(value, bool) else _BOOL[str(value).lower()]
        if key in ("prefill_tokens_per_s", "load_timeout_s", "lease_ttl"):
            return float(value)  # type: ignore[arg-type]
        return str(value)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"kv_connector_extra_config: bad value {value!r} for {key}") from err
