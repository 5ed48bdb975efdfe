"""The one store core: ``TieredStore`` over the tiers, fastest first, used by the embedded
store, the store process and the connector alike.

Modules: ``tiered`` (the store), ``lookup`` (sized contiguous lookups), ``promote``
(single-flight promotion into the host pool), ``writedown`` (write-through / write-back with
bounded concurrency and a bounded queue), ``registry`` (tiers opened from a spec), ``events``
(counters and the observer hooks)."""
