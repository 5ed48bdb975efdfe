"""kvstore as a secondary tier of vLLM's native offloading (``OffloadingConnector`` with
``TieringOffloadingSpec``): ``KVStoreSecondaryTier`` runs in vLLM's scheduler process, under
vLLM's CPU primary tier (docs/vllm-tier.md).
"""

from adapters.vllm_tier.manager import KVStoreSecondaryTier

__all__ = ["KVStoreSecondaryTier"]
