"""The L2 adapter's settings, from the ``adapter_params`` of LMCache's ``plugin`` L2 adapter JSON.

Runs in LMCache's server process, once per adapter.  The parameters are one JSON object:

* ``scope`` and ``max_capacity_gb`` are the adapter's own: the tenant scope in every
  object's namespace (adapters of different scopes never see each other's objects) and the
  capacity LMCache's L2 eviction may plan with (0, the default: none declared, so LMCache
  runs no aggregate eviction and the store's own eviction governs);
* every other key is one of the connector's tier keys (``TIER_KEYS``: ``store_target``,
  ``store_token_file``, ``redis_url``, ``ssd_dir``, ``keys_file``...), parsed by the
  connector's typed config (``connector.config.ConnectorConfig``), so a user learns one
  vocabulary.  Keys of the connector's engine side, of its host pool, and unknown keys are
  refused by name, as is a config without a tier (LMCache's L1 already is host memory).

Errors are ``ConfigError`` (a ``ValueError``, what LMCache's config parsing expects), each
naming ``adapter_params`` and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from connector.config import ConnectorConfig
from connector.lower import LOWER_TIER_KEYS
from kvstore.config import given, load
from kvstore.errors import ConfigError

OWN_KEYS = frozenset({"scope", "max_capacity_gb"})
TIER_KEYS = LOWER_TIER_KEYS
WHERE = "adapter_params"


@dataclass(frozen=True, slots=True)
class L2Settings:
    """``tiers``: the tiers below LMCache's L1 (the connector's typed config); ``scope``: the
    tenant scope in every namespace ("" = none); ``max_capacity_bytes``: 0 = none declared."""

    tiers: ConnectorConfig
    scope: str = ""
    max_capacity_bytes: int = 0


def parse_settings(params: Mapping[str, object] | None) -> L2Settings:
    """The settings in ``params`` (see the module docstring); ``ConfigError`` naming the key."""
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"{WHERE} must be a JSON object, got {type(params).__name__}")
    params = {str(k).replace("-", "_"): v for k, v in (params or {}).items()}
    _refuse_foreign(params)
    scope = params.pop("scope", "")
    if not isinstance(scope, str):
        raise ConfigError(f"{WHERE}: scope must be a string, got {scope!r}")
    capacity = params.pop("max_capacity_gb", 0)
    if isinstance(capacity, bool) or not isinstance(capacity, int | float) or not 0 <= capacity < 1e6:
        raise ConfigError(f"{WHERE}: max_capacity_gb must be a number of GiB >= 0, got {capacity!r}")
    tiers = load(ConnectorConfig, given(ConnectorConfig, params, WHERE))
    if not tiers.has_lower_tiers:
        raise ConfigError(
            f"{WHERE}: the kvstore L2 adapter needs a tier: store_target (kvstore serve), redis_url or "
            "ssd_dir; LMCache's L1 already is host memory"
        )
    return L2Settings(tiers, scope, int(capacity * (1 << 30)))


def _refuse_foreign(params: Mapping[str, object]) -> None:
    known = {f.name for f in fields(ConnectorConfig)}
    ours = sorted(TIER_KEYS | OWN_KEYS)
    engine_only = sorted(k for k in params if k in known - TIER_KEYS)
    if engine_only:
        raise ConfigError(
            f"{WHERE}: {', '.join(map(repr, engine_only))} configure the vLLM connector or its host pool, "
            f"not the LMCache L2 adapter; its keys: {', '.join(ours)}"
        )
    unknown = sorted(k for k in params if k not in known | OWN_KEYS)
    if unknown:
        raise ConfigError(
            f"{WHERE}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"the kvstore L2 adapter's keys: {', '.join(ours)}"
        )


__all__ = ["OWN_KEYS", "TIER_KEYS", "WHERE", "L2Settings", "parse_settings"]
