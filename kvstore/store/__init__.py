"""The one store core: ``TieredStore`` over the tiers, fastest first, used by the embedded
store, the store process and the connector alike."""
