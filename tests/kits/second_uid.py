"""Running test code as a second, unprivileged uid on the same host (test side; the tests run as root).

``NOBODY`` is uid/gid 65534.  ``tenant_user(name)`` is the (uid, gid) of a system user ``kvs-<name>``
(``useradd --system --no-create-home --user-group``), created when missing: idempotent, and safe when
two test processes create it at once (the loser of the race finds the winner's user).  ``run_as`` runs
a Python snippet in a child that drops every group, then its gid, then its uid (never root), and returns
the finished process; ``json_as`` expects the snippet to print one JSON line last and returns it parsed.

What the snippet imports is loaded before the drop, as root (``preload``): the interpreter's own files
may lie where another uid cannot read them (under /root).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping

NOBODY = 65534
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PRELOAD = (
    "json",
    "socket",
    "grpc",
    "zmq",
    "numpy",
    "kvstore._proto.kvstore_pb2",
    "kvstore._proto.kvstore_pb2_grpc",
    "kvstore.localtoken",
)


def tenant_user(name: str) -> tuple[int, int]:
    """(uid, gid) of the system user ``kvs-<name>``, created (no home, no login) when missing."""
    user = f"kvs-{name}"
    for _ in range(20):
        try:
            entry = pwd.getpwnam(user)
            return entry.pw_uid, entry.pw_gid
        except KeyError:
            pass
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", user],
            capture_output=True,
            text=True,
            timeout=60,
        )
        time.sleep(0.05)  # lost a race or /etc/passwd was locked: look again
    raise RuntimeError(f"cannot create the test user {user} (useradd failed twenty times)")


def _drop(uid: int, gid: int) -> str:
    """The code that becomes ``uid``/``gid``.  The uid change leaves the process non-dumpable (its /proc
    files root's); it is made dumpable again, as a process the user started itself would be."""
    return (
        f"import ctypes, os\nos.setgroups([])\nos.setgid({gid})\nos.setuid({uid})\n"
        "ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)\n"
    )  # PR_SET_DUMPABLE, 1


def run_as(
    uid: int,
    gid: int,
    code: str,
    preload: Iterable[str] = DEFAULT_PRELOAD,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """Run ``code`` as ``uid``/``gid`` with no supplementary groups; the finished process (text output)."""
    if uid == 0 or gid == 0:
        raise ValueError("run_as runs code as an unprivileged uid: never 0")
    prelude = "".join(f"import {module}\n" for module in preload)
    prelude += _drop(uid, gid)
    prelude += f"assert os.getuid() == os.geteuid() == {uid} and os.getgroups() in ([], [{gid}])\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        cwd="/",
    )


def json_as(
    uid: int, gid: int, code: str, preload: Iterable[str] = DEFAULT_PRELOAD, env: Mapping[str, str] | None = None
) -> dict:
    """Run ``code`` (which prints one JSON line last) as ``uid``/``gid``; that line, parsed."""
    run = run_as(uid, gid, code, preload, env)
    assert run.returncode == 0, f"the child of uid {uid} failed: {run.stderr[-2000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def spawn_as(uid: int, gid: int, code: str, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``code`` as ``uid``/``gid`` (no other groups) and return at once: a long-lived second process."""
    if uid == 0 or gid == 0:
        raise ValueError("spawn_as runs code as an unprivileged uid: never 0")
    prelude = _drop(uid, gid)
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        cwd="/",
    )
