"""Generated gRPC code for ``proto/kvstore/v1/kvstore.proto`` (``make proto`` regenerates it)."""
