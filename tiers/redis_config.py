"""Configuration of the Redis tier: one URL plus options, validated up front.

``RedisConfig.from_url(url, **options)`` accepts::

    redis://[[user]:password@]host[:port][/db][?option=value&...]
    rediss://...            TLS
    redis+cluster://...     Redis Cluster (the URL names one seed node)
    rediss+cluster://...    Redis Cluster over TLS

``cluster=true`` (an option or a query parameter) selects cluster mode with a plain scheme.
Options may come from the query string or from keyword arguments (keywords win), and
convert by field type (``kvstore.config.convert``: sizes such as ``2MiB``, seconds,
``true``/``false``); the username and password may come from the URL or the options.
Every mistake — a malformed URL, an unknown scheme or option, a missing host, a bad port,
a key prefix with spaces, a part size above Redis' 512 MiB bulk limit — raises
``ConfigError`` naming the value.  The password never appears in ``repr``/``str``/
``redacted_url``.  Parsing touches neither the network nor the file system.

``connect(cfg)`` turns a config into a connected redis-py asyncio client (a
``BlockingConnectionPool`` of ``pool_size`` + 2 connections, or a ``RedisCluster``), PINGs
within ``connect_timeout_s`` and reads ``proto-max-bulk-len`` (512 MiB when CONFIG is not
allowed).  Unreachable -> ``TierUnavailableError``; refused credentials, a missing TLS file,
a failed TLS handshake or ``part_size`` above the bulk limit -> ``ConfigError``; never a
hang.  ``TRANSPORT_ERRORS`` are the failures that mean "the server is not answering".
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import ssl
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import BlockingConnectionPool, Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvstore.config import Seconds, Size, convert, field_types, read_token_file
from kvstore.errors import ConfigError, TierUnavailableError

log = logging.getLogger("tiers.redis")

MiB = 1 << 20
REDIS_MAX_BULK = 512 * MiB        # Redis' default (and usual) proto-max-bulk-len
MIN_PART_SIZE = 4096
# Measured here (32 MiB objects, 2 cores): gets go through ``tiers.redis_bulk`` (pipelined part
# GETs straight into the caller's buffer) at ~1.0-1.6 GB/s with 1 MiB parts, 4 in flight;
# bigger parts cost Redis more output buffering; puts ~1.3-1.5 GB/s.
DEFAULT_PART_SIZE = 1 * MiB
_SCHEMES = {"redis": (False, False), "rediss": (True, False),
            "redis+cluster": (False, True), "rediss+cluster": (True, True)}


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Where the Redis tier connects and how it stores objects (see the module docstring)."""

    host: str
    port: int = 6379
    db: int = 0
    tls: bool = False
    cluster: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    key_prefix: str = "kvstore:"
    ttl_s: Seconds = 0.0               # 0: objects never expire
    pool_size: int = 16                # connections per server (per node in a cluster)
    connect_timeout_s: Seconds = 1.0
    op_timeout_s: Seconds = 2.0
    part_size: Size = DEFAULT_PART_SIZE
    max_object_bytes: Size = 1 << 30
    max_inflight_parts: int = 4        # concurrent part transfers of one object (measured)
    retry_s: Seconds = 1.0             # circuit-breaker probe interval
    orphan_ttl_s: Seconds = 600.0      # lifetime of parts of a put never committed
    budget_bytes: Size = 0             # bytes this key prefix may hold, kept by the writers (0: none)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        _check_prefix(self.key_prefix)
        _positive("pool_size", self.pool_size)
        _positive("max_inflight_parts", self.max_inflight_parts)
        for name in ("connect_timeout_s", "op_timeout_s", "retry_s", "orphan_ttl_s"):
            _positive(name, getattr(self, name))
        if not math.isfinite(self.ttl_s) or self.ttl_s < 0:
            raise ConfigError(f"ttl_s must be 0 (no expiry) or positive seconds, got {self.ttl_s!r}")
        if not MIN_PART_SIZE <= self.part_size <= REDIS_MAX_BULK:
            raise ConfigError(f"part_size {self.part_size} is outside [{MIN_PART_SIZE}, {REDIS_MAX_BULK}] "
                              "bytes (Redis refuses values above proto-max-bulk-len, 512 MiB)")
        _positive("max_object_bytes", self.max_object_bytes)
        if isinstance(self.budget_bytes, bool) or self.budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be 0 (no budget) or positive, got {self.budget_bytes!r}")
        if self.cluster and self.db != 0:
            raise ConfigError(f"Redis Cluster has only database 0, the URL asks for /{self.db}")
        if not self.tls and (self.tls_ca or self.tls_cert or self.tls_key):
            raise ConfigError(f"TLS files given but {self.redacted_url} is not a TLS URL; use rediss://")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key must be given together")

    @property
    def scheme(self) -> str:
        return ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def redacted_url(self) -> str:
        """The URL without its password (the username is kept: errors name it)."""
        auth = ""
        if self.username or self.password:
            auth = quote(self.username or "", safe="") + (":***" if self.password else "") + "@"
        db = f"/{self.db}" if self.db else ""
        return f"{self.scheme}://{auth}{self.address}{db}"

    def __repr__(self) -> str:
        opts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                         if f.name not in _URL_FIELDS)
        return f"RedisConfig({self.redacted_url}, {opts})"

    __str__ = __repr__

    @classmethod
    def from_url(cls, url: str, **options: object) -> RedisConfig:
        """Parse ``url`` and merge ``options`` (query parameters first, keywords over them)."""
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(f"redis URL must be a non-empty string, got {url!r}")
        values = _parse_url(url)
        merged: dict[str, object] = dict(cast("dict[str, str]", values.pop("query")))  # _parse_url's dict
        merged.update(options)
        password_file = merged.pop("password_file", None)
        if password_file is not None:  # the password from a 0600 file, not the URL (logs, /proc)
            if values.get("password") is not None:
                raise ConfigError(f"{_redact(url)}: a password and a password_file; give it one way")
            values["password"] = read_token_file(str(password_file))
        unknown = sorted(set(merged) - _OPTION_FIELDS)
        if unknown:
            raise ConfigError(f"unknown redis option(s) {', '.join(unknown)} in {_redact(url)}; "
                              f"known: {', '.join(sorted(_OPTION_FIELDS))}")
        types = field_types(cls)
        for name, value in merged.items():
            values[name] = convert(types[name], value, name)
        scheme_cluster = values.pop("scheme_cluster")
        if scheme_cluster and values.get("cluster") is False:
            raise ConfigError(f"{_redact(url)} is a cluster URL but the options say cluster=false")
        values["cluster"] = bool(scheme_cluster or values.get("cluster", False))
        return cls(**values)  # type: ignore[arg-type]  # each value converted to its field's type above


