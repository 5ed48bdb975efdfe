"""kvstore as an L2 of LMCache's multiprocess server (LMCache 0.5.6's ``L2AdapterInterface``).

Runs inside LMCache's server process (``lmcache.v1.multiprocess.server``), which loads
``adapters.lmcache_l2.adapter.KVStoreL2Adapter`` through its own ``plugin`` L2 adapter type
(docs/lmcache-l2.md).  ``names`` maps LMCache's object keys into kvstore namespaces,
``settings`` parses the adapter's parameters, ``adapters.lower`` writes and reads the objects through
kvstore's lower tiers (the store process, and through it Redis and its SSD); only ``adapter``
imports LMCache, so this package imports without it.
"""
