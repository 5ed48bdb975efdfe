"""Thin adapters that make kvstore a tier of other serving frameworks.

Each runs inside its framework's own process and is a thin layer over the one store core
(``kvstore.store.TieredStore``), opened from the connector's tier vocabulary
(``connector.config``, ``connector.lower``, ``connector.identity``):

- ``adapters.vllm_tier``: a ``SecondaryTierManager`` under vLLM's CPU primary tier
  (docs/vllm-tier.md);
- ``adapters.sglang_hicache``: SGLang's HiCache storage backend (docs/sglang-hicache.md);
- ``adapters.lmcache_l2``: an L2 adapter of LMCache's multiprocess server (docs/lmcache-l2.md).

``adapters.lower`` is the host-less store the vLLM tier and the LMCache L2 share: the
connector's lower tiers on a private event loop; it imports no framework.

Nothing here is imported by ``kvstore``, ``tiers`` or ``connector``, and nothing here
imports the harness.
"""
