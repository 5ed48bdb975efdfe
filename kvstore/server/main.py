"""Lifecycle of the store process (``kvstore serve``): start, serve, drain, exit 0.

Server side.  ``serve(cfg)``:

1. checks what can fail before anything is created (tokens file, tenants' quotas, TLS
   files), then opens the tiers (``ServerStore.open``: one host pool per tenant, SSD, Redis)
   and seals the pools of tenants that have no writing ``shm`` token against writable
   mappings;
2. starts a ``grpc.aio`` server on ``cfg.listen`` (port 0 picks a free port) with the
   KVStore servicer, ``grpc.health.v1`` (SERVING for "" and ``kvstore.v1.KVStore``) and
   server reflection; TLS when configured, client certificates when a client CA is given;
   and, unless ``data_channel`` is off, the raw TCP data channel on the same host
   (``cfg.data_port``, 0: a free port; ``kvstore.server.dataserver``, same TLS), whose port
   ``Hello`` advertises;
3. serves the shared-memory gate (``kvstore.server.shmgate``: a Unix socket, ``shm_socket``)
   that hands same-host clients their tenant's pool, and optionally Prometheus ``/metrics``
   on ``cfg.metrics_port``;
4. once serving, writes ``host:port`` to ``cfg.ready_file`` (temp + rename, so a reader
   never sees half a line) and prints ``kvstore serve: listening on HOST:PORT (...)``;
5. on SIGTERM/SIGINT: health turns NOT_SERVING, new calls are refused, in-flight calls and
   data-channel requests get ``shutdown_grace`` seconds to finish, then uncommitted puts are aborted, leases
   released, write-throughs finished, tiers closed and the shm file unlinked; returns 0.

The gRPC server is created with ``so_reuseport`` off, so a port already in use is an error
(``ConfigError``) rather than two servers silently sharing it, and with bounds: at most
``max_concurrent_rpcs`` calls, ``max_streams_per_connection`` per connection, keepalive
pings, idle connections closed after ``idle_timeout``.

Exposure: a listen address beyond loopback without TLS and tokens is refused unless
``insecure`` (``ServerConfig``); with it a warning is printed.  ``/metrics`` beyond loopback
answers only scrapes with an ``admin`` token (``metrics_authorizer``), unless ``insecure``:
then it is open, with a warning.  Without a tokens file every call needs the default token
(``kvstore.localtoken``; docs/exposure.md).  ``run`` makes the process non-dumpable, so another process of the
same uid can neither ptrace it nor open its pools through ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvstore.errors import ConfigError, UnauthenticatedError
from kvstore.localtoken import default_token_path, ensure_token
from kvstore.server.auth import DEFAULT_TENANT, Authenticator, Permission
from kvstore.server.config import STREAM_HEADROOM, ServerConfig, is_loopback, split_listen
from kvstore.server.core import ServerStore
from kvstore.server.dataserver import DataServer
from kvstore.server.dataserver import describe as describe_data
from kvstore.server.metrics import ServerMetrics
from kvstore.server.metricshttp import start_http
from kvstore.server.observing import start_trace, trace_tiers
from kvstore.server.peers import PreAuth
from kvstore.server.process import harden_process, tune_malloc
from kvstore.server.scoping import Scoper
from kvstore.server.servicer import KVStoreServicer
from kvstore.server.shmgate import ShmGate
from kvstore.server.shmreads import GateReads
from kvstore.server.tenants import Tenants
from kvstore.server.wire import SERVICE, add_to_server

log = logging.getLogger("kvstore.server.servicer")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{what} {path} is not readable: {err.strerror or err}") from err


def credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS server credentials, or None for a plaintext server."""
    if cfg.tls_cert is None:
        return None
    cert, key = _read(cfg.tls_cert, "tls_cert"), _read(cfg.tls_key, "tls_key")
    ca = _read(cfg.tls_client_ca, "tls_client_ca")
    _check_pem(cfg)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _check_pem(cfg: ServerConfig) -> None:
    """Load the files with ``ssl`` first: grpc reports a bad certificate or a key that does
    not match it only as "failed to bind"."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(cfg.tls_cert), str(cfg.tls_key))
    except ssl.SSLError as err:
        raise ConfigError(
            f"tls_cert {cfg.tls_cert} / tls_key {cfg.tls_key}: not a PEM certificate "
            f"and its matching private key ({err.reason or err})"
        ) from err
    if cfg.tls_client_ca is not None:
        try:
            ctx.load_verify_locations(str(cfg.tls_client_ca))
        except ssl.SSLError as err:
            raise ConfigError(
                f"tls_client_ca {cfg.tls_client_ca}: not a PEM CA certificate ({err.reason or err})"
            ) from err


def grpc_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", max(cfg.max_message_bytes, cfg.frame_bytes + STREAM_HEADROOM)),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 60_000),  # find half-open connections of dead hosts
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
        ("grpc.max_connection_idle_ms", int(cfg.idle_timeout * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # ping floods are cut (GOAWAY)
    ]


def authenticator(cfg: ServerConfig) -> Authenticator:
    """The tokens file's table; without one the default token (made once, 0600, at
    ``default_token_file``), unless ``insecure``: then no token at all (docs/exposure.md)."""
    if cfg.auth_tokens is not None:
        return Authenticator.from_file(cfg.auth_tokens)
    if cfg.insecure:
        return Authenticator(None)
    return Authenticator.local(ensure_token(cfg.default_token_file))


def plan_tenants(cfg: ServerConfig, auth: Authenticator) -> Tenants:
    """Every tenant's quotas: those of the tokens file, shares of the capacities for the rest."""
    table = auth.table
    names = table.tenants if table is not None else {DEFAULT_TENANT}
    return Tenants.plan(
        names,
        table.limits if table is not None else {},
        cfg.host_capacity,
        cfg.ssd_capacity if cfg.ssd_dir is not None else None,
    )


