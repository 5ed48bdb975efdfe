"""Real ``kvstore serve`` processes for a test module: ``StoreFactory`` (behind the
``store_process`` fixture of tests/conftest.py) starts each with its flags in a fresh work
directory and, at teardown, stops every one and checks it shut down gracefully (exit 0).

    @pytest.fixture(scope="module")
    def store(store_process):
        return store_process("--host-capacity", "256MiB", "--ssd-dir", "{work}/ssd", tokens=TOKENS)

``{work}`` in a flag is the process's work directory; ``tokens`` (entries as in a tokens
file) writes one there and adds ``--auth-tokens``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.testing.serve_proc import StoreProcess
from tests.kits.store_calls import write_tokens


class StoreFactory:
    def __init__(self, mktemp: Callable[[str], Path]) -> None:
        self._mktemp = mktemp
        self.started: list[StoreProcess] = []

    def __call__(self, *flags: str, tokens: Sequence[dict] | None = None, name: str = "store") -> StoreProcess:
        work = self._mktemp(name)
        args = [flag.replace("{work}", str(work)) for flag in flags]
        if tokens is not None:
            args += ["--auth-tokens", str(write_tokens(work / "tokens.yaml", tokens))]
        proc = StoreProcess(work, *args)
        self.started.append(proc)
        return proc.start()

    def stop_all(self) -> list[int | None]:
        """Stop every store started (SIGTERM, then a graceful wait); their exit codes."""
        return [proc.terminate(30) for proc in reversed(self.started)]
