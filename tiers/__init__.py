"""Storage tiers behind one interface (``tiers.base.Tier``): host DRAM, SSD, and Redis or
Redis Cluster (the store process's tier is its client, ``kvstore.client.tier.RemoteTier``).
Backends are imported lazily by name (``kvstore.store.registry``)."""
