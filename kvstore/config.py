"""Configuration of the embedded store: sizes, directories, chunking, write policy.

A ``StoreConfig`` comes from keyword values, a mapping (e.g. vLLM's
``kv_connector_extra_config``) or ``KVSTORE_*`` environment variables; unknown keys and
impossible values raise ``ConfigError`` with a message naming the key.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.layout import validate_chunk_size

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a string such as ``512MiB``, ``8GiB``, ``1.5GB`` or ``4096``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"{what}: cannot parse size {value!r} (examples: 4096, 512MiB, 8GiB)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return n


def merge_settings(cls: type, values: Mapping[str, object], env: Mapping[str, str] | None,
                   where: str) -> dict[str, object]:
    """The fields of dataclass ``cls`` given in ``values``, else in ``KVSTORE_<KEY>``
    environment variables; unknown keys raise ``ConfigError`` naming them and the known ones."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    env = os.environ if env is None else env
    merged: dict[str, object] = {k: env[f"KVSTORE_{k.upper()}"] for k in known if f"KVSTORE_{k.upper()}" in env}
    merged.update(values)
    return merged


class WritePolicy(Enum):
    """How objects published in host DRAM reach the lower tiers (one vocabulary for the
    embedded store, the store process and the connector)."""

    WRITE_THROUGH = "write_through"  # each committed object is copied to every lower tier
    WRITE_BACK = "write_back"        # kept in host DRAM (never evicted unwritten), written later
    HOST_ONLY = "host_only"          # lower tiers are read (and promoted from), never written


@dataclass(frozen=True, slots=True)
class StoreConfig:
    host_capacity: int = 1 << 30
    ssd_dir: Path | None = None
    ssd_capacity: int = 16 << 30
    chunk_size: int = 256
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    lease_ttl: float = 30.0

    def __post_init__(self) -> None:
        if self.host_capacity <= 0 or self.ssd_capacity <= 0:
            raise ConfigError("host_capacity and ssd_capacity must be positive")
        validate_chunk_size(self.chunk_size, 1)
        if self.lease_ttl <= 0:
            raise ConfigError(f"lease_ttl must be positive, got {self.lease_ttl}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], env: Mapping[str, str] | None = None) -> "StoreConfig":
        """Build from a mapping; ``KVSTORE_<KEY>`` environment variables fill missing keys."""
        merged = merge_settings(cls, values, env, "config")
        return cls(**{k: _convert(k, v) for k, v in merged.items()})

    def with_(self, **changes: object) -> "StoreConfig":
        return replace(self, **changes)


def _convert(key: str, value: object) -> object:
    if key in ("host_capacity", "ssd_capacity"):
        return parse_size(value, key)  # type: ignore[arg-type]
    if key == "ssd_dir":
        return None if value in (None, "") else Path(str(value))
    if key == "chunk_size":
        return _int(key, value)
    if key == "lease_ttl":
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:
            raise ConfigError(f"lease_ttl: expected seconds, got {value!r}") from err
    if key == "write_policy":
        try:
            return value if isinstance(value, WritePolicy) else WritePolicy(str(value))
        except ValueError as err:
            choices = ", ".join(p.value for p in WritePolicy)
            raise ConfigError(f"write_policy: {value!r} is not one of {choices}") from err
    raise AssertionError(key)


def _int(key: str, value: object) -> int:
    try:
        return int(str(value), 10) if not isinstance(value, int) else value
    except ValueError as err:
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from err
