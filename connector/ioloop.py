"""A private asyncio loop on a background thread, for the scheduler half's tier I/O.

The engine calls the connector synchronously; the tiers are async.  ``run`` blocks the
caller until a coroutine finishes (with a timeout); ``spawn`` starts one and returns a
``concurrent.futures.Future`` the scheduler polls, so slow reads (SSD) never block a step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class IOLoop:
    def __init__(self, name: str = "kvstore-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._spawned: set[concurrent.futures.Future] = set()  # not yet done
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self._lock:
            self._spawned.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._spawned.discard(fut)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        return self.spawn(coro).result(timeout)

    def drain(self, timeout: float = 60.0) -> None:
        """Wait for everything ``spawn``ed so far (write-throughs, prefetches) to finish.
        Tasks the tiers run for themselves (a circuit breaker's probe) are not waited for."""
        with self._lock:
            pending = set(self._spawned)
        if pending:
            concurrent.futures.wait(pending, timeout=timeout)

    def close(self, timeout: float = 30.0) -> None:
        if not self.loop.is_running():
            return
        self.drain(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
