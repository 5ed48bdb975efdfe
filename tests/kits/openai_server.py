"""The pytest side of vLLM's OpenAI server (``harness.openai_server`` has the server itself).

Test side.  ``tests/conftest.py`` builds its fixtures on this: ``openai_servers`` (a factory:
every server made is stopped at teardown), ``openai_reference_server`` (a session-wide
connector-less server with prefix caching off: pure recompute), and a report hook that
appends every server's log tail to a failing test's report (``attach_log_tails``).  The names
of ``harness.openai_server`` are re-exported, so tests import them from here as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from harness.openai_server import (
    HOST,
    LOG_TAIL_CHARS,
    MODULE,
    Completion,
    OpenAIServer,
    ServerError,
    checkpoint_dtype,
    free_port,
    max_in_flight,
    parse_completion,
)

__all__ = [
    "HOST",
    "LOG_TAIL_CHARS",
    "MODULE",
    "Completion",
    "OpenAIServer",
    "ServerError",
    "attach_log_tails",
    "checkpoint_dtype",
    "free_port",
    "max_in_flight",
    "parse_completion",
]


def attach_log_tails(report, servers: Iterable[OpenAIServer]) -> None:
    """Append each server's log tail to a failed test report (shown with the failure)."""
    if not report.failed:
        return
    for server in servers:
        for log in server.logs[-2:]:  # a restart's failure often needs the previous log too
            if log.exists():
                tail = log.read_bytes()[-LOG_TAIL_CHARS:].decode(errors="replace")
                report.sections.append((f"openai server {server.name}: tail of {log}", tail))
