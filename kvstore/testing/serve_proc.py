"""A real ``kvstore serve`` child process, for tests and ``kvstore bench store``.

Runs in the test or benchmark process and owns one child:

* ``StoreProcess(workdir, *args, env=None)`` remembers the arguments; ``start(timeout)`` runs
  ``python -m kvstore serve --listen 127.0.0.1:0 --ready-file <workdir>/ready-<n> *args``
  with stdout and stderr in ``<workdir>/serve-<n>.log`` and returns once the ready file
  names the bound ``host:port``; if the child exits first or the timeout passes it raises
  ``TierError`` with the log tail (and kills the child).
* ``target`` is ``"127.0.0.1:PORT"``; ``metrics_url`` the ``/metrics`` address when the
  child was given ``--metrics-port``; ``pid`` the child's pid.
* ``kill()`` is SIGKILL, ``terminate(timeout)`` SIGTERM (the graceful shutdown) and returns
  the exit code; both wait for the child.  ``restart()`` stops a running child gracefully
  and starts a new one with the same arguments (a NEW port: ``target`` updates).
* ``log_text()`` is everything the current child printed.  A context manager: the child is
  stopped (SIGTERM, then SIGKILL after 10 s) on exit, and killed when the object is garbage-collected.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

from kvstore.errors import TierError

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its kvstore package, not an installed one
_METRICS_RE = re.compile(r"metrics (http://\S+/metrics)")


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class StoreProcess:
    """One ``kvstore serve`` child (see the module docstring)."""

    def __init__(self, workdir: Path, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.args = tuple(args)
        self.env = dict(env) if env is not None else None
        self.target = ""
        self.metrics_url: str | None = None
        self._proc: subprocess.Popen | None = None
        self._log: Path | None = None
        self._runs = 0
        self._finalizer: weakref.finalize | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("store process not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 20.0) -> StoreProcess:
        if self.running:
            raise RuntimeError(f"store process {self.pid} is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._runs += 1
        ready = self.workdir / f"ready-{self._runs}"
        ready.unlink(missing_ok=True)
        self._log = self.workdir / f"serve-{self._runs}.log"
        cmd = [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--ready-file",
            str(ready),
            *self.args,
        ]
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True
            )
        self._finalizer = weakref.finalize(self, _reap, self._proc)
        self.target = self._wait_ready(self._proc, ready, timeout)
        match = _METRICS_RE.search(self.log_text())
        self.metrics_url = match.group(1) if match else None
        return self

    def _wait_ready(self, proc: subprocess.Popen, ready: Path, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready.exists():
                text = ready.read_text().strip()
                if text and "listening on" in self.log_text():
                    return text
            if proc.poll() is not None:
                raise TierError(
                    f"kvstore serve exited with code {proc.returncode} before it was ready:\n{self.log_tail()}"
                )
            time.sleep(0.02)
        self.kill()
        raise TierError(f"kvstore serve was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL, then wait: the port refuses connections when this returns."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful shutdown) and its exit code; SIGKILL after ``timeout``."""
        if self._proc is None:
            raise RuntimeError("store process not started")
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self._proc.returncode

    def restart(self, timeout: float = 20.0) -> StoreProcess:
        if self.running:
            self.terminate()
        return self.start(timeout)

    def log_text(self) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return self._log.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> StoreProcess:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.running:
            self.terminate(timeout=10.0)


__all__ = ["StoreProcess"]
