"""The ``Stats`` document's flat counters (``StatsResponse.counters``).  Server side, pure.

Two shapes: the whole document (``flat_counters``, for a token with ``admin``) and one
tenant's part (``flat_tenant``, what every other token sees: its own pool, SSD partition,
quotas, holdings and refusals, never another tenant's).
"""

from __future__ import annotations


def flat_tenant(doc: dict) -> dict[str, float]:
    """The flat counters of one tenant's document: ``leases_held``, ``puts_in_flight``,
    ``host.bytes_used`` (its pool), ``ssd.objects`` (its partition), ``quota.leases``,
    ``held.streams``, ``refused.leases``..."""
    out: dict[str, float] = {"leases_held": doc["held"]["leases"], "puts_in_flight": doc["puts_in_flight"]}
    for name, stats in doc["tiers"].items():
        _walk(out, name, stats)
    for part in ("quota", "held", "refused"):
        _walk(out, part, doc[part])
    return out


def _walk(out: dict[str, float], prefix: str, value: object) -> None:
    if isinstance(value, (bool, int, float)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(out, f"{prefix}.{k}" if prefix else str(k), v)


def flat_counters(doc: dict) -> dict[str, float]:
    """Numeric leaves of the stats document as ``dotted.names`` (``leases_held``,
    ``puts_in_flight``, ``host.bytes_used``, ``store.lookup_hits.ssd``, ...)."""
    out: dict[str, float] = {
        "leases_held": doc["leases"]["held"],
        "leases_expired": doc["leases"]["expired"],
        "puts_in_flight": doc["puts_in_flight"],
        "puts_fenced": doc["puts_fenced"],
        "data_tickets_refused": doc["data_tickets"]["refused"],
        "write_throughs_in_flight": doc["write_throughs_in_flight"],
    }

    for name, stats in doc["tiers"].items():
        _walk(out, name, stats)
    _walk(out, "store", doc["store"])
    return out


def dumpable() -> bool | None:
    """Whether other processes of our uid may ptrace us or open our ``/proc/<pid>/fd``
    (``prctl(PR_GET_DUMPABLE)``; None where it cannot be asked)."""
    import ctypes
    import ctypes.util

    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(3, 0, 0, 0, 0))
    except (OSError, AttributeError):
        return None


__all__ = ["dumpable", "flat_counters", "flat_tenant"]
