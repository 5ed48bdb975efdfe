"""The store process (``kvstore serve``): the gRPC servicer over the one store core, plus
what only a shared server needs: tenants and their tokens, leases and their reaper,
reservations for in-place puts, and its metrics."""
