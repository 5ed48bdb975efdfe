"""LMCache as a peer of ``kvstore bench e2e`` and ``kvstore bench serve``: its install into
this venv, its server, and the engine's connector config for it.

Host side.  ``ensure_lmcache()`` installs LMCache ``LMCACHE_VERSION`` by the recipe in docs/engines.md#peers
when it is missing; ``lmcache_server(log)`` runs its multiprocess server in its own process
group and yields the port.  Either raises ``PeerError`` with the error tail.
``connector_config(port)`` is the ``--kv-transfer-config`` that points an engine at that
server (``LMCacheMPConnector``); the engine runs with ``QUIET`` in its environment.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

LMCACHE_VERSION = "0.5.6"
# The recipe in docs/engines.md#peers plus the two flags 0.5.6 needs here: a legacy L1 config must name an
# eviction policy, and the metrics exporter needs a package the --no-deps install lacks.
LMCACHE_ARGS = (
    "--chunk-size",
    "256",
    "--l1-size-gb",
    "2",
    "--supported-transfer-mode",
    "auto",
    "--eviction-policy",
    "LRU",
    "--disable-metrics",
)
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


class PeerError(RuntimeError):
    """A peer could not be installed or started; the message carries the error tail."""


def connector_config(port: int) -> dict:
    """vLLM's ``kv_transfer_config`` for LMCache's multiprocess connector, its server on ``port``."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port},
    }


def ensure_lmcache() -> None:
    """The recipe in docs/engines.md#peers, into this interpreter's venv: lmcache without its dependencies
    (so the CPU torch stays), then the two it needs here."""
    from importlib import metadata

    try:
        if metadata.version("lmcache") == LMCACHE_VERSION and all(
            importlib.util.find_spec(m) for m in ("sortedcontainers", "aiofile")
        ):
            return
    except metadata.PackageNotFoundError:
        pass
    print(f"  installing lmcache=={LMCACHE_VERSION} into {sys.prefix} ...", flush=True)
    _pip("install", "--no-deps", f"lmcache=={LMCACHE_VERSION}")
    _pip("install", "sortedcontainers", "aiofile")


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PeerError(f"{' '.join(cmd)}: {err}") from err
    if proc.returncode != 0:
        raise PeerError(f"{' '.join(cmd)} exited with {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")


@contextmanager
def lmcache_server(
    log: Path, timeout_s: float = 120, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> Iterator[int]:
    """The LMCache MP server on a free localhost port, in its own process group; yields the
    port once it accepts connections and stops the group on exit.  ``extra_args`` follow
    ``LMCACHE_ARGS`` (``--l2-adapter JSON``...); ``env`` replaces ``os.environ`` (a PYTHONPATH
    that finds LMCache outside this venv: ``.venv-lmcache``)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "lmcache.v1.multiprocess.server",
        "--host",
        "localhost",
        "--port",
        str(port),
        *LMCACHE_ARGS,
        *extra_args,
    ]
    base = os.environ if env is None else env
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True, env={**base, **QUIET})
    try:
        _wait_listening(proc, port, log, timeout_s)
        yield port
    finally:
        _stop(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerError(f"server exited with {proc.returncode}\n{_log_tail(log)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise PeerError(f"server not listening on port {port} after {timeout_s:g} s\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _log_tail(log: Path, n: int = 3000) -> str:
    return log.read_bytes()[-n:].decode(errors="replace")
