"""Storage tiers behind one interface (``tiers.base.Tier``): host DRAM, SSD, and later
Redis and the remote store process.  Backends are imported lazily by name."""
