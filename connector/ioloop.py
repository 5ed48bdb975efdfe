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
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        return self.spawn(coro).result(timeout)

    def drain(self, timeout: float = 60.0) -> None:
        """Wait for every task spawned so far (write-throughs) to finish."""
        pending = self.run(_pending_tasks(), timeout)
        if pending:
            self.run(asyncio.wait(pending, timeout=timeout), timeout + 5)

    def close(self, timeout: float = 30.0) -> None:
        if not self.loop.is_running():
            return
        self.drain(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


async def _pending_tasks() -> set[asyncio.Task]:
    me = asyncio.current_task()
    return {t for t in asyncio.all_tasks() if t is not me}
