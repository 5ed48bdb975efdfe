"""A circuit breaker for network tiers (Redis, the store process).

While a backend is down, every request would otherwise wait out its own timeout.  The
breaker turns the first failure into "open": from then on calls fail fast (the tier answers
*miss*) and one background probe retries the backend every ``retry_s`` seconds; the first
successful probe closes the breaker again.

    CLOSED --failure--> OPEN --probe ok--> CLOSED
                         ^--probe fails--'

Only *transport* failures (connection refused or reset, timeouts) trip it; an answer the
server gave (an error reply, a miss) means the backend is up.  It is used from one event
loop; ``stats()`` may be read from any thread.  At most one probe loop runs at a time; a
breaker opened outside a running loop starts its probe at the first ``allow()`` inside one;
after ``aclose()`` no probe starts again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass

log = logging.getLogger("kvstore.breaker")


@dataclass(slots=True)
class BreakerStats:
    opened: int = 0  # CLOSED -> OPEN transitions
    closed: int = 0  # OPEN -> CLOSED transitions (backend came back)
    rejected: int = 0  # calls answered without touching the backend
    probes: int = 0  # background probes attempted
    failures: int = 0  # transport failures recorded


class CircuitBreaker:
    """``allow()`` before a call; ``failure(err)`` / ``success()`` after it."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], Awaitable[object]],
        *,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if retry_s <= 0:
            raise ValueError(f"retry_s must be positive, got {retry_s}")
        self.name = name
        self._probe = probe
        self.retry_s = retry_s
        self._clock = clock
        self._open_since: float | None = None
        self._last_error = ""
        self._task: asyncio.Task | None = None  # the one probe loop, while it runs
        self._closed = False
        self.counters = BreakerStats()

    @property
    def is_open(self) -> bool:
        return self._open_since is not None

    @property
    def last_error(self) -> str:
        return self._last_error

    def allow(self) -> bool:
        """True when a call may go to the backend; counts a rejection otherwise."""
        if self._open_since is None:
            return True
        self.counters.rejected += 1
        self._start_probe()  # opened outside a running loop: nobody is probing yet
        return False

    def success(self) -> None:
        if self._open_since is not None:
            self._close()

    def failure(self, err: BaseException) -> None:
        """Record a transport failure: open (once) and start the background probe."""
        self.counters.failures += 1
        self._last_error = f"{type(err).__name__}: {err}"
        if self._open_since is not None:
            return
        self._open_since = self._clock()
        self.counters.opened += 1
        log.warning("kvstore: %s is unavailable (%s); answering misses until it is back", self.name, self._last_error)
        self._start_probe()

    def _start_probe(self) -> None:
        """Start the probe loop unless one runs (it may outlive a close and a re-open)."""
        if self._closed or (self._task is not None and not self._task.done()):
            return
        with suppress(RuntimeError):  # no running loop: the first allow() inside one starts it
            self._task = asyncio.get_running_loop().create_task(self._probe_loop())

    def _close(self) -> None:
        down = self._clock() - (self._open_since or self._clock())
        self._open_since = None
        self.counters.closed += 1
        log.warning("kvstore: %s is back after %.1f s", self.name, down)

    async def _probe_loop(self) -> None:
        while self._open_since is not None:
            await asyncio.sleep(self.retry_s)
            if self._open_since is None:
                return
            self.counters.probes += 1
            try:
                await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - still down
                self._last_error = f"{type(err).__name__}: {err}"
                continue
            if self._open_since is not None:  # success() may have closed it meanwhile
                self._close()

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "breaker_open": float(self.is_open),
            "breaker_opened": c.opened,
            "breaker_closed": c.closed,
            "breaker_rejected": c.rejected,
            "breaker_probes": c.probes,
            "breaker_failures": c.failures,
        }
