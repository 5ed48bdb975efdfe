"""Tokens stay secret around the store's API (issue 22): a real ``kvstore serve`` never prints
one, even when its tokens file is malformed; an inline token there starts the server with a
warning that says how to convert it; and a second, unprivileged uid can read neither a
tenant's token file written by ``kvstore tokens`` nor a client's token through ``/proc``.

Cost: about 5 s (two short store processes, a few subprocesses as uid 65534).
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvstore.errors import TierError
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.second_uid import NOBODY, run_as

SECRET = "tok-a-never-in-any-log-5e1d"


def as_nobody(code: str) -> str:
    """Run ``code`` as uid/gid 65534 (an unprivileged user, never root); its stdout."""
    run = run_as(NOBODY, NOBODY, code, preload=())
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_a_malformed_tokens_file_fails_the_server_without_printing_its_tokens(tmp_path):
    bad = tmp_path / "tokens.yaml"
    bad.write_text(f'tokens:\n  - {{token: "{SECRET}", tenant: a, permissions: [read]\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--auth-tokens",
            str(bad),
            "--host-capacity",
            "16MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "is not valid YAML" in proc.stderr + proc.stdout
    assert SECRET not in proc.stderr + proc.stdout


def test_an_inline_token_starts_the_server_with_a_warning_and_is_never_printed(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens:\n  - {{token: {SECRET}, tenant: a, permissions: [read, write]}}\n")
    store = StoreProcess(tmp_path, "--auth-tokens", str(tokens), "--host-capacity", "16MiB")
    try:
        store.start()
        log = store.log_text()
    except TierError as err:
        raise AssertionError(str(err)) from err
    finally:
        store.terminate()
    assert "an inline token" in log and "sha256:" in log
    assert SECRET not in log


def test_another_uid_reads_neither_a_token_file_nor_a_clients_environment(tmp_path):
    os.chmod(tmp_path, 0o755)
    out = tmp_path / "tokens"
    subprocess.run(
        [sys.executable, "-m", "kvstore", "tokens", "--dir", str(out), "--tenant", "a=read,write"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    os.chmod(out, 0o755)  # even opened up, the files themselves are 0600
    token_files = [p for p in out.iterdir() if p.name.endswith(".token")]
    assert token_files, sorted(p.name for p in out.iterdir())
    # A client holding the token in its environment (works, with a warning; below: /proc).
    client = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "KVSTORE_STORE_TOKEN": SECRET}
    )
    try:
        probe = (
            f"for p in {[str(p) for p in token_files]!r} + ['/proc/{client.pid}/environ']:\n"
            "    try:\n        open(p, 'rb').read()\n    except PermissionError:\n        print('denied')\n"
            "    else:\n        print('READ', p)\n"
        )
        assert as_nobody(probe).split("\n") == ["denied"] * (len(token_files) + 1)
    finally:
        client.kill()
        client.wait()
