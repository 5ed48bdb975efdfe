"""A private asyncio loop on a background thread, for the scheduler half's tier I/O.

The engine calls the connector synchronously; the tiers are async.  ``run`` blocks the
caller until a coroutine finishes (with a timeout); ``spawn`` starts one and returns a
``concurrent.futures.Future`` the scheduler polls, so slow reads (SSD) never block a step.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("kvstore.connector")


def call_before_exit(method) -> None:
    """Call the bound ``method`` when the interpreter starts exiting, while threads and
    ``concurrent.futures`` still take work: atexit handlers and ``weakref.finalize`` (vLLM's
    engine shutdown) run only after ``concurrent.futures`` has started refusing new work, which
    fails every tier read or write that needs a thread.  The object is held weakly: a closed
    and dropped one is not kept alive, and is skipped."""
    ref = weakref.WeakMethod(method)

    def hook() -> None:
        fn = ref()
        if fn is None:
            return
        try:
            fn()
        except Exception:  # noqa: BLE001 - the process is exiting: log, never mask the exit
            log.exception("kvstore: flush at exit failed")

    register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9: before the pools stop
    try:
        if register is None:
            raise RuntimeError("no threading exit hooks")
        register(hook)
    except RuntimeError:  # already shutting down, or another interpreter
        atexit.register(hook)


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

    def later(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop like ``spawn``, but ``drain`` does not wait for it (work
        timed for later, such as a resume prefetch: its owner cancels it before a close)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

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