_URL_FIELDS = {"host", "port", "db", "tls", "username", "password"}
_OPTION_FIELDS = {f.name for f in dataclasses.fields(RedisConfig)} - {"host", "port", "db", "tls"}


def _redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for error messages about bad URLs)."""
    head, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    auth, _, tail = rest.partition("@")
    user = auth.split(":", 1)[0]
    return f"{head}://{user}{':***' if ':' in auth else ''}@{tail}"


def _parse_url(url: str) -> dict[str, object]:
    shown = _redact(url)
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as err:
        raise ConfigError(f"malformed redis URL {shown}: {err}") from err
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ConfigError(f"unknown redis URL scheme {parts.scheme!r} in {shown}; "
                          f"expected one of {', '.join(f'{s}://' for s in _SCHEMES)}")
    if not parts.hostname:
        raise ConfigError(f"redis URL {shown} has no host")
    if port == 0:
        raise ConfigError(f"redis URL {shown} has port 0")
    if parts.fragment:
        raise ConfigError(f"redis URL {shown} has a fragment (#...); options go in the query string")
    tls, cluster = _SCHEMES[scheme]
    try:
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as err:
        raise ConfigError(f"malformed query string in redis URL {shown}: {err}") from err
    dup = sorted({k for k, _ in query if sum(1 for q, _ in query if q == k) > 1})
    if dup:
        raise ConfigError(f"redis URL {shown} repeats option(s) {', '.join(dup)}")
    values: dict[str, object] = {"host": parts.hostname, "port": port or 6379, "tls": tls,
                                 "db": _db(parts.path, shown), "scheme_cluster": cluster,
                                 "query": dict(query)}
    if parts.username:
        values["username"] = unquote(parts.username)
    if parts.password is not None:
        values["password"] = unquote(parts.password)
    return values


def _db(path: str, shown: str) -> int:
    text = path.strip("/")
    if not text:
        return 0
    if not text.isdigit():
        raise ConfigError(f"redis URL {shown}: the path must be a database number, got {path!r}")
    return int(text)


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not 1 <= len(prefix) <= 64:
        raise ConfigError(f"key_prefix must be 1-64 characters, got {prefix!r}")
    if not all("!" <= c <= "~" for c in prefix):
        raise ConfigError(f"key_prefix {prefix!r} must be printable ASCII without spaces")
    if "{" in prefix or "}" in prefix:
        # A hash tag would pin every key of the tier to one cluster slot.
        raise ConfigError(f"key_prefix {prefix!r} must not contain '{{' or '}}' (Redis Cluster hash tags)")


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{name} must be positive, got {value!r}")


# --- connecting ------------------------------------------------------------------------------

TRANSPORT_ERRORS = (rx.ConnectionError, rx.TimeoutError, rx.RedisClusterException, OSError)
_STREAM_LIMIT = 1 << 20     # asyncio buffers this much per connection before pausing reads
_READ_SIZE = 256 << 10      # bytes handed to hiredis per read


async def connect(cfg: RedisConfig) -> tuple[Any, int]:
    """A connected client and the servers' proto-max-bulk-len.  Unreachable ->
    ``TierUnavailableError`` within ``connect_timeout_s``; refused credentials, a missing TLS
    file, a failed TLS handshake or a part size above the bulk limit -> ``ConfigError``."""
    for what in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(cfg, what)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{what} file {path!r} for {cfg.redacted_url} does not exist")
    client = make_client(cfg)
    try:
        bulk = await _handshake(cfg, client)
        if cfg.part_size > bulk:
            raise ConfigError(f"part_size {cfg.part_size} exceeds proto-max-bulk-len {bulk} of "
                              f"{cfg.redacted_url}; choose a smaller part_size")
        await _check_policy(cfg, client)
    except BaseException:
        with suppress(Exception):
            await client.aclose()
        raise
    return client, bulk


class _WideReads:
    """Let asyncio buffer up to 1 MiB per connection (its default pauses reading at 128 KiB).
    Measured on 1-2 MiB parts: a 32 MiB get went from ~0.6-0.8 to ~0.8-1.0 GB/s."""

    _reader: asyncio.StreamReader | None

    async def _connect(self) -> None:
        await super()._connect()  # type: ignore[misc]  # a mixin: redis-py's Connection comes after it
        if self._reader is not None and hasattr(self._reader, "_limit"):
            self._reader._limit = max(self._reader._limit, _STREAM_LIMIT)


class _TCP(_WideReads, Connection):
    pass


class _TLS(_WideReads, SSLConnection):
    pass


def make_client(cfg: RedisConfig) -> Any:
    """A redis-py asyncio client for ``cfg`` (not yet connected)."""
    common: dict[str, Any] = dict(
        username=cfg.username, password=cfg.password, socket_timeout=cfg.op_timeout_s,
        socket_connect_timeout=cfg.connect_timeout_s, socket_read_size=_READ_SIZE,
        socket_keepalive=True)
    tls: dict[str, Any] = {}
    if cfg.tls:
        tls = dict(ssl_ca_certs=cfg.tls_ca, ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key,
                   ssl_cert_reqs="required", ssl_check_hostname=True)
    if cfg.cluster:
        client = RedisCluster(host=cfg.host, port=cfg.port, max_connections=cfg.pool_size + 2,
                              retry=Retry(NoBackoff(), 0), ssl=cfg.tls, **common, **tls)
        kwargs = client.get_connection_kwargs()  # shared by every node it will discover
        kwargs["connection_class"] = _TLS if cfg.tls else _TCP
        for node in client.startup_nodes:
            node.connection_class = kwargs["connection_class"]
        return client
    pool = BlockingConnectionPool(
        connection_class=_TLS if cfg.tls else _TCP, max_connections=cfg.pool_size + 2,
        timeout=cfg.op_timeout_s, host=cfg.host, port=cfg.port, db=cfg.db,
        retry=Retry(NoBackoff(), 1, supported_errors=(rx.ConnectionError,)), **common, **tls)
    return Redis(connection_pool=pool)


async def _handshake(cfg: RedisConfig, client: Any) -> int:
    """PING within ``connect_timeout_s``, then read proto-max-bulk-len (default 512 MiB)."""
    user = cfg.username or "default"
    try:
        async with asyncio.timeout(cfg.connect_timeout_s):
            if cfg.cluster:
                await client.initialize()
            await client.ping()
    except (rx.AuthenticationError, rx.AuthenticationWrongNumberOfArgsError, rx.NoPermissionError) as err:
        raise _auth_error(cfg, user, err) from err
    except TimeoutError as err:
        raise TierUnavailableError(f"cannot reach redis at {cfg.address}: no answer within "
                                   f"{cfg.connect_timeout_s:g} s") from err
    except (*TRANSPORT_ERRORS, rx.RedisError) as err:
        raise _open_error(cfg, user, err) from err
    return await _bulk_limit(cfg, client)


def _open_error(cfg: RedisConfig, user: str, err: BaseException) -> Exception:
    text = str(err)
    if any(s in text for s in ("WRONGPASS", "NOAUTH", "invalid username-password", "invalid password")):
        return _auth_error(cfg, user, err)
    if _ssl_cause(err):
        return ConfigError(f"TLS handshake with redis at {cfg.address} failed ({text}); "
                           "check tls_ca/tls_cert/tls_key")
    hint = ("; if that port speaks TLS, use rediss://"
            if not cfg.tls and ("closed" in text.lower() or "reset" in text.lower()) else "")
    return TierUnavailableError(f"cannot reach redis at {cfg.address}: {text}{hint}")


def _auth_error(cfg: RedisConfig, user: str, err: BaseException) -> ConfigError:
    why = "a password is required" if cfg.password is None else str(err)
    return ConfigError(f"redis at {cfg.redacted_url} refused user {user!r}: {why}")


def _ssl_cause(err: BaseException | None) -> bool:
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, ssl.SSLError) or "SSL" in type(err).__name__:
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


async def _check_policy(cfg: RedisConfig, client: Any) -> None:
    """Warn when Redis evicts under memory pressure: its eviction cannot be partitioned by
    tenant, so one tenant's writes would evict another's objects.  Under ``noeviction`` a
    write beyond ``maxmemory`` is refused instead (a counted put failure of the writer)."""
    try:
        async with asyncio.timeout(cfg.op_timeout_s):
            info = await client.info("memory")
    except rx.ResponseError:  # INFO not allowed for this user: nothing to tell
        return
    except (TimeoutError, *TRANSPORT_ERRORS) as err:
        raise TierUnavailableError(f"cannot reach redis at {cfg.address}: {err}") from err
    nodes = info.values() if cfg.cluster and info and isinstance(next(iter(info.values())), dict) else [info]
    policies = sorted({str(n.get("maxmemory_policy", "noeviction")) for n in nodes} - {"noeviction"})
    if policies:
        log.warning("redis at %s evicts under memory pressure (maxmemory-policy %s): in a tier shared by "
                    "tenants one tenant's writes evict another's objects; run it with maxmemory-policy "
                    "noeviction (writes beyond maxmemory are then refused, counted)", cfg.address,
                    ", ".join(policies))


async def _bulk_limit(cfg: RedisConfig, client: Any) -> int:
    """The smallest proto-max-bulk-len of the servers; 512 MiB when CONFIG is not allowed."""
    try:
        async with asyncio.timeout(cfg.op_timeout_s):
            reply = await client.config_get("proto-max-bulk-len")
    except rx.ResponseError:  # NOPERM for this user, or CONFIG renamed away
        return REDIS_MAX_BULK
    except (TimeoutError, *TRANSPORT_ERRORS) as err:
        raise TierUnavailableError(f"cannot reach redis at {cfg.address}: {err}") from err
    values = reply.values() if cfg.cluster and reply and isinstance(next(iter(reply.values())), dict) else [reply]
    limits = [int(v.get("proto-max-bulk-len", REDIS_MAX_BULK)) for v in values]
    return min(limits or [REDIS_MAX_BULK])


__all__ = ["RedisConfig", "connect", "make_client", "TRANSPORT_ERRORS", "DEFAULT_PART_SIZE",
           "REDIS_MAX_BULK", "MIN_PART_SIZE"]
