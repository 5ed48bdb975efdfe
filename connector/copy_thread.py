"""One thread that runs a copy device's work in submission order (worker side).

``HostDevice`` runs its copy jobs on one, ``EmulatedCudaDevice`` its stream.  The owner
``put``s items, and calls ``begin()`` once per item before it and ``finished()`` once the
item counts as done (which may be after ``run(item)`` returned: a test double can hold a
completion back); ``wait_idle`` waits until every begun item has finished, and ``close``
stops the thread once they have (``check_open`` then refuses new work).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CopyThread(Generic[T]):
    """A daemon thread calling ``run(item)`` for each item put, in order."""

    def __init__(self, name: str, run: Callable[[T], None]) -> None:
        self._run = run
        self._queue: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()  # guards _pending
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("copy device is closed")

    def begin(self) -> None:
        with self._idle:
            self._pending += 1

    def put(self, item: T) -> None:
        self._queue.put(item)

    def empty(self) -> bool:
        """No item waits for the thread (one may still be running)."""
        return self._queue.empty()

    def finished(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once every begun item has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 60.0, drain: Callable[[float], bool] | None = None) -> None:
        """Stop the thread once every begun item has finished (``drain(timeout)``, by default
        ``wait_idle``, says so); ``RuntimeError`` if they have not within ``timeout``
        (nothing is closed under them)."""
        if self.closed:
            return
        if not (drain or self.wait_idle)(timeout):
            raise RuntimeError(f"copy jobs still running after {timeout}s; not closing under them")
        self.closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(item)
