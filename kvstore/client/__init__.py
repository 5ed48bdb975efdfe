"""The store process's client: ``StoreClient`` (control on gRPC; data through the shared
segment on the same host, the raw TCP data channel, or gRPC streams) and ``RemoteTier``,
the client as a tier."""
