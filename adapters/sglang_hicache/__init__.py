"""kvstore as SGLang's HiCache storage (its L3), runs in SGLang's scheduler processes.

``adapters.sglang_hicache.backend.KVStoreHiCache`` is the ``HiCacheStorage`` SGLang loads
through its ``dynamic`` backend (docs/sglang-hicache.md); ``settings`` parses its extra
config and ``names`` turns SGLang's page keys into kvstore object keys.  Only ``backend``
imports SGLang."""
