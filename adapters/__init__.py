"""Thin adapters that plug kvstore into engines other than through its vLLM connector.

Each runs inside its framework's own process and is a thin layer over the one store core
(``kvstore.store.TieredStore``), opened from the connector's tier vocabulary
(``connector.config`` and ``connector.lower``): ``adapters.sglang_hicache`` is SGLang's
HiCache storage backend (docs/sglang-hicache.md).  Nothing here is imported by ``kvstore``,
``tiers`` or ``connector``."""
