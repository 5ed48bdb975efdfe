"""The HiCache backend's settings, from SGLang's ``--hicache-storage-backend-extra-config`` JSON.

Runs in SGLang's scheduler process, once per backend (one per TP/PP rank).  The extra
config is one JSON object for SGLang and for us:

* SGLang's own keys are left to SGLang (``SGLANG_KEYS``: ``backend_name``, ``module_path``,
  ``class_name`` of its ``dynamic`` backend, ``interface_v1``, ``prefetch_threshold``...);
* ``scope`` and ``model`` are this backend's: the tenant scope of its pages (backends of
  different scopes never see each other's pages) and the model name when SGLang gives none;
* every other key is one of the connector's tier keys (``TIER_KEYS``: ``ssd_dir``,
  ``store_target``, ``store_token_file``, ``redis_url``, ``host_capacity``...), parsed by the
  connector's own typed config (``connector.config.ConnectorConfig``, ``KVSTORE_<KEY>``
  variables under it), so a user learns one vocabulary.  The connector's engine-side keys
  (``chunk_size``, ``device``...) mean nothing here and are refused by name, as is a config
  without a tier below host memory (SGLang's host pool already is one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from connector.config import ConnectorConfig
from connector.lower import LOWER_TIER_KEYS
from kvstore.config import from_env, given, load
from kvstore.errors import ConfigError

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
OWN_KEYS = frozenset({"scope", "model"})
# SGLang's host pool sits above ours, so the host pool's keys are tier keys here too.
TIER_KEYS = LOWER_TIER_KEYS | {"host_capacity", "write_policy"}
WHERE = "hicache_storage_backend_extra_config"


@dataclass(frozen=True, slots=True)
class HiCacheSettings:
    """``tiers``: the store's tiers (the connector's typed config); ``scope``: the tenant scope
    in every page's namespace ("" = none); ``model``: the model name given here ("" = SGLang's)."""

    tiers: ConnectorConfig
    scope: str = ""
    model: str = ""


def parse_settings(extra: Mapping[str, object] | None, env: Mapping[str, str] | None = None) -> HiCacheSettings:
    """The settings in SGLang's extra config (see the module docstring); ``ConfigError``
    naming the key for anything else."""
    extra = dict(extra or {})
    known = {f.name for f in fields(ConnectorConfig)}
    engine_only = sorted(k for k in extra if k.replace("-", "_") in known - TIER_KEYS)
    if engine_only:
        raise ConfigError(
            f"{WHERE}: {', '.join(map(repr, engine_only))} configure the vLLM connector's engine "
            f"side, not the HiCache backend; its keys: {', '.join(sorted(TIER_KEYS | OWN_KEYS))}"
        )
    unknown = sorted(k for k in extra if k.replace("-", "_") not in known | OWN_KEYS | SGLANG_KEYS)
    if unknown:
        raise ConfigError(
            f"{WHERE}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"the kvstore backend's keys: {', '.join(sorted(TIER_KEYS | OWN_KEYS))}"
        )
    own = {k: extra.pop(k) for k in list(extra) if k in OWN_KEYS}
    for key, value in own.items():
        if not isinstance(value, str):
            raise ConfigError(f"{WHERE}: {key} must be a string, got {value!r}")
    tier_values = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
    tiers = load(
        ConnectorConfig, given(ConnectorConfig, tier_values, WHERE), from_env(ConnectorConfig, env, "KVSTORE_")
    )
    if not tiers.has_lower_tiers:
        raise ConfigError(
            f"{WHERE}: the kvstore HiCache backend needs a tier below host memory "
            "(ssd_dir, store_target or redis_url); SGLang's host pool already is one"
        )
    return HiCacheSettings(tiers, str(own.get("scope", "")), str(own.get("model", "")))


__all__ = ["OWN_KEYS", "SGLANG_KEYS", "TIER_KEYS", "HiCacheSettings", "parse_settings"]
