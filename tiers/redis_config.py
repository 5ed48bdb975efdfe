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

Runs wherever a Redis tier is configured.  ``tiers.redis_connect.connect(cfg)`` turns a
config into a connected client (and ``TRANSPORT_ERRORS`` are its "not answering" failures).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from kvstore.config import Seconds, Size, convert, field_types, read_token_file
from kvstore.errors import ConfigError

MiB = 1 << 20
REDIS_MAX_BULK = 512 * MiB  # Redis' default (and usual) proto-max-bulk-len
MIN_PART_SIZE = 4096
# Measured here (32 MiB objects, 2 cores): gets go through ``tiers.redis_bulk`` (pipelined part
# GETs straight into the caller's buffer) at ~1.0-1.6 GB/s with 1 MiB parts, 4 in flight;
# bigger parts cost Redis more output buffering; puts ~1.3-1.5 GB/s.
DEFAULT_PART_SIZE = 1 * MiB
_SCHEMES = {
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}


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
    ttl_s: Seconds = 0.0  # 0: objects never expire
    pool_size: int = 16  # connections per server (per node in a cluster)
    connect_timeout_s: Seconds = 1.0
    op_timeout_s: Seconds = 2.0
    part_size: Size = DEFAULT_PART_SIZE
    max_object_bytes: Size = 1 << 30
    max_inflight_parts: int = 4  # concurrent part transfers of one object (measured)
    retry_s: Seconds = 1.0  # circuit-breaker probe interval
    orphan_ttl_s: Seconds = 600.0  # lifetime of parts of a put never committed
    budget_bytes: Size = 0  # bytes this key prefix may hold, kept by the writers (0: none)
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
            raise ConfigError(
                f"part_size {self.part_size} is outside [{MIN_PART_SIZE}, {REDIS_MAX_BULK}] "
                "bytes (Redis refuses values above proto-max-bulk-len, 512 MiB)"
            )
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
        opts = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name not in _URL_FIELDS
        )
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
            raise ConfigError(
                f"unknown redis option(s) {', '.join(unknown)} in {_redact(url)}; "
                f"known: {', '.join(sorted(_OPTION_FIELDS))}"
            )
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
        raise ConfigError(
            f"unknown redis URL scheme {parts.scheme!r} in {shown}; "
            f"expected one of {', '.join(f'{s}://' for s in _SCHEMES)}"
        )
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
    values: dict[str, object] = {
        "host": parts.hostname,
        "port": port or 6379,
        "tls": tls,
        "db": _db(parts.path, shown),
        "scheme_cluster": cluster,
        "query": dict(query),
    }
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


__all__ = ["RedisConfig", "DEFAULT_PART_SIZE", "REDIS_MAX_BULK", "MIN_PART_SIZE"]
