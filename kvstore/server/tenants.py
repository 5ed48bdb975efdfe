"""Tenants of the store process: their quotas, what each holds now, and what was refused.
Server side, event loop only (the data channel's threads reach it through the loop).

* **Quotas** come from the tokens file's ``tenants`` section (``parse_limits``)::

      tenants:
        team-a: {host_bytes: 512MiB, ssd_bytes: 8GiB, reservations: 32, leases: 2048,
                 streams: 16, connections: 32}

  Every key is optional.  ``host_bytes`` is the tenant's own host pool (a memfd of that
  size: its limit *and* its guaranteed share, since no other tenant can evict from it) and
  ``ssd_bytes`` its SSD partition (the same).  A tenant without them gets an equal share of
  what the others leave of ``host_capacity`` / ``ssd_capacity`` (``Tenants.plan``).  The
  counts cap what a tenant holds at once: ``reservations`` (``PutStart`` reservations not
  yet committed, including expired ones still fenced), ``leases`` (leases held),
  ``streams`` (``GetStream``/``PutStream`` calls and data-channel requests in flight) and
  ``connections`` (data-channel connections and shared-memory sessions open) and
  ``tickets`` (``OpenData`` tickets minted and not yet redeemed or expired).
  ``described_bytes`` and ``described`` cap the ``Describe`` descriptions (for KV events)
  the tenant's objects hold, in bytes and in entries (counted by
  ``kvstore.store.kvevents.EventRecorder``; refusals as ``described_bytes`` / ``described``).
  ``redis_bytes`` is the tenant's byte budget in a shared Redis (kept by the writers,
  ``tiers.redis_budget``; needs a ``--redis`` URL with ``{tenant}``: docs/redis-tenants.md).
  ``uid`` and ``gid`` are not quotas but whose the tenant's ``ipc://`` KV event sockets are
  (``kvstore.server.kvpublish``; docs/exposure.md): only that uid (or group) may subscribe.
  ``encrypt: true`` is not a quota either: the tenant's objects are encrypted at rest on
  SSD and Redis (``kvstore.integrity``; docs/integrity.md); off by default.
* **Usage.**  ``take(tenant, what)`` counts one more of ``what`` or, at the quota, counts a
  refusal and raises ``CapacityError`` (RESOURCE_EXHAUSTED on either channel); ``give``
  gives it back.  ``refuse`` counts a refusal decided elsewhere (a full host pool).
* **Marks.**  A scoped key's namespace starts with its tenant's mark
  (``kvstore.keys.tenant_mark``): ``tenant_of(key)`` is the tenant whose pool and SSD
  partition hold it, with no table of namespaces to keep.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

from kvstore.config import parse_size
from kvstore.errors import CapacityError, ConfigError
from kvstore.keys import TENANT_MARK_SIZE, tenant_mark

COUNTED = ("reservations", "leases", "streams", "connections", "tickets")
_MIN_SHARE = 1 << 20  # the least host pool or SSD partition a tenant may be left with
_UNIT = 4096  # shares are whole 4 KiB units (the host pool's slot alignment)


@dataclass(frozen=True, slots=True)
class Limits:
    """One tenant's quotas (see the module docstring); ``None`` bytes: an equal share."""

    host_bytes: int | None = None
    ssd_bytes: int | None = None
    redis_bytes: int | None = None  # the tenant's Redis budget (kvstore.server.redis_tenants); None: none
    reservations: int = 64
    leases: int = 4096
    streams: int = 32
    connections: int = 64
    tickets: int = 64
    described_bytes: int = 32 << 20
    described: int = 65536
    uid: int | None = None  # the tenant's KV event sockets belong to this uid ...
    gid: int | None = None  # ... and/or this group (kvstore.server.kvpublish)
    encrypt: bool = False  # encryption at rest on SSD / Redis (kvstore.integrity)

    def count(self, what: str) -> int:
        return getattr(self, what)

    @property
    def descriptions(self) -> tuple[int, int]:
        """(bytes, entries) of descriptions the tenant may hold (``kvstore.store.kvevents``)."""
        return self.described_bytes, self.described


DEFAULT = Limits()


