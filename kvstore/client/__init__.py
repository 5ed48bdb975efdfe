"""The store process's client: ``StoreClient`` (control on gRPC; data through the shared
segment on the same host, or streamed), and ``RemoteTier``, the client as a ``Tier``."""
