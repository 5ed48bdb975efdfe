"""The connector's store: the core (``kvstore.store.TieredStore``) opened from its config.

Runs in the engine's scheduler process, on the connector's I/O loop.

Tiers, fastest first (``kvstore.store.registry`` specs): the host pool in shared memory
(``host:``, mapped by the workers), the SSD directory (``ssd_dir``), the host's store
process (``store_target``: ``kvstore://HOST:PORT``) and Redis (``redis_url``).  An
unreachable store process or Redis at start is a ``TierUnavailableError`` unless
``lower_tiers_required`` is false; then the tier is left out (logged and counted as
``<tier>:open``) and the engine runs without it.

The core's write-down (``kvstore.store.writedown``) takes committed saves down under
``write_policy``.  The scheduler thread offers them and never waits: when the write-through
queue is full a chunk is dropped (counted as ``lower:write_down_dropped``; it stays in host
memory).  ``ConnectorObserver`` turns the core's events into the connector's failure and
byte counters; a failing lower tier costs a counted failure, never the chunk in host memory.

Objects are authenticated (``kvstore.integrity``) when the connector itself writes a lower
tier it shares with others (``ssd_dir``, ``redis_url``): each save is sealed with the
engine's tenant key (``keys_file``, else ``KVSTORE_KEYS``, else the default deployment
file) and every object read from those tiers must verify, else it is a counted miss
(``<tier>:forged``) and is removed.  The store process verifies and seals for its clients.
With ``encrypt_at_rest`` the objects written to those tiers are also encrypted
(docs/integrity.md).
"""

from __future__ import annotations

from collections.abc import Callable

from connector.config import ConnectorConfig
from kvstore import integrity
from kvstore.store import registry
from kvstore.store.observer import StoreObserver
from kvstore.store.tiered import TieredStore
from tiers.base import PutResult, Tier

# The connector's keys that configure its lower tiers (and their integrity): the one
# vocabulary of the framework adapters (``adapters.vllm_tier``, ``adapters.sglang_hicache``,
# ``adapters.lmcache_l2``), each parsed by ``ConnectorConfig``.
LOWER_TIER_KEYS = frozenset(
    {
        "ssd_dir",
        "ssd_capacity",
        "lease_ttl",
        "redis_url",
        "store_target",
        "store_token",
        "store_token_file",
        "store_tls_ca",
        "store_tls_cert",
        "store_tls_key",
        "store_transport",
        "keys_file",
        "encrypt_at_rest",
        "lower_tiers_required",
    }
)


class ConnectorObserver(StoreObserver):
    """Core events as ``(tier, reason)`` failures and ``(tier, direction, bytes)``."""

    def __init__(self, on_bytes: Callable[[str, str, int], None], on_fail: Callable[[str, str], None]) -> None:
        self._on_bytes, self._on_fail = on_bytes, on_fail

    def tier_failed(self, tier: Tier, op: str, err: BaseException) -> None:
        self._on_fail(tier.name, f"{op}:{type(err).__name__}")

    def forged(self, tier: Tier, err: BaseException) -> None:
        self._on_fail(tier.name, "forged")

    def promote_no_room(self) -> None:
        self._on_fail("host", "promote:no_room")

    def written(self, tier: Tier, result: PutResult, size: int, err: BaseException | None) -> None:
        if err is not None:
            self._on_fail(tier.name, f"write:{type(err).__name__}")
        elif result is PutResult.STORED:
            self._on_bytes(tier.name, "write", size)
        elif result in (PutResult.NO_ROOM, PutResult.FAILED):
            down = tier.stats().extra.get("breaker_open", 0) == 1
            self._on_fail(tier.name, f"write:{'unavailable' if down else result.value}")

    def write_down_dropped(self) -> None:
        self._on_fail("lower", "write_down_dropped")


def tier_specs(cfg: ConnectorConfig) -> list[tuple[str, dict[str, object]]]:
    """The registry specs of the connector's tiers, host pool first."""
    store = (
        [
            (
                f"kvstore://{cfg.store_target}",
                {
                    "token": cfg.bearer_token(),
                    "tls_ca": cfg.store_tls_ca,
                    "tls_cert": cfg.store_tls_cert,
                    "tls_key": cfg.store_tls_key,
                    "transport": cfg.store_transport,
                    "lease_ttl_s": cfg.lease_ttl,
                },
            )
        ]
        if cfg.store_target
        else []
    )
    return registry.tier_specs(cfg, host={"shared": True, "pin": False}, lower=[*store, (cfg.redis_url, {})])


def lower_tier_specs(cfg: ConnectorConfig) -> list[tuple[str, dict[str, object]]]:
    """The connector's tiers below the host pool (SSD, store process, Redis), fastest first:
    what a store whose host tier is someone else's opens (``adapters.vllm_tier``, under
    vLLM's CPU primary tier)."""
    host, *lower = tier_specs(cfg)
    if not host[0].startswith("host:"):
        raise LookupError(f"the connector's first tier spec is {host[0]!r}, not the host pool")
    return lower


async def open_store(
    cfg: ConnectorConfig, on_bytes: Callable[[str, str, int], None], on_fail: Callable[[str, str], None]
) -> TieredStore:
    """The connector's store (on the I/O loop: the write-down binds to it)."""
    return await TieredStore.open(
        tier_specs(cfg),
        cfg.write_policy,
        required=cfg.lower_tiers_required,
        on_left_out=lambda kind, _err: on_fail(kind, "open"),
        observer=ConnectorObserver(on_bytes, on_fail),
        keys=keys_of(cfg),
    )


def keys_of(cfg: ConnectorConfig):
    """The MAC keys of the engine's own lower tiers (module docstring): a function of the
    key giving the engine's tenant's ``Keyring``, or None (no SSD directory nor Redis, or
    ``mac_objects`` off for a private SSD directory)."""
    if not cfg.mac_objects or (cfg.ssd_dir is None and not cfg.redis_url):
        return None
    ring = integrity.load_keys(cfg.keys_file).keyring().encrypting(cfg.encrypt_at_rest)
    return lambda _key: ring


__all__ = ["LOWER_TIER_KEYS", "ConnectorObserver", "keys_of", "lower_tier_specs", "open_store", "tier_specs"]