def parse_limits(doc: object, where: str, known: Iterable[str]) -> dict[str, Limits]:
    """The ``tenants`` section of a tokens file: tenant name → ``Limits``."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: 'tenants' must be a mapping of tenant name to its limits")
    known, out = set(known), {}
    names = [f.name for f in fields(Limits)]
    for tenant, entry in doc.items():
        at = f"{where}: tenants.{tenant}"
        if tenant not in known:
            raise ConfigError(f"{at}: no token names this tenant")
        if not isinstance(entry, dict) or set(entry) - set(names):
            raise ConfigError(f"{at}: expected a mapping of {', '.join(names)}")
        values: dict[str, int | bool] = {}
        for key, value in entry.items():
            if key == "encrypt":
                if not isinstance(value, bool):
                    raise ConfigError(f"{at}.encrypt: expected true or false, got {value!r}")
                values[key] = value
            elif key in ("uid", "gid"):
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32 - 1:
                    raise ConfigError(f"{at}.{key}: expected a numeric {key} (0 to 4294967294), got {value!r}")
                values[key] = value
            elif key.endswith("_bytes"):
                values[key] = parse_size(value, f"{at}.{key}")
            elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
                values[key] = value
            else:
                raise ConfigError(f"{at}.{key}: expected a positive integer, got {value!r}")
        out[tenant] = Limits(**values)  # type: ignore[arg-type]  # each value was checked above, by name
    return out


def _shares(names: list[str], wanted: Mapping[str, int | None], total: int, what: str) -> dict[str, int]:
    """Bytes of each tenant: what it asked for, the rest split equally among the others."""
    fixed = {n: w for n in names if (w := wanted[n]) is not None}
    left = total - sum(fixed.values())
    rest = [n for n in names if wanted[n] is None]
    share = (left // len(rest)) // _UNIT * _UNIT if rest else 0
    if left < 0 or (rest and share < _MIN_SHARE):
        raise ConfigError(
            f"tenants' {what} ({sum(fixed.values())} bytes asked for) leave "
            f"{max(left, 0)} bytes of {total} for {len(rest)} other tenant(s): "
            f"each needs at least {_MIN_SHARE}"
        )
    return {**fixed, **{n: share for n in rest}}


class Tenants:
    """Every tenant's quotas, usage and refusals (see the module docstring)."""

    def __init__(self, limits: Mapping[str, Limits], host: Mapping[str, int], ssd: Mapping[str, int] | None) -> None:
        self.limits = dict(limits)
        self.host_bytes, self.ssd_bytes = dict(host), dict(ssd or {})
        self._by_mark = {tenant_mark(name): name for name in self.limits}
        if len(self._by_mark) != len(self.limits):
            raise ConfigError("two tenant names share a tenant mark: rename one of them")
        self.usage: Counter[tuple[str, str]] = Counter()
        self.refused: Counter[tuple[str, str]] = Counter()

    @classmethod
    def plan(
        cls, names: Iterable[str], limits: Mapping[str, Limits], host_capacity: int, ssd_capacity: int | None
    ) -> Tenants:
        """Quotas of ``names`` (``limits`` where given) within the capacities."""
        names = sorted(set(names))
        full = {n: limits.get(n, Limits()) for n in names}
        host = _shares(names, {n: full[n].host_bytes for n in names}, host_capacity, "host_bytes")
        ssd = None
        if ssd_capacity is not None:
            ssd = _shares(names, {n: full[n].ssd_bytes for n in names}, ssd_capacity, "ssd_bytes")
        return cls(full, host, ssd)

    @property
    def names(self) -> list[str]:
        return list(self.limits)

    def tenant_of(self, key: bytes) -> str | None:
        """The tenant of a scoped key or namespace (None: no configured tenant's)."""
        return self._by_mark.get(bytes(key[:TENANT_MARK_SIZE]))

    def take(self, tenant: str, what: str) -> None:
        """One more ``what`` held by ``tenant``; ``CapacityError`` (counted) at its quota."""
        limit = self.limits.get(tenant, DEFAULT).count(what)
        if self.usage[tenant, what] >= limit:
            self.refuse(tenant, what)
            raise CapacityError(f"tenant {tenant!r} holds {limit} {what}, its quota")
        self.usage[tenant, what] += 1

    def give(self, tenant: str, what: str) -> None:
        if self.usage[tenant, what] <= 0:
            raise RuntimeError(f"tenant {tenant!r} gives back {what} it does not hold")
        self.usage[tenant, what] -= 1

    def descriptions(self, tenant: str) -> tuple[int, int]:
        return self.limits.get(tenant, DEFAULT).descriptions

    def refuse(self, tenant: str, what: str) -> None:
        self.refused[tenant, what] += 1

    def held_and_quota(self, tenant: str, what: str) -> tuple[int, int]:
        """What ``tenant`` holds of ``what`` now, and its quota (no iteration: the metrics'
        thread may ask while the loop counts)."""
        return self.usage[tenant, what], self.limits.get(tenant, DEFAULT).count(what)

    def doc(self, tenant: str) -> dict[str, dict[str, int]]:
        """Quotas, holdings and refusals of one tenant (its part of ``Stats``)."""
        lim = self.limits.get(tenant, DEFAULT)
        return {
            "quota": {
                "host_bytes": self.host_bytes.get(tenant, 0),
                "ssd_bytes": self.ssd_bytes.get(tenant, 0),
                **{what: lim.count(what) for what in COUNTED},
            },
            "held": {what: self.usage[tenant, what] for what in COUNTED},
            "refused": {what: n for (t, what), n in sorted(self.refused.items()) if t == tenant},
        }


__all__ = ["COUNTED", "Limits", "Tenants", "parse_limits"]
