"""Tiers by spec: one uniform ``await open_tier(spec, **options)`` for every backend.

Runs wherever a store is opened (the embedded store, the store process, the connector).

Specs, and the keyword options each takes:

    host:                    the host DRAM pool: capacity (required), shared, pin, alignment, name,
                             pools and pool_of (one memfd pool per name: ``tiers.host``), retention
                             (``tiers.retention``)
    ssd:PATH                 an SSD directory: capacity (required), fsync, name, partition and
                             quotas (bytes per partition: ``tiers.ssd_index``)
    redis://HOST:PORT/DB     Redis; also rediss:// (TLS), redis+cluster://, rediss+cluster://:
                             ``tiers.redis_config.RedisConfig`` options (over the query string)
    kvstore://HOST:PORT      a store process (``kvstore serve``): token, tls_ca, tls_cert,
                             tls_key, tls_server_name, transport, timeout_s, release_delay_s, lease_ttl_s,
                             name, retry_s

Sizes may be strings (``512MiB``).  Backends are imported lazily: redis-py only for a Redis
spec, grpc only for ``kvstore://``.  ``resolve`` checks a spec and its options without I/O;
a bad one raises ``ConfigError`` naming the spec (passwords redacted).  Opening a backend
that cannot be reached raises ``TierUnavailableError`` (a ``TierError``).

``open_tiers`` opens several, in order, after checking them all: with ``required=False`` a
tier whose opening raises ``TierError`` is left out (logged, reported to ``on_left_out``),
while a ``ConfigError`` always fails; on failure, the tiers already opened are closed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass

from kvstore.config import TierSettings, parse_size
from kvstore.config import redact_url as _redact
from kvstore.errors import ConfigError, TierError
from tiers.base import Tier

log = logging.getLogger("kvstore.store")
Opener = Callable[[], Awaitable[Tier]]
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
EXPECTED = "host:, ssd:PATH, redis://HOST:PORT, rediss://HOST:PORT, redis+cluster://HOST:PORT or kvstore://HOST:PORT"
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")
_OPTIONS = {
    "host": {"capacity", "shared", "pin", "alignment", "name", "pools", "pool_of", "retention"},
    "ssd": {"capacity", "fsync", "name", "partition", "quotas"},
    "remote": {
        "token",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "tls_server_name",
        "transport",
        "timeout_s",
        "release_delay_s",
        "lease_ttl_s",
        "name",
        "retry_s",
    },
}


@dataclass(frozen=True, slots=True)
class TierSpec:
    kind: str  # host | ssd | redis | remote
    target: str  # the directory, the URL or HOST:PORT ("" for host)
    shown: str  # the spec as messages show it (a password redacted)


def parse_spec(spec: str) -> TierSpec:
    """The kind and target of ``spec``; ``ConfigError`` naming it when it is none of them."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"tier spec must be a non-empty string, got {spec!r}; expected {EXPECTED}")
    shown = _redact(spec)
    scheme, sep, rest = spec.partition("://")
    if sep:
        scheme = scheme.lower()
        if scheme == "kvstore":
            if not _HOSTPORT.match(rest):
                raise ConfigError(f"tier spec {shown!r}: expected kvstore://HOST:PORT")
            return TierSpec("remote", rest, shown)
        if scheme in REDIS_SCHEMES:
            return TierSpec("redis", spec, shown)
        raise ConfigError(
            f"unknown tier spec {shown!r}: not host:, ssd:PATH or kvstore://HOST:PORT, "
            f"and unknown redis URL scheme {scheme!r} (expected "
            f"{', '.join(s + '://' for s in REDIS_SCHEMES)})"
        )
    kind, sep, rest = spec.partition(":")
    if sep and kind == "host":
        if rest:
            raise ConfigError(f"tier spec {shown!r}: host: takes no argument (capacity=... is an option)")
        return TierSpec("host", "", shown)
    if sep and kind == "ssd":
        if not rest.strip():
            raise ConfigError(f"tier spec {shown!r}: ssd: needs a directory (ssd:PATH)")
        return TierSpec("ssd", rest, shown)
    raise ConfigError(f"unknown tier spec {shown!r}; expected {EXPECTED}")


