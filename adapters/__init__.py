"""Thin adapters that make kvstore a tier of other serving frameworks.

Each runs inside its framework's own process and is a thin layer over the one store core
(``kvstore.store.TieredStore``), opened from the connector's tier vocabulary
(``connector.config``, ``connector.lower``, ``connector.identity``):

- ``adapters.vllm_tier``: a ``SecondaryTierManager`` under vLLM's CPU primary tier
  (docs/vllm-tier.md);
- ``adapters.sglang_hicache``: SGLang's HiCache storage backend (docs/sglang-hicache.md).

Nothing here is imported by ``kvstore``, ``tiers`` or ``connector``, and nothing here
imports the harness.
"""