def seal_read_only_pools(store: ServerStore, auth: Authenticator) -> list[str]:
    """Seal the pools of tenants with no token holding both write and shm against every new
    writable mapping (their clients can only map them read-only); the tenants sealed."""
    if auth.table is None:
        return []
    writers = {p.tenant for p in auth.table.principals() if p.allows(Permission.WRITE) and p.allows(Permission.SHM)}
    sealed = [t for t in store.host.pools if t not in writers]
    for tenant in sealed:
        store.host.pool_memfd(tenant).seal_writes()
    return sealed


def boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def warn_exposure(cfg: ServerConfig, auth: Authenticator) -> None:
    """Say it loudly when the store is reachable beyond this host without protection."""
    if cfg.insecure and not is_loopback(cfg.listen_host) and not (cfg.tls and auth.enabled):
        print(
            f"kvstore serve: WARNING: --insecure: {cfg.listen} is served beyond loopback "
            f"{'without TLS' if not cfg.tls else ''}{' and ' if not cfg.tls and not auth.enabled else ''}"
            f"{'without tokens' if not auth.enabled else ''}: anyone who reaches it "
            f"{'reads, writes and deletes every object' if not auth.enabled else 'can read the traffic'}",
            file=sys.stderr,
            flush=True,
        )
    mhost = cfg.metrics_host or cfg.listen_host
    if cfg.metrics_port is not None and not is_loopback(mhost) and metrics_authorizer(cfg, auth) is None:
        print(
            f"kvstore serve: WARNING: /metrics on {mhost} is reachable beyond this host, without "
            f"authentication (it shows every tenant's counters)",
            file=sys.stderr,
            flush=True,
        )


def metrics_authorizer(cfg: ServerConfig, auth: Authenticator):
    """Beyond loopback, unless ``insecure``: every scrape of ``/metrics`` needs a token with
    ``admin`` (``Authorization: Bearer``); None where ``/metrics`` is open."""
    if cfg.insecure or not auth.enabled or is_loopback(cfg.metrics_host or cfg.listen_host):
        return None

    def authorize(header: str | None) -> int:
        try:
            who = auth.authenticate([("authorization", header)] if header else [])
        except UnauthenticatedError:
            return 401
        return 200 if who.allows(Permission.ADMIN) else 403

    return authorize


def write_ready(path: Path, target: str) -> None:
    """``target`` into ``path`` atomically (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(target + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise ConfigError(f"ready_file {path} cannot be written: {err.strerror or err}") from err


def _bind(server: grpc.aio.Server, cfg: ServerConfig, creds: grpc.ServerCredentials | None) -> int:
    try:
        if creds is None:
            return server.add_insecure_port(cfg.listen)
        return server.add_secure_port(cfg.listen, creds)
    except RuntimeError as err:
        raise ConfigError(f"cannot listen on {cfg.listen}: {err}") from err


def _describe(
    cfg: ServerConfig, store: ServerStore, auth: Authenticator, metrics_url: str | None, data_port: int, gate: ShmGate
) -> str:
    pools = store.host.pools
    parts = [f"host pools {cfg.host_capacity / 2**20:.1f} MiB for {len(pools)} tenant(s), shm socket {gate.path}"]
    if data_port:
        parts.append(describe_data(cfg.tls, data_port))
    if cfg.ssd_dir is not None:
        parts.append(f"ssd {cfg.ssd_dir} ({cfg.ssd_capacity / 2**30:.2f} GiB)")
    if cfg.redis:
        parts.append("redis on")
    if store.publisher is not None:
        streams = ", ".join(
            f"{t} {pub}" + (f" (replay {rep})" if rep else "") for t, (pub, rep) in store.publisher.endpoints.items()
        )
        parts.append(f"kv events epoch {store.publisher.epoch}: {streams}")
    if cfg.auth_tokens is None and auth.table is not None:
        parts.append(f"auth: the default token in {cfg.default_token_file or default_token_path()}")
    else:
        parts.append(f"auth {len(auth.table)} tokens" if auth.table is not None else "auth off")
    parts.append("tls on" + (" with client certificates" if cfg.tls_client_ca else "") if cfg.tls else "tls off")
    if metrics_url:
        parts.append(f"metrics {metrics_url}")
    return ", ".join(parts)


class _Stopper:
    """SIGTERM/SIGINT → an event: the first signal starts the graceful shutdown, later ones
    are ignored.  Plain ``signal.signal`` handlers (not the loop's): they stay installed
    until the process exits, so a signal during the final teardown cannot kill it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._set, signum)
        except RuntimeError:  # the loop is closed: shutting down already
            pass

    def _set(self, signum: int) -> None:
        if not self.event.is_set():
            log.warning("kvstore serve: %s received, shutting down", signal.Signals(signum).name)
        self.event.set()


