"""The tier's parameters (its dict in vLLM's ``secondary_tiers``) and its key namespace.

Runs in vLLM's scheduler process, once when the tier is built.

The parameters are the connector's own keys for its lower tiers (``ssd_dir``,
``store_target``, ``store_token_file``, ``redis_url``, ...), parsed by the connector's typed
config (``connector.config.ConnectorConfig``: same names, types, ``KVSTORE_<KEY>`` variables
and errors), plus ``scope`` (the sharing scope: a tenant or salt; "" shares with every
engine of the same model) and ``locality`` (vLLM's own: ``LOCAL`` or ``REMOTE``).  The
connector's other keys have no meaning under vLLM's CPU primary tier and are refused by name:
``host_capacity`` first (vLLM's ``cpu_bytes_to_use`` is the host tier here).

The namespace (``kvstore.keys.Identity``) is the model's identity as the connector computes
it from the model name (``connector.identity.weights_identity``: hub commit and a digest of
the weight files), the KV dtype, and the byte geometry vLLM's offloading config gives (bytes
per block and chunk, blocks per chunk, tokens per block and hash, layer names per group,
parallel sizes, layout), plus ``scope``.  Two managers of the same model and geometry share
objects; different models never do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from connector.config import ConnectorConfig
from connector.identity import weights_identity
from connector.lower import LOWER_TIER_KEYS
from kvstore.errors import ConfigError
from kvstore.keys import ChunkHash, Identity, Namespace, ObjectKey

# Connector keys that mean nothing under vLLM's CPU primary tier, and why.
_REFUSED = {
    "host_capacity": "vLLM's CPU primary tier is the host tier here: size it with vLLM's cpu_bytes_to_use",
    "write_policy": "every chunk vLLM cascades is written through to each tier",
    "chunk_size": "vLLM's block_size and blocks per chunk decide the chunk",
    "device": "vLLM's own workers copy between GPU and the CPU primary tier",
}
# The connector's keys for its lower tiers: the tier's vocabulary.
LOWER_KEYS = LOWER_TIER_KEYS
_OWN = ("scope", "locality")
_DOMAIN = b"kvstore/vllm-tier/v1\x00"
LAYOUT_ID = "vllm-offload"


@dataclass(frozen=True)
class TierParams:
    """The parsed parameters: the connector's config, the sharing scope and vLLM's locality."""

    store: ConnectorConfig
    scope: str = ""
    locality: str | None = None


def parse_params(params: Mapping[str, Any], env: Mapping[str, str] | None = None) -> TierParams:
    """``params`` (vLLM's tier dict without ``type``/``module_path``) checked and parsed;
    ``ConfigError`` naming the key when one is refused, unknown or impossible."""
    connector_keys = {f.name for f in fields(ConnectorConfig)}
    for key in params:
        name = str(key).replace("-", "_")
        if name in _REFUSED:
            raise ConfigError(f"secondary_tiers: {name} is not a parameter of the kvstore tier: {_REFUSED[name]}")
        if name in connector_keys and name not in LOWER_KEYS:
            raise ConfigError(
                f"secondary_tiers: {name} is a setting of the kvstore connector, not of its vLLM "
                f"tier (whose parameters are the lower tiers' keys: {', '.join(sorted(LOWER_KEYS))})"
            )
    scope = params.get("scope", "")
    if not isinstance(scope, str):
        raise ConfigError(f"secondary_tiers: scope must be a string, got {scope!r}")
    store = ConnectorConfig.from_extra_config({k: v for k, v in params.items() if k not in _OWN}, env)
    if not store.has_lower_tiers:
        raise ConfigError("secondary_tiers: the kvstore tier needs at least one of ssd_dir, store_target or redis_url")
    locality = params.get("locality")
    if locality not in (None, "LOCAL", "REMOTE"):
        raise ConfigError(f"secondary_tiers: locality must be LOCAL or REMOTE, got {locality!r}")
    return TierParams(store, scope, locality)


def geometry_of(config: Any, block_bytes: int) -> dict[str, object]:
    """What fixes the bytes of one chunk in vLLM's ``OffloadingConfig`` (plus the primary
    tier's row size), as plain JSON values."""
    par = config.parallel
    return {
        "block_bytes": block_bytes,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "groups": [[g.group_id, g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "parallel": [par.world_size, par.tp_size, par.pp_size, par.pcp_size, par.dcp_size],
        "replicated_layout": bool(config.replicated_layout),
        "canonical_layout": bool(config.canonical_layout),
        "kv_cache_layout": config.kv_cache_layout,
    }


def namespace_of(config: Any, block_bytes: int, scope: str) -> Namespace:
    """The tier's namespace for vLLM's ``OffloadingConfig`` ``config`` (module docstring)."""
    revision, weights = weights_identity(config.model.name)
    geometry = geometry_of(config, block_bytes)
    layers = sum(len(g.layer_names) for g in config.groups)
    identity = Identity(
        model=config.model.name,
        revision=revision,
        kv_dtype=config.model.dtype or "auto",
        layout_id=LAYOUT_ID,
        num_layers=max(layers, 1),
        num_kv_heads=1,
        head_dim=1,
        tp_size=max(config.parallel.tp_size, 1),
        pp_size=max(config.parallel.pp_size, 1),
        scope=scope,
        weights=weights,
        engine_config=hashlib.sha256(json.dumps(geometry, sort_keys=True).encode()).hexdigest()[:32],
    )
    return identity.namespace()


def object_key(namespace: Namespace, offload_key: bytes) -> ObjectKey:
    """The object key of one of vLLM's offload keys (block hash and KV group) in ``namespace``."""
    return ObjectKey(namespace, ChunkHash(hashlib.sha256(_DOMAIN + bytes(offload_key)).digest()))


__all__ = ["LAYOUT_ID", "LOWER_KEYS", "TierParams", "geometry_of", "namespace_of", "object_key", "parse_params"]
