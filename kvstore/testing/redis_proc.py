"""A real ``redis-server`` process on a free port: plain, with a password or ACL user, TLS.

Used by the Redis tier's tests (fixtures in ``tests/conftest.py``) and by ``kvstore bench
redis``; it runs in the test or benchmark process and starts its own children.

Contract:
  * ``RedisServer(directory, ...)`` owns one ``redis-server`` child.  Its options are written
    to ``<directory>/redis.conf`` (mode 0600, so a password is not visible in ``ps``); the
    server logs to ``<directory>/redis.log`` and anything printed before the log opens goes
    to ``<directory>/redis.out``.  Every server binds 127.0.0.1 with ``protected-mode no``,
    ``daemonize no``, ``save ""`` (no RDB) and ``appendonly no`` unless asked.
  * ``start()`` returns once the server answers PING, or raises ``TierError`` with the log
    tail; it polls with short timeouts and never waits past its ``timeout``.  A port picked
    here that lost an "Address already in use" race is replaced once; a port given by the
    caller (and the port of any later ``restart()``) is never changed.
  * ``kill()`` is SIGKILL, ``stop()`` is SIGTERM (Redis's graceful shutdown), each followed by
    a wait, so the port refuses connections when they return.  A server not stopped by its
    owner is killed when it is garbage-collected or at interpreter exit (``weakref.finalize``).
  * ``free_port()`` and ``free_cluster_port()`` (a port whose cluster bus port, +10000, is free
    too) pick ports on 127.0.0.1; ``RedisServer(..., cluster=True)`` is one node of a
    ``kvstore.testing.redis_cluster.RedisClusterProcs``.
  * ``make_tls_files`` builds a CA, a server certificate (SAN IP:127.0.0.1, DNS:localhost) and
    a client certificate with the ``openssl`` command.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.errors import ConfigError, TierError
from kvstore.testing.tls_files import TLSFiles, make_tls_files

__all__ = ["HOST", "RedisServer", "TLSFiles", "free_cluster_port", "free_port", "make_tls_files"]

HOST = "127.0.0.1"
_CONF, _LOG, _OUT = "redis.conf", "redis.log", "redis.out"
_BUS_OFFSET = 10000  # a cluster node's bus listens on port + 10000
_CLUSTER_PORTS = (15000, 22000)  # bus ports land in 25000..32000, below Linux's ephemeral range
_POLICIES = frozenset(
    {
        "noeviction",
        "allkeys-lru",
        "allkeys-lfu",
        "allkeys-random",
        "volatile-lru",
        "volatile-lfu",
        "volatile-random",
        "volatile-ttl",
    }
)
_STOP_WAIT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def free_cluster_port() -> int:
    """A port P where both P and its cluster bus port P + 10000 are free right now."""
    for _ in range(200):
        port = random.randint(*_CLUSTER_PORTS)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((HOST, port))
                b.bind((HOST, port + _BUS_OFFSET))
        except OSError:
            continue
        return port
    raise TierError(f"no free port pair (P, P+{_BUS_OFFSET}) found in {_CLUSTER_PORTS}")


# --------------------------------------------------------------------------- one server


def _quote(value: str) -> str:
    """A double-quoted redis.conf argument: anything but plain printable ASCII as \\xHH."""
    out = (ch if " " <= ch <= "~" and ch not in '"\\' else "".join(f"\\x{b:02x}" for b in ch.encode()) for ch in value)
    return '"' + "".join(out) + '"'


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """Last resort for a server its owner forgot: SIGKILL and reap."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class RedisServer:
    """One ``redis-server`` child on 127.0.0.1 (see the module docstring for the contract)."""

    host: str = HOST

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        password: str | None = None,
        username: str | None = None,
        maxmemory: str | int | None = None,
        maxmemory_policy: str | None = None,
        tls: TLSFiles | None = None,
        tls_auth_clients: bool = False,
        appendonly: bool = False,
        cluster: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        if username is not None and password is None:
            raise ConfigError(f"username {username!r} needs a password")
        if tls_auth_clients and tls is None:
            raise ConfigError("tls_auth_clients=True needs tls=TLSFiles(...)")
        if maxmemory_policy is not None and maxmemory_policy not in _POLICIES:
            raise ConfigError(f"maxmemory_policy {maxmemory_policy!r} is not one of {sorted(_POLICIES)}")
        top = 65535 - (_BUS_OFFSET if cluster else 0)
        if port is not None and not 0 < port <= top:
            raise ConfigError(f"port {port} is outside 1..{top}")
        self.directory = Path(directory).resolve()
        self.password, self.username = password, username
        self.maxmemory, self.maxmemory_policy = maxmemory, maxmemory_policy
        self.tls, self.tls_auth_clients = tls, tls_auth_clients
        self.appendonly, self.cluster = appendonly, cluster
        self.extra_args = tuple(extra_args)
        self._auto_port = port is None  # only a port picked here may be replaced after a race
        self.port: int = port if port is not None else self._pick_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    @property
    def url_with_auth(self) -> str:
        if self.password is None:
            return self.url
        scheme, rest = self.url.split("://", 1)
        user, password = quote(self.username or "", safe=""), quote(self.password, safe="")
        return f"{scheme}://{user}:{password}@{rest}"

    def connection_kwargs(self) -> dict[str, Any]:
        """Credentials and TLS options for a redis-py client of this server."""
        kw: dict[str, Any] = {"password": self.password, "username": self.username}
        if self.tls is not None:
            kw.update(ssl=True, ssl_ca_certs=str(self.tls.ca_cert), ssl_cert_reqs="required")
            if self.tls_auth_clients:
                kw.update(ssl_certfile=str(self.tls.client_cert), ssl_keyfile=str(self.tls.client_key))
        return kw

    def client(self, **kw: Any) -> redis.Redis:
        """A sync client with the right credentials and TLS; no retries, 2 s/5 s timeouts.
        Keyword arguments override any of these."""
        opts: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "socket_timeout": 5.0,
            "socket_connect_timeout": 2.0,
            "retry": Retry(NoBackoff(), 0),
            **self.connection_kwargs(),
        }
        return redis.Redis(**{**opts, **kw})

    def info(self, section: str | None = None) -> dict[str, Any]:
        with self.client() as c:
            return dict(c.info(section) if section else c.info())

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Spawn the server and return once it answers PING; ``TierError`` otherwise."""
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        exe = shutil.which("redis-server")
        if exe is None:
            raise TierError("the 'redis-server' command is not on PATH")
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            self._spawn(exe)
            reason = self._await_ping(deadline, timeout)
            if reason is None:
                self._auto_port = False  # restart() keeps this port
                return self
            self.kill()
            tail = self.log_tail()
            if attempt == 1 and self._auto_port and "Address already in use" in tail:
                self.port = self._pick_port()
                continue
            raise TierError(
                f"redis-server on {self.host}:{self.port} ({self.directory}) {reason}; last log lines:\n{tail}"
            )
        raise AssertionError("unreachable")

    def kill(self) -> None:
        """SIGKILL and wait: the port refuses connections when this returns."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM (Redis's graceful shutdown; it flushes the AOF) and wait; SIGKILL after 10 s."""
        self._end(signal.SIGTERM)

    def restart(self, timeout: float = 10.0) -> None:
        """Stop if running, then start again on the same port, directory and options."""
        self.stop()
        self.start(timeout)

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of the server's stdout/stderr and of its log."""
        parts = [
            f"[{f.name}]\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:])
            for f in (self.directory / _OUT, self.directory / _LOG)
            if f.exists() and f.stat().st_size > 0
        ]
        return "\n".join(parts) or "(no log output)"

    def __enter__(self) -> RedisServer:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _pick_port(self) -> int:
        return free_cluster_port() if self.cluster else free_port()

    def _config_lines(self) -> list[str]:
        d = self.directory
        conf = [
            f"bind {HOST}",
            "protected-mode no",
            "daemonize no",
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            f"dir {_quote(str(d))}",
            f"logfile {_quote(str(d / _LOG))}",
        ]
        if self.tls is None:
            conf.append(f"port {self.port}")
        else:
            t = self.tls
            conf += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {_quote(str(t.cert))}",
                f"tls-key-file {_quote(str(t.key))}",
                f"tls-ca-cert-file {_quote(str(t.ca_cert))}",
                f"tls-auth-clients {'yes' if self.tls_auth_clients else 'no'}",
            ]
            if self.cluster:
                conf.append("tls-cluster yes")
        if self.password is not None and self.username is None:
            conf.append(f"requirepass {_quote(self.password)}")
        elif self.password is not None:
            conf += [
                "user default off",
                f"user {_quote(self.username or '')} on {_quote('>' + self.password)} ~* &* +@all",
            ]
        if self.maxmemory is not None:
            conf.append(f"maxmemory {_quote(str(self.maxmemory))}")
        if self.maxmemory_policy is not None:
            conf.append(f"maxmemory-policy {self.maxmemory_policy}")
        if self.cluster:
            conf += [
                "cluster-enabled yes",
                f"cluster-config-file nodes-{self.port}.conf",
                "cluster-node-timeout 2000",
                "cluster-require-full-coverage no",
            ]
        return conf

    def _spawn(self, exe: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / _CONF
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(self._config_lines()) + "\n")
        for old in (self.directory / _LOG, self.directory / _OUT):  # a tail shows this run only
            if old.exists():
                old.replace(old.with_name(old.name + ".prev"))
        with open(self.directory / _OUT, "wb") as out:
            self._proc = subprocess.Popen(
                [exe, str(conf), *self.extra_args],
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._finalizer = weakref.finalize(self, _terminate, self._proc)

    def _await_ping(self, deadline: float, timeout: float) -> str | None:
        """None once PING answers; otherwise why not (exited, auth refused, timed out)."""
        assert self._proc is not None
        while True:
            rc = self._proc.poll()
            if rc is not None:
                return f"exited with status {rc} during start-up"
            try:
                with self.client(socket_connect_timeout=0.25, socket_timeout=0.5) as c:
                    if c.ping():
                        return None
            except redis.AuthenticationError as err:
                return f"refused the configured credentials: {err}"
            except (
                redis.ConnectionError,
                redis.TimeoutError,
                redis.BusyLoadingError,
                OSError,
            ) as err:  # not listening yet, or still loading its data
                if "certificate verify failed" in str(err):  # will not get better by waiting
                    return f"presented a certificate the client rejects: {err}"
            if time.monotonic() >= deadline:
                return f"did not answer PING within {timeout:g} s"
            time.sleep(0.02)

    def _end(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
