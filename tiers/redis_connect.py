"""Connecting the Redis tier: ``connect(cfg)`` turns a ``tiers.redis_config.RedisConfig`` into
a connected redis-py asyncio client (a ``BlockingConnectionPool`` of ``pool_size`` + 2
connections, or a ``RedisCluster``), PINGs within ``connect_timeout_s`` and reads
``proto-max-bulk-len`` (512 MiB when CONFIG is not allowed).  Runs wherever a Redis tier is
opened (an engine's store core, the store process, ``kvstore redis-sweep``).

Unreachable -> ``TierUnavailableError``; refused credentials, a missing TLS file, a failed TLS
handshake or ``part_size`` above the bulk limit -> ``ConfigError``; never a hang.  At connect
it warns when Redis evicts under memory pressure (tenants' objects would evict each other).
``TRANSPORT_ERRORS`` are the failures that mean "the server is not answering".
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from contextlib import suppress
from typing import Any

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import BlockingConnectionPool, Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvstore.errors import ConfigError, TierUnavailableError
from tiers.redis_config import REDIS_MAX_BULK, RedisConfig

log = logging.getLogger("tiers.redis")

TRANSPORT_ERRORS = (rx.ConnectionError, rx.TimeoutError, rx.RedisClusterException, OSError)
_STREAM_LIMIT = 1 << 20  # asyncio buffers this much per connection before pausing reads
_READ_SIZE = 256 << 10  # bytes handed to hiredis per read


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
            raise ConfigError(
                f"part_size {cfg.part_size} exceeds proto-max-bulk-len {bulk} of "
                f"{cfg.redacted_url}; choose a smaller part_size"
            )
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
        username=cfg.username,
        password=cfg.password,
        socket_timeout=cfg.op_timeout_s,
        socket_connect_timeout=cfg.connect_timeout_s,
        socket_read_size=_READ_SIZE,
        socket_keepalive=True,
    )
    tls: dict[str, Any] = {}
    if cfg.tls:
        tls = dict(
            ssl_ca_certs=cfg.tls_ca,
            ssl_certfile=cfg.tls_cert,
            ssl_keyfile=cfg.tls_key,
            ssl_cert_reqs="required",
            ssl_check_hostname=True,
        )
    if cfg.cluster:
        client = RedisCluster(
            host=cfg.host,
            port=cfg.port,
            max_connections=cfg.pool_size + 2,
            retry=Retry(NoBackoff(), 0),
            ssl=cfg.tls,
            **common,
            **tls,
        )
        kwargs = client.get_connection_kwargs()  # shared by every node it will discover
        kwargs["connection_class"] = _TLS if cfg.tls else _TCP
        for node in client.startup_nodes:
            node.connection_class = kwargs["connection_class"]
        return client
    pool = BlockingConnectionPool(
        connection_class=_TLS if cfg.tls else _TCP,
        max_connections=cfg.pool_size + 2,
        timeout=cfg.op_timeout_s,
        host=cfg.host,
        port=cfg.port,
        db=cfg.db,
        retry=Retry(NoBackoff(), 1, supported_errors=(rx.ConnectionError,)),
        **common,
        **tls,
    )
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
        raise TierUnavailableError(
            f"cannot reach redis at {cfg.address}: no answer within {cfg.connect_timeout_s:g} s"
        ) from err
    except (*TRANSPORT_ERRORS, rx.RedisError) as err:
        raise _open_error(cfg, user, err) from err
    return await _bulk_limit(cfg, client)


def _open_error(cfg: RedisConfig, user: str, err: BaseException) -> Exception:
    text = str(err)
    if any(s in text for s in ("WRONGPASS", "NOAUTH", "invalid username-password", "invalid password")):
        return _auth_error(cfg, user, err)
    if _ssl_cause(err):
        return ConfigError(f"TLS handshake with redis at {cfg.address} failed ({text}); check tls_ca/tls_cert/tls_key")
    hint = (
        "; if that port speaks TLS, use rediss://"
        if not cfg.tls and ("closed" in text.lower() or "reset" in text.lower())
        else ""
    )
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
        log.warning(
            "redis at %s evicts under memory pressure (maxmemory-policy %s): in a tier shared by "
            "tenants one tenant's writes evict another's objects; run it with maxmemory-policy "
            "noeviction (writes beyond maxmemory are then refused, counted)",
            cfg.address,
            ", ".join(policies),
        )


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


__all__ = ["TRANSPORT_ERRORS", "connect", "make_client"]
