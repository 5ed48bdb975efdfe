"""Copy completion: ``CopyEvent`` and the ``Device`` protocol every copy engine follows.

Two completion styles, and callers must handle both:

* host-style events complete on the copy thread, which runs the callbacks;
* stream-style events (``StreamCopyEvent``: CUDA and its emulation) complete only when
  somebody observes them through ``query()``, ``wait()`` or ``Device.synchronize()``; the
  callbacks then run on the observing thread.

A callback that raises is logged and counted on its event (``callback_error``, ``ok`` is
then False); it never kills the thread that observed the completion.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("kvstore.connector")

Job = Callable[[], None]
Callback = Callable[["CopyEvent"], None]


class CopyEvent:
    """Completion of one submitted copy.  ``error`` is set when the copy raised;
    ``callback_error`` when a completion callback raised (the event is then not ``ok``)."""

    __slots__ = ("_done", "_fired", "error", "callback_error", "_callbacks", "_lock")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._fired = False
        self._lock = threading.Lock()  # guards _callbacks against a concurrent complete()
        self._callbacks: list[Callback] = []
        self.error: BaseException | None = None
        self.callback_error: BaseException | None = None

    def complete(self, error: BaseException | None = None) -> None:
        """Record the outcome, run the callbacks, then let waiters go: a ``wait()`` that
        returns True has seen every callback (e.g. the ticket's ``end_copy``) finish."""
        with self._lock:
            if self._fired:
                return
            self._fired, self.error = True, error
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            self._run(cb)
        self._done.set()

    def _run(self, cb: Callback) -> None:
        try:
            cb(self)
        except Exception as err:  # noqa: BLE001 - a callback must not kill the copy thread
            log.exception("kvstore: copy completion callback failed")
            if self.callback_error is None:
                self.callback_error = err

    def on_complete(self, cb: Callback) -> None:
        """Run ``cb(event)`` once the copy completed (at once if it already has)."""
        with self._lock:
            if not self._fired:
                self._callbacks.append(cb)
                return
        self._run(cb)

    @property
    def done(self) -> bool:
        """Completed and observed, callbacks run; unlike ``query()`` this observes nothing."""
        return self._done.is_set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once completed (check ``ok``); False on timeout."""
        return self._done.wait(timeout)

    @property
    def ok(self) -> bool:
        return self._done.is_set() and self.error is None and self.callback_error is None


class StreamCopyEvent(CopyEvent):
    """An event a stream reaches on its own, like ``torch.cuda.Event``: nothing calls back.
    The first ``query()``/``wait()`` that finds it reached completes it (running the
    callbacks on that thread) with the stream's error, if any."""

    __slots__ = ()

    def _reached(self) -> bool:
        raise NotImplementedError

    def _wait_reached(self, timeout: float | None) -> bool:
        raise NotImplementedError

    def _stream_error(self) -> BaseException | None:
        return None

    def query(self) -> bool:
        if not self._done.is_set() and self._reached():
            self.complete(self._stream_error())
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done.is_set():
            if not self._wait_reached(timeout):
                return False
            self.complete(self._stream_error())
        return self._done.wait(timeout)


class Device(Protocol):
    name: str

    def submit(self, job: Job) -> CopyEvent: ...

    def make_compute_wait(self, event: CopyEvent, timeout: float | None = None) -> bool: ...

    def synchronize(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...