def resolve(spec: str, **options: object) -> Opener:
    """Check ``spec`` and ``options`` (no I/O); a coroutine function that opens the tier."""
    parsed = parse_spec(spec)
    allowed = _OPTIONS.get(parsed.kind)
    if allowed is not None and set(options) - allowed:
        bad = ", ".join(sorted(set(options) - allowed))
        raise ConfigError(f"tier spec {parsed.shown!r}: unknown option(s) {bad}; known: {', '.join(sorted(allowed))}")
    return _RESOLVERS[parsed.kind](parsed, dict(options))


def tier_specs(
    cfg: TierSettings,
    *,
    host: Mapping[str, object] | None = None,
    ssd: Mapping[str, object] | None = None,
    lower: Sequence[tuple[str | None, Mapping[str, object]]] = (),
) -> list[tuple[str, dict[str, object]]]:
    """The one builder of a store's specs, fastest first: ``cfg``'s host pool (its capacity
    and retention policy plus ``host``'s options), its SSD directory when ``cfg.ssd_dir`` is set (its capacity
    plus ``ssd``'s), then each ``(spec, options)`` of ``lower`` whose spec is given (the
    store process, Redis).  Used by the embedded store, the store process and the
    connector."""
    specs: list[tuple[str, dict[str, object]]] = [
        ("host:", {"capacity": cfg.host_capacity, "retention": cfg.host_retention, **(host or {})})
    ]
    if cfg.ssd_dir is not None:
        specs.append((f"ssd:{cfg.ssd_dir}", {"capacity": cfg.ssd_capacity, **(ssd or {})}))
    specs.extend((spec, dict(options)) for spec, options in lower if spec)
    return specs


async def open_tier(spec: str, **options: object) -> Tier:
    """The opened tier of ``spec`` (see the module docstring)."""
    return await resolve(spec, **options)()


async def open_tiers(
    specs: Sequence[tuple[str, Mapping[str, object]]],
    *,
    required: bool = True,
    on_left_out: Callable[[str, TierError], None] | None = None,
) -> list[Tier]:
    """Open every ``(spec, options)`` in order, all checked first (see the module docstring)."""
    openers = [(parse_spec(spec), resolve(spec, **options)) for spec, options in specs]
    tiers: list[Tier] = []
    try:
        for parsed, opener in openers:
            try:
                tiers.append(await opener())
            except TierError as err:
                if required:
                    raise
                log.warning("kvstore: %s tier %s left out (not required): %s", parsed.kind, parsed.shown, err)
                if on_left_out is not None:
                    on_left_out(parsed.kind, err)
    except BaseException:
        for tier in reversed(tiers):
            with suppress(Exception):
                await tier.aclose()
        raise
    return tiers


def _capacity(spec: TierSpec, options: dict[str, object]) -> int:
    if "capacity" not in options:
        raise ConfigError(f"tier spec {spec.shown!r} needs a capacity= option")
    return parse_size(options.pop("capacity"), f"tier spec {spec.shown!r}: capacity")


def _host(spec: TierSpec, options: dict[str, object]) -> Opener:
    from tiers.host import HostTier

    capacity = _capacity(spec, options)

    async def opener() -> Tier:
        return HostTier(capacity, **options)  # type: ignore[arg-type]

    return opener


def _ssd(spec: TierSpec, options: dict[str, object]) -> Opener:
    from tiers.ssd import SSDTier

    capacity = _capacity(spec, options)
    return lambda: SSDTier.open(spec.target, capacity, **options)


def _redis(spec: TierSpec, options: dict[str, object]) -> Opener:
    from tiers.redis_config import RedisConfig  # lazily: redis-py only for a Redis spec

    cfg = RedisConfig.from_url(spec.target, **options)

    async def opener() -> Tier:
        from tiers.redis import RedisTier

        return await RedisTier.open(cfg)

    return opener


def _remote(spec: TierSpec, options: dict[str, object]) -> Opener:
    async def opener() -> Tier:
        from kvstore.client.tier import RemoteTier  # lazily: grpc only for a store process

        return await RemoteTier.open(spec.target, **options)  # type: ignore[arg-type]

    return opener


_RESOLVERS: dict[str, Callable[[TierSpec, dict[str, object]], Opener]] = {
    "host": _host,
    "ssd": _ssd,
    "redis": _redis,
    "remote": _remote,
}


__all__ = ["EXPECTED", "REDIS_SCHEMES", "TierSpec", "open_tier", "open_tiers", "parse_spec", "resolve", "tier_specs"]