async def serve(cfg: ServerConfig, stop: asyncio.Event | None = None) -> int:
    """Run the store process until ``stop`` is set (default: SIGTERM/SIGINT); 0 when it
    shut down gracefully.  Each part is built whole, with what it needs, and registered for
    its teardown as it starts; teardown runs in reverse (/metrics, the gRPC server and the
    data channel first, the store and its KV events after them, the trace last), after a
    graceful stop or a failed start-up alike."""
    auth = authenticator(cfg)
    tenants = plan_tenants(cfg, auth)
    creds = credentials(cfg)
    warn_exposure(cfg, auth)
    stop = stop if stop is not None else _Stopper().event
    metrics = ServerMetrics()
    metrics.tenant_labels = cfg.metrics_tenant_labels
    async with contextlib.AsyncExitStack() as stack:
        tracer = start_trace(cfg, metrics)
        if tracer is not None:
            stack.callback(tracer.close)
        store = await ServerStore.open(cfg, metrics, tenants)
        stack.push_async_callback(store.aclose, cfg.shutdown_grace)
        if tracer is not None:
            trace_tiers(tracer, store)
        scope = Scoper()
        gate = ShmGate(
            store.host,
            auth,
            store.tickets,
            tenants,
            store.puts.end_session,
            cfg.shm_socket,
            hello_timeout=cfg.hello_timeout,
            preauth=PreAuth(cfg.max_unauthenticated_per_peer, cfg.max_unauthenticated),
            on_refused=lambda reason: metrics.counters.fail(f"shm_{reason}"),
            reads=GateReads(store, scope).lease,
        )
        seal_read_only_pools(store, auth)
        await gate.start()
        stack.push_async_callback(gate.aclose)
        data, data_port = None, 0
        if cfg.data_channel:
            data = DataServer(store, auth, scope, cfg)
            stack.push_async_callback(data.aclose, 0)  # idempotent; cuts what a failed start-up left
            data_port = await data.start(cfg.listen_host, cfg.data_port)
        servicer = KVStoreServicer(store, auth, boot_id(), scope=scope, gate=gate, data_port=data_port)
        server, health, port = _grpc_server(cfg, servicer, creds)
        stack.push_async_callback(server.stop, 0)  # no-op after a graceful stop; ends a failed start-up
        await server.start()
        for name in ("", SERVICE):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        metrics_url = _start_metrics(cfg, metrics, auth, stack)
        target = f"{split_listen(cfg.listen)[0]}:{port}"
        if cfg.ready_file is not None:
            write_ready(cfg.ready_file, target)
        print(
            f"kvstore serve: listening on {target} ({_describe(cfg, store, auth, metrics_url, data_port, gate)})",
            flush=True,
        )
        await stop.wait()
        await health.enter_graceful_shutdown()
        await asyncio.gather(
            server.stop(cfg.shutdown_grace), data.aclose(cfg.shutdown_grace) if data is not None else asyncio.sleep(0)
        )
    print("kvstore serve: stopped", flush=True)
    return 0


def _grpc_server(cfg: ServerConfig, servicer: KVStoreServicer, creds):
    """The gRPC server with the store's service (guarded), health and reflection, bound (not
    started): (server, its health servicer, the bound port)."""
    server = grpc.aio.server(options=grpc_options(cfg), maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
    add_to_server(servicer, server, servicer.guard())
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return server, health, _bind(server, cfg, creds)


def _start_metrics(
    cfg: ServerConfig, metrics: ServerMetrics, auth: Authenticator, stack: contextlib.AsyncExitStack
) -> str | None:
    """Serve ``/metrics`` when ``metrics_port`` is set (its shutdown on ``stack``); its URL."""
    if cfg.metrics_port is None:
        return None
    mhost = cfg.metrics_host or cfg.listen_host
    try:
        http, mport = start_http(metrics, mhost, cfg.metrics_port, metrics_authorizer(cfg, auth))
    except OSError as err:
        raise ConfigError(f"cannot serve metrics on {mhost}:{cfg.metrics_port}: {err}") from err
    stack.callback(http.server_close)
    stack.callback(http.shutdown)
    return f"http://{mhost}:{mport}/metrics"


def run(cfg: ServerConfig) -> int:
    tune_malloc()
    harden_process()
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return asyncio.run(serve(cfg))
    finally:
        # Shut down already: a late SIGTERM must not turn exit 0 into death by signal while
        # the interpreter tears down (which resets Python-level handlers to SIG_DFL).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


__all__ = ["credentials", "grpc_options", "harden_process", "plan_tenants", "run", "serve", "write_ready"]
